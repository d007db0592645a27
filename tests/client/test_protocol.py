"""The wire contract (manylora.client.protocol) and the InferInputs built from it."""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from manylora.client import protocol
from manylora.client.protocol import Request
from manylora.client.transport import infer_inputs, requested_outputs

SCHEMA = json.dumps({"entities": ["person", "company"]})


def test_contract_matches_the_design():
    assert protocol.MODEL_NAME == "gliner2"
    assert [(s.name, s.config_dtype, s.triton_dtype, s.numpy_dtype, s.dims, s.optional) for s in protocol.INPUTS] == [
        ("TEXT", "TYPE_STRING", "BYTES", np.object_, (1,), False),
        ("SCHEMA", "TYPE_STRING", "BYTES", np.object_, (1,), False),
        ("ADAPTER_ID", "TYPE_STRING", "BYTES", np.object_, (1,), True),
        ("THRESHOLD", "TYPE_FP32", "FP32", np.float32, (1,), True),
        ("INCLUDE_CONFIDENCE", "TYPE_BOOL", "BOOL", np.bool_, (1,), True),
        ("INCLUDE_SPANS", "TYPE_BOOL", "BOOL", np.bool_, (1,), True),
        ("MAX_LEN", "TYPE_INT32", "INT32", np.int32, (1,), True),
    ]
    assert [(s.name, s.config_dtype, s.triton_dtype) for s in protocol.OUTPUTS] == [("RESULT", "TYPE_STRING", "BYTES")]
    assert {s.name: s.default for s in protocol.INPUTS if s.optional} == {
        "ADAPTER_ID": "",
        "THRESHOLD": 0.5,
        "INCLUDE_CONFIDENCE": False,
        "INCLUDE_SPANS": False,
        "MAX_LEN": 0,
    }
    assert set(protocol.SPECS) == {s.name for s in protocol.INPUTS + protocol.OUTPUTS}


def test_protocol_imports_neither_tritonclient_nor_gliner2():
    code = (
        "import sys, manylora.client.protocol;"
        "heavy = [m for m in ('tritonclient', 'gliner2', 'torch') if m in sys.modules];"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_request_arrays_are_all_six_tensors_shaped_1_1():
    request = Request("Tim Cook runs Apple.", SCHEMA, adapter="acme", threshold=0.25, include_spans=True)
    arrays = request.to_arrays()
    assert list(arrays) == [spec.name for spec in protocol.INPUTS]
    for spec in protocol.INPUTS:
        assert arrays[spec.name].shape == (1, 1)
        assert arrays[spec.name].dtype == np.dtype(spec.numpy_dtype)
    assert arrays["TEXT"][0, 0] == b"Tim Cook runs Apple."
    assert arrays["ADAPTER_ID"][0, 0] == b"acme"
    assert arrays["THRESHOLD"][0, 0] == np.float32(0.25)
    assert arrays["INCLUDE_CONFIDENCE"][0, 0] == np.False_ and arrays["INCLUDE_SPANS"][0, 0] == np.True_


def test_base_model_is_sent_as_an_empty_adapter_id():
    assert Request("t", SCHEMA).to_arrays()["ADAPTER_ID"][0, 0] == b""


def test_arrays_round_trip_exactly():
    request = Request("naïve café – 東京", SCHEMA, adapter="a/b", threshold=0.3, include_confidence=True)
    assert Request.from_arrays(request.to_arrays()) == request
    assert request.threshold == float(np.float32(0.3)), "threshold holds what FP32 carries"


def test_absent_optional_inputs_take_their_defaults():
    arrays = Request("t", SCHEMA).to_arrays()
    decoded = Request.from_arrays({"TEXT": arrays["TEXT"], "SCHEMA": arrays["SCHEMA"], "ADAPTER_ID": None})
    assert decoded == Request("t", SCHEMA, adapter="", threshold=0.5, include_confidence=False, include_spans=False)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"TEXT": None}, "TEXT is required"),
        ({"SCHEMA": np.array([[b"a", b"b"]], dtype=np.object_)}, "SCHEMA must hold one element"),
        ({"TEXT": np.array([[b"\xff\xfe"]], dtype=np.object_)}, "TEXT is not valid UTF-8"),
        ({"TEXT": np.array([[3]], dtype=np.object_)}, "TEXT must be BYTES"),
        ({"EXTRA": np.array([[1]])}, "unknown input"),
    ],
)
def test_bad_arrays_raise_value_error_naming_the_tensor(change, message):
    arrays = {**Request("t", SCHEMA).to_arrays(), **change}
    with pytest.raises(ValueError, match=message):
        Request.from_arrays(arrays)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"text": b"bytes"}, "text must be a str"),
        ({"schema": {"entities": ["x"]}}, "schema must be a str"),
        ({"adapter": None}, "adapter must be a str"),
        ({"threshold": True}, "threshold must be a number"),
        ({"threshold": "0.5"}, "threshold must be a number"),
        ({"include_spans": 1}, "include_spans must be a bool"),
    ],
)
def test_request_validates_its_fields(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Request(**{"text": "t", "schema": SCHEMA, **kwargs})


@pytest.mark.parametrize("threshold", [-0.5, -1e30, 0.0, 1.0, 1.0000001, 1.5, 7, 3e38])
def test_any_finite_threshold_is_taken_as_fp32_carries_it(threshold):
    """As GLiNER2 takes it (above 1 nothing passes, below 0 acts as 0; tested against GLiNER2
    in test_client_dropin.py and tests/engine/test_post.py)."""
    request = Request("t", SCHEMA, threshold=threshold)
    assert request.threshold == float(np.float32(threshold))
    assert Request.from_arrays(request.to_arrays()) == request


@pytest.mark.parametrize(
    "threshold,wire",
    [(float("nan"), None), (float("inf"), np.inf), (-float("inf"), -np.inf), (1e39, np.inf), (-(10**400), -np.inf)],
)
def test_non_finite_thresholds_are_taken_as_gliner2_takes_them(threshold, wire):
    """NaN and +inf pass nothing, -inf acts as 0 (GLiNER2 does not fail on them: tested against
    GLiNER2 in test_client_dropin.py and tests/engine/test_post.py); FP32 makes 1e39 infinite."""
    request = Request("t", SCHEMA, threshold=threshold)
    back = Request.from_arrays(request.to_arrays()).threshold
    if wire is None:
        assert np.isnan(request.threshold) and np.isnan(back)
    else:
        assert request.threshold == wire == back


def _batch(requests) -> dict:
    arrays = [r.to_arrays() for r in requests]
    return {name: np.concatenate([a[name] for a in arrays]) for name in arrays[0]}


def test_a_request_of_several_items_decodes_item_by_item():
    items = [
        Request("one", SCHEMA, adapter="a", threshold=0.25, include_spans=True),
        Request("", SCHEMA, threshold=1.5, include_confidence=True),
        Request("three", '{"relations": ["r"]}'),
    ]
    arrays = _batch(items)
    assert arrays["TEXT"].shape == (3, 1)
    assert protocol.requests_from_arrays(arrays) == items
    assert protocol.requests_from_arrays(items[0].to_arrays()) == items[:1]
    flat = {name: array.reshape(-1) for name, array in arrays.items()}  # [N] as well as [N, 1]
    assert protocol.requests_from_arrays(flat) == items
    absent = {protocol.TEXT: arrays[protocol.TEXT], protocol.SCHEMA: arrays[protocol.SCHEMA]}
    assert protocol.requests_from_arrays(absent) == [Request(r.text, r.schema) for r in items], "defaults for all"
    with pytest.raises(ValueError, match="must hold one element, got shape \\(3, 1\\)"):
        Request.from_arrays(arrays)


@pytest.mark.parametrize(
    "change,message",
    [
        (
            {"THRESHOLD": np.full((1, 1), 0.5, np.float32)},
            "input THRESHOLD has shape \\(1, 1\\), but the request has 2 items",
        ),
        ({"ADAPTER_ID": np.array([[b"a"]] * 3, dtype=np.object_)}, "input ADAPTER_ID has shape \\(3, 1\\)"),
        ({"TEXT": np.array([[b"a", b"b"]] * 2, dtype=np.object_)}, "input TEXT has shape \\(2, 2\\)"),
        ({"TEXT": np.empty((0, 1), dtype=np.object_)}, "input TEXT holds no item"),
        (
            {"TEXT": np.array([[b"ok"], [b"\xff"]], dtype=np.object_)},
            "^item 1 \\(0-based\\) of 2: TEXT is not valid UTF-8",
        ),
        (
            {"SCHEMA": np.array([[b"{}"], [b"\xff"]], dtype=np.object_)},
            "^item 1 \\(0-based\\) of 2: SCHEMA is not valid UTF-8",
        ),
        ({"SCHEMA": None}, "^input SCHEMA is required$"),
    ],
)
def test_bad_requests_of_several_items_name_the_tensor_and_the_item(change, message):
    """Every input present holds one value per item ([N, 1]), as Triton itself requires: an
    optional input is absent or N values, never one for all; a bad item names itself."""
    arrays = {**_batch([Request("t", SCHEMA), Request("u", SCHEMA)]), **change}
    with pytest.raises(ValueError, match=message):
        protocol.requests_from_arrays({k: v for k, v in arrays.items() if v is not None})


def test_results_array_holds_one_result_per_item():
    results = [{"entities": {"city": ["Zürich"]}}, {"t": "a"}, {}]
    array = protocol.results_array(results)
    assert array.shape == (3, 1) and array.dtype == np.object_
    assert protocol.parse_results(array) == results
    assert protocol.parse_results(protocol.result_array(results[0])) == results[:1]


def test_result_array_round_trip_keeps_unicode():
    result = {"entities": {"city": ["Zürich", "東京"]}, "relation_extraction": {"in": [["a", "b"]]}}
    array = protocol.result_array(result)
    assert array.shape == (1, 1) and array.dtype == np.object_
    assert "Zürich".encode() in array[0, 0]
    assert protocol.parse_result(array) == result


def _bytes_element(value: bytes) -> bytes:
    """Triton's BYTES serialization: a little-endian uint32 length, then the bytes."""
    return struct.pack("<I", len(value)) + value


def _expected_wire(request: Request) -> dict:
    return {
        "TEXT": _bytes_element(request.text.encode()),
        "SCHEMA": _bytes_element(request.schema.encode()),
        "ADAPTER_ID": _bytes_element(request.adapter.encode()),
        "THRESHOLD": struct.pack("<f", request.threshold),
        "INCLUDE_CONFIDENCE": bytes([request.include_confidence]),
        "INCLUDE_SPANS": bytes([request.include_spans]),
        "MAX_LEN": struct.pack("<i", request.max_len),
    }


REQUEST = Request("Zoë works at ACME.", SCHEMA, adapter="tenant-7", threshold=0.42, include_confidence=True)


def test_grpc_infer_inputs():
    inputs = infer_inputs("grpc", REQUEST)
    assert all(isinstance(i, grpcclient.InferInput) for i in inputs)
    assert [(i.name(), i.datatype(), i.shape()) for i in inputs] == [
        (s.name, s.triton_dtype, [1, 1]) for s in protocol.INPUTS
    ]
    expected = _expected_wire(REQUEST)
    assert {i.name(): i._get_content() for i in inputs} == expected


def test_http_infer_inputs_are_binary():
    inputs = infer_inputs("http", REQUEST)
    assert all(isinstance(i, httpclient.InferInput) for i in inputs)
    assert [(i.name(), i.datatype(), i.shape()) for i in inputs] == [
        (s.name, s.triton_dtype, [1, 1]) for s in protocol.INPUTS
    ]
    expected = _expected_wire(REQUEST)
    assert {i.name(): i._get_binary_data() for i in inputs} == expected
    for infer_input in inputs:
        tensor = infer_input._get_tensor()
        assert "data" not in tensor
        assert tensor["parameters"] == {"binary_data_size": len(expected[infer_input.name()])}


def test_requested_output_is_result_in_binary():
    (grpc_output,) = requested_outputs("grpc")
    (http_output,) = requested_outputs("http")
    assert grpc_output.name() == http_output.name() == "RESULT"
    assert http_output._get_tensor()["parameters"]["binary_data"] is True


def test_unknown_protocol_is_refused():
    with pytest.raises(ValueError, match="protocol must be one of"):
        infer_inputs("websocket", REQUEST)


def test_routing_headers_carry_the_adapter_for_affinity_gateways():
    from manylora.client.protocol import ADAPTER_HEADER, Request, routing_headers

    assert routing_headers(Request("t", "{}", adapter="support-v2")) == {ADAPTER_HEADER: "support-v2"}
    assert routing_headers(Request("t", "{}")) == {}
    assert ADAPTER_HEADER == "x-adapter-id"  # deploy/k8s/router.yaml hashes on this header


def test_transports_send_the_routing_header():
    from manylora.client.protocol import Request
    from manylora.client.transport import GrpcTransport, HttpTransport

    calls = []

    class FakeTriton:
        def infer(self, model_name, inputs, **kwargs):
            calls.append(kwargs["headers"])
            return "ok"

    grpc = GrpcTransport.__new__(GrpcTransport)
    grpc.triton, grpc._timeout, grpc._outputs = FakeTriton(), None, []
    assert grpc.infer("gliner2", Request("t", "{}", adapter="a1")) == "ok"
    http = HttpTransport.__new__(HttpTransport)
    http._outputs = []
    assert http._infer(FakeTriton(), "gliner2", Request("t", "{}")) == "ok"
    assert calls == [{"x-adapter-id": "a1"}, {}]


@pytest.mark.parametrize("bad", [-1, 2**31, 1.5, True, "3"])
def test_max_len_is_an_int32_count(bad):
    with pytest.raises(ValueError, match="max_len must be"):
        Request("t", SCHEMA, max_len=bad)


def test_max_len_round_trips_and_is_int32_on_the_wire():
    request = Request("t", SCHEMA, max_len=384)
    arrays = request.to_arrays()
    assert arrays["MAX_LEN"].dtype == np.int32 and arrays["MAX_LEN"].shape == (1, 1)
    assert Request.from_arrays(arrays) == request
    assert Request.from_arrays({**arrays, "MAX_LEN": None}).max_len == 0, "absent: every word"
    with pytest.raises(ValueError, match="MAX_LEN must be INT32"):
        Request.from_arrays({**arrays, "MAX_LEN": np.full((1, 1), 3.0, np.float32)})
