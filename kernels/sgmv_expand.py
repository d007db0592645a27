"""SGMV expand: add each token's own adapter update back to the layer output (rank -> hidden).

Computes y[t] += scale(slot(t)) * v[t] @ B[slot(t)]ᵀ in place, for a batch whose tokens
are grouped by adapter (punica's SGMV, Chen et al. 2023). The grid is (tiles, H_out /
N_PER_PROG): each program takes BLOCK_M tokens of one segment (meta.py) and N_PER_PROG output
columns, which it walks in blocks of BLOCK_N (N_PER_PROG = BLOCK_N: one block; the launch
config's ``N_PER_PROG``, default BLOCK_N). Per block it reads y (and the residual) first, does
one tensor-core dot over the rank (K = BLOCK_R) and stores the block once; the tile's metadata
and v are loaded once per program. y traffic (read + write) dominates, so the kernel is
bandwidth-bound; the B slice comes from L2 after an adapter's first tile.

v may be fp32 (recommended: the shrink result is not rounded twice) or the weights'
dtype; it is cast to B's dtype for the dot, whose accumulator is fp32. The update is
added to y in fp32 and rounded once on store.

y may be a column slice of a wider output (fused q/k/v): pass the wide y and y_offset,
or a strided view; each row of the slice must be contiguous.

Epilogues (accumulate mode only): the layer's next elementwise pass, done on the tile while it
is in registers instead of as another read and write of y. ``residual`` adds a tensor after the
update (DeBERTa's ``dense(x) + input`` before its LayerNorm), ``gelu`` applies the exact (erf)
GELU (DeBERTa's intermediate activation), ``layer_norm`` normalises the row after that (DeBERTa's
LayerNorm after the residual; one block then spans the row, up to LAYER_NORM_MAX_WIDTH columns).
Each step rounds to y's dtype as the separate torch passes do: ``round(round(y + update) +
residual)``, ``round(gelu(round(y + update)))``, ``round(layer_norm(that row))`` (in fp32 with the
biased variance, as torch; its sums run in another order, so one bf16 step may differ). They are
exact only where every row of y has an adapter (rows of slot -1 get no tile, so no epilogue):
the caller checks that (``LoraBatch.fuses_epilogue``).

Mixed ranks: with `ranks` given, rank columns r >= rank(slot) of v and B are masked out
of the loads (no bandwidth spent on padding). BLOCK_R is max(16, pow2 >= max rank)
because tl.dot needs K >= 16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import LAYER_NORM_MAX_WIDTH
from .launch_config import get_config, rank_block
from .meta import SgmvMeta

# Launch of the layer-norm epilogue, whose block spans the row (BLOCK_N: H_out's power of two).
# H200, 32,760 tokens of 768 columns (perf/bench_expand_variants.py --sizes, session 20): 94 µs
# against 137 for the residual expand then torch's layer_norm; 8 warps 133, BLOCK_M 32 123-221.
LAYER_NORM_CONFIG = {"BLOCK_M": 16, "num_warps": 4, "num_stages": 2}


@triton.jit
def _expand_block(
    v_tile,  # [BLOCK_M, BLOCK_R] in the dot's dtype
    offs_n,  # [BLOCK_N] output columns of this block
    rows,  # [BLOCK_M, 1] int64 token rows
    mask_m,
    offs_r,
    mask_r,
    slot,
    scale,
    b_ptr,
    y_ptr,
    bias_ptr,
    res_ptr,
    ln_w_ptr,
    ln_b_ptr,
    h_out,
    y_offset,
    eps,
    stride_b_slot,
    stride_b_h,
    stride_y_t,
    stride_res_t,
    EVEN_N: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    GELU: tl.constexpr,
    LAYER_NORM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] block of y: the update's dot, then the epilogue, one store."""
    mask_n = offs_n < h_out
    y_ptrs = y_ptr + rows * stride_y_t + y_offset + offs_n[None, :]
    if EVEN_N:
        y_mask = mask_m[:, None]
    else:
        y_mask = mask_m[:, None] & mask_n[None, :]
    # the tile's reads are issued before the dot that does not need them
    if ACCUMULATE:
        old = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + rows * stride_res_t + offs_n[None, :], mask=y_mask, other=0.0).to(tl.float32)
    b_ptrs = b_ptr + slot * stride_b_slot + offs_n[:, None] * stride_b_h + offs_r[None, :]
    if EVEN_N:
        b_tile = tl.load(b_ptrs, mask=mask_r[None, :], other=0.0)
    else:
        b_tile = tl.load(b_ptrs, mask=mask_n[:, None] & mask_r[None, :], other=0.0)
    if DOT_IN_FP32:
        b_tile = b_tile.to(tl.float32)
    acc = tl.dot(v_tile, tl.trans(b_tile), input_precision=DOT_PRECISION)
    out = scale * acc
    if ACCUMULATE:
        out += old
    elif HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if HAS_RESIDUAL:  # rounded first, as y would be stored before torch's add
        out = out.to(y_ptr.dtype.element_ty).to(tl.float32) + res
    if GELU:  # rounded first, as y would be stored before torch's gelu (computed in fp32)
        out = out.to(y_ptr.dtype.element_ty).to(tl.float32)
        out = 0.5 * out * (1.0 + tl.math.erf(out * 0.7071067811865476))
    if LAYER_NORM:  # the block spans the row: torch's layer_norm of the stored row, in fp32
        h = tl.where(mask_n[None, :], out.to(y_ptr.dtype.element_ty).to(tl.float32), 0.0)
        mean = tl.sum(h, axis=1) / h_out
        d = tl.where(mask_n[None, :], h - mean[:, None], 0.0)
        rstd = tl.math.rsqrt(tl.sum(d * d, axis=1) / h_out + eps)
        w = tl.load(ln_w_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        b = tl.load(ln_b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        out = d * rstd[:, None] * w[None, :] + b[None, :]
    tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=y_mask)


@triton.jit
def _sgmv_expand_kernel(
    # pointers
    v_ptr,  # [T, >= R_max], unit stride on R
    b_ptr,  # [num_slots, H_out, R_max], unit stride on R
    y_ptr,  # [T, >= y_offset + H_out] updated in place, unit stride on H
    scales_ptr,  # fp32 [num_slots]
    ranks_ptr,  # int32 [num_slots] (unused unless HAS_RANKS)
    bias_ptr,  # [H_out] added when writing (unused unless HAS_BIAS)
    res_ptr,  # [T, H_out] added after the update (unused unless HAS_RESIDUAL)
    ln_w_ptr,  # [H_out] layer norm weight (unused unless LAYER_NORM)
    ln_b_ptr,  # [H_out] layer norm bias (unused unless LAYER_NORM)
    tiles_ptr,  # int32 [1 + 3 * tile_cap]: num_tiles, then (slot, start, end) per tile (meta.py)
    # sizes
    h_out,
    rank_cap,  # min(R_max, meta.max_rank): rank columns at or past it are never read
    y_offset,  # first column of y written
    eps,  # layer norm epsilon
    # strides (elements)
    stride_v_t,
    stride_b_slot,
    stride_b_h,
    stride_y_t,
    stride_res_t,
    # meta-parameters
    BLOCK_M: tl.constexpr,  # tokens per tile; must match the tiles passed in
    BLOCK_N: tl.constexpr,  # output columns per block
    N_PER_PROG: tl.constexpr,  # output columns per program, a multiple of BLOCK_N (walked in blocks)
    BLOCK_R: tl.constexpr,  # rank tile (the dot's K), >= 16
    EVEN_N: tl.constexpr,  # H_out % N_PER_PROG == 0: no mask on the output columns
    HAS_RANKS: tl.constexpr,  # mask rank columns r >= ranks[slot]
    ACCUMULATE: tl.constexpr,  # y += update (read-modify-write); else y = bias + update (write only)
    HAS_BIAS: tl.constexpr,  # only when writing
    HAS_RESIDUAL: tl.constexpr,  # y = round(round(y + update) + residual); accumulate mode
    GELU: tl.constexpr,  # y = round(gelu(round(y + update))), exact erf GELU; accumulate mode
    LAYER_NORM: tl.constexpr,  # then y = round(layer_norm(row)); BLOCK_N spans the row
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 weights, else "tf32" (ignored for 16-bit)
    DOT_IN_FP32: tl.constexpr,  # upcast dot operands: the CPU interpreter multiplies bf16 as raw bits
):
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    col0 = tl.program_id(1) * N_PER_PROG
    num_tiles = tl.load(tiles_ptr)
    # Grid-stride loop over tiles on axis 0 (see sgmv_shrink).
    for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        slot = tl.load(tiles_ptr + 1 + 3 * tile).to(tl.int64)
        tokens = tl.load(tiles_ptr + 2 + 3 * tile) + offs_m
        mask_m = tokens < tl.load(tiles_ptr + 3 + 3 * tile)
        rank = rank_cap
        if HAS_RANKS:
            rank = tl.minimum(tl.load(ranks_ptr + slot), rank_cap)
        mask_r = offs_r < rank
        scale = tl.load(scales_ptr + slot)

        rows = tokens.to(tl.int64)[:, None]
        v_tile = tl.load(
            v_ptr + rows * stride_v_t + offs_r[None, :],
            mask=mask_m[:, None] & mask_r[None, :],
            other=0.0,
        )
        v_tile = v_tile.to(b_ptr.dtype.element_ty)
        if DOT_IN_FP32:
            v_tile = v_tile.to(tl.float32)
        if N_PER_PROG == BLOCK_N:  # one block per program
            _expand_block(
                v_tile, col0 + tl.arange(0, BLOCK_N), rows, mask_m, offs_r, mask_r, slot, scale,
                b_ptr, y_ptr, bias_ptr, res_ptr, ln_w_ptr, ln_b_ptr, h_out, y_offset, eps,
                stride_b_slot, stride_b_h, stride_y_t, stride_res_t,
                EVEN_N, ACCUMULATE, HAS_BIAS, HAS_RESIDUAL, GELU, LAYER_NORM, DOT_PRECISION, DOT_IN_FP32,
            )  # fmt: skip
        else:  # the v tile and the tile's metadata serve N_PER_PROG // BLOCK_N blocks, pipelined
            for nb in tl.range(0, N_PER_PROG, BLOCK_N, num_stages=2):
                _expand_block(
                    v_tile, col0 + nb + tl.arange(0, BLOCK_N), rows, mask_m, offs_r, mask_r, slot, scale,
                    b_ptr, y_ptr, bias_ptr, res_ptr, ln_w_ptr, ln_b_ptr, h_out, y_offset, eps,
                    stride_b_slot, stride_b_h, stride_y_t, stride_res_t,
                    EVEN_N, ACCUMULATE, HAS_BIAS, HAS_RESIDUAL, GELU, False, DOT_PRECISION, DOT_IN_FP32,
                )  # fmt: skip


def sgmv_expand(
    v: torch.Tensor,  # [T, >= R_max], fp32 or lora_b.dtype
    lora_b: torch.Tensor,  # [num_slots, H_out, R_max]
    scales: torch.Tensor,  # fp32 [num_slots]
    meta: SgmvMeta,
    y: torch.Tensor,  # [T, >= y_offset + H_out], lora_b.dtype; updated in place
    ranks: torch.Tensor | None = None,  # int32 [num_slots]; None = every slot has rank R_max
    y_offset: int = 0,  # first column of y that this op writes
    config: dict | None = None,  # forced launch config (tests, tuning); None = table lookup
    accumulate: bool = True,
    bias: torch.Tensor | None = None,  # [H_out]; only with accumulate=False
    residual: torch.Tensor | None = None,  # [T, H_out], y's dtype; added after the update (accumulate)
    gelu: bool = False,  # exact GELU of the updated row (accumulate)
    layer_norm: tuple | None = None,  # (weight [H_out], bias [H_out], eps): then torch's layer_norm
) -> torch.Tensor:
    """Semantics:
        for each token t with slot s = slot(t) >= 0, r = rank(s):
            y[t, y_offset : y_offset + H_out] += scales[s] * v[t, :r] @ lora_b[s, :, :r]ᵀ
                                                 [r] x [r, H_out] -> [H_out], fp32 accumulate
        With accumulate=False the row is written instead of updated (y is never read):
            y[t, y_offset : y_offset + H_out] = bias + scales[s] * v[t, :r] @ lora_b[s, :, :r]ᵀ
        (bias None: 0), so that the base GEMM can add itself afterwards in its epilogue.
        Rows of slot -1 (no adapter) are left untouched, as are all other columns of y.
        With ``residual`` the updated row, rounded to y's dtype, gets residual[t] added; with
        ``gelu`` it goes through the exact GELU (rounded first too); see the module docstring.
        With ``layer_norm`` the row (rounded) is then normalised over its H_out columns in fp32 and
        rounded: torch's layer_norm of the stored row (biased variance, ``eps`` inside the root).
    Mutates y in place and returns it. Every adapter's rank must be <= meta.max_rank when
    that is set. v and y may be strided views with unit stride on their last axis.
    """
    assert v.dim() == 2 and lora_b.dim() == 3 and y.dim() == 2, (
        "v must be [T, R], lora_b [num_slots, H_out, R_max], y [T, H]"
    )
    num_tokens = v.shape[0]
    num_slots, h_out, r_max = lora_b.shape
    assert v.shape[1] >= r_max, f"v has {v.shape[1]} columns, lora_b has rank {r_max}"
    assert y.shape[0] == num_tokens, f"y has {y.shape[0]} rows, v has {num_tokens}"
    assert 0 <= y_offset and y_offset + h_out <= y.shape[1], (
        f"columns [{y_offset}, {y_offset + h_out}) do not fit y of width {y.shape[1]}"
    )
    assert y.dtype == lora_b.dtype, f"y dtype {y.dtype} != lora_b dtype {lora_b.dtype}"
    assert y.dtype in (torch.float32, torch.float16, torch.bfloat16), f"unsupported dtype {y.dtype}"
    assert v.dtype in (torch.float32, lora_b.dtype), f"v must be fp32 or {lora_b.dtype}, got {v.dtype}"
    assert scales.dtype == torch.float32 and scales.shape == (num_slots,), (
        f"scales must be fp32 [num_slots={num_slots}]"
    )
    assert v.stride(1) == 1 and lora_b.stride(2) == 1 and y.stride(1) == 1, (
        "v, lora_b and y need unit stride on their last axis"
    )
    assert meta.num_tokens == num_tokens, f"meta has {meta.num_tokens} tokens, v has {num_tokens}"
    assert v.device == lora_b.device == y.device == scales.device == meta.device, (
        "v, lora_b, scales, y and meta must share a device"
    )
    assert ranks is None or (ranks.dtype == torch.int32 and ranks.shape == (num_slots,)), (
        f"ranks must be int32 [num_slots={num_slots}]"
    )
    assert bias is None or (not accumulate and bias.shape == (h_out,) and bias.stride(0) == 1), (
        f"bias [H_out={h_out}] (contiguous) is only added when writing (accumulate=False)"
    )
    assert (residual is None and not gelu) or accumulate, "epilogues (residual, gelu) need accumulate=True"
    assert residual is None or (
        residual.shape == (num_tokens, h_out) and residual.stride(1) == 1 and residual.dtype == y.dtype
    ), f"residual must be [T={num_tokens}, H_out={h_out}] of {y.dtype} with unit stride on H_out"
    assert residual is None or residual.device == y.device, "residual and y must share a device"
    rank_cap = min(r_max, meta.max_rank or r_max)
    block_r = rank_block(rank_cap)
    assert block_r <= 128, f"rank tile {block_r} > 128 is not supported"

    assert layer_norm is None or (accumulate and not gelu and y_offset == 0), (
        "layer_norm follows an accumulated update (and residual), not gelu, over the whole row"
    )
    if layer_norm is not None:
        assert h_out <= LAYER_NORM_MAX_WIDTH, f"the layer-norm epilogue takes rows up to {LAYER_NORM_MAX_WIDTH} wide"
        ln_weight, ln_bias, eps = layer_norm
        assert ln_weight.shape == ln_bias.shape == (h_out,), f"layer_norm weight and bias must be [H_out={h_out}]"
        assert ln_weight.stride(0) == ln_bias.stride(0) == 1, "layer_norm weight and bias must be contiguous"
    if config is None and layer_norm is not None:  # one block spans the row
        config = dict(LAYER_NORM_CONFIG, BLOCK_N=triton.next_power_of_2(h_out))
    elif config is None:
        config = get_config("sgmv_expand", y.device, num_tokens, h_out, block_r, y.element_size())
    block_n = config["BLOCK_N"]
    n_per_prog = config.get("N_PER_PROG", block_n)
    assert n_per_prog % block_n == 0, f"N_PER_PROG {n_per_prog} is not a multiple of BLOCK_N {block_n}"
    assert layer_norm is None or n_per_prog == block_n >= h_out, "with layer_norm one block spans the row"
    tiles = meta.tiles(config["BLOCK_M"])
    grid = (tiles.grid_bound, -(-h_out // n_per_prog))
    _sgmv_expand_kernel[grid](
        v,
        lora_b,
        y,
        scales,
        tiles.packed if ranks is None else ranks,  # any int32 pointer when HAS_RANKS is off
        y if bias is None else bias,  # any pointer when HAS_BIAS is off
        y if residual is None else residual,  # any pointer when HAS_RESIDUAL is off
        y if layer_norm is None else layer_norm[0],  # any pointers when LAYER_NORM is off
        y if layer_norm is None else layer_norm[1],
        tiles.packed,
        h_out,
        rank_cap,
        y_offset,
        0.0 if layer_norm is None else float(layer_norm[2]),
        v.stride(0),
        lora_b.stride(0),
        lora_b.stride(1),
        y.stride(0),
        0 if residual is None else residual.stride(0),
        BLOCK_M=config["BLOCK_M"],
        BLOCK_N=block_n,
        N_PER_PROG=n_per_prog,
        BLOCK_R=block_r,
        EVEN_N=h_out % n_per_prog == 0,
        HAS_RANKS=ranks is not None,
        ACCUMULATE=accumulate,
        HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None,
        GELU=gelu,
        LAYER_NORM=layer_norm is not None,
        DOT_PRECISION="ieee" if lora_b.dtype == torch.float32 else "tf32",
        DOT_IN_FP32=y.device.type == "cpu",
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )
    return y
