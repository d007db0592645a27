"""ManyLoRAClient: GLiNER2's extraction API, answered by the ManyLoRA Triton model.

Every method takes the arguments GLiNER2's method of the same name takes (those that
make sense remotely) plus ``adapter=``. Results are what ``GLiNER2.extract`` returns,
after a JSON round trip (tuples arrive as lists).
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from tritonclient.utils import InferenceServerException

from . import schemas as schema_lib
from .errors import ManyLoRAError, error_from_exception
from .protocol import BASE_ADAPTER, DEFAULT_THRESHOLD, MODEL_NAME, RESULT, Request, parse_result
from .transport import DEFAULT_URLS, make_transport

AdapterArg = str | Sequence[str | None] | None

DEFAULT_CONCURRENCY = 64


class ManyLoRAClient:
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

    def create_schema(self):
        """A new ``gliner2.Schema`` builder, as ``GLiNER2.create_schema()``."""
        return schema_lib.create_schema()

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
            schema=schema_lib.encode_schema(schema),
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

    # ----------------------------------------------------- GLiNER2's public API

    def extract(
        self,
        text: str,
        schema,
        threshold: float = DEFAULT_THRESHOLD,
        *,
        include_confidence: bool = False,
        include_spans: bool = False,
        adapter: str | None = None,
    ) -> dict[str, Any]:
        """``GLiNER2.extract``: one text, a Schema (or its dict / JSON)."""
        return self.infer(
            self.request(
                text,
                schema,
                threshold,
                include_confidence=include_confidence,
                include_spans=include_spans,
                adapter=adapter,
            )
        )

    def batch_extract(
        self,
        texts: Sequence[str],
        schemas: Any,
        batch_size: int | None = None,
        threshold: float = DEFAULT_THRESHOLD,
        *,
        include_confidence: bool = False,
        include_spans: bool = False,
        adapter: AdapterArg = None,
        raise_on_error: bool = True,
    ) -> list[dict[str, Any] | ManyLoRAError]:
        """``GLiNER2.batch_extract``: one schema for all texts, or a list with one per text.

        Requests go out concurrently, ``batch_size`` (default: the client's concurrency)
        at a time, and the server batches them. Results come back in input order. The
        first failed item raises its ManyLoRAError; with ``raise_on_error=False`` its
        slot holds the ManyLoRAError instead. ``adapter`` may be one id per text.
        """
        texts = list(texts)
        if isinstance(schemas, list):
            if len(schemas) != len(texts):
                raise ValueError(f"Schema count ({len(schemas)}) != text count ({len(texts)})")
            encoded = [schema_lib.encode_schema(schema) for schema in schemas]
        else:
            encoded = [schema_lib.encode_schema(schemas)] * len(texts)
        adapters = self._adapters(adapter, len(texts))
        requests = [
            Request(
                text=text,
                schema=schema_json,
                adapter=adapter_id,
                threshold=threshold,
                include_confidence=include_confidence,
                include_spans=include_spans,
            )
            for text, schema_json, adapter_id in zip(texts, encoded, adapters, strict=True)
        ]
        results = []
        with contextlib.closing(self.stream(requests, window=batch_size)) as answers:
            for answer in answers:
                if raise_on_error and isinstance(answer, ManyLoRAError):
                    raise answer
                results.append(answer)
        return results

    def extract_entities(
        self,
        text: str,
        entity_types,
        threshold: float = DEFAULT_THRESHOLD,
        *,
        include_confidence: bool = False,
        include_spans: bool = False,
        adapter: str | None = None,
    ) -> dict[str, Any]:
        """``GLiNER2.extract_entities``: entity types as a list, a str, or name → description/config."""
        return self.extract(
            text,
            schema_lib.entities_schema(entity_types),
            threshold,
            include_confidence=include_confidence,
            include_spans=include_spans,
            adapter=adapter,
        )

    def batch_extract_entities(
        self,
        texts: Sequence[str],
        entity_types,
        batch_size: int | None = None,
        threshold: float = DEFAULT_THRESHOLD,
        *,
        include_confidence: bool = False,
        include_spans: bool = False,
        adapter: AdapterArg = None,
        raise_on_error: bool = True,
    ) -> list[dict[str, Any] | ManyLoRAError]:
        """``GLiNER2.batch_extract_entities``; see ``batch_extract``."""
        return self.batch_extract(
            texts,
            schema_lib.entities_schema(entity_types),
            batch_size,
            threshold,
            include_confidence=include_confidence,
            include_spans=include_spans,
            adapter=adapter,
            raise_on_error=raise_on_error,
        )

    def classify_text(
        self,
        text: str,
        tasks: dict,
        threshold: float = DEFAULT_THRESHOLD,
        *,
        include_confidence: bool = False,
        include_spans: bool = False,
        adapter: str | None = None,
    ) -> dict[str, Any]:
        """``GLiNER2.classify_text``: task → labels, or task → {"labels": ..., options}."""
        return self.extract(
            text,
            schema_lib.classification_schema(tasks),
            threshold,
            include_confidence=include_confidence,
            include_spans=include_spans,
            adapter=adapter,
        )

    def batch_classify_text(
        self,
        texts: Sequence[str],
        tasks: dict,
        batch_size: int | None = None,
        threshold: float = DEFAULT_THRESHOLD,
        *,
        include_confidence: bool = False,
        include_spans: bool = False,
        adapter: AdapterArg = None,
        raise_on_error: bool = True,
    ) -> list[dict[str, Any] | ManyLoRAError]:
        """``GLiNER2.batch_classify_text``; see ``batch_extract``."""
        return self.batch_extract(
            texts,
            schema_lib.classification_schema(tasks),
            batch_size,
            threshold,
            include_confidence=include_confidence,
            include_spans=include_spans,
            adapter=adapter,
            raise_on_error=raise_on_error,
        )

    def extract_relations(
        self,
        text: str,
        relation_types,
        threshold: float = DEFAULT_THRESHOLD,
        *,
        include_confidence: bool = False,
        include_spans: bool = False,
        adapter: str | None = None,
    ) -> dict[str, Any]:
        """``GLiNER2.extract_relations``: relation types as a list, a str, or name → description/config."""
        return self.extract(
            text,
            schema_lib.relations_schema(relation_types),
            threshold,
            include_confidence=include_confidence,
            include_spans=include_spans,
            adapter=adapter,
        )

    def batch_extract_relations(
        self,
        texts: Sequence[str],
        relation_types,
        batch_size: int | None = None,
        threshold: float = DEFAULT_THRESHOLD,
        *,
        include_confidence: bool = False,
        include_spans: bool = False,
        adapter: AdapterArg = None,
        raise_on_error: bool = True,
    ) -> list[dict[str, Any] | ManyLoRAError]:
        """``GLiNER2.batch_extract_relations``; see ``batch_extract``."""
        return self.batch_extract(
            texts,
            schema_lib.relations_schema(relation_types),
            batch_size,
            threshold,
            include_confidence=include_confidence,
            include_spans=include_spans,
            adapter=adapter,
            raise_on_error=raise_on_error,
        )

    def extract_json(
        self,
        text: str,
        structures: dict,
        threshold: float = DEFAULT_THRESHOLD,
        *,
        include_confidence: bool = False,
        include_spans: bool = False,
        adapter: str | None = None,
    ) -> dict[str, Any]:
        """``GLiNER2.extract_json``: structure → field specs ("name::str::description", ...)."""
        return self.extract(
            text,
            schema_lib.json_schema(structures),
            threshold,
            include_confidence=include_confidence,
            include_spans=include_spans,
            adapter=adapter,
        )

    def batch_extract_json(
        self,
        texts: Sequence[str],
        structures: dict,
        batch_size: int | None = None,
        threshold: float = DEFAULT_THRESHOLD,
        *,
        include_confidence: bool = False,
        include_spans: bool = False,
        adapter: AdapterArg = None,
        raise_on_error: bool = True,
    ) -> list[dict[str, Any] | ManyLoRAError]:
        """``GLiNER2.batch_extract_json``; see ``batch_extract``."""
        return self.batch_extract(
            texts,
            schema_lib.json_schema(structures),
            batch_size,
            threshold,
            include_confidence=include_confidence,
            include_spans=include_spans,
            adapter=adapter,
            raise_on_error=raise_on_error,
        )

    # ----------------------------------------------------------------- helpers

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
