"""The SGMV expand's three serving cases against experimental kernel shapes, on one GPU.

    python perf/bench_expand_variants.py [--tokens 61440] [--row-len 240] [--out FILE]

Why: inside the 1,024-adapter forward the intermediate expand with its GELU takes ~448 µs a layer
for a 61,440-token chunk where torch's own GELU pass over the same bytes takes ~181 µs, and the
write-first q/k/v expands ~60 µs against a ~31 µs fill (session 17, perf/README.md). Those
calls are ~40% of all SGMV time. This measures, on synthetic tensors of that shape (rows of
``--row-len`` tokens, each row its own adapter of 1,024 rank-16 slots), the product kernel
(kernels/sgmv_expand.py, its table config and a few others) against variants that change how a
program walks its tile, each checked against the product kernel's output first:

* ``loop``: one program per (token tile, column chunk) walks ``N_PER_PROG`` columns in
  ``BLOCK_N`` steps (the v tile and the tile's metadata loaded once, the loop software-pipelined);
* ``fma``: the rank-16 update as 16 outer-product FMAs in the load layout (no tensor-core dot, so
  no layout conversion between the dot's registers and the coalesced loads and stores).

Prints one line per (case, kernel); writes every timing to --out (JSON).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl


@triton.jit
def _expand_variant_kernel(
    v_ptr,
    b_ptr,
    y_ptr,
    scales_ptr,
    bias_ptr,
    res_ptr,
    tiles_ptr,
    h_out,
    stride_v_t,
    stride_b_slot,
    stride_b_h,
    stride_y_t,
    stride_res_t,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    N_PER_PROG: tl.constexpr,
    STAGES: tl.constexpr,
    USE_DOT: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    GELU: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,  # the CPU interpreter multiplies 16-bit dot operands as raw bits
):
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    num_tiles = tl.load(tiles_ptr)
    col0 = tl.program_id(1) * N_PER_PROG
    for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        slot = tl.load(tiles_ptr + 1 + 3 * tile).to(tl.int64)
        tokens = tl.load(tiles_ptr + 2 + 3 * tile) + offs_m
        mask_m = tokens < tl.load(tiles_ptr + 3 + 3 * tile)
        scale = tl.load(scales_ptr + slot)
        rows = tokens.to(tl.int64)[:, None]
        if USE_DOT:
            v_tile = tl.load(v_ptr + rows * stride_v_t + offs_r[None, :], mask=mask_m[:, None], other=0.0)
            v_tile = v_tile.to(b_ptr.dtype.element_ty)
        for nb in tl.range(0, N_PER_PROG, BLOCK_N, num_stages=STAGES):
            offs_n = col0 + nb + tl.arange(0, BLOCK_N)
            y_ptrs = y_ptr + rows * stride_y_t + offs_n[None, :]
            y_mask = mask_m[:, None]
            if ACCUMULATE:
                old = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                res = tl.load(res_ptr + rows * stride_res_t + offs_n[None, :], mask=y_mask, other=0.0)
            b_base = b_ptr + slot * stride_b_slot + offs_n * stride_b_h
            if USE_DOT:
                b_tile = tl.load(b_base[:, None] + offs_r[None, :])
                if DOT_IN_FP32:
                    acc = tl.dot(v_tile.to(tl.float32), tl.trans(b_tile.to(tl.float32)))
                else:
                    acc = tl.dot(v_tile, tl.trans(b_tile))
            else:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for r in tl.static_range(BLOCK_R):
                    vc = tl.load(v_ptr + tokens.to(tl.int64) * stride_v_t + r, mask=mask_m, other=0.0)
                    bc = tl.load(b_base + r).to(tl.float32)
                    acc += vc.to(b_ptr.dtype.element_ty).to(tl.float32)[:, None] * bc[None, :]
            out = scale * acc
            if ACCUMULATE:
                out += old
            elif HAS_BIAS:
                out += tl.load(bias_ptr + offs_n).to(tl.float32)[None, :]
            if HAS_RESIDUAL:
                out = out.to(y_ptr.dtype.element_ty).to(tl.float32) + res.to(tl.float32)
            if GELU:
                out = out.to(y_ptr.dtype.element_ty).to(tl.float32)
                out = 0.5 * out * (1.0 + tl.math.erf(out * 0.7071067811865476))
            tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=y_mask)


def variant(v, lora_b, scales, meta, y, *, bias=None, residual=None, gelu=False, accumulate=True, cfg):
    h_out = lora_b.shape[1]
    assert h_out % cfg["N_PER_PROG"] == 0 and cfg["N_PER_PROG"] % cfg["BLOCK_N"] == 0
    tiles = meta.tiles(cfg["BLOCK_M"])
    grid = (tiles.grid_bound, h_out // cfg["N_PER_PROG"])
    _expand_variant_kernel[grid](
        v,
        lora_b,
        y,
        scales,
        y if bias is None else bias,
        y if residual is None else residual,
        tiles.packed,
        h_out,
        v.stride(0),
        lora_b.stride(0),
        lora_b.stride(1),
        y.stride(0),
        0 if residual is None else residual.stride(0),
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_R=lora_b.shape[2],
        N_PER_PROG=cfg["N_PER_PROG"],
        STAGES=cfg["STAGES"],
        USE_DOT=cfg["dot"],
        ACCUMULATE=accumulate,
        HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None,
        GELU=gelu,
        DOT_IN_FP32=y.device.type == "cpu",
        num_warps=cfg["num_warps"],
    )
    return y


def device_us(fn, reps: int, flush: torch.Tensor) -> float:
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


VARIANTS = [
    {"name": "loop", "dot": True, "BLOCK_M": m, "BLOCK_N": n, "N_PER_PROG": p, "STAGES": 2, "num_warps": w}
    for m in (32, 64)
    for n in (64, 128)
    for p in (256, 768)
    for w in (4, 8)
] + [
    {"name": "fma", "dot": False, "BLOCK_M": m, "BLOCK_N": n, "N_PER_PROG": p, "STAGES": 2, "num_warps": 4}
    for m in (16, 32)
    for n in (64, 128)
    for p in (128, 768)
]
# the product kernel's own column walk (kernels/sgmv_expand.py, N_PER_PROG), per token count
PRODUCT_CONFIGS = [
    {"BLOCK_M": m, "BLOCK_N": 128, "N_PER_PROG": p, "num_warps": w, "num_stages": s}
    for m in (32, 64)
    for p in (128, 256, 768)
    for w in (4, 8)
    for s in (2, 3)
]
LAYER_NORM_CONFIGS = [{"BLOCK_M": m, "num_warps": w, "num_stages": 2} for m in (8, 16, 32) for w in (4, 8)]


def make_case(case: str, tokens: int, row_len: int, slots: int, rank: int, gen):
    """Tensors of one serving case: every row of ``row_len`` tokens its own adapter."""
    from manylora.kernels import SgmvMetaBuilder

    dev, dt = torch.device("cuda"), torch.bfloat16
    width = 3072 if case == "gelu" else 768
    rows = tokens // row_len
    chosen = sorted(torch.randperm(slots, generator=torch.Generator().manual_seed(1))[: min(rows, slots)].tolist())
    slot_per_row = [chosen[i * len(chosen) // rows] for i in range(rows)]
    meta = SgmvMetaBuilder(rows * row_len, dev).build(
        slot_per_row=torch.tensor(slot_per_row, dtype=torch.int32), row_len=row_len, max_rank=rank
    )
    t = rows * row_len
    v = torch.randn(t, rank, device=dev, generator=gen)
    scales = torch.rand(slots, device=dev, generator=gen) + 0.5
    lora_b = (torch.randn(slots, width, rank, device=dev, generator=gen) * 0.1).to(dt)
    y0 = torch.randn(t, width, device=dev, generator=gen).to(dt)
    kw = {}
    if case == "gelu":
        kw = {"gelu": True}
    elif case in ("residual", "layernorm"):
        kw = {"residual": torch.randn(t, width, device=dev, generator=gen).to(dt)}
    elif case == "write":
        kw = {"accumulate": False, "bias": torch.randn(width, device=dev, generator=gen).to(dt)}
    if case == "layernorm":
        kw["layer_norm"] = (
            (1 + 0.1 * torch.randn(width, device=dev, generator=gen)).to(dt),
            (0.1 * torch.randn(width, device=dev, generator=gen)).to(dt),
            1e-7,
        )
    return v, lora_b, scales, meta, y0, kw


def sizes_main(args) -> int:
    """--sizes: the product kernel's table config against its column-walk configs at several token
    counts, and the layer-norm epilogue against the residual expand followed by torch's layer_norm."""
    from manylora.kernels.sgmv_expand import sgmv_expand

    gen = torch.Generator(device="cuda").manual_seed(0)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    results, lines = [], []
    for case in ("gelu", "residual", "write", "layernorm"):
        for tokens in args.sizes:
            v, lora_b, scales, meta, y0, kw = make_case(case, tokens, args.row_len, args.slots, args.rank, gen)
            y = y0.clone()
            want = sgmv_expand(v, lora_b, scales, meta, y0.clone(), **kw)
            row = {"case": case, "tokens": int(y.shape[0])}
            if case == "layernorm":
                norm = kw["layer_norm"]
                plain = {k: x for k, x in kw.items() if k != "layer_norm"}

                def split():
                    sgmv_expand(v, lora_b, scales, meta, y, **plain)
                    torch.nn.functional.layer_norm(y, (y.shape[1],), *norm)

                row["table_us"] = device_us(split, args.reps, flush)  # what runs without the epilogue
                configs = LAYER_NORM_CONFIGS
            else:
                row["table_us"] = device_us(lambda: sgmv_expand(v, lora_b, scales, meta, y, **kw), args.reps, flush)
                configs = PRODUCT_CONFIGS
            tried = []
            for cfg in configs:
                if case == "layernorm":
                    cfg = dict(cfg, BLOCK_N=1024)
                try:
                    got = sgmv_expand(v, lora_b, scales, meta, y0.clone(), config=cfg, **kw)
                    torch.cuda.synchronize()
                except Exception as exc:  # out of resources: not a candidate
                    tried.append({**cfg, "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
                    continue
                diff = (got.float() - want.float()).abs() / (want.float().abs().clamp_min(1.0) * 2**-7)
                entry = {**cfg, "worst_ulps": float(diff.max())}
                if entry["worst_ulps"] <= 1.0:
                    fn = lambda: sgmv_expand(v, lora_b, scales, meta, y, config=cfg, **kw)  # noqa: E731
                    entry["us"] = device_us(fn, args.reps, flush)
                tried.append(entry)
            ok = [t for t in tried if "us" in t]
            best = min(ok, key=lambda t: t["us"]) if ok else None
            row.update(configs=tried, best=best)
            results.append(row)
            keys = ("BLOCK_M", "BLOCK_N", "N_PER_PROG", "num_warps", "num_stages")
            desc = "-" if best is None else f"{best['us']:7.1f} {[best.get(k) for k in keys]}"
            base = "split" if case == "layernorm" else "table"
            lines.append(
                f"{case:10} {row['tokens']:6} {base} {row['table_us']:7.1f}  best {desc}  ({len(ok)}/{len(tried)} ok)"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"rows of {args.row_len} tokens, each its own adapter of {args.slots} slots, rank {args.rank}; device µs")
    print("\n".join(lines))
    return 0


def main(argv=None) -> int:
    from manylora.kernels import SgmvMetaBuilder
    from manylora.kernels.sgmv_expand import sgmv_expand

    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=61440)
    p.add_argument("--row-len", type=int, default=240)
    p.add_argument("--slots", type=int, default=1024)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", type=Path, default=Path("perf/results/expand-variants.json"))
    p.add_argument("--sizes", type=int, nargs="*", help="token counts: the product kernel's configs instead")
    args = p.parse_args(argv)
    assert torch.cuda.is_available(), "a GPU measurement"
    if args.sizes:
        return sizes_main(args)
    dev, dt = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = args.tokens // args.row_len
    slots = sorted(torch.randperm(args.slots, generator=torch.Generator().manual_seed(1))[:rows].tolist())
    meta = SgmvMetaBuilder(rows * args.row_len, dev).build(
        slot_per_row=torch.tensor(slots, dtype=torch.int32), row_len=args.row_len, max_rank=args.rank
    )
    tokens = rows * args.row_len
    v = torch.randn(tokens, args.rank, device=dev, generator=gen)
    scales = torch.rand(args.slots, device=dev, generator=gen) + 0.5
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    cases = [("gelu", 3072), ("residual", 768), ("write", 768), ("accumulate", 768)]
    results, lines = [], []
    for case, width in cases:
        lora_b = (torch.randn(args.slots, width, args.rank, device=dev, generator=gen) * 0.1).to(dt)
        y0 = torch.randn(tokens, width, device=dev, generator=gen).to(dt)
        kw = {}
        if case == "gelu":
            kw = {"gelu": True}
        elif case == "residual":
            kw = {"residual": torch.randn(tokens, width, device=dev, generator=gen).to(dt)}
        elif case == "write":
            kw = {"accumulate": False, "bias": torch.randn(width, device=dev, generator=gen).to(dt)}
        y = y0.clone()
        want = sgmv_expand(v, lora_b, scales, meta, y0.clone(), **kw)
        if case == "gelu":
            floor = lambda: torch.nn.functional.gelu(y)  # noqa: E731
        elif case == "residual":
            floor = lambda: y.add_(kw["residual"])  # noqa: E731
        elif case == "write":
            floor = lambda: y.fill_(0)  # noqa: E731
        else:
            floor = lambda: y.mul_(1.0)  # noqa: E731
        row = {"case": case, "width": width, "tokens": tokens, "floor_us": device_us(floor, args.reps, flush)}
        row["product_us"] = device_us(lambda: sgmv_expand(v, lora_b, scales, meta, y, **kw), args.reps, flush)
        tried = []
        for cfg in VARIANTS:
            if width % cfg["N_PER_PROG"]:
                continue
            try:
                got = variant(v, lora_b, scales, meta, y0.clone(), cfg=cfg, **kw)
                torch.cuda.synchronize()
            except Exception as exc:  # out of resources: not a candidate
                tried.append({**cfg, "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
                continue
            diff = (got.float() - want.float()).abs()
            ulp = want.float().abs().clamp_min(1.0) * 2**-7  # bf16's step at the value, at least 1's
            worst = float((diff / ulp).max())
            entry = {**cfg, "worst_ulps": worst}
            if worst <= 1.0:
                entry["us"] = device_us(lambda: variant(v, lora_b, scales, meta, y, cfg=cfg, **kw), args.reps, flush)
            tried.append(entry)
        row["variants"] = tried
        for name in ("loop", "fma"):
            ok = [t for t in tried if t["name"] == name and "us" in t]
            best = min(ok, key=lambda t: t["us"]) if ok else None
            row[f"best_{name}"] = best
            bad = sum(1 for t in tried if t["name"] == name and "us" not in t)
            desc = (
                "-"
                if best is None
                else f"{best['us']:.1f} {dict((k, best[k]) for k in best if k not in ('us', 'name', 'dot', 'worst_ulps'))}"
            )
            lines.append(f"{case:10} {width:5} {name:5} best {desc}  (failed/inexact {bad})")
        lines.append(f"{case:10} {width:5} floor {row['floor_us']:.1f}  product {row['product_us']:.1f}")
        results.append(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(
        f"{tokens} tokens, rows of {args.row_len}, {rows} adapters of {args.slots} slots, rank {args.rank}; device µs"
    )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
