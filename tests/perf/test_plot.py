"""perf/plot.py on small synthetic engine results: a real PNG and a well-formed table."""

from __future__ import annotations

import json
import struct
import sys
import zlib
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))

import plot  # noqa: E402


def _row(mode, k, dist, rps, p95, **extra):
    row = {"mode": mode, "req_per_s": rps, "batch_p50_ms": p95 / 2, "batch_p95_ms": p95, "batch_p99_ms": p95 * 1.1}
    if k:
        row.update(adapters_in_flight=k, distribution=dist)
    return {**row, **extra}


@pytest.fixture
def results(tmp_path) -> tuple[Path, Path]:
    new = tmp_path / "new" / "engine.jsonl"
    old = tmp_path / "old" / "engine.jsonl"
    new.parent.mkdir()
    old.parent.mkdir()
    flops = {"flops_per_request": 4e10}
    rows = [
        {"mode": "gemm_rate", "tflops": 800.0, "gemm_size": 8192},
        _row("base", 0, None, 400.0, 600.0, fraction_of_gemm_rate=0.02),
        _row("manylora", 1, "uniform", 300.0, 900.0, **flops),
        _row("manylora", 8, "uniform", 200.0, 1200.0, **flops),
        _row("manylora", 8, "zipf", 250.0, 1000.0, **flops),
        _row("hotswap", 8, "uniform", 4.0, 800.0, **flops),
        _row("peft-mixed", 1, "uniform", 100.0, 2500.0, **flops),
    ]
    new.write_text("".join(json.dumps(r) + "\n" for r in rows))
    old.write_text(json.dumps(_row("manylora", 32, "uniform", 150.0, 1700.0)) + "\n")  # before the GEMM fields
    return new, old


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_plot_writes_png_and_markdown(results, tmp_path):
    new, _ = results
    png, md = tmp_path / "out.png", tmp_path / "out.md"
    assert plot.main([str(new), "--png", str(png), "--md", str(md)]) == 0
    assert png.stat().st_size > 1000 and _png_size(png)[0] > 0
    lines = md.read_text().splitlines()
    assert lines[0].startswith("| mode | adapters | distribution | req/s | p50 (ms) | p95 (ms) | p99 (ms) |")
    assert "× base" in lines[0] and "× hotswap" in lines[0] and "of GEMM rate" in lines[0]
    body = [line.split(" | ") for line in lines[2:]]
    assert len(body) == 6, "one row per measurement, the gemm_rate line is not one"
    by_key = {(cells[0].strip("| "), cells[1], cells[2]): cells for cells in body}
    zipf = by_key[("manylora", "8", "zipf")]
    assert zipf[3] == "250.0" and zipf[7] == "0.62", "x base against the same file's base row"
    assert zipf[8] == "62.5", "x hotswap against the hotswap row at the same adapters in flight"
    assert zipf[9].rstrip(" |") == "1.25%", "flops x req/s over the run's measured GEMM rate"
    assert by_key[("base", "0", "-")][9].rstrip(" |") == "2.00%"


def test_builtin_png_is_a_valid_image(results, tmp_path):
    new, old = results
    runs = plot.load([new, old])
    lines, bases = plot.series(runs)
    assert set(lines) == {
        "manylora uniform [new/engine.jsonl]",
        "manylora zipf [new/engine.jsonl]",
        "hotswap uniform [new/engine.jsonl]",
        "peft-mixed uniform [new/engine.jsonl]",
        "manylora uniform [old/engine.jsonl]",
    }
    assert [p[0] for p in lines["manylora uniform [new/engine.jsonl]"]] == [1, 8]
    assert bases == {"base [new/engine.jsonl]": (400.0, 600.0)}
    png = tmp_path / "builtin.png"
    assert plot.write_png(png, lines, bases, builtin=True) == "builtin"
    width, height = _png_size(png)
    data = png.read_bytes()
    idat = data[33:]
    length, kind = struct.unpack(">I4s", idat[:8])
    assert kind == b"IDAT"
    raw = zlib.decompress(idat[8 : 8 + length])
    assert len(raw) == height * (1 + 3 * width), "8-bit RGB rows, each with its filter byte"
    assert data.endswith(b"IEND\xaeB`\x82")
    assert len(set(raw[1 : 1 + 3 * width * height : 3])) > 3, "something besides white was drawn"
    table = plot.markdown(plot.table(runs))
    assert table.splitlines()[0].startswith("| run | mode |")
    assert "| old/engine.jsonl | manylora | 32 | uniform | 150.0 |" in table
    assert table.splitlines()[-1].endswith("| – | – | – |"), "no base, hotswap or GEMM rate in the old run"


def test_matplotlib_png_when_installed(results, tmp_path):
    pytest.importorskip("matplotlib")
    lines, bases = plot.series(plot.load([results[0]]))
    png = tmp_path / "mpl.png"
    assert plot.write_png(png, lines, bases, builtin=False) == "matplotlib"
    assert _png_size(png)[0] > 0


def test_plot_prints_the_table_without_outputs(results, capsys, tmp_path):
    assert plot.main([str(results[0])]) == 0
    assert capsys.readouterr().out.startswith("| mode |")
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"mode": "gemm_rate", "tflops": 1.0}) + "\n")
    assert plot.main([str(empty)]) == 1
