"""GLiNER2's span scores in one pass, without the [B, L, W, 4H] span tensor.

GLiNER2 scores every span (start word l, width w) of a row against each of its queries q with
the factorised form of its span head (``SpanMarkerV0.score_queries``):

    hidden[b, l, w] = relu(start[b, l] + end[b, l + w] + c)          # [4H], rounded per op
    logits[b, q, l, w] = hidden[b, l, w] · F[b, q] + g[b, q]         # -inf where l + w >= len_b

with ``start`` / ``end`` the token states through the projections and the two halves of
``out_project``'s first layer ([B, L, 4H]), ``c`` that layer's bias, ``F = queries W2`` the
queries folded through its last layer and ``g = queries · b2``. GLiNER2 materialises ``hidden``
for all B x L x W spans (W = max_width, 12) at 4H features: for the benchmark's 1,024 rows of
~110 words that is ~8 GB of 16-bit values, written and read by three elementwise passes and a
batched GEMM. Here a program takes BLOCK_M consecutive (l, w) pairs of one row and BLOCK_Q of its
queries, walks the 4H features in BLOCK_K steps (the start and end rows it needs are loaded per
step; consecutive pairs share them, so they come from cache), builds ``hidden``'s tile in
registers and accumulates its dot with the queries' tile in float32. Only the logits are written.

Rounding: with 16-bit inputs the two sums are rounded to the input dtype as GLiNER2's separate
torch ops round them (each op computes in float32 and stores 16 bits), so ``hidden`` is the value
GLiNER2 multiplies; the dot accumulates in float32 and the logit is rounded once, as its baddbmm
does. Only the summation order of the dot differs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _round(x, dtype: tl.constexpr, BIT_RTNE: tl.constexpr):
    """float32 x rounded to ``dtype`` (round to nearest even, as torch stores 16-bit results),
    returned as float32. BIT_RTNE: bfloat16 by integer arithmetic, for the CPU interpreter, whose
    float32 -> bfloat16 cast truncates (Triton 3.9); a GPU's cast rounds to nearest even itself."""
    if BIT_RTNE and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return x.to(dtype).to(tl.float32)


@triton.jit
def _span_scores_kernel(
    start_ptr,  # [B, L, K] (unit stride on K)
    end_ptr,  # [B, L, K] (unit stride on K)
    bias_ptr,  # [K] (read when HAS_BIAS)
    query_ptr,  # [B, Q, K] folded queries (unit stride on K)
    qbias_ptr,  # [B, Q] (read when HAS_QBIAS; unit stride on Q)
    len_ptr,  # int [B]: each row's word count
    out_ptr,  # [B, Q, L, W] contiguous
    length,
    num_q,
    k_dim,
    stride_s_b,
    stride_s_l,
    stride_e_b,
    stride_e_l,
    stride_q_b,
    stride_q_q,
    stride_g_b,
    WIDTH: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_QBIAS: tl.constexpr,
    ROUND: tl.constexpr,  # 16-bit inputs: round each sum to the input dtype, as GLiNER2's ops do
    PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,  # the CPU interpreter: 16-bit dot operands as raw bits, truncating casts
):
    b = tl.program_id(0).to(tl.int64)  # rows on the first axis: up to 2^31 - 1 programs there, 65,535 on the others
    pid_m = tl.program_id(1)
    pid_q = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # flat (l, w) = l * WIDTH + w
    spans = length * WIDTH
    in_m = offs_m < spans
    first = offs_m // WIDTH
    last = first + offs_m % WIDTH
    has_end = in_m & (last < length)  # GLiNER2 pads end states past L with zeros
    valid = has_end & (last < tl.load(len_ptr + b))
    offs_q = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    mask_q = offs_q < num_q
    offs_k = tl.arange(0, BLOCK_K)
    dtype = start_ptr.dtype.element_ty

    s_ptrs = start_ptr + b * stride_s_b + first.to(tl.int64)[:, None] * stride_s_l + offs_k[None, :]
    e_ptrs = end_ptr + b * stride_e_b + last.to(tl.int64)[:, None] * stride_e_l + offs_k[None, :]
    q_ptrs = query_ptr + b * stride_q_b + offs_q.to(tl.int64)[:, None] * stride_q_q + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_Q), dtype=tl.float32)
    for k in range(0, tl.cdiv(k_dim, BLOCK_K)):
        mask_k = offs_k < k_dim - k * BLOCK_K
        s = tl.load(s_ptrs, mask=in_m[:, None] & mask_k[None, :], other=0.0)
        e = tl.load(e_ptrs, mask=has_end[:, None] & mask_k[None, :], other=0.0)
        h = s.to(tl.float32) + e.to(tl.float32)
        if ROUND:
            h = _round(h, dtype, DOT_IN_FP32)
        if HAS_BIAS:
            c = tl.load(bias_ptr + k * BLOCK_K + offs_k, mask=mask_k, other=0.0)
            h = h + c.to(tl.float32)[None, :]
            if ROUND:
                h = _round(h, dtype, DOT_IN_FP32)
        h = tl.maximum(h, 0.0)
        f = tl.load(q_ptrs, mask=mask_q[:, None] & mask_k[None, :], other=0.0)
        if DOT_IN_FP32:
            acc = tl.dot(h, tl.trans(f.to(tl.float32)), acc, input_precision=PRECISION)
        else:
            acc = tl.dot(h.to(dtype), tl.trans(f), acc, input_precision=PRECISION)
        s_ptrs += BLOCK_K
        e_ptrs += BLOCK_K
        q_ptrs += BLOCK_K
    if HAS_QBIAS:
        g = tl.load(qbias_ptr + b * stride_g_b + offs_q, mask=mask_q, other=0.0)
        acc += g.to(tl.float32)[None, :]
    if ROUND:
        acc = _round(acc, dtype, DOT_IN_FP32)  # the store's cast is then exact
    acc = tl.where(valid[:, None], acc, float("-inf"))
    out_ptrs = out_ptr + (b * num_q + offs_q.to(tl.int64))[None, :] * spans + offs_m[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=in_m[:, None] & mask_q[None, :])


def span_scores(
    start: torch.Tensor,  # [B, L, K]
    end: torch.Tensor,  # [B, L, K]
    bias: torch.Tensor | None,  # [K]
    queries: torch.Tensor,  # [B, Q, K]
    query_bias: torch.Tensor | None,  # [B, Q]
    lengths: torch.Tensor,  # int [B], each <= L
    max_width: int,
    block_m: int = 64,
    block_k: int = 64,
    num_warps: int = 4,
) -> torch.Tensor:
    """Span logits [B, Q, L, max_width] (contiguous, start's dtype); see the module docstring."""
    batch, length, k_dim = start.shape
    num_q = queries.shape[1]
    assert end.shape == start.shape and queries.shape == (batch, num_q, k_dim), "start, end and queries disagree"
    assert start.dtype == end.dtype == queries.dtype, "start, end and queries need one dtype"
    assert start.stride(2) == end.stride(2) == queries.stride(2) == 1, "unit stride on the feature axis"
    assert bias is None or (bias.shape == (k_dim,) and bias.stride(0) == 1)
    assert query_bias is None or (query_bias.shape == (batch, num_q) and query_bias.stride(1) == 1)
    assert lengths.shape == (batch,)
    out = torch.empty(batch, num_q, length, max_width, dtype=start.dtype, device=start.device)
    if out.numel() == 0:
        return out
    block_q = max(16, min(64, triton.next_power_of_2(num_q)))
    grid = (batch, triton.cdiv(length * max_width, block_m), triton.cdiv(num_q, block_q))
    _span_scores_kernel[grid](
        start,
        end,
        start if bias is None else bias,  # any pointer when HAS_BIAS is off
        queries,
        start if query_bias is None else query_bias,
        lengths,
        out,
        length,
        num_q,
        k_dim,
        start.stride(0),
        start.stride(1),
        end.stride(0),
        end.stride(1),
        queries.stride(0),
        queries.stride(1),
        0 if query_bias is None else query_bias.stride(0),
        WIDTH=max_width,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_K=block_k,
        HAS_BIAS=bias is not None,
        HAS_QBIAS=query_bias is not None,
        ROUND=start.dtype != torch.float32,
        PRECISION="ieee" if start.dtype == torch.float32 else "tf32",
        DOT_IN_FP32=start.device.type == "cpu",
        num_warps=num_warps,
    )
    return out
