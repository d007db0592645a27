"""The GPU stage's engine in a child process of its own (``core_process: on``).

Why. ``gliner2_core`` is one Triton Python-backend stub process: its ``execute`` thread parses
the fronts' requests, the GPU thread runs the engine and the answer thread builds and sends the
responses, all under one interpreter lock. At LoRA saturation on the H200 the GPU thread was
busy ~66 ms of each ~68 ms of wall time per call, 52 of them on a CPU, while the parse (6.6 ms a
call) and the answers (9.2 ms of CPU a call, mostly the Python backend's tensors and response
senders: our packing is ~1.3 ms) took the lock from it (session 24, ``perf/README.md``). Work
taken off the GPU thread but left in the process made it slower, not faster (session 23: folder
checks in ``execute``; session 24: the heads' ~230 operations a chunk as one graph replay gave
1.13x), because each hand-over of the lock costs the GPU thread a wait.

So with ``core_process: on`` the stub keeps Triton's side (parse, responses, metrics) and a
child process (``CoreWorker``: ``python -m manylora.core_process <fd>``) holds the engine, the
adapter cache, the adapter control watcher, the GPU thread and a thin answer thread that packs
each request's compact rows (``serving.core_parts``) and writes them back. Between them one
Unix socket carries length-framed messages (``frame``): a JSON header and raw buffers
(``wire.pack_arrays``), never pickle.

- stub -> worker: ``init`` (Triton's initialize arguments, the control folder resolved by the
  stub, whose parent is tritonserver), ``job`` (one execute's parsed requests: ``encode_job``),
  ``stop``;
- worker -> stub: ``ready`` or ``failed`` (the load), ``answers`` (per request of a job: its
  STATUS texts and COMPACT buffer, or its error), ``metrics`` (a snapshot of the numbers
  ``AdapterMetrics.publish`` reads, at most every ``metrics_interval``).

A worker that exits (a crash, a CUDA fault, the OOM killer) does not take the model down: the
stub answers that worker's requests in flight UNAVAILABLE at once (in-process, Triton 2.51's
Python backend leaves requests answered through response senders waiting when their stub dies)
and starts a new worker, with a growing pause between failed starts; meanwhile requests get
UNAVAILABLE. A worker whose stub is gone (end of file on the socket) answers what it holds,
then exits.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Optional

import numpy as np

from manylora import wire
from manylora.errors import INTERNAL, UNAVAILABLE, RequestError
from manylora.metrics import graph_kinds
from manylora.serving import CoreModelHandler, ExecuteProfiler, core_parts, instance_device, profile_folder

logger = logging.getLogger("manylora.core_process")

# a header holds ids, times, a job's requests and its rows' own errors (capped messages); every
# per-row value and text travels in the blobs
MAX_HEADER_BYTES = 64 << 20


# ---------------------------------------------------------------------------- framing


def frame(kind: str, header: Optional[dict] = None, blobs: Sequence[bytes] = ()) -> bytes:
    """One message: a u32 header length, the JSON header (``kind``, the blobs' lengths), the blobs."""
    head = json.dumps({**(header or {}), "kind": kind, "blobs": [len(b) for b in blobs]}, separators=(",", ":"))
    data = head.encode("utf-8")
    return struct.pack("<I", len(data)) + data + b"".join(blobs)


def unframe(data: bytes) -> tuple[dict, list[memoryview]]:
    """(header, blobs) of a ``frame``; ValueError if malformed."""
    view = memoryview(data)
    header, offset = wire.read_header(view, MAX_HEADER_BYTES, "message")
    if not isinstance(header, dict) or not isinstance(header.get("kind"), str):
        raise ValueError("message: no kind")
    blobs = []
    for length in header.get("blobs", []):
        if not isinstance(length, int) or length < 0 or offset + length > len(view):
            raise ValueError("message: truncated blob")
        blobs.append(view[offset : offset + length])
        offset += length
    if offset != len(view):
        raise ValueError("message: trailing bytes")
    return header, blobs


def _error_entry(exc: RequestError) -> list:
    return ["e", exc.code, exc.message]


def encode_job(job_id: int, job: tuple[list, list], queued: float) -> bytes:
    """One execute's parse (``CoreModelHandler._parse``: per request its (first item, rows) or
    RequestError; per item its row or RequestError) as a ``job`` message; ``queued`` is the stub's
    ``time.monotonic()`` (one clock for both processes) for the queue-time metric."""
    groups, items = job
    texts: dict[str, int] = {}
    errors, schema_of, adapter_of, rows = [], [], [], []  # per item its texts' indices (-1: an error)
    for index, item in enumerate(items):
        if isinstance(item, RequestError):
            errors.append([index, item.code, item.message])  # messages are capped (errors.cap_message)
            schema_of.append(-1)
            adapter_of.append(-1)
            continue
        schema_of.append(texts.setdefault(item[2], len(texts)))
        adapter_of.append(texts.setdefault(item[3], len(texts)))
        rows.append(item)
    arrays = {
        "ids": np.concatenate([r[0] for r in rows]).astype(np.int32) if rows else np.zeros(0, np.int32),
        "tokens": np.array([len(r[0]) for r in rows], dtype=np.int32),
        "words": np.concatenate([r[1] for r in rows]).astype(np.int32) if rows else np.zeros(0, np.int32),
        "word_counts": np.array([len(r[1]) for r in rows], dtype=np.int32),
        # float32 is exact: T_MIN arrives as FP32 (CoreModelHandler._items widens it to float64)
        "t_min": np.array([r[4] for r in rows], dtype=np.float32),
        # per item, not in the JSON header: a header's size must not grow with the rows
        "schema_of": np.array(schema_of, dtype=np.int32),
        "adapter_of": np.array(adapter_of, dtype=np.int32),
    }
    header = {
        "job": job_id,
        "queued": queued,
        "groups": [_error_entry(g) if isinstance(g, RequestError) else list(g) for g in groups],
        "errors": errors,
    }
    # the rows' texts (schemas: untrusted, any size) as one blob with their UTF-8 lengths, not as
    # JSON strings: JSON escapes every non-ASCII character to 6 bytes (a review found a 46 MB
    # schema of "é" past the header's bound, which took the worker down)
    encoded = [t.encode("utf-8") for t in texts]
    arrays["text_bytes"] = np.array([len(t) for t in encoded], dtype=np.int64)
    return frame("job", header, [wire.pack_arrays(arrays), b"".join(encoded)])


def decode_job(header: dict, blobs: list) -> tuple[list, list]:
    """The (groups, items) ``encode_job`` carried, as ``CoreModelHandler._parse`` made them (each
    row's ids and word positions int64 views of one array, its threshold a Python float)."""
    arrays = wire.unpack_arrays(blobs[0])
    ids, words = arrays["ids"].astype(np.int64), arrays["words"].astype(np.int64)
    token_ends = np.cumsum(arrays["tokens"], dtype=np.int64).tolist()
    word_ends = np.cumsum(arrays["word_counts"], dtype=np.int64).tolist()
    t_min = arrays["t_min"].astype(np.float64).tolist()
    lengths = arrays["text_bytes"]
    ends = np.cumsum(lengths).tolist()
    if (lengths < 0).any() or (ends[-1] if ends else 0) != len(blobs[1]):
        raise ValueError("job: the texts do not fill their blob")
    texts = [bytes(blobs[1][e - n : e]).decode("utf-8") for e, n in zip(ends, lengths.tolist())]
    errors = {index: RequestError(code, message) for index, code, message in header["errors"]}
    items, row, token_start, word_start = [], 0, 0, 0
    for index, (schema, adapter) in enumerate(zip(arrays["schema_of"].tolist(), arrays["adapter_of"].tolist())):
        if schema < 0:
            items.append(errors[index])
            continue
        items.append(
            (
                ids[token_start : token_ends[row]],
                words[word_start : word_ends[row]],
                texts[schema],
                texts[adapter],
                t_min[row],
            )
        )
        token_start, word_start, row = token_ends[row], word_ends[row], row + 1
    groups = [RequestError(g[1], g[2]) if g and g[0] == "e" else (int(g[0]), int(g[1])) for g in header["groups"]]
    return groups, items


# ---------------------------------------------------------------------------- metrics snapshot


def _drain(queue: deque) -> list:
    out = []
    while queue:
        try:
            out.append(queue.popleft())
        except IndexError:
            break
    return out


def metrics_snapshot(engine) -> dict:
    """What ``AdapterMetrics.publish`` reads from an engine, as plain numbers (the queued batch and
    call statistics and the load times drained, as publish does)."""
    store = engine.store
    graphs = graph_kinds(engine)
    return {
        "events": [[*key, count] for key, count in list(store.events.items())],
        "graphs": [sum(g.stats["captures"] for g in graphs), sum(g.stats["capture_seconds"] for g in graphs)]
        if graphs
        else None,
        "phases": dict(engine.phase_seconds),
        "resident": {tier: len(names) for tier, names in store.resident().items()},
        "loading": len(store.loading()),
        "host_bytes": store.host_bytes,
        "loads": store.drain_load_seconds(),
        "batches": _drain(engine.batch_stats),
        "calls": _drain(engine.call_stats),
    }


class _Graphs:
    def __init__(self, captures, seconds):
        self.stats = {"captures": captures, "capture_seconds": seconds}


class _StoreView:
    def __init__(self, snapshot: dict):
        self.events = Counter({tuple(entry[:-1]): entry[-1] for entry in snapshot["events"]})
        self._resident = {tier: [None] * count for tier, count in snapshot["resident"].items()}
        self._loading = [None] * snapshot["loading"]
        self.host_bytes = snapshot["host_bytes"]
        self._loads = snapshot["loads"]

    def resident(self) -> dict:
        return self._resident

    def loading(self) -> list:
        return self._loading

    def drain_load_seconds(self) -> dict:
        loads, self._loads = self._loads, {}
        return loads


class EngineView:
    """A worker's ``metrics_snapshot`` where ``AdapterMetrics.publish`` expects an engine; the
    stub's own phases (parse, responses) are added to the worker's."""

    heads = None

    def __init__(self, snapshot: dict, stub_phases: dict):
        self.store = _StoreView(snapshot)
        self.graphs = _Graphs(*snapshot["graphs"]) if snapshot["graphs"] else None
        self.phase_seconds = {**snapshot["phases"], **stub_phases}
        self.batch_stats = deque(tuple(b) for b in snapshot["batches"])
        self.call_stats = deque(tuple(c) for c in snapshot["calls"])


# ---------------------------------------------------------------------------- the worker (child)


class CoreWorker(CoreModelHandler):
    """The engine side of ``gliner2_core`` in its own process: the GPU thread and an answer
    thread whose responses are plain tuples written to the stub (no Triton objects here)."""

    def __init__(self, args: dict, conn: Connection):
        from manylora.config import EngineConfig
        from manylora.engine import freeze_long_lived

        self.pb_utils = None
        self._conn, self._write_lock = conn, threading.Lock()
        model_config = json.loads(args["model_config"])
        device = instance_device(args)
        config = EngineConfig.from_model_config(model_config, model_dir=Path(args["model_repository"]), device=device)
        name = f"{args.get('model_instance_name', '')}-worker"
        self.profiler = ExecuteProfiler(profile_folder(args.get("model_name", "")), name)
        self.core_model = ""
        self._load_engine(config, args, model_config, device)
        self.vocab = len(self.engine.processor.tokenizer)
        self.metrics_interval = config.metrics_interval
        self.start_overlap()
        freeze_long_lived()

    def _make_metrics(self, args: dict):
        return None  # the stub publishes this worker's snapshots

    def write(self, data: bytes) -> None:
        with self._write_lock:
            self._conn.send_bytes(data)

    def _publish(self) -> None:
        try:
            self.write(frame("metrics", metrics_snapshot(self.engine)))
        except Exception:
            logger.exception("sending the metrics to the stub failed")

    def _error(self, exc: RequestError):
        return ("error", exc.code, exc.message)

    def _core_response(self, rows: list):
        statuses, packed = core_parts(rows)
        return ("ok", statuses, packed)

    def _send(self, job_id, responses: list) -> None:
        entries, blobs = [], []
        for response in responses:
            if response[0] == "ok":  # three blobs: COMPACT, the STATUS texts' lengths, the texts
                statuses = response[1]
                entries.append(["ok"])
                blobs += [
                    response[2],
                    np.array([len(t) for t in statuses], dtype=np.int64).tobytes(),
                    b"".join(statuses),
                ]
            else:
                entries.append(list(response))  # a request's error: its message is capped
        try:
            self.write(frame("answers", {"job": job_id, "responses": entries}, blobs))
        except OSError:  # the stub is gone: it answered these requests itself
            logger.exception("sending the answers of job %s failed", job_id)
        except Exception:  # a bug: the stub would wait for these answers forever; it fails them
            logger.exception("the answers of job %s could not be framed: the worker exits", job_id)
            logging.shutdown()
            os._exit(70)

    def serve(self) -> None:
        """Queue each job until ``stop`` or the end of the socket (the stub is gone)."""
        while True:
            try:
                header, blobs = unframe(self._conn.recv_bytes())
            except (EOFError, OSError):
                logger.warning("the stub closed the socket: stopping")
                return
            except ValueError:  # a bug: whose job it was is unknown; the stub fails them all
                logger.exception("a message from the stub does not parse: the worker exits")
                logging.shutdown()
                os._exit(70)
            if header["kind"] == "stop":
                return
            if header["kind"] != "job":
                continue
            try:
                job = decode_job(header, blobs)
                queued = float(header["queued"])
            except Exception as exc:  # a bug: this job's requests fail, the worker goes on
                logger.exception("job %s does not decode", header.get("job"))
                error = self._error(RequestError(INTERNAL, f"the GPU stage's worker could not read the batch: {exc}"))
                self._send(header.get("job"), [error] * len(header.get("groups") or []))
                continue
            self._jobs.put((header["job"], job, queued))


def worker_main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m manylora.core_process <fd>``: the worker, on the socket the stub passed."""
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="manylora core worker %(process)d %(levelname)s: %(message)s")
    # stopped by its stub (stop, or the end of the socket), not by a Ctrl-C or a SIGINT sent to the
    # process group as tritonserver shuts down: its stub answers what it holds first
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    fd = int(argv[0])
    os.set_inheritable(fd, False)  # a process this one starts must not keep the stub's socket open
    conn = Connection(fd)
    header, _ = unframe(conn.recv_bytes())
    try:
        worker = CoreWorker(header["args"], conn)
    except BaseException as exc:  # the stub's load fails with this message
        logger.exception("the GPU stage's worker failed to load")
        conn.send_bytes(frame("failed", {"message": f"{type(exc).__name__}: {exc}"}))
        return 1
    code = 0
    try:
        worker.write(frame("ready", {"vocab": worker.vocab, "pid": os.getpid()}))
        worker.serve()
    except BaseException:  # a bug: the stub fails what is left once this process is gone
        logger.exception("the worker's loop failed")
        code = 70
    finally:
        try:
            worker.finalize()  # the queued jobs are answered first
        finally:
            logging.shutdown()
            os._exit(code)  # no interpreter teardown: the GPU thread may still hold CUDA, the stub waits for the exit


# ---------------------------------------------------------------------------- the stub's side


class WorkerFailed(RuntimeError):
    """A worker did not get ready (its load failed, or it exited)."""


def python_executable() -> str:
    """The interpreter for the worker: the stub's own environment's ``python3`` (inside a Triton
    stub, ``sys.executable`` may be the stub binary)."""
    for candidate in (
        os.path.join(sys.prefix, "bin", "python3"),
        os.path.join(sys.exec_prefix, "bin", "python3"),
        sys.executable,
    ):
        if candidate and os.access(candidate, os.X_OK) and "python" in os.path.basename(candidate):
            return candidate
    return "python3"


class Worker:
    """One worker process and its socket, seen from the stub: started and loaded by the constructor
    (raises WorkerFailed), then ``submit`` jobs; ``pending`` maps a job id to its response senders."""

    def __init__(self, args: dict):
        parent, child = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # the stub's imports, the worker's
        try:
            self.process = subprocess.Popen(
                [python_executable(), "-m", "manylora.core_process", str(child.fileno())],
                pass_fds=(child.fileno(),),
                env=env,
                stdin=subprocess.DEVNULL,
            )
        finally:
            child.close()
        self.conn = Connection(parent.detach())
        self.pending: dict[int, list] = {}
        self.lock = threading.Lock()  # ``pending`` and ``closed``
        # the socket's writes, apart: a write that blocks (a worker that does not read) must not
        # keep the receiver from answering and failing jobs
        self.write_lock = threading.Lock()
        self.started = 0.0  # time.monotonic() once ready
        self.closed = False
        self.receiver: Optional[threading.Thread] = None  # the stub's thread reading this socket
        try:
            self.conn.send_bytes(frame("init", {"args": args}))
            header, _ = unframe(self.conn.recv_bytes())
        except (EOFError, OSError, ValueError) as exc:
            self.kill()
            raise WorkerFailed(f"the worker exited while loading (exit code {self.process.poll()}): {exc}") from None
        if header["kind"] != "ready":
            self.kill()
            raise WorkerFailed(str(header.get("message", header)))
        self.pid = header["pid"]
        self.vocab = int(header["vocab"])
        self.started = time.monotonic()

    def submit(self, job_id: int, senders: list, data: bytes) -> bool:
        """Send a job; False if this worker is gone (then its senders are not kept)."""
        with self.lock:
            if self.closed:
                return False
            self.pending[job_id] = senders
        try:
            with self.write_lock:
                self.conn.send_bytes(data)
        except Exception:  # OSError; TypeError when ``_lost`` closed the socket mid-write
            # ours to answer unless the receiver's ``close`` took it (then it answers it)
            return self.take(job_id) is None
        return True

    def take(self, job_id: int) -> Optional[list]:
        with self.lock:
            return self.pending.pop(job_id, None)

    def close(self) -> dict:
        """No more jobs: the senders still pending (their requests not answered)."""
        with self.lock:
            self.closed = True
            pending, self.pending = self.pending, {}
        return pending

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the worker to answer what it holds and exit; killed after ``timeout``."""
        timer = threading.Timer(timeout, self._overdue, args=(timeout,))  # also ends a write stuck below
        timer.daemon = True
        timer.start()
        try:
            if self.write_lock.acquire(timeout=timeout):
                try:
                    self.conn.send_bytes(frame("stop"))
                except Exception:  # gone already
                    pass
                finally:
                    self.write_lock.release()
            self.process.wait()
        finally:
            timer.cancel()

    def _overdue(self, timeout: float) -> None:
        logger.error("the GPU stage's worker %d did not stop within %g s: killed", self.process.pid, timeout)
        self.kill()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


class CoreProcessHandler(CoreModelHandler):
    """``gliner2_core`` with ``core_process: on``: this stub parses and answers; a ``Worker``
    runs the engine (module docstring)."""

    RESTART_PAUSES = (0.0, 1.0, 2.0, 5.0, 10.0, 30.0)  # seconds before each next start after a failed one
    YOUNG_SECONDS = 60.0  # a worker that dies sooner after its start makes the next restart wait longer

    def __init__(self, args: dict, pb_utils, config):
        from manylora.control import UnsafeControlDir, resolve_control_dir
        from manylora.engine import freeze_long_lived

        self.pb_utils = pb_utils
        self.config = config
        self.profiler = ExecuteProfiler(profile_folder(args.get("model_name", "")), args.get("model_instance_name", ""))
        self.core_model = ""
        self.engine = self.control = None
        self.metrics = self._make_metrics(args)
        # fixed keys: EngineView copies this dict while the other thread adds to it
        self.phases = {"parse": 0.0, "respond": 0.0, "respond_cpu": 0.0}
        # the control folder is found from this stub's parent (tritonserver), not the worker's
        try:
            folder = resolve_control_dir(config.control_dir)
        except UnsafeControlDir as exc:
            logger.error("adapter control is off for %s: %s", args.get("model_instance_name"), exc.message)
            folder = None
        model_config = json.loads(args["model_config"])
        parameters = model_config.setdefault("parameters", {})
        parameters["control_dir"] = {"string_value": "none" if folder is None else str(folder)}
        self._args = {**args, "model_config": json.dumps(model_config)}
        self._ids = itertools.count()
        self._state = threading.Lock()
        self._stopping = False
        self._down_since: Optional[str] = None  # why there is no worker now (None: there is one)
        self._worker: Optional[Worker] = None
        self._started = 0  # workers started so far
        self._deaths = 0  # workers in a row that died young
        self._start(Worker(self._args))  # a failed load fails the model's load
        self.vocab = self._worker.vocab
        self.overlap = True
        freeze_long_lived()

    @property
    def request_limit(self) -> int:
        return self.config.max_request_tokens

    def _start(self, worker: Worker) -> None:
        with self._state:
            if self._started and self.metrics is not None:  # a new worker counts from 0 again
                try:
                    self.metrics.restart_counts(keep={("phase", phase) for phase in self.phases})
                except Exception:
                    logger.exception("resetting the GPU stage's metric counts failed")
            if self._stopping:  # finalize came first: this worker is not needed
                worker.stop()
                return
            self._started += 1
            worker.receiver = threading.Thread(
                target=self._receive, args=(worker,), name="manylora-core-receive", daemon=True
            )
            worker.receiver.start()
            self._worker, self._down_since = worker, None
        logger.info("the GPU stage's worker %d is ready", worker.pid)

    def execute(self, requests: list):
        started = time.perf_counter()
        with self.profiler:
            job = self._parse(requests)
            senders = [request.get_response_sender() for request in requests]
            data = encode_job(job_id := next(self._ids), job, time.monotonic())
        self._add("parse", time.perf_counter() - started)
        with self._state:
            worker, down = self._worker, self._down_since
        if worker is None or not worker.submit(job_id, senders, data):
            why = down or "it exited"
            self._unavailable(senders, f"the GPU stage's worker process is not running ({why}); retry")
        return None

    def _add(self, phase: str, seconds: float) -> None:
        self.phases[phase] += seconds

    def _unavailable(self, senders: list, message: str) -> None:
        self._send(senders, [self._error(RequestError(UNAVAILABLE, message))] * len(senders))

    def _receive(self, worker: Worker) -> None:
        """Answer the worker's jobs and publish its metrics until its socket ends."""
        try:
            while True:
                try:
                    header, blobs = unframe(worker.conn.recv_bytes())
                except (EOFError, OSError):
                    return
                except ValueError:  # a bug: the worker and its jobs are given up (finally)
                    logger.exception("a message from the GPU stage's worker does not parse")
                    return
                started, cpu = time.perf_counter(), time.thread_time()
                if header["kind"] == "answers":
                    senders = worker.take(header["job"])
                    if senders is None:
                        logger.error("answers for an unknown job %s", header["job"])
                        continue
                    self._send(senders, self._responses_of(header.get("responses"), blobs, len(senders)))
                    self._add("respond", time.perf_counter() - started)
                    self._add("respond_cpu", time.thread_time() - cpu)
                elif header["kind"] == "metrics" and self.metrics is not None:
                    try:
                        self.metrics.publish(EngineView(header, self.phases))
                    except Exception:
                        logger.exception("publishing the GPU stage's metrics failed")
        except Exception:  # a bug here must not leave the worker's jobs unanswered
            logger.exception("the GPU stage's receiver failed: its worker is stopped")
        finally:
            self._lost(worker)

    def _responses_of(self, entries: list, blobs: list, count: int) -> list:
        """The ``count`` responses of a job's answers; one that cannot be built is INTERNAL."""
        blob = iter(blobs)
        responses = []
        for k in range(count):
            try:
                entry = entries[k]
                if entry[0] == "ok":
                    packed, lengths, texts = bytes(next(blob)), next(blob), bytes(next(blob))
                    ends = np.cumsum(np.frombuffer(lengths, dtype=np.int64)).tolist()
                    statuses = [texts[e - n : e] for e, n in zip(ends, np.diff([0, *ends]).tolist())]
                    responses.append(self._core_pb_response(statuses, packed))
                else:
                    responses.append(self._error(RequestError(entry[1], entry[2])))
            except Exception as exc:
                logger.exception("building a GPU-stage response failed")
                responses.append(self._error(RequestError(INTERNAL, f"answer failed: {type(exc).__name__}: {exc}")))
        return responses

    def _lost(self, worker: Worker) -> None:
        """The worker's socket ended: answer its jobs UNAVAILABLE, and start a new one."""
        pending = worker.close()
        worker.kill()  # gone already, or given up by a failed receiver
        if worker.write_lock.acquire(timeout=5.0):  # after the kill a write in progress fails soon
            try:
                worker.conn.close()
            finally:
                worker.write_lock.release()
        code = worker.process.returncode
        if self._stopping:
            why = "the model is unloading"
        else:
            why = f"it exited with code {code}"
            logger.error("the GPU stage's worker %d exited (code %s): %d jobs fail", worker.pid, code, len(pending))
        for senders in pending.values():
            self._unavailable(senders, f"the GPU stage's worker process is not running ({why}); retry")
        with self._state:
            if self._worker is not worker:
                return
            self._worker, self._down_since = None, f"restarting: {why}"
        # a worker that dies young (a request or an adapter that kills it again) does not restart at
        # once: the pauses go on growing from where the last restart left them
        young = time.monotonic() - worker.started < self.YOUNG_SECONDS
        self._deaths = self._deaths + 1 if young else 0
        if not self._stopping:
            threading.Thread(
                target=self._restart, args=(self._deaths,), name="manylora-core-restart", daemon=True
            ).start()

    def _restart(self, first: int) -> None:
        for attempt in itertools.count(first):
            time.sleep(self.RESTART_PAUSES[min(attempt, len(self.RESTART_PAUSES) - 1)])
            if self._stopping:
                return
            try:
                worker = Worker(self._args)
            except Exception as exc:  # WorkerFailed, or the start itself (fork: EAGAIN, ENOMEM)
                logger.error("starting the GPU stage's worker again failed: %s", exc)
                with self._state:
                    self._down_since = f"its restart failed: {exc}"
                continue
            self._deaths = attempt  # where the pauses go on from if this one dies young too
            self._start(worker)
            return

    def finalize(self) -> None:
        with self._state:
            self._stopping = True
            worker = self._worker
        if worker is not None:
            worker.stop(timeout=70)  # it answers its queued jobs, then exits; the receiver fails the rest
            worker.receiver.join(30)
        self.overlap = False
        self.profiler.dump()
        if self.metrics is not None:
            self.metrics.close()


def process_handler(args: dict, pb_utils, config) -> CoreProcessHandler:
    """The stub's handler with ``core_process: on`` (``serving.core_handler``)."""
    return CoreProcessHandler(args, pb_utils, config)


if __name__ == "__main__":
    raise SystemExit(worker_main())
