"""DeBERTa's disentangled attention bias in one pass: mask + c2p + p2c, gathered by relative position.

DeBERTa-v3 adds to every attention score two position terms (He et al. 2021):

    bias[b, h, i, j] = key_bias[b, j] + scale * (c2p[b, h, i, idx(i, j)] + p2c[b, h, j, idx(i, j)])

where c2p = q · (position table through key_proj)ᵀ and p2c = k · (position table through
query_proj)ᵀ, both [B, h, L, W] over the W table rows a length-L sequence can reach, and
idx(i, j) is the bucketed relative position of (i, j), which depends on j - i only:
``idx(i, j) = rel_index[j - i + L - 1]`` (``rel_index`` has 2L - 1 entries).

The eager version gathers both terms into [B, h, L, L] tensors and adds them to the mask
in three more passes; here every output element is read and written once: the program
for an (i, j) tile loads its slice of ``rel_index`` (consecutive j give consecutive
indices inside the linear bucket range, so the c2p and p2c loads stay mostly coalesced),
gathers both terms, adds the key mask in fp32 and stores the bias in the output dtype,
ready for scaled_dot_product_attention. Memory-bound: two [B, h, L, W] reads and one
[B, h, L, L] write.

c2p and p2c may be any strided views (e.g. the [h, B, L, W] output of one batched GEMM per
head, seen as [B, h, L, W]); each row of W must be contiguous. Either term may be absent.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _relpos_bias_kernel(
    c2p_ptr,  # [B, h, L, W] (any strides, unit stride on W)
    p2c_ptr,  # [B, h, L, W] (any strides, unit stride on W)
    idx_ptr,  # int32 [2L - 1]: table row of relative position (j - i), offset by L - 1
    mask_ptr,  # fp32 [B, L] additive key bias (0 or a large negative)
    out_ptr,  # [B, h, L, L] contiguous
    heads,
    length,
    scale,
    stride_c_b,
    stride_c_h,
    stride_c_l,
    stride_p_b,
    stride_p_h,
    stride_p_l,
    BLOCK_I: tl.constexpr,
    BLOCK_J: tl.constexpr,
    HAS_C2P: tl.constexpr,
    HAS_P2C: tl.constexpr,
):
    # a 1-D grid (axis 1 would stop at 65,535 rows x heads); the tiles of one (b, h) are
    # neighbours, so the c2p/p2c rows they share are still in L2
    tiles_j = tl.cdiv(length, BLOCK_J)
    tiles = tl.cdiv(length, BLOCK_I) * tiles_j
    bh = tl.program_id(0) // tiles
    tile = tl.program_id(0) % tiles
    b = bh // heads
    h = bh % heads
    offs_i = (tile // tiles_j) * BLOCK_I + tl.arange(0, BLOCK_I)
    offs_j = (tile % tiles_j) * BLOCK_J + tl.arange(0, BLOCK_J)
    mask_i = offs_i < length
    mask_j = offs_j < length
    inside = mask_i[:, None] & mask_j[None, :]
    rel = tl.load(idx_ptr + (offs_j[None, :] - offs_i[:, None] + length - 1), mask=inside, other=0)
    acc = tl.zeros((BLOCK_I, BLOCK_J), dtype=tl.float32)
    if HAS_C2P:
        base = c2p_ptr + b.to(tl.int64) * stride_c_b + h.to(tl.int64) * stride_c_h
        rows = offs_i.to(tl.int64)[:, None] * stride_c_l
        acc += tl.load(base + rows + rel, mask=inside, other=0.0).to(tl.float32)
    if HAS_P2C:
        base = p2c_ptr + b.to(tl.int64) * stride_p_b + h.to(tl.int64) * stride_p_h
        cols = offs_j.to(tl.int64)[None, :] * stride_p_l
        acc += tl.load(base + cols + rel, mask=inside, other=0.0).to(tl.float32)
    key = tl.load(mask_ptr + b.to(tl.int64) * length + offs_j, mask=mask_j, other=0.0)
    out = acc * scale + key[None, :]
    out_rows = (bh.to(tl.int64) * length + offs_i.to(tl.int64))[:, None] * length
    tl.store(out_ptr + out_rows + offs_j[None, :], out.to(out_ptr.dtype.element_ty), mask=inside)


def relpos_bias(
    c2p: torch.Tensor | None,  # [B, h, L, W]
    p2c: torch.Tensor | None,  # [B, h, L, W]
    rel_index: torch.Tensor,  # int32 [2L - 1]
    key_bias: torch.Tensor,  # [B, L] additive (fp32 preferred)
    scale: float,
    out_dtype: torch.dtype,
    block_i: int = 64,
    block_j: int = 64,
) -> torch.Tensor:
    """bias [B, h, L, L] = key_bias[b, j] + scale * (c2p[.., i, rel(i,j)] + p2c[.., j, rel(i,j)])."""
    ref = c2p if c2p is not None else p2c
    assert ref is not None, "at least one of c2p, p2c"
    batch, heads, length, _ = ref.shape
    for t in (c2p, p2c):
        assert t is None or (t.shape[:3] == ref.shape[:3] and t.stride(3) == 1), "rows of W must be contiguous"
    assert rel_index.shape == (2 * length - 1,) and rel_index.dtype == torch.int32
    key_bias = key_bias.to(torch.float32).contiguous()
    assert key_bias.shape == (batch, length)
    out = torch.empty(batch, heads, length, length, dtype=out_dtype, device=ref.device)
    c, p = (c2p if c2p is not None else ref), (p2c if p2c is not None else ref)
    grid = (batch * heads * triton.cdiv(length, block_i) * triton.cdiv(length, block_j),)
    _relpos_bias_kernel[grid](
        c,
        p,
        rel_index,
        key_bias,
        out,
        heads,
        length,
        float(scale),
        c.stride(0),
        c.stride(1),
        c.stride(2),
        p.stride(0),
        p.stride(1),
        p.stride(2),
        BLOCK_I=block_i,
        BLOCK_J=block_j,
        HAS_C2P=c2p is not None,
        HAS_P2C=p2c is not None,
        num_warps=4,
    )
    return out
