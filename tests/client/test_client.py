"""ManyLoRAClient without a server: a fake transport stands in for tritonclient.

The fake replaces the client's own transport seam (``submit``/``infer``), answers
out of order from a thread and records what it was sent, so ordering, concurrency,
per-item errors and GLiNER2-API argument handling are checked without mocking
tritonclient. Connection failures use tritonclient for real, on a closed port.
"""

from __future__ import annotations

import json
import random
import threading
import time

import pytest
from manylora.client import ManyLoRAClient, ManyLoRAError, protocol, schemas
from manylora.client.errors import code_from_status, error_from_exception
from tritonclient.utils import InferenceServerException


class FakeResponse:
    def __init__(self, result):
        self._array = protocol.result_array(result)

    def as_numpy(self, name):
        return self._array if name == protocol.RESULT else None


class FakeFuture:
    def __init__(self):
        self._done = threading.Event()
        self._value = self._error = None
        self.cancelled = False

    def finish(self, value=None, error=None):
        self._value, self._error = value, error
        self._done.set()

    def result(self):
        assert self._done.wait(10), "fake request never finished"
        if self._error is not None:
            raise self._error
        return self._value

    def cancel(self):
        self.cancelled = True


class FakeTransport:
    """Echoes each request back as its result, after a random delay.

    ``fail`` maps a text to the exception its request fails with.
    """

    def __init__(self, fail=None, max_delay=0.01, wait_for=0):
        self.fail = fail or {}
        self.max_delay = max_delay
        # answers are held until this many requests are in flight at once (deterministic
        # concurrency checks on a loaded machine; 0 = never held)
        self.wait_for = wait_for
        self._reached = threading.Event()
        self.sent = []
        self.futures = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.closed = False
        self._lock = threading.Lock()

    def _answer(self, request):
        if request.text in self.fail:
            raise self.fail[request.text]
        return FakeResponse({"model": "echo", **_as_dict(request)})

    def infer(self, model_name, request):
        self.sent.append((model_name, request))
        return self._answer(request)

    def submit(self, model_name, request):
        future = FakeFuture()
        with self._lock:
            self.sent.append((model_name, request))
            self.futures.append(future)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            if self.in_flight >= self.wait_for:
                self._reached.set()

        def work():
            self._reached.wait(5)
            time.sleep(random.uniform(0, self.max_delay))
            with self._lock:
                self.in_flight -= 1
            try:
                future.finish(value=self._answer(request))
            except Exception as exc:
                future.finish(error=exc)

        threading.Thread(target=work, daemon=True).start()
        return future

    def close(self):
        self.closed = True


def _as_dict(request):
    return {
        "text": request.text,
        "schema": json.loads(request.schema),
        "adapter": request.adapter,
        "threshold": request.threshold,
        "include_confidence": request.include_confidence,
        "include_spans": request.include_spans,
    }


def make_client(transport=None, **kwargs):
    client = ManyLoRAClient("localhost:1", **kwargs)  # constructing connects nowhere
    client._transport.close()
    client._transport = transport or FakeTransport()
    return client


ENTITIES = {"entities": ["person"]}
NOT_FOUND = InferenceServerException("unknown adapter 'nope'", status="StatusCode.NOT_FOUND")


def test_batch_results_come_back_in_input_order_with_requests_in_flight_together():
    transport = FakeTransport(max_delay=0.02, wait_for=8)
    client = make_client(transport)
    texts = [f"text {i}" for i in range(50)]
    results = client.batch_extract(texts, ENTITIES, batch_size=8)
    assert [r["text"] for r in results] == texts
    assert transport.max_in_flight == 8, "requests are sent concurrently, at most batch_size at a time"


def test_window_defaults_to_the_client_concurrency():
    transport = FakeTransport(max_delay=0.02, wait_for=5)
    client = make_client(transport, concurrency=5)
    client.batch_extract_entities([str(i) for i in range(30)], ["person"])
    assert transport.max_in_flight == 5


def test_extract_sends_gliner2s_schema_and_the_call_options():
    transport = FakeTransport()
    client = make_client(transport, model_name="gliner2-large")
    result = client.extract_entities(
        "Tim Cook runs Apple.", {"person": "a human"}, 0.3, include_confidence=True, adapter="acme"
    )
    ((model_name, request),) = transport.sent
    assert model_name == "gliner2-large"
    assert request == protocol.Request(
        "Tim Cook runs Apple.",
        schemas.encode_schema(schemas.entities_schema({"person": "a human"})),
        adapter="acme",
        threshold=0.3,
        include_confidence=True,
    )
    assert result["schema"] == {"entities": {"person": "a human"}}


@pytest.mark.parametrize(
    "method,argument,schema",
    [
        (
            "classify_text",
            {"sentiment": ["pos", "neg"]},
            {"classifications": [{"task": "sentiment", "labels": ["pos", "neg"]}]},
        ),
        ("extract_relations", ["works_for"], {"relations": ["works_for"]}),
        ("extract_json", {"p": ["name::str"]}, {"structures": {"p": {"fields": [{"name": "name", "dtype": "str"}]}}}),
        ("extract_entities", ["person"], {"entities": ["person"]}),
    ],
)
def test_each_task_method_and_its_batch_variant(method, argument, schema):
    client = make_client()
    single = getattr(client, method)("a text", argument, include_spans=True)
    assert single["schema"] == schema and single["include_spans"] is True
    batch = getattr(client, f"batch_{method}")(["one", "two"], argument, 2, 0.7)
    assert [r["text"] for r in batch] == ["one", "two"]
    assert all(r["schema"] == schema and r["threshold"] == pytest.approx(0.7) for r in batch)


def test_batch_extract_takes_one_schema_per_text():
    client = make_client()
    results = client.batch_extract(["a", "b"], [ENTITIES, schemas.relations_schema(["r"])])
    assert [r["schema"] for r in results] == [ENTITIES, {"relations": ["r"]}]
    with pytest.raises(ValueError, match="Schema count"):
        client.batch_extract(["a", "b"], [ENTITIES])


def test_adapters_default_override_and_per_text():
    client = make_client(adapter="tenant-1")
    assert client.extract("t", ENTITIES)["adapter"] == "tenant-1"
    assert client.extract("t", ENTITIES, adapter="tenant-2")["adapter"] == "tenant-2"
    assert client.extract("t", ENTITIES, adapter="")["adapter"] == "", "empty string selects the base model"
    mixed = client.batch_extract(["a", "b", "c"], ENTITIES, adapter=["x", None, ""])
    assert [r["adapter"] for r in mixed] == ["x", "tenant-1", ""]
    with pytest.raises(ValueError, match="Adapter count"):
        client.batch_extract(["a", "b"], ENTITIES, adapter=["x"])
    assert make_client().extract("t", ENTITIES)["adapter"] == ""


def test_a_failed_item_raises_with_its_index_and_code():
    transport = FakeTransport(fail={"bad": NOT_FOUND})
    client = make_client(transport)
    with pytest.raises(ManyLoRAError) as info:
        client.batch_extract(["ok", "ok", "bad", "ok"], ENTITIES, adapter="nope")
    error = info.value
    assert (error.index, error.code, error.status) == (2, "NOT_FOUND", "StatusCode.NOT_FOUND")
    assert "unknown adapter" in error.message and str(error).startswith("[NOT_FOUND] item 2:")
    assert error.__cause__ is NOT_FOUND


def test_raise_on_error_false_keeps_the_error_in_its_slot():
    failure = InferenceServerException("bad schema", status="400")
    client = make_client(FakeTransport(fail={"b": failure}))
    results = client.batch_extract(["a", "b", "c"], ENTITIES, raise_on_error=False)
    assert results[0]["text"] == "a" and results[2]["text"] == "c"
    assert isinstance(results[1], ManyLoRAError)
    assert (results[1].index, results[1].code, results[1].status) == (1, "INVALID_ARG", "400")


def test_stopping_early_cancels_what_is_still_in_flight():
    transport = FakeTransport(fail={"bad": NOT_FOUND}, max_delay=0.0)
    client = make_client(transport)
    with pytest.raises(ManyLoRAError):
        client.batch_extract(["bad"] + ["slow"] * 9, ENTITIES, batch_size=4)
    assert len(transport.sent) == 4, "nothing more is sent after the failure"
    assert [f.cancelled for f in transport.futures] == [False, True, True, True]


def test_single_call_errors_raise_manylora_error():
    client = make_client(FakeTransport(fail={"t": InferenceServerException("down", status="StatusCode.UNAVAILABLE")}))
    with pytest.raises(ManyLoRAError) as info:
        client.extract("t", ENTITIES)
    assert info.value.code == "UNAVAILABLE" and info.value.index is None


def test_a_malformed_result_is_an_internal_error():
    transport = FakeTransport()
    transport._answer = lambda request: type("R", (), {"as_numpy": lambda self, name: None})()
    with pytest.raises(ManyLoRAError) as info:
        make_client(transport).extract("t", ENTITIES)
    assert info.value.code == "INTERNAL"


def test_stream_passes_prebuilt_errors_through_in_place():
    client = make_client()
    items = [
        protocol.Request("a", json.dumps(ENTITIES)),
        ManyLoRAError("line 2: missing text", "INVALID_ARG"),
        protocol.Request("c", json.dumps(ENTITIES)),
    ]
    answers = list(client.stream(iter(items), window=2))
    assert answers[0]["text"] == "a" and answers[2]["text"] == "c"
    assert answers[1].index == 1 and answers[1].code == "INVALID_ARG"
    with pytest.raises(TypeError):
        list(client.stream(["not a request"]))
    with pytest.raises(ValueError, match="window"):
        list(client.stream([], window=0))


def test_bad_arguments_raise_before_sending():
    transport = FakeTransport()
    client = make_client(transport)
    with pytest.raises(ValueError, match="threshold must be a number"):
        client.batch_extract(["a"], ENTITIES, threshold="0.5")  # NaN and 2.0 are sent: GLiNER2 takes them
    with pytest.raises(schemas.SchemaError):
        client.extract("a", schemas.create_schema())
    with pytest.raises(ValueError, match="format_results=False"):
        client.extract("a", ENTITIES, 0.5, False)  # GLiNER2's positional format_results: only True is served
    with pytest.raises(ValueError, match="max_len must be a positive int"):
        client.batch_extract(["a"], ENTITIES, 8, 0.5, 0, True, False, False, 0)
    with pytest.raises(ValueError, match="batch_size"):
        client.batch_extract(["a"], ENTITIES, 0)
    assert transport.sent == []
    assert client.extract("a", ENTITIES, 0.5, True, True)["include_confidence"] is True, "positional, as GLiNER2"


def test_max_len_is_sent_as_gliner2_takes_it():
    """GLiNER2's positional max_len (word tokens of the text read) goes out as MAX_LEN."""
    transport = FakeTransport()
    client = make_client(transport)
    client.batch_extract(["a"], ENTITIES, 8, 0.5, 0, True, False, False, 100)
    client.extract("a", ENTITIES, 0.5, True, False, False, 7)
    client.extract("a", ENTITIES)
    assert [request.max_len for _, request in transport.sent] == [100, 7, 0]


def test_context_manager_closes_the_transport():
    transport = FakeTransport()
    with make_client(transport) as client:
        assert client.extract("t", ENTITIES)
    assert transport.closed


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"url": "http://localhost:8000"}, "without a scheme"),
        ({"protocol": "ws"}, "protocol must be one of"),
        ({"concurrency": 0}, "concurrency"),
        ({"adapter": 3}, "adapter"),
    ],
)
def test_constructor_validates(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ManyLoRAClient(**kwargs)


def test_default_urls_follow_the_protocol():
    with ManyLoRAClient(protocol="grpc") as grpc_client, ManyLoRAClient(protocol="http") as http_client:
        assert (grpc_client.url, http_client.url) == ("localhost:8001", "localhost:8000")


@pytest.mark.parametrize("protocol_name", ["grpc", "http"])
def test_unreachable_server_is_not_ready_and_fails_per_item(protocol_name):
    with ManyLoRAClient("127.0.0.1:1", protocol=protocol_name, timeout=5) as client:
        assert client.is_live() is False and client.is_ready() is False
        assert client.health() == {
            "url": "127.0.0.1:1",
            "protocol": protocol_name,
            "model": "gliner2",
            "live": False,
            "ready": False,
            "model_ready": False,
        }
        results = client.batch_extract(["a", "b"], ENTITIES, raise_on_error=False)
        assert [(r.index, r.code) for r in results] == [(0, "UNAVAILABLE"), (1, "UNAVAILABLE")]
        with pytest.raises(ManyLoRAError, match="UNAVAILABLE"):
            client.model_metadata()
        with pytest.raises(ManyLoRAError, match="not ready after"):
            client.wait_until_ready(timeout=0.2, interval=0.05)


@pytest.mark.parametrize(
    "status,code",
    [
        ("StatusCode.INVALID_ARGUMENT", "INVALID_ARG"),
        ("StatusCode.NOT_FOUND", "NOT_FOUND"),
        ("StatusCode.UNAVAILABLE", "UNAVAILABLE"),
        ("StatusCode.RESOURCE_EXHAUSTED", "RESOURCE_EXHAUSTED"),
        ("StatusCode.UNIMPLEMENTED", "UNSUPPORTED"),
        ("StatusCode.DEADLINE_EXCEEDED", "DEADLINE_EXCEEDED"),
        ("400", "INVALID_ARG"),
        ("404", "NOT_FOUND"),
        ("500", "INTERNAL"),
        ("503", "UNAVAILABLE"),
        ("418", "UNKNOWN"),
        (None, "UNKNOWN"),
    ],
)
def test_status_to_triton_code(status, code):
    assert code_from_status(status) == code


def test_client_side_failures_get_codes_too():
    assert error_from_exception(ConnectionRefusedError(111, "refused"), 4).code == "UNAVAILABLE"
    assert error_from_exception(TimeoutError("slow")).code == "DEADLINE_EXCEEDED"
    unknown = error_from_exception(RuntimeError("boom"), 1)
    assert (unknown.code, unknown.index, unknown.status) == ("UNKNOWN", 1, None)
    assert unknown.to_json() == {"code": "UNKNOWN", "message": "RuntimeError: boom"}


def test_an_http_client_is_shared_between_threads_and_refuses_work_once_closed():
    client = ManyLoRAClient("127.0.0.1:1", protocol="http", concurrency=3)
    answers = []
    threads = [threading.Thread(target=lambda: answers.append(client.is_ready())) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert answers == [False] * 6
    client.close()
    with pytest.raises(ManyLoRAError, match="closed"):
        client.extract("t", ENTITIES)
