"""DeBERTa-v2/v3 encoder with adapter-aware linears and per-adapter position tables.

transformers' ``DebertaV2Model`` is the reference (tests compare hidden states within
1e-5 in fp32). We own the forward pass because a mixed-adapter batch needs two things
the reference cannot do:

* every linear runs the base GEMM once for the whole batch and then adds each token's
  own low-rank update (``LoraBatch.apply``), and
* query_proj / key_proj also project the shared relative-position table; with LoRA on
  them every adapter has its own projected table, so each sequence must use its own
  adapter's table (``LoraBatch.position_factors``: in low-rank form, never a table per row).

Two constant-folding tricks keep the position work small:

* LayerNorm(rel_embeddings) and its base projections through every layer's query_proj
  and key_proj do not depend on the input: they are computed once at load time.
* A sequence of length L only reads the table rows between bucket(-(L-1)) and
  bucket(L-1) around the centre; attention uses just that window (about 2L rows
  instead of 2 x position_buckets).

Supported geometry: DeBERTa-v3 as GLiNER2 uses it (relative attention with c2p and/or
p2c, share_att_key, no absolute positions, no token types, no conv layer). Anything
else is refused at load with the option that is not supported.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import nn

from manylora import kernels

# On CUDA, attention runs without cuDNN's SDPA backend: it builds an execution graph for every
# new (rows, length) shape, and the GPU stage's batches vary in both. Measured on the H200
# (perf/profile_core.py, server profile): 2.4 ms of host time per attention call, the largest
# single cost of the GPU stage. MANYLORA_SDPA_CUDNN=1 gives torch its own choice back (A/B).
_SDPA_CUDNN = os.environ.get("MANYLORA_SDPA_CUDNN", "") == "1"


def _attention_backends(device: torch.device):
    from contextlib import nullcontext

    if device.type != "cuda" or _SDPA_CUDNN:
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


if TYPE_CHECKING:  # pragma: no cover
    from manylora.lora.batch import LoraBatch, PositionLora


class AdapterLinear(nn.Module):
    """``y = x Wᵀ + b`` once for the batch, then every token's own LoRA update.

    ``name`` is the module path inside the GLiNER2 model (``encoder.encoder.layer.0.
    attention.self.query_proj``); adapters are matched to linears by that path.
    """

    def __init__(self, name: str, weight: torch.Tensor, bias: Optional[torch.Tensor]):
        super().__init__()
        self.name = name
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(
        self,
        x: torch.Tensor,
        lora: Optional["LoraBatch"] = None,
        residual: Optional[torch.Tensor] = None,
        gelu: bool = False,
        norm: Optional[tuple] = None,
        shrunk: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``x Wᵀ + b`` with each token's LoRA update, then ``+ residual``, the exact GELU and / or
        the layer norm ``norm`` (weight, bias, eps) (DeBERTa's next elementwise passes): inside the
        LoRA expand where the batch allows it (``LoraBatch.fuses_epilogue``), else as torch's own
        add, gelu and layer_norm. ``shrunk``: x Aᵀ of this linear's LoRA, already computed
        (``LoraBatch.shrink_together``)."""
        fused = residual is not None or gelu or norm is not None
        if lora is not None and fused and x.dim() == 2 and lora.fuses_epilogue(self.name):
            y = F.linear(x, self.weight, self.bias)
            # y = norm(gelu(y + update [+ residual])); the norm's block spans the row, so up to a width
            wide = norm is not None and self.out_features > kernels.LAYER_NORM_MAX_WIDTH
            lora.apply(self.name, x, y, residual=residual, gelu=gelu, layer_norm=None if wide else norm, shrunk=shrunk)
            return F.layer_norm(y, (y.shape[-1],), *norm) if wide else y
        if lora is not None and x.dim() == 2 and lora.writes_first(self.name):
            y = x.new_empty(x.shape[0], self.out_features)
            lora.apply(self.name, x, y, accumulate=False, bias=self.bias, shrunk=shrunk)  # y = bias + update
            y.addmm_(x, self.weight.t())  # + x Wᵀ, y read in the GEMM's epilogue
        else:
            y = F.linear(x, self.weight, self.bias)
            if lora is not None:
                lora.apply(self.name, x, y, shrunk=shrunk)
        if residual is not None:
            y = y + residual
        if gelu:
            y = F.gelu(y)
        return y if norm is None else F.layer_norm(y, (y.shape[-1],), *norm)

    @classmethod
    def from_linear(cls, name: str, linear: nn.Linear) -> "AdapterLinear":
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(name, linear.weight.detach().clone(), bias)


@dataclass(frozen=True)
class EncoderGeometry:
    hidden_size: int
    num_layers: int
    num_heads: int
    head_size: int
    intermediate_size: int
    position_buckets: int
    max_relative_positions: int
    c2p: bool
    p2c: bool
    layer_norm_eps: float
    hidden_act: str

    @classmethod
    def from_config(cls, config) -> "EncoderGeometry":
        """Validate a DebertaV2Config and keep what the forward pass needs."""

        def refuse(option: str, value) -> None:
            raise ValueError(
                f"encoder option {option}={value!r} is not supported by the ManyLoRA "
                "encoder (it serves DeBERTa-v3 backbones as GLiNER2 uses them)"
            )

        if getattr(config, "model_type", None) not in ("deberta-v2",):
            refuse("model_type", getattr(config, "model_type", None))
        if not getattr(config, "relative_attention", False):
            refuse("relative_attention", False)
        if not getattr(config, "share_att_key", False):
            refuse("share_att_key", False)
        if getattr(config, "position_biased_input", True):
            refuse("position_biased_input", True)
        if getattr(config, "type_vocab_size", 0) > 0:
            refuse("type_vocab_size", config.type_vocab_size)
        if getattr(config, "conv_kernel_size", 0) > 0:
            refuse("conv_kernel_size", config.conv_kernel_size)
        if getattr(config, "embedding_size", config.hidden_size) != config.hidden_size:
            refuse("embedding_size", config.embedding_size)
        if "layer_norm" not in str(getattr(config, "norm_rel_ebd", "none")).lower():
            refuse("norm_rel_ebd", getattr(config, "norm_rel_ebd", None))
        raw = config.pos_att_type or []
        pos_att = [p.strip().lower() for p in (raw.split("|") if isinstance(raw, str) else raw)]
        if not set(pos_att) <= {"c2p", "p2c"}:
            refuse("pos_att_type", config.pos_att_type)
        heads = config.num_attention_heads
        head_size = getattr(config, "attention_head_size", config.hidden_size // heads)
        if head_size * heads != config.hidden_size:
            refuse("attention_head_size", head_size)
        max_rel = getattr(config, "max_relative_positions", -1)
        if max_rel < 1:
            max_rel = config.max_position_embeddings
        buckets = getattr(config, "position_buckets", -1)
        if buckets <= 0:
            refuse("position_buckets", buckets)
        return cls(
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            head_size=head_size,
            intermediate_size=config.intermediate_size,
            position_buckets=buckets,
            max_relative_positions=max_rel,
            c2p="c2p" in pos_att,
            p2c="p2c" in pos_att,
            layer_norm_eps=config.layer_norm_eps,
            hidden_act=config.hidden_act,
        )


@lru_cache(maxsize=64)
def _relative_index(length: int, buckets: int, max_position: int, device: str):
    """Window-relative position rows for a sequence of ``length`` tokens.

    Returns ``(lo, hi, rel_index)``: the table rows ``lo..hi`` are the only ones read, and
    the pair (query i, key j) reads row ``lo + rel_index[j - i + length - 1]`` for its c2p
    term (through key_proj) and for its p2c term (through query_proj): DeBERTa's p2c index
    of (j, i) equals the c2p index of (i, j) because the log buckets are odd in i - j.
    Uses transformers' own bucketing so positions match the reference exactly.
    """
    from transformers.models.deberta_v2.modeling_deberta_v2 import make_log_bucket_position

    ids = torch.arange(length, dtype=torch.long)
    rel = ids[:, None] - ids[None, :]
    rel = make_log_bucket_position(rel, buckets, max_position).to(torch.long)
    c2p = torch.clamp(rel + buckets, 0, 2 * buckets - 1)
    p2c = torch.clamp(-rel + buckets, 0, 2 * buckets - 1)
    if not torch.equal(p2c.t(), c2p):  # pragma: no cover - transformers' bucketing changed
        raise ValueError("relative position buckets are not odd in i - j; the encoder cannot use them")
    lo = int(c2p.min())
    hi = int(c2p.max())
    # widen the window to a multiple of 16 rows: aligned GEMM outputs pick the fast kernels
    width = min(-(-(hi - lo + 1) // 16) * 16, 2 * buckets)
    lo = min(lo, 2 * buckets - width)
    hi = lo + width - 1
    # row of (i, j) by j - i: i = length - 1 covers j - i <= 0, i = 0 covers j - i > 0
    rel_index = torch.cat([c2p[length - 1], c2p[0, 1:]]) - lo
    return lo, hi, rel_index.to(device=device, dtype=torch.int32)


def _position_scores(
    x: torch.Tensor,
    table: torch.Tensor,
    lora: Optional["PositionLora"],
    batch: int,
    length: int,
    heads: int,
    backend: str,
):
    """x [B*L, H] against the position table [W, H] per head: [B, h, L, W] (maybe a strided view).

    With adapters (``lora`` from ``LoraBatch.position_factors``) every row's scores are
    ``x · tableᵀ + (x B_b)(s A_b windowᵀ)`` per head: on the triton backend one kernel computes
    both and writes the scores once (kernels/posscores.py). Without adapters, and on the torch
    backend, ``kernels.position_scores_eager``: cuBLAS GEMMs (the base alone is fastest there).
    """
    factors = () if lora is None else (lora.lora_b, lora.row_slots, lora.v, lora.row_group)
    fused = lora is not None and backend == "triton" and kernels.position_scores_supported(table.shape[1] // heads)
    return kernels.position_scores(x, table, batch, length, heads, *factors, backend="triton" if fused else "torch")


class EncoderLayer(nn.Module):
    def __init__(self, prefix: str, layer, geometry: EncoderGeometry):
        super().__init__()
        attn = layer.attention
        self.geometry = geometry
        self.query = AdapterLinear.from_linear(f"{prefix}.attention.self.query_proj", attn.self.query_proj)
        self.key = AdapterLinear.from_linear(f"{prefix}.attention.self.key_proj", attn.self.key_proj)
        self.value = AdapterLinear.from_linear(f"{prefix}.attention.self.value_proj", attn.self.value_proj)
        self.attn_out = AdapterLinear.from_linear(f"{prefix}.attention.output.dense", attn.output.dense)
        self.attn_norm = _clone_norm(attn.output.LayerNorm)
        self.ffn_in = AdapterLinear.from_linear(f"{prefix}.intermediate.dense", layer.intermediate.dense)
        self.ffn_out = AdapterLinear.from_linear(f"{prefix}.output.dense", layer.output.dense)
        self.ffn_norm = _clone_norm(layer.output.LayerNorm)
        from transformers.activations import ACT2FN

        self.act = ACT2FN[geometry.hidden_act]
        # transformers' "gelu" is torch's exact (erf) GELU, the one the LoRA expand can apply
        self.exact_gelu = geometry.hidden_act == "gelu"

    def project_positions(self, rel_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Base (no-adapter) projections of the normalised position table."""
        return (
            F.linear(rel_table, self.query.weight, self.query.bias),
            F.linear(rel_table, self.key.weight, self.key.bias),
        )

    def forward(
        self,
        x: torch.Tensor,  # [B, L, H]
        key_bias: torch.Tensor,  # [B, L] additive mask, fp32
        window: torch.Tensor,  # [W, H] the normalised position rows this length reads
        pos_q: torch.Tensor,  # [W, H] position table through query_proj (base weights)
        pos_k: torch.Tensor,  # [W, H] position table through key_proj (base weights)
        rel_index: torch.Tensor,  # int32 [2L - 1], see _relative_index
        lora: Optional["LoraBatch"],
        backend: str,
        kv_len: Optional[torch.Tensor] = None,  # int32 [B]: set, the attention runs in kernels/disattn.py
    ) -> torch.Tensor:
        g = self.geometry
        batch, length, hidden = x.shape
        heads, dh = g.num_heads, g.head_size
        flat = x.reshape(batch * length, hidden)
        shrunk = {}  # their LoRA shrinks in one pass over x (LoraBatch.group_shrinks)
        if lora is not None:
            shrunk = lora.shrink_together((self.query.name, self.key.name, self.value.name), flat)
        q_flat = self.query(flat, lora, shrunk=shrunk.get(self.query.name))
        k_flat = self.key(flat, lora, shrunk=shrunk.get(self.key.name))
        v_flat = self.value(flat, lora, shrunk=shrunk.get(self.value.name))
        del shrunk  # the v buffer goes back to the allocator (a graph capture's pool) here

        scale_factor = 1 + int(g.c2p) + int(g.p2c)
        inv_scale = 1.0 / math.sqrt(dh * scale_factor)
        c2p = p2c = None
        if g.c2p:  # queries against the table through key_proj (and each row's key_proj LoRA)
            factors = None if lora is None else lora.position_factors(self.key.name, window)
            c2p = _position_scores(q_flat, pos_k, factors, batch, length, heads, backend)
        if g.p2c:  # keys against the table through query_proj (and each row's query_proj LoRA)
            factors = None if lora is None else lora.position_factors(self.query.name, window)
            p2c = _position_scores(k_flat, pos_q, factors, batch, length, heads, backend)
        if kv_len is not None:  # one kernel, no [B, h, L, L] bias; ctx already [B*L, H]
            ctx = kernels.disentangled_attention(
                q_flat, k_flat, v_flat, c2p, p2c, rel_index, key_bias, kv_len, inv_scale, batch, length, heads
            )
        else:
            ctx = _eager_attention(q_flat, k_flat, v_flat, c2p, p2c, rel_index, key_bias, inv_scale, heads, backend)

        # the residual adds and layer norms, and the activation, may ride in the LoRA expands
        attn = self.attn_out(ctx, lora, residual=flat, norm=(*self.attn_norm, g.layer_norm_eps))
        if self.exact_gelu:
            inter = self.ffn_in(attn, lora, gelu=True)
        else:
            inter = self.act(self.ffn_in(attn, lora))
        out = self.ffn_out(inter, lora, residual=attn, norm=(*self.ffn_norm, g.layer_norm_eps))
        return out.view(batch, length, hidden)


def _eager_attention(q, k, v, c2p, p2c, rel_index, key_bias, scale: float, heads: int, backend: str) -> torch.Tensor:
    """DeBERTa's attention without kernels/disattn.py: relpos.py's bias (or the key mask alone)
    in the serving dtype, then scaled_dot_product_attention. q, k, v [B*L, H]; returns [B*L, H]."""
    batch, length = key_bias.shape
    hidden = q.shape[1]

    def split(t: torch.Tensor) -> torch.Tensor:  # [B*L, H] -> [B, h, L, d] (a view)
        return t.view(batch, length, heads, hidden // heads).transpose(1, 2)

    if c2p is None and p2c is None:
        bias = key_bias.view(batch, 1, 1, length).to(q.dtype)
    else:
        bias = kernels.relpos_bias(c2p, p2c, rel_index, key_bias, scale, q.dtype, backend)
    ctx = F.scaled_dot_product_attention(split(q), split(k), split(v), attn_mask=bias, scale=scale)
    return ctx.transpose(1, 2).reshape(batch * length, hidden)


def _clone_norm(norm: nn.LayerNorm) -> nn.ParameterList:
    return nn.ParameterList(
        [
            nn.Parameter(norm.weight.detach().clone(), requires_grad=False),
            nn.Parameter(norm.bias.detach().clone(), requires_grad=False),
        ]
    )


class Encoder(nn.Module):
    """Inference-only DeBERTa-v3 encoder built from a transformers ``DebertaV2Model``.

    ``prefix`` is the module path of the backbone inside the GLiNER2 model (``encoder``),
    so ``AdapterLinear.name`` equals the PEFT key path without ``base_model.model.``.
    """

    def __init__(self, backbone, prefix: str = "encoder"):
        super().__init__()
        geometry = EncoderGeometry.from_config(backbone.config)
        self.geometry = geometry
        emb = backbone.embeddings
        self.word_embeddings = nn.Parameter(emb.word_embeddings.weight.detach().clone(), requires_grad=False)
        self.embed_norm = _clone_norm(emb.LayerNorm)
        self.layers = nn.ModuleList(
            EncoderLayer(f"{prefix}.encoder.layer.{i}", layer, geometry)
            for i, layer in enumerate(backbone.encoder.layer)
        )
        enc = backbone.encoder
        with torch.no_grad():
            rel = enc.rel_embeddings.weight[: 2 * geometry.position_buckets]
            rel_table = enc.LayerNorm(rel)
            pos_q, pos_k = zip(*(layer.project_positions(rel_table) for layer in self.layers))
        # Constant per checkpoint: normalised table and its base projections per layer.
        self.register_buffer("rel_table", rel_table.detach().clone(), persistent=False)
        self.register_buffer("pos_q", torch.stack(pos_q).detach().clone(), persistent=False)
        self.register_buffer("pos_k", torch.stack(pos_k).detach().clone(), persistent=False)
        # attention-bias backend ("triton" / "torch"); None: triton on CUDA, torch elsewhere
        self.backend: Optional[str] = None
        # the whole attention in kernels/disattn.py (the engine's fused_attention; triton backend)
        self.fused_attention = False
        # LoRA update written before the base GEMM when every row has an adapter (LoraBatch.writes_first)
        self.lora_write_first = True
        # DeBERTa's residual adds and GELU inside the LoRA expand when every row has an adapter
        # (the engine's fused_lora_epilogue; LoraBatch.fuses_epilogue)
        self.lora_fuse_epilogue = False
        # LoRA tiles over each row's real tokens only, where no real token reads a padded one
        # (the engine's lora_skip_padding; skips_lora_padding)
        self.lora_skip_padding = False
        # a layer's query, key and value LoRA shrinks in one pass over its input (LoraBatch.
        # shrink_together); off only for the A/B (perf/profile_core.py --ab group_shrinks)
        self.lora_group_shrinks = True
        # the projections the position table goes through (c2p: key_proj, p2c: query_proj)
        self.position_modules = [
            name
            for layer in self.layers
            for name, used in ((layer.key.name, geometry.c2p), (layer.query.name, geometry.p2c))
            if used
        ]

    def padding_unread(self, device: torch.device) -> bool:
        """Whether no real token reads a padded token's states: with the attention kernel, which
        loads keys and values only below each row's ``kv_len``; every other step is token-local.
        ``scaled_dot_product_attention`` multiplies a masked key's value by a weight of 0, which a
        non-finite value turns into NaN."""
        backend = self.backend or kernels.default_backend(device)
        supported = kernels.disentangled_attention_supported(self.geometry.head_size)
        return self.fused_attention and backend == "triton" and supported

    def skips_lora_padding(self, device: torch.device) -> bool:
        """Whether the LoRA kernels may leave each row's padding alone (``lora_skip_padding``):
        its tokens then hold whatever the base GEMMs and the skipped epilogues leave there."""
        return self.lora_skip_padding and self.padding_unread(device)

    def linears(self) -> dict[str, AdapterLinear]:
        return {m.name: m for m in self.modules() if isinstance(m, AdapterLinear)}

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [B, L] int
        attention_mask: torch.Tensor,  # [B, L] 0/1
        lora: Optional["LoraBatch"] = None,
    ) -> torch.Tensor:  # [B, L, H]
        g = self.geometry
        batch, length = input_ids.shape
        dtype = self.word_embeddings.dtype
        mask = attention_mask.to(dtype)
        x = F.embedding(input_ids, self.word_embeddings)
        x = F.layer_norm(x, (g.hidden_size,), *self.embed_norm, g.layer_norm_eps) * mask.unsqueeze(-1)

        lo, hi, rel_index = _relative_index(length, g.position_buckets, g.max_relative_positions, str(input_ids.device))
        window = self.rel_table[lo : hi + 1]
        key_bias = (1.0 - attention_mask.to(torch.float32)) * torch.finfo(dtype).min  # [B, L]
        backend = self.backend or kernels.default_backend(input_ids.device)
        kv_len = None  # 1 + each row's last real token: the fused attention's key range
        if self.padding_unread(input_ids.device):
            kv_len = kernels.key_lengths(attention_mask)
        if lora is not None:  # every layer's position factors at once
            lora.prepare_positions(self.position_modules, window)
        with _attention_backends(input_ids.device):
            for i, layer in enumerate(self.layers):
                pos_q = self.pos_q[i, lo : hi + 1]
                pos_k = self.pos_k[i, lo : hi + 1]
                x = layer(x, key_bias, window, pos_q, pos_k, rel_index, lora, backend, kv_len)
        return x


@torch.no_grad()
def check_fused_attention(geometry: EncoderGeometry, device: torch.device, dtype: torch.dtype, seed: int = 0) -> str:
    """kernels/disattn.py against the eager attention (relpos.py's bias, then
    scaled_dot_product_attention) on a few random rows of this geometry, on ``device`` and
    ``dtype``, real query positions only: the load-time check of ``fused_attention``. Returns ""
    when they agree within the kernels' tolerances for the dtype, else what went wrong."""
    heads, head_size = geometry.num_heads, geometry.head_size
    if not kernels.disentangled_attention_supported(head_size):
        return f"head size {head_size} is not a power of two from 16 to 128"
    gen = torch.Generator().manual_seed(seed)
    batch, length, width = 3, 70, 64
    lengths = torch.tensor([70, 1, 41])

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    hidden = heads * head_size
    q, k, v = (randn(batch * length, hidden) for _ in range(3))
    c2p = randn(heads, batch, length, width).transpose(0, 1) if geometry.c2p else None
    p2c = randn(heads, batch, length, width).transpose(0, 1) if geometry.p2c else None
    rel_index = torch.clamp(torch.arange(-(length - 1), length) // 2 + width // 2, 0, width - 1)
    rel_index = rel_index.to(device=device, dtype=torch.int32)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).to(device)
    key_bias = (1.0 - mask.float()) * torch.finfo(dtype).min
    scale = 1.0 / math.sqrt(head_size * (1 + int(geometry.c2p) + int(geometry.p2c)))
    try:
        got = kernels.disentangled_attention(
            q, k, v, c2p, p2c, rel_index, key_bias, kernels.key_lengths(mask), scale, batch, length, heads
        )
    except Exception as exc:
        return f"the attention kernel failed: {type(exc).__name__}: {exc}"
    want = _eager_attention(q, k, v, c2p, p2c, rel_index, key_bias, scale, heads, "triton")
    real = mask.reshape(-1)
    atol, rtol = kernels.TOLERANCES[dtype]
    if not torch.allclose(got[real].float(), want[real].float(), atol=atol, rtol=rtol):
        worst = (got[real].float() - want[real].float()).abs().max().item()
        return f"the attention kernel's output differs from the eager attention's by up to {worst:.3g}"
    return ""
