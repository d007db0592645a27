"""Operations the GPU stage's heads (step B, ``Engine.compact_begin``) dispatch for one chunk:
a host-time proxy that needs no GPU. On the GPU stage every operation is a launch or a copy
issued from Python, and each hands the interpreter lock over (docs/architecture.md).

    python perf/count_head_ops.py --checkpoint models/demo-tiny --adapters DIR [--rows 64]

Counts every ATen operation that reaches the dispatcher (``TorchDispatchMode``) for a chunk of
one LoRA row, ``--rows`` rows with as many adapters as the folder holds (up to ``--rows``), and
``--rows`` base rows, all with the benchmark's entity schema. On the CPU a host-to-GPU copy is
a no-op, so the GPU's count is higher by its pinned copies.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from bench_engine import ENTITY_SCHEMA
from torch.utils._python_dispatch import TorchDispatchMode


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--adapters", type=Path, required=True)
    p.add_argument("--rows", type=int, default=64)
    args = p.parse_args(argv)

    from manylora.config import EngineConfig
    from manylora.demo import demo_texts
    from manylora.engine import Engine, Request

    names = sorted(d.name for d in args.adapters.iterdir() if d.name.startswith("adapter-"))[: args.rows]
    slots = str(max(1, len(names)))
    params = {"checkpoint": str(args.checkpoint), "adapter_dir": str(args.adapters)}
    engine = Engine(EngineConfig.from_parameters({**params, "max_gpu_adapters": slots, "max_cpu_adapters": slots}))
    schema = json.dumps(ENTITY_SCHEMA)
    for rows, adapters in ((1, names[:1]), (args.rows, names), (args.rows, [""])):
        texts = demo_texts(rows, seed=5, min_words=60, max_words=120)
        found: dict = {}
        chunk = [
            engine.prepare(i, Request(t, schema, adapter=adapters[i % len(adapters)]), found)
            for i, t in enumerate(texts)
        ]
        with torch.inference_mode():
            batch, states, slot_per_row = engine.forward(chunk)
            count = _Count()
            with count:
                engine.compact_begin(chunk, batch, states, engine._repin(chunk, slot_per_row))
        kind = "base" if adapters == [""] else f"{len(adapters)} adapters"
        print(f"{rows} rows, {kind}: {count.ops} operations in the heads (step B)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
