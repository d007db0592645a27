"""In-process engine benchmark: every mode measured in the same run, reported as ratios too.

Modes
  base      ManyLoRA engine, no adapter on any request (the no-LoRA ceiling)
  manylora  ManyLoRA engine, a random adapter per request (uniform or Zipf) out of N
  hotswap   the path users run today: GLiNER2 + PEFT, one adapter active per forward behind a
            25-adapter LRU and one lock, loading from disk on a miss (time-capped: it is slow)

Each mode runs closed-loop batches of --batch requests (what Triton's dynamic batcher hands
execute()), after warm-up; it reports req/s, batch latency p50/p95/p99, and the split of
time into pre (validate + tokenize), core (encoder) and post (heads + decoding).

    python perf/bench_engine.py --checkpoint models/demo-base --adapters models/bench-adapters \\
        --adapters-in-flight 1 8 32 128 1024 --out perf/results/engine.jsonl
    python perf/bench_engine.py --smoke --out /tmp/engine.jsonl      # CPU, tiny, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path

import torch

ENTITY_SCHEMA = {"entities": ["person", "organization", "location", "date", "product"]}
MIXED_SCHEMA = {
    "classifications": [{"task": "sentiment", "labels": ["positive", "negative", "neutral"]}],
    "relations": ["works_for", "located_in"],
}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def pick_adapters(names, n_requests, distribution, seed):
    rng = random.Random(seed)
    if distribution == "uniform":
        return [rng.choice(names) for _ in range(n_requests)]
    weights = [1.0 / (rank + 1) ** 1.1 for rank in range(len(names))]  # Zipf(1.1)
    return rng.choices(names, weights=weights, k=n_requests)


def run_engine_mode(engine, texts, schema, adapters, batch, warmup_batches, device):
    from manylora.engine import Request

    requests = [Request(t, json.dumps(schema), adapter=a) for t, a in zip(texts, adapters)]
    batches = [requests[i : i + batch] for i in range(0, len(requests), batch)]
    for b in batches[:warmup_batches]:
        engine.run(b)
    _sync(device)
    latencies, split = [], {"pre": 0.0, "core": 0.0, "post": 0.0}
    errors = 0
    start = time.perf_counter()
    for b in batches[warmup_batches:]:
        t0 = time.perf_counter()
        prepared = [engine.prepare(i, r) for i, r in enumerate(b)]
        t1 = time.perf_counter()
        outs = []
        for chunk in engine._chunks(prepared):
            c0 = time.perf_counter()
            batch_, states, slots = engine.forward(chunk)
            _sync(device)
            c1 = time.perf_counter()
            outs.extend(engine.decode(chunk, batch_, states, slots))
            c2 = time.perf_counter()
            split["core"] += c1 - c0
            split["post"] += c2 - c1
        split["pre"] += t1 - t0
        errors += sum(not isinstance(o, dict) for o in outs)
        latencies.append(time.perf_counter() - t0)
    elapsed = time.perf_counter() - start
    n = sum(len(b) for b in batches[warmup_batches:])
    return {
        "requests": n,
        "seconds": elapsed,
        "req_per_s": n / elapsed,
        "errors": errors,
        "batch_p50_ms": 1e3 * _percentile(latencies, 50),
        "batch_p95_ms": 1e3 * _percentile(latencies, 95),
        "batch_p99_ms": 1e3 * _percentile(latencies, 99),
        "split_s": {k: round(v, 4) for k, v in split.items()},
    }


class HotSwapServer:
    """GLiNER2 + PEFT hot-swap behind an LRU of ``capacity`` adapters and one lock."""

    def __init__(self, checkpoint, adapter_root, capacity, device, dtype):
        from gliner2 import GLiNER2

        self.model = GLiNER2.from_pretrained(str(checkpoint)).to(device=device, dtype=dtype).eval()
        self.root, self.capacity, self.device, self.dtype = Path(adapter_root), capacity, device, dtype
        self.peft = None
        self.lru: OrderedDict[str, None] = OrderedDict()
        self.lock = threading.Lock()
        self.disk_loads = 0

    def _activate(self, name):
        from peft import PeftModel

        if name in self.lru:
            self.lru.move_to_end(name)
        else:
            path = str(self.root / name)
            if self.peft is None:
                self.peft = PeftModel.from_pretrained(self.model, path, adapter_name=name)
            else:
                self.peft.load_adapter(path, adapter_name=name)
            self.peft.to(device=self.device, dtype=self.dtype)
            self.disk_loads += 1
            self.lru[name] = None
            while len(self.lru) > self.capacity:
                victim, _ = self.lru.popitem(last=False)
                self.peft.delete_adapter(victim)
        self.peft.set_adapter(name)

    def extract(self, text, schema, name):
        with self.lock:
            self._activate(name)
            return self.model.batch_extract([text], schema)[0]


def run_hotswap_mode(server, texts, schema, adapters, seconds_cap, device):
    from gliner2.inference.schema import Schema

    schema_obj = Schema.from_dict(schema)
    latencies = []
    start = time.perf_counter()
    n = 0
    for text, name in zip(texts, adapters):
        t0 = time.perf_counter()
        server.extract(text, schema_obj, name)
        _sync(device)
        latencies.append(time.perf_counter() - t0)
        n += 1
        if time.perf_counter() - start > seconds_cap:
            break
    elapsed = time.perf_counter() - start
    return {
        "requests": n,
        "seconds": elapsed,
        "req_per_s": n / elapsed,
        "errors": 0,
        "batch_p50_ms": 1e3 * _percentile(latencies, 50),
        "batch_p95_ms": 1e3 * _percentile(latencies, 95),
        "batch_p99_ms": 1e3 * _percentile(latencies, 99),
        "disk_loads": server.disk_loads,
    }


def machine() -> dict:
    info = {"host": platform.node(), "python": platform.python_version(), "torch": torch.__version__}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="ManyLoRA in-process engine benchmark")
    p.add_argument("--checkpoint", type=Path)
    p.add_argument("--adapters", type=Path, help="folder of adapter folders (made if --make-adapters)")
    p.add_argument("--make-adapters", type=int, default=0, help="clone this many random rank-16 adapters")
    p.add_argument("--adapters-in-flight", type=int, nargs="+", default=[1, 8, 32, 128, 1024])
    p.add_argument("--distributions", nargs="+", default=["uniform", "zipf"])
    p.add_argument(
        "--modes", nargs="*", default=["base", "manylora", "hotswap"], help="none: only --make-adapters, then exit"
    )
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--gpu-slots", type=int, default=32)
    p.add_argument("--host-slots", type=int, default=128)
    p.add_argument("--max-rank", type=int, default=16)
    p.add_argument("--hotswap-seconds", type=float, default=20.0)
    p.add_argument(
        "--hotswap-at",
        type=int,
        nargs="*",
        default=None,
        help="adapters-in-flight values at which to run hotswap (default: all)",
    )
    p.add_argument(
        "--cold",
        action="store_true",
        help="start every case with empty adapter caches (default: preload the pool, steady state)",
    )
    p.add_argument("--words", type=int, nargs=2, default=[60, 120])
    p.add_argument("--schema", choices=["entities", "mixed"], default="entities")
    p.add_argument("--smoke", action="store_true", help="tiny CPU run in seconds (harness check)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)

    from manylora.config import EngineConfig
    from manylora.demo import build_demo_checkpoint, demo_texts
    from manylora.engine import Engine
    from manylora.lora.demo_adapters import DemoAdapter, build_demo_adapter, clone_random_adapters

    device = "cuda:0" if torch.cuda.is_available() and not args.smoke else "cpu"
    tmp = Path(tempfile.mkdtemp(prefix="manylora-bench-"))
    if args.smoke:
        args.checkpoint = build_demo_checkpoint(tmp / "demo-tiny", size="tiny")
        args.adapters, args.make_adapters = tmp / "adapters", 6
        args.adapters_in_flight, args.distributions = [1, 4], ["uniform"]
        args.batch, args.batches, args.warmup, args.gpu_slots, args.host_slots = 8, 2, 1, 2, 4
        args.hotswap_seconds = 2.0
    if args.make_adapters:
        template = args.adapters / "_template"
        if not (template / "adapter_model.safetensors").is_file():
            build_demo_adapter(
                args.checkpoint, template, DemoAdapter("template", 16, 32, ["encoder", "all_task_heads"]), seed=0
            )
        clone_random_adapters(template, args.adapters, args.make_adapters, seed=1)
        if not args.modes:
            return 0
    names = sorted(p.name for p in args.adapters.iterdir() if p.name.startswith("adapter-")) if args.adapters else []

    schema = ENTITY_SCHEMA if args.schema == "entities" else MIXED_SCHEMA
    n_requests = args.batch * (args.batches + args.warmup)
    texts = demo_texts(n_requests, seed=42, min_words=args.words[0], max_words=args.words[1])
    params = {
        "checkpoint": str(args.checkpoint),
        "max_gpu_adapters": str(args.gpu_slots),
        "max_cpu_adapters": str(args.host_slots),
        "max_lora_rank": str(args.max_rank),
    }
    if args.adapters:
        params["adapter_dir"] = str(args.adapters)
    engine = Engine(EngineConfig.from_parameters(params, device=device))
    dtype = engine.dtype
    rows = []

    def emit(row):
        row.update(
            {
                "machine": machine(),
                "device": device,
                "dtype": str(dtype),
                "batch": args.batch,
                "schema": args.schema,
                "gpu_slots": args.gpu_slots,
                "host_slots": args.host_slots,
            }
        )
        rows.append(row)
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(
            f"{row['mode']:9s} {row.get('adapters_in_flight', 0):5d} {row.get('distribution', '-'):8s} "
            f"{row['req_per_s']:9.1f} req/s  p95 {row['batch_p95_ms']:8.1f} ms  {row.get('split_s', '')}",
            flush=True,
        )

    if "base" in args.modes:
        emit(
            {
                "mode": "base",
                **run_engine_mode(engine, texts, schema, [""] * n_requests, args.batch, args.warmup, device),
            }
        )
    for k in args.adapters_in_flight:
        pool = names[:k]
        if len(pool) < k:
            print(f"skipping {k} adapters in flight: only {len(names)} adapters", file=sys.stderr)
            continue
        for dist in args.distributions:
            chosen = pick_adapters(pool, n_requests, dist, seed=k)
            if "manylora" in args.modes:
                engine.store.clear()
                if not args.cold:  # steady state: the pool is resident as far as the tiers allow
                    adapters = [engine.store.get(name) for name in pool]
                    for i in range(0, len(adapters), args.gpu_slots):
                        engine.store.acquire(adapters[i : i + args.gpu_slots])
                r = run_engine_mode(engine, texts, schema, chosen, args.batch, args.warmup, device)
                emit(
                    {
                        "mode": "manylora",
                        "adapters_in_flight": k,
                        "distribution": dist,
                        **r,
                        "loads": dict(engine.store.loads),
                        "caches": "cold" if args.cold else "preloaded",
                    }
                )
            if "hotswap" in args.modes and dist == "uniform" and (args.hotswap_at is None or k in args.hotswap_at):
                server = HotSwapServer(args.checkpoint, args.adapters, 25, device, dtype)
                r = run_hotswap_mode(server, texts, schema, chosen, args.hotswap_seconds, device)
                emit({"mode": "hotswap", "adapters_in_flight": k, "distribution": dist, **r})
                del server

    base = next((r for r in rows if r["mode"] == "base"), None)
    print("\nmode      adapters dist      req/s   x base  x hotswap")
    for r in rows:
        hot = next(
            (h for h in rows if h["mode"] == "hotswap" and h.get("adapters_in_flight") == r.get("adapters_in_flight")),
            None,
        )
        ratio_base = r["req_per_s"] / base["req_per_s"] if base else float("nan")
        ratio_hot = r["req_per_s"] / hot["req_per_s"] if hot else float("nan")
        print(
            f"{r['mode']:9s} {r.get('adapters_in_flight', 0):8d} {r.get('distribution', '-'):8s} "
            f"{r['req_per_s']:8.1f} {ratio_base:8.2f} {ratio_hot:9.1f}"
        )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
