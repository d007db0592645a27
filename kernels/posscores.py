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
copies of x and V into the GEMM's batch layout. Here one program takes an L tile of one
(b, h): it loads the x tile and computes u = x B ([BL, R], tensor-core dot) once, then walks
``w_tiles`` W tiles, each a base dot (x against the table tile) plus a rank-R dot (u against
the V tile), and writes the scores once.

Rows of slot -1 read no B or V (masked loads): their u is zero and the low-rank term
vanishes. Ranks up to the slot width are padded with zeros in the store, so a batch of mixed
ranks runs at the padded width R (a power of two >= 16 here).
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
    W_TILES: tl.constexpr,  # W tiles per program, walked in a loop that reuses the x and u tiles
    HAS_LORA: tl.constexpr,
    PRECISION: tl.constexpr,  # "ieee" for fp32 inputs, else "tf32" (the u dot; ignored for 16-bit)
    DOT_IN_FP32: tl.constexpr,  # the CPU interpreter's dot is only right in fp32
):
    # a 1-D grid (axis 1 would stop at 65,535 rows x heads): the (L tile, W span) programs of
    # one (b, h) are neighbours
    span = BLOCK_W * W_TILES
    spans = tl.cdiv(window, span)
    tiles = tl.cdiv(length, BLOCK_L) * spans
    bh = tl.program_id(0) // tiles
    tile = tl.program_id(0) % tiles
    b = bh // heads
    h = bh % heads
    offs_l = (tile // spans) * BLOCK_L + tl.arange(0, BLOCK_L)
    w_begin = (tile % spans) * span
    w_end = tl.minimum(window, w_begin + span)
    cols = h * HEAD + tl.arange(0, HEAD)
    mask_l = offs_l < length
    rows = b.to(tl.int64) * length + offs_l
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask_l[:, None], other=0.0)  # [BL, d]
    if DOT_IN_FP32:
        x = x.to(tl.float32)
    if HAS_LORA:
        slot = tl.load(slot_ptr + b)
        group = tl.load(group_ptr + b)
        offs_r = tl.arange(0, RANK)
        mask_r = offs_r < tl.where(slot >= 0, rank, 0)  # no adapter: nothing read, u = 0
        bf = tl.load(
            b_ptr + slot.to(tl.int64) * stride_bs + cols[:, None] * stride_bo + offs_r[None, :],
            mask=mask_r[None, :],
            other=0.0,
        )  # [d, R]
        # u in fp32 operands: a 16-bit dot here that reuses the x tile of the base dot gives
        # wrong results with Triton 3.6 on sm90 (tests/kernels/test_position_scores.py)
        u = tl.dot(x.to(tl.float32), bf.to(tl.float32), input_precision=PRECISION)  # [BL, R]
        u = u.to(v_ptr.dtype.element_ty)  # rounded like the eager path's u
        if DOT_IN_FP32:
            u = u.to(tl.float32)
    out_rows = (bh.to(tl.int64) * length + offs_l)[:, None] * window
    for w0 in range(w_begin, w_end, BLOCK_W):
        offs_w = w0 + tl.arange(0, BLOCK_W)
        mask_w = offs_w < w_end
        t = tl.load(
            table_ptr + offs_w.to(tl.int64)[None, :] * stride_t + cols[:, None], mask=mask_w[None, :], other=0.0
        )  # [d, BW]
        if DOT_IN_FP32:
            t = t.to(tl.float32)
        acc = tl.dot(x, t, input_precision=PRECISION)
        if HAS_LORA:
            v = tl.load(
                v_ptr + group.to(tl.int64) * stride_vg + offs_r[:, None] * stride_vr + offs_w[None, :],
                mask=mask_r[:, None] & mask_w[None, :],
                other=0.0,
            )  # [R, BW]
            if DOT_IN_FP32:
                v = v.to(tl.float32)
            acc += tl.dot(u, v, input_precision=PRECISION)
        tl.store(
            out_ptr + out_rows + offs_w[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=mask_l[:, None] & mask_w[None, :],
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
    block_l: int = 128,
    block_w: int = 64,
    num_warps: int = 4,
    w_tiles: int = 8,
) -> torch.Tensor:
    """Scores [B, h, L, W] (contiguous); see the module docstring.

    The default launch (128 x 64 tiles, the whole window of up to 512 in one program's loop)
    was the fastest of ``perf/bench_posscores.py``'s shapes on the H200: 185-189 us per call
    against 408-414 us for one 64 x 64 tile per program, at 256 rows of 224 tokens."""
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
    w_tiles = max(1, min(w_tiles, triton.cdiv(window, block_w)))
    grid = (batch * heads * triton.cdiv(length, block_l) * triton.cdiv(window, block_w * w_tiles),)
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
        W_TILES=w_tiles,
        HAS_LORA=has_lora,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        DOT_IN_FP32=x.device.type == "cpu",
        num_warps=num_warps,
    )
    return out
