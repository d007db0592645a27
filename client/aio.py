"""AsyncManyLoRAClient: the ManyLoRAClient API on asyncio, over ``tritonclient.grpc.aio``.

    from manylora.client.aio import AsyncManyLoRAClient
    async with AsyncManyLoRAClient("localhost:8001", adapter="acme-ner") as client:
        await client.extract_entities("Tim Cook runs Apple.", ["person", "company"])

Every GLiNER2 method of ``ManyLoRAClient`` is here with the same parameters and returns
an awaitable of the same result; arguments are checked when the method is called, the
requests go out when it is awaited. ``format_results`` and ``create_schema`` need no
server and stay plain methods. gRPC only (tritonclient's HTTP aio client needs aiohttp).
"""

from __future__ import annotations

import asyncio
from typing import Any

from tritonclient.utils import InferenceServerException

from . import protocol, transport
from .client import DEFAULT_CONCURRENCY, Request, _decode_response, _GLiNER2Methods, _Plan
from .errors import ManyLoRAError, error_from_exception
from .protocol import MODEL_NAME


class AsyncManyLoRAClient(_GLiNER2Methods):
    """Client of the ManyLoRA ``gliner2`` Triton model on asyncio (gRPC).

    Args:
        url: ``HOST:PORT`` of Triton's gRPC endpoint (no scheme); default ``localhost:8001``.
        model_name: Triton model name.
        adapter: Default LoRA adapter id for every call; None or ``""`` = base model.
        timeout: Seconds: the gRPC deadline per request; None waits forever.
        concurrency: Requests a batch call keeps in flight by default.

    Create it inside the event loop that uses it; ``async with`` or ``await close()``.
    """

    def __init__(
        self,
        url: str | None = None,
        model_name: str = MODEL_NAME,
        adapter: str | None = None,
        timeout: float | None = None,
        concurrency: int = DEFAULT_CONCURRENCY,
    ):
        url = transport.DEFAULT_URLS["grpc"] if url is None else url
        if "://" in url:
            raise ValueError(f"url must be HOST:PORT without a scheme, got {url!r}")
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"concurrency must be a positive int, got {concurrency!r}")
        if adapter is not None and not isinstance(adapter, str):
            raise ValueError(f"adapter must be a str or None, got {type(adapter).__name__}")
        import tritonclient.grpc.aio as grpc_aio

        self.url, self.model_name, self.adapter = url, model_name, adapter
        self.timeout, self.concurrency = timeout, concurrency
        self.triton = grpc_aio.InferenceServerClient(url)
        self._outputs = transport.requested_outputs("grpc")
        self._closed = False

    def __repr__(self) -> str:
        return f"AsyncManyLoRAClient(url={self.url!r}, model_name={self.model_name!r}, adapter={self.adapter!r})"

    async def __aenter__(self) -> AsyncManyLoRAClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await self.triton.close()

    # ------------------------------------------------------------------ server

    async def is_live(self) -> bool:
        """True when the server answers its liveness check; False when unreachable."""
        try:
            return bool(await self.triton.is_server_live())
        except (InferenceServerException, OSError):
            return False

    async def is_ready(self) -> bool:
        """True when the server and the model are ready; False when unreachable."""
        try:
            return bool(await self.triton.is_server_ready()) and bool(await self.triton.is_model_ready(self.model_name))
        except (InferenceServerException, OSError):
            return False

    async def wait_until_ready(self, timeout: float = 60.0, interval: float = 0.5) -> None:
        """Poll ``is_ready()``; raise ManyLoRAError (UNAVAILABLE) after ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not await self.is_ready():
            if loop.time() >= deadline:
                raise ManyLoRAError(
                    f"model {self.model_name!r} at {self.url} not ready after {timeout} s", "UNAVAILABLE"
                )
            await asyncio.sleep(interval)

    async def model_metadata(self) -> dict[str, Any]:
        """Triton's model metadata, shapes as ints."""
        try:
            metadata = await self.triton.get_model_metadata(self.model_name, as_json=True)
        except (InferenceServerException, OSError) as exc:
            raise error_from_exception(exc) from exc
        for tensor in metadata.get("inputs", []) + metadata.get("outputs", []):
            tensor["shape"] = [int(dim) for dim in tensor.get("shape", [])]
        return metadata

    async def model_config(self) -> dict[str, Any]:
        """The model's config as Triton parsed it (int64 values are strings)."""
        try:
            return (await self.triton.get_model_config(self.model_name, as_json=True))["config"]
        except (InferenceServerException, OSError) as exc:
            raise error_from_exception(exc) from exc

    async def health(self) -> dict[str, Any]:
        """Liveness and readiness of the server and the model, never raising."""
        report = {"url": self.url, "protocol": "grpc", "model": self.model_name, "live": await self.is_live()}
        report["ready"] = report["model_ready"] = False
        try:
            report["ready"] = bool(await self.triton.is_server_ready())
            report["model_ready"] = bool(await self.triton.is_model_ready(self.model_name))
        except (InferenceServerException, OSError):
            pass
        return report

    # ---------------------------------------------------------------- requests

    def request(
        self,
        text: str,
        schema,
        threshold: float = protocol.DEFAULT_THRESHOLD,
        *,
        include_confidence: bool = False,
        include_spans: bool = False,
        adapter: str | None = None,
    ) -> Request:
        """One validated request (as ``ManyLoRAClient.request``)."""
        from .client import _encoded

        return Request(
            text=text,
            schema=_encoded(schema).json,
            adapter=self._adapter(adapter),
            threshold=threshold,
            include_confidence=include_confidence,
            include_spans=include_spans,
        )

    async def infer(self, request: Request) -> dict[str, Any]:
        """Send one request and wait; raises ManyLoRAError on failure."""
        if self._closed:
            raise ManyLoRAError("the client is closed", "UNAVAILABLE")
        try:
            response = await self.triton.infer(
                self.model_name,
                transport.infer_inputs("grpc", request),
                outputs=self._outputs,
                client_timeout=self.timeout,
                headers=protocol.routing_headers(request),
            )
        except Exception as exc:
            raise error_from_exception(exc) from exc
        return _decode_response(response)

    async def _complete(self, plan: _Plan):
        """The plan's requests, at most ``plan.window`` in flight; the first failure cancels
        the rest when the plan raises on errors."""
        answers = list(plan.items)
        positions = [i for i, item in enumerate(plan.items) if isinstance(item, Request)]
        gate = asyncio.Semaphore(plan.window or 1)

        async def one(position: int):
            async with gate:
                try:
                    return await self.infer(plan.items[position])
                except ManyLoRAError as error:
                    error.index = plan.report[position]
                    if plan.raise_on_error:
                        raise
                    return error

        tasks = [asyncio.ensure_future(one(position)) for position in positions]
        try:
            for position, answer in zip(positions, await asyncio.gather(*tasks)):
                answers[position] = answer
        finally:
            for task in tasks:
                task.cancel()
        return plan.finish(answers)

    async def _single(self, result):
        return (await result)[0]
