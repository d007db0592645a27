"""pb_utils <-> Engine: decode Triton requests, run the engine, answer each request alone.

``model_repository/gliner2/1/model.py`` is a thin shell around ``TritonModelHandler``.
Everything here takes ``pb_utils`` as an argument, so the decoding and error mapping are
unit-testable without a server (the end-to-end tests then run the real one).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from manylora.client import protocol
from manylora.client.protocol import Request
from manylora.engine import INTERNAL, INVALID_ARG, Engine, RequestError, freeze_long_lived

logger = logging.getLogger(__name__)

PROFILE_ENV = "MANYLORA_PROFILE_DIR"  # set: every instance profiles its execute() calls (README)


class ExecuteProfiler:
    """cProfile of an instance's ``execute()`` calls, for finding where a loaded server's host
    time goes: on when ``MANYLORA_PROFILE_DIR`` is set in tritonserver's environment. Stats are
    written to ``<dir>/<instance>-<pid>.prof`` every ``every`` calls and at unload; read them
    with ``python -m pstats`` (several instances' files can be merged there with ``add``). Only
    the thread that runs ``execute`` is profiled (not the adapter loader threads). A failure
    (folder not writable, disk full) is logged once and turns profiling off: it never fails a
    request or the model's load."""

    def __init__(self, folder: Optional[str], name: str, every: int = 50):
        self.path = None if not folder else Path(folder) / f"{name or 'instance'}-{os.getpid()}.prof"
        self.every, self.calls = max(1, every), 0
        self.profile = None
        if self.path is not None:
            try:
                import cProfile

                self.path.parent.mkdir(parents=True, exist_ok=True)
                self.profile = cProfile.Profile()
            except Exception:
                logger.exception("%s=%s: profiling stays off", PROFILE_ENV, folder)

    def __enter__(self):
        if self.profile is not None:
            try:
                self.profile.enable()
            except Exception:  # e.g. another profiler is active in this thread
                self._off("starting the execute() profiler")
        return self

    def __exit__(self, *exc) -> None:
        if self.profile is None:
            return
        self.profile.disable()
        self.calls += 1
        if self.calls % self.every == 0:
            self.dump()

    def dump(self) -> None:
        if self.profile is not None:
            try:
                self.profile.dump_stats(str(self.path))
            except Exception:
                self._off(f"writing {self.path}")

    def _off(self, what: str) -> None:
        logger.exception("%s failed; profiling is off for this instance", what)
        self.profile = None


def decode_request(get: Callable[[str], Optional[np.ndarray]]) -> Request:
    """Build a validated Request from a getter of input arrays (None when absent)."""
    try:
        return Request.from_arrays({spec.name: get(spec.name) for spec in protocol.INPUTS})
    except ValueError as exc:
        raise RequestError(INVALID_ARG, str(exc)) from None


def check_model_config(model_config: dict) -> None:
    """The parsed config.pbtxt must declare exactly the tensors of manylora.client.protocol."""
    declared = {
        t["name"]: (t["data_type"], tuple(int(d) for d in t["dims"]), bool(t.get("optional", False)))
        for t in model_config.get("input", []) + model_config.get("output", [])
    }
    expected = {s.name: (s.config_dtype, tuple(s.dims), s.optional) for s in protocol.INPUTS + protocol.OUTPUTS}
    if declared != expected:
        raise ValueError(f"config.pbtxt tensors {declared} do not match the protocol {expected}")


def threads_per_instance(model_config: dict, cpu_count: int) -> int:
    """CPU threads for one instance's torch ops: the host's cores shared by every instance
    of this model on the host (``count`` per listed GPU). Each instance is its own process
    with its own intra-op pool; left at torch's default (all cores each), N instances run
    N x cores threads, and small host ops (adapter loads, decoding) thrash."""
    instances = 0
    for group in model_config.get("instance_group") or [{}]:
        instances += int(group.get("count", 1)) * max(1, len(group.get("gpus") or []))
    return max(1, cpu_count // max(1, instances))


def instance_threads(cpu_threads: int, model_config: dict, cpu_count: int) -> int:
    """The ``cpu_threads`` parameter when set (> 0), else the host's share (threads_per_instance)."""
    return cpu_threads if cpu_threads > 0 else threads_per_instance(model_config, cpu_count)


def instance_device(args: dict) -> str:
    if args.get("model_instance_kind") == "GPU":
        return f"cuda:{int(args.get('model_instance_device_id', 0))}"
    return "cpu"


class TritonModelHandler:
    """What model.py's TritonPythonModel delegates to."""

    def __init__(self, args: dict, pb_utils):
        from manylora.config import EngineConfig

        self.pb_utils = pb_utils
        model_config = json.loads(args["model_config"])
        check_model_config(model_config)
        device = instance_device(args)
        import torch

        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        config = EngineConfig.from_model_config(model_config, model_dir=Path(args["model_repository"]), device=device)
        torch.set_num_threads(instance_threads(config.cpu_threads, model_config, os.cpu_count() or 1))
        logger.info("loading %s on %s (%s)", config.checkpoint, device, config.torch_dtype)
        self.engine = Engine(config)
        from manylora.control import attach_control

        # list / preload / evict / stats from the manylora_control model (README: Adapter control)
        self.control = attach_control(self.engine, args)
        from manylora.metrics import AdapterMetrics

        self.metrics = AdapterMetrics(
            pb_utils, {"model": args.get("model_name", "gliner2"), "instance": args.get("model_instance_name", "")}
        )
        self.profiler = ExecuteProfiler(os.environ.get(PROFILE_ENV), args.get("model_instance_name", ""))
        freeze_long_lived()  # this process keeps its engine for life: no full-collection pauses mid-batch

    def _error(self, exc: RequestError):
        pb = self.pb_utils
        code = getattr(pb.TritonError, exc.code, pb.TritonError.INTERNAL)
        return pb.InferenceResponse(output_tensors=[], error=pb.TritonError(exc.message, code))

    def execute(self, requests: list) -> list:
        """One response per request, in order; never raises (an exception here would fail
        every request of the dynamic batch with Triton's generic INTERNAL error)."""
        with self.profiler:
            return self._execute(requests)

    def _execute(self, requests: list) -> list:
        pb = self.pb_utils
        decoded: list = []
        for request in requests:
            try:
                decoded.append(decode_request(lambda name, r=request: _as_numpy(pb, r, name)))
            except RequestError as exc:
                decoded.append(exc)
            except Exception as exc:
                logger.exception("decoding a request failed")
                decoded.append(RequestError(INTERNAL, f"request could not be decoded: {type(exc).__name__}: {exc}"))
        valid = [d for d in decoded if isinstance(d, Request)]
        answers = iter(self._run(valid))
        responses = []
        for item in decoded:
            result = item if isinstance(item, RequestError) else next(answers)
            if isinstance(result, RequestError):
                responses.append(self._error(result))
            else:
                responses.append(
                    pb.InferenceResponse(output_tensors=[pb.Tensor(protocol.RESULT, protocol.result_array(result))])
                )
        try:
            self.metrics.publish(self.engine)
        except Exception:
            logger.exception("publishing the adapter metrics failed")
        return responses

    def _run(self, requests: list[Request]) -> list:
        """The engine's results. The engine answers bad requests with RequestErrors; should it
        raise instead, the batch is halved until the requests it raises on fail alone (INTERNAL)."""
        if not requests:
            return []
        try:
            return self.engine.run(requests)
        except Exception as exc:
            if len(requests) == 1:
                logger.exception("the engine raised on a request")
                return [RequestError(INTERNAL, f"inference failed: {type(exc).__name__}: {exc}")]
            logger.warning("the engine raised on a batch of %d (%s); splitting it", len(requests), type(exc).__name__)
            half = len(requests) // 2
            return self._run(requests[:half]) + self._run(requests[half:])

    def finalize(self) -> None:
        self.profiler.dump()  # never raises
        self.metrics.close()
        if self.control is not None:
            self.control.close()
        self.engine = None


def _as_numpy(pb_utils, request, name: str) -> Optional[np.ndarray]:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()
