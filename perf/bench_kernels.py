"""Benchmark the SGMV kernels against a per-adapter torch loop and the HBM byte floor.

    python perf/bench_kernels.py --out results.jsonl          # CUDA: the full grid
    python perf/bench_kernels.py --smoke --out smoke.jsonl    # any host: one tiny case
    python perf/bench_kernels.py --sweep NVIDIA_H200.json     # CUDA: retune the config table

Cases: bf16, rank 16, {1, 8, 32, 128} distinct adapters sharing T in {1024, 4096, 16384,
32768} tokens evenly (one contiguous segment each); shrink 768 -> 16, expand 16 -> 768
and 16 -> 3072. Each case times
  triton      the kernel (fp32 v, as lora_apply uses it)
  torch_loop  one matmul per adapter on its token slice (slicing is the index-select,
              since tokens are grouped): v[s:e] = x[s:e] @ A[slot]ᵀ, y[s:e].addmm_(...)
  floor       bytes that must cross HBM once / measured copy bandwidth: x, the A slices
              used and v for shrink; v, the B slices used, and y read + written for expand
Timing: events around each call, warm-up, L2 flushed before every run, median (Timer).
launch_us is the host time to issue one call (what a CUDA graph would remove).
One JSON line per case goes to --out; a table is printed last.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import statistics
import sys
import time

import torch

ADAPTERS = (1, 8, 32, 128)
TOKENS = (1024, 4096, 16384, 32768)
SHAPES = (("sgmv_shrink", 768, 16), ("sgmv_expand", 16, 768), ("sgmv_expand", 16, 3072))
RANK = 16
NUM_SLOTS = 128

SWEEP_SHRINK = [
    {"BLOCK_M": m, "BLOCK_K": k, "num_warps": w, "num_stages": s}
    for m, k, (w, s) in itertools.product((16, 32, 64, 128), (64, 128, 256), ((4, 2), (4, 3), (4, 4), (8, 3)))
]
SWEEP_EXPAND = [
    {"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": s}
    for m, n, (w, s) in itertools.product((16, 32, 64, 128), (64, 128, 256), ((2, 2), (4, 2), (8, 2)))
]
SWEEP_TOKENS = (16, 64, 256, 1024, 4096, 16384, 32768)
SWEEP_HIDDEN = (768, 1024, 3072, 4096)


class Timer:
    """Median device microseconds of one call, L2 flushed (by a 256 MiB read) before every run.

    On CUDA each timed run is queued behind a GPU sleep, so the host has issued the call
    before the start event fires: the number is the kernel's own time, not Python launch
    overhead (launch_us reports that separately). A call that takes the host longer than
    the sleep (the torch loop over many adapters) is timed as the host issues it, which
    is what it costs in serving too. On CPU (smoke) it is a median of wall-clock runs.
    """

    SLEEP_CYCLES = 400_000  # ~200 us at 2 GHz: more than one launcher call takes the host

    def __init__(self, device: torch.device, rep_ms: float = 50.0):
        self.device, self.rep_ms = device, rep_ms
        if device.type == "cuda":
            self.flush = torch.ones(256 << 20, dtype=torch.uint8, device=device)

    def __call__(self, fn) -> float:
        if self.device.type != "cuda":
            fn()
            times = []
            for _ in range(3):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            return 1e6 * statistics.median(times)
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        reps = int(min(1000, max(10, self.rep_ms * 1e-3 / (time.perf_counter() - start + 300e-6))))
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for begin, end in events:
            # Flush by reading: a memset would leave L2 full of dirty lines whose write-back
            # the timed call would pay for.
            self.flush.max()
            torch.cuda._sleep(self.SLEEP_CYCLES)
            begin.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return 1e3 * statistics.median(begin.elapsed_time(end) for begin, end in events)


def launch_us(fn, device: torch.device, calls: int = 50) -> float:
    """Host microseconds to issue one call (no synchronization inside the loop)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 1e6 * elapsed / calls


def copy_bandwidth(device: torch.device, timer: Timer, num_bytes: int) -> float:
    """Bytes per second of a large device copy, counting bytes read plus bytes written."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    us = timer(lambda: dst.copy_(src))
    return 2 * num_bytes / (us * 1e-6)


def make_case(
    op: str,
    num_adapters: int,
    num_tokens: int,
    h_in: int,
    h_out: int,
    device: torch.device,
    segment_tokens: int | None = None,
):
    """One case. ``segment_tokens``: segments of that many tokens (one request's row each, as the
    GPU stage's chunks hold them), their slots cycling over NUM_SLOTS; else ``num_adapters``
    equal segments."""
    from manylora.kernels import build_sgmv_meta

    gen = torch.Generator().manual_seed(num_adapters * 100003 + num_tokens)
    if segment_tokens:
        slots = (torch.arange(num_tokens) // segment_tokens) % NUM_SLOTS
    else:
        slots = torch.arange(num_adapters).repeat_interleave(num_tokens // num_adapters)
        slots = torch.cat([slots, slots.new_full((num_tokens - len(slots),), num_adapters - 1)])
    meta = build_sgmv_meta(slot_per_token=slots.int(), device=device, max_rank=RANK)
    segments = meta.segments()
    dtype = torch.bfloat16
    case = {"meta": meta, "segments": segments}
    if op == "sgmv_shrink":
        case["x"] = torch.randn(num_tokens, h_in, generator=gen).to(device, dtype)
        case["lora_a"] = (torch.randn(NUM_SLOTS, RANK, h_in, generator=gen) / h_in**0.5).to(device, dtype)
        case["v"] = torch.empty(num_tokens, RANK, dtype=torch.float32, device=device)
        case["v_loop"] = torch.empty(num_tokens, RANK, dtype=dtype, device=device)
    else:
        case["v"] = torch.randn(num_tokens, RANK, generator=gen).to(device)
        case["v_loop"] = case["v"].to(dtype)
        case["lora_b"] = (torch.randn(NUM_SLOTS, h_out, RANK, generator=gen) / RANK**0.5).to(device, dtype)
        case["scales"] = torch.rand(NUM_SLOTS, generator=gen).to(device) + 0.5
        case["y"] = torch.randn(num_tokens, h_out, generator=gen).to(device, dtype)
    return case


def kernel_fn(op: str, case: dict, config: dict | None = None):
    if op == "sgmv_shrink":
        from manylora.kernels.sgmv_shrink import sgmv_shrink

        return lambda: sgmv_shrink(case["x"], case["lora_a"], case["meta"], case["v"], config=config)
    from manylora.kernels.sgmv_expand import sgmv_expand

    return lambda: sgmv_expand(case["v"], case["lora_b"], case["scales"], case["meta"], case["y"], config=config)


def loop_fn(op: str, case: dict):
    segments = [s for s in case["segments"] if s[2] >= 0]
    if op == "sgmv_shrink":
        x, lora_a, v = case["x"], case["lora_a"], case["v_loop"]

        def run():
            for start, end, slot in segments:
                torch.matmul(x[start:end], lora_a[slot].t(), out=v[start:end])

        return run
    v, lora_b, y = case["v_loop"], case["lora_b"], case["y"]
    scales = case["scales"].tolist()

    def run():
        for start, end, slot in segments:
            y[start:end].addmm_(v[start:end], lora_b[slot].t(), alpha=scales[slot])

    return run


def floor_bytes(op: str, num_adapters: int, num_tokens: int, h_in: int, h_out: int) -> int:
    bf16, fp32 = 2, 4
    if op == "sgmv_shrink":
        return num_tokens * h_in * bf16 + num_adapters * RANK * h_in * bf16 + num_tokens * RANK * fp32
    return num_tokens * RANK * fp32 + num_adapters * h_out * RANK * bf16 + 2 * num_tokens * h_out * bf16


def check(op: str, case: dict) -> None:
    """The kernel result against the float32 reference, within the shared tolerance."""
    from manylora.kernels import TOLERANCES, sgmv_expand_ref, sgmv_shrink_ref

    atol, rtol = TOLERANCES[torch.bfloat16]
    if op == "sgmv_shrink":
        kernel_fn(op, case)()
        expected = sgmv_shrink_ref(case["x"], case["lora_a"], case["meta"], torch.empty_like(case["v"]))
        torch.testing.assert_close(case["v"], expected, atol=atol, rtol=rtol)
    else:
        y0 = case["y"].clone()
        kernel_fn(op, case)()
        expected = sgmv_expand_ref(case["v"], case["lora_b"], case["scales"], case["meta"], y0)
        torch.testing.assert_close(case["y"].float(), expected.float(), atol=atol, rtol=rtol)


def machine(device: torch.device) -> dict:
    import triton

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {"device": name, "torch": torch.__version__, "triton": triton.__version__, "host": platform.node()}


def run_grid(args, device: torch.device) -> list[dict]:
    from manylora.kernels.launch_config import get_config, rank_block

    timer = Timer(device)
    bandwidth = copy_bandwidth(device, timer, (1 << 30) if device.type == "cuda" else (64 << 20))
    if args.smoke:
        grid = [("sgmv_shrink", 2, 64, 64, RANK), ("sgmv_expand", 2, 64, RANK, 48)]
    else:
        grid = [(op, n, t, h_in, h_out) for op, h_in, h_out in SHAPES for t in TOKENS for n in ADAPTERS]
    info = machine(device)
    rows = []
    for op, num_adapters, num_tokens, h_in, h_out in grid:
        case = make_case(op, num_adapters, num_tokens, h_in, h_out, device)
        check(op, case)
        fn, loop = kernel_fn(op, case), loop_fn(op, case)
        triton_us, loop_us = timer(fn), timer(loop)
        num_bytes = floor_bytes(op, num_adapters, num_tokens, h_in, h_out)
        floor_us = 1e6 * num_bytes / bandwidth
        hidden = h_in if op == "sgmv_shrink" else h_out
        rows.append(
            {
                "case": op,
                "adapters": num_adapters,
                "tokens": num_tokens,
                "h_in": h_in,
                "h_out": h_out,
                "rank": RANK,
                "dtype": "bfloat16",
                "triton_us": round(triton_us, 3),
                "torch_loop_us": round(loop_us, 3),
                "floor_us": round(floor_us, 3),
                "floor_bytes": num_bytes,
                "over_floor": round(triton_us / floor_us, 3),
                "speedup_vs_loop": round(loop_us / triton_us, 3),
                "launch_us": round(launch_us(fn, device, 5 if args.smoke else 50), 3),
                "copy_bandwidth_gbps": round(bandwidth / 1e9, 1),
                "config": get_config(op, device, num_tokens, hidden, rank_block(RANK)),
                **info,
                "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            }
        )
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"copy bandwidth {rows[0]['copy_bandwidth_gbps']} GB/s on {rows[0]['device']}")
    print(
        f"{'op':12} {'H':>9} {'adapters':>8} {'tokens':>6} {'triton_us':>10} {'loop_us':>10} "
        f"{'floor_us':>9} {'x floor':>8} {'x loop':>7}"
    )
    for r in rows:
        shape = f"{r['h_in']}->{r['h_out']}"
        print(
            f"{r['case']:12} {shape:>9} {r['adapters']:8} {r['tokens']:6} {r['triton_us']:10.1f} "
            f"{r['torch_loop_us']:10.1f} {r['floor_us']:9.1f} {r['over_floor']:8.2f} {r['speedup_vs_loop']:7.1f}"
        )


def sweep(args, device: torch.device) -> None:
    """Time every candidate config per (op, token bucket, hidden) with 8 adapters (or segments
    of ``--sweep-segment-tokens``) and write the fastest as a config table (keys as
    launch_config.py reads them)."""
    import triton

    timer = Timer(device, rep_ms=15)
    segments = args.sweep_segment_tokens
    workload = f"segments of {segments} tokens over {NUM_SLOTS} adapters" if segments else "8 adapters"
    table = {
        "_about": f"Tuned by perf/bench_kernels.py --sweep on {machine(device)['device']}, "
        f"bf16, rank {RANK}, {workload}; keys: see launch_config.py."
    }
    for op, candidates in (("sgmv_shrink", SWEEP_SHRINK), ("sgmv_expand", SWEEP_EXPAND)):
        entries = {}
        for num_tokens in args.sweep_tokens:
            best_any = {}
            for hidden in args.sweep_hidden:
                h_in, h_out = (hidden, RANK) if op == "sgmv_shrink" else (RANK, hidden)
                case = make_case(op, min(8, num_tokens), num_tokens, h_in, h_out, device, segments)
                times = []
                for config in candidates:
                    try:
                        us = timer(kernel_fn(op, case, config))
                    except triton.runtime.errors.OutOfResources:  # too much shared memory
                        us = float("inf")
                    times.append((us, config))
                    best_any.setdefault(json.dumps(config), []).append(us)
                us, config = min(times, key=lambda t: t[0])
                entries[f"t{num_tokens}_h{hidden}_r{RANK}"] = config
                print(f"{op} T={num_tokens} H={hidden}: {us:.1f} us {config}", flush=True)
            # Wildcard entry: the config with the best geometric mean over the hidden sizes.
            best = min(best_any, key=lambda c: statistics.geometric_mean(best_any[c]))
            entries[f"t{num_tokens}_h*_r*"] = json.loads(best)
        table[op] = entries
    with open(args.sweep, "w") as f:
        f.write(format_table(table))
    print(f"wrote {args.sweep}")


def format_table(table: dict) -> str:
    """JSON with one entry per line, so diffs of retuned tables stay readable."""
    lines = ["{", f'  "_about": {json.dumps(table["_about"])},']
    ops = [op for op in table if op != "_about"]
    for i, op in enumerate(ops):
        lines.append(f'  "{op}": {{')
        keys = list(table[op])
        for j, key in enumerate(keys):
            comma = "," if j < len(keys) - 1 else ""
            lines.append(f'    "{key}": {json.dumps(table[op][key])}{comma}')
        lines.append("  }" + ("," if i < len(ops) - 1 else ""))
    lines.append("}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="append one JSON line per case to this file")
    parser.add_argument("--smoke", action="store_true", help="one tiny case; runs on CPU under the Triton interpreter")
    parser.add_argument("--sweep", metavar="TABLE_JSON", help="time candidate configs and write a config table")
    parser.add_argument("--sweep-tokens", type=int, nargs="+", default=list(SWEEP_TOKENS), help="token buckets swept")
    parser.add_argument("--sweep-hidden", type=int, nargs="+", default=list(SWEEP_HIDDEN), help="hidden sizes swept")
    parser.add_argument(
        "--sweep-segment-tokens",
        type=int,
        help="sweep on segments of this many tokens (one row each, slots cycling) instead of 8 adapters",
    )
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    if not cuda:
        if not args.smoke:
            parser.error("the full benchmark and --sweep need CUDA; use --smoke on CPU")
        # Before any kernel module is imported: @triton.jit reads it at definition time.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = torch.device("cuda" if cuda else "cpu")
    if args.sweep:
        sweep(args, device)
        return 0
    if not args.out:
        parser.error("--out is required")
    rows = run_grid(args, device)
    with open(args.out, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
