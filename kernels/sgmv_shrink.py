"""SGMV shrink: project each token onto its own adapter's LoRA A (hidden -> rank).

Computes v[t] = x[t] @ A[slot(t)]ᵀ for a batch whose tokens are grouped by adapter.
The idea is punica's SGMV (segmented gather matrix-vector product, Chen et al. 2023):
one launch serves every adapter of the batch. Here the launch walks the batch's tiles
(meta.py): each program takes BLOCK_M tokens of one segment, loops over H_in in BLOCK_K
steps and accumulates x_tile @ A_tileᵀ in float32 with tensor-core dots, so x is read
once and the A slice of an adapter comes from L2 after its first tile.

Mixed ranks: A is stored padded to R_max; with `ranks` given, rows r >= rank(slot) are
masked out of the loads, so padded rank costs neither bandwidth nor correctness. The
rank tile BLOCK_R is max(16, next pow2 >= max rank) because tl.dot needs N >= 16; the
masked rows are zeros in the dot.

Limits: token indices are int32 (memory offsets are int64); ranks up to 128 (BLOCK_R <=
128). No split-K: a batch of a few tokens with a large H_in runs on few programs, which
is latency-bound (a few microseconds, about one launch).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .launch_config import fits_shared_memory, get_config, rank_block
from .meta import SgmvMeta

# Largest rank tile at which several linears are shrunk in one launch. Measured at 16 only
# (session 21); with three [BLOCK_M, BLOCK_R] accumulators a wider tile risks register spills,
# which made another fused kernel of this session 56x slower (kernels/PERF_NOTES.md).
GROUP_MAX_RANK_TILE = 16


@triton.jit
def _sgmv_shrink_kernel(
    # pointers
    x_ptr,  # [T, H_in], unit stride on H_in
    a_ptr,  # [num_slots, R_max, H_in], unit stride on H_in
    v_ptr,  # [T, >= R_max] out, unit stride on R
    ranks_ptr,  # int32 [num_slots] (unused unless HAS_RANKS)
    tiles_ptr,  # int32 [1 + 3 * tile_cap]: num_tiles, then (slot, start, end) per tile (meta.py)
    a1_ptr,  # NUM_A > 1: a second (third) linear's A and v, the same layouts as a_ptr and v_ptr
    a2_ptr,
    v1_ptr,
    v2_ptr,
    # sizes
    h_in,
    rank_cap,  # min(R_max, meta.max_rank): rank rows/columns at or past it are never touched
    # strides (elements)
    stride_x_t,
    stride_a_slot,
    stride_a_r,
    stride_v_t,
    # meta-parameters
    BLOCK_M: tl.constexpr,  # tokens per tile; must match the tiles passed in
    BLOCK_R: tl.constexpr,  # rank tile, >= 16
    BLOCK_K: tl.constexpr,  # H_in step
    EVEN_K: tl.constexpr,  # H_in % BLOCK_K == 0: no mask on the hidden axis
    HAS_RANKS: tl.constexpr,  # mask rank rows r >= ranks[slot]
    NUM_A: tl.constexpr,  # 1-3 linears reading the same x (query, key, value): x is loaded once
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs, else "tf32" (ignored for 16-bit)
    DOT_IN_FP32: tl.constexpr,  # upcast dot operands: the CPU interpreter multiplies bf16 as raw bits
):
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    num_tiles = tl.load(tiles_ptr)
    # Grid-stride loop: the grid is sized from a host bound (one tile per program when
    # it holds); any tiles beyond it are still done here.
    for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        slot = tl.load(tiles_ptr + 1 + 3 * tile).to(tl.int64)
        tokens = tl.load(tiles_ptr + 2 + 3 * tile) + offs_m
        mask_m = tokens < tl.load(tiles_ptr + 3 + 3 * tile)
        rank = rank_cap
        if HAS_RANKS:
            rank = tl.minimum(tl.load(ranks_ptr + slot), rank_cap)
        mask_r = offs_r < rank

        x_ptrs = x_ptr + tokens.to(tl.int64)[:, None] * stride_x_t + offs_k[None, :]
        a_offs = slot * stride_a_slot + offs_r[:, None] * stride_a_r + offs_k[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        acc1 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k in range(0, tl.cdiv(h_in, BLOCK_K)):
            if EVEN_K:
                x_mask = mask_m[:, None]
                a_mask = mask_r[:, None]
            else:
                mask_k = offs_k < h_in - k * BLOCK_K
                x_mask = mask_m[:, None] & mask_k[None, :]
                a_mask = mask_r[:, None] & mask_k[None, :]
            x_tile = tl.load(x_ptrs, mask=x_mask, other=0.0)
            if DOT_IN_FP32:
                x_tile = x_tile.to(tl.float32)
            acc = _shrink_step(acc, x_tile, a_ptr + a_offs, a_mask, DOT_PRECISION, DOT_IN_FP32)
            if NUM_A > 1:
                acc1 = _shrink_step(acc1, x_tile, a1_ptr + a_offs, a_mask, DOT_PRECISION, DOT_IN_FP32)
            if NUM_A > 2:
                acc2 = _shrink_step(acc2, x_tile, a2_ptr + a_offs, a_mask, DOT_PRECISION, DOT_IN_FP32)
            x_ptrs += BLOCK_K
            a_offs += BLOCK_K

        v_offs = tokens.to(tl.int64)[:, None] * stride_v_t + offs_r[None, :]
        v_mask = mask_m[:, None] & (offs_r[None, :] < rank_cap)
        tl.store(v_ptr + v_offs, acc.to(v_ptr.dtype.element_ty), mask=v_mask)
        if NUM_A > 1:
            tl.store(v1_ptr + v_offs, acc1.to(v1_ptr.dtype.element_ty), mask=v_mask)
        if NUM_A > 2:
            tl.store(v2_ptr + v_offs, acc2.to(v2_ptr.dtype.element_ty), mask=v_mask)


@triton.jit
def _shrink_step(acc, x_tile, a_ptrs, a_mask, DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr):
    """acc + x_tile @ the A tile at ``a_ptrs``ᵀ (one BLOCK_K step of one linear)."""
    a_tile = tl.load(a_ptrs, mask=a_mask, other=0.0)
    if DOT_IN_FP32:
        a_tile = a_tile.to(tl.float32)
    return tl.dot(x_tile, tl.trans(a_tile), acc, input_precision=DOT_PRECISION)


def sgmv_shrink(
    x: torch.Tensor,  # [T, H_in]
    lora_a: torch.Tensor,  # [num_slots, R_max, H_in], same dtype as x
    meta: SgmvMeta,
    v: torch.Tensor,  # [T, >= R_max], fp32 or x.dtype; written in place
    ranks: torch.Tensor | None = None,  # int32 [num_slots]; None = every slot has rank R_max
    config: dict | None = None,  # forced launch config (tests, tuning); None = table lookup
) -> torch.Tensor:
    """Semantics:
        for each token t with slot s = slot(t) >= 0, r = rank(s):
            v[t, :r] = x[t, :] @ lora_a[s, :r, :]ᵀ       [H_in] x [H_in, r] -> [r], fp32 accumulate
        v[t, r:] is unspecified (zero within the rank tile); sgmv_expand never reads it.
        Rows of slot -1 (no adapter) are left untouched.
    Mutates v in place and returns it. Every adapter's rank must be <= meta.max_rank when
    that is set. x, lora_a and v may be strided views with unit stride on their last axis.
    """
    sgmv_shrink_group(x, (lora_a,), meta, (v,), ranks, config)
    return v


def sgmv_shrink_group(
    x: torch.Tensor,  # [T, H_in]
    lora_as: Sequence[torch.Tensor],  # 1-3 of [num_slots, R_max, H_in], one shape and layout
    meta: SgmvMeta,
    vs: Sequence[torch.Tensor],  # as many [T, >= R_max], one dtype and row stride; written in place
    ranks: torch.Tensor | None = None,
    config: dict | None = None,
) -> None:
    """``sgmv_shrink(x, lora_as[i], meta, vs[i])`` for every i in one launch that loads each x tile
    once: the query, key and value linears of a layer read the same x. The three shrinks read x
    three times; H200, 40,800 tokens of 768 columns, rank 16: 70.3 µs, one pass 31.9-34.6 µs (one
    read of x: 30.1; ``perf/bench_fused_shrink.py``, session 21). The launch config is the single
    shrink's table entry; where the A tiles would not fit its pipeline in shared memory (a rank
    tile of 64 in bfloat16 asked for 393,216 bytes on the H200), or the rank tile is above
    GROUP_MAX_RANK_TILE, each linear is shrunk alone. A ``config`` passed in is used as given."""
    assert 1 <= len(lora_as) == len(vs) <= 3, "one to three linears"
    assert x.dim() == 2, "x must be [T, H_in]"
    num_tokens, h_in = x.shape
    lora_a, v = lora_as[0], vs[0]
    assert lora_a.dim() == 3, "lora_a must be [num_slots, R_max, H_in]"
    num_slots, r_max, a_h_in = lora_a.shape
    assert a_h_in == h_in, f"lora_a hidden size {a_h_in} != x hidden size {h_in}"
    assert x.dtype in (torch.float32, torch.float16, torch.bfloat16), f"unsupported dtype {x.dtype}"
    for a, out in zip(lora_as, vs):
        assert a.shape == lora_a.shape and a.stride() == lora_a.stride(), "every lora_a of one shape and layout"
        assert a.dtype == x.dtype, f"lora_a dtype {a.dtype} != x dtype {x.dtype}"
        assert out.dim() == 2 and out.shape[0] == num_tokens and out.shape[1] >= r_max, (
            f"v must be [T={num_tokens}, >= R_max={r_max}], got {tuple(out.shape)}"
        )
        assert out.dtype == v.dtype in (torch.float32, x.dtype), (
            f"v must be fp32 or {x.dtype} (one dtype), got {out.dtype}"
        )
        assert out.stride(0) == v.stride(0), "every v of one row stride"
        assert x.device == a.device == out.device == meta.device, "x, lora_a, v and meta must share a device"
    assert x.stride(1) == 1 and lora_a.stride(2) == 1 and v.stride(1) == 1, (
        "x, lora_a and v need unit stride on their last axis"
    )
    assert meta.num_tokens == num_tokens, f"meta has {meta.num_tokens} tokens, x has {num_tokens}"
    assert ranks is None or (ranks.dtype == torch.int32 and ranks.shape == (num_slots,)), (
        f"ranks must be int32 [num_slots={num_slots}]"
    )
    rank_cap = min(r_max, meta.max_rank or r_max)
    block_r = rank_block(rank_cap)
    assert block_r <= 128, f"rank tile {block_r} > 128 is not supported"

    if config is None:
        config = get_config("sgmv_shrink", x.device, num_tokens, h_in, block_r, x.element_size())
        grouped = len(lora_as) > 1
        if grouped and (
            block_r > GROUP_MAX_RANK_TILE
            or not fits_shared_memory("sgmv_shrink", config, x.device, block_r, x.element_size(), len(lora_as))
        ):  # not measured there: one launch each, with the single shrink's config
            for a, out in zip(lora_as, vs):
                sgmv_shrink_group(x, (a,), meta, (out,), ranks, config)
            return
    tiles = meta.tiles(config["BLOCK_M"])
    grid = (tiles.grid_bound,)
    extra_a = list(lora_as[1:]) + [lora_a] * (3 - len(lora_as))  # any pointers past NUM_A
    extra_v = list(vs[1:]) + [v] * (3 - len(vs))
    _sgmv_shrink_kernel[grid](
        x,
        lora_a,
        v,
        tiles.packed if ranks is None else ranks,  # any int32 pointer when HAS_RANKS is off
        tiles.packed,
        extra_a[0],
        extra_a[1],
        extra_v[0],
        extra_v[1],
        h_in,
        rank_cap,
        x.stride(0),
        lora_a.stride(0),
        lora_a.stride(1),
        v.stride(0),
        BLOCK_M=config["BLOCK_M"],
        BLOCK_R=block_r,
        BLOCK_K=config["BLOCK_K"],
        EVEN_K=h_in % config["BLOCK_K"] == 0,
        HAS_RANKS=ranks is not None,
        NUM_A=len(lora_as),
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        DOT_IN_FP32=x.device.type == "cpu",
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )
