"""perf/profile_core.py's interleaved A/B of chunk_cost_tokens runs and reports the chunks it
compares (speed is never asserted here)."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

PERF = Path(__file__).resolve().parents[2] / "perf"
sys.path.insert(0, str(PERF))

import profile_core  # noqa: E402


def test_chunk_cost_ab_reports_each_value_its_chunks_and_equal_answers(tiny_checkpoint, tmp_path, capsys):
    argv = ["--checkpoint", str(tiny_checkpoint), "--rows", "12", "--repeats", "1", "--out", str(tmp_path)]
    assert profile_core.main([*argv, "--ab", "chunk_cost_tokens", "--chunk-costs", "32768,16"]) == 0
    out = capsys.readouterr().out
    plans = dict(re.findall(r"^chunk_cost_tokens (\d+): (\d+) chunks", out, re.M))
    assert plans["32768"] == "1" and int(plans["16"]) > 1, out  # the cheap chunk cuts the same rows finer
    for value in ("32768", "16"):
        line = re.search(rf"^chunk_cost_tokens {value} \(best of 1, interleaved\): .*$", out, re.M)
        assert line and "0 of 12 rows with other hits, 0 failed in either arm" in line.group(0), out
    assert "chunk_pipeline A/B" not in out  # --ab picks the A/Bs
    assert (tmp_path / "core-tottime.txt").exists()
    # the engine's phases of the timed runs only (the A/Bs' runs come after them)
    phases = ast.literal_eval(re.search(r"^phases, ms per run_core: (\{.*\})$", out, re.M).group(1))
    assert set(phases) >= {"prepare", "forward", "heads", "finish", "forward_cpu"}, phases
    assert phases["forward"] > 0 and phases["prepare"] > 0, phases
