"""tritonclient plumbing: InferInput lists for both protocols, and one transport per protocol.

tritonclient's gRPC and HTTP modules are imported on first use, so a gRPC user never
imports gevent and a protocol-only import stays light. Both transports hand out futures
with ``result()`` and ``cancel()``.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from typing import Any

from . import protocol

PROTOCOLS = ("grpc", "http")
DEFAULT_URLS = {"grpc": "localhost:8001", "http": "localhost:8000"}


def triton_module(name: str):
    """``tritonclient.grpc`` or ``tritonclient.http``."""
    if name == "grpc":
        import tritonclient.grpc as module
    elif name == "http":
        import tritonclient.http as module
    else:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {name!r}")
    return module


def infer_inputs(name: str, request: protocol.Request) -> list[Any]:
    """The tritonclient ``InferInput`` list for one request over protocol ``name``.

    All seven inputs are sent, shaped ``[1, 1]``; HTTP sends tensors as binary data.
    """
    module = triton_module(name)
    inputs = []
    for tensor_name, array in request.to_arrays().items():
        spec = protocol.SPECS[tensor_name]
        infer_input = module.InferInput(tensor_name, list(array.shape), spec.triton_dtype)
        if name == "http":
            infer_input.set_data_from_numpy(array, binary_data=True)
        else:
            infer_input.set_data_from_numpy(array)
        inputs.append(infer_input)
    return inputs


def requested_outputs(name: str) -> list[Any]:
    module = triton_module(name)
    if name == "http":
        return [module.InferRequestedOutput(protocol.RESULT, binary_data=True)]
    return [module.InferRequestedOutput(protocol.RESULT)]


class GrpcTransport:
    """Futures over ``tritonclient.grpc.InferenceServerClient.async_infer``; thread-safe."""

    name = "grpc"

    def __init__(self, url: str, timeout: float | None, concurrency: int):
        self.triton = triton_module("grpc").InferenceServerClient(url)
        self._timeout = timeout
        self._outputs = requested_outputs("grpc")

    def call(self, fn):
        """``fn(client)``, in the calling thread."""
        return fn(self.triton)

    def infer(self, model_name: str, request: protocol.Request):
        return self.triton.infer(
            model_name,
            infer_inputs("grpc", request),
            outputs=self._outputs,
            client_timeout=self._timeout,
            headers=protocol.routing_headers(request),
        )

    def submit(self, model_name: str, request: protocol.Request) -> _GrpcFuture:
        future = _GrpcFuture()
        future.call = self.triton.async_infer(
            model_name,
            infer_inputs("grpc", request),
            callback=future.done,
            outputs=self._outputs,
            client_timeout=self._timeout,
            headers=protocol.routing_headers(request),
        )
        return future

    def close(self):
        self.triton.close()


class _GrpcFuture:
    """Result of one async_infer; gRPC completes it from its own thread."""

    def __init__(self):
        self.call = None  # tritonclient.grpc CallContext
        self._done = threading.Event()
        self._result = self._error = None

    def done(self, result, error):
        self._result, self._error = result, error
        self._done.set()

    def result(self):
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._result

    def cancel(self):
        if self.call is not None:
            self.call.cancel()


class HttpTransport:
    """Blocking calls on worker threads, each with its own tritonclient.http client.

    Not tritonclient.http's own ``async_infer``: in 2.51 it sleeps 10 ms after every
    submit (to hand control to gevent), which caps one client at ~100 requests/s and
    lets the dynamic batcher see only a couple of requests at a time. Every call, the
    server helpers included, runs on a worker: a gevent-based client must stay on its
    thread's hub, and is closed by that thread, so this transport is thread-safe.
    """

    name = "http"

    def __init__(self, url: str, timeout: float | None, concurrency: int):
        self._module = triton_module("http")
        self._url = url
        self._client_kwargs = {"concurrency": 1}
        if timeout is not None:
            self._client_kwargs.update(connection_timeout=timeout, network_timeout=timeout)
        self._outputs = requested_outputs("http")
        self._concurrency = concurrency
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._workers: list = []
        self._lock = threading.Lock()
        self._closed = False

    def call(self, fn):
        """``fn(client)`` on a worker thread, waited for."""
        return self._run(fn).result()

    def _infer(self, client, model_name: str, request: protocol.Request):
        headers = protocol.routing_headers(request)
        return client.infer(model_name, infer_inputs("http", request), outputs=self._outputs, headers=headers)

    def infer(self, model_name: str, request: protocol.Request):
        return self.call(lambda client: self._infer(client, model_name, request))

    def submit(self, model_name: str, request: protocol.Request) -> concurrent.futures.Future:
        return self._run(lambda client: self._infer(client, model_name, request))

    def close(self):
        with self._lock:
            workers, self._workers, self._closed = self._workers, [], True
        for _ in workers:
            self._jobs.put(None)
        for worker in workers:
            worker.join()

    def _run(self, fn) -> concurrent.futures.Future:
        with self._lock:
            if self._closed:
                raise RuntimeError("the client is closed")
            if not self._workers:
                self._workers = [
                    threading.Thread(target=self._work, name=f"manylora-http-{i}", daemon=True)
                    for i in range(self._concurrency)
                ]
                for worker in self._workers:
                    worker.start()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((future, fn))
        return future

    def _work(self):
        client = None
        try:
            while (job := self._jobs.get()) is not None:
                future, fn = job
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    if client is None:
                        client = self._module.InferenceServerClient(self._url, **self._client_kwargs)
                    future.set_result(fn(client))
                except BaseException as exc:  # handed to the caller
                    future.set_exception(exc)
        finally:
            if client is not None:
                client.close()


def make_transport(name: str, url: str, timeout: float | None, concurrency: int):
    transports = {"grpc": GrpcTransport, "http": HttpTransport}
    if name not in transports:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {name!r}")
    return transports[name](url, timeout, concurrency)
