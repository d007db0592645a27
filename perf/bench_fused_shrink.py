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


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    size_arguments(p, "perf/results/fused-shrink.json")
    args = p.parse_args(argv)
    assert torch.cuda.is_available(), "a GPU measurement"
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
