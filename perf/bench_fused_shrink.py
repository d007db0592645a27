"""One SGMV shrink for query, key and value (x read once) against three shrinks.

    python perf/bench_fused_shrink.py [--sizes 8192 16384 32768 61440] [--row-len 272] [--out FILE]

Why: every shrink runs at its bytes' floor (session 17), so the three of a layer's query, key and
value read the same x three times. One pass that loads each x tile once and takes three rank-16
dots, one per module's A, saves two of those reads. Session 21 measured it with an experimental
kernel in this script (commit f99d92d: 40,800 tokens, three shrinks 70.3 µs, one pass 31.9, one
read of x 30.1; perf/h200-2026-12-04/session21/f99d92d-fused-shrink.*), then built it into the
product (kernels/sgmv_shrink.py, sgmv_shrink_group). This version times the product's grouped
launch with the table's config and with every config of the sweep, the table's checked bit for bit
against the three single shrinks first (the others within float32 rounding). Prints one line per size; --out holds all timings.

    python perf/bench_fused_shrink.py --write-group [--sizes 16320 40800] [--row-len 272]

times the next step (session 22, kernels/sgmv_fused.py): the three shrinks and the three
write-first expands of q, k, v in one pass, against the split kernels and the bytes' floor.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_expand_variants import row_meta, size_arguments  # noqa: E402

CONFIGS = [
    {"BLOCK_M": m, "BLOCK_K": k, "num_warps": w, "num_stages": s}
    for m in (16, 32, 64)
    for k in (64, 128)
    for w in (4, 8)
    for s in (2, 3)
]


def make_case(tokens: int, row_len: int, slots: int, rank: int, hidden: int, device, gen):
    meta = row_meta(tokens, row_len, slots, rank, device)
    x = torch.randn(meta.num_tokens, hidden, generator=gen).to(device, torch.bfloat16)
    lora_as = [(0.05 * torch.randn(slots, rank, hidden, generator=gen)).to(device, torch.bfloat16) for _ in range(3)]
    return x, lora_as, meta


def three_shrinks(x, lora_as, meta, v):
    from manylora.kernels.sgmv_shrink import sgmv_shrink

    rank = lora_as[0].shape[1]
    for i, a in enumerate(lora_as):
        sgmv_shrink(x, a, meta, v[:, i * rank : (i + 1) * rank])
    return v


WRITE_CONFIGS = [
    {"BLOCK_M": m, "BLOCK_K": k, "BLOCK_N": n, "num_warps": w, "num_stages": 2}
    for m in (32, 64)
    for k in (64, 128)
    for n in (128, 256)
    for w in (4, 8)
]


def write_group_main(args) -> int:
    """--write-group: a layer's q, k, v LoRA written first in one pass (kernels/sgmv_fused.py)
    against the grouped shrink followed by three write-first expands (its bits checked equal), and
    against three accumulating expands after the base GEMM (what CUDA graphs ran before session 22)."""
    from bench_lora_calls import device_us
    from manylora.kernels.sgmv_expand import sgmv_expand
    from manylora.kernels.sgmv_fused import sgmv_write_group
    from manylora.kernels.sgmv_shrink import sgmv_shrink_group

    gen = torch.Generator().manual_seed(0)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    results, lines = [], []
    for tokens in args.sizes:
        x, lora_as, meta = make_case(tokens, args.row_len, args.slots, 16, 768, "cuda", gen)
        lora_bs = [
            (0.05 * torch.randn(args.slots, 768, 16, generator=gen)).to("cuda", torch.bfloat16) for _ in range(3)
        ]
        scales = [torch.rand(args.slots, generator=gen).add(0.5).cuda() for _ in range(3)]
        biases = [torch.randn(768, generator=gen).to("cuda", torch.bfloat16) for _ in range(3)]
        ys = [torch.empty_like(x) for _ in range(3)]
        vs = list(torch.zeros(3, x.shape[0], 16, device="cuda").unbind(0))

        def split(accumulate: bool):
            sgmv_shrink_group(x, lora_as, meta, vs)
            for v, b, s, y, bias in zip(vs, lora_bs, scales, ys, biases):
                sgmv_expand(v, b, s, meta, y, accumulate=accumulate, bias=None if accumulate else bias)

        def fused(cfg=None):
            sgmv_write_group(x, lora_as, lora_bs, scales, meta, ys, biases, config=cfg)

        split(False)
        want = [y.clone() for y in ys]
        fused()
        equal = all(torch.equal(y, w) for y, w in zip(ys, want))
        row = {"tokens": int(x.shape[0]), "bits_equal": equal}
        row["floor_us"] = device_us(lambda: (x.sum(dim=1), [y.fill_(1.0) for y in ys]), args.reps, flush)
        row["split_write_us"] = device_us(lambda: split(False), args.reps, flush)
        row["split_accumulate_us"] = device_us(lambda: split(True), args.reps, flush)
        row["fused_us"] = device_us(fused, args.reps, flush)
        tried = []
        for cfg in WRITE_CONFIGS:
            try:
                fused(cfg)
                torch.cuda.synchronize()
            except Exception as exc:  # out of resources: not a candidate
                tried.append({**cfg, "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
                continue
            diff = max(float((y.float() - w.float()).abs().max()) for y, w in zip(ys, want))
            entry = {**cfg, "max_diff": diff}
            if diff <= 0.05:  # another BLOCK_K sums in another order: a bfloat16 step at most
                entry["us"] = device_us(lambda: fused(cfg), args.reps, flush)
            tried.append(entry)
        ok = sorted((t for t in tried if "us" in t), key=lambda t: t["us"])
        row.update(configs=tried)
        results.append(row)
        keys = ("BLOCK_M", "BLOCK_K", "BLOCK_N", "num_warps")
        top = " | ".join(f"{[t[k] for k in keys]} {t['us']:.1f}" for t in ok[:4])
        lines.append(
            f"{row['tokens']:6} tokens: floor {row['floor_us']:.1f} µs, grouped shrink + 3 write-first expands "
            f"{row['split_write_us']:.1f}, + 3 accumulating {row['split_accumulate_us']:.1f}, one pass "
            f"{row['fused_us']:.1f} (bits equal: {equal}); best {top} ({len(ok)}/{len(tried)} ok)"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"query/key/value LoRA written first, 768 -> 3 x 16 -> 3 x 768, rows of {args.row_len} tokens")
    print("\n".join(lines))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    size_arguments(p, "perf/results/fused-shrink.json")
    p.add_argument("--write-group", action="store_true", help="time the shrink-and-write pass (sgmv_fused.py)")
    args = p.parse_args(argv)
    assert torch.cuda.is_available(), "a GPU measurement"
    if args.write_group:
        return write_group_main(args)
    from bench_lora_calls import device_us
    from manylora.kernels.sgmv_shrink import sgmv_shrink_group

    def grouped(x, lora_as, meta, v, cfg=None):
        sgmv_shrink_group(x, lora_as, meta, [v[:, i * 16 : (i + 1) * 16] for i in range(3)], config=cfg)
        return v

    gen = torch.Generator().manual_seed(0)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    results, lines = [], []
    for tokens in args.sizes:
        x, lora_as, meta = make_case(tokens, args.row_len, args.slots, 16, 768, "cuda", gen)
        v = torch.zeros(x.shape[0], 48, device="cuda")
        want = three_shrinks(x, lora_as, meta, v.clone())
        row = {
            "tokens": int(x.shape[0]),
            "three_us": device_us(lambda: three_shrinks(x, lora_as, meta, v), args.reps, flush),
        }
        row["x_read_us"] = device_us(lambda: x.sum(dim=1), args.reps, flush)  # one read of x: the floor of one shrink
        assert torch.equal(grouped(x, lora_as, meta, torch.zeros_like(v)), want)
        row["table_us"] = device_us(lambda: grouped(x, lora_as, meta, v), args.reps, flush)
        tried = []
        for cfg in CONFIGS:
            try:
                got = grouped(x, lora_as, meta, torch.zeros_like(v), cfg)
                torch.cuda.synchronize()
            except Exception as exc:  # out of resources: not a candidate
                tried.append({**cfg, "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
                continue
            entry = {**cfg, "max_diff": float((got - want).abs().max())}
            if entry["max_diff"] <= 1e-3 * float(want.abs().max()):  # another BLOCK_K sums in another order
                entry["us"] = device_us(lambda: grouped(x, lora_as, meta, v, cfg), args.reps, flush)
            tried.append(entry)
        ok = [t for t in tried if "us" in t]
        row.update(configs=tried, best=min(ok, key=lambda t: t["us"]) if ok else None)
        results.append(row)
        best = row["best"]
        desc = (
            "-"
            if best is None
            else f"{best['us']:.1f} {[best[k] for k in ('BLOCK_M', 'BLOCK_K', 'num_warps', 'num_stages')]}"
        )
        lines.append(
            f"{row['tokens']:6} tokens: three shrinks {row['three_us']:.1f} µs, one read of x {row['x_read_us']:.1f}, "
            f"grouped (table config) {row['table_us']:.1f}, best {desc} ({len(ok)}/{len(tried)} ok)"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(
        f"query/key/value shrinks, 768 -> 3 x 16, rows of {args.row_len} tokens, each its own adapter of {args.slots}"
    )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
