"""perf/plot.py on small synthetic engine results: rounds, latency definitions, a real PNG, the table."""

from __future__ import annotations

import json
import struct
import sys
import zlib
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))

import plot  # noqa: E402


def _row(mode, k, dist, rps, p95, round_=None, **extra):
    row = {"mode": mode, "req_per_s": rps, "batch_p50_ms": p95 / 2, "batch_p95_ms": p95, "batch_p99_ms": p95 * 1.1}
    row["batch"] = 256
    if k:
        row.update(adapters_in_flight=k, distribution=dist)
    if round_ is not None:
        row["round"] = round_
    return {**row, **extra}


def _write(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def results(tmp_path) -> tuple[Path, Path]:
    flops = {"flops_per_request": 4e10}
    new = _write(
        tmp_path / "new" / "engine.jsonl",
        [
            {"mode": "gemm_rate", "tflops": 800.0, "gemm_size": 8192},
            _row("base", 0, None, 400.0, 600.0, fraction_of_gemm_rate=0.02),
            _row("manylora", 1, "uniform", 300.0, 900.0, **flops),
            _row("manylora", 8, "uniform", 200.0, 1200.0, **flops),
            _row("manylora", 8, "zipf", 250.0, 1000.0, **flops),
            _row("hotswap", 8, "uniform", 4.0, 80.0, **flops),
            _row("peft-mixed", 1, "uniform", 100.0, 2500.0, **flops),
        ],
    )
    old = _write(tmp_path / "old" / "engine.jsonl", [_row("manylora", 32, "uniform", 150.0, 1700.0)])  # no GEMM
    return new, old


@pytest.fixture
def drifting(tmp_path) -> Path:
    """Three rounds on a host that slows down: LoRA is 0.9x base within every round, but the
    rounds' base rows come from the fast start and LoRA's from the slow end (what a naive
    reading, first base against last LoRA or all rows pooled, gets wrong)."""
    rows = [{"mode": "gemm_rate", "tflops": 800.0, "gemm_size": 8192}]
    for round_, speed in enumerate([1000.0, 700.0, 500.0]):
        rows.append(_row("base", 0, None, speed, 300.0 * 1000 / speed, round_))
        rows.append(_row("manylora", 8, "uniform", 0.9 * speed, 330.0 * 1000 / speed, round_))
        rows.append(_row("manylora", 1024, "uniform", 0.8 * speed, 360.0 * 1000 / speed, round_))
    rows.insert(3, _row("hotswap", 8, "uniform", 9.0, 110.0, 0))  # round 0 only, per-request latency
    return _write(tmp_path / "rounds" / "engine.jsonl", rows)


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    return struct.unpack(">II", data[16:24])


def _cells(md: str) -> dict:
    lines = md.splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    body = [line for line in lines[2:] if line.startswith("|")]
    rows = [dict(zip(head, (c.strip() for c in line.strip("|").split("|")))) for line in body]
    return {(r["mode"], r["adapters"], r["distribution"]): r for r in rows}


def test_ratios_are_taken_within_a_round_and_the_median_over_rounds(drifting):
    runs = plot.load([drifting])
    entries = {(e["mode"], e["adapters"]): e for e in plot.table(runs)}
    eight = entries[("manylora", 8)]
    assert eight["rounds"] == 3 and eight["x_base"] == pytest.approx(0.9)
    assert entries[("manylora", 1024)]["x_base"] == pytest.approx(0.8)
    naive = [r for r in runs[0]["rows"] if r["mode"] == "manylora" and r["adapters_in_flight"] == 8][-1]["req_per_s"]
    assert naive / runs[0]["rows"][0]["req_per_s"] == pytest.approx(0.45), "what the old plot.py reported"
    assert eight["req_per_s"] == pytest.approx(630.0) and entries[("base", 0)]["req_per_s"] == 700.0, "medians"
    assert eight["x_hotswap"] == pytest.approx(900 / 9.0), "hotswap ran in round 0: the ratio of round 0"
    table = _cells(plot.markdown(plot.table(runs)))
    assert table[("manylora", "8", "uniform")]["× base"] == "0.90"
    assert table[("manylora", "8", "uniform")]["rounds"] == "3"
    assert table[("base", "0", "-")]["× base"] == "1.00"


def test_latency_definitions_are_never_mixed(drifting, tmp_path):
    entries = plot.table(plot.load([drifting]))
    kinds = {e["mode"]: plot.latency_kind(e) for e in entries}
    assert kinds == {"base": "batch of 256", "manylora": "batch of 256", "hotswap": "request"}
    md = plot.markdown(entries)
    assert _cells(md)[("hotswap", "8", "uniform")]["latency of"] == "request"
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = {}
    real_savefig = plt.Figure.savefig

    def capture(fig, *args, **kwargs):
        for ax in fig.axes:
            drawn[ax.get_ylabel()] = {line.get_label() for line in ax.get_lines()}
        return real_savefig(fig, *args, **kwargs)

    plt.Figure.savefig = capture
    try:
        plot.write_png(tmp_path / "x.png", plot.series(entries))
    finally:
        plt.Figure.savefig = real_savefig
    batch_axis = drawn["p95 latency per batch of 256 requests (ms)"]
    request_axis = drawn["p95 latency per request (ms), one at a time"]
    assert "hotswap uniform" not in batch_axis and "manylora uniform" in batch_axis
    assert request_axis == {"hotswap uniform"}
    assert "× base req/s (same-round ratio)" in drawn and "throughput (req/s)" in drawn


def test_plot_writes_a_valid_png_and_the_markdown(results, tmp_path):
    pytest.importorskip("matplotlib")
    new, _ = results
    png, md = tmp_path / "out.png", tmp_path / "out.md"
    assert plot.main([str(new), "--png", str(png), "--md", str(md)]) == 0
    width, height = _png_size(png)
    assert width > 300 and height > 300
    data = png.read_bytes()
    assert data.endswith(b"IEND\xaeB`\x82")
    idat = b"".join(  # every IDAT chunk, decompressed: a real image with more than one colour
        data[i + 8 : i + 8 + struct.unpack(">I", data[i : i + 4])[0]]
        for i in range(8, len(data) - 12)
        if data[i + 4 : i + 8] == b"IDAT"
    )
    assert len(set(zlib.decompress(idat))) > 8
    from matplotlib.image import imread

    assert imread(png).shape[:2] == (height, width)
    lines = md.read_text().splitlines()
    assert lines[0].startswith("| mode | adapters | distribution | req/s | p50 (ms) | p95 (ms) | p99 (ms) |")
    assert "× base" in lines[0] and "× hotswap" in lines[0] and "of GEMM rate" in lines[0]
    assert "rounds" not in lines[0], "a single-round file has no rounds column"
    cells = _cells(md.read_text())
    assert len(cells) == 6, "one row per case, the gemm_rate line is not one"
    zipf = cells[("manylora", "8", "zipf")]
    assert zipf["req/s"] == "250.0" and zipf["× base"] == "0.62", "x base against the same file's base row"
    assert zipf["× hotswap"] == "62.5", "x hotswap against the hotswap row at the same adapters in flight"
    assert zipf["of GEMM rate"] == "1.25%", "flops x req/s over the run's measured GEMM rate"
    assert cells[("base", "0", "-")]["of GEMM rate"] == "2.00%"


def test_several_files_and_old_rows(results):
    new, old = results
    entries = plot.table(plot.load([new, old]))
    table = plot.markdown(entries)
    assert table.splitlines()[0].startswith("| run | mode |")
    assert "| old/engine.jsonl | manylora | 32 | uniform | 150.0 |" in table
    assert "| – | – | – | batch of 256 |" in table.splitlines()[-1], "no base, hotswap or GEMM rate in the old run"
    chart = plot.series(entries)
    assert set(chart["lines"]) == {
        "manylora uniform [new/engine.jsonl]",
        "manylora zipf [new/engine.jsonl]",
        "hotswap uniform [new/engine.jsonl]",
        "peft-mixed uniform [new/engine.jsonl]",
        "manylora uniform [old/engine.jsonl]",
    }
    assert [e["adapters"] for e in chart["lines"]["manylora uniform [new/engine.jsonl]"]] == [1, 8]
    assert set(chart["bases"]) == {"base [new/engine.jsonl]"}


def test_a_missing_matplotlib_says_how_to_install_it(results, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    with pytest.raises(SystemExit, match=r"pip install 'manylora\[plot\]'"):
        plot.main([str(results[0]), "--png", str(tmp_path / "x.png")])


def test_plot_prints_the_table_without_outputs(results, capsys, tmp_path):
    assert plot.main([str(results[0])]) == 0
    assert capsys.readouterr().out.startswith("| mode |")
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"mode": "gemm_rate", "tflops": 1.0}) + "\n")
    assert plot.main([str(empty)]) == 1


def test_the_committed_multi_round_results_plot(tmp_path):
    pytest.importorskip("matplotlib")
    committed = Path(__file__).resolve().parents[2] / "perf/h200-2026-11-30/session6/1156a68-engine.jsonl"
    if not committed.exists():
        pytest.skip("results file not in this checkout")
    png = tmp_path / "session6.png"
    assert plot.main([str(committed), "--png", str(png)]) == 0
    assert _png_size(png)[0] > 0
    rows = [e for e in plot.table(plot.load([committed])) if e["mode"] == "manylora"]
    assert all(e["rounds"] == 4 and 0.8 < e["x_base"] < 1.15 for e in rows)
