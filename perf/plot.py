"""A chart and a table from engine benchmark results (the JSON lines of ``bench_engine.py``).

    python perf/plot.py perf/h200-2026-11-30/session6/1156a68-engine.jsonl --png out.png --md out.md

Rounds. ``bench_engine.py --rounds N`` (and ``--interleave``) writes every case once per
round, each row with its ``round``; a shared host drifts between rounds, so a ratio is
only taken between rows of the same round (the case's req/s over the base row's of that
round), and a case's figure is the median over its rounds: req/s, latencies and the
fraction of the GEMM rate are medians of the rounds' values, "× base" and "× hotswap" the
medians of the same-round ratios. Rows without ``round`` (older files) are round 0.

Latency. The engine modes (base, manylora, peft-mixed) time whole batches of ``batch``
requests; hotswap serves one request at a time and times requests. The two are never on
one axis: the chart has a panel per definition, each labelled, and the table says which
one each row's p50/p95/p99 are.

* PNG (matplotlib, ``pip install 'manylora[plot]'``): req/s, × base, and p95 latency
  against adapters in flight, log x; the no-adapter base is a dashed line.
* Markdown: one row per case (mode, adapters, distribution): req/s, p50/p95/p99, × base,
  × hotswap, the fraction of the dense GEMM rate ("–" for runs older than that field),
  what the latency times, and the rounds when a file has several.

Without ``--png`` or ``--md`` the table is printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Optional

PER_REQUEST_MODES = {"hotswap"}  # modes whose latencies time single requests, not batches


# ---------------------------------------------------------------- data


def load(paths) -> list[dict]:
    """One run per file: {"source", "rows" (measurements), "gemm" (the gemm_rate line or None)}."""
    paths = [Path(p) for p in paths]
    names = [p.name for p in paths]
    runs = []
    for path in paths:
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        source = path.name if names.count(path.name) == 1 else f"{path.parent.name}/{path.name}"
        rows = [r for r in lines if r.get("mode") != "gemm_rate" and "req_per_s" in r and "batch_p95_ms" in r]
        runs.append(
            {"source": source, "rows": rows, "gemm": next((r for r in lines if r.get("mode") == "gemm_rate"), None)}
        )
    return runs


def _round(row: dict) -> int:
    return row.get("round") or 0


def _key(row: dict) -> tuple:
    adapters = row.get("adapters_in_flight") or 0
    return (row["mode"], adapters, row.get("distribution", "-") if adapters else "-")


def _fraction(row: dict, gemm: Optional[dict]) -> Optional[float]:
    if row.get("fraction_of_gemm_rate") is not None:
        return row["fraction_of_gemm_rate"]
    if gemm and row.get("flops_per_request"):
        return row["flops_per_request"] * row["req_per_s"] / 1e12 / gemm["tflops"]
    return None


def _median(values) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _same_round(rows: list[dict], row: dict, mode: str) -> Optional[dict]:
    """The ``mode`` row of ``row``'s round: the base row, or the row at the same adapters in
    flight (the same distribution where there is one)."""
    candidates = [r for r in rows if r["mode"] == mode and _round(r) == _round(row)]
    if mode != "base":
        candidates = [r for r in candidates if r.get("adapters_in_flight") == row.get("adapters_in_flight")]
        same = [r for r in candidates if r.get("distribution") == row.get("distribution")]
        candidates = same or candidates
    return candidates[0] if candidates else None


def latency_kind(entry: dict) -> str:
    if entry["mode"] in PER_REQUEST_MODES:
        return "request"
    return f"batch of {entry['batch']}" if entry.get("batch") else "batch"


def table(runs: list[dict]) -> list[dict]:
    """One entry per case and file, in the order cases first appear: medians over rounds."""
    out = []
    for run in runs:
        rows = run["rows"]
        cases: dict[tuple, list[dict]] = {}
        for row in rows:
            cases.setdefault(_key(row), []).append(row)
        for (mode, adapters, distribution), case in cases.items():

            def ratio(row, other_mode):
                other = _same_round(rows, row, other_mode)
                return row["req_per_s"] / other["req_per_s"] if other and other is not row else None

            out.append(
                {
                    "source": run["source"],
                    "mode": mode,
                    "adapters": adapters,
                    "distribution": distribution,
                    "rounds": len({_round(r) for r in case}),
                    "batch": case[0].get("batch"),
                    "req_per_s": _median(r["req_per_s"] for r in case),
                    "p50": _median(r.get("batch_p50_ms") for r in case),
                    "p95": _median(r["batch_p95_ms"] for r in case),
                    "p99": _median(r.get("batch_p99_ms") for r in case),
                    "x_base": None if mode == "base" else _median(ratio(r, "base") for r in case),
                    "x_hotswap": None if mode == "hotswap" else _median(ratio(r, "hotswap") for r in case),
                    "fraction_of_gemm": _median(_fraction(r, run["gemm"]) for r in case),
                }
            )
            if mode == "base":
                out[-1]["x_base"] = 1.0
            if mode == "hotswap":
                out[-1]["x_hotswap"] = 1.0
    return out


def markdown(entries: list[dict]) -> str:
    several = len({e["source"] for e in entries}) > 1
    rounds = any(e["rounds"] > 1 for e in entries)

    def num(value, fmt):
        return "–" if value is None else format(value, fmt)

    head = ["mode", "adapters", "distribution", "req/s", "p50 (ms)", "p95 (ms)", "p99 (ms)", "× base", "× hotswap"]
    head += ["of GEMM rate", "latency of"]
    if rounds:
        head.append("rounds")
    if several:
        head.insert(0, "run")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in entries:
        cells = [e["mode"], str(e["adapters"]), e["distribution"], num(e["req_per_s"], ".1f")]
        cells += [num(e["p50"], ".1f"), num(e["p95"], ".1f"), num(e["p99"], ".1f")]
        cells += [num(e["x_base"], ".2f"), num(e["x_hotswap"], ".1f"), num(e["fraction_of_gemm"], ".2%")]
        cells.append(latency_kind(e))
        if rounds:
            cells.append(str(e["rounds"]))
        if several:
            cells.insert(0, e["source"])
        lines.append("| " + " | ".join(cells) + " |")
    notes = ["", "Medians over rounds; × base and × hotswap: the median of ratios within each round."]
    return "\n".join(lines + (notes if rounds else [])) + "\n"


def series(entries: list[dict]) -> dict:
    """What the chart draws, from ``table()``'s entries: lines by adapters in flight per
    (mode, distribution[, file]) and the base's level, per quantity."""
    several = len({e["source"] for e in entries}) > 1
    lines: dict[str, list[dict]] = {}
    bases: dict[str, dict] = {}
    for e in entries:
        suffix = f" [{e['source']}]" if several else ""
        if e["mode"] == "base" or not e["adapters"]:
            bases[f"{e['mode']}{suffix}"] = e
        else:
            lines.setdefault(f"{e['mode']} {e['distribution']}{suffix}", []).append(e)
    for points in lines.values():
        points.sort(key=lambda e: e["adapters"])
    return {"lines": lines, "bases": bases}


# ---------------------------------------------------------------- PNG


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(
            "perf/plot.py --png needs matplotlib: pip install 'manylora[plot]' (or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_png(path: Path, chart: dict) -> None:
    """Draw ``series()``'s chart into ``path`` (matplotlib, imported here)."""
    plt = _pyplot()
    from matplotlib.ticker import FuncFormatter

    lines, bases = chart["lines"], chart["bases"]
    everything = [e for points in lines.values() for e in points] + list(bases.values())
    batches = sorted({e["batch"] for e in everything if e["mode"] not in PER_REQUEST_MODES and e.get("batch")})
    batch_label = f"batch of {batches[0]} requests" if len(batches) == 1 else "batch"
    panels = [("req_per_s", "throughput (req/s)", None, True)]
    if any(e["x_base"] is not None for points in lines.values() for e in points):
        panels.append(("x_base", "× base req/s (same-round ratio)", None, False))
    panels.append(("p95", f"p95 latency per {batch_label} (ms)", False, True))
    if any(e["mode"] in PER_REQUEST_MODES for e in everything):
        panels.append(("p95", "p95 latency per request (ms), one at a time", True, True))
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 3.2 * len(panels)), sharex=True, squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (field, title, per_request, log_y) in zip(axes[:, 0], panels):
        for i, (label, points) in enumerate(lines.items()):
            if per_request is not None and (points[0]["mode"] in PER_REQUEST_MODES) != per_request:
                continue
            drawn = [e for e in points if e[field] is not None]
            if drawn:
                xs, ys = [e["adapters"] for e in drawn], [e[field] for e in drawn]
                ax.plot(xs, ys, "o-", color=colours[i % len(colours)], label=label)
        for j, (label, base) in enumerate(bases.items()):
            if per_request or base[field] is None:
                continue
            colour = colours[(len(lines) + j) % len(colours)]
            ax.axhline(base[field], linestyle="--", color=colour, label=f"{label} (no adapter)")
        ax.set_xscale("log")
        if log_y:
            ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_ylabel(title)
        ax.grid(True, which="both", alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=7)
    axes[-1, 0].set_xlabel("adapters in flight")
    xs = sorted({e["adapters"] for points in lines.values() for e in points})
    if xs:
        axes[-1, 0].set_xticks(xs)
        axes[-1, 0].set_xticklabels([str(x) for x in xs])
    if any(e["rounds"] > 1 for e in everything):
        fig.suptitle("medians over rounds", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------- command line


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="chart and table of bench_engine.py results")
    p.add_argument("jsonl", nargs="+", type=Path, help="bench_engine.py output files")
    p.add_argument("--png", type=Path, help="write the chart here (needs matplotlib)")
    p.add_argument("--md", type=Path, help="write the markdown table here")
    args = p.parse_args(argv)
    runs = load(args.jsonl)
    if not any(run["rows"] for run in runs):
        print("no engine measurements in " + ", ".join(map(str, args.jsonl)), file=sys.stderr)
        return 1
    entries = table(runs)
    text = markdown(entries)
    if args.png:
        write_png(args.png, series(entries))
        print(f"wrote {args.png}")
    if args.md:
        args.md.write_text(text)
    if not (args.md or args.png):
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
