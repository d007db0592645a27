"""``core_process: on`` (manylora.core_process) without Triton: the wire between the stub and its
worker, and a real worker process behind a stub handler with a fake ``pb_utils``, answering
exactly what the in-process GPU stage answers (the same STATUS and COMPACT bytes)."""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_post import FakePb, NoMetrics, _SenderRequest

from manylora import core_process
from manylora.errors import INVALID_ARG, NOT_FOUND, RequestError


def _row(rng, tokens: int, words: int, schema: str, adapter: str, t_min: float) -> tuple:
    ids = rng.integers(0, 1000, tokens).astype(np.int64)
    positions = np.sort(rng.choice(tokens, size=min(words, tokens), replace=False)).astype(np.int64)
    return ids, positions, schema, adapter, float(np.float32(t_min))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.integers(1, 40), st.integers(0, 40), st.sampled_from(['{"entities": ["a"]}', "{}", "é\t\n"])),
            st.just(None),
        ),
        max_size=12,
    ),
    st.integers(0, 2**31),
)
def test_a_job_crosses_the_socket_as_parse_made_it(rows, seed):
    rng = np.random.default_rng(seed)
    items = [
        RequestError(INVALID_ARG, f"row {k} is too long ü")
        if spec is None
        else _row(rng, spec[0], spec[1], spec[2], "" if k % 3 else f"adapter-{k}", rng.random())
        for k, spec in enumerate(rows)
    ]
    groups = [
        (0, len(items) // 2),
        RequestError(NOT_FOUND, "bad request"),
        (len(items) // 2, len(items) - len(items) // 2),
    ]
    header, blobs = core_process.unframe(core_process.encode_job(7, (groups, items), 12.5))
    assert header["kind"] == "job" and header["job"] == 7 and header["queued"] == 12.5
    got_groups, got_items = core_process.decode_job(header, blobs)
    assert [g if isinstance(g, tuple) else (g.code, g.message) for g in got_groups] == [
        g if isinstance(g, tuple) else (g.code, g.message) for g in groups
    ]
    assert len(got_items) == len(items)
    for got, want in zip(got_items, items):
        if isinstance(want, RequestError):
            assert isinstance(got, RequestError) and (got.code, got.message) == (want.code, want.message)
            continue
        assert got[0].dtype == np.int64 and np.array_equal(got[0], want[0])
        assert got[1].dtype == np.int64 and np.array_equal(got[1], want[1])
        assert got[2:] == want[2:]  # schema, adapter and the threshold (exact: FP32 on the wire)


def test_a_huge_schema_travels_as_a_blob_not_in_the_header():
    """Schemas are untrusted and of any size: a review sent a 46 MB schema of "é" (6 bytes each in
    JSON) past the header's bound, which took the worker down. They travel as raw UTF-8."""
    schema = "é" * 300_000
    item = (np.arange(5, dtype=np.int64), np.arange(3, dtype=np.int64), schema, "", 0.5)
    data = core_process.encode_job(1, ([(0, 1)], [item]), 0.0)
    header, blobs = core_process.unframe(data)
    assert len(data) - sum(len(b) for b in blobs) < 1024, "the header does not grow with the schema"
    (row,) = core_process.decode_job(header, blobs)[1]
    assert row[2] == schema
    # nor with the rows (a review: ~10 bytes a row in the header passed its bound at ~6.7 M rows)
    many = [(np.arange(1, dtype=np.int64), np.arange(1, dtype=np.int64), "{}", "", 0.5)] * 20_000
    data = core_process.encode_job(2, ([(0, len(many))], many), 0.0)
    _, blobs = core_process.unframe(data)
    assert len(data) - sum(len(b) for b in blobs) < 1024


def test_a_malformed_message_is_refused():
    data = core_process.frame("answers", {"job": 1}, [b"abc", b""])
    header, blobs = core_process.unframe(data)
    assert header["job"] == 1 and [bytes(b) for b in blobs] == [b"abc", b""]
    for bad in (data[:3], data[:-1], data + b"x", b"\xff\xff\xff\x7f" + data[4:]):
        with pytest.raises(ValueError):
            core_process.unframe(bad)


class _Pb(FakePb):
    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1


class _Metrics(NoMetrics):
    def __init__(self):
        self.views, self.restarts = [], []

    def publish(self, engine) -> None:
        self.views.append(engine)

    def restart_counts(self, keep=()) -> None:
        self.restarts.append(set(keep))

    def close(self) -> None:
        pass


def _pair(checkpoint, engine, kind: str):
    """(a stub handler with its worker on ``kind``, the in-process GPU stage of ``engine``)."""
    from manylora.serving import CoreModelHandler, ExecuteProfiler, core_handler

    parameters = {"checkpoint": str(checkpoint), "core_process": "on", "control_dir": "none"}
    args = {
        "model_config": json.dumps({"parameters": {k: {"string_value": v} for k, v in parameters.items()}}),
        "model_repository": os.getcwd(),
        "model_name": "gliner2_core",
        "model_instance_name": "gliner2_core_0_0",
        "model_instance_kind": kind,
        "model_instance_device_id": "0",
    }
    original = core_process.CoreProcessHandler._make_metrics
    core_process.CoreProcessHandler._make_metrics = lambda self, args: _Metrics()
    try:
        stub = core_handler(args, _Pb)
    finally:
        core_process.CoreProcessHandler._make_metrics = original
    local = CoreModelHandler.__new__(CoreModelHandler)
    local.pb_utils, local.engine, local.metrics, local.control = _Pb, engine, NoMetrics(), None
    local.profiler, local.vocab = ExecuteProfiler(None, ""), len(engine.processor.tokenizer)
    return stub, local


@pytest.fixture(scope="module")
def handlers(tiny_checkpoint, tiny_engine):
    """(the stub handler with its worker, the in-process GPU stage), on the tiny checkpoint."""
    stub, local = _pair(tiny_checkpoint, tiny_engine, "CPU")
    yield stub, local
    stub.finalize()


def test_a_worker_on_the_gpu_answers_what_the_in_process_stage_answers(tiny_checkpoint, tiny_engine):
    """The worker of a GPU instance (model_instance_kind GPU) runs its engine on that GPU."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from manylora.config import EngineConfig
    from manylora.engine import Engine

    engine = Engine(EngineConfig.from_parameters({"checkpoint": str(tiny_checkpoint)}, device="cuda:0"))
    stub, local = _pair(tiny_checkpoint, engine, "GPU")
    try:
        requests = _core_requests(tiny_engine, seed=7)
        # bfloat16 on the GPU: the same kernels on the same rows, compared as the GPU fidelity tests do
        assert _same(_answers(stub, requests), _answers(local, requests), atol=1e-3)
    finally:
        stub.finalize()


def _core_requests(tiny_engine, seed: int) -> list[dict]:
    from manylora.demo import demo_schemas, demo_texts
    from manylora.engine import Request
    from manylora.serving import TritonModelHandler

    front = TritonModelHandler.__new__(TritonModelHandler)
    front.pb_utils, front.core_model = _Pb, "gliner2_core"
    schemas = [json.dumps(s) for s in demo_schemas()]
    texts = demo_texts(9, seed=seed)
    prepared = [tiny_engine.pre.prepare(i, Request(t, schemas[i % len(schemas)])) for i, t in enumerate(texts)]
    requests = [front._core_request(prepared[i : i + 3]).inputs for i in (0, 3, 6)]
    requests[1] = {**requests[1], "T_MIN": np.full_like(requests[1]["T_MIN"], 2.0)}  # INVALID_ARG, this one alone
    adapters = requests[0]["ADAPTER_ID"].copy()
    adapters.reshape(-1)[1] = "é-no-such-adapter".encode()  # NOT_FOUND in that row's STATUS alone
    requests[0] = {**requests[0], "ADAPTER_ID": adapters}
    return requests


def _answers(handler, requests: list[dict], timeout: float = 60.0) -> list:
    senders = [_SenderRequest(r) for r in requests]
    returned = handler.execute(senders)
    if returned is not None:  # the in-process handler without its threads answers from execute
        return returned
    deadline = time.monotonic() + timeout
    while not all(s.sent for s in senders) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert all(len(s.sent) == 1 and s.sent[0][1] == 1 for s in senders), "one final response per request"
    return [s.sent[0][0] for s in senders]


def _same(got: list, want: list, atol: float = 1e-5) -> bool:
    """The same errors, STATUS texts and rows (``wire.unpack_rows``), the span scores within 1e-5:
    two processes' CPU forwards differ by float rounding (up to ~4e-6 seen; the same hits)."""
    from manylora import wire

    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.has_error() == w.has_error()
        if g.has_error():
            assert (g.error().code, g.error().message()) == (w.error().code, w.error().message())
            continue
        (g_status, g_compact), (w_status, w_compact) = ([t.as_numpy() for t in r.output_tensors] for r in (g, w))
        assert g_status.tolist() == w_status.tolist()
        for g_row, w_row in zip(wire.unpack_rows(g_compact[0][0]), wire.unpack_rows(w_compact[0][0]), strict=True):
            assert (g_row is None) == (w_row is None) and (g_row is None or g_row.keys() == w_row.keys())
            for name in g_row or {}:
                if name == "scores":
                    assert np.allclose(g_row[name], w_row[name], rtol=0, atol=atol), name
                else:
                    assert np.array_equal(g_row[name], w_row[name]), name
    return True


def test_the_worker_answers_what_the_in_process_stage_answers(handlers, tiny_engine):
    stub, local = handlers
    requests = _core_requests(tiny_engine, seed=5)
    got, want = _answers(stub, requests), _answers(local, requests)
    assert _same(got, want)
    assert got[1].has_error() and "T_MIN" in got[1].error().message()
    assert not got[0].has_error() and not got[2].has_error()
    status = got[0].output_tensors[0].as_numpy().reshape(-1).tolist()
    assert status[0] == status[2] == b"" and status[1].startswith(b"NOT_FOUND\t"), status
    time.sleep(stub.config.metrics_interval + 0.2)
    _answers(stub, requests[:1])  # a publish is due after this call

    def rows() -> int:
        return sum(call[0] for view in list(stub.metrics.views) for call in view.call_stats)

    deadline = time.monotonic() + 10
    while rows() < 9 and time.monotonic() < deadline:
        time.sleep(0.05)
    view = stub.metrics.views[-1]
    assert view.phase_seconds["parse"] > 0 and view.phase_seconds["prepare"] > 0, "the stub's and the worker's"
    assert rows() == 9, "the calls' rows (6, then 3) reach the metrics, once each"


def test_a_response_that_cannot_be_built_fails_alone(handlers, tiny_engine, monkeypatch):
    """A bug in the stub's receiver while building one response (a review made it raise once):
    that request gets INTERNAL, the job's others and the next jobs are answered."""
    stub, local = handlers
    requests = _core_requests(tiny_engine, seed=8)
    build, calls = stub._core_pb_response, []

    def once(*args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return build(*args)

    monkeypatch.setattr(stub, "_core_pb_response", once)
    got = _answers(stub, requests)
    assert got[0].has_error() and got[0].error().code == _Pb.TritonError.INTERNAL and "boom" in got[0].error().message()
    assert got[1].has_error() and "T_MIN" in got[1].error().message() and not got[2].has_error()
    assert _same(_answers(stub, requests), _answers(local, requests)), "the next job is answered as before"


def test_a_killed_worker_fails_its_jobs_and_a_new_one_answers_the_same(handlers, tiny_engine):
    from manylora.demo import demo_texts
    from manylora.engine import Request

    stub, local = handlers
    requests = _core_requests(tiny_engine, seed=6)
    # a job in flight when the worker dies: long rows, so that it is still in the worker's hands
    long = [
        tiny_engine.pre.prepare(i, Request(t, '{"entities": ["company"]}'))
        for i, t in enumerate(demo_texts(24, seed=9, min_words=300, max_words=400))
    ]
    from manylora.serving import TritonModelHandler

    front = TritonModelHandler.__new__(TritonModelHandler)
    front.pb_utils, front.core_model = _Pb, "gliner2_core"
    in_flight = [_SenderRequest(front._core_request(long[i : i + 8]).inputs) for i in (0, 8, 16)]
    old = stub._worker.pid
    assert stub.execute(in_flight) is None
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not all(r.sent for r in in_flight) and time.monotonic() < deadline:
        time.sleep(0.02)
    for r in in_flight:  # each exactly once: an answer if the worker was quicker, else UNAVAILABLE
        assert len(r.sent) == 1, "one response per request"
        response = r.sent[0][0]
        assert not response.has_error() or "exited with code -9" in response.error().message()
    assert any(r.sent[0][0].has_error() for r in in_flight), "the kill found the job in the worker"
    deadline = time.monotonic() + 10
    while stub._worker is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    failed = _answers(stub, requests[:1])
    assert failed[0].has_error() and failed[0].error().code == _Pb.TritonError.UNAVAILABLE
    assert "worker process is not running" in failed[0].error().message()
    deadline = time.monotonic() + 120
    while stub._worker is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert stub._worker is not None and stub._worker.pid != old, "a new worker was started"
    assert stub.metrics.restarts == [{("phase", "parse"), ("phase", "respond"), ("phase", "respond_cpu")}], (
        "the new worker's counts start from 0, the stub's phases go on"
    )
    assert _same(_answers(stub, requests), _answers(local, requests))
