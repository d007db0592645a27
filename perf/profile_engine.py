"""Where does a batch's time go? One engine batch under torch.profiler (GPU kernels) and
cProfile (host Python), for the base model and with per-request adapters.

    python perf/profile_engine.py --checkpoint models/demo-base [--adapters DIR --adapters-in-flight 1024]

Prints the top CUDA kernels of ``forward`` and the top host functions of ``prepare`` +
``decode``; writes the full tables under --out.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import statistics
import time
from pathlib import Path

import torch


def _stats(profile: cProfile.Profile, sort: str, limit: int) -> str:
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats(sort).print_stats(limit)
    return out.getvalue()


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--adapters", type=Path)
    p.add_argument("--adapters-in-flight", type=int, default=0)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--out", type=Path, default=Path("perf/results/profile"))
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    from manylora.config import EngineConfig
    from manylora.demo import demo_texts
    from manylora.engine import Engine, Request, freeze_long_lived

    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    params = {"checkpoint": str(args.checkpoint), "max_lora_rank": "16"}
    names: list[str] = []
    if args.adapters and args.adapters_in_flight:
        params.update(
            adapter_dir=str(args.adapters),
            max_gpu_adapters=str(args.adapters_in_flight),
            max_cpu_adapters=str(args.adapters_in_flight),
            preload_adapters="all",
        )
        names = sorted(d.name for d in args.adapters.iterdir() if d.name.startswith("adapter-"))
        names = names[: args.adapters_in_flight]
    pr = cProfile.Profile()
    started = time.perf_counter()
    pr.enable()
    engine = Engine(EngineConfig.from_parameters(params, device=device))  # with names: preloads them all
    pr.disable()
    print(f"engine start-up with {len(names)} adapters preloaded: {time.perf_counter() - started:.1f} s")
    freeze_long_lived()  # as each server instance does, after start-up
    table = _stats(pr, "cumulative", 30)
    (args.out / f"init-{len(names)}.txt").write_text(table)
    print("\n".join(table.splitlines()[:45]))
    schema = json.dumps({"entities": ["person", "organization", "location", "date", "product"]})
    texts = demo_texts(args.batch, seed=42, min_words=60, max_words=120)
    requests = [Request(t, schema, adapter=names[i % len(names)] if names else "") for i, t in enumerate(texts)]
    tag = f"lora{len(names)}" if names else "base"

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    gc_pauses: list[tuple[int, float]] = []  # (generation, seconds) of every collection while timed

    def on_gc(phase, info, started=[0.0]):
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            gc_pauses.append((info["generation"], time.perf_counter() - started[0]))

    if names:  # what one per-request adapter check costs on this file system
        weights = args.adapters / names[0] / "adapter_model.safetensors"
        s0 = time.perf_counter()
        for _ in range(1000):
            os.stat(weights)
        stat_us = 1e3 * (time.perf_counter() - s0)
        s0 = time.perf_counter()
        for name in names[:256]:
            engine.store.get(name)
        print(f"os.stat {stat_us:.1f} us; store.get {1e6 * (time.perf_counter() - s0) / min(256, len(names)):.1f} us")
    print(
        f"gc: {len(gc.get_objects())} tracked objects, {gc.get_freeze_count()} frozen, thresholds {gc.get_threshold()}"
    )
    with torch.inference_mode():
        for _ in range(3):
            engine.run(requests)
        sync()
        gc.callbacks.append(on_gc)
        t0 = time.perf_counter()
        prepared = [engine.prepare(i, r) for i, r in enumerate(requests)]
        t1 = time.perf_counter()
        chunks = engine._chunks(prepared)
        chunk = max(chunks, key=len)  # the profiled forward is the largest chunk of the batch
        batch, states, slots = engine.forward(chunk)
        t2 = time.perf_counter()
        sync()
        t3 = time.perf_counter()
        engine.decode(chunk, batch, states, slots)
        sync()
        t4 = time.perf_counter()
        gc.callbacks.remove(on_gc)
        timings = {
            "gc_ms": round(1e3 * sum(t for _, t in gc_pauses), 2),
            "gc_full": sum(g == 2 for g, _ in gc_pauses),
            "pre_ms": 1e3 * (t1 - t0),
            "forward_launch_ms": 1e3 * (t2 - t1),
            "forward_sync_ms": 1e3 * (t3 - t1),
            "post_ms": 1e3 * (t4 - t3),
            "tokens": int(batch.input_ids.numel()),
            "rows": len(chunk),
            "chunks": [len(c) for c in chunks],
            "length": int(batch.input_ids.shape[1]),
        }
        print(tag, json.dumps(timings))

        # attention-bias backends side by side: forward time and answers
        from manylora.compare import result_differences

        def states_and_forward_ms(repeats: int = 5):
            """The chunk's encoder states (float32), and its mean forward wall time over ``repeats``."""
            states = engine.forward(list(chunk))[1].float()
            sync()
            t0 = time.perf_counter()
            for _ in range(repeats):
                engine.forward(list(chunk))
            sync()
            return states, 1e3 * (time.perf_counter() - t0) / repeats

        answers, forward_ms, states_by = {}, {}, {}
        for backend in ("torch", "triton") if device.startswith("cuda") else ("torch",):
            engine.encoder.backend = backend
            answers[backend] = engine.run(requests)
            states_by[backend], forward_ms[backend] = states_and_forward_ms()
        engine.encoder.backend = None
        if len(answers) == 2:
            # in bf16 the demo checkpoint's answers move with one-ulp changes of its (very large)
            # position scores, so a differing answer is not by itself a wrong kernel: the state
            # difference says how far apart the paths are (perf/check_posscores_accuracy.py
            # compares both against float32)
            diffs = [result_differences(a, b, atol=2e-2) for a, b in zip(answers["torch"], answers["triton"])]
            gap = (states_by["torch"] - states_by["triton"]).abs()
            print(
                f"{tag} forward ms by backend: {forward_ms}; encoder states differ by {gap.max().item():.3g} "
                f"(mean {gap.mean().item():.3g}); requests whose answers differ: "
                f"{sum(bool(d) for d in diffs)}/{len(diffs)} {[d for d in diffs if d][:3]}"
            )

        if names:  # the LoRA update after each base GEMM, or written first (bias + update, then addmm_)
            forward_by, states_by = {}, {}
            default = engine.encoder.lora_write_first
            orders = {"update after": False, "written first": True}
            try:
                for order, write_first in orders.items():
                    engine.encoder.lora_write_first = write_first
                    states_by[order], forward_by[order] = states_and_forward_ms()
            finally:
                engine.encoder.lora_write_first = default
            gaps = {
                order: round((states_by[order] - states_by["update after"]).abs().max().item(), 4)
                for order in orders
                if order != "update after"
            }
            print(f"{tag} forward ms by LoRA order: {forward_by}; encoder states differ from 'update after' by {gaps}")

        def launch_ms(repeats: int = 5) -> float:
            """Median host time of one forward call from an idle GPU (launches, no final sync)."""
            times = []
            for _ in range(repeats):
                sync()
                t0 = time.perf_counter()
                engine.forward(list(chunk))
                times.append(1e3 * (time.perf_counter() - t0))
            sync()
            return statistics.median(times)

        if names:  # every position module's factors at once (LoraBatch.prepare_positions) or one at a time
            from manylora.lora.batch import LoraBatch

            prepare = LoraBatch.prepare_positions
            by, states_by = {}, {}
            for way in ("at once", "one at a time"):
                if way == "one at a time":
                    LoraBatch.prepare_positions = lambda self, modules, window: None
                try:
                    states_by[way], wall = states_and_forward_ms()
                    by[way] = {"forward_ms": round(wall, 2), "launch_ms": round(launch_ms(), 2)}
                finally:
                    LoraBatch.prepare_positions = prepare
            gap = (states_by["at once"] - states_by["one at a time"]).abs().max().item()
            print(f"{tag} position factors: {by}; encoder states differ by {gap:.3g}")

        if device.startswith("cuda"):  # a host sync inside forward serialises launch and GPU time
            import traceback
            import warnings

            syncs: dict[str, int] = {}

            def record(*_args, **_kwargs):
                where = "".join(traceback.format_stack(limit=6)[:-2])
                syncs[where] = syncs.get(where, 0) + 1

            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = record
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    engine.forward(list(chunk))
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            print(f"{tag} host syncs in forward: {sum(syncs.values())}")
            for where, n in sorted(syncs.items(), key=lambda kv: -kv[1])[:6]:
                print(f"  x{n}\n{where}")
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(3):
            engine.forward(list(chunk))
        sync()
        pr.disable()
        table = _stats(pr, "tottime", 25)
        print(f"{tag} forward x3, host functions by own time:")
        print("\n".join(table.splitlines()[:40]))

        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
        with profile(activities=acts) as prof:
            batch, states, slots = engine.forward(chunk)
            sync()
        key = "cuda_time_total" if device.startswith("cuda") else "cpu_time_total"
        table = prof.key_averages().table(sort_by=key, row_limit=40)
        (args.out / f"forward-{tag}.txt").write_text(table)
        print(prof.key_averages().table(sort_by=key, row_limit=18))

        with profile(activities=acts) as prof:
            engine.decode(chunk, batch, states, slots)
            sync()
        table = prof.key_averages().table(sort_by=key, row_limit=40)
        (args.out / f"decode-torch-{tag}.txt").write_text(table)
        print(prof.key_averages().table(sort_by=key, row_limit=12))

        pr = cProfile.Profile()
        pr.enable()
        prepared = [engine.prepare(i, r) for i, r in enumerate(requests)]
        chunk = max(engine._chunks(prepared), key=len)
        batch, states, slots = engine.forward(chunk)
        engine.decode(chunk, batch, states, slots)
        sync()
        pr.disable()
        table = _stats(pr, "tottime", 45)
        (args.out / f"host-{tag}.txt").write_text(table)
        print(f"{tag} prepare + forward + decode, host functions by own time:")
        print("\n".join(table.splitlines()[:60]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
