"""perf/bench_kernels.py --smoke runs anywhere and writes well-formed JSON lines."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "perf" / "bench_kernels.py"
NUMBERS = (
    "triton_us",
    "torch_loop_us",
    "floor_us",
    "over_floor",
    "speedup_vs_loop",
    "launch_us",
    "copy_bandwidth_gbps",
)


@pytest.mark.smoke
def test_smoke_writes_json_lines(tmp_path):
    out = tmp_path / "bench.jsonl"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["case"] for r in rows} == {"sgmv_shrink", "sgmv_expand"}
    for row in rows:
        for key in NUMBERS:
            assert isinstance(row[key], (int, float)) and row[key] > 0, (key, row[key])
        assert row["dtype"] == "bfloat16" and row["rank"] == 16
        assert {"device", "torch", "triton", "config", "adapters", "tokens"} <= row.keys()
    assert "x floor" in result.stdout


def test_sweep_segments_are_one_row_each_with_slots_cycling():
    """--sweep-segment-tokens: the sweep's case holds segments of that many tokens (the GPU
    stage's chunks: one row per adapter), their slots cycling over the bench's slots."""
    import torch

    sys.path.insert(0, str(SCRIPT.parent))
    from bench_kernels import NUM_SLOTS, make_case

    tokens = 128 * (NUM_SLOTS + 2)
    case = make_case("sgmv_expand", 8, tokens, 16, 64, torch.device("cpu"), segment_tokens=128)
    segments = [tuple(s) for s in case["segments"]]
    assert [(end - start) for start, end, _ in segments] == [128] * (NUM_SLOTS + 2)
    assert [slot for _, _, slot in segments] == [*range(NUM_SLOTS), 0, 1]
