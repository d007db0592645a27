"""Every SGMV call of one encoder forward of a GPU-stage chunk: its device time inside the
forward, the same call alone on the same tensors, the bytes' floor measured beside it, and the
expand's and shrink's launch variants on those tensors.

    python perf/bench_lora_calls.py --checkpoint models/demo-base --adapters DIR [--rows 256]

Why: inside the engine the expand took 31.2 ms per 1,024 rows (session 16) where the kernel
sweep on synthetic chunks of the same shape predicted about 13 ms; the sweep's table made the
engine slower. This measures the calls the engine really makes (module, width, epilogue, stride),
so a launch table or a kernel change is judged on them. Prints one line per call of --layer and
the forward's totals per module; writes everything to --out as JSON. Columns: in-fwd (profiler),
alone (events, L2 flushed before each run: the flush keeps the GPU busy while the call is
launched), hot (events, back to back: includes the host's launch gap, so not a device time),
floor (torch's pass over the same bytes), best (the fastest launch variant).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import ENTITY_SCHEMA, pick_adapters  # noqa: E402  (same requests as the benchmarks)

EXPAND_VARIANTS = [
    {"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": 2}
    for m in (16, 32, 64, 128)
    for n in (64, 128, 256)
    for w in (2, 4, 8)
    if m * n <= 128 * 128
]
SHRINK_VARIANTS = [
    {"BLOCK_M": m, "BLOCK_K": k, "num_warps": w, "num_stages": s}
    for m in (16, 32, 64, 128)
    for k in (64, 128, 256)
    for w in (4, 8)
    for s in (2, 3)
    if m * k <= 128 * 128
]


@torch.inference_mode()  # the recorded tensors are inference tensors: updated in place here
def device_us(fn, reps: int, flush: torch.Tensor | None) -> float:
    """Median device time of ``fn`` in µs (CUDA events), L2 flushed before each run if given."""
    times = []
    for _ in range(reps):
        if flush is not None:
            flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def clone(t):
    if not isinstance(t, torch.Tensor):
        return t
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    return out.copy_(t)


def main(argv=None) -> int:
    from manylora.kernels import sgmv_expand, sgmv_shrink

    from manylora.config import EngineConfig
    from manylora.demo import demo_texts
    from manylora.engine import Engine, Request

    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--adapters", type=Path, required=True)
    p.add_argument("--adapters-in-flight", type=int, default=1024)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--layer", type=int, default=5, help="the layer whose calls are replayed alone")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", type=Path, default=Path("perf/results/lora-calls.json"))
    args = p.parse_args(argv)
    assert torch.cuda.is_available(), "a GPU measurement"

    names = sorted(d.name for d in args.adapters.iterdir() if d.name.startswith("adapter-"))
    names = names[: args.adapters_in_flight]
    params = {
        "checkpoint": str(args.checkpoint),
        "max_lora_rank": "16",
        "cpu_threads": "2",
        "cuda_graphs": "off",  # one eager forward: every launch is seen with its arguments
        "adapter_dir": str(args.adapters),
        "max_gpu_adapters": str(len(names)),
        "max_cpu_adapters": str(len(names)),
        "preload_adapters": "all",
    }
    engine = Engine(EngineConfig.from_parameters(params, device="cuda:0"))
    schema = json.dumps(ENTITY_SCHEMA)
    texts = demo_texts(args.rows, seed=5, min_words=60, max_words=120)
    adapters = pick_adapters(names, args.rows, "uniform", 0)
    prepared = [engine.prepare(i, Request(t, schema, adapter=a)) for i, (t, a) in enumerate(zip(texts, adapters))]
    chunk = max(engine._chunks(prepared), key=len)

    calls: list[dict] = []  # every SGMV call of the recorded forward, in launch order
    recording = {"on": False}
    per_layer = 2 * sum(1 for n in engine.encoder.linears() if ".layer.0." in n)  # a shrink and an expand each
    real = {"sgmv_expand": sgmv_expand.sgmv_expand, "sgmv_shrink": sgmv_shrink.sgmv_shrink}

    def wrap(op):
        def call(*a, **kw):
            if recording["on"]:
                i = len(calls)
                info = {"op": op, "i": i, "T": int(a[0].shape[0])}
                if op == "sgmv_expand":
                    v, lora_b, scales, meta, y = a[:5]
                    info.update(
                        h=int(lora_b.shape[1]),
                        y_stride=int(y.stride(0)),
                        accumulate=kw.get("accumulate", True),
                        residual=kw.get("residual") is not None,
                        gelu=bool(kw.get("gelu")),
                        bias=kw.get("bias") is not None,
                    )
                else:
                    info.update(h=int(a[0].shape[1]))
                info["layer"] = i // per_layer
                if info["layer"] == args.layer:
                    info["args"] = ([clone(t) for t in a], {k: clone(t) for k, t in kw.items()}, a[3])
                calls.append(info)
            return real[op](*a, **kw)

        return call

    sgmv_expand.sgmv_expand = wrap("sgmv_expand")  # kernels.expand imports it at each call
    sgmv_shrink.sgmv_shrink = wrap("sgmv_shrink")

    with torch.inference_mode():
        engine.forward(list(chunk))  # compile, warm
        torch.cuda.synchronize()
        recording["on"] = True
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            engine.forward(list(chunk))
            torch.cuda.synchronize()
        recording["on"] = False
    kernel_events = sorted(
        (e for e in prof.events() if e.name in ("_sgmv_expand_kernel", "_sgmv_shrink_kernel")),
        key=lambda e: e.time_range.start,
    )
    assert len(kernel_events) == len(calls), f"{len(kernel_events)} kernels for {len(calls)} calls"
    assert len(calls) == per_layer * len(engine.encoder.layers), f"{len(calls)} calls: not every linear adapted"
    for info, event in zip(calls, kernel_events):
        assert event.name == "_" + info["op"] + "_kernel", (event.name, info["op"])
        info["in_forward_us"] = event.time_range.end - event.time_range.start

    # module of each call: linears run in order, one shrink then one expand each
    order = [n.split(".layer.0.", 1)[1] for n in engine.encoder.linears() if ".layer.0." in n]
    for info in calls:
        info["module"] = order[(info["i"] % per_layer) // 2]

    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    rows = []
    for info in calls:
        if "args" not in info:
            continue
        a, kw, meta = info.pop("args")
        fn = real[info["op"]]
        info["alone_us"] = device_us(lambda: fn(*a, **kw), args.reps, flush)
        info["alone_hot_us"] = device_us(lambda: fn(*a, **kw), args.reps, None)
        if info["op"] == "sgmv_expand":  # the floor: torch's own pass over the same y bytes
            y = a[4]
            view = y if info["h"] == y.shape[1] else y[:, : info["h"]]
            if info["accumulate"]:
                floor = (lambda: view.add_(kw["residual"])) if info["residual"] else (lambda: view.mul_(1.0))
            else:
                floor = lambda: view.fill_(0)  # noqa: E731
            variants = EXPAND_VARIANTS
        else:
            x = a[0]
            floor = lambda: x.sum(dim=1)  # noqa: E731  (reads x once)
            variants = SHRINK_VARIANTS
        info["floor_us"] = device_us(floor, args.reps, flush)
        tried = []
        for config in variants:
            try:
                us = device_us(lambda: fn(*a, **kw, config=config), max(5, args.reps // 2), flush)
            except Exception as exc:  # out of resources: not a candidate
                tried.append({"config": config, "error": type(exc).__name__})
                continue
            tried.append({"config": config, "us": us})
        ok = [t for t in tried if "us" in t]
        info["best"] = min(ok, key=lambda t: t["us"]) if ok else None
        info["variants"] = tried
        rows.append(info)

    totals: dict[str, float] = {}
    for info in calls:
        key = f"{info['op'].split('_')[1]} {info['module']}"
        totals[key] = totals.get(key, 0.0) + info["in_forward_us"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows_in_chunk": len(chunk), "calls": calls, "totals_us": totals}, indent=1))

    tokens = calls[0]["T"] if calls else 0
    print(f"chunk of {len(chunk)} rows, {tokens} tokens, {len(calls)} SGMV calls per forward; layer {args.layer}:")
    print("op      module                      H     flags        in-fwd  alone  hot   floor  best (config)")
    for r in rows:
        flags = (
            ("acc" if r.get("accumulate", True) else "write")
            + ("+res" if r.get("residual") else "")
            + ("+gelu" if r.get("gelu") else "")
        )
        best = r["best"]
        best_s = f"{best['us']:.1f} {best['config']}" if best else "-"
        print(
            f"{r['op'][5:]:7} {r['module']:26} {r['h']:5} {flags:12} {r['in_forward_us']:6.1f} "
            f"{r['alone_us']:6.1f} {r['alone_hot_us']:5.1f} {r['floor_us']:6.1f}  {best_s}"
        )
    print("forward totals (µs): " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(totals.items())))
    print(f"sum {sum(totals.values()):.0f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
