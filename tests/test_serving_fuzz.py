"""Property-based fuzzing of the serving layer on the tiny engine (no server): request decoding,
the engine's schema parsing and ``TritonModelHandler.execute`` on batches of arbitrary
requests. Only the documented errors come out (RequestError: INVALID_ARG for bad input,
NOT_FOUND for an unknown adapter); execute answers every request and never raises."""

from __future__ import annotations

import json
import time
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from manylora.client import protocol
from manylora.client.protocol import Request

from manylora import serving
from manylora.engine import RequestError
from manylora.serving import ExecuteProfiler, TritonModelHandler, decode_request

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DOCUMENTED = {"INVALID_ARG", "NOT_FOUND"}


class FakePbUtils:
    """The parts of triton_python_backend_utils that manylora.serving uses."""

    class TritonError:
        UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

        def __init__(self, message: str, code: int = 0):
            self.message, self.code = message, code

    class Tensor:
        def __init__(self, name: str, array: np.ndarray):
            self.name, self.array = name, array

        def as_numpy(self) -> np.ndarray:
            return self.array

    class InferenceResponse:
        def __init__(self, output_tensors: list, error=None):
            self.output_tensors, self.error = output_tensors, error

    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

    @staticmethod
    def get_input_tensor_by_name(request: dict, name: str):
        return None if name not in request else FakePbUtils.Tensor(name, request[name])


CODE_NAMES = {getattr(FakePbUtils.TritonError, name): name for name in DOCUMENTED | {"INTERNAL", "UNAVAILABLE"}}


class NoMetrics:
    def publish(self, engine) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def handler(tiny_checkpoint, demo_adapters):
    from manylora.config import EngineConfig
    from manylora.engine import Engine

    root = next(iter(demo_adapters.values())).parent
    engine = Engine(EngineConfig.from_parameters({"checkpoint": str(tiny_checkpoint), "adapter_dir": str(root)}))
    handler = TritonModelHandler.__new__(TritonModelHandler)  # the model.py path, minus Triton's args
    handler.pb_utils, handler.engine, handler.metrics = FakePbUtils, engine, NoMetrics()
    handler.profiler = ExecuteProfiler(None, "")  # off, as without MANYLORA_PROFILE_DIR
    return handler


def test_profiling_can_be_limited_to_named_models(monkeypatch, tmp_path):
    """MANYLORA_PROFILE_DIR turns profiling on for every model; MANYLORA_PROFILE_MODELS, when set,
    keeps it to the models it names."""
    monkeypatch.delenv("MANYLORA_PROFILE_MODELS", raising=False)
    monkeypatch.delenv("MANYLORA_PROFILE_DIR", raising=False)
    assert serving.profile_folder("gliner2") is None
    monkeypatch.setenv("MANYLORA_PROFILE_DIR", str(tmp_path))
    assert serving.profile_folder("gliner2") == serving.profile_folder("gliner2_core") == str(tmp_path)
    monkeypatch.setenv("MANYLORA_PROFILE_MODELS", "gliner2_core, manylora_control")
    assert serving.profile_folder("gliner2") is None
    assert serving.profile_folder("gliner2_core") == serving.profile_folder("manylora_control") == str(tmp_path)


def test_execute_profiler_writes_stats_of_the_profiled_calls(handler, tmp_path):
    """With a folder (MANYLORA_PROFILE_DIR), execute() calls are profiled and their stats
    written every ``every`` calls and on dump; without one, nothing is profiled or written."""
    import pstats

    profiler = ExecuteProfiler(str(tmp_path / "prof"), "gliner2_0", every=2)
    request = {"TEXT": np.array([b"Ada Lovelace met Charles Babbage."], dtype=object)}
    request["SCHEMA"] = np.array([json.dumps({"entities": ["person"]}).encode()], dtype=object)
    off, handler.profiler = handler.profiler, profiler
    try:
        handler.execute([request])
        assert not profiler.path.exists()
        handler.execute([request])
    finally:
        handler.profiler = off
    assert profiler.path.parent == tmp_path / "prof" and profiler.path.exists()
    stats = pstats.Stats(str(profiler.path))
    assert any(name == "run" and "engine" in file for file, _, name in stats.stats), "the engine ran inside"
    assert off.profile is None and off.path is None


def test_execute_profiler_failures_never_fail_requests(handler, tmp_path):
    """A profile folder that cannot be made, or stats that cannot be written, turn profiling
    off; execute() still answers and finalize-time dumps do not raise."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    request = {"TEXT": np.array([b"Grace Hopper worked at Harvard."], dtype=object)}
    request["SCHEMA"] = np.array([json.dumps({"entities": ["person"]}).encode()], dtype=object)
    unmade = ExecuteProfiler(str(blocker / "prof"), "gliner2_0")
    assert unmade.profile is None
    unwritable = ExecuteProfiler(str(tmp_path / "prof"), "gliner2_0", every=1)
    (tmp_path / "prof").rmdir()
    blocker.rename(tmp_path / "prof")  # the folder is now a file: every dump fails
    off = handler.profiler
    try:
        for profiler in (unmade, unwritable):
            handler.profiler = profiler
            (response,) = handler.execute([request])
            assert response.error is None and response.output_tensors
    finally:
        handler.profiler = off
    assert unwritable.profile is None, "off after the failed dump"
    unwritable.dump()


json_values = st.recursive(
    st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=30,
)
labels = st.lists(st.text(max_size=10), max_size=6) | st.dictionaries(
    st.text(max_size=8), st.text(max_size=8), max_size=4
)
schemas = (
    st.one_of(
        st.fixed_dictionaries({}, optional={"entities": labels | json_values, "relations": labels | json_values}),
        st.fixed_dictionaries(
            {
                "classifications": st.lists(
                    st.fixed_dictionaries({"task": st.text(max_size=6), "labels": labels}), max_size=2
                )
            }
        ),
        st.fixed_dictionaries(
            {
                "structures": st.dictionaries(
                    st.text(max_size=6),
                    st.fixed_dictionaries(
                        {"fields": st.lists(st.fixed_dictionaries({"name": st.text(max_size=6)}), max_size=3)},
                        optional={"mode": st.text(max_size=8)},
                    ),
                    max_size=2,
                )
            }
        ),
        st.dictionaries(
            st.sampled_from(["entities", "relations", "structures", "entity_attributes", "x"]), json_values
        ),
        json_values,
    ).map(json.dumps)
    | st.text(max_size=60)
    | st.integers(1, 5000).map(lambda n: '{"entities": ' + "[" * n + "]" * n + "}")
)
texts = st.one_of(
    st.text(max_size=80),
    st.sampled_from(["", " ", "\u3000", "\x00", "Tim Cook runs Apple.", "\ufeff", "a" * 5000]),
)
adapters = st.one_of(
    st.sampled_from(["", "enc-r8", "heads-r8", "no-such", "../enc-r8", "/etc", "enc-r8\n", "%2e%2e", "a" * 200]),
    st.text(max_size=20),
)


@st.composite
def raw_requests(draw):
    """Input arrays as Triton could deliver them: mostly well-formed, some of them damaged."""
    threshold = draw(st.floats(0, 1) | st.floats(allow_nan=True, allow_infinity=True, width=32))
    arrays = {
        protocol.TEXT: np.array([[draw(texts).encode("utf-8", "surrogatepass")]], dtype=np.object_),
        protocol.SCHEMA: np.array([[draw(schemas).encode("utf-8", "surrogatepass")]], dtype=np.object_),
        protocol.ADAPTER_ID: np.array([[draw(adapters).encode("utf-8", "surrogatepass")]], dtype=np.object_),
        protocol.THRESHOLD: np.full((1, 1), threshold, dtype=np.float32),
        protocol.INCLUDE_CONFIDENCE: np.full((1, 1), draw(st.booleans())),
        protocol.INCLUDE_SPANS: np.full((1, 1), draw(st.booleans())),
    }
    for name in draw(st.sets(st.sampled_from(sorted(arrays)), max_size=2)):
        arrays[name] = draw(
            st.sampled_from(
                [
                    None,
                    np.array([[b"\xff\xfe"]], dtype=np.object_),
                    np.zeros((2, 1), dtype=np.float32),
                    np.array([[7]], dtype=np.object_),
                    np.empty((0, 1), dtype=np.object_),
                ]
            )
        )
    return {name: array for name, array in arrays.items() if array is not None}


@FUZZ
@given(request=raw_requests())
def test_decode_request_raises_only_invalid_arg(request):
    try:
        decoded = decode_request(request.get)
    except RequestError as exc:
        assert exc.code == "INVALID_ARG", exc
    else:
        assert isinstance(decoded, Request)


@FUZZ
@given(schema=schemas, text=texts)
def test_schema_parsing_raises_only_request_errors(handler, schema, text):
    try:
        request = Request(text, schema)
    except ValueError:  # over the protocol's limits: INVALID_ARG before the engine
        return
    try:
        handler.engine.prepare(0, request)
    except RequestError as exc:
        assert exc.code == "INVALID_ARG", exc


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.lists(raw_requests(), min_size=1, max_size=4))
def test_execute_answers_every_request_with_a_result_or_a_documented_error(handler, batch):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        responses = handler.execute(batch)
    assert len(responses) == len(batch)
    for response in responses:
        if response.error is not None:
            assert CODE_NAMES.get(response.error.code) in DOCUMENTED, response.error.message
        else:
            (tensor,) = response.output_tensors
            assert isinstance(protocol.parse_result(tensor.array), dict)


def test_execute_isolates_a_request_the_engine_raises_on():
    """Should the engine raise instead of answering a RequestError, only that request fails
    (INTERNAL); the batch is halved until it is found, and the others are answered."""

    class RaisingEngine:
        calls = 0

        def run(self, requests):
            RaisingEngine.calls += 1
            if any(r.text == "boom" for r in requests):
                raise RecursionError("maximum recursion depth exceeded")
            return [{"text": r.text} for r in requests]

    raising = TritonModelHandler.__new__(TritonModelHandler)
    raising.pb_utils, raising.engine, raising.metrics = FakePbUtils, RaisingEngine(), NoMetrics()
    raising.profiler = ExecuteProfiler(None, "")
    texts = ["a", "b", "boom", "c", "d", "e", "f"]
    responses = raising.execute([Request(t, '{"entities": ["x"]}').to_arrays() for t in texts])
    for text, response in zip(texts, responses):
        if text == "boom":
            assert CODE_NAMES[response.error.code] == "INTERNAL"
            assert response.error.message == "inference failed: RecursionError: maximum recursion depth exceeded"
        else:
            assert response.error is None and protocol.parse_result(response.output_tensors[0].array) == {"text": text}
    assert RaisingEngine.calls <= 1 + 2 * 3, "halving, not one by one"


def test_request_error_messages_are_capped():
    """A 60 KB message (an unknown schema key echoed back) once came back over gRPC as
    RESOURCE_EXHAUSTED instead of its own code: every RequestError message is capped."""
    from manylora.errors import MAX_MESSAGE_CHARS, RequestError

    exc = RequestError("INVALID_ARG", "SCHEMA is not a valid GLiNER2 schema: " + "k" * 60_000)
    assert len(exc.message) <= MAX_MESSAGE_CHARS and exc.message.startswith("SCHEMA is not a valid")
    assert "60038 characters in all" in exc.message
    assert RequestError("INVALID_ARG", "short").message == "short"


def _core_handler(engine):
    from manylora.serving import CoreModelHandler

    core = CoreModelHandler.__new__(CoreModelHandler)
    core.pb_utils, core.engine, core.metrics = FakePbUtils, engine, NoMetrics()
    core.profiler, core.vocab = ExecuteProfiler(None, ""), len(engine.processor.tokenizer)
    core.control = None
    return core


def _core_request(prepared, schema: str, adapters=None) -> dict:
    """The BLS request a front sends for these prepared rows (manylora/wire.py's inputs)."""
    records = [p.record for p in prepared]
    adapters = adapters or [""] * len(records)
    return {
        "INPUT_IDS": np.array([[t for r in records for t in r.input_ids]], dtype=np.int32),
        "ROW_TOKENS": np.array([[len(r.input_ids) for r in records]], dtype=np.int32),
        "WORD_POS": np.array([[w for r in records for w in r.text_word_first_positions]], dtype=np.int32),
        "ROW_WORDS": np.array([[len(r.text_word_first_positions) for r in records]], dtype=np.int32),
        "SCHEMA": np.array([[schema.encode()] * len(records)], dtype=object),
        "ADAPTER_ID": np.array([[a.encode() for a in adapters]], dtype=object),
        "T_MIN": np.array([[p.t_min for p in prepared]], dtype=np.float32),
    }


class FakeSender:
    """A request's response sender: records what was sent."""

    def __init__(self):
        import threading

        self.sent, self.done = [], threading.Event()

    def send(self, response=None, flags=0):
        self.sent.append((response, flags))
        if flags == FakePbUtils.TRITONSERVER_RESPONSE_COMPLETE_FINAL:
            self.done.set()


class SenderRequest(dict):
    def __init__(self, arrays: dict):
        super().__init__(arrays)
        self.sender = FakeSender()

    def get_response_sender(self):
        return self.sender


def test_overlapped_gpu_stage_answers_every_request_once_through_its_sender(tiny_checkpoint, demo_adapters):
    """gliner2_core with core_overlap: execute() only parses and queues; the GPU thread runs queued
    batches (merged when they wait) and the answer thread sends each request exactly one
    final response. A malformed request fails alone; every row equals the in-process engine's
    answer; finalize answers what is queued and stops both threads."""
    from manylora import wire
    from manylora.config import EngineConfig
    from manylora.engine import Engine, Request
    from manylora.post import CompactRow

    root = next(iter(demo_adapters.values())).parent
    engine = Engine(EngineConfig.from_parameters({"checkpoint": str(tiny_checkpoint), "adapter_dir": str(root)}))
    schema = json.dumps({"entities": ["person", "company"]})
    names = sorted(demo_adapters)
    texts = ["Tim Cook runs Apple.", "Ada Lovelace met Charles Babbage.", "Grace Hopper worked at Remington Rand."]
    cases = []  # (request, [(text, adapter)] or None for the malformed one)
    for k in range(6):
        rows = [(texts[(k + i) % 3], ["", *names][(k + i) % (len(names) + 1)]) for i in range(1 + k % 3)]
        prepared = [engine.pre.prepare(i, Request(t, schema, adapter=a)) for i, (t, a) in enumerate(rows)]
        cases.append((SenderRequest(_core_request(prepared, schema, [a for _, a in rows])), rows, prepared))
    broken = SenderRequest(_core_request(cases[0][2], schema))
    del broken["T_MIN"]
    core = _core_handler(engine)
    core.start_overlap()
    try:
        assert core.execute([r for r, _, _ in cases[:3]] + [broken]) is None
        assert core.execute([r for r, _, _ in cases[3:]]) is None  # queued while the first may still run
        for request in [r for r, _, _ in cases] + [broken]:
            assert request.sender.done.wait(120), "every request is answered"
    finally:
        core.finalize()
    assert not any(t.is_alive() for t in core._threads)
    ((response, flags),) = broken.sender.sent
    assert CODE_NAMES[response.error.code] == "INVALID_ARG" and "T_MIN" in response.error.message
    for request, rows, prepared in cases:
        ((response, flags),) = request.sender.sent
        assert flags == FakePbUtils.TRITONSERVER_RESPONSE_COMPLETE_FINAL and response.error is None
        statuses = [s.decode() for s in response.output_tensors[0].array.reshape(-1)]
        assert statuses == [""] * len(rows)
        packed = wire.unpack_rows(response.output_tensors[1].array.reshape(-1)[0])
        expected = engine.run([Request(t, schema, adapter=a) for t, a in rows])
        for p, arrays, want in zip(prepared, packed, expected):
            got = engine.post.decode(CompactRow.from_arrays(arrays), p.record, p.metadata, 0.5)
            assert got == want


def test_gpu_thread_delivers_the_last_call_once_the_next_forward_is_queued(tiny_checkpoint, monkeypatch):
    """The GPU thread's pipeline across calls: the last call is delivered (its answers queued)
    after the next call's first forward is queued and before that call's heads, exactly once;
    both calls' rows decode to the in-process engine's answers."""
    import queue

    from manylora import wire
    from manylora.config import EngineConfig
    from manylora.engine import Engine, Request
    from manylora.post import CompactRow

    events = []

    class Answers(queue.Queue):
        def put(self, entry, *args, **kwargs):
            events.append("deliver")
            super().put(entry, *args, **kwargs)

    engine = Engine(EngineConfig.from_parameters({"checkpoint": str(tiny_checkpoint)}))
    core = _core_handler(engine)
    core._answers = Answers()
    schema = json.dumps({"entities": ["person", "company"]})
    calls = []
    for texts in (["Tim Cook runs Apple."], ["Ada Lovelace met Charles Babbage.", "Grace Hopper joined IBM."]):
        prepared = [engine.pre.prepare(i, Request(t, schema)) for i, t in enumerate(texts)]
        calls.append((texts, prepared, core._parse([SenderRequest(_core_request(prepared, schema))])))
    real_forward, real_begin = engine.forward, engine.compact_begin
    monkeypatch.setattr(engine, "forward", lambda chunk: events.append(f"A{len(chunk)}") or real_forward(chunk))
    monkeypatch.setattr(engine, "compact_begin", lambda c, *a: events.append(f"B{len(c)}") or real_begin(c, *a))
    queued = time.monotonic()
    first = core._begin_jobs([(["sender-1"], calls[0][2], queued)], None)
    assert core._answers.empty(), "not delivered before the next call (or an empty queue) asks"
    second = core._begin_jobs([(["sender-2"], calls[1][2], queued)], first)
    assert events == ["A1", "B1", "A2", "deliver", "B2"], events
    first()  # a second call runs nothing
    second()
    delivered = [core._answers.get_nowait() for _ in range(2)]
    # each call's rows, wall time and its job's wait reach the metrics (manylora_core_call_*)
    stats = list(engine.call_stats)
    assert [rows for rows, _, _ in stats] == [1, 2], stats
    assert all(seconds > 0 and len(waits) == 1 and waits[0] >= 0 for _, seconds, waits in stats)
    assert stats[1][2][0] >= stats[0][2][0], "the second call started later: its job waited longer"
    assert core._answers.empty() and [d[0] for d in delivered] == [["sender-1"], ["sender-2"]]
    for (texts, prepared, _), (_, job, answers) in zip(calls, delivered):
        response = core._responses(job, answers)[0]
        packed = wire.unpack_rows(response.output_tensors[1].array.reshape(-1)[0])
        for p, arrays, want in zip(prepared, packed, engine.run([Request(t, schema) for t in texts])):
            assert engine.post.decode(CompactRow.from_arrays(arrays), p.record, p.metadata, 0.5) == want


def test_gpu_thread_merges_waiting_jobs_up_to_its_token_budget(tiny_checkpoint):
    """The GPU thread merges the jobs that wait into one engine call while the call's tokens are
    below MERGE_BUDGETS token budgets, counting each job's rows' tokens."""
    import queue

    from manylora.config import EngineConfig
    from manylora.engine import Engine, Request

    engine = Engine(EngineConfig.from_parameters({"checkpoint": str(tiny_checkpoint)}))
    core = _core_handler(engine)
    schema = json.dumps({"entities": ["person", "company"]})
    prepared = [
        engine.pre.prepare(i, Request(t, schema)) for i, t in enumerate(["Tim Cook runs Apple.", "Ada met Bob."])
    ]
    tokens = sum(len(p.record.input_ids) for p in prepared)
    jobs = []
    for _ in range(3):
        job = core._parse([SenderRequest(_core_request(prepared, schema))])
        assert serving._job_tokens(job[1]) == tokens
        jobs.append((["sender"], job, time.monotonic()))
    core.MERGE_BUDGETS = 1.5 * tokens / engine.config.max_batch_tokens  # room for one job and a half
    core._jobs, core._answers = queue.SimpleQueue(), queue.SimpleQueue()
    calls = []
    core._begin_jobs = lambda merged, before: calls.append(len(merged)) or (lambda: None)
    for job in [*jobs, None]:
        core._jobs.put(job)
    core._gpu_loop()
    assert calls == [2, 1], "a call takes jobs while below the budget: two, then the third alone"


def test_gpu_thread_publishes_metrics_after_answers_and_at_most_every_interval(tiny_checkpoint):
    """The overlapped GPU stage publishes its metrics at most every metrics_interval (not in
    every call), and once more while idle with calls unpublished (so a scrape after the last
    answer is at most one interval behind)."""
    import queue
    import threading

    from manylora.config import EngineConfig
    from manylora.engine import Engine, Request

    engine = Engine(EngineConfig.from_parameters({"checkpoint": str(tiny_checkpoint)}))
    core = _core_handler(engine)
    schema = json.dumps({"entities": ["person"]})
    prepared = [engine.pre.prepare(0, Request("Tim Cook runs Apple.", schema))]
    core._jobs, core._answers = queue.SimpleQueue(), queue.SimpleQueue()
    core.metrics_interval = 0.5
    published = []  # when each publish ran

    class Counting:
        def publish(self, engine) -> None:
            published.append(time.monotonic())

    core.metrics = Counting()
    thread = threading.Thread(target=core._gpu_loop, daemon=True)
    thread.start()
    started = time.monotonic()
    for _ in range(3):  # three calls in quick succession: one publish for the first ...
        core._jobs.put((["sender"], core._parse([SenderRequest(_core_request(prepared, schema))]), time.monotonic()))
        while core._answers.qsize() < 1:
            time.sleep(0.005)
        core._answers.get()
    deadline = time.monotonic() + 5
    while len(published) < 2 and time.monotonic() < deadline:  # ... one for the other two, once due
        time.sleep(0.01)
    core._jobs.put(None)
    thread.join(10)
    assert not thread.is_alive()
    assert len(published) == 2, published
    assert published[1] - published[0] >= core.metrics_interval
    assert published[0] >= started and "publish" in engine.phase_seconds


def test_gpu_stage_fails_an_over_limit_row_alone_and_answers_the_others(tiny_checkpoint):
    """gliner2_core (CoreModelHandler) gets a front's rows in one request. A row above its own
    max_request_tokens (a front configured with a larger limit) gets INVALID_ARG alone; the
    other rows' compact answers decode to what the in-process engine answers."""
    from manylora import wire
    from manylora.config import EngineConfig
    from manylora.engine import Engine, Request
    from manylora.post import CompactRow

    engine = Engine(EngineConfig.from_parameters({"checkpoint": str(tiny_checkpoint), "max_request_tokens": "64"}))
    core = _core_handler(engine)
    schema = json.dumps({"entities": ["person", "company"]})
    texts = ["Tim Cook runs Apple.", "word " * 200, "Ada Lovelace met Charles Babbage."]
    engine.pre.max_request_tokens = 4096  # the front's larger limit
    prepared = [engine.pre.prepare(i, Request(t, schema)) for i, t in enumerate(texts)]
    engine.pre.max_request_tokens = 64
    (response,) = core.execute([_core_request(prepared, schema)])
    assert response.error is None
    statuses = [s.decode() for s in response.output_tensors[0].array.reshape(-1)]
    assert statuses[0] == statuses[2] == "" and statuses[1].startswith("INVALID_ARG\t")
    assert "above the GPU stage's limit of 64" in statuses[1]
    rows = wire.unpack_rows(response.output_tensors[1].array.reshape(-1)[0])
    assert rows[1] is None
    expected = engine.run([Request(texts[0], schema), Request(texts[2], schema)])
    for index, want in zip((0, 2), expected):
        row = CompactRow.from_arrays(rows[index])
        got = engine.post.decode(row, prepared[index].record, prepared[index].metadata, 0.5)
        assert got == want
