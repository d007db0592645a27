"""A chart and a table from engine benchmark results (the JSON lines of ``bench_engine.py``).

    python perf/plot.py perf/h200-2026-11-29/engine.jsonl --png out.png --md out.md

* PNG: throughput (req/s) and batch p95 (ms) against adapters in flight, log scales, one
  line per mode and distribution (and per file when given several); the no-adapter base is
  a dashed horizontal line. Drawn with matplotlib where it is installed; otherwise by a
  small built-in rasteriser (a zlib PNG writer and a 5x7 bitmap font), so the harness needs
  no plotting package.
* Markdown: one row per measurement: mode, adapters, distribution, req/s, batch
  p50/p95/p99, × base and × hotswap (the rows of the same file), and the fraction of the
  dense GEMM rate ("–" for runs older than that field).

Without ``--png`` or ``--md`` the table is printed.
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import sys
import zlib
from pathlib import Path
from typing import Optional

COLOURS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75)]
COLOURS += [(227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)]


# ---------------------------------------------------------------- data


def load(paths) -> list[dict]:
    """One run per file: {"source", "rows" (measurements), "gemm" (the gemm_rate line or None)}."""
    paths = [Path(p) for p in paths]
    names = [p.name for p in paths]
    runs = []
    for path in paths:
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        source = path.name if names.count(path.name) == 1 else f"{path.parent.name}/{path.name}"
        runs.append(
            {
                "source": source,
                "rows": [r for r in lines if r.get("mode") != "gemm_rate" and "req_per_s" in r],
                "gemm": next((r for r in lines if r.get("mode") == "gemm_rate"), None),
            }
        )
    return runs


def _fraction(row: dict, gemm: Optional[dict]) -> Optional[float]:
    if row.get("fraction_of_gemm_rate") is not None:
        return row["fraction_of_gemm_rate"]
    if gemm and row.get("flops_per_request"):
        return row["flops_per_request"] * row["req_per_s"] / 1e12 / gemm["tflops"]
    return None


def _same_adapters(rows: list[dict], mode: str, row: dict) -> Optional[dict]:
    k = row.get("adapters_in_flight")
    matches = [r for r in rows if r["mode"] == mode and r.get("adapters_in_flight") == k]
    same = [r for r in matches if r.get("distribution") == row.get("distribution")]
    return (same or matches or [None])[0]


def table(runs: list[dict]) -> list[dict]:
    """Every measurement with its ratios, in file order."""
    out = []
    for run in runs:
        rows = run["rows"]
        base = next((r for r in rows if r["mode"] == "base"), None)
        for row in rows:
            hot = _same_adapters(rows, "hotswap", row)
            out.append(
                {
                    "source": run["source"],
                    "mode": row["mode"],
                    "adapters": row.get("adapters_in_flight", 0),
                    "distribution": row.get("distribution", "-"),
                    "req_per_s": row["req_per_s"],
                    "p50": row["batch_p50_ms"],
                    "p95": row["batch_p95_ms"],
                    "p99": row["batch_p99_ms"],
                    "x_base": row["req_per_s"] / base["req_per_s"] if base else None,
                    "x_hotswap": row["req_per_s"] / hot["req_per_s"] if hot else None,
                    "fraction_of_gemm": _fraction(row, run["gemm"]),
                }
            )
    return out


def markdown(entries: list[dict]) -> str:
    several = len({e["source"] for e in entries}) > 1

    def num(value, fmt):
        return "–" if value is None else format(value, fmt)

    head = ["mode", "adapters", "distribution", "req/s", "p50 (ms)", "p95 (ms)", "p99 (ms)", "× base", "× hotswap"]
    head += ["of GEMM rate"]
    if several:
        head.insert(0, "run")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in entries:
        cells = [e["mode"], str(e["adapters"]), e["distribution"], num(e["req_per_s"], ".1f")]
        cells += [num(e["p50"], ".1f"), num(e["p95"], ".1f"), num(e["p99"], ".1f")]
        cells += [num(e["x_base"], ".2f"), num(e["x_hotswap"], ".1f"), num(e["fraction_of_gemm"], ".2%")]
        if several:
            cells.insert(0, e["source"])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def series(runs: list[dict]) -> tuple[dict, dict]:
    """({label: [(adapters, req/s, p95 ms)] by adapters}, {label: (req/s, p95 ms)} of the base runs)."""
    several = len(runs) > 1
    lines, bases = {}, {}
    for run in runs:
        suffix = f" [{run['source']}]" if several else ""
        for row in run["rows"]:
            if row["mode"] == "base" or not row.get("adapters_in_flight"):
                bases.setdefault(f"{row['mode']}{suffix}", (row["req_per_s"], row["batch_p95_ms"]))
                continue
            label = f"{row['mode']} {row.get('distribution', '-')}{suffix}"
            points = dict((p[0], p) for p in lines.get(label, []))
            points[row["adapters_in_flight"]] = (row["adapters_in_flight"], row["req_per_s"], row["batch_p95_ms"])
            lines[label] = sorted(points.values())
    return lines, bases


# ---------------------------------------------------------------- PNG


def write_png(path: Path, lines: dict, bases: dict, builtin: Optional[bool] = None) -> str:
    """Draw the chart into ``path``; returns the renderer used ('matplotlib' or 'builtin')."""
    if builtin is None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            builtin = True
    if builtin:
        _Canvas.chart(lines, bases).save(path)
        return "builtin"
    _matplotlib_chart(path, lines, bases)
    return "matplotlib"


def _matplotlib_chart(path: Path, lines: dict, bases: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(2, 1, figsize=(9, 8), sharex=True)
    for index, (ax, column, title) in enumerate(zip(axes, (1, 2), ("throughput (req/s)", "batch p95 (ms)"))):
        for i, (label, points) in enumerate(lines.items()):
            colour = [c / 255 for c in COLOURS[i % len(COLOURS)]]
            ax.plot([p[0] for p in points], [p[column] for p in points], "o-", color=colour, label=label)
        for j, (label, values) in enumerate(bases.items()):
            colour = [c / 255 for c in COLOURS[(len(lines) + j) % len(COLOURS)]]
            ax.axhline(values[column - 1], linestyle="--", color=colour, label=f"{label} (no adapter)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_ylabel(title)
        ax.grid(True, which="both", alpha=0.3)
        if index == 0:
            ax.legend(fontsize=8)
    axes[-1].set_xlabel("adapters in flight")
    xs = sorted({p[0] for points in lines.values() for p in points})
    if xs:
        axes[-1].set_xticks(xs)
        axes[-1].set_xticklabels([str(x) for x in xs])
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# A 5x7 bitmap font: seven rows of five pixels per character, '#' on.
FONT = {
    "0": ".###. #...# #..## #.#.# ##..# #...# .###.",
    "1": "..#.. .##.. ..#.. ..#.. ..#.. ..#.. .###.",
    "2": ".###. #...# ....# ...#. ..#.. .#... #####",
    "3": "##### ...#. ..#.. ...#. ....# #...# .###.",
    "4": "...#. ..##. .#.#. #..#. ##### ...#. ...#.",
    "5": "##### #.... ####. ....# ....# #...# .###.",
    "6": "..##. .#... #.... ####. #...# #...# .###.",
    "7": "##### ....# ...#. ..#.. .#... .#... .#...",
    "8": ".###. #...# #...# .###. #...# #...# .###.",
    "9": ".###. #...# #...# .#### ....# ...#. .##..",
    "a": "..... ..... .###. ....# .#### #...# .####",
    "b": "#.... #.... #.##. ##..# #...# #...# ####.",
    "c": "..... ..... .###. #.... #.... #...# .###.",
    "d": "....# ....# .##.# #..## #...# #...# .####",
    "e": "..... ..... .###. #...# ##### #.... .###.",
    "f": "..##. .#..# .#... ###.. .#... .#... .#...",
    "g": "..... .#### #...# #...# .#### ....# .###.",
    "h": "#.... #.... #.##. ##..# #...# #...# #...#",
    "i": "..#.. ..... .##.. ..#.. ..#.. ..#.. .###.",
    "j": "...#. ..... ..##. ...#. ...#. #..#. .##..",
    "k": "#.... #.... #..#. #.#.. ##... #.#.. #..#.",
    "l": ".##.. ..#.. ..#.. ..#.. ..#.. ..#.. .###.",
    "m": "..... ..... ##.#. #.#.# #.#.# #...# #...#",
    "n": "..... ..... #.##. ##..# #...# #...# #...#",
    "o": "..... ..... .###. #...# #...# #...# .###.",
    "p": "..... ..... ####. #...# ####. #.... #....",
    "q": "..... ..... .##.# #..## .#### ....# ....#",
    "r": "..... ..... #.##. ##..# #.... #.... #....",
    "s": "..... ..... .###. #.... .###. ....# ####.",
    "t": ".#... .#... ###.. .#... .#... .#..# ..##.",
    "u": "..... ..... #...# #...# #...# #..## .##.#",
    "v": "..... ..... #...# #...# #...# .#.#. ..#..",
    "w": "..... ..... #...# #...# #.#.# #.#.# .#.#.",
    "x": "..... ..... #...# .#.#. ..#.. .#.#. #...#",
    "y": "..... ..... #...# #...# .#### ....# .###.",
    "z": "..... ..... ##### ...#. ..#.. .#... #####",
    " ": "..... ..... ..... ..... ..... ..... .....",
    ".": "..... ..... ..... ..... ..... .##.. .##..",
    ",": "..... ..... ..... ..... .##.. ..#.. .#...",
    "-": "..... ..... ..... ##### ..... ..... .....",
    "_": "..... ..... ..... ..... ..... ..... #####",
    "/": "..... ....# ...#. ..#.. .#... #.... .....",
    "(": "...#. ..#.. .#... .#... .#... ..#.. ...#.",
    ")": ".#... ..#.. ...#. ...#. ...#. ..#.. .#...",
    "[": ".###. .#... .#... .#... .#... .#... .###.",
    "]": ".###. ...#. ...#. ...#. ...#. ...#. .###.",
    "%": "##... ##..# ...#. ..#.. .#... #..## ...##",
    ":": "..... .##.. .##.. ..... .##.. .##.. .....",
    "=": "..... ..... ##### ..... ##### ..... .....",
    "+": "..... ..#.. ..#.. ##### ..#.. ..#.. .....",
    "?": ".###. #...# ....# ...#. ..#.. ..... ..#..",
}
GLYPH_SCALE = 2
GLYPH_ADVANCE = 6 * GLYPH_SCALE


class _Canvas:
    """An RGB raster with lines, dashes and bitmap text, saved as a PNG (zlib, no other package)."""

    WIDTH, HEIGHT = 1100, 760
    PLOT_LEFT, PLOT_RIGHT = 90, 660  # legend to the right of the plots

    def __init__(self, width: int, height: int):
        self.width, self.height = width, height
        self.pixels = bytearray(b"\xff" * (width * height * 3))

    def dot(self, x: int, y: int, colour, size: int = 1) -> None:
        for dy in range(size):
            for dx in range(size):
                px, py = x + dx - size // 2, y + dy - size // 2
                if 0 <= px < self.width and 0 <= py < self.height:
                    i = 3 * (py * self.width + px)
                    self.pixels[i : i + 3] = bytes(colour)

    def line(self, x0, y0, x1, y1, colour, size: int = 1, dash: int = 0) -> None:
        steps = max(abs(x1 - x0), abs(y1 - y0), 1)
        for s in range(int(steps) + 1):
            if dash and (s // dash) % 2:
                continue
            t = s / steps
            self.dot(round(x0 + (x1 - x0) * t), round(y0 + (y1 - y0) * t), colour, size)

    def text(self, x: int, y: int, text: str, colour=(0, 0, 0)) -> None:
        for n, char in enumerate(text.lower()):
            rows = FONT.get(char, FONT["?"]).split()
            for r, row in enumerate(rows):
                for c, on in enumerate(row):
                    if on == "#":
                        for dy in range(GLYPH_SCALE):
                            for dx in range(GLYPH_SCALE):
                                self.dot(x + n * GLYPH_ADVANCE + c * GLYPH_SCALE + dx, y + r * GLYPH_SCALE + dy, colour)

    def save(self, path: Path) -> None:
        stride = 3 * self.width
        raw = b"".join(b"\x00" + bytes(self.pixels[y * stride : (y + 1) * stride]) for y in range(self.height))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)  # 8-bit RGB
        png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9))
        Path(path).write_bytes(png + chunk(b"IEND", b""))

    @classmethod
    def chart(cls, lines: dict, bases: dict) -> "_Canvas":
        canvas = cls(cls.WIDTH, cls.HEIGHT)
        xs = sorted({p[0] for points in lines.values() for p in points}) or [1, 10]
        x_lo, x_hi = math.log10(xs[0]) - 0.15, math.log10(xs[-1]) + 0.15
        panels = (("throughput (req/s)", 1, 40, 330), ("batch p95 (ms)", 2, 390, 680))
        for title, column, top, bottom in panels:
            values = [p[column] for points in lines.values() for p in points] + [b[column - 1] for b in bases.values()]
            values = [v for v in values if v > 0] or [1.0, 10.0]
            y_lo, y_hi = math.log10(min(values)), math.log10(max(values))
            pad = max(0.1, (y_hi - y_lo) * 0.08)
            y_lo, y_hi = y_lo - pad, y_hi + pad

            def to_px(x, y, top=top, bottom=bottom, y_lo=y_lo, y_hi=y_hi):
                px = cls.PLOT_LEFT + (math.log10(x) - x_lo) / (x_hi - x_lo) * (cls.PLOT_RIGHT - cls.PLOT_LEFT)
                py = bottom - (math.log10(y) - y_lo) / (y_hi - y_lo) * (bottom - top)
                return round(px), round(py)

            grey, black = (215, 215, 215), (0, 0, 0)
            for tick in _log_ticks(y_lo, y_hi):
                _, py = to_px(xs[0], tick)
                canvas.line(cls.PLOT_LEFT, py, cls.PLOT_RIGHT, py, grey)
                label = _short(tick)
                canvas.text(cls.PLOT_LEFT - 8 - len(label) * GLYPH_ADVANCE, py - 7, label)
            for x in xs:
                px, _ = to_px(x, 10**y_lo)
                canvas.line(px, top, px, bottom, grey)
                canvas.text(px - len(str(x)) * GLYPH_ADVANCE // 2, bottom + 6, str(x))
            for a, b, c, d in ((0, 0, 1, 0), (0, 1, 1, 1), (0, 0, 0, 1), (1, 0, 1, 1)):
                xa = cls.PLOT_LEFT if a == 0 else cls.PLOT_RIGHT
                xb = cls.PLOT_LEFT if c == 0 else cls.PLOT_RIGHT
                canvas.line(xa, top if b == 0 else bottom, xb, top if d == 0 else bottom, black)
            canvas.text(cls.PLOT_LEFT, top - 20, title)
            for i, points in enumerate(lines.values()):
                colour = COLOURS[i % len(COLOURS)]
                pixels = [to_px(p[0], p[column]) for p in points if p[column] > 0]
                for (xa, ya), (xb, yb) in zip(pixels, pixels[1:]):
                    canvas.line(xa, ya, xb, yb, colour, size=2)
                for px, py in pixels:
                    canvas.dot(px, py, colour, size=7)
            for j, values in enumerate(bases.values()):
                if values[column - 1] > 0:
                    colour = COLOURS[(len(lines) + j) % len(COLOURS)]
                    _, py = to_px(xs[0], values[column - 1])
                    canvas.line(cls.PLOT_LEFT, py, cls.PLOT_RIGHT, py, colour, size=2, dash=8)
        canvas.text(cls.PLOT_LEFT + 150, panels[-1][3] + 30, "adapters in flight (log)")
        legend = list(lines) + [f"{label} (no adapter)" for label in bases]
        for i, label in enumerate(legend):
            colour = COLOURS[i % len(COLOURS)]
            y = 50 + 24 * i
            canvas.line(
                cls.PLOT_RIGHT + 20, y + 6, cls.PLOT_RIGHT + 44, y + 6, colour, size=3, dash=8 if i >= len(lines) else 0
            )
            canvas.text(cls.PLOT_RIGHT + 52, y, label[:31])
        return canvas


def _log_ticks(lo: float, hi: float) -> list[float]:
    """Ticks within 10**lo..10**hi: decades on a wide range, 1-2-5 on a middling one, 1..9 on a narrow one."""
    steps = (1,) if hi - lo > 3 else (1, 2, 5) if hi - lo > 1 else tuple(range(1, 10))
    ticks = []
    for decade in range(math.floor(lo), math.ceil(hi) + 1):
        ticks += [m * 10.0**decade for m in steps if lo <= math.log10(m * 10.0**decade) <= hi]
    return ticks


def _short(value: float) -> str:
    if value >= 1:
        return f"{value:,.0f}".replace(",", "")
    return f"{value:g}"


# ---------------------------------------------------------------- command line


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="chart and table of bench_engine.py results")
    p.add_argument("jsonl", nargs="+", type=Path, help="bench_engine.py output files")
    p.add_argument("--png", type=Path, help="write the chart here")
    p.add_argument("--md", type=Path, help="write the markdown table here")
    args = p.parse_args(argv)
    runs = load(args.jsonl)
    if not any(run["rows"] for run in runs):
        print("no measurements in " + ", ".join(map(str, args.jsonl)), file=sys.stderr)
        return 1
    text = markdown(table(runs))
    if args.md:
        args.md.write_text(text)
    if args.png:
        renderer = write_png(args.png, *series(runs))
        print(f"wrote {args.png} ({renderer})")
    if not (args.md or args.png):
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
