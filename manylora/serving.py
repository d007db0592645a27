"""pb_utils <-> the stages: decode Triton requests, run them, answer each request alone.

``model_repository/gliner2/1/model.py`` (the public model: the CPU front) is a thin shell
around ``TritonModelHandler``, ``model_repository/gliner2_core/1/model.py`` (the GPU stage)
around ``CoreModelHandler``.
Everything here takes ``pb_utils`` as an argument, so the decoding and error mapping are
unit-testable without a server (the end-to-end tests then run the real one).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from manylora import wire
from manylora.client import protocol
from manylora.client.protocol import Request
from manylora.engine import Engine, freeze_long_lived
from manylora.errors import CODES, INTERNAL, INVALID_ARG, UNAVAILABLE, RequestError
from manylora.post import pack_compact_rows

logger = logging.getLogger(__name__)

PROFILE_ENV = "MANYLORA_PROFILE_DIR"  # set: every instance profiles its execute() calls (README)
# set too: only the instances of these models (comma list), e.g. gliner2_core alone: profiling
# all 64 fronts as well halved the H200 server's rate (session 18)
PROFILE_MODELS_ENV = "MANYLORA_PROFILE_MODELS"


def profile_folder(model_name: str) -> Optional[str]:
    """Where ``model_name``'s instances write their execute() profiles: ``$MANYLORA_PROFILE_DIR``,
    unless ``$MANYLORA_PROFILE_MODELS`` is set and does not name the model (None: no profiling)."""
    folder = os.environ.get(PROFILE_ENV)
    models = os.environ.get(PROFILE_MODELS_ENV)
    if folder and models is not None and model_name not in {m.strip() for m in models.split(",")}:
        return None
    return folder


class ExecuteProfiler:
    """cProfile of an instance's ``execute()`` calls, for finding where a loaded server's host
    time goes: on when ``MANYLORA_PROFILE_DIR`` is set in tritonserver's environment. Stats are
    written to ``<dir>/<instance>-<pid>.prof`` every ``every`` calls and at unload; read them
    with ``python -m pstats`` (several instances' files can be merged there with ``add``). Before
    Python 3.12 only the profiled thread is seen (``execute``'s, or the GPU stage's GPU thread); from
    3.12 on cProfile sees every thread of the process while it is on (session 18: the GPU stage's
    file held its parse and answer threads too), and a thread waiting for the interpreter lock inside
    a function adds that wait to the function's own time. A failure
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
    """Build a validated Request of one item from a getter of input arrays (None when absent)."""
    try:
        return Request.from_arrays({spec.name: get(spec.name) for spec in protocol.INPUTS})
    except ValueError as exc:
        raise RequestError(INVALID_ARG, str(exc)) from None


def decode_requests(get: Callable[[str], Optional[np.ndarray]]) -> list[Request]:
    """The validated Requests of one Triton request's items ([N, 1] inputs), in order."""
    try:
        return protocol.requests_from_arrays({spec.name: get(spec.name) for spec in protocol.INPUTS})
    except ValueError as exc:
        raise RequestError(INVALID_ARG, str(exc)) from None


def item_error(exc: RequestError, item: int, items: int) -> RequestError:
    """``exc`` of one item, as the error of its whole request: same code, the item named when
    the request has several (Triton answers a request once: one bad item fails them all)."""
    if items == 1:
        return exc.with_traceback(None)  # a kept traceback holds its frame: a cycle
    return RequestError(exc.code, protocol.item_message(exc.message, item, items))


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


class CallDeadline:
    """Blocking calls with a deadline, for the front's BLS call to the GPU stage.

    Why: Triton 2.51's Python backend fails the requests of a dead stub's ``execute()`` in
    progress, but not those its threads were answering through response senders, as the GPU
    stage does. With the GPU-stage stub killed on the CPU, the fronts' ``exec()`` calls never
    returned: every client waited out its own deadline, and the requests queued behind the
    blocked fronts expired in Triton's queue. Here each call runs on a thread of its own; past
    ``seconds`` the caller gets a TimeoutError and the call is left on its thread (its answer,
    should one come, is logged and dropped).

    Bounded threads: such stranded calls are counted, and while ``limit`` of them are, new
    calls fail at once, except one probe call per ``seconds`` (until twice the limit is
    stranded), so that a stage that answers again is found. Any call answered in time, an error
    included (a dead stub's new calls fail at once), shows that calls no longer hang: the count
    starts again from 0, and the calls stranded before stay on their threads uncounted (those of
    a dead stub never return). Callers in flight together can each pass the check, so the count
    may exceed its bound by as many. A thread per call costs ~0.13 ms of host time (this
    repository's 2-core CPU host, ``perf/bench_host_steps.py``: ~8 us per row of 16-row
    batches), against ~0.25 ms of the front's own pre and post per row.
    """

    def __init__(self, seconds: float, limit: int = 4):
        self.seconds, self.limit = seconds, limit
        self._lock = threading.Lock()
        self.stranded = 0  # calls past their deadline, since the last call answered in time
        self._generation = 0  # bumped by each call answered in time
        self._next_probe = 0.0

    def call(self, fn):
        with self._lock:
            if self.stranded >= self.limit:
                now = time.monotonic()
                if self.stranded >= 2 * self.limit or now < self._next_probe:
                    raise TimeoutError(
                        f"{self.stranded} calls past their {self.seconds:g} s deadline are still unanswered"
                    )
                self._next_probe = float("inf")  # this call is the probe: none other while it runs
                probe = True
            else:
                probe = False
        done = threading.Event()
        state: dict = {"generation": None}  # set when the call is abandoned

        def run() -> None:
            started = time.monotonic()
            try:
                state["value"] = fn()
            except Exception as exc:  # handed to the caller
                state["error"] = exc
            except BaseException as exc:  # not an answer: never let it end the caller's batch unanswered
                state["error"] = RuntimeError(f"{type(exc).__name__}: {exc}")
            finally:
                with self._lock:
                    state["finished"] = True
                    if state["generation"] is not None:
                        if state["generation"] == self._generation:
                            self.stranded -= 1
                        logger.warning(
                            "a call answered %.1f s after its %g s deadline; its answer is dropped",
                            time.monotonic() - started,
                            self.seconds,
                        )
                done.set()

        threading.Thread(target=run, name="manylora-core-call", daemon=True).start()
        done.wait(self.seconds)
        with self._lock:
            if not state.get("finished"):
                state["generation"] = self._generation
                self.stranded += 1
                if probe:  # the next probe one deadline after this one gave up
                    self._next_probe = time.monotonic() + self.seconds
                raise TimeoutError(f"no answer within {self.seconds:g} s")
            self._generation += 1  # answered in time: calls do not hang (any more)
            self.stranded, self._next_probe = 0, 0.0
        if "error" in state:
            raise state["error"]
        return state["value"]


class TritonModelHandler:
    """What model.py's TritonPythonModel of the public ``gliner2`` model delegates to.

    With the ``core_model`` parameter set (the committed repository: ``gliner2_core``), this
    instance is a CPU front: pre and post here, the GPU stage through one BLS call per batch
    (``_execute_front``). Without it, this instance runs every stage itself (``_execute``)."""

    core_model = ""  # class default: tests build handlers without __init__ (the single design)
    _inflight = None  # front_inflight > 1: (thread pool, semaphore, futures) of the batches in the GPU stage
    _core_deadline = None  # the front's CallDeadline for the GPU stage's calls (None: exec() waits as long as it takes)

    def __init__(self, args: dict, pb_utils):
        from manylora.config import EngineConfig

        self.pb_utils = pb_utils
        model_config = json.loads(args["model_config"])
        check_model_config(model_config)
        device = instance_device(args)
        import torch

        config = EngineConfig.from_model_config(model_config, model_dir=Path(args["model_repository"]), device=device)
        self.core_model = config.core_model
        self.profiler = ExecuteProfiler(profile_folder(args.get("model_name", "")), args.get("model_instance_name", ""))
        self.engine = self.control = self.metrics = None
        if self.core_model:
            from manylora.engine import load_gliner2_skeleton
            from manylora.post import PostDecoder
            from manylora.pre import Preprocessor

            # pre and post need the processor (tokenizer) and the model's decoding settings,
            # not its weights: a front instance holds no tensors of the model
            torch.set_num_threads(1)
            model = load_gliner2_skeleton(config.checkpoint)
            self.post = PostDecoder.from_model(model)
            self.pre = Preprocessor(model, config.max_request_tokens)
            logger.info("front of %s: pre and post here, the GPU stage in model %s", config.checkpoint, self.core_model)
            if config.front_inflight > 1:
                self.start_inflight(config.front_inflight)
            # up to front_inflight calls are in the GPU stage at once, so as many can be stranded by
            # one death of its stub: four such deaths before this instance refuses
            self._core_deadline = CallDeadline(config.core_timeout, limit=4 * config.front_inflight)
        else:
            self._load_engine(config, args, model_config, device)
        freeze_long_lived()  # this process keeps its engine for life: no full-collection pauses mid-batch

    def _load_engine(self, config, args: dict, model_config: dict, device: str) -> None:
        import torch

        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        torch.set_num_threads(instance_threads(config.cpu_threads, model_config, os.cpu_count() or 1))
        logger.info("loading %s on %s (%s)", config.checkpoint, device, config.torch_dtype)
        self.engine = Engine(config)
        from manylora.control import attach_control

        # list / preload / evict / stats from the manylora_control model (README: Adapter control)
        self.control = attach_control(self.engine, args)
        self.metrics = self._make_metrics(args)

    def _make_metrics(self, args: dict):
        from manylora.metrics import AdapterMetrics

        return AdapterMetrics(
            self.pb_utils, {"model": args.get("model_name", "gliner2"), "instance": args.get("model_instance_name", "")}
        )

    def _error(self, exc: RequestError):
        pb = self.pb_utils
        code = getattr(pb.TritonError, exc.code, pb.TritonError.INTERNAL)
        return pb.InferenceResponse(output_tensors=[], error=pb.TritonError(exc.message, code))

    def _decode_all(self, requests: list) -> list:
        """Per request: the list of its items' Requests (one per item of its [N, 1] inputs), or
        the RequestError that fails it."""
        pb = self.pb_utils
        decoded: list = []
        for request in requests:
            try:
                decoded.append(decode_requests(lambda name, r=request: _as_numpy(pb, r, name)))
            except RequestError as exc:
                decoded.append(exc.with_traceback(None))  # a kept traceback holds this frame: a cycle
            except Exception as exc:
                logger.exception("decoding a request failed")
                decoded.append(RequestError(INTERNAL, f"request could not be decoded: {type(exc).__name__}: {exc}"))
        return decoded

    def _respond(self, results: list) -> list:
        """One response per request: its RESULT ([N, 1], an answer per item), or its error.

        ``results[i]`` is request i's RequestError, or the list of its items' answers, where
        an item's answer may be a RequestError: the first such item fails the whole request
        (a request is answered once, so its good items are not answered either)."""
        pb = self.pb_utils
        responses = []
        for result in results:
            if not isinstance(result, RequestError):
                failed = [(k, r) for k, r in enumerate(result) if isinstance(r, RequestError)]
                if failed:
                    result = item_error(failed[0][1], failed[0][0], len(result))
            if isinstance(result, RequestError):
                responses.append(self._error(result))
                continue
            try:
                array = protocol.result_array(result[0]) if len(result) == 1 else protocol.results_array(result)
            except Exception as exc:  # not JSON-serializable: a bug, this request alone
                logger.exception("encoding a result failed")
                responses.append(self._error(RequestError(INTERNAL, f"encoding the result failed: {exc}")))
                continue
            responses.append(pb.InferenceResponse(output_tensors=[pb.Tensor(protocol.RESULT, array)]))
        return responses

    def execute(self, requests: list) -> list:
        """One response per request, in order (with front_inflight > 1: None, each request
        answered through its response sender); never raises (an exception here would fail
        every request of the dynamic batch with Triton's generic INTERNAL error)."""
        with self.profiler:
            if not self.core_model:
                return self._execute(requests)
            if self._inflight is not None:
                return self._execute_front_inflight(requests)
            return self._execute_front(requests)

    def _execute(self, requests: list) -> list:
        decoded = self._decode_all(requests)
        valid = [item for group in decoded if not isinstance(group, RequestError) for item in group]
        answers = iter(self._run(valid))
        results = [group if isinstance(group, RequestError) else [next(answers) for _ in group] for group in decoded]
        try:
            self.metrics.publish(self.engine)
        except Exception:
            logger.exception("publishing the adapter metrics failed")
        return self._respond(results)

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

    # ------------------------------------------------------------------ the CPU front
    def _execute_front(self, requests: list) -> list:
        """Front: pre here, every row of the batch to the GPU stage in one BLS request (the
        core's batcher packs it with other fronts' requests), post here.

        A synchronous, non-decoupled ``exec``: Triton runs a non-decoupled model's coroutine
        execute to its end before the next one, so ``async_exec`` would overlap nothing here.
        Measured on the H200 with tritonserver 2.51 (24.10), session 8: with ``async_exec``,
        or with a decoupled GPU stage and ``exec(decoupled=True)``, front stubs turned
        "not healthy" under load (the Python backend's decoupled-BLS deadlock and async_exec
        use-after-free, fixed upstream in python_backend #439, 2026)."""
        return self._front_finish(*self._front_prepare(requests))

    def start_inflight(self, batches: int) -> None:
        """front_inflight > 1: up to ``batches`` batches of this instance in the GPU stage at once."""
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(max_workers=batches, thread_name_prefix="manylora-front")
        self._inflight = (pool, threading.BoundedSemaphore(batches), set())  # set: the batches in flight

    def _execute_front_inflight(self, requests: list):
        """front_inflight > 1: pre here, then the GPU stage's call and post on a pool thread,
        which answers each request through its response sender (exactly one final response, as
        the Python backend's default mode allows since 24.06); returns None. Waits only while
        ``front_inflight`` batches are in the GPU stage."""
        senders = [request.get_response_sender() for request in requests]
        job = self._front_prepare(requests)
        pool, slots, running = self._inflight
        slots.acquire()
        try:
            future = pool.submit(self._finish_and_send, senders, job, slots)
        except RuntimeError:  # the pool is shut down (unloading): answer here
            slots.release()
            self._finish_and_send(senders, job, None)
            return None
        running.add(future)
        future.add_done_callback(self._batch_done)
        return None

    def _batch_done(self, future) -> None:
        self._inflight[2].discard(future)
        if not future.cancelled() and future.exception() is not None:  # a bug: _finish_and_send answers all
            logger.error("a front batch failed", exc_info=future.exception())

    def _finish_and_send(self, senders: list, job: tuple, slots) -> None:
        try:
            try:
                responses = self._front_finish(*job)
            except Exception as exc:  # never leave a request unanswered
                logger.exception("the front failed on a batch")
                error = RequestError(INTERNAL, f"inference failed: {type(exc).__name__}: {exc}")
                responses = [self._error(error) for _ in senders]
            self._send(senders, responses)
        finally:
            if slots is not None:
                slots.release()

    def _send(self, senders: list, responses: list) -> None:
        """Each response through its request's sender, as the one final response."""
        final = self.pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        for sender, response in zip(senders, responses):
            try:
                sender.send(response, flags=final)
            except Exception:  # the client is gone (cancelled): nothing else to answer
                logger.exception("sending a response failed")

    def _front_prepare(self, requests: list) -> tuple[list, list, list]:
        """(results, prepared, places): per request its RequestError or a list to fill with
        its items' answers; every row to the GPU stage; (request, item) of each row."""
        decoded = self._decode_all(requests)
        results: list = list(decoded)  # per request: its RequestError, or its items' answers
        prepared, places = [], []  # every row to the GPU stage; (request, item) of each
        for index, group in enumerate(decoded):
            if isinstance(group, RequestError):
                continue
            rows = []
            for item, request in enumerate(group):
                try:
                    rows.append(self.pre.prepare(index, request))
                except RequestError as exc:  # the request fails: none of its rows is sent
                    results[index] = item_error(exc, item, len(group))
                    break
                except Exception as exc:  # a bug must not fail the other requests of the batch
                    logger.exception("request %d could not be prepared", index)
                    error = RequestError(INTERNAL, f"request could not be prepared: {type(exc).__name__}: {exc}")
                    results[index] = item_error(error, item, len(group))
                    break
            else:
                results[index] = [None] * len(group)
                prepared.extend(rows)
                places.extend((index, item) for item in range(len(group)))
        return results, prepared, places

    def _front_finish(self, results: list, prepared: list, places: list) -> list:
        """The GPU stage's call for the prepared rows, post, and one response per request."""
        if prepared:
            try:
                call = self._core_request(prepared).exec
                answer = call() if self._core_deadline is None else self._core_deadline.call(call)
            except Exception as exc:
                answer = exc
            for (index, item), p, row in zip(places, prepared, self._core_rows(answer, len(prepared))):
                results[index][item] = row if isinstance(row, RequestError) else self._post(p, row)
        return self._respond(results)

    def _core_request(self, prepared: list):
        pb = self.pb_utils
        records = [p.record for p in prepared]

        def ints(values) -> np.ndarray:
            return np.asarray(values, dtype=np.int32).reshape(1, -1)

        def texts(values) -> np.ndarray:
            return np.array([[v.encode("utf-8") for v in values]], dtype=np.object_)

        inputs = [
            pb.Tensor("INPUT_IDS", ints([t for r in records for t in r.input_ids])),
            pb.Tensor("ROW_TOKENS", ints([len(r.input_ids) for r in records])),
            pb.Tensor("WORD_POS", ints([w for r in records for w in r.text_word_first_positions])),
            pb.Tensor("ROW_WORDS", ints([len(r.text_word_first_positions) for r in records])),
            pb.Tensor("SCHEMA", texts([p.request.schema for p in prepared])),
            pb.Tensor("ADAPTER_ID", texts([p.request.adapter for p in prepared])),
            pb.Tensor("T_MIN", np.asarray([p.t_min for p in prepared], dtype=np.float32).reshape(1, -1)),
        ]
        return pb.InferenceRequest(
            model_name=self.core_model, inputs=inputs, requested_output_names=list(wire.CORE_OUTPUTS)
        )

    def _core_rows(self, answer, rows: int) -> list:
        """Each row's CompactRow, or the RequestError the GPU stage answered it with."""
        from manylora.post import CompactRow

        pb = self.pb_utils
        try:
            if isinstance(answer, TimeoutError):  # CallDeadline: the stage is slow, frozen or dead
                raise RequestError(
                    UNAVAILABLE,
                    f"the GPU stage did not answer: {answer} (core_timeout); retry later; if every request"
                    " gets this, gliner2_core's stub has probably died: unload and load gliner2_core",
                )
            if isinstance(answer, BaseException):
                raise RequestError(UNAVAILABLE, f"the GPU stage could not be reached: {answer}")
            if answer.has_error():
                raise RequestError(UNAVAILABLE, f"the GPU stage failed: {answer.error().message()}")
            statuses = pb.get_output_tensor_by_name(answer, "STATUS").as_numpy().reshape(-1)
            packed = pb.get_output_tensor_by_name(answer, "COMPACT").as_numpy().reshape(-1)
            if len(statuses) != rows or len(packed) != 1:
                raise RequestError(INTERNAL, f"the GPU stage answered {len(statuses)} rows for {rows}")
            arrays = wire.unpack_rows(packed[0])
            if len(arrays) != rows:
                raise RequestError(INTERNAL, f"the GPU stage answered {len(arrays)} rows for {rows}")
        except RequestError as exc:
            return [exc] * rows
        except Exception as exc:
            return [RequestError(INTERNAL, f"the GPU stage's answer is malformed: {exc}")] * rows
        out: list = []
        for status, row in zip(statuses, arrays):
            status = status.decode("utf-8", "replace") if isinstance(status, bytes) else str(status)
            if status or row is None:
                code, _, message = (status or "INTERNAL\tthe GPU stage answered no row").partition("\t")
                out.append(RequestError(code if code in CODES else INTERNAL, message))
                continue
            try:
                out.append(CompactRow.from_arrays(row))
            except Exception as exc:
                out.append(RequestError(INTERNAL, f"the GPU stage's answer is malformed: {exc}"))
        return out

    def _post(self, p, row):
        """The GLiNER2 result of one row from its CompactRow (or an INTERNAL RequestError)."""
        try:
            r = p.request
            return self.post.decode(row, p.record, p.metadata, r.threshold, r.include_confidence, r.include_spans)
        except Exception as exc:
            logger.exception("request %d could not be decoded", p.index)
            return RequestError(INTERNAL, f"decoding failed: {type(exc).__name__}: {exc}")

    def finalize(self) -> None:
        if self._inflight is not None:  # the batches in the GPU stage are still answered, for up to 30 s
            from concurrent.futures import wait

            pool, _, running = self._inflight
            pool.shutdown(wait=False)
            _, late = wait(list(running), timeout=30)
            if late:
                logger.error("%d front batches still in the GPU stage at unload", len(late))
        self.profiler.dump()  # never raises
        if self.metrics is not None:
            self.metrics.close()
        if self.control is not None:
            self.control.close()
        self.engine = None


def core_handler(args: dict, pb_utils):
    """What gliner2_core's model.py delegates to: a ``CoreModelHandler``, or with ``core_process: on``
    a ``core_process.CoreProcessHandler`` (the engine in a child process)."""
    from manylora.config import EngineConfig

    config = EngineConfig.from_model_config(
        args["model_config"], model_dir=Path(args["model_repository"]), device=instance_device(args)
    )
    if config.core_process:
        from manylora.core_process import process_handler

        return process_handler(args, pb_utils, config)
    return CoreModelHandler(args, pb_utils, config)


class CoreModelHandler(TritonModelHandler):
    """``gliner2_core``: the GPU stage. Its rows come from the fronts' BLS calls (any client
    can call it too: every input is checked); it holds the only adapter cache of its GPU.

    With ``core_overlap`` on (default), ``execute`` only parses a batch, queues it and returns
    None; one GPU thread runs the queued batches (those that wait are merged into one engine
    call, up to two token budgets) and an answer thread packs each request's one response and
    sends it with its response sender (the Python backend's default mode allows that since
    24.06: exactly one response per request, with the final flag). So the next batch is parsed
    and the last one answered while the GPU runs, in one process (one adapter cache). The
    model stays non-decoupled: measured on tritonserver 2.51, decoupled BLS calls took front
    stubs down under load. ``core_overlap: off`` runs each batch in turn inside ``execute``."""

    overlap = False  # class default: tests build handlers without __init__
    MERGE_BUDGETS = 2  # queued batches merged into one engine call: up to this many token budgets
    metrics_interval = 0.25  # seconds: the overlapped GPU stage publishes its metrics at most this often (config)
    _unpublished = False  # calls delivered since the metrics were last published
    _published_at = 0.0  # time.monotonic() of that publish

    def __init__(self, args: dict, pb_utils, config=None):
        from manylora.config import EngineConfig

        self.pb_utils = pb_utils
        model_config = json.loads(args["model_config"])
        device = instance_device(args)
        if config is None:  # core_handler passes the one it parsed
            config = EngineConfig.from_model_config(
                model_config, model_dir=Path(args["model_repository"]), device=device
            )
        self.profiler = ExecuteProfiler(profile_folder(args.get("model_name", "")), args.get("model_instance_name", ""))
        self.core_model = ""
        self._load_engine(config, args, model_config, device)
        self.vocab = len(self.engine.processor.tokenizer)
        self.metrics_interval = config.metrics_interval
        if config.core_overlap:
            self.start_overlap()
        freeze_long_lived()

    def start_overlap(self) -> None:
        """Start the GPU and answer threads (finalize stops them)."""
        import queue

        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._answers: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._gpu_loop, name="manylora-core-gpu", daemon=True),
            threading.Thread(target=self._answer_loop, name="manylora-core-answer", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        self.overlap = True

    def execute(self, requests: list):
        """core_overlap off: one response per request, in order. On: None; every request is
        answered through its response sender by the answer thread."""
        if not self.overlap:
            with self.profiler:
                job = self._parse(requests)
                return self._responses(job, self._run_job(job))
        started = time.perf_counter()
        job = self._parse(requests)  # the GPU thread profiles (one cProfile per process)
        phases = self.engine.phase_seconds
        phases["parse"] += time.perf_counter() - started
        self._jobs.put(([request.get_response_sender() for request in requests], job, time.monotonic()))
        return None

    @property
    def request_limit(self) -> int:
        """The longest row (tokens) this GPU stage takes: its ``max_request_tokens``."""
        return self.engine.config.max_request_tokens

    def _parse(self, requests: list) -> tuple[list, list]:
        """(groups, items): groups[i] is (first item, rows) of request i, or its RequestError."""
        items, groups = [], []
        for request in requests:
            try:
                group = self._items(request)
                groups.append((len(items), len(group)))
                items.extend(group)
            except RequestError as exc:
                groups.append(exc.with_traceback(None))
            except Exception as exc:
                groups.append(RequestError(INVALID_ARG, f"bad GPU-stage request: {type(exc).__name__}: {exc}"))
        return groups, items

    def _run_job(self, job: tuple[list, list]) -> list:
        """Each item's CompactRow, or its RequestError."""
        _, items = job
        return self._item_answers(items, self._run_core([item for item in items if not isinstance(item, RequestError)]))

    def _item_answers(self, items: list, results: list, publish: bool = True) -> list:
        """Each item's answer: its RequestError, or the next of ``results`` (the engine's, for
        the items that are rows, in order). Publishes the adapter metrics unless ``publish`` is
        False (the GPU thread publishes on its own schedule: ``_publish_when_due``)."""
        done = iter(results)
        answers = [item if isinstance(item, RequestError) else next(done) for item in items]
        if publish:
            self._publish()
        return answers

    def _publish(self) -> None:
        try:
            self.metrics.publish(self.engine)
        except Exception:
            logger.exception("publishing the adapter metrics failed")

    def _responses(self, job: tuple[list, list], answers: list) -> list:
        responses = []
        for group in job[0]:
            if isinstance(group, RequestError):
                responses.append(self._error(group))
            else:
                first, rows = group
                try:
                    responses.append(self._core_response(answers[first : first + rows]))
                except Exception as exc:
                    logger.exception("packing a GPU-stage answer failed")
                    responses.append(self._error(RequestError(INTERNAL, f"packing the answer failed: {exc}")))
        return responses

    def _gpu_loop(self) -> None:
        """GPU thread: run queued jobs, merging those that wait, until finalize queues None.

        A merged call's last chunk is finished (its host work, then its answers queued) once
        the next call's first forward is queued, or at once when no job waits
        (``Engine.core_begin``): under load the GPU runs the next forward meanwhile."""
        import queue

        budget = self.MERGE_BUDGETS * self.engine.config.max_batch_tokens
        pending = None  # the last call's delivery, due
        phases = self.engine.phase_seconds
        cpu = time.thread_time()
        while True:
            self._publish_when_due()
            now = time.thread_time()  # this thread's CPU (with CUDA's spin-waits), between waits
            phases["gpu_thread_cpu"] += now - cpu
            cpu = now
            if pending is None:
                started = time.perf_counter()
                first = self._next_job()
                phases["idle"] += time.perf_counter() - started
            else:
                try:
                    first = self._jobs.get_nowait()
                except queue.Empty:
                    pending()
                    pending = None
                    continue
            if first is None:
                if pending is not None:
                    pending()
                self._answers.put(None)
                return
            jobs, tokens = [first], _job_tokens(first[1][1])
            while tokens < budget:
                try:
                    nxt = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._jobs.put(None)  # stop after this merged call
                    break
                jobs.append(nxt)
                tokens += _job_tokens(nxt[1][1])
            with self.profiler:
                pending = self._begin_jobs(jobs, pending)
                if not self.engine.config.chunk_pipeline:  # the A/B's other arm: every call delivered at once
                    pending()
                    pending = None

    def _begin_jobs(self, jobs: list, before: Optional[Callable[[], None]]) -> Callable[[], None]:
        """Queue the merged call of ``jobs``; ``before`` (the last call's delivery) runs once its
        first forward is queued. Returns this call's delivery: it finishes the call and queues
        each job's answers for the answer thread. Neither raises: a failure answers its rows.
        Each call's rows, wall time and its jobs' waits in the queue go to the engine's
        ``call_stats`` (the metrics manylora_core_call_rows / _call_seconds / _queue_seconds)."""
        started = time.monotonic()
        waits = [started - queued for _, _, queued in jobs]
        merged_items = [item for _, (_, items), _ in jobs for item in items]
        rows = [item for item in merged_items if not isinstance(item, RequestError)]
        before = _once(before)
        try:
            finish = self.engine.core_begin(rows, before)
        except Exception:  # core_begin answers per row; this is a bug: the slower path, which splits
            logger.exception("the GPU thread failed to queue a merged batch")
            before()

            def finish(rows=rows):
                return self._run_core(rows)

        def deliver() -> None:
            try:
                results = finish()
                self.engine.call_stats.append((len(rows), time.monotonic() - started, waits))
                answers = self._item_answers(merged_items, results, publish=False)
            except Exception as exc:  # never leave a request unanswered
                logger.exception("the GPU thread failed on a merged batch")
                error = RequestError(INTERNAL, f"inference failed: {type(exc).__name__}: {exc}")
                answers = [error] * len(merged_items)
            self._unpublished = True  # the call's counters (cache events, phases) changed either way
            offset = 0
            for senders, job, _ in jobs:
                n = len(job[1])
                self._answers.put((senders, job, answers[offset : offset + n]))
                offset += n

        return _once(deliver)

    def _next_job(self):
        """The next queued job, waiting for one; the metrics are published meanwhile when due."""
        import queue

        while True:
            wait = self._publish_when_due()
            try:
                return self._jobs.get() if wait is None else self._jobs.get(timeout=wait)
            except queue.Empty:
                continue

    def _publish_when_due(self) -> Optional[float]:
        """Publish the metrics if calls were delivered since the last publish and the last one is
        metrics_interval old; returns the seconds until a publish is due (None: nothing to).

        Until session 19 every call published in the GPU thread before its answers were queued:
        1.2-1.5 ms of a one-row call and ~2 ms of each call under load (H200,
        manylora_core_phase_seconds_total{phase="publish"}, 6f1e60a), each metric update being a
        message to the Triton process. Now at most every metrics_interval, after the answers."""
        if not self._unpublished:
            return None
        wait = self._published_at + self.metrics_interval - time.monotonic()
        if wait > 0:
            return wait
        started = time.perf_counter()
        self._unpublished = False
        self._publish()
        self._published_at = time.monotonic()
        self.engine.phase_seconds["publish"] += time.perf_counter() - started
        return None

    def _answer_loop(self) -> None:
        phases = self.engine.phase_seconds
        while True:
            entry = self._answers.get()
            if entry is None:
                return
            started, cpu = time.perf_counter(), time.thread_time()
            senders, job, answers = entry
            try:
                responses = self._responses(job, answers)
            except Exception as exc:  # never leave a request unanswered
                logger.exception("building GPU-stage responses failed")
                responses = [self._error(RequestError(INTERNAL, f"answer failed: {exc}"))] * len(job[0])
            packed = time.perf_counter()
            self._send(senders, responses)
            done = time.perf_counter()
            phases["answer_pack"] += packed - started
            phases["answer_send"] += done - packed
            phases["answer_thread_cpu"] += time.thread_time() - cpu

    def finalize(self) -> None:
        if self.overlap:  # the queued jobs are still answered, then both threads stop
            self._jobs.put(None)
            for thread in self._threads:
                thread.join(30)
            self.overlap = False
        super().finalize()

    def _items(self, request) -> list:
        """The rows of one front request, each (ids, word positions, schema, adapter, t_min), or
        the RequestError of that row alone; raises RequestError for a malformed request."""
        pb = self.pb_utils
        arrays = {name: _as_numpy(pb, request, name) for name in wire.CORE_INPUTS}
        missing = [name for name, a in arrays.items() if a is None]
        if missing:
            raise RequestError(INVALID_ARG, f"input {missing[0]} is required")
        flat = {name: a.reshape(-1) for name, a in arrays.items()}
        rows = flat["ROW_TOKENS"].size
        if not all(flat[n].size == rows for n in ("ROW_WORDS", "SCHEMA", "ADAPTER_ID", "T_MIN")):
            raise RequestError(
                INVALID_ARG, "ROW_TOKENS, ROW_WORDS, SCHEMA, ADAPTER_ID and T_MIN need one value per row"
            )
        tokens, words = flat["ROW_TOKENS"].astype(np.int64), flat["ROW_WORDS"].astype(np.int64)
        limit = self.request_limit
        if rows == 0 or tokens.min() < 1 or words.min() < 0:
            raise RequestError(INVALID_ARG, "every row needs at least one token")
        ids, positions = flat["INPUT_IDS"].astype(np.int64), flat["WORD_POS"].astype(np.int64)
        if ids.size != tokens.sum() or positions.size != words.sum():
            raise RequestError(INVALID_ARG, "INPUT_IDS and WORD_POS must hold the rows' counts")
        if ids.min() < 0 or ids.max() >= self.vocab:
            raise RequestError(INVALID_ARG, f"token ids must be below {self.vocab}")
        t_min = flat["T_MIN"].astype(np.float64)
        if not np.all((t_min >= 0.0) & (t_min <= 1.0)):
            raise RequestError(INVALID_ARG, "T_MIN must be within [0, 1]")
        token_ends, word_ends = np.cumsum(tokens).tolist(), np.cumsum(words).tolist()
        t_list = t_min.tolist()
        texts: dict = {}  # bytes -> str: the rows of one request mostly share a schema
        items, token_start, word_start = [], 0, 0
        for row in range(rows):
            # views of the request's arrays, not lists: pad_batch concatenates them without a
            # Python object per token (perf/bench_host_steps.py, 1,024 rows, 2-core CPU host:
            # the parse 17.2 -> 6.3 us per row, the padding 14.8 -> 3.1)
            row_ids = ids[token_start : token_ends[row]]
            row_words = positions[word_start : word_ends[row]]
            token_start, word_start = token_ends[row], word_ends[row]
            if len(row_words) and (row_words[0] < 0 or row_words[-1] >= len(row_ids)):
                raise RequestError(INVALID_ARG, "WORD_POS must be increasing positions within each row")
            schema, adapter = flat["SCHEMA"][row], flat["ADAPTER_ID"][row]
            if schema not in texts:
                texts[schema] = _text(schema, "SCHEMA")
            if adapter not in texts:
                texts[adapter] = _text(adapter, "ADAPTER_ID")
            if len(row_ids) > limit:  # this row alone: a front configured with a larger limit
                items.append(
                    RequestError(
                        INVALID_ARG,
                        f"text and schema are {len(row_ids)} tokens, above the GPU stage's limit of {limit} "
                        "(max_request_tokens of gliner2_core); split the text into chunks",
                    )
                )
                continue
            items.append((row_ids, row_words, texts[schema], texts[adapter], t_list[row]))
        falls = np.diff(positions) <= 0  # allowed only where a new row starts
        starts = np.asarray(word_ends[:-1], dtype=np.int64) - 1
        falls[starts[(starts >= 0) & (starts < falls.size)]] = False
        if falls.any():
            raise RequestError(INVALID_ARG, "WORD_POS must be increasing positions within each row")
        return items

    def _run_core(self, items: list) -> list:
        if not items:
            return []
        try:
            return self.engine.run_core(items)
        except Exception as exc:
            if len(items) == 1:
                logger.exception("the GPU stage raised on a request")
                return [RequestError(INTERNAL, f"inference failed: {type(exc).__name__}: {exc}")]
            half = len(items) // 2
            return self._run_core(items[:half]) + self._run_core(items[half:])

    def _core_response(self, rows: list):
        return self._core_pb_response(*core_parts(rows))

    def _core_pb_response(self, statuses: list, packed: bytes):
        """The response of one front request: its rows' STATUS texts (bytes) and COMPACT buffer."""
        pb = self.pb_utils
        return pb.InferenceResponse(
            output_tensors=[
                pb.Tensor("STATUS", np.array([statuses], dtype=np.object_)),
                pb.Tensor("COMPACT", np.array([[packed]], dtype=np.object_)),
            ]
        )


def core_parts(rows: list) -> tuple[list, bytes]:
    """(STATUS texts, COMPACT buffer) of one front request's rows (CompactRow or RequestError each)."""
    statuses = [f"{r.code}\t{r.message}".encode("utf-8") if isinstance(r, RequestError) else b"" for r in rows]
    return statuses, pack_compact_rows([None if isinstance(r, RequestError) else r for r in rows])


def _once(fn: Optional[Callable[[], None]]) -> Callable[[], None]:
    """``fn`` callable any number of times, run at most once (None: nothing to run)."""
    done = fn is None

    def call() -> None:
        nonlocal done
        if not done:
            done = True
            fn()

    return call


def _job_tokens(items: list) -> int:
    """Tokens of a job's rows, from its parsed items (``job[1]``, not the whole job: that counted
    ~7 tokens a job, and every waiting job was merged whatever the budget, session 18)."""
    return sum(len(item[0]) for item in items if not isinstance(item, RequestError))


def _text(value, name: str) -> str:
    if not isinstance(value, bytes):
        raise RequestError(INVALID_ARG, f"input {name} must hold one BYTES element")
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise RequestError(INVALID_ARG, f"{name} is not valid UTF-8") from None


def _as_numpy(pb_utils, request, name: str) -> Optional[np.ndarray]:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()
