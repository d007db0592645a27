"""DeBERTa's position scores with every row's own LoRA on the position projection, in one pass.

DeBERTa-v3 scores every query (c2p) and every key (p2c) against the relative-position table
projected through key_proj (c2p) or query_proj (p2c). With LoRA on those projections each
adapter has its own projected table ``table + s (window Aᵀ) Bᵀ``, so for row b (adapter
slot s_b, group g_b of the batch's distinct adapters) and head h:

    out[b, h, i, w] = x[b, i, h] · table[w, h]  +  (x[b, i, h] · B[s_b, h]) · V[g_b, :, w]

where x[b, i, h] is the head-h slice (d features) of token i, ``B[s, h]`` the head-h rows of
slot s's B factor ([d, R]) and ``V[g] = s_g A_g windowᵀ`` ([R, W], zeros for rows without an
adapter). The eager form runs the base scores as one GEMM per head, then materialises the
rank-R product and adds it in place: three extra passes over the [B, h, L, W] scores plus
copies of x and V into the GEMM's batch layout. Here the program for an (L, W) tile of one
(b, h) computes both products with tensor-core dots (x tile [BL, d] against the table tile
[d, BW]; x tile against B [d, R], then that against V [R, BW]) and writes the scores once.

Rows of slot -1 skip the low-rank term. Ranks up to the slot width are padded with zeros in
the store, so a batch of mixed ranks runs at the padded width R (a power of two >= 16 here).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import position_scores_supported


@triton.jit
def _position_scores_kernel(
    x_ptr,  # [B*L, H] (unit stride on H)
    table_ptr,  # [W, H] (unit stride on H)
    b_ptr,  # [slots, H, R_slot] B factors (unit stride on R)
    slot_ptr,  # int [B]: slot of row b, -1 = no adapter
    v_ptr,  # [G, R_slot, W] s·A·windowᵀ per group (unit stride on W)
    group_ptr,  # int [B]: group of row b
    out_ptr,  # [B, h, L, W] contiguous
    length,
    window,
    heads,
    rank,
    stride_x,
    stride_t,
    stride_bs,
    stride_bo,
    stride_vg,
    stride_vr,
    HEAD: tl.constexpr,
    RANK: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_W: tl.constexpr,
    HAS_LORA: tl.constexpr,
    PRECISION: tl.constexpr,  # "ieee" for fp32 inputs, else "tf32" (the u dot; ignored for 16-bit)
    DOT_IN_FP32: tl.constexpr,  # the CPU interpreter's dot is only right in fp32
):
    bh = tl.program_id(1)
    b = bh // heads
    h = bh % heads
    tiles_w = tl.cdiv(window, BLOCK_W)
    offs_l = (tl.program_id(0) // tiles_w) * BLOCK_L + tl.arange(0, BLOCK_L)
    offs_w = (tl.program_id(0) % tiles_w) * BLOCK_W + tl.arange(0, BLOCK_W)
    cols = h * HEAD + tl.arange(0, HEAD)
    mask_l = offs_l < length
    mask_w = offs_w < window
    rows = b.to(tl.int64) * length + offs_l
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask_l[:, None], other=0.0)  # [BL, d]
    t = tl.load(
        table_ptr + offs_w.to(tl.int64)[None, :] * stride_t + cols[:, None], mask=mask_w[None, :], other=0.0
    )  # [d, BW]
    if DOT_IN_FP32:
        x = x.to(tl.float32)
        t = t.to(tl.float32)
    acc = tl.dot(x, t, input_precision=PRECISION)
    if HAS_LORA:
        slot = tl.load(slot_ptr + b)
        if slot >= 0:
            group = tl.load(group_ptr + b)
            offs_r = tl.arange(0, RANK)
            mask_r = offs_r < rank
            bf = tl.load(
                b_ptr + slot.to(tl.int64) * stride_bs + cols[:, None] * stride_bo + offs_r[None, :],
                mask=mask_r[None, :],
                other=0.0,
            )  # [d, R]
            # u in fp32 operands: a 16-bit dot here that reuses the x tile of the dot above gives
            # wrong results with Triton 3.6 on sm90 (tests/kernels/test_position_scores.py)
            u = tl.dot(x.to(tl.float32), bf.to(tl.float32), input_precision=PRECISION)  # [BL, R]
            v = tl.load(
                v_ptr + group.to(tl.int64) * stride_vg + offs_r[:, None] * stride_vr + offs_w[None, :],
                mask=mask_r[:, None] & mask_w[None, :],
                other=0.0,
            )  # [R, BW]
            u = u.to(v.dtype)  # rounded like the eager path's u
            if DOT_IN_FP32:
                u = u.to(tl.float32)
                v = v.to(tl.float32)
            acc += tl.dot(u, v, input_precision=PRECISION)
    out_rows = (bh.to(tl.int64) * length + offs_l)[:, None] * window
    tl.store(
        out_ptr + out_rows + offs_w[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask_l[:, None] & mask_w[None, :]
    )


def position_scores(
    x: torch.Tensor,  # [B*L, H]
    table: torch.Tensor,  # [W, H]
    batch: int,
    length: int,
    heads: int,
    lora_b: torch.Tensor | None = None,  # [slots, H, R]
    row_slots: torch.Tensor | None = None,  # int [B], -1 = no adapter
    v: torch.Tensor | None = None,  # [G, R, W], x's dtype
    row_group: torch.Tensor | None = None,  # int [B]
    block_l: int = 64,
    block_w: int = 64,
    num_warps: int = 4,
) -> torch.Tensor:
    """Scores [B, h, L, W] (contiguous); see the module docstring."""
    window, hidden = table.shape
    head = hidden // heads
    assert position_scores_supported(head) and head * heads == hidden, f"head size {head}: a power of two >= 16"
    assert x.shape == (batch * length, hidden) and x.stride(1) == 1 and table.stride(1) == 1
    has_lora = lora_b is not None
    if has_lora:
        assert row_slots is not None and v is not None and row_group is not None
        assert lora_b.shape[1] == hidden and lora_b.stride(2) == 1 and v.stride(2) == 1
        assert v.shape[1:] == (lora_b.shape[2], window) and row_slots.shape == row_group.shape == (batch,)
    rank = lora_b.shape[2] if has_lora else 0
    out = torch.empty(batch, heads, length, window, dtype=x.dtype, device=x.device)
    ref = x  # stands in for absent LoRA operands (never read)
    grid = (triton.cdiv(length, block_l) * triton.cdiv(window, block_w), batch * heads)
    _position_scores_kernel[grid](
        x,
        table,
        lora_b if has_lora else ref,
        row_slots if has_lora else ref,
        v if has_lora else ref,
        row_group if has_lora else ref,
        out,
        length,
        window,
        heads,
        rank,
        x.stride(0),
        table.stride(0),
        lora_b.stride(0) if has_lora else 0,
        lora_b.stride(1) if has_lora else 0,
        v.stride(0) if has_lora else 0,
        v.stride(1) if has_lora else 0,
        HEAD=head,
        RANK=max(16, triton.next_power_of_2(max(rank, 1))),
        BLOCK_L=block_l,
        BLOCK_W=block_w,
        HAS_LORA=has_lora,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        DOT_IN_FP32=x.device.type == "cpu",
        num_warps=num_warps,
    )
    return out
