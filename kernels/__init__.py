"""SGMV LoRA kernels (imported as manylora.kernels): every token gets its own adapter's update;
DeBERTa's relative-position attention bias in one pass (relpos.py); its position scores
with every row's LoRA on the position projection (posscores.py); the whole disentangled
attention without the bias tensor (disattn.py); and GLiNER2's span scores without the span
tensor (spanscores.py).

Per LoRA layer, with tokens grouped by adapter and `meta` built once per forward:

    v = shrink(x, lora_a, meta, v)                     # v[t] = x[t] @ A[slot(t)]ᵀ
    expand(v, lora_b, scales, meta, y)                 # y[t] += scale · v[t] @ B[slot(t)]ᵀ
    lora_apply(x, y, lora_a, lora_b, scales, meta)     # both, with a scratch v

Backends: "triton" (the kernels in sgmv_shrink.py / sgmv_expand.py; CUDA tensors, or CPU
tensors under TRITON_INTERPRET=1) and "torch" (reference.py: float32, one matmul per
segment; the CPU serving path). Triton is imported only when the "triton" backend runs,
so the torch backend works where Triton is not installed.
"""

from __future__ import annotations

import torch

from .meta import BLOCK_M_CHOICES, SgmvMeta, SgmvMetaBuilder, SgmvTiles, build_sgmv_meta
from .reference import (
    TOLERANCES,
    disentangled_attention_ref,
    position_scores_eager,
    position_scores_ref,
    relpos_bias_ref,
    sgmv_expand_ref,
    sgmv_shrink_ref,
    span_scores_ref,
)

BACKENDS = ("triton", "torch")
# widest row expand's layer_norm epilogue takes: its block holds BLOCK_M x that many float32 values
LAYER_NORM_MAX_WIDTH = 1024

__all__ = [
    "BACKENDS",
    "BLOCK_M_CHOICES",
    "LAYER_NORM_MAX_WIDTH",
    "TOLERANCES",
    "SgmvMeta",
    "SgmvMetaBuilder",
    "SgmvTiles",
    "build_sgmv_meta",
    "default_backend",
    "disentangled_attention",
    "disentangled_attention_ref",
    "disentangled_attention_supported",
    "expand",
    "key_lengths",
    "lora_apply",
    "position_scores",
    "position_scores_eager",
    "position_scores_ref",
    "position_scores_supported",
    "relpos_bias",
    "relpos_bias_ref",
    "sgmv_expand_ref",
    "sgmv_shrink_ref",
    "shrink",
    "shrink_group",
    "span_scores",
    "span_scores_ref",
]


def default_backend(device: torch.device | str) -> str:
    """The triton backend on CUDA, the torch reference elsewhere."""
    return "triton" if torch.device(device).type == "cuda" else "torch"


def _check_backend(backend: str) -> None:
    assert backend in BACKENDS, f"backend must be one of {BACKENDS}, got {backend!r}"


def shrink(
    x: torch.Tensor,  # [T, H_in]
    lora_a: torch.Tensor,  # [num_slots, R_max, H_in]
    meta: SgmvMeta,
    v: torch.Tensor,  # [T, >= R_max], written in place
    ranks: torch.Tensor | None = None,  # int32 [num_slots]
    backend: str = "triton",
) -> torch.Tensor:
    """v[t, :rank] = x[t] @ lora_a[slot(t), :rank]ᵀ; slot -1 rows untouched. See sgmv_shrink."""
    _check_backend(backend)
    if backend == "torch":
        return sgmv_shrink_ref(x, lora_a, meta, v, ranks)
    from .sgmv_shrink import sgmv_shrink

    return sgmv_shrink(x, lora_a, meta, v, ranks)


def shrink_group(
    x: torch.Tensor,  # [T, H_in]
    lora_as,  # 1-3 of [num_slots, R_max, H_in], one shape and layout
    meta: SgmvMeta,
    vs,  # as many [T, >= R_max], written in place
    ranks: torch.Tensor | None = None,
    backend: str = "triton",
) -> None:
    """shrink(x, lora_as[i], meta, vs[i]) for each i, reading x once (sgmv_shrink_group)."""
    _check_backend(backend)
    if backend == "torch":
        for lora_a, v in zip(lora_as, vs):
            sgmv_shrink_ref(x, lora_a, meta, v, ranks)
        return
    from .sgmv_shrink import sgmv_shrink_group

    sgmv_shrink_group(x, lora_as, meta, vs, ranks)


def expand(
    v: torch.Tensor,  # [T, >= R_max]
    lora_b: torch.Tensor,  # [num_slots, H_out, R_max]
    scales: torch.Tensor,  # fp32 [num_slots]
    meta: SgmvMeta,
    y: torch.Tensor,  # [T, >= y_offset + H_out], updated in place
    ranks: torch.Tensor | None = None,  # int32 [num_slots]
    y_offset: int = 0,
    backend: str = "triton",
    accumulate: bool = True,
    bias: torch.Tensor | None = None,  # [H_out]; only with accumulate=False
    residual: torch.Tensor | None = None,  # [T, H_out]; added after the update (accumulate)
    gelu: bool = False,  # exact GELU of the updated row (accumulate)
    layer_norm: tuple | None = None,  # (weight, bias, eps): then torch's layer_norm of the row
) -> torch.Tensor:
    """y[t, y_offset:+H_out] += scales[slot] · v[t, :rank] @ lora_b[slot, :, :rank]ᵀ; slot -1 rows
    untouched. With accumulate=False the rows are written (= bias + the update), y never read.
    ``residual`` / ``gelu``: the layer's next elementwise pass on the updated rows (sgmv_expand)."""
    _check_backend(backend)
    if backend == "torch":
        return sgmv_expand_ref(
            v, lora_b, scales, meta, y, ranks, y_offset, accumulate, bias, residual, gelu, layer_norm
        )
    from .sgmv_expand import sgmv_expand

    return sgmv_expand(
        v,
        lora_b,
        scales,
        meta,
        y,
        ranks,
        y_offset,
        accumulate=accumulate,
        bias=bias,
        residual=residual,
        gelu=gelu,
        layer_norm=layer_norm,
    )


def lora_apply(
    x: torch.Tensor,  # [T, H_in]
    y: torch.Tensor,  # [T, >= y_offset + H_out], the base layer's output; updated in place
    lora_a: torch.Tensor,  # [num_slots, R_max, H_in]
    lora_b: torch.Tensor,  # [num_slots, H_out, R_max]
    scales: torch.Tensor,  # fp32 [num_slots]
    meta: SgmvMeta,
    backend: str = "triton",
    ranks: torch.Tensor | None = None,  # int32 [num_slots]
    y_offset: int = 0,
    v: torch.Tensor | None = None,  # scratch [T, >= R_max]; fp32 [T, R_max] is allocated if None
    accumulate: bool = True,
    bias: torch.Tensor | None = None,  # [H_out]; only with accumulate=False
    residual: torch.Tensor | None = None,  # [T, H_out]; added after the update (accumulate)
    gelu: bool = False,  # exact GELU of the updated row (accumulate)
    layer_norm: tuple | None = None,  # (weight, bias, eps): then torch's layer_norm of the row
    shrunk: bool = False,  # v already holds shrink(x, lora_a) (shrink_group ran for this linear)
) -> torch.Tensor:
    """Semantics:
        for each token t with slot s = slot(t) >= 0:
            y[t, y_offset : y_offset + H_out] += scales[s] * (x[t] @ lora_a[s]ᵀ) @ lora_b[s]ᵀ
        (with accumulate=False: = bias + that update, y never read), then the epilogue
        (``residual``, ``gelu``, ``layer_norm``; see sgmv_expand). Rows of slot -1 are left untouched.
    Mutates y (and the scratch v) in place; returns y.
    """
    if v is None:
        v = torch.empty(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    if not shrunk:
        shrink(x, lora_a, meta, v, ranks, backend)
    return expand(v, lora_b, scales, meta, y, ranks, y_offset, backend, accumulate, bias, residual, gelu, layer_norm)


def relpos_bias(
    c2p: torch.Tensor | None,  # [B, h, L, W]
    p2c: torch.Tensor | None,  # [B, h, L, W]
    rel_index: torch.Tensor,  # int32 [2L - 1]
    key_bias: torch.Tensor,  # [B, L] additive
    scale: float,
    out_dtype: torch.dtype,
    backend: str = "triton",
) -> torch.Tensor:
    """bias[b, h, i, j] = key_bias[b, j] + scale * (c2p[b, h, i, r] + p2c[b, h, j, r]),
    r = rel_index[j - i + L - 1]. See relpos.py."""
    _check_backend(backend)
    if backend == "torch":
        return relpos_bias_ref(c2p, p2c, rel_index, key_bias, scale, out_dtype)
    from .relpos import relpos_bias as kernel

    return kernel(c2p, p2c, rel_index, key_bias, scale, out_dtype)


def key_lengths(attention_mask: torch.Tensor) -> torch.Tensor:
    """int32 [B]: 1 + the position of each row's last real token (0 for a row without one), the
    key range of disentangled_attention."""
    positions = torch.arange(1, attention_mask.shape[1] + 1, device=attention_mask.device, dtype=torch.int32)
    return (attention_mask.to(torch.int32) * positions).amax(dim=1).to(torch.int32)


def disentangled_attention_supported(head_size: int) -> bool:
    """Whether disattn.py takes this head size (a power of two, 16 to 128)."""
    return 16 <= head_size <= 128 and head_size & (head_size - 1) == 0


def disentangled_attention(
    q: torch.Tensor,  # [B*L, h*d]
    k: torch.Tensor,
    v: torch.Tensor,
    c2p: torch.Tensor | None,  # [B, h, L, W]
    p2c: torch.Tensor | None,
    rel_index: torch.Tensor,  # int32 [2L - 1]
    key_bias: torch.Tensor,  # [B, L] additive
    kv_len: torch.Tensor,  # int32 [B]: 1 + each row's last real token
    scale: float,
    batch: int,
    length: int,
    heads: int,
) -> torch.Tensor:
    """softmax(q·kᵀ·scale + bias)·v per (row, head), bias as relpos_bias gives it, [B*L, h*d];
    query positions at or past kv_len are padding (0 or the attention's value). Triton only
    (CUDA, or the CPU interpreter). See disattn.py; disentangled_attention_ref is the float32
    reference."""
    from .disattn import disentangled_attention as kernel

    return kernel(q, k, v, c2p, p2c, rel_index, key_bias, kv_len, scale, batch, length, heads)


def position_scores_supported(head_size: int) -> bool:
    """Whether the triton position-score kernel takes this head size (a power of two >= 16)."""
    return head_size >= 16 and head_size & (head_size - 1) == 0


def position_scores(
    x: torch.Tensor,  # [B*L, H]
    table: torch.Tensor,  # [W, H]
    batch: int,
    length: int,
    heads: int,
    lora_b: torch.Tensor | None = None,  # [slots, H, R]
    row_slots: torch.Tensor | None = None,  # int [B], -1 = no adapter
    v: torch.Tensor | None = None,  # [G, R, W]
    row_group: torch.Tensor | None = None,  # int [B]
    backend: str = "triton",
) -> torch.Tensor:
    """out[b, h, i, w] = x[b, i, h] · table[w, h] + (x[b, i, h] · lora_b[s_b, h]) · v[g_b, :, w]
    (the second term for rows with a slot s_b >= 0); [B, h, L, W]. See posscores.py; the torch
    backend is position_scores_eager (position_scores_ref is the float32 test reference)."""
    _check_backend(backend)
    if backend == "torch":
        return position_scores_eager(x, table, batch, length, heads, lora_b, row_slots, v, row_group)
    from .posscores import position_scores as kernel

    return kernel(x, table, batch, length, heads, lora_b, row_slots, v, row_group)


def span_scores(
    start: torch.Tensor,  # [B, L, K]
    end: torch.Tensor,  # [B, L, K]
    bias: torch.Tensor | None,  # [K]
    queries: torch.Tensor,  # [B, Q, K]
    query_bias: torch.Tensor | None,  # [B, Q]
    lengths: torch.Tensor,  # int [B]
    max_width: int,
) -> torch.Tensor:
    """logits[b, q, l, w] = relu(start[b, l] + end[b, l + w] + bias) · queries[b, q] + query_bias[b, q],
    -inf where l + w >= lengths[b]; [B, Q, L, max_width]. Triton only (CUDA, or the CPU interpreter):
    the CPU serving path keeps GLiNER2's own span head. See spanscores.py; span_scores_ref is the
    float32 reference."""
    from .spanscores import span_scores as kernel

    return kernel(start, end, bias, queries, query_bias, lengths, max_width)
