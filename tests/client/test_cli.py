"""The ``manylora`` CLI with a fake client injected through ``main(client_factory=...)``."""

from __future__ import annotations

import io
import json

import pytest
from manylora.client import ManyLoRAError, schemas
from manylora.client.cli import main, read_requests, write_answers
from manylora.client.protocol import Request


class FakeClient:
    """What the CLI needs of a client: stream(), health(), close(). Echoes requests."""

    instances: list = []

    def __init__(self, fail=None, ready=True, **kwargs):
        self.kwargs = kwargs
        self.fail = fail or {}
        self.ready = ready
        self.requests = []
        self.windows = []
        self.closed = False
        FakeClient.instances.append(self)

    def stream(self, items, window=None):
        self.windows.append(window)
        for index, item in enumerate(items):
            if isinstance(item, ManyLoRAError):
                item.index = index
                yield item
                continue
            self.requests.append(item)
            if item.text in self.fail:
                yield ManyLoRAError(self.fail[item.text], "NOT_FOUND", "StatusCode.NOT_FOUND", index)
            else:
                yield {"text": item.text, "adapter": item.adapter, "threshold": item.threshold}

    def health(self):
        return {"url": self.kwargs["url"], "model_ready": self.ready}

    def close(self):
        self.closed = True


def run(argv, *, stdin="", **fake_options):
    """Run the CLI; return (exit status, stdout, stderr, the fake client or None)."""
    FakeClient.instances.clear()
    out, err = io.StringIO(), io.StringIO()
    status = main(
        argv,
        client_factory=lambda **kwargs: FakeClient(**fake_options, **kwargs),
        stdin=io.StringIO(stdin),
        stdout=out,
        stderr=err,
    )
    client = FakeClient.instances[0] if FakeClient.instances else None
    return status, out.getvalue(), err.getvalue(), client


def test_text_mode_prints_the_result():
    status, out, err, client = run(["extract", "--entities", "person, company", "--adapter", "acme", "Tim runs Apple."])
    assert status == 0, err
    assert json.loads(out) == {"text": "Tim runs Apple.", "adapter": "acme", "threshold": 0.5}
    (request,) = client.requests
    assert json.loads(request.schema) == {"entities": ["person", "company"]}
    assert client.closed
    assert client.kwargs == {
        "url": None,
        "protocol": "grpc",
        "model_name": "gliner2",
        "timeout": None,
        "concurrency": 64,
    }


def test_connection_flags_reach_the_client():
    _, _, _, client = run(
        [
            "extract",
            "--url",
            "triton:9001",
            "--protocol",
            "http",
            "--model",
            "g2",
            "--timeout",
            "2.5",
            "--concurrency",
            "7",
            "--relations",
            "works_for",
            "x",
        ]
    )
    assert client.kwargs == {
        "url": "triton:9001",
        "protocol": "http",
        "model_name": "g2",
        "timeout": 2.5,
        "concurrency": 7,
    }


@pytest.mark.parametrize(
    "flags,schema",
    [
        (["--entities", "a,b"], {"entities": ["a", "b"]}),
        (["--relations", "works_for,born_in"], {"relations": ["works_for", "born_in"]}),
        (
            ["--classify", '{"sentiment": ["pos", "neg"]}'],
            {"classifications": [{"task": "sentiment", "labels": ["pos", "neg"]}]},
        ),
        (
            ["--json", '{"p": ["name::str", "tags"]}'],
            {"structures": {"p": {"fields": [{"name": "name", "dtype": "str"}, {"name": "tags"}]}}},
        ),
        (["--schema", '{"entities": {"person": "a human"}}'], {"entities": {"person": "a human"}}),
    ],
)
def test_schema_flags_build_gliner2s_schemas(flags, schema):
    status, _, err, client = run(["extract", *flags, "--threshold", "0.25", "--confidence", "--spans", "some text"])
    assert status == 0, err
    (request,) = client.requests
    assert json.loads(request.schema) == schema
    assert (request.threshold, request.include_confidence, request.include_spans) == (0.25, True, True)


def test_schema_flags_read_files(tmp_path):
    tasks = tmp_path / "tasks.json"
    tasks.write_text(json.dumps({"topic": {"labels": ["a", "b"], "multi_label": True}}))
    _, _, _, client = run(["extract", "--classify", str(tasks), "text"])
    assert json.loads(client.requests[0].schema) == json.loads(
        schemas.encode_schema(schemas.classification_schema({"topic": {"labels": ["a", "b"], "multi_label": True}}))
    )


@pytest.mark.parametrize(
    "argv,message",
    [
        (["extract", "text"], "give a schema"),
        (["extract", "--entities", "a"], "one of the arguments TEXT --input is required"),
        (["extract", "--entities", "a", "--input", "x.jsonl", "text"], "not allowed with"),
        (["extract", "--entities", "a", "--schema", "{}", "t"], "not allowed with"),
        (["extract", "--entities", " , ", "t"], "--entities needs at least one name"),
        (["extract", "--schema", "{oops", "t"], "--schema: the argument is not valid JSON"),
        (["extract", "--schema", "[1]", "t"], "bad schema"),
        (["extract", "--classify", '["a"]', "t"], "--classify must be a JSON object"),
        (["extract", "--classify", '{"t": ["only-one"]}', "t"], "bad schema"),
        (["extract", "--entities", "a", "--threshold", "1.5", "t"], "within [0, 1]"),
        (["extract", "--entities", "a", "--threshold", "high", "t"], "not a number"),
        (["extract", "--entities", "a", "--concurrency", "0", "t"], "must be >= 1"),
        (["extract", "--entities", "a", "--output", "o.jsonl", "t"], "--output needs --input"),
        (["extract", "--entities", "a", "--input", "/no/such/file.jsonl"], "No such file"),
        (["extract", "--entities", "a", "--protocol", "ws", "t"], "invalid choice"),
        (["nothing"], "invalid choice"),
        ([], "required"),
    ],
)
def test_usage_errors_exit_2(argv, message):
    status, out, err, _ = run(argv)
    assert status == 2 and out == ""
    assert message in err


def test_a_client_that_refuses_its_arguments_is_a_usage_error():
    def factory(**kwargs):
        raise ValueError("url must be HOST:PORT without a scheme")

    err = io.StringIO()
    assert main(["health", "--url", "http://x:1"], client_factory=factory, stderr=err) == 2
    assert "without a scheme" in err.getvalue()


def test_text_mode_failure_exits_1():
    status, out, err, _ = run(
        ["extract", "--entities", "a", "--adapter", "nope", "boom"], fail={"boom": "unknown adapter"}
    )
    assert (status, out) == (1, "")
    assert "[NOT_FOUND] unknown adapter" in err


JSONL = (
    "\n".join(
        [
            json.dumps({"text": "first"}),
            "",
            json.dumps({"text": "second", "adapter": "tenant-2", "threshold": 0.9}),
            json.dumps({"text": "third", "schema": {"relations": ["r"]}}),
            "{not json",
            json.dumps({"text": "boom"}),
            json.dumps({"text": "sixth", "id": 6}),
            json.dumps(["a list"]),
            json.dumps({"schema": {"entities": ["x"]}}),
            json.dumps({"text": "bad threshold", "threshold": 3}),
            json.dumps({"text": "server judges", "schema": {"entities": []}, "adapter": None}),
        ]
    )
    + "\n"
)


def test_jsonl_in_jsonl_out_in_input_order(tmp_path):
    source, sink = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(JSONL)
    status, out, err, client = run(
        [
            "extract",
            "--entities",
            "person",
            "--adapter",
            "base-a",
            "--concurrency",
            "3",
            "--input",
            str(source),
            "--output",
            str(sink),
        ],
        fail={"boom": "unknown adapter 'base-a'"},
    )
    assert status == 1 and out == ""
    assert "6 of 10 item(s) failed" in err
    lines = [json.loads(line) for line in sink.read_text().splitlines()]
    assert len(lines) == 10, "one output line per non-empty input line"
    assert lines[0] == {"result": {"text": "first", "adapter": "base-a", "threshold": 0.5}}
    assert lines[1]["result"]["adapter"] == "tenant-2"
    assert lines[1]["result"]["threshold"] == pytest.approx(0.9)
    assert lines[2]["result"]["text"] == "third"
    assert lines[3]["error"]["code"] == "INVALID_ARG" and lines[3]["error"]["message"].startswith("line 5:")
    assert lines[4] == {"error": {"code": "NOT_FOUND", "message": "unknown adapter 'base-a'"}}
    assert "unknown key(s) ['id']" in lines[5]["error"]["message"]
    assert "expected a JSON object" in lines[6]["error"]["message"]
    assert 'missing "text"' in lines[7]["error"]["message"]
    assert "threshold must be within" in lines[8]["error"]["message"]
    assert lines[9] == {"result": {"text": "server judges", "adapter": "base-a", "threshold": 0.5}}
    assert json.loads(client.requests[-1].schema) == {"entities": []}, "dict schemas go as given; the server validates"
    assert [r.text for r in client.requests][:3] == ["first", "second", "third"]
    assert json.loads(client.requests[2].schema) == {"relations": ["r"]}
    assert client.windows == [3]


def test_jsonl_bad_schema_on_a_line_is_reported_locally_when_it_is_not_an_object(tmp_path):
    status, out, _, client = run(
        ["extract", "--input", "-"], stdin=json.dumps({"text": "t", "schema": ["person"]}) + "\n"
    )
    assert status == 1
    (line,) = out.splitlines()
    assert "schema must be a gliner2 Schema, a dict or a JSON string" in json.loads(line)["error"]["message"]
    assert client.requests == []


def test_jsonl_from_stdin_to_stdout_without_schema_flag_uses_line_schemas():
    stdin = json.dumps({"text": "a", "schema": {"entities": ["x"]}}) + "\n" + json.dumps({"text": "b"}) + "\n"
    status, out, _, _ = run(["extract", "--input", "-"], stdin=stdin)
    assert status == 1
    first, second = (json.loads(line) for line in out.splitlines())
    assert first["result"]["text"] == "a"
    assert second["error"]["code"] == "INVALID_ARG" and "no schema flag" in second["error"]["message"]


def test_all_good_file_exits_0(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"text": f"t{i}"}) + "\n" for i in range(20)))
    status, out, err, _ = run(["extract", "--entities", "x", "--input", str(source)])
    assert status == 0, err
    assert [json.loads(line)["result"]["text"] for line in out.splitlines()] == [f"t{i}" for i in range(20)]


def test_read_requests_and_write_answers_directly():
    defaults = dict(
        schema='{"entities": ["x"]}', adapter="", threshold=0.5, include_confidence=True, include_spans=False
    )
    items = list(read_requests(['{"text": "a"}\n', "\n", '{"text": 1}\n'], defaults))
    assert items[0] == Request("a", '{"entities": ["x"]}', include_confidence=True)
    assert isinstance(items[1], ManyLoRAError) and "line 3: text must be a str" in items[1].message
    sink = io.StringIO()
    assert write_answers([{"ok": "ü"}, items[1]], sink) == (2, 1)
    assert sink.getvalue().splitlines() == [
        '{"result": {"ok": "ü"}}',
        json.dumps({"error": {"code": "INVALID_ARG", "message": items[1].message}}, ensure_ascii=False),
    ]


@pytest.mark.parametrize("ready,status", [(True, 0), (False, 1)])
def test_health(ready, status):
    code, out, _, client = run(["health", "--url", "h:1"], ready=ready)
    assert code == status
    assert json.loads(out) == {"url": "h:1", "model_ready": ready}
    assert client.closed
