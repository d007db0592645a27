"""The physical limit of a benchmark: FLOPs per request, bytes per adapter, dense GEMM rate.

A throughput in req/s says little alone. Multiplied by the FLOPs one request needs it is an
achieved TFLOP/s, and divided by what this device's dense GEMMs reach it is a fraction of
the hardware (``bench_engine.py`` writes all three next to every throughput).

FLOPs (a multiply-add counts 2) of one request of T tokens (schema prompt + text) and N text
words, from the checkpoint's real shapes (``ModelShape``):

* encoder, per layer:
  - each ``nn.Linear`` (query, key, value, attention output, intermediate, output): 2·T·in·out;
  - attention scores QKᵀ and the weighted sum AV: 2·2·T²·H;
  - DeBERTa's relative positions, c2p and p2c: 2·2·T·W·H, where W is the number of position
    table rows a length-T sequence reads: 2·bucket(T-1)+1 with DeBERTa's log buckets (2T-1 up
    to T = 128 for 256 buckets, at most 2·position_buckets); stock transformers multiplies
    by all 2·position_buckets rows, ManyLoRA's encoder only by the rows read;
  - the position table through query_proj and key_proj (W rows each): shared by every row
    of a batch, so it counts 1/batch per request (``batch=``);
* heads, on GLiNER2's inference path (``score_queries``: the span MLPs run once per word,
  not per span), with S span tasks of M_s fields, ``instances`` predicted per task, Q = Σ
  instances·M_s queries and C classification labels:
  - ``count_pred``: S rows (each task's [P] embedding);
  - ``count_embed``: its GRU (input and hidden projections, 3H each) and ``projector`` on
    Σ instances·M_s rows;
  - ``span_rep`` (only for a request with span queries): ``project_start``/``project_end``
    on N rows; ``out_project.0`` (2H→4H) as its start and end halves, each on N rows;
    ``out_project.3`` (4H→H) folded into the Q queries (Q rows); the span scores themselves
    2·N·max_width·4H·Q;
  - ``classifier``: C rows.
  The typical request of the benchmark is one entity task with 5 labels and 1 instance
  (entity decoding reads instance 0 only); ``RequestShape.from_record`` reads a real
  request's counts from GLiNER2's record, ``instances`` stays an assumption (it is the
  model's prediction).
* LoRA: 2·rows·r·(in+out) for every adapted linear, on the rows of its base linear; none on
  ``out_project.*`` (GLiNER2 reads those weights directly in ``score_queries``, so neither
  PEFT's nor ManyLoRA's LoRA applies there).

Not counted (each under 1% on the base model): layer norms, softmax, activations, the
embedding lookup, GRU gate arithmetic, span masking and decoding.

Bytes per adapter: lora_A [r, in] + lora_B [out, r] for every adapted linear, in the serving
dtype (``adapter_bytes`` from a PEFT folder's safetensors header, ``slot_bytes`` from the
engine's store shapes at one rank).

GEMM rate: a few large ``torch.matmul`` runs in the serving dtype (bfloat16 on a GPU,
float32 on a CPU at a small size, under 2 s), the median run, in TFLOP/s.
"""

from __future__ import annotations

import json
import statistics
import struct
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Mapping, Optional, Sequence, Union

import torch

SPAN_MARKERS = ("[E]", "[C]", "[R]")
LABEL_MARKER = "[L]"
TABLE_PROJECTIONS = ("query_proj", "key_proj")  # with share_att_key they also project the position table
NO_LORA_HEADS = ("span_rep.span_rep_layer.out_project.",)  # read as weights by score_queries
DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I8": 1, "U8": 1}


def _safetensors_header(path: Path) -> dict:
    """The tensor table of a safetensors file (name -> dtype, shape, offsets), read without the data."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header


@dataclass(frozen=True)
class ModelShape:
    """What the FLOP count needs of a GLiNER2 checkpoint: encoder geometry and every linear's shape."""

    layers: int
    hidden: int
    heads: int
    position_buckets: int  # <= 0: no log buckets (the table has 2·max_relative_positions rows)
    max_relative_positions: int
    c2p: bool
    p2c: bool
    share_att_key: bool
    max_width: int
    linears: Mapping[str, tuple[int, int]]  # module path -> (in, out), encoder and heads
    gru: Optional[tuple[int, int]] = None  # count_embed's GRU (input, hidden)

    @classmethod
    def from_checkpoint(cls, checkpoint: Union[str, Path]) -> "ModelShape":
        """From a GLiNER2 checkpoint folder: its two configs and its safetensors header (no weights read)."""
        folder = Path(checkpoint)
        config = json.loads((folder / "config.json").read_text())
        encoder = json.loads((folder / "encoder_config" / "config.json").read_text())
        header = _safetensors_header(folder / "model.safetensors")
        linears, gru = {}, None
        for name, info in header.items():
            if name == "count_embed.gru.weight_ih_l0":
                gru = (info["shape"][1], info["shape"][0] // 3)
            elif name.endswith(".weight") and len(info["shape"]) == 2 and not _is_embedding(name):
                out_features, in_features = info["shape"]
                linears[name[: -len(".weight")]] = (in_features, out_features)
        return cls._build(config, encoder, linears, gru)

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> "ModelShape":
        """From a GLiNER2 instance (PEFT-wrapped or not): its configs and its ``nn.Linear`` modules."""
        linears = {}
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and ".lora_" not in name:
                linears[name.replace(".base_layer", "")] = (module.in_features, module.out_features)
        gru = getattr(getattr(model, "count_embed", None), "gru", None)
        gru_shape = None if gru is None else (gru.weight_ih_l0.shape[1], gru.weight_ih_l0.shape[0] // 3)
        return cls._build(model.config.to_dict(), model.encoder.config.to_dict(), linears, gru_shape)

    @classmethod
    def _build(cls, config: dict, encoder: dict, linears: dict, gru) -> "ModelShape":
        pos_att = encoder.get("pos_att_type") or []
        if isinstance(pos_att, str):
            pos_att = [p.strip() for p in pos_att.lower().split("|")]
        relative = encoder.get("relative_attention", False)
        max_rel = encoder.get("max_relative_positions", -1)
        if max_rel < 1:
            max_rel = encoder.get("max_position_embeddings", 512)
        max_width = config.get("max_width") or (config.get("span_head") or {}).get("max_width") or 8
        return cls(
            layers=encoder["num_hidden_layers"],
            hidden=encoder["hidden_size"],
            heads=encoder["num_attention_heads"],
            position_buckets=encoder.get("position_buckets", -1),
            max_relative_positions=max_rel,
            c2p=relative and "c2p" in pos_att,
            p2c=relative and "p2c" in pos_att,
            share_att_key=encoder.get("share_att_key", False),
            max_width=int(max_width),
            linears=dict(sorted(linears.items())),
            gru=gru,
        )

    def position_rows(self, tokens: int) -> int:
        """W: rows of the relative-position table that a sequence of ``tokens`` reads."""
        if not (self.c2p or self.p2c):
            return 0
        span = self.position_buckets if self.position_buckets > 0 else self.max_relative_positions
        if tokens <= 1:
            return 1
        return min(2 * _bucket(tokens - 1, self.position_buckets, self.max_relative_positions) + 1, 2 * span)


def _is_embedding(name: str) -> bool:
    return name.endswith("embeddings.weight") or name.endswith("pos_embedding.weight") or "LayerNorm" in name


@lru_cache(maxsize=None)
def _bucket(distance: int, buckets: int, max_position: int) -> int:
    """DeBERTa's log bucket of a relative distance (transformers' own function)."""
    if buckets <= 0:
        return min(distance, max_position)
    from transformers.models.deberta_v2.modeling_deberta_v2 import make_log_bucket_position

    return int(make_log_bucket_position(torch.tensor([distance]), buckets, max_position).item())


def model_shape(model) -> ModelShape:
    """A ModelShape from a ModelShape, a checkpoint folder or a GLiNER2 model."""
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, (str, Path)):
        return _shape_of_checkpoint(str(Path(model).resolve()))
    return ModelShape.from_model(model)


@lru_cache(maxsize=16)
def _shape_of_checkpoint(folder: str) -> ModelShape:
    return ModelShape.from_checkpoint(folder)


@dataclass(frozen=True)
class RequestShape:
    """The counts of one request that its FLOPs depend on."""

    tokens: int  # T: encoder tokens, schema prompt and text
    words: int  # N: text words (GLiNER2 keeps each word's first sub-token)
    span_fields: tuple[int, ...] = (5,)  # M per span task: entity labels, 2 per relation, structure fields
    instances: int = 1  # count_pred's predicted count per span task (the GRU steps)
    class_labels: tuple[int, ...] = ()  # labels per classification task

    @classmethod
    def from_record(cls, record, instances: int = 1) -> "RequestShape":
        """From GLiNER2's ``TransformedRecord`` of the request (what ``Engine.prepare`` builds)."""
        span_fields, class_labels = [], []
        for task_type, tokens in zip(record.task_types, record.schema_tokens_list):
            if task_type == "classifications":
                class_labels.append(sum(t == LABEL_MARKER for t in tokens))
            else:
                span_fields.append(sum(t in SPAN_MARKERS for t in tokens))
        return cls(
            tokens=len(record.input_ids),
            words=len(record.text_tokens),
            span_fields=tuple(span_fields),
            instances=instances,
            class_labels=tuple(class_labels),
        )


@dataclass
class Rows:
    """Rows each linear sees for one request (fractions where a batch shares the work)."""

    base: dict[str, float] = field(default_factory=dict)
    lora: dict[str, float] = field(default_factory=dict)  # rows its LoRA update runs on
    other: dict[str, float] = field(default_factory=dict)  # FLOPs that are no linear's


def request_rows(model, request: RequestShape, batch: int = 1) -> Rows:
    """Rows of every linear of ``model`` for ``request``, with non-linear FLOP terms; see the module doc."""
    shape = model_shape(model)
    T, N, H = request.tokens, request.words, shape.hidden
    W = shape.position_rows(T)
    S = len(request.span_fields)
    fields = sum(request.span_fields)
    instanced = request.instances * fields if S else 0
    rows = Rows()
    for name in shape.linears:
        if name.startswith("encoder."):
            table = W / batch if _projects_table(shape, name) else 0.0
            token_rows = 0.0 if name.rsplit(".", 1)[-1].startswith("pos_") else float(T)
            rows.base[name] = token_rows + table
        elif name.startswith("count_pred."):
            rows.base[name] = float(S)
        elif name.startswith("count_embed.projector."):
            rows.base[name] = float(instanced)
        elif name.startswith("span_rep.span_rep_layer.project_") or name == "span_rep.span_rep_layer.out_project.0":
            rows.base[name] = float(N) if instanced else 0.0  # span scoring runs only for requests with queries
        elif name == "span_rep.span_rep_layer.out_project.3":
            rows.base[name] = float(instanced)
        elif name.startswith("classifier."):
            rows.base[name] = float(sum(request.class_labels))
        else:
            raise ValueError(f"no row count for linear {name!r}: the FLOP count does not know this head")
        if not name.startswith(NO_LORA_HEADS):
            rows.lora[name] = rows.base[name]
    per_layer_attention = 2 * 2 * T * T * H
    per_layer_position = 2 * 2 * T * W * H if (shape.c2p and shape.p2c) else (2 * T * W * H if W else 0)
    rows.other["attention"] = float(shape.layers * per_layer_attention)
    rows.other["relative_positions"] = float(shape.layers * per_layer_position)
    if shape.gru is not None and instanced:
        gru_in, gru_hidden = shape.gru
        rows.other["count_gru"] = float(2 * instanced * 3 * gru_hidden * (gru_in + gru_hidden))
    out3 = shape.linears.get("span_rep.span_rep_layer.out_project.3")
    if out3 is not None and instanced:
        rows.other["span_scores"] = float(2 * N * shape.max_width * out3[0] * instanced)
    return rows


def _projects_table(shape: ModelShape, name: str) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    if not (shape.c2p or shape.p2c):
        return False
    if shape.share_att_key:
        return leaf in TABLE_PROJECTIONS
    return leaf in ("pos_key_proj", "pos_query_proj")


def flop_breakdown(
    model,
    tokens: Optional[int] = None,
    *,
    words: Optional[int] = None,
    span_fields: Sequence[int] = (5,),
    instances: int = 1,
    class_labels: Sequence[int] = (),
    lora_ranks: Optional[Mapping[str, int]] = None,
    batch: int = 1,
    request: Optional[RequestShape] = None,
) -> dict[str, float]:
    """FLOPs of one request by term: encoder_linears, attention, relative_positions, heads, lora.

    ``model``: a checkpoint folder, a GLiNER2 model or a ModelShape. The request is either
    ``request`` or ``tokens`` with the counts after it; ``words`` defaults to ``tokens`` (an
    upper bound: pass the real count where you have it).
    ``lora_ranks``: module path -> rank of the request's adapter (``adapter_ranks``).
    """
    shape = model_shape(model)
    if request is None:
        if tokens is None:
            raise ValueError("give tokens or request")
        request = RequestShape(
            tokens=tokens,
            words=tokens if words is None else words,
            span_fields=tuple(span_fields),
            instances=instances,
            class_labels=tuple(class_labels),
        )
    rows = request_rows(shape, request, batch)
    terms = {"encoder_linears": 0.0, "heads": 0.0, **rows.other, "lora": 0.0}
    for name, n in rows.base.items():
        i, o = shape.linears[name]
        terms["encoder_linears" if name.startswith("encoder.") else "heads"] += 2 * n * i * o
    for extra in ("count_gru", "span_scores"):
        terms["heads"] += terms.pop(extra, 0.0)
    for name, rank in (lora_ranks or {}).items():
        if name in rows.lora:
            i, o = shape.linears[name]
            terms["lora"] += 2 * rows.lora[name] * rank * (i + o)
    return terms


def flops_per_request(model, tokens: int, **kwargs) -> float:
    """Total FLOPs of one request of ``tokens`` tokens; the arguments of ``flop_breakdown``."""
    return sum(flop_breakdown(model, tokens, **kwargs).values())


# ---------------------------------------------------------------- adapters


@lru_cache(maxsize=4096)
def _adapter_tensors(folder: str) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    header = _safetensors_header(Path(folder) / "adapter_model.safetensors")
    return tuple((name, info["dtype"], tuple(info["shape"])) for name, info in sorted(header.items()))


def _module_of(key: str) -> Optional[tuple[str, str]]:
    """('module path', 'A' or 'B') of a PEFT LoRA tensor key, None for anything else."""
    for part, which in ((".lora_A.", "A"), (".lora_B.", "B")):
        if part in key:
            module = key.split(part)[0]
            return module.removeprefix("base_model.model."), which
    return None


def adapter_ranks(folder: Union[str, Path]) -> dict[str, int]:
    """Module path -> LoRA rank of a PEFT adapter folder, from its safetensors header."""
    ranks = {}
    for key, _, shape in _adapter_tensors(str(Path(folder).resolve())):
        found = _module_of(key)
        if found and found[1] == "A":
            ranks[found[0]] = shape[0]
    return ranks


def adapter_bytes(folder: Union[str, Path], dtype: Optional[torch.dtype] = None) -> int:
    """Bytes of an adapter's A and B matrices, in ``dtype`` (default: as stored)."""
    total = 0
    for key, stored, shape in _adapter_tensors(str(Path(folder).resolve())):
        if _module_of(key) is None:
            continue
        numel = 1
        for d in shape:
            numel *= d
        itemsize = DTYPE_BYTES[stored] if dtype is None else torch.empty(0, dtype=dtype).element_size()
        total += numel * itemsize
    return total


def slot_bytes(shapes: Mapping[str, tuple[int, int]], rank: int, dtype: torch.dtype) -> int:
    """Bytes of one adapter at ``rank`` on every linear of ``shapes`` (the engine store's (in, out) map)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return sum(rank * (i + o) for i, o in shapes.values()) * itemsize


# ---------------------------------------------------------------- GEMM rate


def measure_gemm_rate(
    device: Union[str, torch.device],
    dtype: Optional[torch.dtype] = None,
    size: Optional[int] = None,
    repeats: int = 10,
    max_seconds: float = 1.5,
) -> dict:
    """Dense ``torch.matmul`` of two [size, size] matrices, median of ``repeats`` runs, in TFLOP/s.

    Defaults: bfloat16 at 8192 on CUDA, float32 at 1024 on CPU (under 2 s on two cores).
    """
    device = torch.device(device)
    cuda = device.type == "cuda"
    dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
    size = size or (8192 if cuda else 1024)
    generator = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(size, size, generator=generator).to(device=device, dtype=dtype)
    b = torch.randn(size, size, generator=generator).to(device=device, dtype=dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)
    for _ in range(3 if cuda else 1):
        torch.matmul(a, b, out=out)
    if cuda:
        torch.cuda.synchronize(device)
    times = []
    budget = time.perf_counter() + max_seconds
    while len(times) < repeats and (len(times) < 2 or time.perf_counter() < budget):
        if cuda:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.matmul(a, b, out=out)
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
        else:
            t0 = time.perf_counter()
            torch.matmul(a, b, out=out)
            times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    return {
        "tflops": 2 * size**3 / seconds / 1e12,
        "gemm_size": size,
        "gemm_dtype": str(dtype),
        "repeats": len(times),
        "median_s": seconds,
    }
