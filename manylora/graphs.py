"""CUDA graphs of the encoder forward: one graph per (rows bucket, padded length, LoRA variant).

Why (H200 profiles, ``perf/h200-2026-12-01/session8/*profile-core*``): one encoder forward with
LoRA issues ~300 kernel launches (180 of them Triton launches at ~40 us of host time each). A
single LoRA row cost 19.2 ms of host time for 2.0 ms of GPU time, a single base row 10.5 ms for
1.1 ms; at saturation the ~20 ms of launches per chunk are host time of the one GPU-stage
process that the GPU waits for. A replayed graph issues the whole forward in one call.

How:

* A graph is captured lazily, the first time its key is met, after one eager warm-up run of the
  same shape (which compiles the Triton kernels and fills the shape caches). Keys are (rows
  bucket, length bucket, the batch's LoRA targets, rank tile): the captured kernels are those the
  eager forward of that shape launches, with each LoRA update added after its base GEMM.
* Rows are padded up to a rows bucket, and the length up to a length bucket, with pad tokens and
  a zero attention mask; a padding row takes the last real row's adapter slot, so the slots stay
  sorted. Rows are independent in the encoder (attention, LayerNorm and the LoRA updates are per
  row) and masked keys add nothing to attention, so padding changes no real token's state.
* Inputs live in static buffers: token ids and mask, the SGMV tile buffer (the same fixed-address
  buffer the eager path fills, ``kernels.meta``), and the per-row slot / group tensors of the
  position factors, where in a graph every row is its own group (the factor count no longer
  depends on how many adapters the batch has). The SGMV kernels walk their tiles with a grid
  stride, so a graph captured with the bound grid of its shape serves any slot layout.
* Every graph writes its output into one shared buffer, and ``run`` returns a copy of it: the
  graphs' own outputs take no memory of their own, and the states stay valid after the next replay.
* All graphs share one memory pool: they never run at once, so intermediates are shared.

Graphs are used for shapes of at most ``max_tokens`` padded tokens (MAX_GRAPH_TOKENS: small
batches, where launches dominate; above it see ``graph_shape``) and ``max_length`` tokens per row; larger forwards, and keys
beyond ``max_graphs``, run eagerly. A capture that fails (out of
memory, an operation that cannot be captured) marks its key eager, logged once.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import logging
import threading
import time
from typing import Optional

import torch

from manylora.kernels import SgmvMetaBuilder
from manylora.kernels.launch_config import rank_block
from manylora.kernels.meta import SgmvMeta, SgmvTiles
from manylora.lora.batch import LoraBatch

logger = logging.getLogger(__name__)

# Rows buckets: fine steps where a padding row is a large share of the batch, then steps of 32
# (at most ~1/8 padding from 256 rows up).
ROW_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256) + tuple(
    range(288, 1025, 32)
)


# Padded lengths (the engine pads rows to a multiple of 16): every length up to 128 tokens, then
# coarser, so that a light load's few dozen shapes are captured within its first seconds.
LENGTH_BUCKETS = tuple(range(16, 129, 16)) + tuple(range(160, 257, 32)) + tuple(range(320, 513, 64))

# Graphs only for forwards of at most this many padded tokens. Measured on the H200
# (perf/h200-2026-12-01/session9/): at 1,024 rows in chunks of ~256 the eager forward's launches
# already hide behind the GPU (run_core 0.339 ms/row eager, 0.333 with graphs), while a single row
# went from 36.7 to 10.0 ms (LoRA) and 9.5 to 4.1 ms (base). Large shapes are many (rows x length)
# and each costs a capture: through tritonserver, graphs for every shape lost 20% at saturation.
MAX_GRAPH_TOKENS = 16384


def _bucket(buckets: tuple, n: int) -> Optional[int]:
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


def row_bucket(rows: int) -> Optional[int]:
    """The smallest bucket holding ``rows`` rows, None above the largest."""
    return _bucket(ROW_BUCKETS, rows)


def length_bucket(length: int) -> Optional[int]:
    """The smallest length bucket holding ``length`` tokens, None above the largest."""
    return _bucket(LENGTH_BUCKETS, length)


def graph_shape(rows: int, length: int, max_tokens: int, max_length: int = 512) -> Optional[tuple[int, int]]:
    """The (rows, length) a batch of ``rows`` x ``length`` padded tokens is replayed at, or None
    when it runs eagerly. Small shapes (at most MAX_GRAPH_TOKENS once padded) go up to a rows
    bucket and a length bucket, within ``max_tokens``. Larger shapes exist only once the cap is
    raised above MAX_GRAPH_TOKENS (``cuda_graph_max_tokens``): they keep their own length (a
    multiple of 16), rows go up to a bucket, and the batch's own tokens must be within the cap
    (``padded_bound`` sizes the buffers for the bucket's extra rows). They are few (rows x length
    stays near the token budget) and large: the length buckets had padded the 1,024 benchmark
    rows' four 65,536-token chunks to 1.16x the eager forward's tokens (computed from
    ``perf/profile_core.py``'s rows), and with graphs for them LoRA took 12.5% more GPU time on
    the H200 (session 10)."""
    bucket, padded = row_bucket(rows), length_bucket(length)
    if bucket is None or padded is None or padded > max_length:
        return None
    if bucket * padded <= MAX_GRAPH_TOKENS or max_tokens <= MAX_GRAPH_TOKENS:
        return (bucket, padded) if bucket * padded <= max_tokens else None
    return (bucket, length) if rows * length <= max_tokens else None


def padded_bound(max_tokens: int, max_length: int = 512) -> int:
    """The most tokens a graph shape of ``graph_shape(..., max_tokens, max_length)`` holds."""
    if max_tokens <= MAX_GRAPH_TOKENS:
        return max_tokens
    bound = MAX_GRAPH_TOKENS
    for length in range(16, max_length + 1, 16):  # the largest bucket of rows within the cap, per length
        rows = min(max_tokens // length, ROW_BUCKETS[-1])
        shape = graph_shape(rows, length, max_tokens, max_length) if rows else None
        bound = max(bound, shape[0] * shape[1] if shape else 0)
    return bound


def capture(run, pool, stream: torch.cuda.Stream, device) -> tuple:
    """``run()`` captured as a CUDA graph into ``pool``: (the graph, what ``run`` returned). On a
    side stream, as torch.cuda.graph does, but without its synchronize + gc.collect +
    empty_cache: a capture in the serving GPU thread must not drop the allocator's cache for
    every other shape."""
    stream.wait_stream(torch.cuda.current_stream(device))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            out = run()
        finally:
            graph.capture_end()
    torch.cuda.current_stream(device).wait_stream(stream)
    return graph, out


class StaticLoraBatch(LoraBatch):
    """``LoraBatch`` over static tensors for a graph of ``rows`` x ``row_len`` tokens.

    ``fill`` writes a batch's slots into them before each replay (two small host-to-GPU copies,
    no synchronisation). Every row is its own position-factor group."""

    def __init__(
        self,
        store,
        meta_builder: SgmvMetaBuilder,
        rows: int,
        row_len: int,
        targets,
        backend: str,
        write_first: bool,
        max_rank: int,
        fuse_epilogue: bool = False,
        group_shrinks: bool = True,
    ):
        self.store = store
        self.backend = backend
        self.targets = set(targets)
        self.write_first = write_first
        self.fuse_epilogue = fuse_epilogue  # fixed at capture: the key says every row has an adapter
        self.group_shrinks = group_shrinks  # fixed at capture too (the key holds it)
        self.builder = meta_builder
        self.rows, self.row_len, self.max_rank = rows, row_len, max_rank
        device = store.device
        # [3, rows] int32: row slot (-1 none), its slot clamped at 0 (the gather index), has-adapter (0/1)
        self._slots = torch.zeros(3, rows, dtype=torch.int32, device=device)
        self.row_slots = self._slots[0]
        self.group_slots = self._slots[1]
        self.group_has_adapter = self._slots[2]
        self.row_group = torch.arange(rows, dtype=torch.int32, device=device)
        self._scratch: dict = {}
        self._positions: dict = {}
        self._positions_window = None
        self.meta: Optional[SgmvMeta] = None

    def fill(self, slot_per_row: list[int], row_lens: Optional[list[int]] = None) -> None:
        """This batch's slots (already padded to ``rows``): the SGMV tiles and the slot tensors;
        ``row_lens`` (padded the same way): tiles over each row's real tokens only."""
        meta = self.builder.build(
            slot_per_row=torch.tensor(slot_per_row, dtype=torch.int32),
            row_len=self.row_len,
            max_rank=self.max_rank,
            row_lens=row_lens,
        )
        if self.meta is None:  # the first fill (the warm-up): fix the grids at their bound for this shape
            tokens = self.rows * self.row_len
            tiles = {}
            for bm, t in meta.tiles_by_block_m.items():
                bound = min(self.builder._tile_cap, -(-tokens // bm) + self.rows)
                tiles[bm] = SgmvTiles(block_m=bm, packed=t.packed, grid_bound=bound)
            meta = dataclasses.replace(meta, segments_bound=self.rows, max_rank=self.max_rank, tiles_by_block_m=tiles)
            self.meta = meta
        values = torch.tensor(
            [slot_per_row, [max(s, 0) for s in slot_per_row], [int(s >= 0) for s in slot_per_row]], dtype=torch.int32
        )
        self._slots.copy_(values.pin_memory(), non_blocking=True)

    def _zero_base_groups(self, factors: torch.Tensor) -> None:
        """Every row is its own group here, and which have an adapter is known on the GPU only."""
        factors.masked_fill_(self.group_has_adapter[None, :, None, None] == 0, 0)

    def forget_scratch(self) -> None:
        """Drop the warm-up's temporaries, so that the capture allocates its own in the graph pool."""
        self._scratch = {}
        self._positions = {}
        self._positions_window = None


class _Graph:
    def __init__(self, rows: int, length: int, lora: Optional[StaticLoraBatch], ids_dtype, mask_dtype, device):
        self.rows, self.length, self.lora = rows, length, lora
        self.input_ids = torch.zeros(rows, length, dtype=ids_dtype, device=device)
        self.attention_mask = torch.zeros(rows, length, dtype=mask_dtype, device=device)
        self.graph: Optional[torch.cuda.CUDAGraph] = None


class EncoderGraphs:
    """Lazily captured CUDA graphs of ``encoder``'s forward; ``run`` replays (or captures) one."""

    def __init__(
        self, encoder, store, max_tokens: int = MAX_GRAPH_TOKENS, max_length: int = 512, max_graphs: int = 2048
    ):
        self.encoder = encoder
        self.store = store
        self.device = store.device
        self.max_tokens = max_tokens
        self.max_length = max_length
        self.max_graphs = max_graphs
        self.pool = torch.cuda.graph_pool_handle()
        self.capture_stream = torch.cuda.Stream(self.device)
        bound = padded_bound(max_tokens, max_length)  # a graph's rows go up to a bucket
        self.meta_builder = SgmvMetaBuilder(bound, self.device)
        hidden = encoder.geometry.hidden_size
        self.output = torch.empty(bound * hidden, dtype=encoder.word_embeddings.dtype, device=self.device)
        self.graphs: dict[tuple, _Graph] = {}
        self.eager: set[tuple] = set()  # keys whose capture failed
        self.stats = {"replays": 0, "captures": 0, "eager": 0, "capture_seconds": 0.0}
        self._lock = threading.Lock()

    def key(self, rows: int, length: int, targets, max_rank: Optional[int], covered: bool = False) -> Optional[tuple]:
        """(rows bucket, length bucket, LoRA targets or None, rank tile, fused attention, fused
        LoRA epilogue, grouped shrinks); None: no graph for this shape. The encoder's
        ``fused_attention`` is in the key, so that turning it on or off (an A/B on one engine)
        replays graphs of its own attention (``lora_group_shrinks`` likewise); so is the LoRA
        epilogue (``LoraBatch.fuses_epilogue``), on when the encoder's ``lora_fuse_epilogue`` is
        and every row has an adapter (``covered``): a padding row takes the last real row's slot,
        so a covered batch stays covered."""
        shape = graph_shape(rows, length, self.max_tokens, self.max_length)
        if shape is None:
            return None
        bucket, padded = shape
        fused = bool(self.encoder.fused_attention)
        if not targets:
            return (bucket, padded, None, 0, fused, False, False)
        epilogue = bool(covered and self.encoder.lora_fuse_epilogue)
        grouped = bool(self.encoder.lora_group_shrinks)
        rank_tile = rank_block(max_rank or self.store.max_rank)
        return (bucket, padded, frozenset(targets), rank_tile, fused, epilogue, grouped)

    def padded_tokens(self, rows: int, length: int) -> int:
        """Tokens the encoder computes for ``rows`` x ``length``: a graph's padded shape, else that."""
        shape = graph_shape(rows, length, self.max_tokens, self.max_length)
        return rows * length if shape is None else shape[0] * shape[1]

    def warm(self, variants, max_rows: int) -> int:
        """Capture now, ahead of traffic, the graph of every (rows bucket <= ``max_rows``, length
        bucket) shape of each ``variants`` entry, (LoRA targets or an empty set for base rows,
        largest rank): the shapes of light and moderate load, which would otherwise be captured
        on first use in the GPU thread (~50-100 ms each, H200 session 9: the first moderate-load
        phase after start had a LoRA p95 of 2.7 s). Returns the number of graphs captured."""
        captured = 0
        for targets, max_rank in variants:
            for rows in ROW_BUCKETS:
                if rows > max_rows:
                    break
                # batches of adapter rows only (the LoRA epilogue, when it is on) and batches that
                # mix in base rows: both are light-load shapes (a key of each; the same key when the
                # epilogue is off). The key alone decides the epilogue, so slot 0 fills both.
                for length, covered in itertools.product(LENGTH_BUCKETS, (True, False) if targets else (False,)):
                    key = self.key(rows, length, targets, max_rank, covered=covered)
                    if key is None or key in self.graphs or key in self.eager:
                        continue
                    if len(self.graphs) >= self.max_graphs:
                        return captured
                    ids = torch.zeros(rows, length, dtype=torch.long, device=self.device)
                    mask = torch.ones(rows, length, dtype=torch.long, device=self.device)
                    with self._lock:
                        captured += self._capture(key, ids, mask, [0 if targets else -1] * rows) is not None
        return captured

    def run(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        slot_per_row: list[int],
        targets,
        max_rank: Optional[int],
        row_lens: Optional[list[int]] = None,
    ) -> Optional[torch.Tensor]:
        """The encoder's hidden states [rows, length, H] through a graph; None: this shape runs eagerly.
        ``row_lens``: each row's real tokens, when the LoRA tiles skip the padding."""
        rows, length = input_ids.shape
        key = self.key(rows, length, targets, max_rank, covered=all(s >= 0 for s in slot_per_row))
        if key is None or key in self.eager:
            self.stats["eager"] += 1
            return None
        with self._lock:
            graph = self.graphs.get(key)
            if graph is None:
                if len(self.graphs) >= self.max_graphs:
                    self.stats["eager"] += 1
                    return None
                graph = self._capture(key, input_ids, attention_mask, slot_per_row, row_lens)
                if graph is None:
                    return None
            self._fill(graph, input_ids, attention_mask, slot_per_row, row_lens)
            graph.graph.replay()
            self.stats["replays"] += 1
            hidden = self.encoder.geometry.hidden_size
            out = self.output[: graph.rows * graph.length * hidden].view(graph.rows, graph.length, hidden)
            # a copy (~15 us for a full token budget): the shared buffer is the next replay's
            return out[:rows, :length].clone()

    def _fill(self, graph: _Graph, input_ids, attention_mask, slot_per_row, row_lens=None) -> None:
        """The batch into the graph's inputs; padding rows and columns get pad ids and a zero mask
        (masked keys add nothing to a real token's attention; rows are independent), and with
        ``row_lens`` no real token, so no LoRA tile."""
        rows, length = input_ids.shape
        graph.input_ids.zero_()
        graph.attention_mask.zero_()
        graph.input_ids[:rows, :length].copy_(input_ids)
        graph.attention_mask[:rows, :length].copy_(attention_mask)
        if graph.lora is not None:
            lens = None if row_lens is None else list(row_lens) + [0] * (graph.rows - rows)
            graph.lora.fill(list(slot_per_row) + [slot_per_row[-1]] * (graph.rows - rows), lens)

    def _forward(self, graph: _Graph) -> torch.Tensor:
        out = self.encoder(graph.input_ids, graph.attention_mask, graph.lora)
        flat = self.output[: out.numel()].view_as(out)
        flat.copy_(out)
        return flat

    def _capture(self, key: tuple, input_ids, attention_mask, slot_per_row, row_lens=None) -> Optional[_Graph]:
        rows, length, targets, rank_tile, _, epilogue, grouped = key
        started = time.perf_counter()
        lora = None
        if targets is not None:
            # the update after the base GEMM (not written first): one graph per shape serves batches
            # with and without base rows. Tried in the graphs of rows that all have an adapter (commit
            # 05de464, H200, session 22): no faster, 31.48 ms of GPU time per 150-row call of 1,024
            # adapters (43,520 tokens) written first against 31.44 added after; the q, k, v GEMMs
            # (K = 768) then read y in their epilogue at near their bytes' pace
            # (perf/h200-2026-12-04/session22/, kernels/PERF_NOTES.md)
            backend = self.encoder.backend or "triton"
            lora = StaticLoraBatch(
                self.store, self.meta_builder, rows, length, targets, backend, False, rank_tile, epilogue, grouped
            )
        graph = _Graph(rows, length, lora, input_ids.dtype, attention_mask.dtype, self.device)
        try:
            self._fill(graph, input_ids, attention_mask, slot_per_row, row_lens)
            with torch.inference_mode():
                self._forward(graph)  # warm-up: compiles kernels, fills the shape caches
                if lora is not None:
                    lora.forget_scratch()
                graph.graph, _ = capture(lambda: self._forward(graph), self.pool, self.capture_stream, self.device)
        except Exception as exc:  # out of memory, an uncapturable op: this key stays eager
            logger.warning(
                "CUDA graph capture of %s failed (%s: %s); that shape runs eagerly", key[:2], type(exc).__name__, exc
            )
            self.eager.add(key)
            torch.cuda.synchronize(self.device)
            return None
        self.graphs[key] = graph
        self.stats["captures"] += 1
        self.stats["capture_seconds"] += time.perf_counter() - started
        return graph
