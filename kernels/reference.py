"""Float32 torch reference for SGMV shrink and expand; also the CPU serving path.

Each segment is one matmul on a slice of contiguous tokens (no per-token gathers), so
the reference is as fast on CPU as the matmuls themselves. Arithmetic is float32
whatever the storage dtype; results are rounded once into the output's dtype. It reads
the segment list on the host (one device sync on GPU): fine for tests and the CPU path,
not for the GPU hot path.
"""

from __future__ import annotations

import torch

from .meta import SgmvMeta

# One tolerance policy for every kernel test and benchmark check: (atol, rtol) against
# this reference, for data of unit scale (x, v, y ~ N(0, 1)). bf16 keeps 8 mantissa
# bits (rounding 2^-9 relative, and y is rounded once more on store), fp16 11, fp32
# is IEEE fp32 with a different summation order.
TOLERANCES = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (3e-2, 2e-2),
}


def _slot_rank(ranks: torch.Tensor | None, slot: int, r_max: int) -> int:
    return r_max if ranks is None else min(int(ranks[slot]), r_max)


def sgmv_shrink_ref(
    x: torch.Tensor,  # [T, H_in]
    lora_a: torch.Tensor,  # [num_slots, R_max, H_in]
    meta: SgmvMeta,
    v: torch.Tensor,  # [T, >= R_max], written in place
    ranks: torch.Tensor | None = None,  # int [num_slots]
) -> torch.Tensor:
    """Semantics (same as sgmv_shrink):
        for each token t with slot s = slot(t) >= 0, r = rank(s):
            v[t, :r] = x[t, :] @ lora_a[s, :r, :]ᵀ      [H_in] x [H_in, r] -> [r]
            v[t, r:R_max] = 0
        rows of slot -1 are left untouched.
    Writes v in place and returns it.
    """
    r_max = lora_a.shape[1]
    ranks_host = None if ranks is None else ranks.tolist()
    for start, end, slot in meta.segments():
        if slot < 0:
            continue
        rank = _slot_rank(ranks_host, slot, r_max)
        out = x[start:end].float() @ lora_a[slot, :rank].float().t()
        v[start:end, :rank] = out.to(v.dtype)
        v[start:end, rank:r_max] = 0
    return v


def sgmv_expand_ref(
    v: torch.Tensor,  # [T, >= R_max]
    lora_b: torch.Tensor,  # [num_slots, H_out, R_max]
    scales: torch.Tensor,  # fp32 [num_slots]
    meta: SgmvMeta,
    y: torch.Tensor,  # [T, >= y_offset + H_out], updated in place
    ranks: torch.Tensor | None = None,  # int [num_slots]
    y_offset: int = 0,
    accumulate: bool = True,
    bias: torch.Tensor | None = None,  # [H_out]; only with accumulate=False
    residual: torch.Tensor | None = None,  # [T, H_out]; added after the update (accumulate)
    gelu: bool = False,  # exact GELU of the updated row (accumulate)
    layer_norm: tuple | None = None,  # (weight, bias, eps): then torch's layer_norm of the row
) -> torch.Tensor:
    """Semantics (same as sgmv_expand):
        for each token t with slot s = slot(t) >= 0, r = rank(s):
            y[t, y_offset : y_offset + H_out] += scales[s] * v[t, :r] @ lora_b[s, :, :r]ᵀ
        or, with accumulate=False, = bias (0 if None) + the same update;
        then, rounded to y's dtype, + residual[t] and / or the exact GELU, each rounded (torch's
        own add and gelu on the stored row), then torch's layer_norm of the row with ``layer_norm``;
        rows of slot -1 are left untouched.
    Updates y in place and returns it.
    """
    h_out, r_max = lora_b.shape[1], lora_b.shape[2]
    assert bias is None or not accumulate, "bias is only added when writing (accumulate=False)"
    assert (residual is None and not gelu) or accumulate, "epilogues (residual, gelu) need accumulate=True"
    ranks_host = None if ranks is None else ranks.tolist()
    scales_host = scales.tolist()
    y_cols = y[:, y_offset : y_offset + h_out]
    for start, end, slot in meta.segments():
        if slot < 0:
            continue
        rank = _slot_rank(ranks_host, slot, r_max)
        delta = v[start:end, :rank].float() @ lora_b[slot, :, :rank].float().t()
        y_rows = y_cols[start:end]
        if accumulate:
            before = y_rows.float()
        else:
            before = torch.zeros(h_out, device=y.device) if bias is None else bias.float()
        out = (before + scales_host[slot] * delta).to(y.dtype)
        if residual is not None:
            out = out + residual[start:end]
        if gelu:
            out = torch.nn.functional.gelu(out)
        if layer_norm is not None:
            out = torch.nn.functional.layer_norm(out, (h_out,), *layer_norm)
        y_rows.copy_(out)
    return y


def relpos_bias_ref(
    c2p: torch.Tensor | None,  # [B, h, L, W]
    p2c: torch.Tensor | None,  # [B, h, L, W]
    rel_index: torch.Tensor,  # int [2L - 1]
    key_bias: torch.Tensor,  # [B, L]
    scale: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """DeBERTa's attention bias by plain gathers in float32 (see relpos.py):
    bias[b, h, i, j] = key_bias[b, j] + scale * (c2p[b, h, i, rel(i, j)] + p2c[b, h, j, rel(i, j)])
    with rel(i, j) = rel_index[j - i + L - 1]."""
    ref = c2p if c2p is not None else p2c
    batch, heads, length, _ = ref.shape
    pos = torch.arange(length, device=rel_index.device)
    index = rel_index.long()[pos[None, :] - pos[:, None] + length - 1]  # [L(i), L(j)]
    acc = torch.zeros(batch, heads, length, length, dtype=torch.float32, device=ref.device)
    if c2p is not None:
        acc += torch.gather(c2p.float(), -1, index.expand(batch, heads, length, length))
    if p2c is not None:  # p2c[b, h, j, rel(i, j)]: gather along rows j, then swap to [i, j]
        acc += torch.gather(p2c.float(), -1, index.t().expand(batch, heads, length, length)).transpose(-1, -2)
    return (acc * scale + key_bias.float().view(batch, 1, 1, length)).to(out_dtype)


def disentangled_attention_ref(
    q: torch.Tensor,  # [B*L, h*d]
    k: torch.Tensor,
    v: torch.Tensor,
    c2p: torch.Tensor | None,  # [B, h, L, W]
    p2c: torch.Tensor | None,
    rel_index: torch.Tensor,  # int [2L - 1]
    key_bias: torch.Tensor,  # [B, L]
    scale: float,
    batch: int,
    length: int,
    heads: int,
) -> torch.Tensor:
    """DeBERTa's attention in float32 (see disattn.py): softmax(q·kᵀ·scale + bias)·v with
    relpos_bias_ref's bias, [B*L, h*d]."""

    def split(t: torch.Tensor) -> torch.Tensor:
        return t.float().view(batch, length, heads, -1).transpose(1, 2)

    if c2p is None and p2c is None:
        bias = key_bias.float().view(batch, 1, 1, length)
    else:
        bias = relpos_bias_ref(c2p, p2c, rel_index, key_bias, scale, torch.float32)
    scores = split(q) @ split(k).transpose(-1, -2) * scale + bias
    out = torch.softmax(scores, dim=-1) @ split(v)
    return out.transpose(1, 2).reshape(batch * length, -1)


def position_scores_ref(
    x: torch.Tensor,  # [B*L, H]
    table: torch.Tensor,  # [W, H]
    batch: int,
    length: int,
    heads: int,
    lora_b: torch.Tensor | None = None,  # [slots, H, R]
    row_slots: torch.Tensor | None = None,  # int [B], -1 = no adapter
    v: torch.Tensor | None = None,  # [G, R, W]
    row_group: torch.Tensor | None = None,  # int [B]
) -> torch.Tensor:
    """DeBERTa's position scores with per-row LoRA, in float32 (see posscores.py):
    out[b, h, i, w] = x[b, i, h] · table[w, h] + (x[b, i, h] · B[s_b, h]) · V[g_b, :, w]
    for rows with a slot s_b >= 0, x[b, i, h] being the head-h features of token i."""
    window, hidden = table.shape
    head = hidden // heads
    xh = x.float().view(batch, length, heads, head)
    out = torch.einsum("blhd,whd->bhlw", xh, table.float().view(window, heads, head))
    if lora_b is not None:
        for b, (slot, group) in enumerate(zip(row_slots.tolist(), row_group.tolist())):
            if slot >= 0:
                u = torch.einsum("lhd,hdr->hlr", xh[b], lora_b[slot].float().view(heads, head, -1))
                out[b] += u @ v[group].float()
    return out


def position_scores_eager(
    x: torch.Tensor,  # [B*L, H]
    table: torch.Tensor,  # [W, H]
    batch: int,
    length: int,
    heads: int,
    lora_b: torch.Tensor | None = None,  # [slots, H, R]
    row_slots: torch.Tensor | None = None,  # int [B], -1 = no adapter
    v: torch.Tensor | None = None,  # [G, R, W], zeros for the no-adapter group
    row_group: torch.Tensor | None = None,  # int [B]
) -> torch.Tensor:
    """``position_scores`` in x's dtype with torch ops: the CPU serving path, and the GPU path
    when no adapter of the batch adapts the projection (one GEMM per head over all B*L tokens).
    With adapters, a second, rank-R batched GEMM adds ``(x B_b)(s A_b windowᵀ)`` onto the base
    scores in place. Returns [B, h, L, W] as a strided view of [h, B, L, W]."""
    window, hidden = table.shape
    head = hidden // heads
    th = table.view(window, heads, head).permute(1, 2, 0)  # [h, d, W]
    xh = x.view(batch * length, heads, head).transpose(0, 1)  # [h, B*L, d]
    scores = torch.bmm(xh, th).view(heads * batch, length, window)  # the base scores, [h*B, L, W]
    if lora_b is not None:
        rank = lora_b.shape[-1]
        b_rows = lora_b.index_select(0, row_slots.clamp(min=0))  # no-adapter rows gather slot 0 ...
        v_rows = v.index_select(0, row_group)  # [B, R, W]
        xb = x.view(batch, length, heads, head).transpose(1, 2)  # [B, h, L, d]
        u = torch.matmul(xb, b_rows.view(batch, heads, head, rank))  # [B, h, L, R]
        # ... and their u is selected away (not multiplied by a zero v: a non-finite slot 0 would give NaN)
        u = torch.where((row_slots >= 0).view(batch, 1, 1, 1), u, torch.zeros((), dtype=u.dtype, device=u.device))
        u = u.transpose(0, 1).reshape(heads * batch, length, rank)
        v_rows = v_rows.unsqueeze(0).expand(heads, batch, rank, window).reshape(heads * batch, rank, window)
        scores.baddbmm_(u, v_rows)
    return scores.view(heads, batch, length, window).transpose(0, 1)


def span_scores_ref(
    start: torch.Tensor,  # [B, L, K]
    end: torch.Tensor,  # [B, L, K]
    bias: torch.Tensor | None,  # [K]
    queries: torch.Tensor,  # [B, Q, K]
    query_bias: torch.Tensor | None,  # [B, Q]
    lengths: torch.Tensor,  # int [B]
    max_width: int,
) -> torch.Tensor:
    """Float32 reference of ``span_scores`` (spanscores.py), materialising every span:
    logits[b, q, l, w] = relu(start[b, l] + end[b, l + w] + bias) · queries[b, q] + query_bias[b, q],
    -inf where l + w >= min(L, lengths[b]). Returns [B, Q, L, W] float32."""
    batch, length, k_dim = start.shape
    ends = torch.arange(length)[:, None] + torch.arange(max_width)[None, :]  # [L, W]
    end_rows = torch.cat([end.float(), end.new_zeros(batch, max_width, k_dim, dtype=torch.float32)], dim=1)
    hidden = start.float()[:, :, None, :] + end_rows[:, ends]  # [B, L, W, K]
    if bias is not None:
        hidden = hidden + bias.float()
    logits = torch.einsum("blwk,bqk->bqlw", hidden.relu(), queries.float())
    if query_bias is not None:
        logits = logits + query_bias.float()[:, :, None, None]
    valid = ends[None] < lengths.cpu().view(-1, 1, 1).clamp(max=length)
    return logits.masked_fill(~valid[:, None].to(logits.device), float("-inf"))
