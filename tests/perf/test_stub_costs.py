"""perf/bench_stub_costs.py measures, through a real tritonserver, what each BLS request of N
rows costs the callee's stub (speed is never asserted here: only that each size is measured)."""

from __future__ import annotations

import sys
from pathlib import Path

PERF = Path(__file__).resolve().parents[2] / "perf"
sys.path.insert(0, str(PERF))

import bench_stub_costs  # noqa: E402


def test_each_request_size_is_measured_in_the_callee_and_the_caller():
    lines = bench_stub_costs.measure([1, 3], calls=5)
    assert [line["rows"] for line in lines] == [1, 3]
    for line in lines:
        assert line["callee_cpu_us"] > 0 and line["caller_cpu_us"] > 0 and line["caller_wall_us"] > 0, line
        # the callee counted the timed calls and the first TOOK request, and its CPU is within the caller's wall
        assert line["callee_requests"] == 5 + 1, line
        assert line["callee_cpu_us"] < line["caller_wall_us"], line
