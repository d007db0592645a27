"""CUDA graphs of the heads of entity-only chunks: step B of the chunk pipeline as one replay.

Why: the GPU stage is one Python process, and at saturation its GPU thread's host work bounds
it (docs/architecture.md). A chunk's dense heads (``HeadLoras.span_logits_dense``, entity tasks
only, with the count gate) and the compaction's mask (``post.compact_dense_begin``) dispatch
~230 tensor operations with head LoRA (~130 without; ``perf/count_head_ops.py``), and every
operation can hand the interpreter lock to the parse or answer thread. On the H200 the heads
took 37 ms of wall and 28 ms of the GPU thread's CPU per ~350-row call at LoRA saturation
(session 23, ``manylora_core_phase_seconds_total``), ~40 us of CPU per operation. Such a chunk
never waits for the GPU before its hits' ``nonzero`` (the count gate), so the whole step can
be a graph: one gather of the token states into a static buffer, two host-to-GPU copies and a
replay.

How:

* A graph's shape is (active rows bucket, words bucket, records bucket, fields bucket, queries
  per row, head LoRA or none). Rows, words, records and fields are padded up to their buckets:
  padding rows have no words (length 0: every span -inf, no hit), padding queries and
  records have a count gate of 0, padding slots are -1 (no adapter). Real rows read exactly
  what the eager path reads.
* The static inputs live in three buffers shared by every graph (one index buffer, one of
  floors, one of gathered states), each graph using views at the buffer's start: graphs
  never run at once (the GPU thread), and their addresses stay fixed.
* Head LoRA always takes the per-row path with its mask (``HeadLoras.slots_on_device``), so
  one graph serves any mix of adapters. In bfloat16 its roundings may differ from the eager
  path's single-adapter GEMMs by a step (tests/engine/test_head_graphs.py compares hits with the
  GPU tolerance of test_dense_heads).
* Outputs (scores, mask, counts) live in the graphs' pool and stay valid until the next replay
  (of any heads graph: they share the pool): the engine's step C reads them, its copy to the
  host returned, before any other chunk's heads run, a chunk run again after a failure
  included (``Engine._core_begin``). Each graph keeps its outputs (for the base size and five
  labels, up to ~25 MB a shape; more with many labels): memory beyond the load-time statement.

On the CPU (tests) the same padded body runs eagerly on the same buffers (``capture=False``).
"""

from __future__ import annotations

import logging
import time
from typing import Optional, Sequence

import numpy as np
import torch

from manylora.graphs import ROW_BUCKETS, capture, length_bucket, row_bucket
from manylora.lora.heads import query_gate
from manylora.post import hit_mask

logger = logging.getLogger(__name__)

# Rows of gathered states (prompts + fields + active rows x words) a graph may hold: the shared
# buffer is this many rows of the hidden size (~200 MB for GLiNER2-base in bfloat16); a token
# budget of 65,536 tokens has at most that many words, plus the buckets' padding.
STATE_ROWS = 1 << 17
MAX_COUNT = 16384  # records or fields of one graph, padded
MAX_QUERY_SLOTS = 16384  # active rows x queries per row of one graph, padded
MAX_GRAPHS = 512


def count_bucket(n: int) -> Optional[int]:
    """Records or fields padded: the rows buckets up to 1,024, then multiples of 256 up to MAX_COUNT."""
    if n <= 1024:
        return row_bucket(max(n, 1))
    padded = -(-n // 256) * 256
    return padded if padded <= MAX_COUNT else None


class _Shape:
    """A graph's padded sizes and its views of the shared buffers."""

    def __init__(self, key: tuple, ints: torch.Tensor, floats: torch.Tensor, states: torch.Tensor):
        rows, words, records, fields, queries, self.lora = key[:6]
        self.rows, self.words, self.records, self.fields, self.queries = rows, words, records, fields, queries
        sizes = {
            "gather": records + fields + rows * words,  # flat indices into the chunk's states
            "count_slots": records,
            "field_slots": fields,
            "span_slots": rows,
            "lengths": rows,
            "n_queries": rows,
            "query_src": rows * queries,
            "gate_index": rows * queries,
        }
        self.int_size = sum(sizes.values())
        self.views, offset = {}, 0
        for name, size in sizes.items():
            self.views[name] = ints[offset : offset + size]
            offset += size
        self.floors = floats[:rows]
        self.states = states[: sizes["gather"]]
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.out: Optional[tuple] = None


class HeadGraphs:
    """The entity-only dense heads as replayed CUDA graphs (``capture``), or as the same padded
    body run eagerly (``capture=False``: the CPU tests)."""

    def __init__(self, heads, hidden: int, dtype: torch.dtype, device, capture: bool = True):
        self.heads = heads
        self.device = torch.device(device)
        self.capture = capture
        rows = ROW_BUCKETS[-1]
        # _Shape's views at their largest: gather, records' and fields' slots, 4 per row, 2 per query slot
        int_cap = STATE_ROWS + 2 * MAX_COUNT + 4 * rows + 2 * MAX_QUERY_SLOTS
        self.ints = torch.zeros(int_cap, dtype=torch.int64, device=self.device)
        self.floats = torch.zeros(rows, dtype=torch.float64, device=self.device)
        self.states = torch.zeros(STATE_ROWS, hidden, dtype=dtype, device=self.device)
        self.shapes: dict[tuple, _Shape] = {}
        self.eager: set[tuple] = set()  # keys whose capture failed
        self.stats = {"replays": 0, "captures": 0, "eager": 0, "capture_seconds": 0.0}
        if capture:
            self.pool = torch.cuda.graph_pool_handle()
            self.capture_stream = torch.cuda.Stream(self.device)

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.ints, self.floats, self.states))

    def key(self, rows: int, words: int, records: int, fields: int, queries: int, lora: bool) -> Optional[tuple]:
        shape = (row_bucket(rows), length_bucket(words), count_bucket(records), count_bucket(fields))
        if None in shape:
            return None
        a, w, r, f = shape
        if r + f + a * w > STATE_ROWS or a * queries > MAX_QUERY_SLOTS:
            return None
        return (a, w, r, f, queries, lora, bool(self.heads.span_kernel))

    def run(
        self,
        hidden: torch.Tensor,
        batch,
        records: Sequence[tuple],
        count_slots: Sequence[int],
        layout: dict,
        t_min: Sequence[float],
        floor,
    ) -> Optional[tuple]:
        """(scores [A', Q, W', width], mask of hits, counts [records]) of the chunk, padded
        (rows past ``layout['active']`` and words past each row's count have no hit); None when
        this chunk's shape has no graph (the caller runs the eager path). ``floor(t, dtype)``:
        the lowest score of ``dtype`` at or above threshold ``t`` (post.dtype_floor)."""
        field_rows, active, span_slots = layout["lists"][0], layout["lists"][3], layout["lists"][4]
        n_rec, n_rows = len(records), len(active)
        lora = any(s >= 0 for s in count_slots) or any(s >= 0 for s in span_slots)
        key = self.key(n_rows, layout["max_words"], n_rec, len(field_rows), layout["width_q"], lora)
        if key is None or key in self.eager:
            self.stats["eager"] += 1
            return None
        shape = self.shapes.get(key)
        if shape is None and len(self.shapes) >= MAX_GRAPHS:
            self.stats["eager"] += 1
            return None
        ints = self._ints(key, hidden.shape[1], batch, records, count_slots, layout)
        floors = [floor(float(t_min[row]), hidden.dtype) for row in active] + [np.inf] * (key[0] - n_rows)
        if shape is None:
            shape = self._capture(key, hidden, ints, floors)
            if shape is None:
                return None
        self._fill(shape, hidden, ints, floors)
        if shape.graph is not None:
            shape.graph.replay()
            scores, mask, counts = shape.out
        else:
            scores, mask, counts = self._body(shape)
        self.stats["replays"] += 1
        return scores, mask, counts[:n_rec]

    def _ints(self, key, length: int, batch, records, count_slots, layout) -> np.ndarray:
        """The graph's index inputs, padded, in ``_Shape``'s order (``length``: the chunk's
        states' padded length, for flat indices into them)."""
        rows_b, words_b, rec_b, fields_b, width_q = key[:5]
        field_rows, field_pos, field_slots, active, span_slots, lengths = layout["lists"][:6]
        n_rec, n_rows = len(records), len(active)

        def padded(values, size, fill):
            out = np.full(size, fill, dtype=np.int64)
            out[: len(values)] = values
            return out

        prompt = [row * length + positions[0] for row, _, positions in records]
        fields = np.asarray(field_rows, dtype=np.int64) * length + np.asarray(field_pos, dtype=np.int64)
        host = getattr(batch, "host", batch)  # decode.batch_to_device keeps the host batch
        words = host.text_word_indices.numpy()[np.asarray(active, dtype=np.int64), :words_b]
        tokens = np.zeros((rows_b, words_b), dtype=np.int64)
        tokens[:n_rows, : words.shape[1]] = words + np.asarray(active, dtype=np.int64)[:, None] * length
        tokens[:n_rows][np.arange(words_b)[None, :] >= np.asarray(lengths)[:, None]] = 0
        if layout["flat_dest"] is None:  # one instance per task, as many queries in every row: in order
            source = np.arange(n_rows * width_q, dtype=np.int64)
        else:
            source = np.zeros(n_rows * width_q, dtype=np.int64)
            source[np.asarray(layout["flat_dest"], dtype=np.int64)] = layout["lists"][7]
        gate = np.asarray(layout["lists"][-1], dtype=np.int64)
        gate[gate >= n_rec] = rec_b  # padding queries: the zero after the padded records' counts
        n_queries = [sum(f for _, _, _, f in tasks) for _, _, tasks in layout["plan_rows"]]
        return np.concatenate(
            [
                padded(prompt, rec_b, 0),
                padded(fields, fields_b, 0),
                tokens.reshape(-1),
                padded(count_slots, rec_b, -1),
                padded(field_slots, fields_b, -1),
                padded(span_slots, rows_b, -1),
                padded(lengths, rows_b, 0),
                padded(n_queries, rows_b, 0),
                padded(source, rows_b * width_q, 0),
                padded(gate, rows_b * width_q, rec_b),
            ]
        )

    def _fill(self, shape: _Shape, hidden: torch.Tensor, ints: np.ndarray, floors: list) -> None:
        """This chunk into the shape's static inputs: two host-to-GPU copies and one gather."""
        for dest, host in (
            (self.ints[: shape.int_size], torch.from_numpy(ints)),
            (shape.floors, torch.tensor(floors, dtype=torch.float64)),
        ):
            if self.device.type == "cuda":
                dest.copy_(host.pin_memory(), non_blocking=True)
            else:
                dest.copy_(host)
        torch.index_select(hidden.reshape(-1, hidden.shape[-1]), 0, shape.views["gather"], out=shape.states)

    def _body(self, shape: _Shape) -> tuple:
        """The padded heads and compaction mask on the shape's static inputs."""
        heads, v = self.heads, shape.views
        model = heads.model
        rows, words, records, fields, width_q = shape.rows, shape.words, shape.records, shape.fields, shape.queries
        prompts = shape.states[:records]
        initial = shape.states[records : records + fields]
        tokens = shape.states[records + fields :].view(rows, words, -1)
        with heads.slots_on_device(("count_pred",), v["count_slots"] if shape.lora else None):
            counts = model.count_pred(prompts).argmax(dim=-1)
        with heads.slots_on_device(("count_embed",), v["field_slots"] if shape.lora else None):
            projected = heads.count_embed_steps(1, initial)[0]  # [fields, H]: step 0 (entity tasks)
        queries = projected[v["query_src"]].view(rows, width_q, -1)
        lengths = v["lengths"]
        in_row = torch.arange(words, device=tokens.device).view(1, -1) < lengths.view(-1, 1)
        tokens = torch.where(in_row.unsqueeze(-1), tokens, torch.zeros((), dtype=tokens.dtype, device=tokens.device))
        with heads.slots_on_device(("span_rep",), v["span_slots"] if shape.lora else None):
            logits = heads._span_scores(tokens, queries, lengths)
        scores = torch.sigmoid(logits)
        gate = query_gate(counts, v["gate_index"]).view(rows, width_q)
        mask = hit_mask(scores, shape.floors.to(scores.dtype), v["n_queries"], lengths, gate)
        return scores, mask, counts

    def _capture(self, key: tuple, hidden: torch.Tensor, ints: np.ndarray, floors: list) -> Optional[_Shape]:
        shape = _Shape(key, self.ints, self.floats, self.states)
        if not self.capture:
            self.shapes[key] = shape
            return shape
        started = time.perf_counter()
        try:
            self._fill(shape, hidden, ints, floors)
            self._body(shape)  # warm-up: compiles kernels, fills the shape caches
            shape.graph, shape.out = capture(lambda: self._body(shape), self.pool, self.capture_stream, self.device)
        except Exception as exc:  # an uncapturable operation, out of memory: this key stays eager
            logger.warning(
                "CUDA graph capture of the heads %s failed (%s: %s); they run eagerly", key[:5], type(exc).__name__, exc
            )
            self.eager.add(key)
            self.stats["eager"] += 1
            torch.cuda.synchronize(self.device)
            return None
        self.shapes[key] = shape
        self.stats["captures"] += 1
        self.stats["capture_seconds"] += time.perf_counter() - started
        return shape
