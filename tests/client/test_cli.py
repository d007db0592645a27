"""The ``manylora`` CLI with a fake client injected through ``main(client_factory=...)``, and
``manylora control`` with a fake sender (``main(control_sender=...)``); the control command
line against a real server is in tests/e2e/test_control.py."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import threading

import pytest
from manylora.client import ManyLoRAError, cli, schemas
from manylora.client.cli import main, read_requests, write_answers
from manylora.client.protocol import Request
from tritonclient.utils import InferenceServerException


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
        stdin=io.BytesIO(stdin) if isinstance(stdin, bytes) else io.StringIO(stdin),
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
            '{"text": "nan threshold", "threshold": NaN}',  # json.loads takes NaN; served as GLiNER2 serves it
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
    assert "4 of 10 item(s) failed" in err
    lines = [json.loads(line) for line in sink.read_text().splitlines()]
    assert len(lines) == 10, "one output line per non-empty input line"
    assert lines[0] == {"result": {"text": "first", "adapter": "base-a", "threshold": 0.5}}
    assert lines[1]["result"]["adapter"] == "tenant-2"
    assert lines[1]["result"]["threshold"] == pytest.approx(0.9)
    assert lines[2]["result"]["text"] == "third"
    assert lines[3]["error"]["code"] == "INVALID_ARG" and lines[3]["error"]["message"].startswith("line 5:")
    assert lines[4] == {"error": {"code": "NOT_FOUND", "message": "unknown adapter 'base-a'"}}
    assert lines[5] == {"id": 6, "result": {"text": "sixth", "adapter": "base-a", "threshold": 0.5}}
    assert "expected a JSON object" in lines[6]["error"]["message"]
    assert 'missing "text"' in lines[7]["error"]["message"]
    assert lines[8]["result"]["text"] == "nan threshold" and lines[8]["result"]["threshold"] != 0.5
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


# ---------------------------------------------------------------------- one pass, bad bytes, ids


def test_a_fifo_is_read_once_and_answered_in_full(tmp_path):
    fifo = tmp_path / "in.fifo"
    os.mkfifo(fifo)
    lines = [json.dumps({"text": f"t{i}", "id": f"doc-{i}"}) + "\n" for i in range(50)]

    def write():
        with open(fifo, "w") as sink:  # blocks until the CLI opens it; a second open would never return
            sink.writelines(lines)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    answer = {}
    cli_thread = threading.Thread(
        target=lambda: answer.update(
            zip(("status", "out", "err"), run(["extract", "--entities", "x", "--input", str(fifo)]))
        ),
        daemon=True,
    )
    cli_thread.start()
    cli_thread.join(30)
    assert not cli_thread.is_alive(), "the CLI hangs on a FIFO (it opened or read it twice)"
    assert answer["status"] == 0, answer["err"]
    records = [json.loads(line) for line in answer["out"].splitlines()]
    assert [r["id"] for r in records] == [f"doc-{i}" for i in range(50)]
    assert [r["result"]["text"] for r in records] == [f"t{i}" for i in range(50)]


def test_bad_bytes_and_bad_json_fail_their_line_only(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_bytes(
        b"\xef\xbb\xbf" + json.dumps({"text": "bom first", "id": 1}).encode() + b"\n"
        b'{"text": "caf\xe9", "id": 2}\n'  # Latin-1, not UTF-8
         + json.dumps({"text": "ünïcode", "id": 3}, ensure_ascii=False).encode() + b"\n"
        b"\xff\xfe\x00garbage\n"
        b'{"text": "no end", "id": 5\n'
        + b"[" * 100_000
        + b"\n"
        + json.dumps({"text": "last", "id": 7}).encode()  # no final newline
    )
    status, out, err, client = run(["extract", "--entities", "x", "--input", str(source)])
    assert status == 1 and "4 of 7 item(s) failed" in err
    records = [json.loads(line) for line in out.splitlines()]
    assert len(records) == 7
    assert records[0] == {"id": 1, "result": {"text": "bom first", "adapter": "", "threshold": 0.5}}
    assert records[1]["error"] == {
        "code": "INVALID_ARG",
        "message": "line 2: not valid UTF-8 (byte 0xe9 at position 13: invalid continuation byte)",
    }
    assert "id" not in records[1], "an undecodable line has no id to pass on"
    assert records[2] == {"id": 3, "result": {"text": "ünïcode", "adapter": "", "threshold": 0.5}}
    assert records[3]["error"]["message"].startswith("line 4: not valid UTF-8")
    assert records[4]["error"]["message"].startswith("line 5: not valid JSON")
    assert records[5]["error"]["message"].startswith("line 6: not valid JSON")
    assert records[6] == {"id": 7, "result": {"text": "last", "adapter": "", "threshold": 0.5}}
    assert [r.text for r in client.requests] == ["bom first", "ünïcode", "last"]


def test_ids_pass_through_as_given_and_bad_lines_keep_theirs():
    stdin = b"".join(
        json.dumps(line).encode() + b"\n"
        for line in (
            {"text": "a", "id": "x-1"},
            {"text": "b", "id": {"doc": 7, "part": [1, 2]}},
            {"text": "c", "id": None},
            {"id": 42},  # no text
            {"text": "boom", "id": 0.5},
            {"text": "no id"},
            {"text": "d", "id": 9, "extra": True},
        )
    )
    status, out, _, _ = run(["extract", "--entities", "x", "--input", "-"], stdin=stdin, fail={"boom": "nope"})
    assert status == 1
    records = [json.loads(line) for line in out.splitlines()]
    assert [r.get("id", "<none>") for r in records] == ["x-1", {"doc": 7, "part": [1, 2]}, None, 42, 0.5, "<none>", 9]
    assert [next(k for k in r if k != "id") for r in records] == ["result"] * 3 + ["error"] * 2 + ["result", "error"]
    assert list(records[0]) == ["id", "result"], "the id comes first"
    assert 'missing "text"' in records[3]["error"]["message"] and records[4]["error"]["code"] == "NOT_FOUND"
    assert "unknown key(s) ['extra']" in records[6]["error"]["message"]


def test_the_input_is_opened_once(tmp_path, monkeypatch):
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"text": "t"}) + "\n")
    opened = []
    real_open = open

    def counting_open(path, *args, **kwargs):
        opened.append(str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", counting_open)
    status, _, err, _ = run(["extract", "--entities", "x", "--input", str(source)])
    assert status == 0, err
    assert opened.count(str(source)) == 1


# ---------------------------------------------------------------------- --version and --help


def test_version(monkeypatch):
    from importlib import metadata

    status, out, err, _ = run(["--version"])
    assert (status, err) == (0, "") and out == f"manylora {metadata.version('manylora')}\n"

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    assert run(["--version"])[1] == f"manylora {cli.FALLBACK_VERSION}\n"


@pytest.mark.parametrize("argv", [["--help"], ["extract", "--help"], ["control", "--help"]])
def test_help_documents_the_exit_statuses(argv):
    status, out, _, _ = run(argv)
    assert status == 0 and "exit status:" in out
    assert "2  usage error" in out and "3  " in out


# ---------------------------------------------------------------------- manylora control


class FakeSender:
    def __init__(self, answer=None, error=None):
        self.answer, self.error, self.calls = answer, error, []

    def __call__(self, url, command, adapter_ids, **options):
        self.calls.append((url, command, adapter_ids, options))
        if self.error is not None:
            raise self.error
        return self.answer


def run_control(argv, sender):
    out, err = io.StringIO(), io.StringIO()
    status = main(["control", *argv], control_sender=sender, stdout=out, stderr=err)
    return status, out.getvalue(), err.getvalue()


def _instance(name="gliner2_0", **answer):
    return {"model": "gliner2", "instance": name, "pid": 1, "device": "cpu", **answer}


def test_control_prints_the_answer_and_exits_0_when_nothing_was_refused():
    answer = {
        "command": "evict",
        "instances": [_instance(result={"evicted": [], "not_resident": ["a"]})],
        "pending": [],
    }
    sender = FakeSender(answer)
    status, out, err = run_control(["evict", "a", "b", "--url", "h:1", "--timeout", "5"], sender)
    assert (status, err) == (0, "") and json.loads(out) == answer
    assert sender.calls == [
        ("h:1", "evict", ["a", "b"], {"model": "manylora_control", "protocol": "grpc", "timeout": 5.0})
    ]
    status, _, _ = run_control(["stats", "--protocol", "http", "--model", "ctl"], sender)
    assert sender.calls[-1] == ("localhost:8000", "stats", [], {"model": "ctl", "protocol": "http", "timeout": None})


@pytest.mark.parametrize(
    "answer,message",
    [
        (
            {"instances": [_instance(result={"loaded": [], "refused": {"x": "unknown adapter 'x'"}, "skipped": []})]},
            "gliner2_0: refused x: unknown adapter 'x'",
        ),
        (
            {"instances": [_instance(result={"loaded": ["a"], "refused": {}, "skipped": ["b"]})]},
            "skipped (the host tier is full): b",
        ),
        ({"instances": [_instance(error="RuntimeError: disk gone")]}, "gliner2_0: RuntimeError: disk gone"),
        ({"instances": [], "pending": [_instance("gliner2_1")]}, "gliner2_1: did not answer within timeout_s"),
    ],
)
def test_control_exits_1_when_anything_was_refused(answer, message):
    status, out, err = run_control(["preload", "a", "b"], FakeSender({"command": "preload", "pending": [], **answer}))
    assert status == 1 and json.loads(out)["command"] == "preload"
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize(
    "error,status,message",
    [
        (
            InferenceServerException("unknown COMMAND", "StatusCode.INVALID_ARGUMENT"),
            1,
            "[INVALID_ARGUMENT] unknown COMMAND",
        ),
        (InferenceServerException("COMMAND 'evict' is turned off", "StatusCode.UNIMPLEMENTED"), 1, "turned off"),
        (InferenceServerException("COMMAND 'evict' is turned off", "501"), 1, "[501] COMMAND 'evict' is turned off"),
        (
            InferenceServerException("no model instance answers adapter control", "StatusCode.UNAVAILABLE"),
            3,
            "no model instance",
        ),
        (
            InferenceServerException("failed to connect to all addresses", "StatusCode.UNAVAILABLE"),
            3,
            "cannot be reached",
        ),
        (InferenceServerException("Deadline Exceeded", "StatusCode.DEADLINE_EXCEEDED"), 3, "Deadline Exceeded"),
        (
            InferenceServerException(
                "Request for unknown model: 'manylora_control' is not found", "StatusCode.NOT_FOUND"
            ),
            3,
            "does not serve the model 'manylora_control'",
        ),
        (
            ConnectionRefusedError(111, "Connection refused"),
            3,
            "the server at localhost:8001 cannot be reached: Connection refused",
        ),
    ],
)
def test_control_server_errors_are_one_clean_line(error, status, message):
    code, out, err = run_control(["evict", "a"], FakeSender(error=error))
    assert (code, out) == (status, "")
    assert err.startswith("manylora control: error: ") and message in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "argv,message",
    [
        (["preload"], "preload needs at least one ADAPTER_ID"),
        (["stats", "a"], "stats takes no ADAPTER_ID"),
        (["drop"], "invalid choice: 'drop'"),
        (["list", "--timeout", "0"], "must be > 0"),
        (["list", "--protocol", "ws"], "invalid choice: 'ws'"),
    ],
)
def test_control_usage_errors_exit_2_without_sending(argv, message):
    sender = FakeSender({})
    status, out, err = run_control(argv, sender)
    assert (status, out, sender.calls) == (2, "", []) and message in err


def test_control_against_no_server_exits_3_without_a_traceback():
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    status, out, err = run_control(["list", "--url", f"127.0.0.1:{port}", "--timeout", "10"], None)
    assert (status, out) == (3, "") and "cannot be reached" in err
    done = subprocess.run(
        [sys.executable, "-m", "manylora.control", "list", "--url", f"127.0.0.1:{port}", "--protocol", "http"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 3 and "Traceback" not in done.stderr and "cannot be reached" in done.stderr
    done = subprocess.run([sys.executable, "-m", "manylora.control"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr and "usage:" in done.stderr
