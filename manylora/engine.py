"""Engine: requests in, GLiNER2 results out, every request succeeding or failing alone.

The work is split the way serving engines split it, each part testable alone:

* ``prepare`` (pre): validate one request, parse its schema (cached per schema text),
  build GLiNER2's record for it (``RecordBuilder``: the schema half once per schema).
* ``forward`` (core): order a chunk's rows by adapter slot, pad, run our encoder once,
  every row with its own adapter's LoRA (SGMV) and position tables.
* ``decode`` (post): GLiNER2's heads and decoders on the encoder output, with our span-logit
  batching routing each row's head LoRA (``HeadLoras``), then GLiNER2's result formatting.

GLiNER2 itself is the reference: an answer equals ``GLiNER2.batch_extract`` (with PEFT and
that request's adapter) for the same text, schema and options; tests check that directly.
"""

from __future__ import annotations

import gc
import json
import logging
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Optional, Sequence, Union

import torch

from manylora.client.protocol import Request  # the wire contract's validated request
from manylora.config import EngineConfig
from manylora.decode import bind_fast_decoding
from manylora.encoder import Encoder
from manylora.kernels import SgmvMetaBuilder
from manylora.lora.adapter import AdapterError, LoraAdapter
from manylora.lora.batch import LoraBatch
from manylora.lora.heads import HeadLoras
from manylora.lora.store import AdapterStore, plan_waves
from manylora.preprocess import RecordBuilder

logger = logging.getLogger(__name__)

# Triton error codes used by the serving layer (pb_utils.TritonError.<CODE>); Triton has no
# RESOURCE_EXHAUSTED: running out of memory is UNAVAILABLE (retry later, or smaller)
INVALID_ARG = "INVALID_ARG"
NOT_FOUND = "NOT_FOUND"
UNAVAILABLE = "UNAVAILABLE"
INTERNAL = "INTERNAL"
PAD_MULTIPLE = 16
# what one more chunk costs, in padded tokens: its ~300 kernel launches and GLiNER2's per-batch
# decoding (~20-30 ms of host time per chunk) against ~0.7 us of GPU time per token, both read
# off the H200 profiles in perf/h200-2026-11-29/session3/profile-lora.txt; an estimate, not tuned
CHUNK_COST_TOKENS = 32768
CHARS_PER_TOKEN_BOUND = 32  # a text this many characters per allowed token is refused untokenized


class RequestError(Exception):
    """A per-request failure with the Triton error code it maps to."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return f"RequestError({self.code}, {self.message!r})"


@dataclass
class Prepared:
    index: int
    request: Request
    record: Any  # gliner2.processor.TransformedRecord
    metadata: dict
    num_tokens: int
    adapter: Optional[LoraAdapter] = None

    @property
    def options(self) -> tuple:
        r = self.request
        return (r.threshold, r.include_confidence, r.include_spans)


Result = Union[dict, RequestError]


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


def load_gliner2(checkpoint, device: str, dtype: torch.dtype):
    """GLiNER2 from a local checkpoint directory, on ``device`` in ``dtype``, eval mode."""
    from gliner2 import GLiNER2

    model = GLiNER2.from_pretrained(str(checkpoint))
    model.eval()
    model.processor.change_mode(is_training=False)
    return model.to(device=device, dtype=dtype)


class Engine:
    """One GLiNER2 checkpoint served with our encoder; see the module docstring."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        model = load_gliner2(config.checkpoint, "cpu", torch.float32)
        self.encoder = Encoder(model.encoder).to(device=self.device, dtype=self.dtype).eval()
        self.encoder.backend = config.backend
        # The heads and decoders stay GLiNER2's; the transformers backbone is not needed.
        model.encoder = None
        self.heads = HeadLoras(model)
        self.model = model.to(device=self.device, dtype=self.dtype)
        self.processor = model.processor
        self.records = RecordBuilder(self.processor)
        # (distinct adapters, waves) per dynamic batch, drained by the metrics publisher
        self.batch_stats: deque[tuple[int, int]] = deque(maxlen=4096)
        shapes = {n: (m.in_features, m.out_features) for n, m in self.encoder.linears().items()}
        shapes.update(self.heads.shapes())
        self.store = AdapterStore(
            config.adapter_dir,
            shapes,
            max_rank=config.max_lora_rank,
            gpu_slots=config.max_gpu_adapters,
            host_slots=config.max_cpu_adapters,
            device=self.device,
            dtype=self.dtype,
        )
        self.encoder_targets = set(self.encoder.linears())
        self.head_names = frozenset(self.heads.linears)
        self.heads.bind(self.store)
        self.span_finder = bind_fast_decoding(self.model)
        if config.preload_adapters:
            names = None if config.preload_adapters == "all" else config.preload_adapters.split(",")
            started = time.perf_counter()
            loaded = self.store.preload(None if names is None else [n.strip() for n in names])
            logger.info("preloaded %d adapters in %.1f s", len(loaded), time.perf_counter() - started)
        self.meta_builder = SgmvMetaBuilder(config.max_batch_tokens, self.device)
        self._parse_schema = lru_cache(maxsize=4096)(self._parse_schema_uncached)

    # ------------------------------------------------------------------ pre
    def _parse_schema_uncached(self, schema_json: str):
        """(schema part of the record, GLiNER2's decoding metadata) for one SCHEMA text."""
        from gliner2.inference.schema import Schema
        from pydantic import ValidationError

        try:
            data = json.loads(schema_json)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
            raise RequestError(INVALID_ARG, f"SCHEMA is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise RequestError(INVALID_ARG, f"SCHEMA must be a JSON object, got {type(data).__name__}")
        try:
            schema = Schema.from_dict(data)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'schema'}: {e['msg']}" for e in exc.errors())
            raise RequestError(INVALID_ARG, f"SCHEMA is not a valid GLiNER2 schema: {problems}") from None
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
            raise RequestError(INVALID_ARG, f"SCHEMA is not a valid GLiNER2 schema: {exc}") from None
        (schema_dict,), (metadata,) = self.model._build_schema_dicts_and_metadata([schema])
        try:
            part = self.records.schema_part(schema_dict)
        except Exception as exc:  # gliner2 raises plain exceptions for schemas it cannot encode
            raise RequestError(INVALID_ARG, f"SCHEMA could not be encoded: {exc}") from None
        return part, metadata

    def prepare(self, index: int, request: Request, found: Optional[dict] = None) -> Prepared:
        """Validate and tokenize one request; raises RequestError. ``found``: the adapters this
        batch has already looked up, by id (filled here), so a batch checks each folder once."""
        if not isinstance(request.text, str) or not request.text.strip():
            raise RequestError(INVALID_ARG, "TEXT is empty")
        limit = self.config.max_request_tokens
        if len(request.text) > CHARS_PER_TOKEN_BOUND * limit:  # refuse before paying for tokenization
            raise RequestError(
                INVALID_ARG,
                f"TEXT has {len(request.text)} characters, far above the limit of "
                f"{limit} tokens (max_request_tokens); split it into chunks",
            )
        adapter = None
        if request.adapter:
            adapter = None if found is None else found.get(request.adapter)
            if adapter is None:
                try:
                    adapter = self.store.get(request.adapter)
                except AdapterError as exc:
                    raise RequestError(exc.code, exc.message) from None
                if found is not None:
                    found[request.adapter] = adapter
        part, metadata = self._parse_schema(request.schema)
        try:
            record = self.records.record(request.text, part)
        except Exception as exc:  # gliner2 raises plain exceptions for unencodable records
            raise RequestError(INVALID_ARG, f"text and schema could not be encoded: {exc}") from None
        if len(record.input_ids) > limit:
            raise RequestError(
                INVALID_ARG,
                f"text and schema are {len(record.input_ids)} tokens, above the limit of "
                f"{limit} (max_request_tokens); split the text into chunks",
            )
        return Prepared(index, request, record, metadata, len(record.input_ids), adapter)

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
        budget, at the cheapest cut points: a chunk costs its padded tokens plus a fixed
        CHUNK_COST_TOKENS (its launches and decoding), so one long text is cut away from 255
        short ones, but 16 slightly longer ones stay with the other 240."""
        budget = self.config.max_batch_tokens
        items = sorted(group, key=lambda p: p.num_tokens)
        padded = [-(-p.num_tokens // PAD_MULTIPLE) * PAD_MULTIPLE for p in items]
        n = len(items)
        # candidate cut points: where the padded length changes (and the end)
        cuts = [k for k in range(1, n) if padded[k] != padded[k - 1]] + [n]
        best = {0: (0, None)}  # items covered -> (cost, previous cut)
        for j in cuts:
            rows_fit = max(1, budget // padded[j - 1])
            best[j] = min(
                (cost + -(-(j - i) // rows_fit) * CHUNK_COST_TOKENS + (j - i) * padded[j - 1], i)
                for i, (cost, _) in best.items()
            )
        bounds, j = [], n
        while j:
            i = best[j][1]
            bounds.append((i, j))
            j = i
        chunks = []
        for i, j in reversed(bounds):  # over the budget: equal pieces of as many rows as fit
            rows_fit = max(1, budget // padded[j - 1])
            pieces = -(-(j - i) // rows_fit)
            size = -(-(j - i) // pieces)
            chunks.extend(items[k : min(k + size, j)] for k in range(i, j, size))
        return chunks

    # ------------------------------------------------------------------ core
    def forward(self, chunk: list[Prepared]):
        """Order rows by GPU slot, pad, run the encoder once with every row's adapter.

        Reorders ``chunk`` in place; returns (batch, padded encoder states [B, L', H], slot per row).
        """
        slots = self.store.acquire(p.adapter for p in chunk if p.adapter is not None)
        chunk.sort(key=lambda p: slots[p.adapter.name] if p.adapter is not None else -1)
        slot_per_row = [slots[p.adapter.name] if p.adapter is not None else -1 for p in chunk]
        batch = self.records.pad_batch([p.record for p in chunk])
        batch = batch.to(self.device, self.dtype if self.dtype != torch.float32 else None)
        # pad the length to a multiple of 16: fewer distinct GEMM/attention shapes, aligned tiles
        pad = -batch.input_ids.shape[1] % PAD_MULTIPLE
        input_ids = torch.nn.functional.pad(batch.input_ids, (0, pad))
        attention_mask = torch.nn.functional.pad(batch.attention_mask, (0, pad))
        lora = None
        distinct = {id(p.adapter): p.adapter for p in chunk if p.adapter is not None}.values()
        targets = {name for adapter in distinct for name in adapter.modules}
        targets &= self.encoder_targets
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
            )
        hidden = self.encoder(input_ids, attention_mask, lora)
        return batch, hidden, slot_per_row

    # ------------------------------------------------------------------ post
    def decode(self, chunk: Sequence[Prepared], batch, states, slot_per_row: Sequence[int]) -> list[dict]:
        """GLiNER2's heads and decoders for the whole chunk; each row's head LoRA applies to it."""
        head_names = self.head_names
        row_slots = [
            slot if p.adapter is not None and not head_names.isdisjoint(p.adapter.modules) else -1
            for p, slot in zip(chunk, slot_per_row)
        ]
        with self.heads.batch(batch, row_slots):
            try:
                return self._decode_rows(chunk, batch, states)
            finally:
                self.span_finder.clear()

    def _decode_rows(self, chunk: Sequence[Prepared], batch, states) -> list[dict]:
        threshold, include_confidence, include_spans = chunk[0].options
        metadata = [p.metadata for p in chunk]
        raw = self.model._extract_from_batch(
            batch, threshold, metadata, include_confidence, include_spans, hidden_states=states
        )
        return [
            self.model.format_results(
                result, include_confidence, meta.get("relation_order", []), meta.get("classification_tasks", [])
            )
            for result, meta in zip(raw, metadata)
        ]

    # ------------------------------------------------------------------ all
    @torch.inference_mode()
    def run(self, requests: Sequence[Request]) -> list[Result]:
        # disk -> host loads of this batch's new adapters start now, in parallel, on the loader threads
        self.store.prefetch(r.adapter for r in requests)
        results: list[Optional[Result]] = [None] * len(requests)
        groups: dict[tuple, list[Prepared]] = defaultdict(list)
        found: dict = {}
        for index, request in enumerate(requests):
            try:
                prepared = self.prepare(index, request, found)
            except RequestError as exc:
                results[index] = exc
                continue
            except Exception as exc:  # a bug must not fail the other requests of the batch
                logger.exception("request %d could not be prepared", index)
                results[index] = RequestError(INTERNAL, f"request could not be prepared: {type(exc).__name__}: {exc}")
                continue
            groups[prepared.options].append(prepared)
        for group in groups.values():
            chunks = self._chunks(group)
            adapters = {p.request.adapter for p in group if p.request.adapter}
            self.batch_stats.append((len(adapters), len(plan_waves(adapters, self.config.max_gpu_adapters))))
            for chunk in chunks:
                self._run_chunk(chunk, results)
        assert all(r is not None for r in results), "every request is answered"
        return results  # type: ignore[return-value]

    def _run_chunk(self, chunk: list[Prepared], results: list[Optional[Result]]) -> None:
        try:
            batch, states, slot_per_row = self.forward(chunk)
            for p, out in zip(chunk, self.decode(chunk, batch, states, slot_per_row)):
                results[p.index] = out
        except torch.cuda.OutOfMemoryError:
            if len(chunk) == 1:
                results[chunk[0].index] = RequestError(
                    UNAVAILABLE, "out of GPU memory for this single request; retry later or send a shorter text"
                )
                return
            torch.cuda.empty_cache()
            half = len(chunk) // 2
            logger.warning("out of GPU memory on a batch of %d; splitting it", len(chunk))
            self._run_chunk(chunk[:half], results)
            self._run_chunk(chunk[half:], results)
        except Exception as exc:
            if len(chunk) > 1:
                # isolate the failing request: the others are still answered
                logger.warning("batch of %d failed (%s); retrying one by one", len(chunk), exc)
                for p in chunk:
                    self._run_chunk([p], results)
                return
            logger.exception("request %d failed", chunk[0].index)
            results[chunk[0].index] = RequestError(INTERNAL, f"inference failed: {type(exc).__name__}: {exc}")
