"""SGMV shrink and write in one pass: the LoRA updates of up to three linears that read one x.

For each token t of slot s and each linear i (a layer's query, key and value):

    y_i[t] = bias_i + scales_i[s] · (x[t] @ A_i[s]ᵀ) @ B_i[s]ᵀ

which is ``sgmv_shrink_group`` followed by ``sgmv_expand(accumulate=False)`` per linear (the
write-first form: the base GEMM then adds ``x Wᵀ`` in its epilogue, ``LoraBatch.writes_first``),
without v ever leaving the registers: a program takes one tile of BLOCK_M tokens of one adapter,
runs the shrink over H_in for every linear (x loaded once per BLOCK_K step, sgmv_shrink's
``_shrink_tile``), rounds each v to B's dtype as the expand does after loading it, then walks each
linear's H_out columns in BLOCK_N blocks (sgmv_expand's ``_expand_block``) and stores them once.
Per layer that is one read of x and one write of each y, one launch instead of four. The
float32 accumulators run the same K steps as a split shrink with the same BLOCK_K, so v, and the
rows written, equal the split path's.

Why (H200, 40,800 tokens of 768 columns, rank 16; perf/bench_expand_variants.py and
perf/bench_fused_shrink.py, session 21-22): the grouped shrink took 32-35 µs and each of the three
write-first expands 28-42 µs, against ~76 µs for the bytes of one read of x and three writes.

Only for rank tiles up to GROUP_MAX_RANK_TILE (16: three [BLOCK_M, BLOCK_R] accumulators live
through the column walk) and rows whose every token has an adapter (rows of slot -1 get no tile,
so nothing would be written there: the caller checks, as for the write-first expand).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .launch_config import get_config, rank_block
from .meta import SgmvMeta
from .sgmv_expand import _expand_block
from .sgmv_shrink import GROUP_MAX_RANK_TILE, _shrink_tile

# Launch of the shrink-and-write (one config: its tile sizes bound the registers of the three
# accumulators and the column walk); BLOCK_K is the shrink table's. H200 timings of other tile
# sizes: perf/bench_fused_shrink.py --write-group.
WRITE_GROUP_CONFIG = {"BLOCK_M": 32, "BLOCK_N": 128, "num_warps": 4, "num_stages": 2}


@triton.jit
def _write_linear(
    acc, rows, mask_m, offs_r, mask_r, slot, b_ptr, y_ptr, bias_ptr, scales_ptr, h_out,
    stride_b_slot, stride_b_h, stride_y_t,
    BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr, HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
):  # fmt: skip
    """y rows = bias + scale · v @ Bᵀ over all H_out columns, v = this tile's accumulator."""
    v_tile = acc.to(b_ptr.dtype.element_ty)  # as the expand rounds the float32 v it loads
    if DOT_IN_FP32:
        v_tile = v_tile.to(tl.float32)
    scale = tl.load(scales_ptr + slot)
    for nb in tl.range(0, h_out, BLOCK_N, num_stages=2):
        _expand_block(
            v_tile, nb + tl.arange(0, BLOCK_N), rows, mask_m, offs_r, mask_r, slot, scale,
            b_ptr, y_ptr, bias_ptr, y_ptr, bias_ptr, bias_ptr, h_out, 0, 0.0,
            stride_b_slot, stride_b_h, stride_y_t, 0,
            EVEN_N, False, HAS_BIAS, False, False, False, DOT_PRECISION, DOT_IN_FP32,
        )  # fmt: skip


@triton.jit
def _sgmv_write_group_kernel(
    x_ptr,  # [T, H_in], unit stride on H_in
    a_ptr,  # NUM_A of [num_slots, R_max, H_in], one layout
    a1_ptr,
    a2_ptr,
    b_ptr,  # NUM_A of [num_slots, H_out, R_max], one layout
    b1_ptr,
    b2_ptr,
    y_ptr,  # NUM_A of [T, H_out] written, one row stride
    y1_ptr,
    y2_ptr,
    bias_ptr,  # NUM_A of [H_out] (unused unless HAS_BIAS)
    bias1_ptr,
    bias2_ptr,
    scales_ptr,  # NUM_A of fp32 [num_slots]
    scales1_ptr,
    scales2_ptr,
    ranks_ptr,  # int32 [num_slots] (unused unless HAS_RANKS)
    tiles_ptr,  # int32 [1 + 3 * tile_cap] (meta.py)
    h_in,
    h_out,
    rank_cap,
    stride_x_t,
    stride_a_slot,
    stride_a_r,
    stride_b_slot,
    stride_b_h,
    stride_y_t,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    HAS_RANKS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NUM_A: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    num_tiles = tl.load(tiles_ptr)
    for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):  # grid-stride, as sgmv_shrink
        slot = tl.load(tiles_ptr + 1 + 3 * tile).to(tl.int64)
        tokens = tl.load(tiles_ptr + 2 + 3 * tile) + offs_m
        mask_m = tokens < tl.load(tiles_ptr + 3 + 3 * tile)
        rank = rank_cap
        if HAS_RANKS:
            rank = tl.minimum(tl.load(ranks_ptr + slot), rank_cap)
        mask_r = offs_r < rank
        acc, acc1, acc2 = _shrink_tile(
            x_ptr, a_ptr, a1_ptr, a2_ptr, tokens, mask_m, slot, mask_r, h_in, stride_x_t, stride_a_slot, stride_a_r,
            BLOCK_M, BLOCK_R, BLOCK_K, EVEN_K, NUM_A, DOT_PRECISION, DOT_IN_FP32,
        )  # fmt: skip
        rows = tokens.to(tl.int64)[:, None]
        _write_linear(
            acc, rows, mask_m, offs_r, mask_r, slot, b_ptr, y_ptr, bias_ptr, scales_ptr, h_out,
            stride_b_slot, stride_b_h, stride_y_t, BLOCK_N, EVEN_N, HAS_BIAS, DOT_PRECISION, DOT_IN_FP32,
        )  # fmt: skip
        if NUM_A > 1:
            _write_linear(
                acc1, rows, mask_m, offs_r, mask_r, slot, b1_ptr, y1_ptr, bias1_ptr, scales1_ptr, h_out,
                stride_b_slot, stride_b_h, stride_y_t, BLOCK_N, EVEN_N, HAS_BIAS, DOT_PRECISION, DOT_IN_FP32,
            )  # fmt: skip
        if NUM_A > 2:
            _write_linear(
                acc2, rows, mask_m, offs_r, mask_r, slot, b2_ptr, y2_ptr, bias2_ptr, scales2_ptr, h_out,
                stride_b_slot, stride_b_h, stride_y_t, BLOCK_N, EVEN_N, HAS_BIAS, DOT_PRECISION, DOT_IN_FP32,
            )  # fmt: skip


def write_group_supported(max_rank: int) -> bool:
    """Whether sgmv_write_group takes adapters of this largest rank (its rank tile)."""
    return rank_block(max_rank) <= GROUP_MAX_RANK_TILE


def sgmv_write_group(
    x: torch.Tensor,  # [T, H_in]
    lora_as: Sequence[torch.Tensor],  # 1-3 of [num_slots, R_max, H_in], one shape and layout
    lora_bs: Sequence[torch.Tensor],  # as many [num_slots, H_out, R_max], one shape and layout
    scales: Sequence[torch.Tensor],  # as many fp32 [num_slots]
    meta: SgmvMeta,
    ys: Sequence[torch.Tensor],  # as many [T, H_out], one shape and row stride; written
    biases: Sequence[torch.Tensor] | None = None,  # as many [H_out], or None (no bias)
    ranks: torch.Tensor | None = None,  # int32 [num_slots]
    config: dict | None = None,  # forced launch config (tests, tuning); None = WRITE_GROUP_CONFIG
) -> None:
    """``ys[i][t] = biases[i] + scales[i][s] · (x[t] @ lora_as[i][s]ᵀ) @ lora_bs[i][s]ᵀ`` for every
    token t of slot s >= 0 (rows of slot -1 are not written), in one launch; see the module
    docstring. Equal to ``shrink_group`` into float32 v's then ``expand(accumulate=False)`` each."""
    count = len(lora_as)
    assert 1 <= count == len(lora_bs) == len(scales) == len(ys) <= 3, "one to three linears"
    assert biases is None or len(biases) == count, "a bias per linear, or none"
    assert x.dim() == 2 and x.stride(1) == 1, "x must be [T, H_in] with unit stride on H_in"
    num_tokens, h_in = x.shape
    num_slots, r_max, a_h_in = lora_as[0].shape
    h_out = lora_bs[0].shape[1]
    assert a_h_in == h_in, f"lora_a hidden size {a_h_in} != x hidden size {h_in}"
    for a, b, s, y in zip(lora_as, lora_bs, scales, ys):
        assert a.shape == lora_as[0].shape and a.stride() == lora_as[0].stride() and a.stride(2) == 1
        assert b.shape == (num_slots, h_out, r_max) and b.stride() == lora_bs[0].stride() and b.stride(2) == 1
        assert a.dtype == b.dtype == x.dtype == y.dtype, "x, A, B and y of one dtype"
        assert s.dtype == torch.float32 and s.shape == (num_slots,), f"scales must be fp32 [num_slots={num_slots}]"
        assert y.shape == (num_tokens, h_out) and y.stride() == ys[0].stride() and y.stride(1) == 1
        assert x.device == a.device == b.device == s.device == y.device == meta.device, "one device"
    for bias in biases or ():
        assert bias.shape == (h_out,) and bias.stride(0) == 1 and bias.dtype == x.dtype, "bias [H_out] contiguous"
    assert meta.num_tokens == num_tokens, f"meta has {meta.num_tokens} tokens, x has {num_tokens}"
    assert ranks is None or (ranks.dtype == torch.int32 and ranks.shape == (num_slots,))
    rank_cap = min(r_max, meta.max_rank or r_max)
    block_r = rank_block(rank_cap)
    assert block_r <= GROUP_MAX_RANK_TILE, f"rank tile {block_r} > {GROUP_MAX_RANK_TILE}: shrink and expand apart"
    if config is None:  # the shrink's K step, so that v is the split path's (the same float32 sums)
        shrink = get_config("sgmv_shrink", x.device, num_tokens, h_in, block_r, x.element_size(), count)
        config = dict(WRITE_GROUP_CONFIG, BLOCK_K=shrink["BLOCK_K"])

    def pad(seq):  # any pointers past NUM_A
        return list(seq) + [seq[0]] * (3 - count)

    a_, b_, y_, s_ = pad(lora_as), pad(lora_bs), pad(ys), pad(scales)
    bias_ = pad(biases) if biases is not None else [ys[0]] * 3
    tiles = meta.tiles(config["BLOCK_M"])
    _sgmv_write_group_kernel[(tiles.grid_bound,)](
        x, *a_, *b_, *y_, *bias_, *s_,
        tiles.packed if ranks is None else ranks,
        tiles.packed,
        h_in, h_out, rank_cap,
        x.stride(0), lora_as[0].stride(0), lora_as[0].stride(1), lora_bs[0].stride(0), lora_bs[0].stride(1),
        ys[0].stride(0),
        BLOCK_M=config["BLOCK_M"],
        BLOCK_R=block_r,
        BLOCK_K=config["BLOCK_K"],
        BLOCK_N=config["BLOCK_N"],
        EVEN_K=h_in % config["BLOCK_K"] == 0,
        EVEN_N=h_out % config["BLOCK_N"] == 0,
        HAS_RANKS=ranks is not None,
        HAS_BIAS=biases is not None,
        NUM_A=count,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        DOT_IN_FP32=x.device.type == "cpu",
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )  # fmt: skip
