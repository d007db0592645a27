"""The CPU post stage: a compact GPU answer -> GLiNER2's final result for one request.

The serving pipeline is split in two. The GPU stage computes GLiNER2's head outputs (per row
and task: the predicted instance count, span scores ``sigmoid(raw span logits)`` shaped
[count, fields, L, W] in the serving dtype, classification probabilities) and sends only a
:class:`CompactRow` per request: the span-score elements at or above the row's sparsification
threshold (:func:`sparsify_threshold`), the probabilities, the counts, and, for entity
attribute groups, the raw logits at the kept positions. :func:`compact_batch` builds them for
a whole batch with one device-to-host copy. :class:`PostDecoder` turns one row into exactly
what ``GLiNER2.batch_extract`` returns for the request (after its ``format_results``): the
same structure, the same scores, with our own decoding code. GLiNER2 2.1.0 (its span
architecture) is the reference; ``tests/engine/test_post.py`` checks the equality against it.

Why a threshold is enough (GLiNER2 2.1.0's span decoders, read one by one):

* text spans (entities, relation heads/tails, structure fields, entity spans carrying
  attributes) are candidates only where ``score >= threshold`` (a torch comparison in the
  scores' dtype, so the threshold is first rounded to that dtype), with threshold = the
  request's or a per-entity / per-field / per-relation one; validators, overlap policies and
  the "best span" of ``dtype="str"`` only ever choose among those candidates;
* choice fields of structures read one element per choice (width 0 at the choice's prefix
  word) and keep it when ``score >= threshold`` in Python floats (list dtype), or keep the
  best choice only if its score reaches the threshold (str dtype): every choice scoring the
  maximum is then a kept element, so the answer is the same without the others;
* attribute groups read raw logits of the attribute labels at the positions of kept entity
  spans only (:attr:`CompactRow.hit_logits`), and compare probabilities, not span scores;
* classifications read probabilities only (sent whole).

So no element below the smallest of those thresholds can change the answer, and none above
it is dropped: :func:`compact_batch` keeps every element ``>= dtype_floor(t_min)`` (the largest
value of the dtype not above ``t_min``), a superset of what any comparison can accept; the
decoder repeats every comparison exactly as GLiNER2 does.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections import OrderedDict
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from manylora import wire
from manylora.decode import device_tensor

__all__ = [
    "CompactRow",
    "PostDecoder",
    "compact_batch",
    "compact_dense_begin",
    "core_threshold",
    "dtype_floor",
    "format_result",
    "head_outputs",
    "needs_raw_logits",
    "normalize_overlap_policy",
    "resolve_overlaps",
    "skipped_tasks",
    "sparsify_threshold",
]

SKIPPED = -1  # CompactRow.counts value of a task GLiNER2 leaves out of the result entirely

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
_BITS = {
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float64: torch.int64,
}
_FIELD_MARKERS = ("[E]", "[C]", "[R]")
_DESCRIPTION = " [DESCRIPTION] "
_ENTITY_KEYS = frozenset({"text", "confidence", "start", "end"})


# ----------------------------------------------------------------------------- compact row
@dataclass
class CompactRow:
    """One request row's compact answer from the GPU stage.

    Task order is the record's (``record.task_types``); T tasks.

    * ``counts`` int32 [T]: predicted instance count of each span task that has span logits;
      0 for classification tasks and for span tasks without logits (count 0); ``SKIPPED`` (-1)
      for tasks GLiNER2 leaves out (no schema embeddings, or a classification without config).
    * ``cls_sizes`` int32 [T]: how many probabilities each classification task contributes to
      ``cls_probs`` (len(embs) - 1), 0 for the others.
    * ``cls_probs`` float32 [P]: the classification probabilities, tasks concatenated in order.
    * ``hits`` int32 [N, 5]: (task, instance, field, start, width) of every span-score element
      ``>= dtype_floor(t_min)``, ordered by task and then row-major within the task's
      [count, fields, L, W] tensor (``torch.nonzero`` order). ``start`` indexes the full L
      axis (classification-prefix words first, then the text's words).
    * ``scores`` float32 [N]: those elements (values of ``dtype``, exact in float32).
    * ``hit_logits`` float32 [M, F]: one line per hit of a task that needs raw logits
      (:func:`needs_raw_logits`: the "entities" task of a schema with attribute groups), in
      hit order: the raw logits of all fields of instance 0 at that hit's (start, width);
      F = the most fields of such a task in the row, shorter tasks padded with NaN.
      Shape [0, 0] when no task of the row needs them.
    * ``grid`` int32 [2]: (L, W) of the row's span tensors; (0, 0) when it has none.
    * ``dtype``: the serving dtype of the scores (comparisons and activations use it).
    """

    counts: np.ndarray
    cls_sizes: np.ndarray
    cls_probs: np.ndarray
    hits: np.ndarray
    scores: np.ndarray
    hit_logits: np.ndarray
    grid: np.ndarray
    dtype: torch.dtype = torch.float32

    def to_arrays(self) -> dict[str, np.ndarray]:
        """Plain arrays (Triton tensors): the dtype travels as an int8 code array of one value."""
        return {
            "counts": np.ascontiguousarray(self.counts, dtype=np.int32),
            "cls_sizes": np.ascontiguousarray(self.cls_sizes, dtype=np.int32),
            "cls_probs": np.ascontiguousarray(self.cls_probs, dtype=np.float32),
            "hits": np.ascontiguousarray(self.hits, dtype=np.int32).reshape(-1, 5),
            "scores": np.ascontiguousarray(self.scores, dtype=np.float32),
            "hit_logits": np.ascontiguousarray(self.hit_logits, dtype=np.float32),
            "grid": np.ascontiguousarray(self.grid, dtype=np.int32),
            "dtype": np.array([DTYPE_CODES[self.dtype]], dtype=np.int8),
        }

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> "CompactRow":
        hit_logits = np.asarray(arrays["hit_logits"], dtype=np.float32)
        if hit_logits.ndim != 2:
            hit_logits = hit_logits.reshape(0, 0)
        return cls(
            counts=np.asarray(arrays["counts"], dtype=np.int32).reshape(-1),
            cls_sizes=np.asarray(arrays["cls_sizes"], dtype=np.int32).reshape(-1),
            cls_probs=np.asarray(arrays["cls_probs"], dtype=np.float32).reshape(-1),
            hits=np.asarray(arrays["hits"], dtype=np.int32).reshape(-1, 5),
            scores=np.asarray(arrays["scores"], dtype=np.float32).reshape(-1),
            hit_logits=hit_logits,
            grid=np.asarray(arrays["grid"], dtype=np.int32).reshape(-1),
            dtype=CODE_DTYPES[int(np.asarray(arrays["dtype"]).reshape(-1)[0])],
        )


def pack_compact_rows(rows: Sequence[Optional[CompactRow]]) -> bytes:
    """The rows (None for a failed one) in one ``wire.pack_arrays`` buffer, as ``wire.unpack_rows``
    reads it back into ``to_arrays()`` dicts: ``_present`` marks the rows that are there; per
    field, those rows' arrays flattened and concatenated (``<field>``) and each one's shape
    (``<field>.shape``). One concatenation per field, no array or dict per row.

    Measured (``perf/bench_host_steps.py``, its "pack" step: 512 rows in requests of 16, this
    repository's 2-core CPU host): the GPU stage's responses 9.8 -> 4.7 us per row against
    packing each row's ``to_arrays()``. The answer thread competes with the GPU thread for the
    interpreter lock."""
    present = [r for r in rows if r is not None]
    n = len(present)
    packed: dict[str, np.ndarray] = {"_present": np.array([r is not None for r in rows], dtype=np.bool_)}
    if not n:
        return wire.pack_arrays(packed)

    def lengths(arrays: list) -> np.ndarray:
        return np.fromiter(map(len, arrays), dtype=np.int64, count=n)

    # each field of every row is 1-D (hits [N, 5]): one concatenation each, no per-row reshape
    for name, dtype in (("counts", np.int32), ("cls_sizes", np.int32), ("cls_probs", np.float32)):
        arrays = [getattr(r, name) for r in present]
        packed[f"{name}.shape"] = lengths(arrays).reshape(n, 1)
        packed[name] = np.concatenate(arrays).astype(dtype, copy=False)
    hits = [r.hits for r in present]
    packed["hits.shape"] = np.stack([lengths(hits), np.full(n, 5, dtype=np.int64)], axis=1)
    packed["hits"] = np.concatenate(hits).astype(np.int32, copy=False).reshape(-1)
    scores = [r.scores for r in present]
    packed["scores.shape"] = lengths(scores).reshape(n, 1)
    packed["scores"] = np.concatenate(scores).astype(np.float32, copy=False)
    logits = [r.hit_logits for r in present]  # [M, F] or [0, 0]
    packed["hit_logits.shape"] = np.array([a.shape for a in logits], dtype=np.int64).reshape(n, 2)
    packed["hit_logits"] = np.concatenate([a.reshape(-1) for a in logits]).astype(np.float32, copy=False)
    grids = [r.grid for r in present]
    packed["grid.shape"] = lengths(grids).reshape(n, 1)
    packed["grid"] = np.concatenate(grids).astype(np.int32, copy=False)
    packed["dtype.shape"] = np.ones((n, 1), dtype=np.int64)
    packed["dtype"] = np.fromiter((DTYPE_CODES[r.dtype] for r in present), dtype=np.int8, count=n)
    return wire.pack_arrays(packed)


# ----------------------------------------------------------------------------- thresholds
def sparsify_threshold(threshold: float, metadata: dict) -> float:
    """The smallest threshold any decoding of the row compares span scores with.

    The request threshold and every per-entity, per-field and per-relation threshold of the
    metadata (see the module docstring for why nothing else reads span scores). NaN
    thresholds accept nothing and are ignored; inf when nothing is left.
    """
    candidates = [threshold]
    for key in ("entity_metadata", "field_metadata", "relation_metadata"):
        for entry in (metadata.get(key) or {}).values():
            if isinstance(entry, dict) and entry.get("threshold") is not None:
                candidates.append(entry["threshold"])
    values = [float(t) for t in candidates if not math.isnan(float(t))]
    return min(values) if values else math.inf


def core_threshold(threshold: float, metadata: dict) -> float:
    """The row's T_MIN for the GPU stage: :func:`sparsify_threshold` clamped into [0, 1].

    GLiNER2 takes any threshold (above 1 finds nothing, below 0 acts as 0). Span scores are
    sigmoids, in [0, 1]: keeping every element ``>= dtype_floor(0)`` keeps all of them, and
    ``>= dtype_floor(1)`` a superset of what a threshold above 1 accepts (none). The decoder
    then compares with the real thresholds, so the answer is GLiNER2's either way.
    """
    return min(max(sparsify_threshold(threshold, metadata), 0.0), 1.0)


@functools.lru_cache(maxsize=4096)  # a few thresholds per server; measured ~8 us a call per row
def dtype_floor(value: float, dtype: torch.dtype) -> float:
    """A value of ``dtype`` not above ``value``: the largest one (or -smallest-normal below 0)."""
    rounded = torch.tensor(value, dtype=torch.float64).to(dtype)
    if math.isnan(value) or float(rounded) <= value:
        return float(rounded)
    if float(rounded) == 0.0:  # a negative value that rounds to zero
        return -float(torch.finfo(dtype).tiny)
    bits = rounded.reshape(1).view(_BITS[dtype])
    bits = bits - 1 if float(rounded) > 0 else bits + 1  # one step towards -inf
    return float(bits.view(dtype)[0])


# ----------------------------------------------------------------------------- GPU stage
def needs_raw_logits(record, metadata: dict) -> list[bool]:
    """Per task of the record: does its decoding read raw logits (entity attribute groups)?"""
    if not metadata.get("entity_attribute_groups"):
        return [False] * len(record.task_types)
    return [
        task_type != "classifications" and len(tokens) >= 4 and _task_name(tokens) == "entities"
        for tokens, task_type in zip(record.schema_tokens_list, record.task_types)
    ]


def skipped_tasks(task_types: Sequence[Sequence[str]], all_schema_embs) -> list[list[bool]]:
    """Per row and task: GLiNER2 leaves the task out (no schema embeddings for it)."""
    return [
        [t >= len(all_schema_embs[row]) or not all_schema_embs[row][t] for t in range(len(types))]
        for row, types in enumerate(task_types)
    ]


def head_outputs(model, batch, all_token_embs, all_schema_embs):
    """GLiNER2's head outputs for a batch: (raw_logits, pred_counts, cls_probs, skipped).

    Calls GLiNER2's own scoring functions (no decoding): ``_compute_direct_span_logits_batched``
    and ``_compute_classification_probabilities`` per classification task.
    """
    raw_logits, pred_counts = model._compute_direct_span_logits_batched(batch, all_token_embs, all_schema_embs)
    skipped = skipped_tasks(batch.task_types, all_schema_embs)
    cls_probs: list[list[Optional[torch.Tensor]]] = []
    for row, types in enumerate(batch.task_types):
        probs_row: list[Optional[torch.Tensor]] = [None] * len(types)
        for t, task_type in enumerate(types):
            tokens = batch.schema_tokens_list[row][t]
            if task_type != "classifications" or len(tokens) < 4 or skipped[row][t]:
                continue
            computed = model._compute_classification_probabilities(
                batch.original_schemas[row], torch.stack(all_schema_embs[row][t]), tokens
            )
            if computed is not None:
                probs_row[t] = computed[2]
        cls_probs.append(probs_row)
    return raw_logits, pred_counts, cls_probs, skipped


def _at(values, index, default=None):
    return values[index] if values is not None and index < len(values) else default


def compact_batch(
    raw_logits: Sequence[Sequence[Optional[torch.Tensor]]],
    pred_counts: Sequence[Sequence[int]],
    cls_probs: Sequence[Sequence[Optional[torch.Tensor]]],
    t_min_per_row: Sequence[float],
    logit_tasks: Optional[Sequence[Sequence[bool]]] = None,
    skipped: Optional[Sequence[Sequence[bool]]] = None,
) -> list[CompactRow]:
    """Every row's :class:`CompactRow`, with one device-to-host copy for the whole batch.

    ``raw_logits[row][task]``: GLiNER2's raw span logits [count, fields, L, W] or None (as
    ``_compute_direct_span_logits_batched`` returns them); ``pred_counts[row][task]``: its
    predicted counts; ``cls_probs[row][task]``: a classification's probabilities or None;
    ``t_min_per_row``: :func:`sparsify_threshold` of each row; ``logit_tasks[row][task]``:
    :func:`needs_raw_logits`; ``skipped[row][task]``: :func:`skipped_tasks`.

    Span scores are ``torch.sigmoid(logits)`` in the logits' dtype, as GLiNER2 computes them.
    One mask pass over the concatenated scores (each row against its own threshold, compared
    in the scores' dtype), one ``nonzero``, one ``.cpu()`` of a float64 pack (hit positions,
    hit scores, probabilities, attribute logits); the rest is numpy on the host. Works on any
    device (CPU too). Attribute tasks' scores go first in the concatenation, so their hits are
    the first hits: their raw-logit lines are gathered for the first min(N, their element count)
    hits, a bound known without a second synchronisation, and the extra lines are dropped here.
    """
    n_rows = len(t_min_per_row)
    num_tasks = [
        max(len(_at(raw_logits, r, [])), len(_at(pred_counts, r, [])), len(_at(cls_probs, r, [])))
        for r in range(n_rows)
    ]
    counts = [np.zeros(num_tasks[r], dtype=np.int32) for r in range(n_rows)]
    cls_sizes = [np.zeros(num_tasks[r], dtype=np.int32) for r in range(n_rows)]
    grids = [np.zeros(2, dtype=np.int32) for _ in range(n_rows)]
    segments = []  # (row, task, tensor, shape, needs_logits, logits)
    cls_parts = []  # (row, task, tensor)
    device, dtypes = None, []
    for r in range(n_rows):
        for t in range(num_tasks[r]):
            if _at(_at(skipped, r), t, False):
                counts[r][t] = SKIPPED
                continue
            probs = _at(_at(cls_probs, r), t)
            if probs is not None:
                cls_sizes[r][t] = probs.numel()
                cls_parts.append((r, t, probs.reshape(-1)))
                device = probs.device if device is None else device
                dtypes.append(probs.dtype)
                continue
            count = int(_at(_at(pred_counts, r), t, 0) or 0)
            logits = _at(_at(raw_logits, r), t)
            if count <= 0 or logits is None:
                continue
            counts[r][t] = count
            grids[r][:] = (logits.shape[-2], logits.shape[-1])
            device = logits.device if device is None else device
            dtypes.append(logits.dtype)
            need = bool(_at(_at(logit_tasks, r), t, False))
            segments.append((r, t, torch.sigmoid(logits), tuple(logits.shape), need, logits if need else None))
    row_dtype = dtypes[0] if dtypes else torch.float32
    if not segments and not cls_parts:
        return [_empty_row(counts[r], cls_sizes[r], grids[r], row_dtype) for r in range(n_rows)]

    # attribute-task segments first: their hits are then a prefix of the sorted hit positions
    segments.sort(key=lambda seg: not seg[4])
    sizes = [seg[2].numel() for seg in segments]
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    total = int(starts[-1])
    pack = []
    n_hits = 0
    attr_rows, fmax = 0, 0
    if segments:
        same = all(seg[2].dtype == segments[0][2].dtype for seg in segments)
        flat_dtype = segments[0][2].dtype if same else torch.float32
        flat = torch.cat([seg[2].reshape(-1).to(flat_dtype) for seg in segments])
        floors = [dtype_floor(float(t_min_per_row[seg[0]]), seg[2].dtype) for seg in segments]
        bounds = torch.tensor(floors, dtype=torch.float64).to(flat_dtype).to(device)
        per_element = torch.repeat_interleave(
            bounds, torch.tensor(sizes, device=device), output_size=total
        )  # exact: the floors are values of each segment's dtype, which flat_dtype holds exactly
        hit_index = torch.nonzero(flat >= per_element).reshape(-1)
        n_hits = hit_index.numel()
        pack += [hit_index.to(torch.float64), flat[hit_index].to(torch.float64)]
        attr_segments = [seg for seg in segments if seg[4]]
        if attr_segments and n_hits:
            attr_total = int(sum(seg[2].numel() for seg in attr_segments))
            attr_rows = min(n_hits, attr_total)  # every attribute hit is among the first attr_rows hits
            fmax = max(seg[3][1] for seg in attr_segments)
            tables, table_base, base = [], [], 0
            for seg in attr_segments:
                _, fields, length, width = seg[3]
                table = seg[5][0].reshape(fields, length * width).transpose(0, 1)  # [L*W, F]
                if fields < fmax:
                    pad = torch.full((length * width, fmax - fields), float("nan"), dtype=table.dtype, device=device)
                    table = torch.cat([table, pad], dim=1)
                tables.append(table.to(torch.float64))
                table_base.append(base)
                base += length * width
            head = hit_index[:attr_rows]
            seg_starts = torch.tensor(starts[: len(attr_segments)], device=device)
            which = torch.searchsorted(seg_starts, head, right=True) - 1
            plane = torch.tensor([seg[3][2] * seg[3][3] for seg in attr_segments], device=device)
            local = (head - seg_starts[which]) % plane[which]
            rows_in_table = torch.tensor(table_base, device=device)[which] + local
            rows_in_table = torch.where(head < attr_total, rows_in_table, torch.zeros_like(rows_in_table))
            pack.append(torch.cat(tables)[rows_in_table].reshape(-1))
    if cls_parts:
        pack.append(torch.cat([part[2].to(torch.float64) for part in cls_parts]))
    host = torch.cat(pack).cpu().numpy()

    # ---- host: split the pack back into rows
    hit_index = host[:n_hits].astype(np.int64)
    hit_scores = host[n_hits : 2 * n_hits].astype(np.float32)
    cursor = 2 * n_hits
    attr_logits = host[cursor : cursor + attr_rows * fmax].reshape(attr_rows, fmax).astype(np.float32)
    cursor += attr_rows * fmax
    cls_flat = host[cursor:].astype(np.float32)

    per_row: list[list[tuple]] = [[] for _ in range(n_rows)]  # (task, hits, scores, logits or None)
    seg_bounds = np.searchsorted(hit_index, starts)
    for k, (r, t, _, shape, need, _) in enumerate(segments):
        lo, hi = int(seg_bounds[k]), int(seg_bounds[k + 1])
        local = hit_index[lo:hi] - starts[k]
        coords = np.unravel_index(local, shape)
        hits = np.empty((hi - lo, 5), dtype=np.int32)
        hits[:, 0] = t
        for axis in range(4):
            hits[:, axis + 1] = coords[axis]
        logits = attr_logits[lo:hi, : shape[1]] if need else None
        per_row[r].append((t, hits, hit_scores[lo:hi], logits, shape[1] if need else 0))
    cls_per_row: list[list[tuple]] = [[] for _ in range(n_rows)]
    offset = 0
    for r, t, part in cls_parts:
        n = part.numel()
        cls_per_row[r].append((t, cls_flat[offset : offset + n]))
        offset += n

    rows = []
    for r in range(n_rows):
        parts = sorted(per_row[r], key=lambda p: p[0])
        hits = np.concatenate([p[1] for p in parts]) if parts else np.zeros((0, 5), dtype=np.int32)
        scores = np.concatenate([p[2] for p in parts]) if parts else np.zeros(0, dtype=np.float32)
        width = max((p[4] for p in parts), default=0)
        logit_parts = [p[3] for p in parts if p[3] is not None]
        if logit_parts:
            hit_logits = np.full((sum(len(p) for p in logit_parts), width), np.nan, dtype=np.float32)
            line = 0
            for p in logit_parts:
                hit_logits[line : line + len(p), : p.shape[1]] = p
                line += len(p)
        else:
            hit_logits = np.zeros((0, 0), dtype=np.float32)
        cls_row = [p[1] for p in sorted(cls_per_row[r], key=lambda p: p[0])]
        rows.append(
            CompactRow(
                counts=counts[r],
                cls_sizes=cls_sizes[r],
                cls_probs=np.concatenate(cls_row) if cls_row else np.zeros(0, dtype=np.float32),
                hits=hits,
                scores=scores,
                hit_logits=hit_logits,
                grid=grids[r],
                dtype=row_dtype,
            )
        )
    return rows


def compact_dense_begin(
    logits: Optional[torch.Tensor],
    plan: dict,
    cls_probs: Sequence[Sequence[Optional[torch.Tensor]]],
    t_min_per_row: Sequence[float],
    skipped: Sequence[Sequence[bool]],
    num_tasks: Sequence[int],
) -> Callable[[], list[CompactRow]]:
    """:func:`compact_batch`'s rows (equal, field for field) from ``HeadLoras.span_logits_dense``'s
    padded logits, with a fixed number of tensor operations per batch instead of a few per row:
    one sigmoid, one mask (each row against its own threshold, only where the row has queries
    and words), one ``nonzero``, one ``.cpu()``. For rows whose tasks need no raw logits
    (attribute groups take :func:`compact_batch`).

    In two parts: this call queues the GPU work that needs no answer from the GPU (sigmoid,
    each row's mask) and returns ``finish() -> rows``, which waits for it (the ``nonzero`` and
    the one device-to-host copy) and builds the rows on the host. The engine queues the next
    chunk's forward in between and runs ``finish`` on a side stream, so the GPU has work while
    the host splits this chunk's answer (``Engine._core_begin``)."""
    n_rows = len(t_min_per_row)
    pred_counts = plan["pred_counts"]
    # every row's arrays are views of one array each (no allocation per row)
    counts, cls_sizes, grids = _row_views(num_tasks), _row_views(num_tasks), _row_views([2] * n_rows)
    cls_total = [0] * n_rows  # probabilities per row, for splitting cls_probs
    cls_parts = []
    cls_dtype = None  # the rows' dtype when no span logits exist: the first probabilities'
    for r in range(n_rows):
        for t in range(num_tasks[r]):
            if skipped[r][t]:
                counts[r][t] = SKIPPED
                continue
            probs = _at(cls_probs[r], t)
            if probs is not None:
                cls_sizes[r][t] = probs.numel()
                cls_total[r] += probs.numel()
                cls_parts.append(probs.reshape(-1).to(torch.float64))
                cls_dtype = probs.dtype if cls_dtype is None else cls_dtype
    graphed = plan.get("graphed")  # (scores, mask) from a CUDA graph of the heads (lora.head_graphs)
    spans = logits if graphed is None else graphed[0]
    dtype = spans.dtype if spans is not None else cls_dtype
    active = plan["rows"]
    gated = plan.get("counts") if spans is not None else None  # entity-only: counts still on the GPU
    if spans is not None:
        width = spans.shape[-1]
        for row, words, tasks in active:
            grids[row][:] = (words, width)
            for task, _, _, _ in tasks if gated is None else ():
                counts[row][task] = pred_counts[row][task]
    if graphed is not None:
        scores, mask = graphed
    elif logits is not None:
        device = logits.device
        scores = torch.sigmoid(logits)
        # host lists -> device without a stream sync each (lora.batch.device_tensor)
        queries = device_tensor([sum(i * f for _, _, i, f in tasks) for _, _, tasks in active], device)
        lengths = device_tensor([words for _, words, _ in active], device)
        floors = device_tensor(
            [dtype_floor(float(t_min_per_row[row]), scores.dtype) for row, _, _ in active], device, torch.float64
        ).to(scores.dtype)  # exact: each floor is a value of scores.dtype
        mask = hit_mask(scores, floors, queries, lengths, plan["query_gate"] if gated is not None else None)
    else:
        scores = mask = None

    def finish() -> list[CompactRow]:
        rows = (scores, mask, cls_parts, active, counts, cls_sizes, cls_total, grids, dtype)
        return _compact_dense_rows(*rows, gated, cls_dtype)

    return finish


def hit_mask(
    scores: torch.Tensor,
    floors: torch.Tensor,
    queries: torch.Tensor,
    lengths: torch.Tensor,
    gate: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Which of the padded ``scores`` [A, Q, L, W] are hits: at or above the row's floor (in
    ``scores``' dtype), within its ``queries`` and ``lengths`` (words), and, with ``gate`` [A, Q],
    of a task whose count is above 0 (GLiNER2 scores none of a task counted 0)."""
    q_axis = torch.arange(scores.shape[1], device=scores.device).view(1, -1, 1, 1)
    l_axis = torch.arange(scores.shape[2], device=scores.device).view(1, 1, -1, 1)
    mask = (
        (scores >= floors.view(-1, 1, 1, 1))
        & (q_axis < queries.view(-1, 1, 1, 1))
        & (l_axis < lengths.view(-1, 1, 1, 1))
    )
    if gate is not None:
        mask &= gate.view(*gate.shape, 1, 1)
    return mask


def _row_views(sizes: Sequence[int]) -> list[np.ndarray]:
    """Zeroed int32 arrays of these sizes, as views of one array."""
    flat = np.zeros(sum(sizes), dtype=np.int32)
    bounds = list(accumulate(sizes, initial=0))
    return [flat[bounds[i] : bounds[i + 1]] for i in range(len(sizes))]


def _compact_dense_rows(
    scores, mask, cls_parts, active, counts, cls_sizes, cls_total, grids, dtype, gated=None, cls_dtype=None
) -> list[CompactRow]:
    """The host part of :func:`compact_dense_begin`: hits, one copy, the rows. ``gated``: the
    (count tensor, (row, task) of each count) of an entity-only chunk, whose counts come to
    the host in the same copy: each active task's count, and a grid of (0, 0) for a row with
    no task above 0 (GLiNER2 scores none of its spans); when no task of the chunk is above 0,
    GLiNER2 has no span logits, and the rows take ``cls_dtype`` as the other paths do.

    The hits of all rows are built with one table lookup (each distinct task layout's
    (task, instance, field) table once, rows pointing into it), then split into views per
    row: no array is built per row. Measured (perf/bench_host_steps.py, 1,024 rows, a 2-core
    CPU host, where the hits' tensor work runs on the CPU too): 46.3 -> 33.5 us per row."""
    n_rows = len(counts)
    pack, n_hits = [], 0
    if mask is not None:
        index = mask.nonzero()  # [N, 4] (active row, query, start, width), row-major
        n_hits = index.shape[0]
        pack += [index.to(torch.float64).reshape(-1), scores[mask].to(torch.float64)]
    pack += cls_parts
    n_counts = 0
    if gated is not None:
        n_counts = len(gated[1])
        pack.append(gated[0].to(torch.float64))
    host = torch.cat(pack).cpu().numpy() if pack else np.zeros(0)
    index = host[: 4 * n_hits].reshape(n_hits, 4).astype(np.int64)
    hit_scores = host[4 * n_hits : 5 * n_hits].astype(np.float32)
    cls_flat = host[5 * n_hits : host.size - n_counts].astype(np.float32)
    if gated is not None:
        count_of = dict(zip(gated[1], host[host.size - n_counts :].astype(np.int64).tolist()))
        for row, _, tasks in active:
            for task, _, _, _ in tasks:
                counts[row][task] = count_of[row, task]
            if not any(count_of[row, task] > 0 for task, _, _, _ in tasks):
                grids[row][:] = 0
        if not any(count > 0 for count in count_of.values()):
            dtype = cls_dtype

    hits_per_row: dict[int, np.ndarray] = {}
    scores_per_row: dict[int, np.ndarray] = {}
    if n_hits:
        layouts: dict[tuple, int] = {}  # a row's task layout -> its table's first line in `tables`
        tables: list[tuple] = []
        first_line = np.empty(len(active), dtype=np.int64)
        for a, (_, _, tasks) in enumerate(active):
            key = tuple(tasks)
            if key not in layouts:
                layouts[key] = len(tables)
                tables.extend(
                    (t, i, f) for t, _, instances, fields in tasks for i in range(instances) for f in range(fields)
                )
            first_line[a] = layouts[key]
        table = np.asarray(tables, dtype=np.int32).reshape(-1, 3)
        hits = np.empty((n_hits, 5), dtype=np.int32)
        hits[:, :3] = table[first_line[index[:, 0]] + index[:, 1]]
        hits[:, 3:] = index[:, 2:]
        bounds = np.searchsorted(index[:, 0], np.arange(len(active) + 1)).tolist()
        for a, (row, _, _) in enumerate(active):
            lo, hi = bounds[a], bounds[a + 1]
            hits_per_row[row], scores_per_row[row] = hits[lo:hi], hit_scores[lo:hi]
    rows, offset = [], 0
    empty_hits, empty_scores = np.zeros((0, 5), dtype=np.int32), np.zeros(0, dtype=np.float32)
    no_logits = np.zeros((0, 0), dtype=np.float32)
    row_dtype = dtype if dtype is not None else torch.float32
    for r in range(n_rows):
        size = cls_total[r]
        rows.append(
            CompactRow(
                counts=counts[r],
                cls_sizes=cls_sizes[r],
                cls_probs=cls_flat[offset : offset + size],
                hits=hits_per_row.get(r, empty_hits),
                scores=scores_per_row.get(r, empty_scores),
                hit_logits=no_logits,
                grid=grids[r],
                dtype=row_dtype,
            )
        )
        offset += size
    return rows


def _empty_row(counts, cls_sizes, grid, dtype) -> CompactRow:
    return CompactRow(
        counts=counts,
        cls_sizes=cls_sizes,
        cls_probs=np.zeros(0, dtype=np.float32),
        hits=np.zeros((0, 5), dtype=np.int32),
        scores=np.zeros(0, dtype=np.float32),
        hit_logits=np.zeros((0, 0), dtype=np.float32),
        grid=grid,
        dtype=dtype,
    )


# ----------------------------------------------------------------------------- overlap policies
_POLICY_NAMES = {
    "allow": "allow",
    "all": "allow",
    "none": "allow",
    "nested": "nested",
    "allow_nested": "nested",
    "flat": "disallow",
    "disallow": "disallow",
    "no_overlap": "disallow",
    "non_overlapping": "disallow",
    "longest": "longest",
    "keep_longest": "longest",
}


def normalize_overlap_policy(policy: Optional[str], default: Optional[str] = None) -> str:
    """GLiNER2's canonical overlap-policy name (allow, nested, disallow, longest)."""
    chosen = policy if policy is not None else default
    if chosen is None:
        raise ValueError("overlap_policy=None needs a default")
    if not isinstance(chosen, str):
        raise TypeError("overlap_policy must be a string or None")
    key = chosen.strip().lower().replace("-", "_")
    if key not in _POLICY_NAMES:
        raise ValueError(f"unknown overlap_policy {chosen!r}; expected allow, nested, flat/disallow or longest")
    return _POLICY_NAMES[key]


def resolve_overlaps(spans: Sequence[tuple], policy: str) -> list[tuple]:
    """Spans (text, score, char_start, char_end) kept by an explicit overlap policy, best first.

    Same decisions as GLiNER2's shared resolver: spans are ranked by (-score, start, end,
    position); spans with the same boundaries collapse to the best ranked; ``allow`` keeps the
    rest, ``nested`` drops spans crossing a kept one, ``longest`` drops spans strictly inside
    another, ``disallow`` keeps the non-overlapping set of largest total score (ties: more
    spans, then the better ranked selection).
    """
    policy = normalize_overlap_policy(policy)
    if not spans:
        return []
    order = sorted(range(len(spans)), key=lambda i: (-float(spans[i][1]), int(spans[i][2]), int(spans[i][3]), i))
    rank = {i: (-float(spans[i][1]), int(spans[i][2]), int(spans[i][3]), i) for i in order}
    unique, boundaries = [], set()
    for i in order:
        key = (int(spans[i][2]), int(spans[i][3]))
        if key not in boundaries:
            boundaries.add(key)
            unique.append(i)
    if policy == "allow":
        return [spans[i] for i in unique]
    if policy == "nested":
        kept: list[int] = []
        for i in unique:
            a, b = int(spans[i][2]), int(spans[i][3])
            if all(not _crosses(a, b, int(spans[j][2]), int(spans[j][3])) for j in kept):
                kept.append(i)
        return [spans[i] for i in kept]
    if policy == "longest":
        result = []
        for i in unique:
            a, b = int(spans[i][2]), int(spans[i][3])
            inside = any(
                int(spans[j][2]) <= a and b <= int(spans[j][3]) and (int(spans[j][2]) < a or b < int(spans[j][3]))
                for j in unique
            )
            if not inside:
                result.append(spans[i])
        return result
    # disallow: weighted interval scheduling over the spans sorted by end
    by_end = sorted(unique, key=lambda i: (int(spans[i][3]), int(spans[i][2]), -float(spans[i][1]), i))
    ends = [int(spans[i][3]) for i in by_end]
    best: list[tuple[float, tuple[int, ...]]] = [(0.0, ())]

    def ranked(selection: tuple[int, ...]) -> tuple:
        return tuple(sorted(rank[by_end[k]] for k in selection))

    for k, i in enumerate(by_end):
        before = bisect.bisect_right(ends, int(spans[i][2]), 0, k)
        take = (best[before][0] + float(spans[i][1]), best[before][1] + (k,))
        skip = best[k]
        if take[0] != skip[0]:
            best.append(take if take[0] > skip[0] else skip)
        elif len(take[1]) != len(skip[1]):
            best.append(take if len(take[1]) > len(skip[1]) else skip)
        else:
            best.append(take if ranked(take[1]) < ranked(skip[1]) else skip)
    chosen = sorted((by_end[k] for k in best[-1][1]), key=lambda i: rank[i])
    return [spans[i] for i in chosen]


def _crosses(a: int, b: int, c: int, d: int) -> bool:
    """[a, b) and [c, d) overlap without one containing the other."""
    return a < d and c < b and not ((a <= c and d <= b) or (c <= a and b <= d))


def _greedy_first(spans: list[tuple]) -> list[tuple]:
    """The first span the default (confidence-first greedy) decoder keeps: the first best."""
    return [max(spans, key=lambda s: s[1])] if spans else []


# ----------------------------------------------------------------------------- formatting
def _format_classification(value: Any, include_confidence: bool) -> Any:
    if not isinstance(value, (list, tuple)) or not value:
        return value
    if isinstance(value[0], (list, tuple)):
        if include_confidence:
            return [{"label": pair[0], "confidence": pair[1]} for pair in value]
        return [pair[0] for pair in value]
    score = value[1] if len(value) == 2 else None
    if (
        len(value) == 2
        and isinstance(value[0], str)
        and isinstance(score, (int, float))
        and not isinstance(score, bool)
    ):
        return {"label": value[0], "confidence": score} if include_confidence else value[0]
    return value


def _dedupe(values: list, include_confidence: bool) -> list:
    out, seen = [], set()
    for item in values:
        if isinstance(item, tuple):
            text, conf, start, end = item
            key = (text.lower(), start, end) if text else None
            if key is not None and key not in seen:
                seen.add(key)
                out.append({"text": text, "confidence": conf} if include_confidence else text)
        elif isinstance(item, dict):
            text = item.get("text", "")
            key = (
                (text.lower(), item["start"], item["end"])
                if "start" in item and "end" in item
                else (text.lower(), None, None)
            )
            if text and key not in seen:
                seen.add(key)
                out.append(item)
        elif item and item.lower() not in seen:
            seen.add(item.lower())
            out.append(item)
    return out


def _format_mapping(mapping: dict, include_confidence: bool) -> dict:
    out = {}
    for name, value in mapping.items():
        if isinstance(value, list):
            out[name] = _dedupe(value, include_confidence)
        elif isinstance(value, tuple):
            text, conf = value[0], value[1]
            out[name] = {"text": text, "confidence": conf} if include_confidence and text else text
        else:
            out[name] = value or None
    return out


def _is_relation_value(value: Any) -> bool:
    if not isinstance(value, list) or not value:
        return False
    first = value[0]
    if isinstance(first, tuple):
        return len(first) == 2
    return isinstance(first, dict) and "head" in first and "tail" in first


def format_result(
    result: dict,
    include_confidence: bool = False,
    requested_relations: Optional[Sequence[str]] = None,
    classification_tasks: Optional[Sequence[str]] = None,
) -> dict:
    """The public payload of one raw result: what GLiNER2's ``format_results`` makes of it."""
    requested = list(requested_relations or [])
    cls_tasks = classification_tasks or []
    out: dict = {}
    relations: dict = {}
    for key, value in result.items():
        if key in cls_tasks:
            out[key] = _format_classification(value, include_confidence)
        elif key in requested or _is_relation_value(value):
            relations[key] = value if isinstance(value, list) else []
        elif isinstance(value, list):
            if not value:
                out[key] = {} if key == "entities" else value
            elif isinstance(value[0], dict):
                if key == "entities":
                    out[key] = _format_mapping(value[0], include_confidence)
                else:
                    out[key] = [_format_mapping(v, include_confidence) for v in value]
            elif isinstance(value[0], tuple):
                out[key] = (
                    [{"label": label, "confidence": conf} for label, conf in value]
                    if include_confidence
                    else [label for label, _ in value]
                )
            else:
                out[key] = value
        elif isinstance(value, tuple):
            out[key] = {"label": value[0], "confidence": value[1]} if include_confidence else value[0]
        elif isinstance(value, dict):
            out[key] = _format_mapping(value, include_confidence)
        else:
            out[key] = value
    for name in requested:
        relations.setdefault(name, [])
    if relations:
        out["relation_extraction"] = relations
    return out


def _span_payload(span: tuple, include_confidence: bool, include_spans: bool) -> Any:
    text, conf, start, end = span
    if include_spans and include_confidence:
        return {"text": text, "confidence": conf, "start": start, "end": end}
    if include_spans:
        return {"text": text, "start": start, "end": end}
    if include_confidence:
        return {"text": text, "confidence": conf}
    return text


# ----------------------------------------------------------------------------- decoding
def _task_name(tokens: Sequence[str]) -> str:
    return tokens[2].split(_DESCRIPTION)[0]


def _classification_config(prompt: str, configs: Sequence[dict]) -> Optional[dict]:
    """The classification config a task prompt belongs to: the longest task name it starts with
    followed by nothing, ':' or ' '; else the first whose task name it starts with."""
    chosen = None
    for config in configs:
        task = config.get("task", "")
        if task and prompt.startswith(task):
            rest = prompt[len(task) :]
            if (rest == "" or rest[0] in ": ") and (chosen is None or len(task) > len(chosen.get("task", ""))):
                chosen = config
    if chosen is None:
        chosen = next((c for c in configs if prompt.startswith(c.get("task", ""))), None)
    return chosen


def _decode_classification(config: dict, probs: np.ndarray) -> Any:
    labels = config["labels"]
    values = probs.tolist()
    if not config.get("multi_label", False):
        best = int(np.argmax(probs))
        return (labels[best], values[best])
    cutoff = config.get("cls_threshold", 0.5)
    chosen = [(labels[j], values[j]) for j in range(len(labels)) if values[j] >= cutoff]
    if not chosen:
        best = int(np.argmax(probs))
        chosen = [(labels[best], values[best])]
    top_k = config.get("top_k")
    if top_k is not None:
        chosen = sorted(chosen, key=lambda pair: pair[1], reverse=True)[:top_k]
    return chosen


class _RowHits:
    """The sparse hits of one row, grouped by (task, instance, field) for the decoders."""

    def __init__(self, row: CompactRow):
        hits = np.asarray(row.hits, dtype=np.int64).reshape(-1, 5)
        self.scores = np.asarray(row.scores, dtype=np.float32)
        self.dtype = row.dtype
        self.start = hits[:, 3]
        self.width = hits[:, 4]
        self.logits = row.hit_logits
        self._masks: dict = {}
        self._tensor: Optional[torch.Tensor] = None
        self._lists: Optional[tuple[list, list, list]] = None
        # hits are sorted by (task, instance, field): one contiguous range per group
        key = (hits[:, 0] << 42) | (hits[:, 1] << 21) | hits[:, 2]
        n = len(key)
        cuts = np.flatnonzero(key[1:] != key[:-1]) + 1 if n else np.zeros(0, dtype=np.int64)
        firsts = np.concatenate([[0], cuts]).astype(np.int64) if n else cuts
        lasts = np.concatenate([cuts, [n]]).astype(np.int64) if n else cuts
        self._groups = dict(zip(key[firsts].tolist(), zip(firsts.tolist(), lasts.tolist())))
        self._tasks: dict[int, tuple[int, int]] = {}
        for task, lo, hi in zip(hits[firsts, 0].tolist(), firsts.tolist(), lasts.tolist()):
            first = self._tasks.get(task, (lo, hi))[0]
            self._tasks[task] = (first, hi)

    def group(self, task: int, instance: int, field: int) -> tuple[int, int]:
        """[lo, hi) of the hits of one (task, instance, field)."""
        return self._groups.get((task << 42) | (instance << 21) | field, (0, 0))

    def task_range(self, task: int) -> tuple[int, int]:
        return self._tasks.get(task, (0, 0))

    def lists(self) -> tuple[list, list, list]:
        """(start, width, score) of every hit as Python lists (made once per row)."""
        if self._lists is None:
            self._lists = (self.start.tolist(), self.width.tolist(), self.scores.tolist())
        return self._lists

    def passing(self, threshold) -> np.ndarray:
        """scores >= threshold, compared by torch in the serving dtype (as GLiNER2 does)."""
        key = (type(threshold), threshold)
        mask = self._masks.get(key)
        if mask is None:
            if self._tensor is None:
                self._tensor = torch.from_numpy(self.scores).to(self.dtype)
            mask = (self._tensor >= threshold).numpy()
            self._masks[key] = mask
        return mask


class _Sample:
    """Per-request constants the span decoders share."""

    def __init__(self, row: CompactRow, record, metadata: dict, policy: Optional[str]):
        self.hits = _RowHits(row)
        self.text = record.text
        self.start_map = record.start_token_idx
        self.end_map = record.end_token_idx
        self.text_len = len(record.start_token_idx)
        length = int(row.grid[0]) if len(row.grid) and int(row.grid[0]) > 0 else len(record.text_tokens)
        self.length = length
        # scores[..., -text_len:] keeps the last text_len words (all of them when text_len is 0 or too long)
        self.offset = length - self.text_len if 0 < self.text_len <= length else 0
        self.prefix_rows = max(length - self.text_len, 0) if self.text_len > 0 else 0
        self.prefix_tokens = record.text_tokens[: -self.text_len] if self.text_len > 0 else []
        self.metadata = metadata
        self.policy = policy

    def spans(self, lo: int, hi: int, threshold) -> tuple[list[tuple], list[int]]:
        """(text, score, char_start, char_end) of the kept text spans in a group, and their hits."""
        if lo == hi:
            return [], []
        picked = np.flatnonzero(self.hits.passing(threshold)[lo:hi]) + lo
        if not len(picked):
            return [], []
        out, which = [], []
        text, text_len, offset = self.text, self.text_len, self.offset
        starts, widths, scores = self.hits.lists()
        for i in picked.tolist():
            start, width, score = starts[i] - offset, widths[i], scores[i]
            end = start + width + 1
            if not (0 <= start < text_len and end <= text_len):
                continue
            try:
                char_start, char_end = self.start_map[start], self.end_map[end - 1]
            except (IndexError, KeyError):
                continue
            piece = text[char_start:char_end].strip()
            if piece:
                out.append((piece, score, char_start, char_end))
                which.append(i)
        return out, which

    def finalize(self, spans: list[tuple], dtype: str = "list") -> list[tuple]:
        """The spans the overlap policy keeps (all of them for list dtype, else the first)."""
        if self.policy is None:
            if dtype != "list":
                return _greedy_first(spans)
            kept: list[tuple] = []
            for span in sorted(spans, key=lambda s: s[1], reverse=True):
                a, b = span[2], span[3]
                if not any(a < other[3] and other[2] < b for other in kept):
                    kept.append(span)
            return kept
        kept = resolve_overlaps(spans, self.policy)
        return kept if dtype == "list" else kept[:1]

    def first(self, spans: list[tuple]) -> Optional[tuple]:
        kept = _greedy_first(spans) if self.policy is None else self.finalize(spans)
        return kept[0] if kept else None

    def choice_score(self, task: int, instance: int, field: int, word: int) -> Optional[float]:
        """The kept score at (instance, field, word, width 0), None when it was dropped."""
        lo, hi = self.hits.group(task, instance, field)
        if lo == hi:
            return None
        starts = self.hits.start[lo:hi]
        j = int(np.searchsorted(starts, word, "left"))
        if j < len(starts) and starts[j] == word and self.hits.width[lo + j] == 0:
            return float(self.hits.scores[lo + j])
        return None


def _valid(text: str, validators) -> bool:
    return all(v.validate(text) for v in validators)


def _find_word(choice: str, tokens: Sequence[str]) -> int:
    lowered = choice.lower()
    return next((i for i, token in enumerate(tokens) if token.lower() == lowered), -1)


class PostDecoder:
    """GLiNER2's span-architecture decoding and formatting, over a :class:`CompactRow`.

    ``overlap_policy`` is the model's own default (None for span checkpoints: GLiNER2's
    confidence-first greedy decoder); a request's ``metadata["_overlap_policy"]`` overrides it.
    """

    def __init__(self, overlap_policy: Optional[str] = None):
        self.overlap_policy = None if overlap_policy is None else normalize_overlap_policy(overlap_policy)

    @classmethod
    def from_model(cls, model) -> "PostDecoder":
        """Reads only plain attributes of a GLiNER2 instance."""
        architecture = getattr(model, "architecture", "span")
        if architecture == "boundary":
            raise NotImplementedError("boundary checkpoints decode their own candidates; only span ones here")
        return cls(None)

    def _policy(self, metadata: dict) -> Optional[str]:
        override = metadata.get("_overlap_policy")
        return normalize_overlap_policy(override) if override is not None else self.overlap_policy

    def decode(
        self,
        row: CompactRow,
        record,
        metadata: dict,
        threshold: float,
        include_confidence: bool = False,
        include_spans: bool = False,
    ) -> dict:
        """What ``GLiNER2.batch_extract`` returns for this request (formatted)."""
        raw = self.decode_raw(row, record, metadata, threshold, include_confidence, include_spans)
        return format_result(
            raw, include_confidence, metadata.get("relation_order", []), metadata.get("classification_tasks", [])
        )

    def decode_raw(
        self,
        row: CompactRow,
        record,
        metadata: dict,
        threshold: float,
        include_confidence: bool = False,
        include_spans: bool = False,
    ) -> dict:
        """The unformatted result (GLiNER2's ``_extract_from_batch`` value for this request)."""
        schema = record.schema
        choice_fields = {}
        for struct in schema.get("json_structures", []):
            for parent, fields in struct.items():
                for name, value in fields.items():
                    if isinstance(value, dict) and "choices" in value:
                        choice_fields[f"{parent}.{name}"] = value["choices"]
        sample = _Sample(row, record, metadata, self._policy(metadata))
        counts = row.counts
        cls_starts = np.concatenate([[0], np.cumsum(row.cls_sizes)]).astype(np.int64)
        logit_base = self._logit_bases(row, sample.hits, needs_raw_logits(record, metadata))
        results: dict = {}
        for t, (tokens, task_type) in enumerate(zip(record.schema_tokens_list, record.task_types)):
            if len(tokens) < 4 or (t < len(counts) and counts[t] == SKIPPED):
                continue
            name = _task_name(tokens)
            if task_type == "classifications":
                size = int(row.cls_sizes[t]) if t < len(row.cls_sizes) else 0
                config = _classification_config(tokens[2], schema.get("classifications", []))
                if config is None or size == 0:
                    continue
                probs = row.cls_probs[cls_starts[t] : cls_starts[t] + size]
                results[config["task"]] = _decode_classification(config, probs)
                continue
            field_names = [tokens[i + 1] for i in range(len(tokens) - 1) if tokens[i] in _FIELD_MARKERS]
            if not field_names:
                results[name] = [] if name == "entities" else {}
                continue
            count = int(counts[t]) if t < len(counts) else 0
            if count <= 0:
                results[name] = [] if name == "entities" or task_type == "relations" else {}
                continue
            if name == "entities":
                if metadata.get("entity_attribute_groups"):
                    results[name] = self._attributed_entities(
                        sample, t, field_names, threshold, include_confidence, include_spans, logit_base.get(t, 0)
                    )
                else:
                    results[name] = self._entities(sample, t, field_names, threshold, include_confidence, include_spans)
            elif task_type == "relations":
                results[name] = self._relations(
                    sample, t, name, field_names, count, threshold, include_confidence, include_spans
                )
            else:
                results[name] = self._structures(
                    sample, t, name, field_names, count, threshold, choice_fields, include_confidence, include_spans
                )
        return results

    @staticmethod
    def _logit_bases(row: CompactRow, hits: _RowHits, needs: list[bool]) -> dict[int, int]:
        """hit_logits line of each logit task's first hit."""
        bases, line = {}, 0
        for t, need in enumerate(needs):
            if need:
                lo, hi = hits.task_range(t)
                bases[t] = line - lo  # line of hit i is i + bases[t]
                line += hi - lo
        if line != len(row.hit_logits) and line:
            raise ValueError(f"hit_logits has {len(row.hit_logits)} lines for {line} hits of attribute tasks")
        return bases

    # ---- entities
    def _entities(self, sample: _Sample, t, names, threshold, include_confidence, include_spans) -> list:
        found = OrderedDict()
        entity_meta = sample.metadata.get("entity_metadata", {})
        for name in sample.metadata.get("entity_order", names):
            if name not in names:
                continue
            meta = entity_meta.get(name, {})
            limit = float(meta["threshold"]) if meta.get("threshold") is not None else threshold
            dtype = meta.get("dtype", "list")
            validators = meta.get("validators", [])
            spans, _ = sample.spans(*sample.hits.group(t, 0, names.index(name)), limit)
            if validators:
                spans = [s for s in spans if _valid(s[0], validators)]
            if dtype == "list":
                found[name] = [_span_payload(s, include_confidence, include_spans) for s in sample.finalize(spans)]
                continue
            best = sample.finalize(spans, dtype)
            if best:
                found[name] = _span_payload(best[0], include_confidence, include_spans)
            else:
                found[name] = "" if not include_spans and not include_confidence else None
        return [found] if found else []

    def _attributed_entities(
        self, sample: _Sample, t, names, threshold, include_confidence, include_spans, logit_base
    ) -> list:
        metadata = sample.metadata
        prompt_labels = metadata.get("entity_attribute_prompt_labels", {})
        attribute_labels = metadata.get("entity_attribute_labels", set())
        groups = []
        for group_name, group in metadata.get("entity_attribute_groups", {}).items():
            present = [
                (label, names.index(prompt_labels.get(label, label)))
                for label in group.labels
                if prompt_labels.get(label, label) in names
            ]
            if present:
                groups.append((group_name, [p[0] for p in present], np.array([p[1] for p in present]), group))
        content = [n for n in names if n not in attribute_labels]
        entity_meta = metadata.get("entity_metadata", {})
        dtype_t = sample.hits.dtype
        found_by_name = OrderedDict()
        for name in metadata.get("entity_order", content):
            if name not in content:
                continue
            meta = entity_meta.get(name, {})
            limit = float(meta["threshold"]) if meta.get("threshold") is not None else threshold
            validators = meta.get("validators", [])
            spans, which = sample.spans(*sample.hits.group(t, 0, names.index(name)), limit)
            found = []
            for span, i in zip(spans, which):
                if validators and not _valid(span[0], validators):
                    continue
                item = {"text": span[0], "confidence": span[1], "start": span[2], "end": span[3]}
                line = sample.hits.logits[i + logit_base]
                for group_name, labels, columns, group in groups:
                    if group.applies_to is not None and name not in group.applies_to:
                        continue
                    values = torch.from_numpy(line[columns]).to(dtype_t)
                    if group.multi_label:
                        probs = torch.sigmoid(values).tolist()
                        item[group_name] = [
                            {"label": labels[k], "confidence": probs[k]}
                            for k in range(len(labels))
                            if probs[k] >= group.threshold
                        ]
                    else:
                        probs = torch.softmax(values, dim=-1)
                        best = int(probs.argmax())
                        item[group_name] = {"label": labels[best], "confidence": probs[best].item()}
                found.append(item)
            dtype = meta.get("dtype", "list")
            kept = sample.finalize([(f["text"], f["confidence"], f["start"], f["end"]) for f in found], dtype)
            by_boundaries = {(f["start"], f["end"]): f for f in found}
            formatted = [
                self._attributed_payload(by_boundaries[(s[2], s[3])], include_confidence, include_spans) for s in kept
            ]
            found_by_name[name] = formatted if dtype == "list" else (formatted[0] if formatted else None)
        return [found_by_name] if found_by_name else []

    @staticmethod
    def _attributed_payload(entity: dict, include_confidence: bool, include_spans: bool) -> dict:
        out = {"text": entity["text"]}
        if include_confidence:
            out["confidence"] = entity["confidence"]
        if include_spans:
            out["start"], out["end"] = entity["start"], entity["end"]
        out.update((k, v) for k, v in entity.items() if k not in _ENTITY_KEYS)
        return out

    # ---- relations
    def _relations(self, sample: _Sample, t, name, fields, count, threshold, include_confidence, include_spans):
        limit = threshold
        relation_meta = sample.metadata.get("relation_metadata", {})
        if name in relation_meta:
            configured = relation_meta[name].get("threshold")
            limit = configured if configured is not None else threshold
        order = sample.metadata.get("field_orders", {}).get(name, fields)
        out = []
        for instance in range(count):
            parts = []
            for field in order:
                if field not in fields:
                    continue
                spans, _ = sample.spans(*sample.hits.group(t, instance, fields.index(field)), limit)
                parts.append(sample.first(spans))
            if len(parts) != 2 or not (parts[0] and parts[0][0]) or not (parts[1] and parts[1][0]):
                continue
            head, tail = parts
            if include_spans or include_confidence:
                out.append(
                    {
                        "head": _relation_side(head, include_confidence, include_spans),
                        "tail": _relation_side(tail, include_confidence, include_spans),
                    }
                )
            else:
                out.append((head[0], tail[0]))
        return out

    # ---- structures
    def _structures(
        self, sample: _Sample, t, name, fields, count, threshold, choice_fields, include_confidence, include_spans
    ):
        order = sample.metadata.get("field_orders", {}).get(name, fields)
        field_meta = sample.metadata.get("field_metadata", {})
        out = []
        for instance in range(count):
            values = OrderedDict()
            for field in order:
                if field not in fields:
                    continue
                index = fields.index(field)
                key = f"{name}.{field}"
                meta = field_meta.get(key, {})
                limit = meta["threshold"] if meta.get("threshold") is not None else threshold
                dtype = meta.get("dtype", "list")
                if key in choice_fields:
                    values[field] = self._choice(
                        sample, t, instance, index, choice_fields[key], limit, dtype, include_confidence
                    )
                    continue
                spans, _ = sample.spans(*sample.hits.group(t, instance, index), limit)
                validators = meta.get("validators", [])
                if validators:
                    spans = [s for s in spans if _valid(s[0], validators)]
                if dtype == "list":
                    kept = sample.finalize(spans)
                    values[field] = [_span_payload(s, include_confidence, include_spans) for s in kept]
                else:
                    kept = sample.finalize(spans, dtype)
                    values[field] = _span_payload(kept[0], include_confidence, include_spans) if kept else None
            if any(v is not None and v != [] for v in values.values()):
                out.append(values)
        return out

    @staticmethod
    def _choice(sample: _Sample, t, instance, index, choices, limit, dtype, include_confidence):
        def score_of(choice: str) -> Optional[float]:
            word = _find_word(choice, sample.prefix_tokens)
            if word < 0 or word >= sample.prefix_rows:
                return None
            return sample.choice_score(t, instance, index, word)  # None: dropped, below every threshold

        if dtype == "list":
            selected, seen = [], set()
            for choice in choices:
                if choice in seen:
                    continue
                score = score_of(choice)
                if score is not None and score >= limit:
                    selected.append({"text": choice, "confidence": score} if include_confidence else choice)
                    seen.add(choice)
            return selected
        best, best_score = None, -1.0
        for choice in choices:
            score = score_of(choice)
            if score is not None and score > best_score:
                best, best_score = choice, score
        if best and best_score >= limit:
            return {"text": best, "confidence": best_score} if include_confidence else best
        return None


def _relation_side(span: tuple, include_confidence: bool, include_spans: bool) -> dict:
    text, conf, start, end = span
    side: dict = {"text": text}
    if include_confidence:
        side["confidence"] = conf
    if include_spans:
        side["start"], side["end"] = start, end
    return side
