"""LoRA linear: the base GEMM and every token's own adapter update in one kernel.

Computes, for a batch whose tokens are grouped by adapter (meta.py) and where every token has
an adapter:

    y[t] = epilogue( x[t] Wᵀ + b + scale(slot(t)) · v[t] B[slot(t)]ᵀ )

with v = x A[slot]ᵀ already computed by the SGMV shrink. Each program takes BLOCK_M tokens of
one segment tile and BLOCK_N output columns: it runs the base GEMM's K loop (tensor-core dots,
fp32 accumulator), then one more dot over the rank with its segment's B slice, then the
epilogue, and writes y once.

Why: the separate path (cuBLAS GEMM, then the SGMV expand reading and writing y again) costs a
second pass over y per adapted linear, and for GLiNER2-base's intermediate dense (3,072 wide,
exact GELU in the expand) that pass was 448 µs a layer against 181 µs for torch's GELU alone
over the same bytes (perf/bench_lora_calls.py, session 17, files perf/h200-2026-12-04/session17/
b55c104-lora-calls-chunk256.*): bound by per-element instructions, not by launches. Here the
update costs one rank-sized dot per tile and the epilogue runs on registers.

The grid's axis 0 walks output-column blocks and axis 1 the tiles (grid stride, see
sgmv_shrink), so the column blocks of one tile run side by side and its x rows are read from
HBM about once; W (a few MB) stays in L2.

Epilogues: ``residual`` adds a tensor after the update (DeBERTa's ``dense(x) + input`` before
its LayerNorm), ``gelu`` the exact (erf) GELU. As in sgmv_expand, the sum is rounded to y's
dtype before either step, as torch's separate passes round their inputs; unlike the separate
path, the base product and the update are added in fp32 before that one rounding (one rounding
fewer than PEFT's ``base(x) + lora(x)``).

Rows without an adapter (slot -1) have no tile: the caller uses this kernel only when every row
of the batch has one (``LoraBatch.fuses_gemm``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch_config import rank_block
from .meta import SgmvMeta

# Launch config per output width (measured: perf/bench_fused_linear.py on the H200).
DEFAULT_CONFIG = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}


@triton.jit
def _lora_linear_kernel(
    x_ptr,  # [T, K], unit stride on K
    w_ptr,  # [N, K], unit stride on K
    bias_ptr,  # [N] (unused unless HAS_BIAS)
    v_ptr,  # [T, >= R_max] shrink result, unit stride on R
    b_ptr,  # [num_slots, N, R_max], unit stride on R
    scales_ptr,  # fp32 [num_slots]
    ranks_ptr,  # int32 [num_slots] (unused unless HAS_RANKS)
    res_ptr,  # [T, N] (unused unless HAS_RESIDUAL)
    y_ptr,  # [T, >= y_offset + N], written, unit stride on N
    tiles_ptr,  # int32 [1 + 3 * tile_cap] (meta.py)
    n_out,
    k_in,
    rank_cap,
    y_offset,
    stride_x_t,
    stride_w_n,
    stride_v_t,
    stride_b_slot,
    stride_b_h,
    stride_res_t,
    stride_y_t,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    EVEN_N: tl.constexpr,  # N % BLOCK_N == 0
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0
    HAS_BIAS: tl.constexpr,
    HAS_RANKS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    GELU: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 weights, else "tf32" (ignored for 16-bit)
    DOT_IN_FP32: tl.constexpr,  # upcast dot operands: the CPU interpreter multiplies bf16 as raw bits
    USE_TMA: tl.constexpr,  # x_ptr / w_ptr are TensorDescriptors of [BLOCK_M, BLOCK_K] / [BLOCK_N, BLOCK_K] boxes
):
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n_out
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    num_tiles = tl.load(tiles_ptr)
    for tile in range(tl.program_id(1), num_tiles, tl.num_programs(1)):
        slot = tl.load(tiles_ptr + 1 + 3 * tile).to(tl.int64)
        tokens = tl.load(tiles_ptr + 2 + 3 * tile) + offs_m
        mask_m = tokens < tl.load(tiles_ptr + 3 + 3 * tile)
        rows = tokens.to(tl.int64)

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if USE_TMA:  # x_ptr and w_ptr are tensor descriptors: the copy engine loads whole boxes
            row0 = tl.load(tiles_ptr + 2 + 3 * tile)  # rows past the tile's end are loaded, never stored
            col0 = tl.program_id(0) * BLOCK_N
            for k in range(0, k_in, BLOCK_K):
                x_tile = x_ptr.load([row0, k])
                w_tile = w_ptr.load([col0, k])
                if DOT_IN_FP32:
                    x_tile = x_tile.to(tl.float32)
                    w_tile = w_tile.to(tl.float32)
                acc = tl.dot(x_tile, w_tile.T, acc, input_precision=DOT_PRECISION)
        else:
            x_ptrs = x_ptr + rows[:, None] * stride_x_t + offs_k[None, :]
            w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_w_n + offs_k[:, None]
            for k in range(0, k_in, BLOCK_K):
                if EVEN_K:
                    x_tile = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
                    if EVEN_N:
                        w_tile = tl.load(w_ptrs)
                    else:
                        w_tile = tl.load(w_ptrs, mask=mask_n[None, :], other=0.0)
                else:
                    mask_k = (k + offs_k) < k_in
                    x_tile = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                    w_tile = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
                if DOT_IN_FP32:
                    x_tile = x_tile.to(tl.float32)
                    w_tile = w_tile.to(tl.float32)
                acc = tl.dot(x_tile, w_tile, acc, input_precision=DOT_PRECISION)
                x_ptrs += BLOCK_K
                w_ptrs += BLOCK_K

        # the adapter's update: one dot over the rank with this segment's B slice
        rank = rank_cap
        if HAS_RANKS:
            rank = tl.minimum(tl.load(ranks_ptr + slot), rank_cap)
        mask_r = offs_r < rank
        v_tile = tl.load(
            v_ptr + rows[:, None] * stride_v_t + offs_r[None, :], mask=mask_m[:, None] & mask_r[None, :], other=0.0
        )
        b_ptrs = b_ptr + slot * stride_b_slot + offs_n[None, :] * stride_b_h + offs_r[:, None]
        b_tile = tl.load(b_ptrs, mask=mask_r[:, None] & mask_n[None, :], other=0.0)
        v_tile = v_tile.to(b_tile.dtype)
        if DOT_IN_FP32:
            v_tile = v_tile.to(tl.float32)
            b_tile = b_tile.to(tl.float32)
        update = tl.dot(v_tile, b_tile, input_precision=DOT_PRECISION)
        out = acc + tl.load(scales_ptr + slot) * update
        if HAS_BIAS:
            out += bias[None, :]

        y_ptrs = y_ptr + rows[:, None] * stride_y_t + y_offset + offs_n[None, :]
        if EVEN_N:
            y_mask = mask_m[:, None]
        else:
            y_mask = mask_m[:, None] & mask_n[None, :]
        if HAS_RESIDUAL:  # rounded first, as y would be stored before torch's add
            res = tl.load(res_ptr + rows[:, None] * stride_res_t + offs_n[None, :], mask=y_mask, other=0.0)
            out = out.to(y_ptr.dtype.element_ty).to(tl.float32) + res.to(tl.float32)
        if GELU:  # rounded first, as y would be stored before torch's gelu (computed in fp32)
            out = out.to(y_ptr.dtype.element_ty).to(tl.float32)
            out = 0.5 * out * (1.0 + tl.math.erf(out * 0.7071067811865476))
        tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=y_mask)


def lora_linear(
    x: torch.Tensor,  # [T, K]
    weight: torch.Tensor,  # [N, K], x's dtype
    bias: torch.Tensor | None,  # [N]
    v: torch.Tensor,  # [T, >= R_max] shrink result, fp32 or the weights' dtype
    lora_b: torch.Tensor,  # [num_slots, N, R_max]
    scales: torch.Tensor,  # fp32 [num_slots]
    meta: SgmvMeta,
    y: torch.Tensor | None = None,  # [T, >= y_offset + N], written; None: a new [T, N]
    ranks: torch.Tensor | None = None,  # int32 [num_slots]
    y_offset: int = 0,
    residual: torch.Tensor | None = None,  # [T, N], added after the update
    gelu: bool = False,  # exact GELU of the updated row
    config: dict | None = None,  # launch config; None = DEFAULT_CONFIG
) -> torch.Tensor:
    """Semantics: for every token t (each must have an adapter, slot s = slot(t) >= 0, r = rank(s)):
        y[t, y_offset : y_offset + N] = x[t] @ weight.T + bias + scales[s] * v[t, :r] @ lora_b[s, :, :r].T
    then ``+ residual[t]`` and / or the exact GELU, each after rounding to y's dtype (module
    docstring). Returns y."""
    assert x.dim() == 2 and weight.dim() == 2 and v.dim() == 2 and lora_b.dim() == 3, (
        "x [T, K], weight [N, K], v [T, R], lora_b [slots, N, R]"
    )
    num_tokens, k_in = x.shape
    num_slots, n_out, r_max = lora_b.shape
    assert weight.shape == (n_out, k_in), f"weight {tuple(weight.shape)} != ({n_out}, {k_in})"
    assert x.dtype == weight.dtype == lora_b.dtype, "x, weight and lora_b must share a dtype"
    assert v.shape[0] == num_tokens and v.shape[1] >= r_max and v.dtype in (torch.float32, x.dtype)
    assert bias is None or (bias.shape == (n_out,) and bias.stride(0) == 1)
    assert scales.dtype == torch.float32 and scales.shape == (num_slots,)
    assert ranks is None or (ranks.dtype == torch.int32 and ranks.shape == (num_slots,))
    assert x.stride(1) == weight.stride(1) == v.stride(1) == lora_b.stride(2) == 1, "unit stride on the last axes"
    assert meta.num_tokens == num_tokens, f"meta has {meta.num_tokens} tokens, x has {num_tokens}"
    if y is None:
        y = x.new_empty(num_tokens, n_out)
    assert y.shape[0] == num_tokens and y_offset + n_out <= y.shape[1] and y.stride(1) == 1 and y.dtype == x.dtype
    assert residual is None or (
        residual.shape == (num_tokens, n_out) and residual.stride(1) == 1 and residual.dtype == y.dtype
    ), f"residual must be [T={num_tokens}, N={n_out}] of {y.dtype} with unit stride on N"
    assert x.device == weight.device == v.device == lora_b.device == y.device == meta.device
    rank_cap = min(r_max, meta.max_rank or r_max)
    block_r = rank_block(rank_cap)
    assert block_r <= 128, f"rank tile {block_r} > 128 is not supported"
    config = dict(DEFAULT_CONFIG if config is None else config)
    if x.device.type == "cpu":  # the interpreter: small tiles keep the tests quick
        config.update(BLOCK_M=min(config["BLOCK_M"], 16), BLOCK_N=min(config["BLOCK_N"], 32))
    tiles = meta.tiles(config["BLOCK_M"])
    grid = (triton.cdiv(n_out, config["BLOCK_N"]), tiles.grid_bound)
    use_tma = bool(config.get("TMA", False)) and all(  # a descriptor needs 16-byte aligned rows
        t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in (x, weight)
    )
    if use_tma:  # boxes past the tensors' ends read zeros (the descriptors' padding)
        from triton.tools.tensor_descriptor import TensorDescriptor

        x_arg = TensorDescriptor.from_tensor(x, [config["BLOCK_M"], config["BLOCK_K"]])
        w_arg = TensorDescriptor.from_tensor(weight, [config["BLOCK_N"], config["BLOCK_K"]])
    else:
        x_arg, w_arg = x, weight
    _lora_linear_kernel[grid](
        x_arg,
        w_arg,
        y if bias is None else bias,
        v,
        lora_b,
        scales,
        tiles.packed if ranks is None else ranks,
        y if residual is None else residual,
        y,
        tiles.packed,
        n_out,
        k_in,
        rank_cap,
        y_offset,
        x.stride(0),
        weight.stride(0),
        v.stride(0),
        lora_b.stride(0),
        lora_b.stride(1),
        0 if residual is None else residual.stride(0),
        y.stride(0),
        BLOCK_M=config["BLOCK_M"],
        BLOCK_N=config["BLOCK_N"],
        BLOCK_K=config["BLOCK_K"],
        BLOCK_R=block_r,
        EVEN_N=n_out % config["BLOCK_N"] == 0,
        EVEN_K=k_in % config["BLOCK_K"] == 0,
        HAS_BIAS=bias is not None,
        HAS_RANKS=ranks is not None,
        HAS_RESIDUAL=residual is not None,
        GELU=gelu,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        DOT_IN_FP32=x.device.type == "cpu",
        USE_TMA=use_tma,
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )
    return y
