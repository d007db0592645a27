"""tritonclient plumbing: InferInput lists for both protocols, and one submit() per protocol.

tritonclient's gRPC and HTTP modules are imported on first use, so a gRPC user never
imports gevent and a protocol-only import stays light.
"""

from __future__ import annotations

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

    All six inputs are sent, shaped ``[1, 1]``; HTTP sends tensors as binary data.
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

    def infer(self, model_name: str, request: protocol.Request):
        return self.triton.infer(
            model_name, infer_inputs("grpc", request), outputs=self._outputs, client_timeout=self._timeout
        )

    def submit(self, model_name: str, request: protocol.Request) -> _GrpcFuture:
        future = _GrpcFuture()
        future.call = self.triton.async_infer(
            model_name,
            infer_inputs("grpc", request),
            callback=future.done,
            outputs=self._outputs,
            client_timeout=self._timeout,
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


class _HttpFuture:
    """Result of one async_infer over HTTP (a greenlet in tritonclient's pool)."""

    def __init__(self, handle):
        self._handle = handle

    def result(self):
        return self._handle.get_result()

    def cancel(self):
        """Nothing to do: the pool finishes the request and the result is dropped."""


class HttpTransport:
    """Futures over ``tritonclient.http.InferenceServerClient.async_infer``.

    The HTTP client runs on gevent: use it from the thread that created it.
    ``concurrency`` sizes its connection pool (requests in flight).
    """

    name = "http"

    def __init__(self, url: str, timeout: float | None, concurrency: int):
        kwargs = {"concurrency": concurrency}
        if timeout is not None:
            kwargs.update(connection_timeout=timeout, network_timeout=timeout)
        self.triton = triton_module("http").InferenceServerClient(url, **kwargs)
        self._outputs = requested_outputs("http")

    def infer(self, model_name: str, request: protocol.Request):
        return self.triton.infer(model_name, infer_inputs("http", request), outputs=self._outputs)

    def submit(self, model_name: str, request: protocol.Request) -> _HttpFuture:
        return _HttpFuture(self.triton.async_infer(model_name, infer_inputs("http", request), outputs=self._outputs))

    def close(self):
        self.triton.close()


def make_transport(name: str, url: str, timeout: float | None, concurrency: int):
    transports = {"grpc": GrpcTransport, "http": HttpTransport}
    if name not in transports:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {name!r}")
    return transports[name](url, timeout, concurrency)
