"""perf/bench_fused_shrink.py's experimental kernel gives the product's three shrinks (its --check,
under the Triton interpreter on the CPU), so that the GPU measurement it prepares compares equals."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PERF = Path(__file__).resolve().parents[2] / "perf"


def test_one_pass_shrink_equals_the_three_shrinks():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, str(PERF / "bench_fused_shrink.py"), "--check"], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "largest difference from the three shrinks" in done.stdout
