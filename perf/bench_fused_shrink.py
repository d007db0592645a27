"""One SGMV shrink for query, key and value (x read once) against the three shrinks of today.

    python perf/bench_fused_shrink.py [--sizes 8192 16384 32768 61440] [--out FILE]   # GPU
    TRITON_INTERPRET=1 python perf/bench_fused_shrink.py --check                        # any host

Why: every shrink runs at its bytes' floor (session 17), so the three of a layer's query, key and
value read the same x three times. One pass that loads each x tile once and takes three rank-16
dots, one per module's A, would save two of those reads: ~45 µs a layer on a 32,760-token chunk by
the floor (docs/architecture.md, "What is not done yet"). Not in the product yet: this measures it
first. The experimental kernel here gives the product kernel's numbers (same tiles, same K steps);
``--check`` compares them on small shapes under the interpreter, and on the GPU every config is
checked against the product before it is timed. Prints one line per size; --out holds all timings.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_expand_variants import row_meta, size_arguments  # noqa: E402


@triton.jit
def _shrink3_kernel(
    x_ptr,  # [T, H_in]
    a0_ptr,  # [num_slots, R, H_in] each, same strides
    a1_ptr,
    a2_ptr,
    v_ptr,  # [T, 3 * R] fp32: module i's ranks at columns i * R
    tiles_ptr,  # the product's tile list (meta.py)
    h_in,
    stride_x_t,
    stride_a_slot,
    stride_a_r,
    stride_v_t,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    num_tiles = tl.load(tiles_ptr)
    for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        slot = tl.load(tiles_ptr + 1 + 3 * tile).to(tl.int64)
        tokens = tl.load(tiles_ptr + 2 + 3 * tile) + offs_m
        mask_m = tokens < tl.load(tiles_ptr + 3 + 3 * tile)
        x_ptrs = x_ptr + tokens.to(tl.int64)[:, None] * stride_x_t + offs_k[None, :]
        a_off = slot * stride_a_slot + offs_r[:, None] * stride_a_r + offs_k[None, :]
        acc0 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        acc1 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k in range(0, tl.cdiv(h_in, BLOCK_K)):  # H_in % BLOCK_K == 0 (checked by the launcher)
            x_tile = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
            a0 = tl.load(a0_ptr + a_off)
            a1 = tl.load(a1_ptr + a_off)
            a2 = tl.load(a2_ptr + a_off)
            if DOT_IN_FP32:
                x_tile, a0, a1, a2 = x_tile.to(tl.float32), a0.to(tl.float32), a1.to(tl.float32), a2.to(tl.float32)
            acc0 = tl.dot(x_tile, tl.trans(a0), acc0)
            acc1 = tl.dot(x_tile, tl.trans(a1), acc1)
            acc2 = tl.dot(x_tile, tl.trans(a2), acc2)
            x_ptrs += BLOCK_K
            a_off += BLOCK_K
        v_ptrs = v_ptr + tokens.to(tl.int64)[:, None] * stride_v_t + offs_r[None, :]
        tl.store(v_ptrs, acc0, mask=mask_m[:, None])
        tl.store(v_ptrs + BLOCK_R, acc1, mask=mask_m[:, None])
        tl.store(v_ptrs + 2 * BLOCK_R, acc2, mask=mask_m[:, None])


def shrink3(x, lora_as, meta, v, cfg):
    """v[:, i*R:(i+1)*R] = x @ lora_as[i][slot]ᵀ for i in 0..2 (every slot of full rank R >= 16)."""
    a0, a1, a2 = lora_as
    rank = a0.shape[1]
    assert a0.shape == a1.shape == a2.shape and a0.stride() == a1.stride() == a2.stride() and rank >= 16
    assert x.shape[1] % cfg["BLOCK_K"] == 0 and v.shape[1] == 3 * rank and v.dtype == torch.float32
    tiles = meta.tiles(cfg["BLOCK_M"])
    _shrink3_kernel[(tiles.grid_bound,)](
        x,
        a0,
        a1,
        a2,
        v,
        tiles.packed,
        x.shape[1],
        x.stride(0),
        a0.stride(0),
        a0.stride(1),
        v.stride(0),
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_R=rank,
        BLOCK_K=cfg["BLOCK_K"],
        DOT_IN_FP32=x.device.type == "cpu",
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return v


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


def check(args) -> int:
    """The experimental kernel against the product's three shrinks (interpreter or GPU)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    x, lora_as, meta = make_case(96, 24, 8, 16, 128, device, gen)
    want = three_shrinks(x, lora_as, meta, torch.zeros(x.shape[0], 48, device=device))
    for cfg in ({"BLOCK_M": 16, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2},):
        got = shrink3(x, lora_as, meta, torch.zeros_like(want), cfg)
        worst = float((got - want).abs().max())
        print(f"{cfg}: largest difference from the three shrinks {worst:.3g}")
        if worst > 1e-4:
            return 1
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    size_arguments(p, "perf/results/fused-shrink.json")
    p.add_argument("--check", action="store_true", help="only compare with the product on small shapes")
    args = p.parse_args(argv)
    if args.check:
        return check(args)
    assert torch.cuda.is_available(), "a GPU measurement (--check runs anywhere)"
    from bench_lora_calls import device_us

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
        tried = []
        for cfg in CONFIGS:
            try:
                got = shrink3(x, lora_as, meta, torch.zeros_like(v), cfg)
                torch.cuda.synchronize()
            except Exception as exc:  # out of resources: not a candidate
                tried.append({**cfg, "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
                continue
            entry = {**cfg, "max_diff": float((got - want).abs().max())}
            if entry["max_diff"] <= 1e-3 * float(want.abs().max()):
                entry["us"] = device_us(lambda: shrink3(x, lora_as, meta, v, cfg), args.reps, flush)
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
            f"fused best {desc} ({len(ok)}/{len(tried)} ok)"
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
