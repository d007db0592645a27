"""End-to-end catalogue of bad requests and bad adapter folders, through the real tritonserver.

Every bad request is sent together with good ones so that all of them share one dynamic
batch (checked with Triton's execution statistics); the bad ones get a clear message and
the right code, the good ones exactly what GLiNER2 (+ PEFT) answers. A pickled adapter is
never unpickled: its payload would create a marker file. The first tests pin what Triton's
gRPC and HTTP frontends report for each ``pb_utils.TritonError`` code, and what Triton does
when a model's Python stub process dies.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import signal
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from fault_tools import (
    GRPC_STATUS,
    HTTP_STATUS,
    References,
    arrays_of,
    bytes_item,
    execution_counts,
    infer_inputs,
    pipeline_loads,
    send_together,
    stub_pids,
    stub_shm_region,
    wait_until,
    write_gliner2_model,
)
from manylora.client import protocol
from manylora.client.protocol import MAX_SCHEMA_CHARS, MAX_SCHEMA_LABELS, Request
from safetensors.torch import load_file, save_file
from tritonclient.utils import InferenceServerException

from manylora.compare import result_differences
from manylora.demo import demo_schemas, demo_texts

BATCH_DELAY_US = 1_000_000  # every request of a test goes out well within this: one dynamic batch
MAX_LORA_RANK = 32  # the demo's rank-64 adapter is then refused
GOOD_ADAPTERS = ("enc-r8", "enc-heads-r16", "qv-r8")
SCHEMA = json.dumps({"entities": ["person", "organization"]})

ERROR_CODES_MODEL = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Answers each request with the TritonError code its TEXT names ("OK": a result; "RAISE": execute raises)."""

    def execute(self, requests):
        names = [pb_utils.get_input_tensor_by_name(r, "TEXT").as_numpy()[0, 0].decode() for r in requests]
        if "RAISE" in names:
            raise RuntimeError("execute raised")
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([[b"ok"]], dtype=np.object_))])
            if name == "OK"
            else pb_utils.InferenceResponse(
                output_tensors=[], error=pb_utils.TritonError("answered " + name, getattr(pb_utils.TritonError, name))
            )
            for name in names
        ]
'''
ERROR_CODES_CONFIG = """
name: "error_codes"
backend: "python"
max_batch_size: 8
dynamic_batching { max_queue_delay_microseconds: 100000 }
input [ { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_STRING dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""


class MarkerPayload:
    """Unpickling this creates ``path``: proof that nobody unpickled it is the file's absence."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@dataclass
class Catalogue:
    server: object
    root: Path
    references: References
    markers: list[Path] = field(default_factory=list)
    outside: Path | None = None


def _adapter(folder: Path, template: Path, config: dict | None = None, tensors: dict | None = None) -> None:
    """An adapter folder: the template's config (updated) and tensors (replaced when given)."""
    folder.mkdir(parents=True)
    base = json.loads((template / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**base, **(config or {})}))
    weights = load_file(str(template / "adapter_model.safetensors")) if tensors is None else tensors
    save_file(weights, str(folder / "adapter_model.safetensors"))


def _bad_adapters(root: Path, template: Path, rank64: Path, scratch: Path) -> list[Path]:
    """Bad adapter folders under ``root``; returns the marker files their pickles would create."""
    good = load_file(str(template / "adapter_model.safetensors"))
    first_a = next(k for k in good if k.endswith("lora_A.weight"))
    markers = [scratch / "unpickled-bin", scratch / "unpickled-safetensors"]

    _adapter(root / "corrupt", template)
    (root / "corrupt" / "adapter_model.safetensors").write_bytes(os.urandom(4096))
    _adapter(root / "truncated", template)
    data = (root / "truncated" / "adapter_model.safetensors").read_bytes()
    (root / "truncated" / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    _adapter(root / "empty-weights", template)
    (root / "empty-weights" / "adapter_model.safetensors").write_bytes(b"")
    _adapter(root / "pickle-only", template)
    os.remove(root / "pickle-only" / "adapter_model.safetensors")
    (root / "pickle-only" / "adapter_model.bin").write_bytes(pickle.dumps(MarkerPayload(markers[0])))
    _adapter(root / "pickle-as-safetensors", template)
    torch.save({"x": MarkerPayload(markers[1])}, root / "pickle-as-safetensors" / "adapter_model.safetensors")
    _adapter(root / "wrong-shape", template, tensors={**good, first_a: torch.randn(8, 5)})
    shutil.copytree(rank64, root / "rank64")
    _adapter(root / "ia3", template, {"peft_type": "IA3"})
    _adapter(root / "loha", template, {"peft_type": "LOHA"})
    _adapter(root / "dora", template, {"use_dora": True})
    _adapter(root / "no-config", template)
    os.remove(root / "no-config" / "adapter_config.json")
    _adapter(root / "config-not-json", template)
    (root / "config-not-json" / "adapter_config.json").write_text("{r: 8")
    _adapter(root / "r-not-int", template, {"r": "eight"})
    _adapter(root / "huge", template)
    with open(root / "huge" / "adapter_model.safetensors", "r+b") as f:
        f.truncate(8 << 30)  # sparse: 8 GiB that must never be read
    _adapter(root / "fifo", template)
    os.remove(root / "fifo" / "adapter_model.safetensors")
    os.mkfifo(root / "fifo" / "adapter_model.safetensors")  # reading would block forever
    _adapter(root / "int8-weights", template, tensors={k: v.to(torch.int8) for k, v in good.items()})
    _adapter(root / "nan-weights", template, tensors={**good, first_a: torch.full_like(good[first_a], float("nan"))})
    _adapter(root / "scalar-weights", template, tensors={**good, first_a: torch.tensor(1.0)})
    _adapter(root / "embedding-lora", template, tensors={"base_model.model.embed.lora_embedding_A": torch.ones(2, 2)})
    _adapter(root / "no-weights-inside", template, tensors={"base_model.model.x.bias": torch.ones(2)})
    (root / "empty-folder").mkdir()
    (root / "plain-file").write_text("not a folder")
    return markers


@pytest.fixture(scope="module")
def catalogue(tmp_path_factory, triton_server_factory, tiny_checkpoint, demo_adapters, reference_model, peft_reference):
    base = tmp_path_factory.mktemp("catalogue")
    root = base / "adapters"
    root.mkdir()
    for name in GOOD_ADAPTERS:
        shutil.copytree(demo_adapters[name], root / name)
    shutil.copytree(demo_adapters["enc-r8"], root / "flip")  # corrupted and restored by a test
    markers = _bad_adapters(root, demo_adapters["enc-r8"], demo_adapters["enc-heads-r64"], base)
    outside = base / "outside"
    shutil.copytree(demo_adapters["enc-r8"], outside / "enc-r8")
    os.symlink(outside / "enc-r8", root / "escape")  # a valid adapter, but outside the root

    def batch_delay(config):
        config.dynamic_batching.max_queue_delay_microseconds = BATCH_DELAY_US

    repo = base / "repo"
    parameters = {
        "adapter_dir": str(root),
        "max_lora_rank": str(MAX_LORA_RANK),
        "max_gpu_adapters": "4",
        "max_cpu_adapters": "8",
    }
    write_gliner2_model(repo, "gliner2", tiny_checkpoint, parameters, edit=batch_delay)
    (repo / "error_codes" / "1").mkdir(parents=True)
    (repo / "error_codes" / "config.pbtxt").write_text(ERROR_CODES_CONFIG)
    (repo / "error_codes" / "1" / "model.py").write_text(ERROR_CODES_MODEL)
    folders = {name: demo_adapters[name] for name in GOOD_ADAPTERS} | {"flip": demo_adapters["enc-r8"]}
    loads = [*pipeline_loads("gliner2"), "--load-model=error_codes"]
    server = triton_server_factory(repo, extra_args=["--model-control-mode=explicit", *loads])
    return Catalogue(server, root, References(reference_model, peft_reference, folders), markers, outside)


# ---------------------------------------------------------------------------------- helpers


@dataclass
class Case:
    """One bad request: its input arrays, and the code and message (regex) it must get."""

    name: str
    arrays: dict
    code: str
    message: str
    reaches_model: bool = True  # False: Triton itself refuses it before the batcher
    items: int = 1  # batch dimension of the request


def _request(text="Tim Cook runs Apple in Cupertino.", schema=SCHEMA, adapter="", **kwargs) -> Request:
    return Request(text, schema, adapter=adapter, include_confidence=True, **kwargs)


def _case(name, code, message, request=None, **changes) -> Case:
    return Case(name, arrays_of(request or _request(), **changes), code, message)


def _good_requests(seed: int, n: int = 6) -> list[Request]:
    adapters = ("", *GOOD_ADAPTERS)
    schemas = demo_schemas()[:2]
    return [
        _request(text, json.dumps(schemas[i % 2]), adapters[i % len(adapters)])
        for i, text in enumerate(demo_texts(n, seed=seed))
    ]


def _check_error(answer, code: str, message: str, statuses=GRPC_STATUS) -> list[str]:
    if not isinstance(answer, InferenceServerException):
        return [f"answered instead of failing: {answer.as_numpy(protocol.RESULT) if answer else answer!r}"]
    problems = []
    if answer.status() != statuses[code]:
        problems.append(f"status {answer.status()} != {statuses[code]}")
    if not re.search(message, answer.message() or ""):
        problems.append(f"message {answer.message()!r} does not match {message!r}")
    if len(answer.message() or "") > 1000:
        problems.append(f"message of {len(answer.message())} characters")
    return problems


def _check_good(catalogue: Catalogue, request: Request, answer) -> list[str]:
    if isinstance(answer, Exception):
        return [f"good request failed: {answer}"]
    got = protocol.parse_result(answer.as_numpy(protocol.RESULT))
    return result_differences(got, catalogue.references.expected(request))


def _run_batch(catalogue: Catalogue, cases: list[Case], seed: int) -> None:
    """Bad cases interleaved with good requests, all sent at once: one dynamic batch.

    Triton never batches requests that carry different sets of inputs, so a case that leaves
    an input out goes in a second round after the first, with the others like it.
    """
    good = _good_requests(seed)
    for request in good:  # the reference first, so that computing it cannot split the batch
        catalogue.references.expected(request)
    full = set(protocol.SPECS) - {protocol.RESULT}
    items: list = []
    for i, case in enumerate(c for c in cases if set(c.arrays) >= full):
        items.append(case)
        if i % max(1, len(cases) // len(good)) == 0 and good:
            items.append(good.pop())
    items.extend(good)
    problems = []
    for round_items in (items, [c for c in cases if not set(c.arrays) >= full]):
        if not round_items:
            continue
        batch = [infer_inputs(grpcclient, i.arrays if isinstance(i, Case) else i.to_arrays()) for i in round_items]
        before = execution_counts(catalogue.server.grpc_url)
        answers = send_together(catalogue.server.grpc_url, batch)
        reaching = [item for item in round_items if getattr(item, "reaches_model", True)]
        inferences = sum(item.items if isinstance(item, Case) else 1 for item in reaching)
        # Triton counts a request once it is released, which can be after its response arrived
        # (CI, session 12: a batch of 27 read as 0 more at once)
        wait_until(lambda: execution_counts(catalogue.server.grpc_url)[1] - before[1] >= inferences, 10)
        after = execution_counts(catalogue.server.grpc_url)
        for item, answer in zip(round_items, answers):
            if isinstance(item, Case):
                problems += [f"{item.name}: {p}" for p in _check_error(answer, item.code, item.message)]
            else:
                problems += [f"good {item.adapter or 'base'}: {p}" for p in _check_good(catalogue, item, answer)]
        assert after[1] - before[1] == inferences, "every request that Triton accepted reached the model"
        if round_items is items:
            assert after[0] - before[0] == 1, f"{after[0] - before[0]} dynamic batches instead of one"
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------------- tests


def test_triton_error_codes_as_the_clients_see_them(catalogue):
    """What a model's pb_utils.TritonError code becomes on the wire (fault_tools.GRPC_STATUS /
    HTTP_STATUS), and why execute() must never raise: Triton then fails the whole batch."""
    server = catalogue.server
    for code in GRPC_STATUS:
        text = {"TEXT": bytes_item(code.encode())}
        (answer,) = send_together(server.grpc_url, [infer_inputs(grpcclient, text)], "error_codes")
        assert _check_error(answer, code, f"^answered {code}$") == []
        with (
            httpclient.InferenceServerClient(server.http_url) as client,
            pytest.raises(InferenceServerException) as info,
        ):
            client.infer("error_codes", infer_inputs(httpclient, text))
        assert _check_error(info.value, code, f"^answered {code}$", HTTP_STATUS) == []
    together = [infer_inputs(grpcclient, {"TEXT": bytes_item(name)}) for name in (b"OK", b"RAISE", b"NOT_FOUND")]
    for answer in send_together(server.grpc_url, together, "error_codes"):
        assert _check_error(answer, "INTERNAL", "Failed to process the request.*execute raised") == []


def test_a_killed_stub_fails_requests_cleanly_until_the_model_is_reloaded(catalogue):
    """Triton 2.51 neither restarts a dead Python backend stub nor marks its model unready:
    every request fails with INTERNAL until the model is unloaded and loaded again (a load of
    a loaded model reloads it only when its files changed). Other models are not affected."""
    server = catalogue.server
    ok = [infer_inputs(grpcclient, {"TEXT": bytes_item(b"OK")})]
    (stub,) = stub_pids(server.process.pid, "error_codes_0_0")
    region = stub_shm_region(stub)
    os.kill(stub, signal.SIGKILL)
    assert wait_until(lambda: not Path(f"/proc/{stub}").exists() or "Z" in _process_state(stub), 10)
    dead = "^Stub process 'error_codes_0_0' is not healthy.$"
    (answer,) = send_together(server.grpc_url, ok, "error_codes")
    assert _check_error(answer, "INTERNAL", dead) == []
    with httpclient.InferenceServerClient(server.http_url) as admin:
        assert admin.is_server_ready() and admin.is_model_ready("error_codes"), "Triton still calls it ready"
        (answer,) = send_together(server.grpc_url, ok, "error_codes")
        assert _check_error(answer, "INTERNAL", dead) == [], "and it stays dead"
        good = _request(adapter="enc-r8")
        (answer,) = send_together(server.grpc_url, [infer_inputs(grpcclient, good.to_arrays())])
        assert _check_good(catalogue, good, answer) == [], "the other models still answer"
        admin.unload_model("error_codes")
        assert wait_until(lambda: not admin.is_model_ready("error_codes"), 30)
        admin.load_model("error_codes")
    (answer,) = send_together(server.grpc_url, ok, "error_codes")
    assert answer.as_numpy("OUT")[0, 0] == b"ok", "unload + load starts a new stub"
    if region is not None:
        region.unlink(missing_ok=True)  # the dead stub's shared memory, which Triton leaves behind


def _process_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_bad_adapter_ids(catalogue):
    invalid = "invalid adapter id"
    ids = {
        "traversal": "../enc-r8",
        "traversal-deep": "../../../../etc/passwd",
        "absolute": "/etc",
        "absolute-to-adapter": str(catalogue.root / "enc-r8"),
        "url-encoded": "%2e%2e",
        "url-encoded-slash": "%2e%2e%2fenc-r8",
        "nul": "enc-r8\x00",
        "nul-traversal": "\x00../enc-r8",
        "backslash": "..\\enc-r8",
        "dot": ".",
        "dotdot": "..",
        "hidden": ".enc-r8",
        "over-long": "a" * 129,
        "megabyte-long": "a" * (1 << 20),
        "newline": "enc-r8\n",
        "tab": "enc-r8\t",
        "escape-sequence": "\x1b[31menc-r8",
        "unicode-lookalike": "ｅｎｃ-r8",
    }
    cases = [_case(name, "INVALID_ARG", invalid, _request(adapter=adapter)) for name, adapter in ids.items()]
    cases += [
        _case("unknown", "NOT_FOUND", "unknown adapter 'no-such-adapter'", _request(adapter="no-such-adapter")),
        _case("a-file-not-a-folder", "NOT_FOUND", "unknown adapter 'plain-file'", _request(adapter="plain-file")),
        _case("symlink-outside", "INVALID_ARG", "resolves outside the adapter directory", _request(adapter="escape")),
        _case("not-utf8", "INVALID_ARG", "ADAPTER_ID is not valid UTF-8", ADAPTER_ID=bytes_item(b"enc-\xff")),
    ]
    _run_batch(catalogue, cases, seed=101)


def test_bad_schemas(catalogue):
    not_schema = "SCHEMA is not a valid GLiNER2 schema"
    schemas = {
        "not-json": ("{broken", "SCHEMA is not valid JSON"),
        "empty": ("", "SCHEMA is not valid JSON"),
        "a-list": ('["person"]', "SCHEMA must be a JSON object, got list"),
        "null": ("null", "SCHEMA must be a JSON object, got NoneType"),
        "no-task": ("{}", "At least one of entities"),
        "empty-labels": ('{"entities": []}', "entities list cannot be empty"),
        "numbers-as-labels": ('{"entities": [1, 2]}', not_schema),
        "string-as-labels": ('{"entities": "person"}', not_schema),
        "one-class-label": ('{"classifications": [{"task": "t", "labels": ["a"]}]}', not_schema),
        "unknown-key": ('{"entities": ["x"], "entitys": ["y"]}', not_schema),
        "threshold-out-of-range": ('{"entities": {"a": {"threshold": 2}}}', not_schema),
        "threshold-nan": ('{"entities": {"a": {"threshold": NaN}}}', not_schema),
        "duplicate-labels": ('{"entities": ["a", "a"]}', "entity names must be unique"),
        "lone-surrogate": ('{"entities": ["\\ud800"]}', "SCHEMA could not be encoded"),
        "oversized": (
            json.dumps({"entities": {"x": "y" * MAX_SCHEMA_CHARS}}),
            rf"SCHEMA has \d+ characters, above the limit of {MAX_SCHEMA_CHARS}",
        ),
        "nested-too-deep": ('{"entities": ' + "[" * 5000 + "]" * 5000 + "}", "nested more than 32 levels"),
        "nested-too-deep-and-broken": ("[" * 10_000, "nested more than 32 levels"),
        "too-many-labels": (
            json.dumps({"entities": [f"label{i}" for i in range(MAX_SCHEMA_LABELS + 1)]}),
            f"SCHEMA has {MAX_SCHEMA_LABELS + 1} labels, above the limit of {MAX_SCHEMA_LABELS}",
        ),
        "labels-beyond-the-token-limit": (
            json.dumps({"entities": [f"label {i}" + " word" * 16 for i in range(MAX_SCHEMA_LABELS)]}),
            r"text and schema are \d+ tokens, above the limit of 4096 \(max_request_tokens\)",
        ),
    }
    cases = [
        _case(name, "INVALID_ARG", message, SCHEMA=bytes_item(s.encode())) for name, (s, message) in schemas.items()
    ]
    cases.append(
        _case("not-utf8", "INVALID_ARG", "SCHEMA is not valid UTF-8", SCHEMA=bytes_item(b'{"entities": ["\xff"]}'))
    )
    _run_batch(catalogue, cases, seed=102)


def test_bad_texts_and_thresholds(catalogue):
    # empty and blank texts are answered (as GLiNER2 answers them): tests/engine/test_post.py
    far = r"TEXT has \d+ characters, far above the limit of 4096 tokens"
    texts = {
        "one-megabyte": (b"word " * 220_000, far),
        "one-megabyte-multibyte": ("é" * 600_000).encode(),
        "too-many-tokens": (b"word " * 5000, r"text and schema are \d+ tokens, above the limit of 4096"),
        "not-utf8": (b"caf\xe9 au lait", "TEXT is not valid UTF-8"),
        "truncated-utf8": ("é".encode()[:1], "TEXT is not valid UTF-8"),
    }
    texts["one-megabyte-multibyte"] = (texts["one-megabyte-multibyte"], far)
    cases = [_case(name, "INVALID_ARG", message, TEXT=bytes_item(t)) for name, (t, message) in texts.items()]
    # every threshold, NaN and +-inf too, is answered as GLiNER2 answers it (tests/e2e/test_gliner2_server.py)
    # a request of two items is answered item by item; an optional input of one value next to two is Triton's error
    two_items = {name: np.concatenate([a, a]) for name, a in _request().to_arrays().items()}
    two_items["THRESHOLD"] = np.full((1, 1), 0.5, dtype=np.float32)
    mismatch = "input 'THRESHOLD' batch size does not match other inputs for 'gliner2'"
    cases.append(Case("two-items-one-threshold", two_items, "INVALID_ARG", mismatch, items=2, reaches_model=False))
    _run_batch(catalogue, cases, seed=103)


def test_missing_unknown_and_mistyped_tensors(catalogue):
    """Triton checks the number of inputs, their dtypes and shapes; a request that leaves out
    a required input but keeps the count within [2, 6] reaches the model, which names it."""
    good = _request()
    swapped = {**arrays_of(good, INCLUDE_SPANS=None), "PROMPT": bytes_item(b"x")}
    triton = "INVALID_ARG"
    cases = [
        Case("missing-text", arrays_of(good, TEXT=None), "INVALID_ARG", "^input TEXT is required$"),
        Case("missing-schema", arrays_of(good, SCHEMA=None), "INVALID_ARG", "^input SCHEMA is required$"),
        Case("unknown-input", {**good.to_arrays(), "PROMPT": bytes_item(b"x")}, triton, "expected number of inputs between 2 and 7 but got 8", reaches_model=False),
        Case("unknown-input-instead-of-optional", swapped, triton, "unexpected inference input 'PROMPT'", reaches_model=False),
        Case("two-texts-per-item", arrays_of(good, TEXT=np.array([[b"a", b"b"]], dtype=np.object_)), triton, "unexpected shape for input 'TEXT'", reaches_model=False),
        Case("threshold-fp64", arrays_of(good, THRESHOLD=np.full((1, 1), 0.5)), triton, "input 'THRESHOLD' data-type is 'FP64', but model 'gliner2' expects 'FP32'", reaches_model=False),
        Case("text-int32", arrays_of(good, TEXT=np.full((1, 1), 7, dtype=np.int32)), triton, "input 'TEXT' data-type is 'INT32', but model 'gliner2' expects 'BYTES'", reaches_model=False),
        Case("flag-as-bytes", arrays_of(good, INCLUDE_SPANS=bytes_item(b"true")), triton, "input 'INCLUDE_SPANS' data-type is 'BYTES', but model 'gliner2' expects 'BOOL'", reaches_model=False),
    ]  # fmt: skip
    _run_batch(catalogue, cases, seed=104)


def test_bad_adapter_folders_never_poison_the_others(catalogue):
    expected = {
        "corrupt": "adapter_model.safetensors is not a readable safetensors file",
        "truncated": "adapter_model.safetensors is not a readable safetensors file",
        "empty-weights": "adapter_model.safetensors is not a readable safetensors file",
        "pickle-only": r"adapter_model.safetensors is missing \(adapter_model.bin is pickled and is never loaded",
        "pickle-as-safetensors": "adapter_model.safetensors is not a readable safetensors file",
        "wrong-shape": r"lora_A \(8, 5\) / lora_B \(64, 8\) do not fit a 64->64 linear",
        "rank64": f"classifier.0 has rank 64, above max_lora_rank {MAX_LORA_RANK}",
        "ia3": "peft_type is not LORA",  # messages describe the file, never quote it
        "loha": "peft_type is not LORA",
        "dora": r"DoRA \(use_dora\) is not supported",
        "no-config": "adapter_config.json is missing",
        "config-not-json": "adapter_config.json is not valid JSON",
        "r-not-int": r"r \(a string\) / lora_alpha \(an integer\) must be an integer / a number",
        "huge": r"adapter_model.safetensors is 8589934592 bytes, above the limit of \d+",
        "fifo": "adapter_model.safetensors is not a regular file",
        "int8-weights": "lora_A / lora_B are torch.int8 / torch.int8, not floating point",
        "nan-weights": "encoder.encoder.layer.0.attention.output.dense holds NaN or infinite weights",
        "scalar-weights": r"lora_A \(\) / lora_B \(64, 8\) do not fit",
        "embedding-lora": "LoRA on embeddings is not supported",
        "no-weights-inside": r"unexpected tensor #0 \(only lora_A / lora_B weights can be applied\)",
        "empty-folder": "adapter_config.json is missing",
    }
    cases = [
        _case(name, "INVALID_ARG", f"^adapter '{name}' cannot be served: (.*: )?{message}", _request(adapter=name))
        for name, message in expected.items()
    ]
    _run_batch(catalogue, cases, seed=105)
    assert not [m for m in catalogue.markers if m.exists()], "a pickle was unpickled"
    # the payload is live: unpickling it here creates its marker
    control = catalogue.markers[0].with_name("control")
    pickle.loads(pickle.dumps(MarkerPayload(control)))
    assert control.exists()
    # the same refusals again (now from a warm cache) next to good adapters: nothing changed
    _run_batch(catalogue, cases[:6], seed=106)


def test_a_changed_adapter_is_reread_and_a_refusal_does_not_stick(catalogue):
    """flip: served, then corrupted in place (refused, never its stale copy), then restored."""
    weights = catalogue.root / "flip" / "adapter_model.safetensors"
    good_bytes = weights.read_bytes()
    request = _request(demo_texts(1, seed=107)[0], adapter="flip")
    expected = catalogue.references.expected(request)
    corrupt = Case("flip-corrupt", request.to_arrays(), "INVALID_ARG", "adapter 'flip' cannot be served")

    def ask():
        (answer,) = send_together(catalogue.server.grpc_url, [infer_inputs(grpcclient, request.to_arrays())])
        return answer

    assert not result_differences(protocol.parse_result(ask().as_numpy(protocol.RESULT)), expected)
    with open(weights, "r+b") as f:  # in place, as `cp` would: same inode
        f.truncate(len(good_bytes) // 3)
    _run_batch(catalogue, [corrupt], seed=108)
    with open(weights, "r+b") as f:
        f.write(good_bytes)
    assert not result_differences(protocol.parse_result(ask().as_numpy(protocol.RESULT)), expected)


def test_http_bad_requests_in_a_batch_with_grpc_good_ones(catalogue):
    """HTTP errors map to 400 / 404; sent alongside gRPC good requests, in the same batch."""
    server = catalogue.server
    http_cases = [
        _case("unknown-adapter", "NOT_FOUND", "unknown adapter 'nope'", _request(adapter="nope")),
        _case("traversal", "INVALID_ARG", "invalid adapter id", _request(adapter="../enc-r8")),
        _case("bad-json", "INVALID_ARG", "SCHEMA is not valid JSON", SCHEMA=bytes_item(b"{")),
        _case("not-utf8", "INVALID_ARG", "TEXT is not valid UTF-8", TEXT=bytes_item(b"\xff")),
        _case("bad-adapter-file", "INVALID_ARG", "adapter 'corrupt' cannot be served", _request(adapter="corrupt")),
    ]
    good = _good_requests(seed=109)
    for request in good:
        catalogue.references.expected(request)
    problems = []
    # an HTTP connection left open makes tritonserver wait out its exit timeout when it stops
    with httpclient.InferenceServerClient(server.http_url, concurrency=len(http_cases)) as http:
        before = execution_counts(server.grpc_url)
        pending = [http.async_infer(protocol.MODEL_NAME, infer_inputs(httpclient, c.arrays)) for c in http_cases]
        answers = send_together(server.grpc_url, [infer_inputs(grpcclient, r.to_arrays()) for r in good])
        for case, handle in zip(http_cases, pending):
            try:
                answer = handle.get_result()
            except InferenceServerException as exc:
                answer = exc
            problems += [f"{case.name}: {p}" for p in _check_error(answer, case.code, case.message, HTTP_STATUS)]
    for request, answer in zip(good, answers):
        problems += [f"good {request.adapter or 'base'}: {p}" for p in _check_good(catalogue, request, answer)]
    wait_until(lambda: execution_counts(server.grpc_url)[1] - before[1] >= len(http_cases) + len(good), 10)
    after = execution_counts(server.grpc_url)
    assert not problems, "\n".join(problems)
    assert after[0] - before[0] == 1 and after[1] - before[1] == len(http_cases) + len(good)


def test_http_malformed_json_bodies(catalogue):
    """Raw HTTP bodies no client library sends. Triton answers them itself, and answers a body
    it cannot parse with 500, not 400 (Triton 2.51's HTTP frontend)."""
    url = f"http://{catalogue.server.http_url}/v2/models/gliner2/infer"

    def body(text: dict, extra: list | None = None) -> bytes:
        schema = {"name": "SCHEMA", "shape": [1, 1], "datatype": "BYTES", "data": [SCHEMA]}
        return json.dumps({"inputs": [{"name": "TEXT", **text}, schema, *(extra or [])]}).encode()

    one = {"shape": [1, 1], "datatype": "BYTES"}
    bodies = {
        "not-json": (b"{inputs", 500, "failed to parse the request JSON buffer"),
        "text-is-a-number": (body({**one, "data": [7]}), 500, "Unable to parse JSON bytes array"),
        "negative-shape": (
            body({"shape": [1, -1], "datatype": "BYTES", "data": ["a"]}),
            500,
            "Unable to parse 'shape'",
        ),
        "more-data-than-shape": (body({**one, "data": ["a", "b"]}), 400, "unexpected number of string elements 2"),
        "batch-of-zero": (
            json.dumps(
                {"inputs": [{"name": n, "shape": [0, 1], "datatype": "BYTES", "data": []} for n in ("TEXT", "SCHEMA")]}
            ).encode(),
            400,
            "expected 1 string elements",
        ),
        "huge-shape": (body({"shape": [1, 1 << 40], "datatype": "BYTES", "data": ["a"]}), 400, "unexpected shape"),
        "no-inputs": (json.dumps({"inputs": []}).encode(), 400, "missing required input(s) ['TEXT','SCHEMA']"),
    }
    for name, (data, status, message) in bodies.items():
        request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request, timeout=30)
        error = json.loads(info.value.read())["error"]
        assert (info.value.code, message in error) == (status, True), (name, info.value.code, error)
