"""One adapter-aware linear of GLiNER2-base on a 1,024-adapter batch: where its LoRA cost goes.

For each of the encoder's linear shapes (q/k/v/o 768 -> 768, FFN 768 -> 3072 and 3072 -> 768)
on 256 rows of 224 tokens, each row with its own adapter out of 1,024 rank-16 slots:

  base          F.linear alone (no LoRA)
  update after  F.linear, then shrink + expand read-modify-writing the output
  write first   shrink, expand writing bias + update (output never read), then the base GEMM
                adding itself in its epilogue (y.addmm_(x, Wᵀ)): LoraBatch.writes_first
  addmm_ alone  the epilogue-reading GEMM by itself

The LoRA forms are checked against each other before timing. ``--sweep`` also times
candidate launch configs for shrink and expand (both modes) on these shapes
and prints the best (the config table's largest bucket serves shrink and expand).

    python perf/bench_lora_linear.py [--sweep] [--out results.jsonl]     # CUDA

Times are device microseconds per call (bench_kernels.Timer: L2 flushed, median).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import Timer  # noqa: E402

SHAPES = [(768, 768), (768, 3072), (3072, 768)]
# --sweep candidates: bench_kernels' grids around the large-batch corner (BLOCK_M >= 32)
SWEEP_SHRINK = [
    {"BLOCK_M": m, "BLOCK_K": k, "num_warps": w, "num_stages": 3}
    for m in (32, 64, 128)
    for k in (64, 128, 256)
    for w in (4, 8)
]
SWEEP_EXPAND = [
    {"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": 2}
    for m in (32, 64, 128)
    for n in (64, 128, 256)
    for w in (4, 8)
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--length", type=int, default=224)
    p.add_argument("--slots", type=int, default=1024)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--sweep", action="store_true", help="time every candidate shrink/expand config too")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    from manylora import kernels

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: TRITON_INTERPRET=1 smoke
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    timer = Timer(device)
    row_slots = sorted(torch.randint(0, args.slots, (args.rows,), generator=gen).tolist())
    tokens = args.rows * args.length
    meta = kernels.build_sgmv_meta(slot_per_row=row_slots, row_len=args.length, device=device, max_rank=args.rank)
    rows = []
    for h_in, h_out in SHAPES:
        x = torch.randn(tokens, h_in, generator=gen).to(device, dtype)
        weight = (torch.randn(h_out, h_in, generator=gen) / h_in**0.5).to(device, dtype)
        bias = torch.randn(h_out, generator=gen).to(device, dtype)
        lora_a = (torch.randn(args.slots, args.rank, h_in, generator=gen) / h_in**0.5).to(device, dtype)
        lora_b = (torch.randn(args.slots, h_out, args.rank, generator=gen) / args.rank**0.5).to(device, dtype)
        scales = torch.full((args.slots,), 2.0, device=device)
        v = torch.empty(tokens, args.rank, dtype=torch.float32, device=device)

        def update_after():
            y = F.linear(x, weight, bias)
            return kernels.lora_apply(x, y, lora_a, lora_b, scales, meta, v=v)

        def write_first():
            y = x.new_empty(tokens, h_out)
            kernels.lora_apply(x, y, lora_a, lora_b, scales, meta, v=v, accumulate=False, bias=bias)
            return y.addmm_(x, weight.t())

        y_fixed = torch.randn(tokens, h_out, generator=gen).to(device, dtype)
        after, first = update_after().float(), write_first().float()
        gap = (after - first).abs().max().item()
        assert gap <= 0.05 * after.abs().max().item(), f"the LoRA forms differ by {gap}"
        case = {"tokens": tokens, "h_in": h_in, "h_out": h_out, "slots": args.slots, "rank": args.rank}
        for variant, fn in (
            ("base", lambda: F.linear(x, weight, bias)),
            ("update after", update_after),
            ("write first", write_first),
            ("addmm_ alone", lambda: y_fixed.addmm_(x, weight.t())),
        ):
            rows.append({**case, "variant": variant, "us": timer(fn), "max_gap": gap})
        if args.sweep:
            from manylora.kernels.sgmv_expand import sgmv_expand
            from manylora.kernels.sgmv_shrink import sgmv_shrink

            kernels.shrink(x, lora_a, meta, v)
            candidates = [("shrink", c, lambda c=c: sgmv_shrink(x, lora_a, meta, v, config=c)) for c in SWEEP_SHRINK]
            candidates.append(("shrink", "table", lambda: sgmv_shrink(x, lora_a, meta, v)))
            for accumulate in (True, False):
                op = "expand" if accumulate else "expand write"
                y = torch.empty(tokens, h_out, dtype=dtype, device=device)
                candidates += [
                    (
                        op,
                        c,
                        lambda c=c, a=accumulate, y=y: sgmv_expand(v, lora_b, scales, meta, y, config=c, accumulate=a),
                    )
                    for c in SWEEP_EXPAND
                ]
                candidates.append(
                    (op, "table", lambda a=accumulate, y=y: sgmv_expand(v, lora_b, scales, meta, y, accumulate=a))
                )
            best: dict = {}
            table: dict = {}
            for op, config, fn in candidates:
                us = timer(fn)
                rows.append({**case, "variant": f"sweep {op}", "config": config, "us": us})
                if config == "table":
                    table[op] = us
                elif op not in best or us < best[op][0]:
                    best[op] = (us, config)
            for op, (us, config) in best.items():
                print(f"{h_in}->{h_out} {op:12s} table {table[op]:8.1f} us, best {us:8.1f} us {config}", flush=True)
    if args.out:
        with args.out.open("w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"{'shape':>12}  {'variant':<14} {'us':>9}  {'LoRA us':>8}")
    for r in rows:
        if "config" in r:
            continue
        base = next(
            b["us"] for b in rows if b["variant"] == "base" and b["h_in"] == r["h_in"] and b["h_out"] == r["h_out"]
        )
        print(f"{r['h_in']:>5}->{r['h_out']:<5}  {r['variant']:<14} {r['us']:>9.1f}  {r['us'] - base:>8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
