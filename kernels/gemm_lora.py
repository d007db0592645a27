"""A linear layer and every token's own LoRA update in one GEMM: the update in the epilogue.

    y[t] = x[t] Wᵀ + bias + scale(s) · v[t, :r] B[s, :, :r]ᵀ        s = slot of t's row, r = rank(s)

with ``v = x A[s]ᵀ`` from SGMV shrink. Separate passes cost the update a write of y (the
write-first expand) plus a read of y in the base GEMM's epilogue; here the program that
owns an output tile adds the update to its float32 accumulator before the single store.

The GEMM is the standard tiled one (grouped tile order for L2 reuse, float32 accumulate,
tensor-core dots). In the epilogue a tile's rows may belong to several adapters (rows are
grouped by slot, so a tile of BLOCK_M tokens spans one to a few segments): the program
walks the distinct slots of its rows, smallest first, and for each adds
``(scale · v masked to that slot's rows) B[s]ᵀ`` as one rank-sized dot. Rows of slot -1
(no adapter) get the base output only; their v rows are never read.

A token's slot is its row's: ``row_slots[t // row_len]`` (the engine pads every row of a
forward to one length), so no per-token table is built.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch_config import rank_block

NO_SLOT = tl.constexpr(1 << 30)  # larger than any slot: "no further slot in this tile" (a jit global)


@triton.jit
def _gemm_lora_kernel(
    x_ptr,  # [M, K], unit stride on K
    w_ptr,  # [N, K], unit stride on K
    bias_ptr,  # [N] (unused unless HAS_BIAS)
    v_ptr,  # [M, >= R] shrink output (unused unless HAS_LORA)
    b_ptr,  # [slots, N, R_max], unit stride on R
    scales_ptr,  # fp32 [slots]
    ranks_ptr,  # int32 [slots] (unused unless HAS_RANKS)
    row_slot_ptr,  # int [rows]: slot per row, -1 = no adapter
    y_ptr,  # [M, N] out, unit stride on N
    M,
    N,
    K,
    row_len,
    rank_cap,
    stride_xm,
    stride_wn,
    stride_vm,
    stride_bs,
    stride_bn,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr,  # M tiles per group of the launch order (neighbours share W tiles in L2)
    HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr,
    HAS_RANKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 operands, else "tf32" (ignored for 16-bit)
    DOT_IN_FP32: tl.constexpr,  # the CPU interpreter multiplies 16-bit operands as raw bits
):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    rows = offs_m.to(tl.int64)
    cols = offs_n.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        mask_k = ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptr + cols[None, :] * stride_wn + ks[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if DOT_IN_FP32:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(x, w, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if HAS_LORA:
        slots = tl.load(row_slot_ptr + offs_m // row_len, mask=mask_m, other=-1).to(tl.int32)
        offs_r = tl.arange(0, BLOCK_R)
        v = tl.load(
            v_ptr + rows[:, None] * stride_vm + offs_r[None, :],
            mask=(mask_m & (slots >= 0))[:, None] & (offs_r < rank_cap)[None, :],
            other=0.0,
        ).to(tl.float32)  # [BM, R]; rows without an adapter are never read
        slot = tl.min(tl.where(slots >= 0, slots, NO_SLOT))
        while slot < NO_SLOT:
            rank = rank_cap
            if HAS_RANKS:
                rank = tl.minimum(tl.load(ranks_ptr + slot), rank_cap)
            mask_r = offs_r < rank
            mine = tl.where((slots == slot)[:, None] & mask_r[None, :], v, 0.0)
            b = tl.load(
                b_ptr + slot.to(tl.int64) * stride_bs + cols[None, :] * stride_bn + offs_r[:, None],
                mask=mask_r[:, None] & mask_n[None, :],
                other=0.0,
            )  # [R, BN]
            # the scale goes into v before its one rounding to the weights' dtype, so that the dot
            # accumulates straight into acc (scaling the dot's result instead keeps a second
            # fp32 tile live: 183 instead of 128 registers at the default launch, ptxas sm_90a)
            mine = (mine * tl.load(scales_ptr + slot)).to(b.dtype)
            if DOT_IN_FP32:
                mine = mine.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(mine, b, acc, input_precision=DOT_PRECISION)
            slot = tl.min(tl.where(slots > slot, slots, NO_SLOT))
    tl.store(
        y_ptr + rows[:, None] * stride_ym + cols[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


DEFAULT_CONFIG = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}


def gemm_lora(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None,  # [N]
    v: torch.Tensor | None = None,  # [M, >= R_max] shrink output (fp32 or x's dtype)
    lora_b: torch.Tensor | None = None,  # [slots, N, R_max]
    scales: torch.Tensor | None = None,  # fp32 [slots]
    row_slots: torch.Tensor | None = None,  # int [M / row_len], -1 = no adapter
    row_len: int = 1,
    ranks: torch.Tensor | None = None,  # int32 [slots]
    max_rank: int | None = None,  # the batch's largest rank (sizes the rank tile); None = R_max
    config: dict | None = None,
) -> torch.Tensor:
    """y = x Wᵀ + bias + each token's scale · v B[slot]ᵀ (see the module docstring); a new [M, N]."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], "x [M, K], weight [N, K]"
    assert x.dtype == weight.dtype and x.stride(1) == 1 and weight.stride(1) == 1, "same dtype, unit stride on K"
    num_tokens, hidden = x.shape
    out_features = weight.shape[0]
    assert bias is None or (bias.shape == (out_features,) and bias.stride(0) == 1)
    has_lora = lora_b is not None
    if has_lora:
        assert v is not None and scales is not None and row_slots is not None
        assert num_tokens == row_slots.shape[0] * row_len, f"{num_tokens} tokens != rows x {row_len}"
        assert lora_b.shape[1] == out_features and lora_b.stride(2) == 1 and lora_b.dtype == x.dtype
        assert v.shape[0] == num_tokens and v.shape[1] >= lora_b.shape[2] and v.stride(1) == 1
        assert scales.dtype == torch.float32 and scales.shape == (lora_b.shape[0],)
        assert ranks is None or (ranks.dtype == torch.int32 and ranks.shape == (lora_b.shape[0],))
    r_max = lora_b.shape[2] if has_lora else 0
    rank_cap = min(r_max, max_rank or r_max)
    config = dict(DEFAULT_CONFIG if config is None else config)
    y = torch.empty(num_tokens, out_features, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(num_tokens, config["BLOCK_M"]) * triton.cdiv(out_features, config["BLOCK_N"]),)
    stand_in = x  # any tensor for pointers that a constexpr switch leaves unread
    _gemm_lora_kernel[grid](
        x,
        weight,
        stand_in if bias is None else bias,
        v if has_lora else stand_in,
        lora_b if has_lora else stand_in,
        scales if has_lora else stand_in,
        ranks if ranks is not None else (row_slots if has_lora else stand_in),
        row_slots if has_lora else stand_in,
        y,
        num_tokens,
        out_features,
        hidden,
        row_len,
        rank_cap,
        x.stride(0),
        weight.stride(0),
        v.stride(0) if has_lora else 0,
        lora_b.stride(0) if has_lora else 0,
        lora_b.stride(1) if has_lora else 0,
        y.stride(0),
        BLOCK_M=config["BLOCK_M"],
        BLOCK_N=config["BLOCK_N"],
        BLOCK_K=config["BLOCK_K"],
        BLOCK_R=rank_block(max(rank_cap, 1)),
        GROUP_M=config["GROUP_M"],
        HAS_BIAS=bias is not None,
        HAS_LORA=has_lora,
        HAS_RANKS=ranks is not None,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        DOT_IN_FP32=x.device.type == "cpu",
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )
    return y
