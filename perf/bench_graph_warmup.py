"""Does capturing the small shapes' CUDA graphs at load remove the first-use stalls?

    python perf/bench_graph_warmup.py --checkpoint models/demo-base --adapters DIR [--calls 300]

For ``cuda_graph_warmup_rows`` 0 (every graph on first use) and 16, in that order and in one
process: the engine's load time, then ``--calls`` GPU-stage calls (``Engine.run_core``) of 1-16
rows of varied lengths and random adapters, one after the other, as a light-to-moderate load
meets a fresh server. Prints load seconds, graphs captured, and the calls' p50 / p99 / max ms.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import ENTITY_SCHEMA  # noqa: E402  (same requests as the benchmarks)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--adapters", type=Path, required=True)
    p.add_argument("--in-flight", type=int, default=64)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--warmup-rows", type=int, nargs="+", default=[0, 16])
    args = p.parse_args(argv)

    from manylora.config import EngineConfig
    from manylora.demo import demo_texts
    from manylora.engine import Engine, Request

    names = sorted(d.name for d in args.adapters.iterdir() if d.name.startswith("adapter-"))[: args.in_flight]
    schema = json.dumps(ENTITY_SCHEMA)
    rng = random.Random(0)
    texts = demo_texts(400, seed=9, min_words=10, max_words=160)
    lines = []
    for rows in args.warmup_rows:
        params = {
            "checkpoint": str(args.checkpoint),
            "adapter_dir": str(args.adapters),
            "max_lora_rank": "16",
            "max_gpu_adapters": str(len(names)),
            "max_cpu_adapters": str(len(names)),
            "preload_adapters": ",".join(names),
            "cuda_graph_warmup_rows": str(rows),
        }
        started = time.perf_counter()
        engine = Engine(EngineConfig.from_parameters(params, device="cuda:0"))
        load = time.perf_counter() - started
        at_load = engine.graphs.stats["captures"]
        latencies = []
        for _ in range(args.calls):
            batch = rng.randint(1, 16)
            items = []
            for _ in range(batch):
                prepared = engine.pre.prepare(0, Request(rng.choice(texts), schema, adapter=rng.choice(names)))
                record = prepared.record
                items.append((record.input_ids, record.text_word_first_positions, schema, prepared.request.adapter,
                              prepared.t_min))  # fmt: skip
            t0 = time.perf_counter()
            engine.run_core(items)
            torch.cuda.synchronize()
            latencies.append((time.perf_counter() - t0) * 1e3)
        latencies.sort()
        pick = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))]  # noqa: E731
        lines.append(
            f"cuda_graph_warmup_rows {rows:>2}: load {load:5.1f} s, graphs at load {at_load:4d}, "
            f"captured during the calls {engine.graphs.stats['captures'] - at_load:4d}; {args.calls} calls of 1-16 rows: "
            f"p50 {pick(0.5):6.1f} ms  p99 {pick(0.99):7.1f} ms  max {latencies[-1]:7.1f} ms"
        )
        del engine
        torch.cuda.empty_cache()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
