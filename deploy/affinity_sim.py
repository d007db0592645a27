"""Adapter-affinity routing across replicas: cache hit rates against load imbalance.

Each replica (one ManyLoRA model instance) keeps an LRU of ``--gpu-slots`` adapters in GPU
slots and ``--host-slots`` in host memory, as ``max_gpu_adapters`` / ``max_cpu_adapters`` do.
A request finds its adapter in a GPU slot (hit), in host memory (a host->GPU copy), or
nowhere (a disk load). Three ways to pick the replica of a request are compared:

- ``random``: any replica (what a plain Kubernetes Service does, per connection or request);
- ``hash``: consistent hashing of the adapter id on a ring (Envoy's ``RING_HASH`` on the
  ``x-adapter-id`` header), every adapter always on the same replica;
- ``bounded``: the same ring with bounded loads (Mirrokni, Thorup and Zadimoghaddam, 2018;
  Envoy's ``hash_balance_factor``): a replica already holding more than ``--balance-factor``
  times the average of the requests in flight is passed over for the next one on the ring.

Requests in flight are modelled as a closed loop: the last ``--concurrency`` requests are
in flight. Traffic is uniform or Zipf(1.1) over ``--adapters`` adapters. Cache statistics
skip the first fifth of the requests (warm-up). Batching and timing are not modelled: this
compares routing policies, it does not predict throughput.

    python deploy/affinity_sim.py            # the table in docs/deploy.md (~20 s)
    python deploy/affinity_sim.py --quick    # a smaller run (~1 s)
"""

from __future__ import annotations

import argparse
import hashlib
import math
import time
from bisect import bisect_right
from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np

POLICIES = ("random", "hash", "bounded")
DISTRIBUTIONS = ("uniform", "zipf")
ZIPF_EXPONENT = 1.1
RING_SIZE = 1024  # Envoy's default minimum_ring_size
WARMUP_FRACTION = 0.2
COLUMNS = (
    "traffic",
    "replicas",
    "routing",
    "GPU hit",
    "GPU hit, worst replica",
    "host or GPU hit",
    "disk loads / 1k req",
    "requests max/mean",
    "in flight p99 max/mean",
)


def stable_hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class Ring:
    """A consistent-hash ring with ``RING_SIZE`` points spread over the replicas."""

    def __init__(self, replicas: int):
        per_replica = math.ceil(RING_SIZE / replicas)
        points = sorted((stable_hash(f"replica-{r}-{v}"), r) for r in range(replicas) for v in range(per_replica))
        self.hashes = [h for h, _ in points]
        self.owners = [r for _, r in points]
        self.replicas = replicas

    def preference(self, key: str) -> list[int]:
        """Distinct replicas met walking clockwise from ``key``'s hash: owner first."""
        start = bisect_right(self.hashes, stable_hash(key))
        order: list[int] = []
        for i in range(len(self.owners)):
            owner = self.owners[(start + i) % len(self.owners)]
            if owner not in order:
                order.append(owner)
                if len(order) == self.replicas:
                    break
        return order


class TieredLRU:
    """GPU slots inside host memory, both LRU (with host >= GPU, GPU residents stay in host)."""

    def __init__(self, gpu_slots: int, host_slots: int):
        self.gpu: OrderedDict[int, None] = OrderedDict()
        self.host: OrderedDict[int, None] = OrderedDict()
        self.gpu_slots, self.host_slots = gpu_slots, host_slots

    def access(self, adapter: int) -> str:
        """'gpu', 'host' or 'disk': where the adapter was found; it is then in both tiers."""
        if adapter in self.gpu:
            where = "gpu"
        elif adapter in self.host:
            where = "host"
        else:
            where = "disk"
        for tier, slots in ((self.gpu, self.gpu_slots), (self.host, self.host_slots)):
            if adapter in tier:
                tier.move_to_end(adapter)
            else:
                tier[adapter] = None
                if len(tier) > slots:
                    tier.popitem(last=False)
        return where


@dataclass(frozen=True)
class Setup:
    adapters: int = 1024
    gpu_slots: int = 32
    host_slots: int = 128
    requests: int = 100_000
    concurrency: int = 256
    balance_factor: float = 1.25
    seed: int = 0


def traffic(setup: Setup, distribution: str, rng: np.random.Generator) -> np.ndarray:
    """Adapter index per request; Zipf ranks are shuffled so popularity ignores the hash."""
    if distribution == "uniform":
        return rng.integers(0, setup.adapters, setup.requests)
    weights = 1.0 / np.arange(1, setup.adapters + 1) ** ZIPF_EXPONENT
    ranks = rng.choice(setup.adapters, setup.requests, p=weights / weights.sum())
    return rng.permutation(setup.adapters)[ranks]


def simulate(setup: Setup, replicas: int, policy: str, requests: np.ndarray, rng: np.random.Generator) -> dict:
    caches = [TieredLRU(setup.gpu_slots, setup.host_slots) for _ in range(replicas)]
    ring = Ring(replicas)
    preference = [ring.preference(f"adapter-{a:05d}") for a in range(setup.adapters)]
    random_choice = rng.integers(0, replicas, len(requests))
    in_flight = [0] * replicas
    window: deque[int] = deque()
    capacity = math.ceil(setup.balance_factor * setup.concurrency / replicas)
    warmup = int(len(requests) * WARMUP_FRACTION)
    found = np.zeros((replicas, 3), dtype=np.int64)  # gpu, host, disk per replica, after warm-up
    routed = np.zeros(replicas, dtype=np.int64)
    flight_ratio = []
    where_index = {"gpu": 0, "host": 1, "disk": 2}

    for i, adapter in enumerate(requests.tolist()):
        if len(window) == setup.concurrency:  # the oldest request in flight completes
            in_flight[window.popleft()] -= 1
        if policy == "random":
            replica = int(random_choice[i])
        elif policy == "hash":
            replica = preference[adapter][0]
        else:
            replica = next((r for r in preference[adapter] if in_flight[r] < capacity), preference[adapter][0])
        in_flight[replica] += 1
        window.append(replica)
        where = caches[replica].access(adapter)
        if i >= warmup:
            found[replica, where_index[where]] += 1
            routed[replica] += 1
            if i % 64 == 0:
                flight_ratio.append(max(in_flight) / (len(window) / replicas))

    served = found.sum(axis=1)
    gpu_per_replica = found[:, 0] / np.maximum(served, 1)
    total = found.sum(axis=0)
    n = total.sum()
    return {
        "gpu_hit": total[0] / n,
        "gpu_hit_worst": float(gpu_per_replica[served > 0].min()),
        "warm_hit": (total[0] + total[1]) / n,
        "disk_per_1k": 1000 * total[2] / n,
        "requests_max_over_mean": float(routed.max() / routed.mean()),
        "in_flight_p99_max_over_mean": float(np.percentile(flight_ratio, 99)),
    }


def run(setup: Setup, replica_counts: list[int]) -> list[dict]:
    rows = []
    for distribution in DISTRIBUTIONS:
        requests = traffic(setup, distribution, np.random.default_rng(setup.seed))
        for replicas in replica_counts:
            for policy in POLICIES:
                result = simulate(setup, replicas, policy, requests, np.random.default_rng(setup.seed + 1))
                rows.append({"traffic": distribution, "replicas": replicas, "routing": policy, **result})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        traffic_name = "Zipf(1.1)" if row["traffic"] == "zipf" else row["traffic"]
        cells = [
            traffic_name,
            str(row["replicas"]),
            row["routing"],
            f"{row['gpu_hit']:.1%}",
            f"{row['gpu_hit_worst']:.1%}",
            f"{row['warm_hit']:.1%}",
            f"{row['disk_per_1k']:.0f}",
            f"{row['requests_max_over_mean']:.2f}",
            f"{row['in_flight_p99_max_over_mean']:.2f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    defaults = Setup()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20,000 requests, 4 replicas (for tests)")
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--adapters", type=int, default=defaults.adapters)
    parser.add_argument("--gpu-slots", type=int, default=defaults.gpu_slots)
    parser.add_argument("--host-slots", type=int, default=defaults.host_slots)
    parser.add_argument("--requests", type=int, default=defaults.requests)
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency, help="requests in flight")
    parser.add_argument("--balance-factor", type=float, default=defaults.balance_factor, help="bounded: 1.25 = 125%%")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.replicas = 20_000, [4]
    if args.host_slots < args.gpu_slots or args.balance_factor < 1.0:
        parser.error("need --host-slots >= --gpu-slots and --balance-factor >= 1")
    setup = Setup(
        args.adapters, args.gpu_slots, args.host_slots, args.requests, args.concurrency, args.balance_factor, args.seed
    )
    started = time.perf_counter()
    rows = run(setup, args.replicas)
    print(
        f"{setup.adapters} adapters, LRU of {setup.gpu_slots} GPU / {setup.host_slots} host slots per replica, "
        f"{setup.requests} requests ({WARMUP_FRACTION:.0%} warm-up), {setup.concurrency} in flight, "
        f"bounded-load factor {setup.balance_factor}, seed {setup.seed}\n"
    )
    print(markdown(rows))
    print(f"\n({time.perf_counter() - started:.1f} s)")


if __name__ == "__main__":
    main()
