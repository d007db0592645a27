"""ManyLoRAClient: GLiNER2's extraction API, answered by the ManyLoRA Triton model.

Every GLiNER2 2.1.0 method is here with GLiNER2's positional parameters and defaults,
plus keyword-only ``adapter=`` (and ``raise_on_error=`` on batch methods). Results are
what ``GLiNER2`` returns, after a JSON round trip (tuples arrive as lists). The ``*_long``
methods cut the text into windows client-side and merge the windows' answers as GLiNER2
does. Every text is sent, an empty one too: GLiNER2 extracts from an empty text (its
processor makes it ".": low thresholds find spans there, classifications score their labels).

Light on the hot path: schemas given as dicts or JSON, and the convenience methods
(``extract_entities`` & co., whose schemas this module builds as GLiNER2's builder
would), never import gliner2 or torch; only a ``gliner2.Schema`` passed in does.
``manylora.client.aio`` has the same API on asyncio.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import dataclasses
import functools
import json
import re
import sys
import time
import unicodedata
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from tritonclient.utils import InferenceServerException

from . import schemas as schema_lib
from .errors import ManyLoRAError, SchemaError, error_from_exception
from .protocol import BASE_ADAPTER, DEFAULT_THRESHOLD, MODEL_NAME, RESULT, Request, parse_result
from .transport import DEFAULT_URLS, make_transport

AdapterArg = str | Sequence[str | None] | None

DEFAULT_CONCURRENCY = 64


class _DefaultBatchSize(int):
    """GLiNER2's ``batch_size=8`` default, told apart from an explicit 8.

    GLiNER2's batch size is texts per encoder pass; here it is requests in flight, and the
    server's dynamic batcher forms the batches. Left at its default it means "the client's
    ``concurrency``", so that a default call keeps the batcher fed.
    """

    def __repr__(self) -> str:
        return "8"


DEFAULT_BATCH_SIZE = _DefaultBatchSize(8)
DEFAULT_CHUNK_SIZE = 384
DEFAULT_CHUNK_OVERLAP = 64


@dataclasses.dataclass
class _Plan:
    """What one GLiNER2-API call sends, and how its answers become the call's result.

    ``items`` holds a Request per server call. ``report`` gives, per item, the index a failure carries (None for single calls,
    the document for chunks of long ones).
    """

    items: list
    finish: Callable[[list], Any]
    window: int | None
    raise_on_error: bool
    report: list


class _GLiNER2Methods:
    """GLiNER2 2.1.0's extraction API: same names, positional parameters and defaults.

    Subclasses define ``_complete(plan)``: the sync client runs it and returns the result,
    the asyncio client returns a coroutine. Parameters that only mean something to a local
    model are taken for compatibility: ``num_workers`` is ignored; ``format_results=False``,
    ``overlap_policy`` and ``hidden_states`` raise ValueError, because the server answers
    GLiNER2's formatted results with the model's own settings. ``max_len`` is sent (MAX_LEN).
    """

    adapter: str | None
    concurrency: int

    def _complete(self, plan: _Plan):  # pragma: no cover - defined by the clients
        raise NotImplementedError

    # ------------------------------------------------------------- pure helpers

    def create_schema(self):
        """A new ``gliner2.Schema`` builder, as ``GLiNER2.create_schema()`` (imports gliner2)."""
        return schema_lib.create_schema()

    def format_results(
        self,
        results: dict,
        include_confidence: bool = False,
        requested_relations: list[str] | None = None,
        classification_tasks: list[str] | None = None,
    ) -> dict[str, Any]:
        """``GLiNER2.format_results``: raw extraction results → the public payload."""
        return format_results(results, include_confidence, requested_relations, classification_tasks)

    # ----------------------------------------------------------------- extract

    def batch_extract(
        self,
        texts: Sequence[str],
        schemas: Any,
        batch_size: int = DEFAULT_BATCH_SIZE,
        threshold: float = DEFAULT_THRESHOLD,
        num_workers: int = 0,
        format_results: bool = True,
        include_confidence: bool = False,
        include_spans: bool = False,
        max_len: int | None = None,
        overlap_policy: str | None = None,
        hidden_states: Any = None,
        *,
        adapter: AdapterArg = None,
        raise_on_error: bool = True,
    ):
        """``GLiNER2.batch_extract``: one schema for all texts, or a list with one per text.

        Requests go out concurrently, ``batch_size`` at a time (left at its default: the
        client's concurrency), and the server batches them. Results come back in input
        order. The first failed item raises its ManyLoRAError; with
        ``raise_on_error=False`` its slot holds the ManyLoRAError instead. ``adapter``
        may be one id per text.
        """
        _remote_only(format_results, overlap_policy, hidden_states)
        words = _max_len(max_len)
        texts = list(texts)
        encoded = _schemas_for(schemas, len(texts))
        adapters = self._adapters(adapter, len(texts))
        items = [
            _item(text, schema, adapter_id, threshold, include_confidence, include_spans, words)
            for text, schema, adapter_id in zip(texts, encoded, adapters, strict=True)
        ]
        window = _window(batch_size, self.concurrency)
        return self._complete(_Plan(items, list, window, raise_on_error, list(range(len(items)))))

    def extract(
        self,
        text: str,
        schema,
        threshold: float = DEFAULT_THRESHOLD,
        format_results: bool = True,
        include_confidence: bool = False,
        include_spans: bool = False,
        max_len: int | None = None,
        overlap_policy: str | None = None,
        *,
        adapter: str | None = None,
    ):
        """``GLiNER2.extract``: one text, a Schema (or its dict / JSON)."""
        _remote_only(format_results, overlap_policy)
        item = _item(
            text,
            _encoded(schema),
            self._adapter(adapter),
            threshold,
            include_confidence,
            include_spans,
            _max_len(max_len),
        )
        return self._complete(_Plan([item], _first, 1, True, [None]))

    def batch_extract_long(
        self,
        texts: Sequence[str],
        schemas: Any,
        batch_size: int = DEFAULT_BATCH_SIZE,
        threshold: float = DEFAULT_THRESHOLD,
        num_workers: int = 0,
        format_results: bool = True,
        include_confidence: bool = False,
        include_spans: bool = False,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        chunk_overlap: int = DEFAULT_CHUNK_OVERLAP,
        overlap_policy: str | None = None,
        *,
        adapter: AdapterArg = None,
        raise_on_error: bool = True,
    ):
        """``GLiNER2.batch_extract_long``: each text cut into overlapping word windows
        (``chunk_size`` words, ``chunk_overlap`` shared), one request per window, the
        windows' answers merged as GLiNER2 merges them (offsets back into the document,
        duplicates collapsed, overlapping spans resolved). Words are cut with GLiNER2's
        default (whitespace) word splitter."""
        if not format_results:
            raise ValueError("batch_extract_long currently requires format_results=True")
        _remote_only(True, overlap_policy)
        texts = list(texts)
        if not texts:
            return self._complete(_Plan([], list, 1, raise_on_error, []))
        encoded = _schemas_for(schemas, len(texts))
        adapters = self._adapters(adapter, len(texts))
        items, report, docs = [], [], []
        for index, (text, schema, adapter_id) in enumerate(zip(texts, encoded, adapters, strict=True)):
            chunks = split_text_into_chunks(text, chunk_size, chunk_overlap)
            docs.append((text, schema, chunks))
            for chunk in chunks:
                # GLiNER2 reads at most chunk_size word tokens of each chunk (max_len=chunk_size)
                items.append(_item(chunk.text, schema, adapter_id, threshold, True, True, chunk_size))
                report.append(index)

        def finish(answers: list) -> list:
            merged, offset = [], 0
            for text, schema, chunks in docs:
                mine = answers[offset : offset + len(chunks)]
                offset += len(chunks)
                error = next((a for a in mine if isinstance(a, ManyLoRAError)), None)
                if error is not None:
                    merged.append(error)
                    continue
                merged.append(
                    merge_chunk_results(text, chunks, mine, include_confidence, include_spans, schema.scalar_labels)
                )
            return merged

        return self._complete(_Plan(items, finish, _window(batch_size, self.concurrency), raise_on_error, report))

    def extract_long(
        self,
        text: str,
        schema,
        threshold: float = DEFAULT_THRESHOLD,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        chunk_overlap: int = DEFAULT_CHUNK_OVERLAP,
        batch_size: int = DEFAULT_BATCH_SIZE,
        num_workers: int = 0,
        format_results: bool = True,
        include_confidence: bool = False,
        include_spans: bool = False,
        overlap_policy: str | None = None,
        *,
        adapter: str | None = None,
    ):
        """``GLiNER2.extract_long``: one long text; see ``batch_extract_long``."""
        return self._single(
            self.batch_extract_long(
                [text],
                _encoded(schema),
                batch_size,
                threshold,
                num_workers,
                format_results,
                include_confidence,
                include_spans,
                chunk_size,
                chunk_overlap,
                overlap_policy,
                adapter=self._adapter(adapter),
            )
        )

    # ---------------------------------------------------------------- entities

    def extract_entities(
        self,
        text: str,
        entity_types,
        threshold: float = DEFAULT_THRESHOLD,
        format_results: bool = True,
        include_confidence: bool = False,
        include_spans: bool = False,
        max_len: int | None = None,
        overlap_policy: str | None = None,
        *,
        adapter: str | None = None,
    ):
        """``GLiNER2.extract_entities``: entity types as a list, a str, or name → description/config."""
        schema = entities_schema(entity_types)
        return self.extract(
            text,
            schema,
            threshold,
            format_results,
            include_confidence,
            include_spans,
            max_len,
            overlap_policy,
            adapter=adapter,
        )

    def extract_entities_long(
        self,
        text: str,
        entity_types,
        threshold: float = DEFAULT_THRESHOLD,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        chunk_overlap: int = DEFAULT_CHUNK_OVERLAP,
        batch_size: int = DEFAULT_BATCH_SIZE,
        num_workers: int = 0,
        format_results: bool = True,
        include_confidence: bool = False,
        include_spans: bool = False,
        overlap_policy: str | None = None,
        *,
        adapter: str | None = None,
    ):
        """``GLiNER2.extract_entities_long``; see ``batch_extract_long``."""
        return self.extract_long(
            text,
            entities_schema(entity_types),
            threshold,
            chunk_size,
            chunk_overlap,
            batch_size,
            num_workers,
            format_results,
            include_confidence,
            include_spans,
            overlap_policy,
            adapter=adapter,
        )

    def batch_extract_entities(
        self,
        texts: Sequence[str],
        entity_types,
        batch_size: int = DEFAULT_BATCH_SIZE,
        threshold: float = DEFAULT_THRESHOLD,
        format_results: bool = True,
        include_confidence: bool = False,
        include_spans: bool = False,
        max_len: int | None = None,
        overlap_policy: str | None = None,
        *,
        adapter: AdapterArg = None,
        raise_on_error: bool = True,
    ):
        """``GLiNER2.batch_extract_entities``; see ``batch_extract``."""
        return self.batch_extract(
            texts,
            entities_schema(entity_types),
            batch_size,
            threshold,
            0,
            format_results,
            include_confidence,
            include_spans,
            max_len,
            overlap_policy,
            adapter=adapter,
            raise_on_error=raise_on_error,
        )

    def batch_extract_entities_long(
        self,
        texts: Sequence[str],
        entity_types,
        batch_size: int = DEFAULT_BATCH_SIZE,
        threshold: float = DEFAULT_THRESHOLD,
        num_workers: int = 0,
        format_results: bool = True,
        include_confidence: bool = False,
        include_spans: bool = False,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        chunk_overlap: int = DEFAULT_CHUNK_OVERLAP,
        overlap_policy: str | None = None,
        *,
        adapter: AdapterArg = None,
        raise_on_error: bool = True,
    ):
        """``GLiNER2.batch_extract_entities_long``; see ``batch_extract_long``."""
        return self.batch_extract_long(
            texts,
            entities_schema(entity_types),
            batch_size,
            threshold,
            num_workers,
            format_results,
            include_confidence,
            include_spans,
            chunk_size,
            chunk_overlap,
            overlap_policy,
            adapter=adapter,
            raise_on_error=raise_on_error,
        )

    # ---------------------------------------------------------- classification

    def classify_text(
        self,
        text: str,
        tasks: dict,
        threshold: float = DEFAULT_THRESHOLD,
        format_results: bool = True,
        include_confidence: bool = False,
        include_spans: bool = False,
        max_len: int | None = None,
        overlap_policy: str | None = None,
        *,
        adapter: str | None = None,
    ):
        """``GLiNER2.classify_text``: task → labels, or task → {"labels": ..., options}."""
        return self.extract(
            text,
            classification_schema(tasks),
            threshold,
            format_results,
            include_confidence,
            include_spans,
            max_len,
            overlap_policy,
            adapter=adapter,
        )

    def batch_classify_text(
        self,
        texts: Sequence[str],
        tasks: dict,
        batch_size: int = DEFAULT_BATCH_SIZE,
        threshold: float = DEFAULT_THRESHOLD,
        format_results: bool = True,
        include_confidence: bool = False,
        include_spans: bool = False,
        max_len: int | None = None,
        overlap_policy: str | None = None,
        *,
        adapter: AdapterArg = None,
        raise_on_error: bool = True,
    ):
        """``GLiNER2.batch_classify_text``; see ``batch_extract``."""
        return self.batch_extract(
            texts,
            classification_schema(tasks),
            batch_size,
            threshold,
            0,
            format_results,
            include_confidence,
            include_spans,
            max_len,
            overlap_policy,
            adapter=adapter,
            raise_on_error=raise_on_error,
        )

    def classify_text_long(
        self,
        text: str,
        tasks: dict,
        threshold: float = DEFAULT_THRESHOLD,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        chunk_overlap: int = DEFAULT_CHUNK_OVERLAP,
        batch_size: int = DEFAULT_BATCH_SIZE,
        num_workers: int = 0,
        format_results: bool = True,
        include_confidence: bool = False,
        include_spans: bool = False,
        overlap_policy: str | None = None,
        *,
        adapter: str | None = None,
    ):
        """``GLiNER2.classify_text_long``: the most confident chunk's label per task."""
        return self.extract_long(
            text,
            classification_schema(tasks),
            threshold,
            chunk_size,
            chunk_overlap,
            batch_size,
            num_workers,
            format_results,
            include_confidence,
            include_spans,
            overlap_policy,
            adapter=adapter,
        )

    def batch_classify_text_long(
        self,
        texts: Sequence[str],
        tasks: dict,
        batch_size: int = DEFAULT_BATCH_SIZE,
        threshold: float = DEFAULT_THRESHOLD,
        num_workers: int = 0,
        format_results: bool = True,
        include_confidence: bool = False,
        include_spans: bool = False,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        chunk_overlap: int = DEFAULT_CHUNK_OVERLAP,
        overlap_policy: str | None = None,
        *,
        adapter: AdapterArg = None,
        raise_on_error: bool = True,
    ):
        """``GLiNER2.batch_classify_text_long``; see ``batch_extract_long``."""
        return self.batch_extract_long(
            texts,
            classification_schema(tasks),
            batch_size,
            threshold,
            num_workers,
            format_results,
            include_confidence,
            include_spans,
            chunk_size,
            chunk_overlap,
            overlap_policy,
            adapter=adapter,
            raise_on_error=raise_on_error,
        )

    # -------------------------------------------------------------------- json

    def extract_json(
        self,
        text: str,
        structures: dict,
        threshold: float = DEFAULT_THRESHOLD,
        format_results: bool = True,
        include_confidence: bool = False,
        include_spans: bool = False,
        max_len: int | None = None,
        overlap_policy: str | None = None,
        *,
        adapter: str | None = None,
    ):
        """``GLiNER2.extract_json``: structure → field specs ("name::str::description", ...)."""
        return self.extract(
            text,
            json_schema(structures),
            threshold,
            format_results,
            include_confidence,
            include_spans,
            max_len,
            overlap_policy,
            adapter=adapter,
        )

    def batch_extract_json(
        self,
        texts: Sequence[str],
        structures: dict,
        batch_size: int = DEFAULT_BATCH_SIZE,
        threshold: float = DEFAULT_THRESHOLD,
        format_results: bool = True,
        include_confidence: bool = False,
        include_spans: bool = False,
        max_len: int | None = None,
        overlap_policy: str | None = None,
        *,
        adapter: AdapterArg = None,
        raise_on_error: bool = True,
    ):
        """``GLiNER2.batch_extract_json``; see ``batch_extract``."""
        return self.batch_extract(
            texts,
            json_schema(structures),
            batch_size,
            threshold,
            0,
            format_results,
            include_confidence,
            include_spans,
            max_len,
            overlap_policy,
            adapter=adapter,
            raise_on_error=raise_on_error,
        )

    def extract_json_long(
        self,
        text: str,
        structures: dict,
        threshold: float = DEFAULT_THRESHOLD,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        chunk_overlap: int = DEFAULT_CHUNK_OVERLAP,
        batch_size: int = DEFAULT_BATCH_SIZE,
        num_workers: int = 0,
        format_results: bool = True,
        include_confidence: bool = False,
        include_spans: bool = False,
        overlap_policy: str | None = None,
        *,
        adapter: str | None = None,
    ):
        """``GLiNER2.extract_json_long``; see ``batch_extract_long``."""
        return self.extract_long(
            text,
            json_schema(structures),
            threshold,
            chunk_size,
            chunk_overlap,
            batch_size,
            num_workers,
            format_results,
            include_confidence,
            include_spans,
            overlap_policy,
            adapter=adapter,
        )

    def batch_extract_json_long(
        self,
        texts: Sequence[str],
        structures: dict,
        batch_size: int = DEFAULT_BATCH_SIZE,
        threshold: float = DEFAULT_THRESHOLD,
        num_workers: int = 0,
        format_results: bool = True,
        include_confidence: bool = False,
        include_spans: bool = False,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        chunk_overlap: int = DEFAULT_CHUNK_OVERLAP,
        overlap_policy: str | None = None,
        *,
        adapter: AdapterArg = None,
        raise_on_error: bool = True,
    ):
        """``GLiNER2.batch_extract_json_long``; see ``batch_extract_long``."""
        return self.batch_extract_long(
            texts,
            json_schema(structures),
            batch_size,
            threshold,
            num_workers,
            format_results,
            include_confidence,
            include_spans,
            chunk_size,
            chunk_overlap,
            overlap_policy,
            adapter=adapter,
            raise_on_error=raise_on_error,
        )

    # --------------------------------------------------------------- relations

    def extract_relations(
        self,
        text: str,
        relation_types,
        threshold: float = DEFAULT_THRESHOLD,
        format_results: bool = True,
        include_confidence: bool = False,
        include_spans: bool = False,
        max_len: int | None = None,
        overlap_policy: str | None = None,
        *,
        adapter: str | None = None,
    ):
        """``GLiNER2.extract_relations``: relation types as a list, a str, or name → description/config."""
        return self.extract(
            text,
            relations_schema(relation_types),
            threshold,
            format_results,
            include_confidence,
            include_spans,
            max_len,
            overlap_policy,
            adapter=adapter,
        )

    def batch_extract_relations(
        self,
        texts: Sequence[str],
        relation_types,
        batch_size: int = DEFAULT_BATCH_SIZE,
        threshold: float = DEFAULT_THRESHOLD,
        format_results: bool = True,
        include_confidence: bool = False,
        include_spans: bool = False,
        max_len: int | None = None,
        overlap_policy: str | None = None,
        *,
        adapter: AdapterArg = None,
        raise_on_error: bool = True,
    ):
        """``GLiNER2.batch_extract_relations``; see ``batch_extract``."""
        return self.batch_extract(
            texts,
            relations_schema(relation_types),
            batch_size,
            threshold,
            0,
            format_results,
            include_confidence,
            include_spans,
            max_len,
            overlap_policy,
            adapter=adapter,
            raise_on_error=raise_on_error,
        )

    def extract_relations_long(
        self,
        text: str,
        relation_types,
        threshold: float = DEFAULT_THRESHOLD,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        chunk_overlap: int = DEFAULT_CHUNK_OVERLAP,
        batch_size: int = DEFAULT_BATCH_SIZE,
        num_workers: int = 0,
        format_results: bool = True,
        include_confidence: bool = False,
        include_spans: bool = False,
        overlap_policy: str | None = None,
        *,
        adapter: str | None = None,
    ):
        """``GLiNER2.extract_relations_long``; see ``batch_extract_long``."""
        return self.extract_long(
            text,
            relations_schema(relation_types),
            threshold,
            chunk_size,
            chunk_overlap,
            batch_size,
            num_workers,
            format_results,
            include_confidence,
            include_spans,
            overlap_policy,
            adapter=adapter,
        )

    def batch_extract_relations_long(
        self,
        texts: Sequence[str],
        relation_types,
        batch_size: int = DEFAULT_BATCH_SIZE,
        threshold: float = DEFAULT_THRESHOLD,
        num_workers: int = 0,
        format_results: bool = True,
        include_confidence: bool = False,
        include_spans: bool = False,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        chunk_overlap: int = DEFAULT_CHUNK_OVERLAP,
        overlap_policy: str | None = None,
        *,
        adapter: AdapterArg = None,
        raise_on_error: bool = True,
    ):
        """``GLiNER2.batch_extract_relations_long``; see ``batch_extract_long``."""
        return self.batch_extract_long(
            texts,
            relations_schema(relation_types),
            batch_size,
            threshold,
            num_workers,
            format_results,
            include_confidence,
            include_spans,
            chunk_size,
            chunk_overlap,
            overlap_policy,
            adapter=adapter,
            raise_on_error=raise_on_error,
        )

    # ----------------------------------------------------------------- helpers

    def _single(self, result):
        """The one result of a one-text batch call (a coroutine's, for the asyncio client)."""
        return result[0]

    def _adapter(self, adapter: str | None) -> str:
        if adapter is None:
            return self.adapter or BASE_ADAPTER
        if not isinstance(adapter, str):
            raise ValueError(f"adapter must be a str or None, got {type(adapter).__name__}")
        return adapter

    def _adapters(self, adapter: AdapterArg, count: int) -> list[str]:
        if adapter is None or isinstance(adapter, str):
            return [self._adapter(adapter)] * count
        adapters = list(adapter)
        if len(adapters) != count:
            raise ValueError(f"Adapter count ({len(adapters)}) != text count ({count})")
        return [self._adapter(one) for one in adapters]


class ManyLoRAClient(_GLiNER2Methods):
    """Client of the ManyLoRA ``gliner2`` Triton model, over gRPC or HTTP.

    Args:
        url: ``HOST:PORT`` of Triton's gRPC or HTTP endpoint (no scheme); default
            ``localhost:8001`` for gRPC, ``localhost:8000`` for HTTP.
        protocol: ``"grpc"`` or ``"http"``.
        model_name: Triton model name.
        adapter: Default LoRA adapter id for every call; None or ``""`` = base model.
        timeout: Seconds: the gRPC deadline per request, or the HTTP connection and
            network timeouts. None: gRPC waits forever, HTTP keeps tritonclient's 60 s.
        concurrency: Requests a batch call keeps in flight (HTTP: also the number of
            worker threads and connections). The server's dynamic batcher groups them;
            keep it at least the model's max_batch_size to fill batches.

    Methods taking ``adapter=`` use the client's default when it is None; pass ``""``
    for the base model. Batch methods also take one adapter per text.

    A client can be shared between threads. Use it as a context manager, or call
    ``close()``.
    """

    def __init__(
        self,
        url: str | None = None,
        protocol: str = "grpc",
        model_name: str = MODEL_NAME,
        adapter: str | None = None,
        timeout: float | None = None,
        concurrency: int = DEFAULT_CONCURRENCY,
    ):
        if protocol not in DEFAULT_URLS:
            raise ValueError(f"protocol must be one of {sorted(DEFAULT_URLS)}, got {protocol!r}")
        url = DEFAULT_URLS[protocol] if url is None else url
        if "://" in url:
            raise ValueError(f"url must be HOST:PORT without a scheme, got {url!r}")
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"concurrency must be a positive int, got {concurrency!r}")
        if adapter is not None and not isinstance(adapter, str):
            raise ValueError(f"adapter must be a str or None, got {type(adapter).__name__}")
        self.url = url
        self.protocol = protocol
        self.model_name = model_name
        self.adapter = adapter
        self.timeout = timeout
        self.concurrency = concurrency
        self._transport = make_transport(protocol, url, timeout, concurrency)
        self._closed = False

    def __repr__(self) -> str:
        return (
            f"ManyLoRAClient(url={self.url!r}, protocol={self.protocol!r}, "
            f"model_name={self.model_name!r}, adapter={self.adapter!r})"
        )

    def __enter__(self) -> ManyLoRAClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._transport.close()

    # ------------------------------------------------------------------ server

    def is_live(self) -> bool:
        """True when the server answers its liveness check; False when unreachable."""
        with _unreachable_is_false():
            return bool(self._transport.call(lambda triton: triton.is_server_live()))
        return False

    def is_ready(self) -> bool:
        """True when the server and the model are ready; False when unreachable."""
        with _unreachable_is_false():
            return bool(
                self._transport.call(lambda triton: triton.is_server_ready() and triton.is_model_ready(self.model_name))
            )
        return False

    def wait_until_ready(self, timeout: float = 60.0, interval: float = 0.5) -> None:
        """Poll ``is_ready()``; raise ManyLoRAError (UNAVAILABLE) after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not self.is_ready():
            if time.monotonic() >= deadline:
                raise ManyLoRAError(
                    f"model {self.model_name!r} at {self.url} not ready after {timeout} s", "UNAVAILABLE"
                )
            time.sleep(interval)

    def model_metadata(self) -> dict[str, Any]:
        """Triton's model metadata (name, versions, platform, inputs, outputs), shapes as ints."""
        with _wrapped_errors():
            if self.protocol == "grpc":
                metadata = self._transport.call(lambda triton: triton.get_model_metadata(self.model_name, as_json=True))
            else:
                metadata = self._transport.call(lambda triton: triton.get_model_metadata(self.model_name))
        for tensor in metadata.get("inputs", []) + metadata.get("outputs", []):
            tensor["shape"] = [int(dim) for dim in tensor.get("shape", [])]
        return metadata

    def model_config(self) -> dict[str, Any]:
        """The model's config as Triton parsed it (over gRPC, int64 values are strings)."""
        with _wrapped_errors():
            if self.protocol == "grpc":
                return self._transport.call(lambda triton: triton.get_model_config(self.model_name, as_json=True))[
                    "config"
                ]
            return self._transport.call(lambda triton: triton.get_model_config(self.model_name))

    def health(self) -> dict[str, Any]:
        """Liveness and readiness of the server and the model, never raising."""
        report = {"url": self.url, "protocol": self.protocol, "model": self.model_name}
        report["live"] = self.is_live()
        report["ready"] = False
        report["model_ready"] = False
        with _unreachable_is_false():
            report["ready"] = bool(self._transport.call(lambda triton: triton.is_server_ready()))
            report["model_ready"] = bool(self._transport.call(lambda triton: triton.is_model_ready(self.model_name)))
        return report

    # ---------------------------------------------------------------- requests

    def request(
        self,
        text: str,
        schema,
        threshold: float = DEFAULT_THRESHOLD,
        *,
        include_confidence: bool = False,
        include_spans: bool = False,
        adapter: str | None = None,
    ) -> Request:
        """One validated request; ``schema`` in any form ``schema_lib.encode_schema`` takes."""
        return Request(
            text=text,
            schema=_encoded(schema).json,
            adapter=self._adapter(adapter),
            threshold=threshold,
            include_confidence=include_confidence,
            include_spans=include_spans,
        )

    def infer(self, request: Request) -> dict[str, Any]:
        """Send one request and wait; raises ManyLoRAError on failure."""
        try:
            response = self._transport.infer(self.model_name, request)
        except Exception as exc:
            raise error_from_exception(exc) from exc
        return _decode_response(response)

    def stream(
        self,
        items: Iterable[Request | ManyLoRAError],
        window: int | None = None,
    ) -> Iterator[dict[str, Any] | ManyLoRAError]:
        """Send requests concurrently; yield results in input order.

        At most ``window`` (default: the client's concurrency) requests are in flight;
        ``items`` is consumed lazily, so files of any size stream in bounded memory.
        A failed item yields its ManyLoRAError (``.index`` = its position) instead of
        raising. A ManyLoRAError given as an item is yielded back in its place, so
        callers that could not build some requests keep their order.
        """
        window = self.concurrency if window is None else window
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive int, got {window!r}")
        pending: collections.deque = collections.deque()
        try:
            for index, item in enumerate(items):
                if isinstance(item, ManyLoRAError):
                    pending.append((index, item))
                elif isinstance(item, Request):
                    try:
                        pending.append((index, self._transport.submit(self.model_name, item)))
                    except Exception as exc:
                        pending.append((index, error_from_exception(exc)))
                else:
                    raise TypeError(f"stream items must be Request or ManyLoRAError, got {type(item).__name__}")
                if len(pending) >= window:
                    yield _settle(*pending.popleft())
            while pending:
                yield _settle(*pending.popleft())
        finally:
            for _, future in pending:
                if not isinstance(future, ManyLoRAError):
                    future.cancel()

    def _complete(self, plan: _Plan):
        """Send the plan's requests (``plan.window`` in flight), then finish it."""
        answers = list(plan.items)
        positions = [i for i, item in enumerate(plan.items) if isinstance(item, Request)]
        if positions:
            requests = [plan.items[i] for i in positions]
            with contextlib.closing(self.stream(requests, window=plan.window)) as stream:
                for position, answer in zip(positions, stream):
                    if isinstance(answer, ManyLoRAError):
                        answer.index = plan.report[position]
                        if plan.raise_on_error:
                            raise answer
                    answers[position] = answer
        return plan.finish(answers)


def _decode_response(response) -> dict[str, Any]:
    try:
        return parse_result(response.as_numpy(RESULT))
    except ValueError as exc:  # json.JSONDecodeError is a ValueError
        raise ManyLoRAError(f"malformed {RESULT} from the server: {exc}", "INTERNAL") from exc


def _settle(index: int, future) -> dict[str, Any] | ManyLoRAError:
    if isinstance(future, ManyLoRAError):
        future.index = index
        return future
    try:
        return _decode_response(future.result())
    except Exception as exc:
        return error_from_exception(exc, index)


@contextlib.contextmanager
def _wrapped_errors():
    try:
        yield
    except (InferenceServerException, OSError) as exc:
        raise error_from_exception(exc) from exc


@contextlib.contextmanager
def _unreachable_is_false():
    """Swallow "cannot reach / cannot answer" errors; the caller falls through to False."""
    try:
        yield
    except (InferenceServerException, OSError):
        pass


# ------------------------------------------------------------------ schemas, items


@dataclasses.dataclass(frozen=True)
class _Encoded:
    """A schema as it travels (SCHEMA's JSON), with what the client itself reads from it."""

    json: str
    data: Any  # the parsed dict
    scalar_labels: frozenset = frozenset()  # entity types declared with a non-list dtype (long merge)


def _encoded(schema) -> _Encoded:
    """Any schema form the client takes → ``_Encoded``; only a gliner2 Schema imports gliner2.

    ``scalar_labels`` follows GLiNER2's ``_scalar_entity_labels``: a Schema's (or one of
    this module's builders') entity dtypes; a plain dict or JSON text has none.
    """
    if isinstance(schema, _Encoded):
        return schema
    text = schema_lib.encode_schema(schema)
    data = json.loads(text)
    scalar = frozenset()
    metadata = getattr(getattr(schema, "schema", schema), "_entity_metadata", None)
    if isinstance(metadata, dict):
        scalar = frozenset(n for n, m in metadata.items() if isinstance(m, dict) and m.get("dtype", "list") != "list")
    return _Encoded(text, data, scalar)


def _built(data: dict, scalar_labels=frozenset()) -> _Encoded:
    """A schema dict this module built as GLiNER2's builder would (``Schema.to_dict()``)."""
    if not data:
        raise SchemaError("the schema has no task: add entities, classifications, relations or structures")
    return _Encoded(json.dumps(data, ensure_ascii=False), data, frozenset(scalar_labels))


def _schemas_for(schemas, count: int) -> list[_Encoded]:
    if isinstance(schemas, list):
        if len(schemas) != count:
            raise ValueError(f"Schema count ({len(schemas)}) != text count ({count})")
        return [_encoded(schema) for schema in schemas]
    return [_encoded(schemas)] * count


def _item(
    text, schema: _Encoded, adapter: str, threshold, include_confidence, include_spans, max_len: int = 0
) -> Request:
    """The Request for one text (an empty one too: the server answers it as GLiNER2 does)."""
    return Request(
        text=text,
        schema=schema.json,
        adapter=adapter,
        threshold=threshold,
        include_confidence=include_confidence,
        include_spans=include_spans,
        max_len=max_len,
    )


def _max_len(max_len) -> int:
    """GLiNER2's ``max_len`` as MAX_LEN carries it: None -> 0 (every word)."""
    if max_len is None:
        return 0
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"max_len must be a positive int or None, got {max_len!r}")
    return max_len


def _remote_only(format_results, overlap_policy, hidden_states=None) -> None:
    if not format_results:
        raise ValueError("format_results=False is not served: the server answers GLiNER2's formatted results")
    for name, value in (("overlap_policy", overlap_policy), ("hidden_states", hidden_states)):
        if value is not None:
            raise ValueError(f"{name} is not served: the server extracts with the model's own settings")


def _window(batch_size, concurrency: int) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int):
        raise ValueError(f"batch_size must be an int, got {type(batch_size).__name__}")
    if batch_size <= 0:
        raise ValueError("batch_size must be greater than 0")
    return concurrency if batch_size is DEFAULT_BATCH_SIZE else batch_size


def _first(results: list):
    return results[0]


# GLiNER2's whitespace word splitter answers no word exactly when the text has no \S.
_NON_SPACE = re.compile(r"\S")


# -------------------------------------------------- GLiNER2's builders, torch-free
#
# What ``Schema().entities(...)``, ``.relations(...)``, ``.classification(...)`` and
# ``.structure(...).field(...)`` give from ``to_dict()``, built without gliner2 (whose
# package imports torch); tests/client/test_client_dropin.py checks them against gliner2.

_CLASSIFICATION_OPTIONS = {"multi_label", "cls_threshold", "top_k", "class_act", "prompt", "examples"}


def _named_configs(types, what: str) -> dict[str, dict]:
    if isinstance(types, str):
        return {types: {}}
    if isinstance(types, list):
        return {name: {} for name in types}
    if isinstance(types, dict):
        return {
            name: {"description": c} if isinstance(c, str) else c if isinstance(c, dict) else {}
            for name, c in types.items()
        }
    raise ValueError(f"Invalid {what}_types format")


def _check_threshold(threshold) -> None:
    if threshold is not None and not 0 <= threshold <= 1:
        raise ValueError(f"Threshold must be 0-1, got {threshold}")


def _compact(config: dict):
    return config["description"] if set(config) == {"description"} else config


def entities_schema(entity_types) -> _Encoded:
    """The schema ``GLiNER2.extract_entities(text, entity_types)`` builds."""
    configs, scalar = {}, set()
    for name, config in _named_configs(entity_types, "entity").items():
        if config.get("validators"):
            raise SchemaError(
                f"regex validators on {[name]} cannot be sent: Schema.to_dict() drops them, "
                "so the server would extract without them. Filter the results client-side instead."
            )
        dtype, threshold = config.get("dtype", "list"), config.get("threshold")
        _check_threshold(threshold)
        out = {}
        if config.get("description"):
            out["description"] = config["description"]
        if dtype != "list":
            out["dtype"] = dtype
            scalar.add(name)
        if threshold is not None:
            out["threshold"] = threshold
        configs[name] = out
    entities = {n: _compact(c) for n, c in configs.items()} if any(configs.values()) else list(configs)
    return _built({"entities": entities} if configs else {}, scalar)


def relations_schema(relation_types) -> _Encoded:
    """The schema ``GLiNER2.extract_relations(text, relation_types)`` builds."""
    configs = {}
    for name, config in _named_configs(relation_types, "relation").items():
        _check_threshold(config.get("threshold"))
        out = {}
        if config.get("description"):
            out["description"] = config["description"]
        if config.get("threshold") is not None:
            out["threshold"] = config["threshold"]
        configs[name] = out
    relations = configs if any(configs.values()) else list(configs)
    return _built({"relations": relations} if configs else {})


def classification_schema(tasks: dict) -> _Encoded:
    """The schema ``GLiNER2.classify_text(text, tasks)`` builds: task → labels (list, or
    label → description), or task → a config dict with ``labels`` and options."""
    out = []
    for task, config in tasks.items():
        options = dict(config) if isinstance(config, dict) and "labels" in config else {"labels": config}
        labels = options.pop("labels")
        extra = sorted(set(options) - _CLASSIFICATION_OPTIONS)
        if extra:
            raise SchemaError(
                f"classification {task!r} has option(s) {extra} that GLiNER2's schema "
                "JSON does not carry (Schema.from_dict knows multi_label, cls_threshold, top_k, "
                "class_act, prompt, examples)"
            )
        cls_threshold, top_k = options.get("cls_threshold", 0.5), options.get("top_k")
        if not 0 <= cls_threshold <= 1:
            raise ValueError(f"cls_threshold must be 0-1, got {cls_threshold}")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        names = list(labels.keys()) if isinstance(labels, dict) else labels
        entry = {"task": task, "labels": dict(labels) if isinstance(labels, dict) and labels else list(names)}
        if options.get("multi_label", False):
            entry["multi_label"] = True
        if cls_threshold != 0.5:
            entry["cls_threshold"] = cls_threshold
        for key in ("top_k", "class_act", "prompt"):
            if options.get(key) is not None:
                entry[key] = options[key]
        if options.get("examples"):
            entry["examples"] = [list(pair) for pair in options["examples"]]
        out.append(entry)
    return _built({"classifications": out} if out else {})


def json_schema(structures: dict) -> _Encoded:
    """The schema ``GLiNER2.extract_json(text, structures)`` builds on a span model: legacy
    structures (mode=None), fields as ``"name::str::description"`` specs or dicts."""
    out = {}
    for parent, specs in structures.items():
        order, meta, descriptions = [], {}, {}
        for spec in specs:
            name, dtype, choices, description = schema_lib.parse_field_spec(spec)
            order.append(name)
            meta[name] = (dtype, choices)
            if description:
                descriptions[name] = description
        fields = []
        for name in order:
            dtype, choices = meta[name]
            field = {"name": name}
            if dtype != "list":
                field["dtype"] = dtype
            if choices:
                field["choices"] = choices
            if descriptions.get(name):
                field["description"] = descriptions[name]
            fields.append(field)
        out[parent] = {"fields": fields}
    return _built({"structures": out} if out else {})


# ------------------------------------------------------------ GLiNER2's formatting


def _is_score(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _format_classification(value, include_confidence: bool):
    if isinstance(value, (list, tuple)) and value:
        first = value[0]
        if isinstance(first, (list, tuple)):
            if include_confidence:
                return [{"label": item[0], "confidence": item[1]} for item in value]
            return [item[0] for item in value]
        if len(value) == 2 and isinstance(first, str) and _is_score(value[1]):
            label, confidence = value
            return {"label": label, "confidence": confidence} if include_confidence else label
    return value


def _unique_spans(spans: list, include_confidence: bool) -> list:
    unique, seen = [], set()
    for span in spans:
        if isinstance(span, tuple):
            text, confidence, start, end = span
            if text and (text.lower(), start, end) not in seen:
                seen.add((text.lower(), start, end))
                unique.append({"text": text, "confidence": confidence} if include_confidence else text)
        elif isinstance(span, dict):
            text = span.get("text", "")
            key = (text.lower(), span["start"], span["end"]) if "start" in span and "end" in span else None
            key = (text.lower(), None, None) if key is None else key
            if text and key not in seen:
                seen.add(key)
                unique.append(span)
        elif span and span.lower() not in seen:
            seen.add(span.lower())
            unique.append(span)
    return unique


def _format_scalar_span(value: tuple, include_confidence: bool):
    text, confidence, _, _ = value
    return {"text": text, "confidence": confidence} if include_confidence and text else text


def format_entity_dict(entities: dict, include_confidence: bool) -> dict:
    """GLiNER2's ``format_entity_dict``: dedupe spans per entity type."""
    out = {}
    for name, spans in entities.items():
        if isinstance(spans, list):
            out[name] = _unique_spans(spans, include_confidence)
        elif isinstance(spans, tuple):
            out[name] = _format_scalar_span(spans, include_confidence)
        else:
            out[name] = spans or None
    return out


def format_struct(struct: dict, include_confidence: bool) -> dict:
    """GLiNER2's ``format_struct``: dedupe the values of one structure instance."""
    out = {}
    for name, value in struct.items():
        if isinstance(value, list):
            out[name] = _unique_spans(value, include_confidence)
        elif isinstance(value, tuple):
            out[name] = _format_scalar_span(value, include_confidence)
        else:
            out[name] = value if value else None
    return out


def format_results(
    results: dict,
    include_confidence: bool = False,
    requested_relations: list[str] | None = None,
    classification_tasks: list[str] | None = None,
) -> dict[str, Any]:
    """GLiNER2's ``format_results``: raw extraction results → the public payload."""
    formatted, relations = {}, {}
    requested_relations = requested_relations or []
    classification_tasks = classification_tasks or []
    for key, value in results.items():
        is_classification = key in classification_tasks
        is_relation = False
        if not is_classification:
            if key in requested_relations:
                is_relation = True
            elif isinstance(value, list) and value:
                first = value[0]
                if isinstance(first, tuple) and len(first) == 2:
                    is_relation = True
                elif isinstance(first, dict) and "head" in first and "tail" in first:
                    is_relation = True
        if is_classification:
            formatted[key] = _format_classification(value, include_confidence)
        elif is_relation:
            relations[key] = value if isinstance(value, list) else []
        elif isinstance(value, list):
            if not value:
                formatted[key] = {} if key == "entities" else value
            elif isinstance(value[0], dict):
                if key == "entities":
                    formatted[key] = format_entity_dict(value[0], include_confidence)
                else:
                    formatted[key] = [format_struct(v, include_confidence) for v in value]
            elif isinstance(value[0], tuple):
                if include_confidence:
                    formatted[key] = [{"label": label, "confidence": c} for label, c in value]
                else:
                    formatted[key] = [label for label, _ in value]
            else:
                formatted[key] = value
        elif isinstance(value, tuple):
            label, confidence = value
            formatted[key] = {"label": label, "confidence": confidence} if include_confidence else label
        elif isinstance(value, dict):
            formatted[key] = format_struct(value, include_confidence)
        else:
            formatted[key] = value
    for name in requested_relations:
        relations.setdefault(name, [])
    if relations:
        formatted["relation_extraction"] = relations
    return formatted


# --------------------------------------------------------- GLiNER2's long documents


@dataclasses.dataclass(frozen=True)
class TextChunk:
    """A window of a document: its text and where it lies (characters, words)."""

    text: str
    start_char: int
    end_char: int
    start_word: int
    end_word: int


@functools.cache
def _word_pattern() -> re.Pattern:
    """GLiNER2's ``WhitespaceTokenSplitter`` pattern (built on first use: it scans Unicode)."""
    marks = "".join(chr(c) for c in range(sys.maxunicode + 1) if unicodedata.category(chr(c)).startswith("M"))
    word = rf"[\w{marks}\u200c\u200d]"
    return re.compile(
        rf"""(?:https?://[^\s]+|www\.[^\s]+)
        |[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{{2,}}
        |@[a-z0-9_]+
        |{word}+(?:[-_]{word}+)*
        |\S""",
        re.VERBOSE | re.IGNORECASE,
    )


def split_text_into_chunks(
    text: str, chunk_size: int = DEFAULT_CHUNK_SIZE, chunk_overlap: int = DEFAULT_CHUNK_OVERLAP
) -> list[TextChunk]:
    """GLiNER2's ``split_text_into_chunks`` with its default word splitter."""
    if chunk_size <= 0:
        raise ValueError("chunk_size must be greater than 0")
    if chunk_overlap < 0:
        raise ValueError("chunk_overlap must be non-negative")
    if chunk_overlap >= chunk_size:
        raise ValueError("chunk_overlap must be smaller than chunk_size")
    words = [(m.start(), m.end()) for m in _word_pattern().finditer(text)] if _NON_SPACE.search(text) else []
    if not words:
        return [TextChunk(text, 0, len(text), 0, 0)]
    chunks, start = [], 0
    while start < len(words):
        end = min(start + chunk_size, len(words))
        first, last = words[start][0], words[end - 1][1]
        chunks.append(TextChunk(text[first:last], first, last, start, end))
        if end == len(words):
            break
        start += chunk_size - chunk_overlap
    return chunks


def _is_span(value) -> bool:
    return (
        isinstance(value, dict)
        and "text" in value
        and "start" in value
        and "end" in value
        and isinstance(value["start"], int)
        and isinstance(value["end"], int)
    )


def _is_classification(value) -> bool:
    return isinstance(value, dict) and "label" in value and "confidence" in value


def _remap(result, text: str, chunk: TextChunk):
    if isinstance(result, list):
        return [_remap(item, text, chunk) for item in result]
    if isinstance(result, dict):
        out = {key: _remap(value, text, chunk) for key, value in result.items()}
        if _is_span(out):
            start, end = int(out["start"]) + chunk.start_char, int(out["end"]) + chunk.start_char
            out["start"], out["end"] = start, end
            if 0 <= start <= end <= len(text):
                out["text"] = text[start:end]
        return out
    return result


def merge_chunk_results(
    text: str,
    chunks: list[TextChunk],
    results: list[dict],
    include_confidence: bool = False,
    include_spans: bool = False,
    scalar_entity_labels=(),
    overlap_policy: str = "disallow",
) -> dict[str, Any]:
    """GLiNER2's ``merge_chunk_results`` for its span models (entity spans of one type that
    overlap: the best-scoring set that does not overlap)."""
    if len(chunks) != len(results):
        raise ValueError("chunks and chunk_results must have the same length")
    remapped = [_remap(result, text, chunk) for chunk, result in zip(chunks, results)]
    merged = {}
    for key in _keys_in_order(remapped):
        values = [result[key] for result in remapped if key in result]
        if key == "entities":
            merged[key] = _merge_labelled(values, set(scalar_entity_labels), overlap_policy)
        elif key == "relation_extraction":
            merged[key] = _merge_labelled(values, set(), "allow")
        else:
            merged[key] = _merge_values(values, overlap_policy)
    return _strip(merged, include_confidence, include_spans)


def _keys_in_order(dicts) -> list:
    return list(dict.fromkeys(key for d in dicts if isinstance(d, dict) for key in d))


def _merge_labelled(values: list, scalar: set, policy: str) -> dict:
    merged = {}
    for label in _keys_in_order(values):
        items = []
        for value in values:
            if isinstance(value, dict) and label in value:
                item = value[label]
                items.extend([] if item is None else item if isinstance(item, list) else [item])
        deduped = _dedupe(items, policy)
        merged[label] = (deduped[0] if deduped else None) if label in scalar else deduped
    return merged


def _merge_values(values: list, policy: str):
    present = [v for v in values if v not in (None, {}, [])]
    if not present:
        return values[0] if values else None
    if all(_is_classification(v) for v in present):
        return max(present, key=lambda v: v.get("confidence", 0.0))
    if all(isinstance(v, str) for v in present):
        counts = collections.Counter(present)
        return max(present, key=lambda v: (counts[v], -present.index(v)))
    if all(isinstance(v, list) for v in present):
        return _dedupe([item for v in present for item in v], policy)
    if all(isinstance(v, dict) for v in present):
        return {key: _merge_values([v[key] for v in present if key in v], policy) for key in _keys_in_order(present)}
    return present[0]


def _dedupe(items: list, policy: str = "allow") -> list:
    spans = [item for item in items if _is_span(item)]
    out = sorted(_resolve_overlaps(spans, policy), key=lambda s: (s["start"], s["end"], s.get("text", "")))
    others, where = [], {}
    for item in items:
        if _is_span(item):
            continue
        key = _canonical_key(item)
        if key not in where:
            where[key] = len(others)
            others.append(item)
        elif _confidence_of(item) > _confidence_of(others[where[key]]):
            others[where[key]] = item
    return out + others


def _canonical_key(value) -> str:
    if isinstance(value, dict):
        return repr(sorted((k, _canonical_key(v)) for k, v in value.items() if k != "confidence"))
    if isinstance(value, list):
        return repr([_canonical_key(v) for v in value])
    return repr(value)


def _confidence_of(value) -> float:
    if isinstance(value, dict):
        if isinstance(value.get("confidence"), (int, float)):
            return float(value["confidence"])
        nested = [_confidence_of(v) for v in value.values()]
        return max(nested) if nested else 0.0
    if isinstance(value, list):
        nested = [_confidence_of(v) for v in value]
        return max(nested) if nested else 0.0
    return 0.0


def _resolve_overlaps(spans: list, policy: str) -> list:
    """GLiNER2's ``resolve_overlaps`` on span dicts for ``allow`` and ``disallow``."""
    if not spans:
        return []

    def rank(row):
        index, span = row
        return (-float(span.get("confidence", 0.0)), span["start"], span["end"], index)

    distinct, bounds = [], set()
    for row in sorted(enumerate(spans), key=rank):
        key = (row[1]["start"], row[1]["end"])
        if key not in bounds:
            bounds.add(key)
            distinct.append(row)
    if policy == "allow":
        return [span for _, span in distinct]
    # disallow: weighted interval scheduling, ties as GLiNER2 breaks them
    by_end = sorted(distinct, key=lambda r: (r[1]["end"], r[1]["start"], -float(r[1].get("confidence", 0.0)), r[0]))
    ends = [span["end"] for _, span in by_end]
    before = [bisect.bisect_right(ends, span["start"], 0, i) - 1 for i, (_, span) in enumerate(by_end)]
    best: list[tuple[float, tuple[int, ...]]] = [(0.0, ())]

    def selection_key(selection):
        return tuple(rank(row) for row in sorted((by_end[i] for i in selection), key=rank))

    for i, (_, span) in enumerate(by_end):
        score, chosen = best[before[i] + 1]
        with_it = (score + float(span.get("confidence", 0.0)), chosen + (i,))
        without = best[i]
        if with_it[0] != without[0]:
            best.append(with_it if with_it[0] > without[0] else without)
        elif len(with_it[1]) != len(without[1]):
            best.append(with_it if len(with_it[1]) > len(without[1]) else without)
        else:
            best.append(with_it if selection_key(with_it[1]) < selection_key(without[1]) else without)
    return [span for _, span in sorted((by_end[i] for i in best[-1][1]), key=rank)]


_SPAN_KEYS = frozenset({"text", "confidence", "start", "end"})


def _strip(value, include_confidence: bool, include_spans: bool):
    if isinstance(value, list):
        return [_strip(item, include_confidence, include_spans) for item in value]
    if not isinstance(value, dict):
        return value
    if _is_span(value):
        extras = {k: v for k, v in value.items() if k not in _SPAN_KEYS}
        if not include_confidence and not include_spans and not extras:
            return value.get("text", "")
        out = {"text": value.get("text", "")}
        if include_confidence and "confidence" in value:
            out["confidence"] = value["confidence"]
        if include_spans:
            out["start"], out["end"] = value["start"], value["end"]
        out.update(extras)
        return out
    if _is_classification(value):
        return {"label": value["label"], "confidence": value["confidence"]} if include_confidence else value["label"]
    if "text" in value and "confidence" in value and "start" not in value and "end" not in value:
        return {"text": value["text"], "confidence": value["confidence"]} if include_confidence else value["text"]
    return {key: _strip(item, include_confidence, include_spans) for key, item in value.items()}
