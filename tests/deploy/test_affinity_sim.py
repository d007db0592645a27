"""deploy/affinity_sim.py: its quick run prints a well-formed table, and its parts behave."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
from deploy_files import REPO, load_script

sim = load_script("deploy/affinity_sim.py")


def table_rows(output: str) -> tuple[list[str], list[list[str]]]:
    lines = [line for line in output.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert set(lines[1].replace("|", "")) == {"-"}
    return header, [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]


def test_quick_run_prints_a_well_formed_table():
    done = subprocess.run(
        [sys.executable, str(REPO / "deploy" / "affinity_sim.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    header, rows = table_rows(done.stdout)
    assert header == list(sim.COLUMNS)
    assert len(rows) == len(sim.DISTRIBUTIONS) * len(sim.POLICIES)
    by_key = {}
    for row in rows:
        assert len(row) == len(header)
        traffic, replicas, routing, gpu, gpu_worst, warm, disk, requests_ratio, flight_ratio = row
        assert traffic in ("uniform", "Zipf(1.1)") and replicas == "4" and routing in sim.POLICIES
        gpu, gpu_worst, warm = (float(v.rstrip("%")) for v in (gpu, gpu_worst, warm))
        assert 0 <= gpu_worst <= gpu <= warm <= 100
        assert 0 <= int(disk) <= 1000
        assert float(requests_ratio) >= 1 and float(flight_ratio) >= 1
        by_key[traffic, routing] = gpu, float(flight_ratio)
    for traffic in ("uniform", "Zipf(1.1)"):
        # hashing keeps each adapter on one replica: more hits than random routing
        assert by_key[traffic, "hash"][0] > by_key[traffic, "random"][0]
        # the bounded-load cap holds (in flight <= 1.25 x the mean)
        assert by_key[traffic, "bounded"][1] <= 1.25 + 1e-9


def test_tiered_lru_keeps_gpu_residents_in_host_memory():
    cache = sim.TieredLRU(gpu_slots=2, host_slots=3)
    assert [cache.access(a) for a in (1, 2, 3, 1)] == ["disk", "disk", "disk", "host"]
    assert cache.access(1) == "gpu"
    cache.access(4)  # host now 3, 1, 4 (2 evicted); GPU 1, 4
    assert cache.access(2) == "disk" and cache.access(4) == "gpu"
    assert set(cache.gpu) <= set(cache.host)


def test_ring_preference_is_stable_and_covers_every_replica():
    ring = sim.Ring(4)
    first = ring.preference("adapter-00007")
    assert sorted(first) == [0, 1, 2, 3] and sim.Ring(4).preference("adapter-00007") == first
    owners = [ring.preference(f"adapter-{a:05d}")[0] for a in range(1024)]
    counts = np.bincount(owners, minlength=4)
    assert counts.min() > 0.5 * 256 and counts.max() < 1.5 * 256
