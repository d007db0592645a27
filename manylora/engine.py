"""Engine: the GPU stage of the pipeline, and the three stages composed in-process.

The work is split into stages with a small, serializable boundary between them, so that in
Triton each runs where it scales (``docs/architecture.md``):

* pre (``manylora.pre``, CPU): validate one request, parse its schema (cached per schema
  text), build GLiNER2's record for it.
* core (here, GPU): look the adapters up, order a chunk's rows by adapter slot, pad, run our
  encoder once with every row's LoRA (SGMV), then the heads on the whole chunk, each row with
  its own head LoRA (``HeadLoras``), and keep only what decoding can read: per-row scores at or
  above the row's own lowest threshold, class probabilities and counts (``post.compact_batch``,
  one device-to-host copy per chunk).
* post (``manylora.post``, CPU): those compact rows -> GLiNER2's JSON, in our own code.

``Engine.run`` composes the three in one process (tests, benchmarks, the single-instance
mode); ``Engine.run_core`` is the GPU stage alone, fed by the Triton front's BLS calls.
GLiNER2 itself is the reference: an answer equals ``GLiNER2.batch_extract`` (with PEFT and
that request's adapter) for the same text, schema and options; tests check that directly.
"""

from __future__ import annotations

import bisect
import gc
import logging
import time
from collections import defaultdict, deque
from typing import Callable, NamedTuple, Optional, Sequence, Union

import torch

from manylora.client.protocol import Request  # the wire contract's validated request
from manylora.config import EngineConfig
from manylora.decode import batch_to_device, encode_padded
from manylora.encoder import Encoder, check_fused_attention
from manylora.errors import INTERNAL, INVALID_ARG, NOT_FOUND, UNAVAILABLE, RequestError
from manylora.graphs import ROW_BUCKETS
from manylora.kernels import SgmvMetaBuilder
from manylora.lora.adapter import AdapterError
from manylora.lora.batch import LoraBatch
from manylora.lora.heads import HeadLoras, check_span_kernel
from manylora.lora.store import AdapterStore, plan_waves
from manylora.post import CompactRow, PostDecoder, compact_batch, compact_dense_begin, needs_raw_logits, skipped_tasks
from manylora.pre import CHARS_PER_TOKEN_BOUND, Prepared, Preprocessor

__all__ = [
    "CHARS_PER_TOKEN_BOUND",
    "INTERNAL",
    "INVALID_ARG",
    "NOT_FOUND",
    "UNAVAILABLE",
    "Engine",
    "Prepared",
    "Request",
    "RequestError",
    "freeze_long_lived",
    "load_gliner2",
    "load_gliner2_skeleton",
]

logger = logging.getLogger(__name__)

PAD_MULTIPLE = 16

Result = Union[dict, RequestError]


class CoreRequest(NamedTuple):
    """What the GPU stage knows of a row's request (``Prepared.request`` there): a full
    ``Request`` would re-validate the schema per row for nothing (the front did)."""

    adapter: str
    schema: str
    threshold: float


CoreResult = Union[CompactRow, RequestError]


def freeze_long_lived() -> None:
    """Move every object alive now out of the garbage collector's generations.

    An engine's model, tokenizer and preloaded adapters are ~650k long-lived objects that every
    full collection would walk again: a pause of 100+ ms in the middle of a batch. A process
    that keeps one engine for its lifetime (a model instance, a benchmark) calls this once after
    building it. Frozen objects are never collected, so an engine dropped later would stay in
    memory: not for processes that build and drop engines.
    """
    gc.collect()
    gc.freeze()


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def check_static_memory(memory: dict, config: EngineConfig, device: str) -> None:
    """Raise ConfigError, with the numbers, when weights + adapter slots exceed the cap."""
    from manylora.config import ConfigError

    weights, slots, cap = memory["weights"], memory["adapter_slots"], memory["cap"]
    before = memory.get("before", 0)  # what this process held on the device already
    if before + weights + slots > cap:
        held = f"{_gib(before)} already allocated in this process + " if before else ""
        raise ConfigError(
            f"the GPU stage does not fit {device}: {held}weights {_gib(weights)} + {config.max_gpu_adapters} adapter "
            f"slots of rank {config.max_lora_rank} {_gib(slots)} = {_gib(before + weights + slots)}, above its cap "
            f"{_gib(cap)} (gpu_memory_fraction {config.gpu_memory_fraction} of {_gib(memory['total'])}); lower "
            "max_gpu_adapters or max_lora_rank, or raise gpu_memory_fraction"
        )


def load_gliner2(checkpoint, device: str, dtype: torch.dtype):
    """GLiNER2 from a local checkpoint directory, on ``device`` in ``dtype``, eval mode."""
    from gliner2 import GLiNER2

    model = GLiNER2.from_pretrained(str(checkpoint))
    model.eval()
    model.processor.change_mode(is_training=False)
    return model.to(device=device, dtype=dtype)


def load_gliner2_skeleton(checkpoint):
    """GLiNER2 from a local checkpoint directory with every tensor on the meta device: its
    processor (tokenizer, schema handling) and decoding settings, none of its weights.

    What a CPU front needs (pre and post). Measured on a 2-core CPU host with the base-size
    demo checkpoint: 0.2 s and a peak RSS of 454 MB per process, against 1.4 s and 1,344 MB
    with ``load_gliner2`` (perf/README.md, session 15)."""
    import warnings

    from gliner2 import GLiNER2

    with warnings.catch_warnings(), torch.device("meta"):
        # the checkpoint's tensors are read and dropped: "copying ... to a meta parameter ... is a no-op"
        warnings.filterwarnings("ignore", message=".*meta parameter.*")
        model = GLiNER2.from_pretrained(str(checkpoint))
    model.eval()
    model.processor.change_mode(is_training=False)
    return model


class Engine:
    """One GLiNER2 checkpoint served with our encoder; see the module docstring."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        if self.device.type == "cuda":  # the cap first: every allocation below counts against it
            torch.cuda.set_per_process_memory_fraction(config.gpu_memory_fraction, self.device)
        model = load_gliner2(config.checkpoint, "cpu", torch.float32)
        encoder = Encoder(model.encoder)
        # The heads stay GLiNER2's modules (wrapped for per-row LoRA); its transformers
        # backbone is not needed.
        model.encoder = None
        self.heads = HeadLoras(model)
        self.heads.span_kernel = config.fused_span_scores and config.backend == "triton"
        shapes = {n: (m.in_features, m.out_features) for n, m in encoder.linears().items()}
        shapes.update(self.heads.shapes())
        self.memory: dict = {}  # the GPU stage's memory statement (bytes), filled on CUDA
        if self.device.type == "cuda":
            weights = sum(p.numel() for m in (encoder, model) for p in m.parameters())
            self.memory = self._check_static_memory(weights, shapes)
        self.encoder = encoder.to(device=self.device, dtype=self.dtype).eval()
        self.encoder.backend = config.backend
        self.encoder.fused_attention = config.fused_attention and config.backend == "triton"
        self.encoder.lora_fuse_epilogue = config.fused_lora_epilogue
        self.encoder.lora_skip_padding = config.lora_skip_padding
        self.model = model.to(device=self.device, dtype=self.dtype)
        if self.heads.span_kernel:  # an opt-in kernel: on a GPU it has not met, refuse rather than misanswer
            problem = check_span_kernel(self.model)
            if problem:
                from manylora.config import ConfigError

                raise ConfigError(f"parameter 'fused_span_scores': {problem} on {self.device}; set it 'off'")
        if self.encoder.fused_attention:  # the same for the attention kernel
            problem = check_fused_attention(self.encoder.geometry, self.device, self.dtype)
            if problem:
                from manylora.config import ConfigError

                raise ConfigError(f"parameter 'fused_attention': {problem} on {self.device}; set it 'off'")
        self.processor = model.processor
        self.pre = Preprocessor(model, config.max_request_tokens)
        self.records = self.pre.records
        self.post = PostDecoder.from_model(model)
        # (distinct adapters, waves) per dynamic batch, drained by the metrics publisher
        self.batch_stats: deque[tuple[int, int]] = deque(maxlen=4096)
        # (rows, seconds, each job's seconds in the queue) per GPU-stage call of the overlapped
        # gliner2_core (serving.CoreModelHandler), drained by the metrics publisher
        self.call_stats: deque[tuple[int, float, list]] = deque(maxlen=4096)
        # cumulative seconds of the GPU stage's host steps, published as
        # manylora_core_phase_seconds_total: each row's record from its ids (prepare); per chunk,
        # A (padding, copies, the forward queued: forward), B (the heads up to the hits' mask:
        # heads) and C (the hits' nonzero, the copy, the compact rows: finish), each also as
        # "<phase>_cpu", the thread's CPU (wall well above it: waits for the interpreter lock or a
        # blocking call; CUDA's spin-waits count as CPU). serving.CoreModelHandler adds its threads'
        # phases (parse, idle, publish, answer_pack, answer_send, gpu_thread_cpu, answer_thread_cpu)
        self.phase_seconds: defaultdict[str, float] = defaultdict(float)
        self.store = AdapterStore(
            config.adapter_dir,
            shapes,
            max_rank=config.max_lora_rank,
            gpu_slots=config.max_gpu_adapters,
            host_slots=config.max_cpu_adapters,
            device=self.device,
            dtype=self.dtype,
            load_timeout=config.adapter_load_timeout,
        )
        self.encoder_targets = set(self.encoder.linears())
        self.head_names = frozenset(self.heads.linears)
        self.heads.store = self.store
        if config.preload_adapters:
            names = None if config.preload_adapters == "all" else config.preload_adapters.split(",")
            started = time.perf_counter()
            loaded = self.store.preload(None if names is None else [n.strip() for n in names])
            logger.info("preloaded %d adapters in %.1f s", len(loaded), time.perf_counter() - started)
        self.meta_builder = SgmvMetaBuilder(config.max_batch_tokens, self.device)
        # step C of the chunk pipeline (_core_begin) runs here on CUDA
        self._compact_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.graphs = None  # CUDA graphs of the encoder forward (manylora.graphs), on CUDA with cuda_graphs on
        if self.device.type == "cuda" and config.cuda_graphs and config.backend == "triton":
            from manylora.graphs import EncoderGraphs

            max_tokens = min(config.max_batch_tokens, config.cuda_graph_max_tokens)
            self.graphs = EncoderGraphs(self.encoder, self.store, max_tokens)
        if self.device.type == "cuda" and config.cuda_graph_heads:
            from manylora.lora.head_graphs import HeadGraphs

            self.heads.graphs = HeadGraphs(self.heads, self.encoder.geometry.hidden_size, self.dtype, self.device)
            self.memory["head_graph_inputs"] = self.heads.graphs.bytes
        # True: the heads run GLiNER2's per-row list layout (compact_batch) for every chunk, as
        # they do anyway for attribute groups; False: the dense batch layout (tests compare them)
        self.list_heads = False
        if self.device.type == "cuda":
            self._probe_activations()
        if self.graphs is not None and config.cuda_graph_warmup_rows:
            self._warm_graphs(config.cuda_graph_warmup_rows)

    # ------------------------------------------------------------------ memory
    def _check_static_memory(self, parameters: int, shapes: dict) -> dict:
        """Weights and adapter slots against the allocator cap, before either is allocated:
        a configuration that cannot hold them refuses to load, with the numbers."""
        from manylora.lora.store import slot_bytes

        config = self.config
        total = torch.cuda.get_device_properties(self.device).total_memory
        memory = {
            "total": total,
            "cap": int(total * config.gpu_memory_fraction),
            "weights": parameters * torch.empty(0, dtype=self.dtype).element_size(),
            "adapter_slots": slot_bytes(shapes, config.max_lora_rank, self.dtype) * config.max_gpu_adapters,
            "before": torch.cuda.memory_allocated(self.device),
        }
        check_static_memory(memory, config, str(self.device))
        return memory

    def probe(self) -> None:
        """One token budget's worth of base rows through the whole GPU stage, in the two
        extreme shapes the limits allow (many short rows; the longest rows), chunked as
        ``_core`` chunks them but without its split-on-out-of-memory. Raises what they raise."""
        config = self.config
        schema = '{"entities": ["person", "organization", "location", "date"]}'
        shapes = [  # (rows, words)
            (max(1, config.max_batch_tokens // 256), 200),
            (max(1, config.max_batch_tokens // config.max_request_tokens), config.max_request_tokens),
        ]
        for rows, words in shapes:
            while True:  # the longest text of `words` words or fewer within max_request_tokens
                try:
                    p = self.pre.prepare(0, Request(" ".join(["word"] * words), schema))
                    break
                except RequestError:
                    words = words * 3 // 4
            record, metadata = self.pre.core_record(p.record.input_ids, p.record.text_word_first_positions, schema)
            request = CoreRequest("", schema, p.t_min)
            prepared = [
                Prepared(i, request, record, metadata, len(record.input_ids), None, p.t_min) for i in range(rows)
            ]
            with torch.inference_mode():
                for chunk in self._chunks(prepared):
                    self.compact(chunk, *self.forward(chunk))

    def _probe_activations(self) -> None:
        """``probe`` at load on the GPU (it also compiles the kernels): its activation peak
        joins the memory statement, and a token budget whose activations do not fit under the
        cap refuses to load, with the numbers. Any other failure of the probe is logged only."""
        from manylora.config import ConfigError

        config, memory = self.config, self.memory
        torch.cuda.synchronize(self.device)
        resident = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        try:
            self.probe()
            torch.cuda.synchronize(self.device)
        except torch.cuda.OutOfMemoryError as exc:
            raise ConfigError(
                f"the GPU stage does not fit {self.device}: weights {_gib(memory['weights'])} and adapter slots "
                f"{_gib(memory['adapter_slots'])} leave {_gib(memory['cap'] - resident)} under the cap "
                f"{_gib(memory['cap'])} (gpu_memory_fraction {config.gpu_memory_fraction}), and one batch of "
                f"max_batch_tokens {config.max_batch_tokens} did not run in it ({type(exc).__name__}); lower "
                "max_batch_tokens or max_gpu_adapters, or raise gpu_memory_fraction"
            ) from None
        except Exception:
            logger.exception("the GPU memory probe failed; the memory statement has no activation figure")
            return
        finally:
            torch.cuda.empty_cache()
        memory["activations"] = torch.cuda.max_memory_allocated(self.device) - resident
        logger.info(
            "GPU memory of %s: weights %s, %d adapter slots %s, heads' graph inputs %s, activations of one token "
            "budget %s; cap %s of %s",
            self.device,
            _gib(memory["weights"]),
            config.max_gpu_adapters,
            _gib(memory["adapter_slots"]),
            _gib(memory.get("head_graph_inputs", 0)),
            _gib(memory["activations"]),
            _gib(memory["cap"]),
            _gib(memory["total"]),
        )

    def _warm_graphs(self, max_rows: int) -> None:
        """Capture the small shapes' CUDA graphs at load, for base rows and for each (module set,
        rank) of the adapters in host memory now (the preloaded ones); their pool joins the
        memory statement."""
        variants = {(frozenset(), 0)}
        for adapter in self.store.host_adapters():
            targets = frozenset(adapter.modules) & self.encoder_targets
            if targets:
                variants.add((targets, adapter.rank))
        torch.cuda.synchronize(self.device)
        before, started = torch.cuda.memory_allocated(self.device), time.perf_counter()
        with torch.inference_mode():
            count = self.graphs.warm(sorted(variants, key=lambda v: (len(v[0]), v[1])), max_rows)
        torch.cuda.synchronize(self.device)
        self.memory["cuda_graphs"] = torch.cuda.memory_allocated(self.device) - before
        logger.info(
            "captured %d CUDA graphs (batches of up to %d rows, %d variants) in %.1f s, %s",
            count,
            max_rows,
            len(variants),
            time.perf_counter() - started,
            _gib(self.memory["cuda_graphs"]),
        )

    # ------------------------------------------------------------------ pre
    def _adapter(self, adapter_id: str, found: Optional[dict]):
        """The adapter of ``adapter_id`` (None for the base model); ``found``: this batch's
        lookups by id (filled here), so a batch checks each folder once."""
        if not adapter_id:
            return None
        adapter = None if found is None else found.get(adapter_id)
        if adapter is None:
            try:
                adapter = self.store.get(adapter_id)
            except AdapterError as exc:
                raise RequestError(exc.code, exc.message) from None
            if found is not None:
                found[adapter_id] = adapter
        return adapter

    def prepare(self, index: int, request: Request, found: Optional[dict] = None) -> Prepared:
        """Validate and tokenize one request, and look its adapter up; raises RequestError."""
        self.pre.check_text(request.text)
        adapter = self._adapter(request.adapter, found)
        prepared = self.pre.prepare(index, request, text_checked=True)
        prepared.adapter = adapter
        return prepared

    def _chunks(self, group: Sequence[Prepared]) -> list[list[Prepared]]:
        """Waves of at most ``max_gpu_adapters`` distinct adapters, each split so that
        rows x padded length stays within the token budget."""
        waves = plan_waves((p.request.adapter for p in group), self.config.max_gpu_adapters)
        if len(waves) == 1:
            return self._budget_chunks(group)
        base = [p for p in group if not p.request.adapter]
        chunks = []
        for i, wave in enumerate(waves):
            members = [p for p in group if p.request.adapter in wave] + (base if i == 0 else [])
            chunks.extend(self._budget_chunks(members))
        return chunks

    def _budget_chunks(self, group: Sequence[Prepared]) -> list[list[Prepared]]:
        """Cut the group (sorted by length) into chunks of rows x padded length <= the token
        budget, at the cheapest cut points: a chunk costs its padded tokens (a CUDA graph's
        padded shape where one runs it) plus a fixed ``chunk_cost_tokens`` (its launches and
        decoding), so one long text is cut away from 255 short ones, but 16 slightly longer
        ones stay with the other 240."""
        items = sorted(group, key=lambda p: p.num_tokens)
        padded = [-(-p.num_tokens // PAD_MULTIPLE) * PAD_MULTIPLE for p in items]
        n = len(items)
        # candidate cut points: where the padded length changes (and the end)
        cuts = [k for k in range(1, n) if padded[k] != padded[k - 1]] + [n]
        best = {0: (0, None)}  # items covered -> (cost, previous cut)
        for j in cuts:
            best[j] = min((cost + self._pieces(j - i, padded[j - 1])[0], i) for i, (cost, _) in best.items())
        bounds, j = [], n
        while j:
            i = best[j][1]
            bounds.append((i, j))
            j = i
        chunks = []
        for i, j in reversed(bounds):  # pieces of `size` rows and the rest
            size = self._pieces(j - i, padded[j - 1])[1]
            chunks.extend(items[k : min(k + size, j)] for k in range(i, j, size))
        return chunks

    def _pieces(self, rows: int, length: int) -> tuple[int, int]:
        """How ``rows`` rows of padded ``length`` are cut to fit the token budget: (cost, piece
        size), in pieces of that many rows and the rest. Equal pieces of as many rows as fit;
        with CUDA graphs also full rows buckets, when that is as many pieces and fewer padded
        tokens (a graph pads its rows up to a bucket). Called for every pair of cut points, in the
        GPU thread: arithmetic per plan, no list per piece."""
        chunk_cost = self.config.chunk_cost(self.device.type)
        fit = max(1, self.config.max_batch_tokens // length)
        count = -(-rows // fit)
        sizes = [-(-rows // count)]
        if self.graphs is not None and count > 1:
            bucket = ROW_BUCKETS[bisect.bisect_right(ROW_BUCKETS, fit) - 1] if fit >= ROW_BUCKETS[0] else 0
            if bucket and -(-rows // bucket) == count:
                sizes.append(bucket)

        def tokens(r: int) -> int:
            return r * length if self.graphs is None else self.graphs.padded_tokens(r, length)

        def cost(size: int) -> int:
            full, rest = divmod(rows, size)
            pieces = full + bool(rest)
            return full * tokens(size) + (tokens(rest) if rest else 0) + pieces * chunk_cost

        return min((cost(size), size) for size in sizes)

    # ------------------------------------------------------------------ core
    def forward(self, chunk: list[Prepared]):
        """Order rows by GPU slot, pad, run the encoder once with every row's adapter.

        Reorders ``chunk`` in place; returns (batch, padded encoder states [B, L', H], slot per row).
        """
        slots = self.store.acquire(p.adapter for p in chunk if p.adapter is not None)
        chunk.sort(key=lambda p: slots[p.adapter.name] if p.adapter is not None else -1)
        slot_per_row = [slots[p.adapter.name] if p.adapter is not None else -1 for p in chunk]
        batch = self.records.pad_batch([p.record for p in chunk])
        batch = batch_to_device(batch, self.device)  # integer and boolean tensors: no dtype cast
        # pad the length to a multiple of 16: fewer distinct GEMM/attention shapes, aligned tiles
        pad = -batch.input_ids.shape[1] % PAD_MULTIPLE
        input_ids = torch.nn.functional.pad(batch.input_ids, (0, pad))
        attention_mask = torch.nn.functional.pad(batch.attention_mask, (0, pad))
        lora = None
        # the union of the chunk's distinct module sets (one or a few layouts), not of every
        # adapter's 72 module names in turn
        layouts = {p.adapter.module_names for p in chunk if p.adapter is not None}
        targets = frozenset().union(*layouts) & self.encoder_targets
        # each row's real tokens, when the LoRA tiles may leave the padding after them alone
        row_lens = [len(p.record.input_ids) for p in chunk] if self.encoder.skips_lora_padding(self.device) else None
        if self.graphs is not None:
            ranks = (self.store.owner(s).rank for s in set(slot_per_row) if s >= 0)
            rank = max(ranks, default=0)
            hidden = self.graphs.run(input_ids, attention_mask, slot_per_row, targets, rank, row_lens)
            if hidden is not None:
                return batch, hidden, slot_per_row
        if targets:
            if input_ids.numel() > self.meta_builder.max_tokens:  # one request above the budget
                self.meta_builder = SgmvMetaBuilder(input_ids.numel(), self.device)
            lora = LoraBatch(
                self.store,
                self.meta_builder,
                slot_per_row,
                input_ids.shape[1],
                targets,
                self.config.backend,
                self.encoder.lora_write_first,
                self.encoder.lora_fuse_epilogue,
                self.encoder.lora_group_shrinks,
                row_lens,
            )
        hidden = self.encoder(input_ids, attention_mask, lora)
        return batch, hidden, slot_per_row

    # ------------------------------------------------------------------ heads -> compact
    @torch.inference_mode()
    def compact(self, chunk: Sequence[Prepared], batch, states, slot_per_row: Sequence[int]) -> list[CompactRow]:
        """GLiNER2's heads on the whole chunk, each row with its own head LoRA, reduced to what
        decoding reads (``post.compact_batch``): one CompactRow per row of ``chunk``."""
        return self.compact_begin(chunk, batch, states, slot_per_row)()

    def compact_begin(self, chunk: Sequence[Prepared], batch, states, slot_per_row: Sequence[int]):
        """``compact`` up to its last wait for the GPU: returns ``finish() -> rows`` (for the dense
        layout, the hits' ``nonzero``, the copy to the host and the rows; see ``_core_begin``)."""
        head_names = self.head_names
        row_slots = [
            slot if p.adapter is not None and not head_names.isdisjoint(p.adapter.modules) else -1
            for p, slot in zip(chunk, slot_per_row)
        ]
        hidden = encode_padded(batch, states)
        logit_tasks = [needs_raw_logits(p.record, p.metadata or {}) for p in chunk]
        t_min = [p.t_min for p in chunk]
        if not self.list_heads and not any(any(row) for row in logit_tasks):
            schema_embs = self._schema_embeddings(batch, hidden)
            with self.heads.batch(batch, row_slots):
                logits, plan = self.heads.span_logits_dense(batch, hidden, t_min)
                cls_probs = self.heads.classification_probabilities(batch, schema_embs)
            skipped = skipped_tasks(batch.task_types, schema_embs)
            return compact_dense_begin(logits, plan, cls_probs, t_min, skipped, [len(t) for t in batch.task_types])
        token_embs, schema_embs = self.processor.extract_embeddings_from_batch(hidden, batch.input_ids, batch)
        with self.heads.batch(batch, row_slots):
            raw_logits, pred_counts = self.heads.span_logits(batch, token_embs, schema_embs)
            cls_probs = self.heads.classification_probabilities(batch, schema_embs)
        skipped = skipped_tasks(batch.task_types, schema_embs)
        rows = compact_batch(raw_logits, pred_counts, cls_probs, t_min, logit_tasks, skipped)
        return lambda: rows

    @staticmethod
    def _schema_embeddings(batch, hidden) -> list[list[list]]:
        """Each row's schema embeddings as GLiNER2's ``_extract_embeddings_fast`` lays them out,
        for what the dense path still reads of them: a view of ``hidden`` per special position
        of classification tasks; for span tasks only whether there are any (their positions).
        Measured (H200 server profile): a view per position of every row cost ~3 ms a chunk."""
        out = []
        for row, n in enumerate(batch.schema_counts):
            types = batch.task_types[row]
            out.append(
                [
                    [hidden[row, p] for p in positions] if types[task] == "classifications" else positions
                    for task, positions in enumerate(batch.schema_special_indices[row][:n])
                ]
            )
        return out

    # ------------------------------------------------------------------ post
    def decode(self, chunk: Sequence[Prepared], batch, states, slot_per_row: Sequence[int]) -> list[dict]:
        """Heads, compaction and our post decoder for a chunk: the GLiNER2 result of each row."""
        rows = self.compact(chunk, batch, states, slot_per_row)
        return [self._post(p, row) for p, row in zip(chunk, rows)]

    def _post(self, p: Prepared, row: CompactRow) -> dict:
        r = p.request
        return self.post.decode(row, p.record, p.metadata, r.threshold, r.include_confidence, r.include_spans)

    # ------------------------------------------------------------------ all
    @torch.inference_mode()
    def run(self, requests: Sequence[Request]) -> list[Result]:
        """pre -> core -> post in this process; one result or RequestError per request."""
        # disk -> host loads of this batch's new adapters start now, in parallel, on the loader threads
        self.store.prefetch(r.adapter for r in requests)
        results: list[Optional[Result]] = [None] * len(requests)
        prepared: list[Prepared] = []
        found: dict = {}
        for index, request in enumerate(requests):
            try:
                prepared.append(self.prepare(index, request, found))
            except RequestError as exc:
                results[index] = exc.with_traceback(None)  # a kept traceback would hold this frame: a cycle
            except Exception as exc:  # a bug must not fail the other requests of the batch
                logger.exception("request %d could not be prepared", index)
                results[index] = RequestError(INTERNAL, f"request could not be prepared: {type(exc).__name__}: {exc}")
        compact = self._core(prepared)
        for p, row in zip(prepared, compact):
            if isinstance(row, RequestError):
                results[p.index] = row
                continue
            try:
                results[p.index] = self._post(p, row)
            except Exception as exc:
                logger.exception("request %d could not be decoded", p.index)
                results[p.index] = RequestError(INTERNAL, f"decoding failed: {type(exc).__name__}: {exc}")
        assert all(r is not None for r in results), "every request is answered"
        return results  # type: ignore[return-value]

    def run_core(self, items: Sequence[tuple]) -> list[CoreResult]:
        """The GPU stage alone: ``items`` are (input_ids, word_positions, schema_json,
        adapter_id, t_min) as the front sends them; one CompactRow or RequestError each."""
        return self.core_begin(items)()

    @torch.inference_mode()
    def core_begin(self, items: Sequence[tuple], between: Optional[Callable[[], None]] = None):
        """``run_core`` but for its last chunk's host work: returns ``finish() -> results``.
        ``between`` (the previous call's ``finish``, say) runs once this call's first forward
        is queued, so the GPU has that forward to run while the host finishes the previous
        call (``_core_begin``). Nothing here raises for a bad item; ``finish`` never raises."""
        # checked before the prefetch: a load it starts may finish before a later check (a race
        # that a fresh-clone CI run hit), and the lookup below would have waited for it anyway
        cold = between is not None and not self.store.in_host({item[3] for item in items if item[3]})
        self.store.prefetch(item[3] for item in items)
        if cold:
            between()  # a lookup below may wait for a disk load: the last call's answers go first
            between = None
        results: list[Optional[CoreResult]] = [None] * len(items)
        prepared: list[Prepared] = []
        found: dict = {}
        started, cpu = time.perf_counter(), time.thread_time()
        for index, (input_ids, word_positions, schema_json, adapter_id, t_min) in enumerate(items):
            try:
                adapter = self._adapter(adapter_id, found)
                record, metadata = self.pre.core_record(input_ids, word_positions, schema_json)
                request = CoreRequest(adapter_id, schema_json, t_min)
                prepared.append(Prepared(index, request, record, metadata, len(record.input_ids), adapter, t_min))
            except RequestError as exc:
                results[index] = exc.with_traceback(None)
            except Exception as exc:
                logger.exception("core item %d could not be prepared", index)
                results[index] = RequestError(INTERNAL, f"request could not be prepared: {type(exc).__name__}: {exc}")
        self.phase_seconds["prepare"] += time.perf_counter() - started
        self.phase_seconds["prepare_cpu"] += time.thread_time() - cpu
        finish_core = self._core_begin(prepared, between)

        def finish() -> list[CoreResult]:
            for p, row in zip(prepared, finish_core()):
                results[p.index] = row
            return results  # type: ignore[return-value]

        return finish

    def _core(self, prepared: list[Prepared]) -> list[CoreResult]:
        """CompactRow (or RequestError) per prepared row, in the order given. Every row of one
        call can share a forward, whatever its decoding options: thresholds are per row."""
        return self._core_begin(prepared)()

    def _core_begin(self, prepared: list[Prepared], between: Optional[Callable[[], None]] = None):
        """The chunks of ``prepared`` as a pipeline of three steps per chunk: (A) pad, copy and
        queue the encoder forward; (B) the heads, up to the mask of hits (B waits for the
        count head); (C) the hits' ``nonzero``, the copy to the host and the rows. Steps run in
        the order A0 B0 A1 C0 B1 A2 C1 ...: chunk k's host work (C) runs while the GPU runs
        chunk k+1's forward, and on CUDA C runs on a side stream that waits only for chunk k
        (the default stream already holds the next forward). Returns ``finish`` (the last C).

        Measured (H200, perf/profile_core.py, 1,024 rows): in turn (f2e9a36), the GPU was busy
        62% of ``run_core`` with 1,024 adapters, 70% without; pipelined (c0eec8d, on/off
        alternating on one engine), 1.10x the rows per second in both.

        A chunk whose step raises is answered by ``_recover`` (in halves on out of memory, else
        row by row, each without the pipeline), as before the pipeline."""
        out: dict[int, CoreResult] = {}
        pending = None  # (chunk, finish, event) of the chunk whose step C is due
        if prepared:
            chunks = self._chunks(prepared)
            adapters = {p.request.adapter for p in prepared if p.request.adapter}
            self.batch_stats.append((len(adapters), len(plan_waves(adapters, self.config.max_gpu_adapters))))
            for chunk in chunks if not self.config.chunk_pipeline else ():  # the A/B's other arm
                self._run_chunk(chunk, out)
            for chunk in chunks if self.config.chunk_pipeline else ():
                failed = None
                try:
                    launched = self._timed("forward", self.forward, chunk)  # A
                except Exception as exc:
                    launched, failed = None, exc
                if pending is not None:
                    self._timed("finish", self._finish_chunk, pending, out)  # C of the chunk before
                elif between is not None:
                    between()
                    between = None
                pending = None
                if failed is not None:
                    # answered without the pipeline only now, after the step C above: a rerun replays
                    # the heads' CUDA graphs, whose outputs that C reads (lora.head_graphs)
                    self._recover(chunk, out, failed)
                    failed = None  # its traceback holds this frame
                elif launched is not None:
                    pending = self._timed("heads", self._step, self._heads_chunk, chunk, out, launched)  # B
                launched = None  # chunk k's states are not kept through chunk k+1's forward

        def finish() -> list[CoreResult]:
            with torch.inference_mode():
                if between is not None:
                    between()
                if pending is not None:
                    self._timed("finish", self._finish_chunk, pending, out)
            return [out[id(p)] for p in prepared]

        return finish

    def _timed(self, phase: str, fn, *args):
        """``fn(*args)``, its wall and CPU time added to ``phase_seconds[phase]`` / ``[phase_cpu]``."""
        started, cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(*args)
        finally:
            self.phase_seconds[phase] += time.perf_counter() - started
            self.phase_seconds[f"{phase}_cpu"] += time.thread_time() - cpu

    def _step(self, step, chunk: list[Prepared], out: dict, *args):
        """``step(chunk, *args)``; should it raise, the chunk is answered by ``_recover`` and None is returned."""
        try:
            return step(chunk, *args)
        except Exception as exc:
            self._recover(chunk, out, exc)
            return None

    def _heads_chunk(self, chunk: list[Prepared], launched) -> tuple:
        batch, states, slot_per_row = launched
        finish = self.compact_begin(chunk, batch, states, self._repin(chunk, slot_per_row))
        event = torch.cuda.current_stream(self.device).record_event() if self._compact_stream is not None else None
        return chunk, finish, event

    def _repin(self, chunk: list[Prepared], slot_per_row: list[int]) -> list[int]:
        """The slots the chunk's heads read. Those of its forward, unless another ``acquire``
        came between the chunk's steps A and B (a failed chunk run again alone, or the last
        call's, in step C or ``between``) and may have given them to other adapters: then
        the chunk's adapters are acquired again (reloaded if evicted; the encoder forward,
        already queued, read its slots before any copy over them, see AdapterStore)."""
        rows = [(p.adapter, s) for p, s in zip(chunk, slot_per_row) if p.adapter is not None]
        if not rows or self.store.pinned(*zip(*rows)):
            return slot_per_row
        slots = self.store.acquire(a for a, _ in rows)
        return [slots[p.adapter.name] if p.adapter is not None else -1 for p in chunk]

    def _finish_chunk(self, pending: tuple, out: dict) -> None:
        chunk, finish, event = pending
        try:
            if self._compact_stream is None:
                rows = finish()
            else:  # waits for this chunk's heads only, not for the forward queued since
                self._compact_stream.wait_event(event)
                with torch.cuda.stream(self._compact_stream):
                    rows = finish()
            for p, row in zip(chunk, rows):
                out[id(p)] = row
        except Exception as exc:
            if self._compact_stream is not None:  # its queued kernels still read this chunk's tensors
                self._compact_stream.synchronize()
            self._recover(chunk, out, exc)

    def _run_chunk(self, chunk: list[Prepared], out: dict) -> None:
        """One chunk, every step in turn (no pipeline): the path of a chunk that failed in it."""
        try:
            batch, states, slot_per_row = self.forward(chunk)
            for p, row in zip(chunk, self.compact(chunk, batch, states, slot_per_row)):
                out[id(p)] = row
        except Exception as exc:
            self._recover(chunk, out, exc)

    def _recover(self, chunk: list[Prepared], out: dict, exc: Exception) -> None:
        """Answer ``chunk`` after ``exc``: out of memory, in halves; otherwise row by row, so
        that only a failing row fails (INTERNAL)."""
        if isinstance(exc, torch.cuda.OutOfMemoryError):
            if len(chunk) == 1:
                out[id(chunk[0])] = RequestError(
                    UNAVAILABLE, "out of GPU memory for this single request; retry later or send a shorter text"
                )
                return
            torch.cuda.empty_cache()
            half = len(chunk) // 2
            logger.warning("out of GPU memory on a batch of %d; splitting it", len(chunk))
            self._run_chunk(chunk[:half], out)
            self._run_chunk(chunk[half:], out)
        elif len(chunk) > 1:
            # isolate the failing request: the others are still answered
            logger.warning("batch of %d failed (%s); retrying one by one", len(chunk), exc)
            for p in chunk:
                self._run_chunk([p], out)
        else:
            logger.error("request %d failed", chunk[0].index, exc_info=exc)
            out[id(chunk[0])] = RequestError(INTERNAL, f"inference failed: {type(exc).__name__}: {exc}")
