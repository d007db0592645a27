"""The benchmark harnesses produce well-formed results (speed is never asserted here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

PERF = Path(__file__).resolve().parents[2] / "perf"
sys.path.insert(0, str(PERF))

import bench_server  # noqa: E402


def test_engine_benchmark_smoke_writes_every_mode(tmp_path):
    out = tmp_path / "engine.jsonl"
    modes = ["base", "manylora", "hotswap", "peft-mixed"]
    proc = subprocess.run(
        [sys.executable, str(PERF / "bench_engine.py"), "--smoke", "--modes", *modes, "--peft-mixed-max", "1"]
        + ["--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    gemm = [r for r in lines if r["mode"] == "gemm_rate"]
    assert len(gemm) == 1, "the GEMM rate is measured once per run"
    assert gemm[0]["tflops"] > 0 and gemm[0]["gemm_dtype"] == "torch.float32" and gemm[0]["device"] == "cpu"
    rows = [r for r in lines if r["mode"] != "gemm_rate"]
    assert {r["mode"] for r in rows} == set(modes)
    base = next(r for r in rows if r["mode"] == "base")
    for row in rows:
        assert row["requests"] > 0 and row["req_per_s"] > 0 and row["errors"] == 0
        assert row["batch_p50_ms"] <= row["batch_p95_ms"] <= row["batch_p99_ms"]
        assert row["machine"]["torch"] and row["device"] == "cpu"
        assert row["flops_per_request"] > 0 and row["tokens_per_request"] > 0
        assert row["achieved_tflops"] == pytest.approx(row["flops_per_request"] * row["req_per_s"] / 1e12)
        assert row["fraction_of_gemm_rate"] == pytest.approx(row["achieved_tflops"] / gemm[0]["tflops"])
        if row["mode"] != "base":
            assert row["bytes_per_adapter"] > 0
            assert row["flops_per_request"] > base["flops_per_request"], "LoRA adds FLOPs to the base request"
    mixed = [r for r in rows if r["mode"] == "peft-mixed"]
    assert [r["adapters_in_flight"] for r in mixed] == [1], "peft-mixed stops at --peft-mixed-max"
    assert mixed[0]["peft_resident"] == 1 and set(mixed[0]["split_s"]) == {"pre", "core", "post"}
    assert "skipping peft-mixed at 4 adapters in flight" in proc.stderr
    assert "TFLOP/s" in proc.stdout and "of GEMM" in proc.stdout
    assert "x hotswap" in proc.stdout and "x peft-mixed" in proc.stdout, "the ratio table is printed last"


def test_engine_benchmark_interleaved_rounds(tmp_path):
    """--interleave: base and every manylora case per round, each with its answers counted; the
    --profile tables name every case of every round."""
    out, profile = tmp_path / "engine.jsonl", tmp_path / "profile.txt"
    proc = subprocess.run(
        [sys.executable, str(PERF / "bench_engine.py"), "--smoke", "--modes", "base", "manylora", "--interleave"]
        + ["--rounds", "2", "--profile", str(profile), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r for r in map(json.loads, out.read_text().splitlines()) if r["mode"] != "gemm_rate"]
    cases = [(r["round"], r["mode"], r.get("adapters_in_flight")) for r in rows]
    assert cases == [(n, m, k) for n in (0, 1) for m, k in (("base", None), ("manylora", 1), ("manylora", 4))]
    for row in rows:
        assert row["interleaved"] and row["errors"] == 0 and row["requests"] == 16  # 2 timed batches of 8
        assert row["found_per_request"] > 0 and row["cpu_ms_per_request"] > 0
    for row in rows:  # the largest pool was made resident first: no load while a case was timed
        assert row["mode"] == "base" or (row["loads"] and not any(row["loads"].values())), row.get("loads")
    tables = profile.read_text()
    for n in (0, 1):
        for tag in ("base", "manylora 1 uniform", "manylora 4 uniform"):
            assert f"==== {tag} (round {n})" in tables
    assert "median" in proc.stdout and "process CPU per request x base" in proc.stdout
    assert all(len(r["batch_ms"]) == 2 for r in rows) and "paired batches: median" in proc.stdout


def test_ratio_summary_pairs_batches_of_one_round():
    """Paired ratios: base's latency over the case's for the same batch index, pooled over rounds."""
    import bench_engine

    def row(mode, round_, req_per_s, batch_ms, k=None):
        extra = {} if mode == "base" else {"adapters_in_flight": k, "distribution": "uniform"}
        common = {"cpu_ms_per_request": 1.0, "interleaved": True}
        return {"mode": mode, "round": round_, "req_per_s": req_per_s, "batch_ms": batch_ms, **extra, **common}

    rows = [
        row("base", 0, 100.0, [10.0, 20.0]),
        row("manylora", 0, 80.0, [12.5, 25.0], k=8),  # 0.8 on both batches
        row("base", 1, 50.0, [40.0, 40.0]),  # a slow round: drift cancels within pairs
        row("manylora", 1, 40.0, [50.0, 50.0], k=8),
    ]
    (line,) = bench_engine.ratio_summary(rows)
    assert "median 0.800" in line and "paired batches: median 0.800 of 4" in line


def test_found_counts_the_items_of_an_answer():
    from bench_engine import _found

    assert _found({"entities": {"person": ["Ann", "Bo"], "date": []}}) == 2
    assert _found({"entities": {"person": [{"text": "Ann", "confidence": 0.9}]}}) == 1
    assert _found({"sentiment": "positive"}) == 1 and _found({"sentiment": ""}) == 0
    assert _found({"relation_extraction": {"works_for": [("Ann", "Acme"), ("Bo", "Zed")]}}) == 2
    assert _found({"product": [{"name": "X", "price": 3}, {"name": "Y", "price": 4}]}) == 2


def test_perf_analyzer_input_data(tmp_path):
    names = [f"adapter-{i:05d}" for i in range(50)]
    path = bench_server.make_input_data(tmp_path / "data.json", 64, names, "zipf", seed=3)
    data = json.loads(path.read_text())["data"]
    assert len(data) == 64
    for entry in data:
        assert set(entry) == {"TEXT", "SCHEMA", "ADAPTER_ID", "THRESHOLD", "INCLUDE_CONFIDENCE", "INCLUDE_SPANS"}
        assert all(value["shape"] == [1] and len(value["content"]) == 1 for value in entry.values())
        assert entry["ADAPTER_ID"]["content"][0] in names
        json.loads(entry["SCHEMA"]["content"][0])
    chosen = [e["ADAPTER_ID"]["content"][0] for e in data]
    assert chosen.count(names[0]) > chosen.count(names[-1]), "Zipf favours the first adapters"
    base = json.loads(bench_server.make_input_data(tmp_path / "b.json", 8, [], "uniform").read_text())["data"]
    assert all(e["ADAPTER_ID"]["content"] == [""] for e in base)
