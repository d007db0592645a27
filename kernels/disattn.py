"""DeBERTa's disentangled attention in one kernel: scores, relative-position bias, softmax and
the weighted values, without the [B, h, L, L] bias tensor.

The eager path (``manylora.encoder.EncoderLayer``) runs relpos.py, which writes

    bias[b, h, i, j] = key_bias[b, j] + scale * (c2p[b, h, i, r] + p2c[b, h, j, r]),
    r = rel_index[j - i + L - 1]

to memory in the serving dtype, and then ``scaled_dot_product_attention(q, k, v, bias, scale)``
reads it back. On the H200 the two took 18.8 + 18.3 ms of the 207 ms of GPU time per 1,024
LoRA rows (session 12, ``perf/h200-2026-12-02/session12/11cfbe5-kernels-cap65536-adapters1024.txt``).

Here a program holds BLOCK_M queries of one (row, head) and walks the keys in tiles, as flash
attention does: ``q · k * scale`` in float32, plus the position term gathered from c2p and p2c
for the tile (the loads relpos.py makes, now from L2 instead of a written tensor), rounded to the
serving dtype as relpos.py stores it, plus the key mask; an online softmax; ``p · v`` with p in
the serving dtype. Two savings besides the bias tensor's traffic:

* keys past a row's last real token are not visited (``kv_len``: the rows of a chunk are padded
  to its longest; their masked keys add exactly 0 to the softmax, so skipping them changes
  nothing);
* query tiles that start past ``kv_len`` are not computed: they are padding, which no real token
  reads (keys are masked, layers are row-wise); they are written as 0.

A row with no real token (CUDA-graph padding rows) gets 0 everywhere. The output is written in
the [B, L, h, d] layout the next linear reads, so the transpose copy after the attention goes too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _disentangled_attention_kernel(
    q_ptr,  # [B*L, h*d] (row stride stride_t, unit stride inside a row)
    k_ptr,
    v_ptr,
    c2p_ptr,  # [B, h, L, W] (any strides, unit stride on W)
    p2c_ptr,
    idx_ptr,  # int32 [2L - 1]
    mask_ptr,  # fp32 [B, L] additive key bias (0 or a large negative)
    len_ptr,  # int32 [B]: 1 + the last real token of each row (0: none)
    out_ptr,  # [B*L, h*d] contiguous
    heads,
    length,
    scale,
    stride_q,
    stride_k,
    stride_v,
    stride_c_b,
    stride_c_h,
    stride_c_l,
    stride_p_b,
    stride_p_h,
    stride_p_l,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_C2P: tl.constexpr,
    HAS_P2C: tl.constexpr,
    ROUND_BIAS: tl.constexpr,  # 16-bit serving dtype: the bias rounded as relpos.py stores it
    PRECISION: tl.constexpr,  # "ieee" for float32 (no TF32)
    DOT_IN_FP32: tl.constexpr,  # the CPU interpreter: its dot is only right in fp32
):
    bh = tl.program_id(0)  # rows x heads on axis 0: axis 1 stops at 65,535 (relpos.py's comment)
    pid_m = tl.program_id(1)
    b = bh // heads
    h = bh % heads
    kv_len = tl.load(len_ptr + b)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_m = offs_m < length
    tokens_m = (b.to(tl.int64) * length + offs_m.to(tl.int64))[:, None]
    column = h * HEAD_DIM + offs_d[None, :]
    q = tl.load(q_ptr + tokens_m * stride_q + column, mask=mask_m[:, None], other=0.0)
    dtype = q.dtype
    if DOT_IN_FP32:
        q = q.to(tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    end_n = tl.where(start_m < kv_len, kv_len, 0)  # a query tile of padding only: no keys
    c_base = c2p_ptr + b.to(tl.int64) * stride_c_b + h.to(tl.int64) * stride_c_h
    p_base = p2c_ptr + b.to(tl.int64) * stride_p_b + h.to(tl.int64) * stride_p_h
    for start_n in range(0, end_n, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        valid_n = offs_n < end_n
        tokens_n = (b.to(tl.int64) * length + offs_n.to(tl.int64))[:, None]
        k = tl.load(k_ptr + tokens_n * stride_k + column, mask=valid_n[:, None], other=0.0)
        if DOT_IN_FP32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        inside = mask_m[:, None] & valid_n[None, :]
        rel = tl.load(idx_ptr + (offs_n[None, :] - offs_m[:, None] + length - 1), mask=inside, other=0)
        pos = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if HAS_C2P:
            pos += tl.load(c_base + offs_m.to(tl.int64)[:, None] * stride_c_l + rel, mask=inside, other=0.0).to(
                tl.float32
            )
        if HAS_P2C:  # a warp's lanes on several keys' rows: uncoalesced, but from L2 (session 13:
            # reading the tile along the queries and transposing it in registers took twice as long)
            pos += tl.load(p_base + offs_n.to(tl.int64)[None, :] * stride_p_l + rel, mask=inside, other=0.0).to(
                tl.float32
            )
        key = tl.load(mask_ptr + b.to(tl.int64) * length + offs_n, mask=valid_n, other=0.0)
        bias = pos * scale + key[None, :]
        if ROUND_BIAS:
            bias = bias.to(dtype).to(tl.float32)
        s = tl.where(valid_n[None, :], s + bias, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row whose keys so far all have a bias of -inf (float16's finfo.min plus a negative
        # position term rounds to -inf): exp(-inf - -inf) would be NaN; 0 keeps its sums at 0
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + tokens_n * stride_v + column, mask=valid_n[:, None], other=0.0)
        if DOT_IN_FP32:  # p rounded to the serving dtype all the same
            pv = tl.dot(p.to(dtype).to(tl.float32), v.to(tl.float32), input_precision=PRECISION)
        else:
            pv = tl.dot(p.to(dtype), v, input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tokens_m * (heads * HEAD_DIM) + column, out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None])


def disentangled_attention(
    q: torch.Tensor,  # [B*L, h*d], unit stride inside a row
    k: torch.Tensor,
    v: torch.Tensor,
    c2p: torch.Tensor | None,  # [B, h, L, W]
    p2c: torch.Tensor | None,
    rel_index: torch.Tensor,  # int32 [2L - 1]
    key_bias: torch.Tensor,  # [B, L] additive
    kv_len: torch.Tensor,  # int32 [B] (key_lengths)
    scale: float,
    batch: int,
    length: int,
    heads: int,
    block_m: int = 64,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """softmax(q·kᵀ·scale + bias)·v per (row, head) with relpos.py's bias, [B*L, h*d] in q's dtype."""
    hidden = q.shape[1]
    head_dim = hidden // heads
    from . import disentangled_attention_supported

    assert disentangled_attention_supported(head_dim) and hidden == heads * head_dim, "head size"
    for t in (q, k, v):
        assert t.shape == (batch * length, hidden) and t.stride(1) == 1
    for t in (c2p, p2c):
        assert t is None or (t.shape[:3] == (batch, heads, length) and t.stride(3) == 1), "rows of W contiguous"
    assert rel_index.shape == (2 * length - 1,) and rel_index.dtype == torch.int32
    assert kv_len.shape == (batch,) and kv_len.dtype == torch.int32
    key_bias = key_bias.to(torch.float32).contiguous()
    out = torch.empty(batch * length, hidden, dtype=q.dtype, device=q.device)
    ref = c2p if c2p is not None else (p2c if p2c is not None else q.new_zeros(batch, heads, length, 1))
    c, p = (c2p if c2p is not None else ref), (p2c if p2c is not None else ref)
    grid = (batch * heads, triton.cdiv(length, block_m))
    _disentangled_attention_kernel[grid](
        q,
        k,
        v,
        c,
        p,
        rel_index,
        key_bias,
        kv_len,
        out,
        heads,
        length,
        float(scale),
        q.stride(0),
        k.stride(0),
        v.stride(0),
        c.stride(0),
        c.stride(1),
        c.stride(2),
        p.stride(0),
        p.stride(1),
        p.stride(2),
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HAS_C2P=c2p is not None,
        HAS_P2C=p2c is not None,
        ROUND_BIAS=q.dtype in (torch.bfloat16, torch.float16),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_IN_FP32=q.device.type == "cpu",
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
