"""Hostile adapters and hostile inputs through the real tritonserver (issue 17): no request can
corrupt, hang or starve another.

One server for the module (the committed pipeline on the tiny checkpoint: one gliner2 front and
gliner2_core, plus two copies of the control model: read-write and read-only; the committed
``manylora_control`` is in the repository but left out). Every hostile adapter folder or input
is sent together with good requests, so that all of them share one dynamic batch of the front
(checked with Triton's execution statistics); the hostile ones get a clear message (at most
1,000 characters, never quoting a file) and the right code, the good ones exactly what GLiNER2
(+ PEFT, the adapter's folder alone) answers, and the server is healthy after. Each test's
docstring names the item of the issue it covers. A frozen stub is the exception: it needs a
server of its own (a tiny Python model that freezes), which the test stops.

Item 4's floods of distinct texts and schemas are in test_bounded_memory_server.py; the
catalogue of malformed folders and requests in test_bad_input_catalogue.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import threading
import time
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
    write_control,
    write_gliner2_model,
)
from manylora.client import protocol
from manylora.client.protocol import Request
from safetensors.torch import load_file, save_file
from tritonclient.grpc import model_config_pb2
from tritonclient.utils import InferenceServerException

from manylora.compare import result_differences
from manylora.control import ADAPTER_IDS, COMMAND, RESULT
from manylora.demo import demo_schemas, demo_texts
from manylora.tritonserver import TritonServer

BATCH_DELAY_US = 500_000  # every request of a test goes out well within this: one dynamic batch
GOOD_ADAPTERS = ("enc-r8", "qv-r8", "enc-heads-r16")
TEMPLATE = "enc-r8"  # the demo adapter the hostile folders are made from
REPOSITORY = Path(__file__).resolve().parents[2] / "model_repository"
RW, RO = "manylora_control_rw", "manylora_control_ro"  # RO: allowed_commands list,stats
CORE_INSTANCE = "gliner2_core_0_0"
FLAPPING = 4  # adapters whose weights file a test swaps with a FIFO
REFUSED_AFTER_READING = 36  # item 4: refused folders whose weights file is read whole first


# ---------------------------------------------------------------------------------- the folders
# Each builder writes its hostile folders under the adapter root and returns, per folder, the
# regex its refusal must match after "adapter '<id>' cannot be served: " (None: it is served).

SECRET = "TOPSECRET-7c41"  # written into files; no message may quote it
# matched by PEFT's own rules, these make `re` backtrack for hours on a module name of the
# tiny model (no nested repetition: only the match timeout stops them)
SLOW = r"(.|.)*_proj\d"
UNREADABLE = "adapter_model.safetensors is not a readable safetensors file"


def _adapter(folder: Path, template: Path, config: dict | None = None, tensors: dict | None = None) -> Path:
    """An adapter folder: the template's config (updated; None values removed) and tensors (replaced when given)."""
    folder.mkdir(parents=True)
    merged = {**json.loads((template / "adapter_config.json").read_text()), **(config or {})}
    (folder / "adapter_config.json").write_text(json.dumps({k: v for k, v in merged.items() if v is not None}))
    weights = load_file(str(template / "adapter_model.safetensors")) if tensors is None else tensors
    save_file(weights, str(folder / "adapter_model.safetensors"))
    return folder


def _safetensors(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data


def _module_suffixes(weights: dict) -> list[str]:
    """The last name of every module the file adapts (query_proj, dense, ...)."""
    paths = {k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for k in weights}
    return sorted({p.rsplit(".", 1)[1] for p in paths})


def _overflowing(root: Path, template: Path) -> dict[str, str | None]:
    """Item 1: adapters whose scale or scaled weights are not finite in float32 (refused at load),
    and one whose scaled weights are just finite (served: its rows may overflow, never its batch-mates')."""
    good = load_file(str(template / "adapter_model.safetensors"))
    r = json.loads((template / "adapter_config.json").read_text())["r"]
    b_keys = [k for k in good if "lora_B" in k]
    _adapter(root / "alpha-beyond-float32", template, {"lora_alpha": 1e300})  # finite in float64 only
    scaled = {k: v * 1e10 if k in b_keys else v for k, v in good.items()}
    _adapter(root / "scaled-beyond-float32", template, {"lora_alpha": 1e30 * r}, scaled)  # B x 1e30 overflows
    inf = {**good, b_keys[0]: good[b_keys[0]].clone().index_put_((torch.tensor([0]),), torch.tensor(float("inf")))}
    _adapter(root / "inf-weights", template, tensors=inf)
    # every weight times the scale stays within float32 (the load check passes), x A^T B^T may not
    peak_b = max(float(good[k].abs().max()) for k in b_keys)
    assert peak_b < 1, "the template's B weights, times a scale of 1e38, stay within float32"
    _adapter(root / "barely-finite", template, {"lora_alpha": r * 1e38})
    return {
        "alpha-beyond-float32": "has a scale beyond float32's range",
        "scaled-beyond-float32": r"scaled by .* exceeds the torch.float32 range",
        "inf-weights": "holds NaN or infinite weights",
        "barely-finite": None,
    }


def _slow_work(root: Path, template: Path) -> dict[str, str]:
    """Item 2: configs whose patterns backtrack catastrophically, and safetensors headers that
    once took seconds (or all memory) to read; all refused within milliseconds."""
    good = load_file(str(template / "adapter_model.safetensors"))
    suffixes = _module_suffixes(good)
    _adapter(root / "regex-rank-pattern", template, {"rank_pattern": {SLOW: 8}})
    _adapter(root / "regex-alpha-pattern", template, {"alpha_pattern": {SLOW: 4}})
    _adapter(root / "regex-target-modules", template, {"target_modules": SLOW})
    _adapter(root / "regex-exclude-modules", template, {"exclude_modules": SLOW})
    layers = {"target_modules": suffixes, "layers_to_transform": [0], "layers_pattern": r"(.|.)*self"}
    _adapter(root / "regex-layers-pattern", template, layers)
    _adapter(root / "regex-nested", template, {"rank_pattern": {"(e+)+$": 8}})
    _adapter(root / "regex-too-long", template, {"target_modules": "q" * 5000})
    first_a = next(k for k in good if "lora_A" in k)
    first_b = first_a.replace("lora_A", "lora_B")
    b_bytes = good[first_b].numel() * 4
    dims = {
        first_a: {"dtype": "F32", "shape": [1] * 160_000, "data_offsets": [0, 4]},
        first_b: {"dtype": "F32", "shape": list(good[first_b].shape), "data_offsets": [4, 4 + b_bytes]},
    }
    _adapter(root / "header-160000-dims", template)
    (root / "header-160000-dims" / "adapter_model.safetensors").write_bytes(_safetensors(dims, bytes(4 + b_bytes)))
    elements = {first_a: {"dtype": "F32", "shape": [1 << 20, 1 << 20], "data_offsets": [0, 4 << 40]}}
    _adapter(root / "header-elements", template)
    (root / "header-elements" / "adapter_model.safetensors").write_bytes(_safetensors(elements, b""))
    _adapter(root / "header-size", template)
    with open(root / "header-size" / "adapter_model.safetensors", "r+b") as f:
        f.write(((1 << 20) + 1).to_bytes(8, "little"))  # a header above the limit, in a file under its size limit
    return {
        "regex-rank-pattern": "rank_pattern key #0 takes more than 25 ms to match a module name",
        "regex-alpha-pattern": "alpha_pattern key #0 takes more than 25 ms",
        "regex-target-modules": "target_modules takes more than 25 ms",
        "regex-exclude-modules": "exclude_modules takes more than 25 ms",
        "regex-layers-pattern": "layers_pattern #0 takes more than 25 ms",
        "regex-nested": r"rank_pattern key #0 nests repetitions, as in \(a\+\)\+",
        "regex-too-long": "target_modules is 5000 characters long, above the limit of 1000",
        "header-160000-dims": rf"{UNREADABLE} \(tensor #0 has 160000 dimensions, more than 8\)",
        "header-elements": rf"{UNREADABLE} \(tensor #0 has more than \d+ elements",
        "header-size": rf"{UNREADABLE} \(header of 1048577 bytes, above the limit of 1048576\)",
    }


def _files(root: Path, outside: Path, template: Path) -> dict[str, str]:
    """Item 3: adapter files that are links (out of the root, or to another adapter's file inside
    it), FIFOs, and contents that an error message could echo. None of them is read through a link
    or blocks; no message quotes SECRET. Needs the good adapter enc-r8 in ``root``."""
    outside.mkdir(parents=True, exist_ok=True)
    secret_config = outside / "secret.json"
    secret_config.write_text(json.dumps({"peft_type": SECRET, "r": SECRET}))
    elsewhere = _adapter(outside / "servable", template)  # a good adapter, stored outside the root
    fifo = outside / "fifo"
    os.mkfifo(fifo)

    def relinked(name: str, file_name: str, target: Path) -> None:
        folder = _adapter(root / name, template)
        os.remove(folder / file_name)
        os.symlink(target, folder / file_name)

    relinked("config-link-out", "adapter_config.json", secret_config)
    relinked("weights-link-out", "adapter_model.safetensors", elsewhere / "adapter_model.safetensors")
    relinked("weights-link-in", "adapter_model.safetensors", root / "enc-r8" / "adapter_model.safetensors")
    relinked("weights-link-to-fifo", "adapter_model.safetensors", fifo)
    relinked("config-link-to-dev-zero", "adapter_config.json", Path("/dev/zero"))
    folder = _adapter(root / "config-fifo", template)
    os.remove(folder / "adapter_config.json")
    os.mkfifo(folder / "adapter_config.json")  # reading it would wait for a writer forever
    expected = {
        "config-link-out": "adapter_config.json is a symbolic link",
        "weights-link-out": "adapter_model.safetensors is a symbolic link",
        "weights-link-in": "adapter_model.safetensors is a symbolic link",
        "weights-link-to-fifo": "adapter_model.safetensors is a symbolic link",
        "config-link-to-dev-zero": "adapter_config.json is a symbolic link",
        "config-fifo": "adapter_config.json is not a regular file",
    }
    configs = {  # contents a message could echo
        "secret-peft-type": (json.dumps({"peft_type": SECRET}).encode(), "peft_type is not LORA"),
        "secret-rank": (json.dumps({"r": SECRET}).encode(), r"r \(a string\) / lora_alpha"),
        "secret-not-utf8": (b'{"r": "' + SECRET.encode() + b'\xff"}', "adapter_config.json is not valid JSON"),
        "secret-not-json": (b'{"r": "' + SECRET.encode() + b'" oops', "adapter_config.json is not valid JSON"),
        "secret-target": (json.dumps({"target_modules": [SECRET]}).encode(), "its config selects none of the modules"),
        "secret-long-key": (
            json.dumps({"rank_pattern": {SECRET + "x" * 60_000: 8}}).encode(),
            "rank_pattern key #0 is 600.. characters long, above the limit of 1000",
        ),
    }
    for name, (config, message) in configs.items():
        folder = _adapter(root / name, template)
        (folder / "adapter_config.json").write_bytes(config)
        expected[name] = message
    good = load_file(str(template / "adapter_model.safetensors"))
    _adapter(root / "secret-tensor", template, tensors={**good, SECRET * 50: torch.zeros(1)})
    expected["secret-tensor"] = r"unexpected tensor #\d+ \(only lora_A / lora_B"
    return expected


def _numbers(root: Path, template: Path) -> dict[str, str]:
    """Item 6: a JSON integer beyond Python's 4,300 digits in an adapter config."""
    folder = _adapter(root / "config-huge-integer", template, {"lora_alpha": 12345})
    text = (folder / "adapter_config.json").read_text()
    assert text.count('"lora_alpha": 12345') == 1
    (folder / "adapter_config.json").write_text(text.replace('"lora_alpha": 12345', '"lora_alpha": ' + "9" * 5000))
    return {"config-huge-integer": r"adapter_config.json is not valid JSON \(a number too long to read\)"}


def _selections(root: Path, template: Path) -> dict[str, dict]:
    """Item 7: the template's weights under configs that select only some of its modules (PEFT
    ignores the others' tensors). Name -> the config changes."""
    good = load_file(str(template / "adapter_model.safetensors"))
    config = json.loads((template / "adapter_config.json").read_text())
    suffixes = _module_suffixes(good)
    changes = {
        "select-target-modules": {"target_modules": sorted(config["target_modules"])[1:]},
        "select-layers": {"target_modules": suffixes, "layers_to_transform": [1]},
        "select-layers-pattern": {"target_modules": suffixes, "layers_to_transform": 0, "layers_pattern": "layer"},
        "select-exclude": {"target_modules": suffixes, "exclude_modules": ["value_proj", "output.dense"]},
        "select-exclude-regex": {"exclude_modules": r".*layer\.0\.attention\..*"},
        "select-target-regex": {"target_modules": r".*\.(query|key)_proj"},
    }
    for name, change in changes.items():
        _adapter(root / name, template, change)
    return changes


def _refused_after_reading(root: Path, template: Path, count: int) -> list[str]:
    """Item 4: ``count`` distinct folders (hard links to one file) refused only after their whole
    weights file (the template's, in float64) was read: the config's r does not match them."""
    source = root / "read-then-refused-0"
    weights = {k: v.double() for k, v in load_file(str(template / "adapter_model.safetensors")).items()}
    r = json.loads((template / "adapter_config.json").read_text())["r"]
    _adapter(source, template, {"r": r // 2, "rank_pattern": {}}, weights)
    names = [source.name]
    for n in range(1, count):
        folder = root / f"read-then-refused-{n}"
        folder.mkdir()
        for file_name in ("adapter_config.json", "adapter_model.safetensors"):
            os.link(source / file_name, folder / file_name)
        names.append(folder.name)
    return names


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ---------------------------------------------------------------------------------- the server


class Hostile:
    def __init__(self, server, root: Path, outside: Path, references: References, peft_reference, expected: dict):
        self.server, self.root, self.outside = server, root, outside
        self.references, self.peft_reference = references, peft_reference
        self.expected = expected  # adapter id -> regex of its refusal (None: served)


@pytest.fixture(scope="module")
def hostile(tmp_path_factory, triton_server_factory, tiny_checkpoint, demo_adapters, reference_model, peft_reference):
    base = tmp_path_factory.mktemp("hostile")
    root, outside = base / "adapters", base / "outside"
    root.mkdir()
    for name in GOOD_ADAPTERS:
        _copy(demo_adapters[name], root / name)
    for n in range(FLAPPING):  # their weights files swapped with FIFOs by a test
        _copy(demo_adapters[TEMPLATE], root / f"flapping-{n}")
    template = demo_adapters[TEMPLATE]
    expected: dict = {}
    expected |= _overflowing(root, template)
    expected |= _slow_work(root, template)
    expected |= _files(root, outside, template)
    expected |= _numbers(root, template)
    expected |= {name: None for name in _selections(root, template)}
    for name in _refused_after_reading(root, demo_adapters["enc-heads-r64"], REFUSED_AFTER_READING):
        expected[name] = "config rank 32 does not match the weights' rank 64"

    def front(config):
        config.dynamic_batching.max_queue_delay_microseconds = BATCH_DELAY_US
        del config.instance_group[:]
        config.instance_group.add(count=1, kind=model_config_pb2.ModelInstanceGroup.Kind.KIND_CPU)

    repo = base / "repo"
    parameters = {"adapter_dir": str(root), "max_gpu_adapters": "8", "max_cpu_adapters": "16"}
    write_gliner2_model(repo, "gliner2", tiny_checkpoint, parameters, edit=front)
    write_control(repo / "manylora_control")  # in the repository, not loaded: the channel left out
    write_control(repo / RW)
    write_control(repo / RO, allowed_commands="list,stats")
    loads = [*pipeline_loads("gliner2"), f"--load-model={RW}", f"--load-model={RO}"]
    server = triton_server_factory(repo, extra_args=["--model-control-mode=explicit", *loads])
    folders = {name: demo_adapters[name] for name in GOOD_ADAPTERS}
    folders |= {f"flapping-{n}": template for n in range(FLAPPING)}
    folders |= {name: root / name for name, message in expected.items() if message is None}
    return Hostile(
        server, root, outside, References(reference_model, peft_reference, folders), peft_reference, expected
    )


# ---------------------------------------------------------------------------------- helpers


def _request(text: str, adapter: str = "", schema: str | None = None) -> Request:
    schema = schema or json.dumps(demo_schemas()[0])
    return Request(text, schema, adapter=adapter, include_confidence=True)


def _good(seed: int, n: int = 4) -> list[Request]:
    adapters = ("", *GOOD_ADAPTERS)
    texts = [" ".join(t.split()[:40]) for t in demo_texts(n, seed=seed)]
    return [_request(text, adapters[i % len(adapters)]) for i, text in enumerate(texts)]


def _problems_of_error(answer, code: str, message: str, statuses=GRPC_STATUS) -> list[str]:
    if not isinstance(answer, InferenceServerException):
        return ["answered instead of failing"]
    text = answer.message() or ""
    problems = []
    if answer.status() != statuses[code]:
        problems.append(f"status {answer.status()} != {statuses[code]} ({text[:200]})")
    if not re.search(message, text):
        problems.append(f"message {text[:300]!r} does not match {message!r}")
    if len(text) > 1000:
        problems.append(f"message of {len(text)} characters")
    if SECRET in text:
        problems.append("the message quotes a file")
    return problems


def _problems_of_answer(hostile: Hostile, request: Request, answer) -> list[str]:
    if isinstance(answer, Exception):
        return [f"failed: {answer}"]
    got = protocol.parse_result(answer.as_numpy(protocol.RESULT))
    return result_differences(got, hostile.references.expected(request))


def _refusal(hostile: Hostile, name: str, text: str = "Tim Cook runs Apple in Cupertino.") -> tuple:
    message = rf"^adapter '{name}' cannot be served: (\S+:? )?{hostile.expected[name]}"  # a module path first
    return (_request(text, name), "INVALID_ARG", message)


def _run_batch(hostile: Hostile, bad: list[tuple], good: list[Request], timeout: float = 120.0) -> float:
    """Bad (request or arrays, code, message regex) and good requests interleaved, all sent at
    once: one dynamic batch of the front. Returns the seconds the batch took."""
    for request in good:  # the references first, so that computing them cannot split the batch
        hostile.references.expected(request)
    items: list = []
    good = list(good)
    for i, case in enumerate(bad):
        items.append(case)
        if good and i % max(1, len(bad) // max(1, len(good))) == 0:
            items.append(good.pop())
    items.extend(good)
    inputs = []
    for item in items:
        if isinstance(item, tuple):
            arrays = item[0].to_arrays() if isinstance(item[0], Request) else item[0]
        else:
            arrays = item.to_arrays()
        inputs.append(infer_inputs(grpcclient, arrays))
    before = execution_counts(hostile.server.grpc_url)
    started = time.monotonic()
    answers = send_together(hostile.server.grpc_url, inputs, timeout=timeout)
    elapsed = time.monotonic() - started
    wait_until(lambda: execution_counts(hostile.server.grpc_url)[1] - before[1] >= len(items), 10)
    after = execution_counts(hostile.server.grpc_url)
    problems = []
    for item, answer in zip(items, answers):
        if isinstance(item, tuple):
            name = item[0].adapter if isinstance(item[0], Request) else "raw"
            problems += [f"bad {name}: {p}" for p in _problems_of_error(answer, item[1], item[2])]
        else:
            problems += [f"good {item.adapter or 'base'}: {p}" for p in _problems_of_answer(hostile, item, answer)]
    assert not problems, "\n".join(problems)
    assert after[1] - before[1] == len(items), "every request reached the model"
    assert after[0] - before[0] == 1, f"{after[0] - before[0]} dynamic batches instead of one"
    return elapsed


def _control(hostile: Hostile, command: str, ids: str | None = None, model: str = RW, module=grpcclient):
    """The JSON answer of a control model, or the InferenceServerException it raised."""
    url = hostile.server.grpc_url if module is grpcclient else hostile.server.http_url
    client = module.InferenceServerClient(url)
    inputs = []
    for name, text in ((COMMAND, command), (ADAPTER_IDS, ids)):
        if text is not None:
            tensor = module.InferInput(name, [1], "BYTES")
            tensor.set_data_from_numpy(np.array([text.encode()], dtype=object))
            inputs.append(tensor)
    try:
        return json.loads(client.infer(model, inputs).as_numpy(RESULT)[0])
    except InferenceServerException as exc:
        return exc
    finally:
        client.close()


def _listing(hostile: Hostile, model: str = RO) -> dict:
    answer = _control(hostile, "list", model=model)
    assert isinstance(answer, dict) and answer["pending"] == [], answer
    (instance,) = answer["instances"]
    return instance["result"]


def _healthy(hostile: Hostile, seed: int) -> None:
    """Ready endpoints, and a base and an adapter request answered as GLiNER2 (+ PEFT) answers them."""
    with httpclient.InferenceServerClient(hostile.server.http_url) as client:
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("gliner2") and client.is_model_ready("gliner2_core")
    text = demo_texts(1, seed=seed)[0]
    for request in (_request(text), _request(text, "enc-r8")):
        hostile.references.expected(request)
        (answer,) = send_together(hostile.server.grpc_url, [infer_inputs(grpcclient, request.to_arrays())])
        assert not _problems_of_answer(hostile, request, answer), request.adapter


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


# ---------------------------------------------------------------------------------- item 1


def test_overflowing_adapters_are_refused_and_batch_mates_stay_exact(hostile):
    """Item 1: adapters whose scale or scaled weights are not finite in the serving dtype
    (float32 here) are refused at load; one just within it is served, first alone (it takes GPU
    slot 0, which rows without an adapter once read times zero: inf x 0 = NaN), then next to
    base rows and other adapters. Every batch-mate equals its reference, and so does the hostile
    adapter itself (GLiNER2 + PEFT overflow the same way); after it is evicted too."""
    texts = [" ".join(t.split()[:40]) for t in demo_texts(2, seed=11)]
    first = _request(texts[0], "barely-finite")
    _run_batch(hostile, [], [first])
    assert "barely-finite" in _listing(hostile)["gpu"]
    refused = [_refusal(hostile, n) for n in ("alpha-beyond-float32", "scaled-beyond-float32", "inf-weights")]
    served = [_request(t, a) for t in texts for a in ("", "barely-finite", *GOOD_ADAPTERS)]
    _run_batch(hostile, refused, served)
    resident = _listing(hostile)
    for name in ("alpha-beyond-float32", "scaled-beyond-float32", "inf-weights"):
        assert name not in resident["host"] and name not in resident["gpu"]
    evicted = _control(hostile, "evict", "barely-finite")
    assert evicted["instances"][0]["result"]["evicted"] == ["barely-finite"], evicted
    _run_batch(hostile, refused, [_request(t, a) for t in texts for a in ("", "enc-r8")])


# ---------------------------------------------------------------------------------- item 2


def test_catastrophic_patterns_and_huge_headers_are_refused_in_bounded_time(hostile):
    """Item 2: config patterns that backtrack catastrophically (rank_pattern / alpha_pattern keys,
    target_modules, exclude_modules, layers_pattern) and safetensors headers of 160,000
    dimensions, 2^40 elements or above 1 MiB: refused within milliseconds each, in one batch
    with good requests; the GPU stage is not left spinning, and answers after."""
    names = [n for n in hostile.expected if n.startswith(("regex-", "header-"))]
    (core,) = stub_pids(hostile.server.process.pid, CORE_INSTANCE)
    elapsed = _run_batch(hostile, [_refusal(hostile, n) for n in names], _good(seed=21))
    assert elapsed < 20, f"the batch took {elapsed:.1f} s"
    again = _run_batch(hostile, [_refusal(hostile, n) for n in names], _good(seed=21))  # refusals remembered
    assert again < 20, f"the second batch took {again:.1f} s"
    before = _cpu_seconds(core)
    time.sleep(1.0)
    assert _cpu_seconds(core) - before < 0.5, "the GPU stage keeps a core busy after the batch"
    _healthy(hostile, seed=23)


# ---------------------------------------------------------------------------------- item 3


def test_adapter_files_that_link_out_or_block_are_refused_without_quoting_them(hostile):
    """Item 3: weights or config files that are symlinks (out of the root, to another adapter's
    file, to a FIFO, to /dev/zero), a config that is a FIFO, and contents a message could echo
    (SECRET in the type, the rank, bad UTF-8, bad JSON, a target, a 60 KB pattern, a tensor name):
    refused at once, in one batch with good requests; no message quotes a file. The adapter stored
    outside the root (which a linked weights file pointed at) is never served."""
    names = [n for n in hostile.expected if n.startswith(("config-", "weights-", "secret-"))]
    names.remove("config-huge-integer")
    elapsed = _run_batch(hostile, [_refusal(hostile, n) for n in names], _good(seed=31))
    assert elapsed < 20, f"the batch took {elapsed:.1f} s"
    resident = _listing(hostile)
    assert not set(names) & (set(resident["host"]) | set(resident["gpu"]))
    _healthy(hostile, seed=32)


def test_weights_files_swapped_with_fifos_never_hang_a_load(hostile):
    """Item 3: while batches ask for them, the weights files of the 'flapping-*' adapters are
    swapped (atomic renames) between their regular file and a FIFO, so that a check and the open
    may see different files. Every answer is the adapter's (GLiNER2 + PEFT) or a clean refusal,
    within the batch's time (a blocking open would hang the batch for good); once the files
    stay, the adapters are served again. Rounds go on until both outcomes were seen (at most 16:
    a batch checks its four adapters at about one instant, when about half the time one of them
    is a FIFO; 8 rounds gave only answers once, in CI on a loaded 2-core machine)."""
    names = [f"flapping-{n}" for n in range(FLAPPING)]
    stash = hostile.outside / "flapping-weights"
    shutil.copy2(hostile.root / names[0] / "adapter_model.safetensors", stash)
    stop = threading.Event()
    swaps = [0]

    def flap():
        while not stop.is_set():
            for k, name in enumerate(names):
                folder = hostile.root / name
                os.mkfifo(folder / ".fifo")
                os.replace(folder / ".fifo", folder / "adapter_model.safetensors")
                time.sleep(0.002 * (k + 1))
                os.link(stash, folder / ".regular")
                os.replace(folder / ".regular", folder / "adapter_model.safetensors")
                time.sleep(0.002 * (FLAPPING - k))
            swaps[0] += 1

    clean = re.compile(
        r"^adapter 'flapping-\d' (cannot be served: adapter_model.safetensors is not a regular file$"
        r"|changed while it was read; retry$)"
    )
    outcomes = {"answered": 0, "refused": 0}
    thread = threading.Thread(target=flap, daemon=True)
    thread.start()
    try:
        for seed in range(16):
            if seed >= 2 and all(outcomes.values()):
                break
            text = " ".join(demo_texts(1, seed=40 + seed)[0].split()[:30])
            batch = [_request(text, a) for a in (*names, "", "qv-r8")]
            for request in batch:
                hostile.references.expected(request)
            started = time.monotonic()
            answers = send_together(hostile.server.grpc_url, [infer_inputs(grpcclient, r.to_arrays()) for r in batch])
            assert time.monotonic() - started < 30
            for request, answer in zip(batch, answers):
                if request.adapter in names and isinstance(answer, InferenceServerException):
                    assert clean.search(answer.message() or ""), answer.message()
                    outcomes["refused"] += 1
                else:
                    assert not _problems_of_answer(hostile, request, answer), (request.adapter, answer)
                    outcomes["answered"] += request.adapter in names
    finally:
        stop.set()
        thread.join(10)
        for name in names:  # each swap ends on the regular file; put it back whatever happened
            if not (hostile.root / name / "adapter_model.safetensors").is_file():
                os.link(stash, hostile.root / name / ".regular")
                os.replace(hostile.root / name / ".regular", hostile.root / name / "adapter_model.safetensors")
    print("flapping:", outcomes, "swaps:", swaps[0])
    assert all(outcomes.values()), f"the swaps gave only one outcome: {outcomes}"
    text = demo_texts(1, seed=49)[0]
    _run_batch(hostile, [], [_request(text, name) for name in names] + [_request(text)])


# ---------------------------------------------------------------------------------- item 4


def _rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))


def test_refused_adapters_keep_no_weights_in_the_gpu_stage(hostile):
    """Item 4: distinct adapters refused only after their whole weights file was read (2.6 MB of
    float64 each, the config's rank does not match them), in batches with good requests: the
    GPU stage's resident memory stays flat (it grew by the file of each before)."""
    names = [n for n in hostile.expected if n.startswith("read-then-refused-")]
    (core,) = stub_pids(hostile.server.process.pid, CORE_INSTANCE)
    size = (hostile.root / names[0] / "adapter_model.safetensors").stat().st_size
    assert size > 2 << 20
    rounds = [names[:6], *(names[i : i + 10] for i in range(6, len(names), 10))]
    rss = []
    for k, part in enumerate(rounds):
        _run_batch(hostile, [_refusal(hostile, n) for n in part], _good(seed=50 + k % 2))
        rss.append(_rss_kib(core))
    grown_mib = (rss[-1] - rss[0]) / 1024
    kept_mib = size * (len(names) - len(rounds[0])) / 2**20
    print(f"GPU stage VmRSS KiB per round: {rss}; {kept_mib:.0f} MiB if the refusals kept their files")
    assert grown_mib < min(24, kept_mib / 3), f"{grown_mib:.0f} MiB more after {len(names)} refusals"
    stats = _control(hostile, "stats", model=RO)["instances"][0]["result"]
    assert stats["resident"]["host"] <= 16


# ---------------------------------------------------------------------------------- item 5


def test_the_control_channel_is_restricted_bounded_and_can_be_left_out(hostile):
    """Item 5: the read-only control model (allowed_commands list,stats) refuses evict and preload
    with UNSUPPORTED over gRPC and HTTP while a batch with adapters is in flight, and nothing
    changes; oversized commands and id lists are INVALID_ARG with short messages; the committed
    manylora_control, left out of the loads, is not there to reach; gliner2 answers are exact."""
    good = _good(seed=61, n=6)
    for request in good:
        hostile.references.expected(request)
    answers: list = []
    sender = threading.Thread(
        target=lambda: answers.extend(
            send_together(hostile.server.grpc_url, [infer_inputs(grpcclient, r.to_arrays()) for r in good])
        )
    )
    sender.start()
    problems = []
    many_ids = ",".join(f"id{n}" for n in range(300))
    for module in (grpcclient, httpclient):
        statuses = GRPC_STATUS if module is grpcclient else HTTP_STATUS
        cases = [
            (RO, command, ids, "UNSUPPORTED", f"^COMMAND '{command.lower()}' is turned off on this server")
            for command, ids in (("evict", "enc-r8"), ("preload", "qv-r8"), ("EVICT", "enc-r8,qv-r8"))
        ]
        cases += [
            (RO, "x" * 70_000, None, "INVALID_ARG", rf"^COMMAND has 70000 bytes, above the limit of {64 * 1024}$"),
            (RO, "drop" * 10_000, None, "INVALID_ARG", r"^unknown COMMAND 'dropdrop.{80,100}\.\.\.'; expected one of"),
            (RO, "list", "enc-r8", "INVALID_ARG", "^list takes no ADAPTER_IDS$"),
            (RW, "evict", many_ids, "INVALID_ARG", "^300 adapter ids, above the limit of 256"),
            (RW, "evict", "a" * 50_000, "INVALID_ARG", r"^ADAPTER_IDS has 50000 characters, above the limit of \d+"),
        ]
        for model, command, ids, code, message in cases:
            answer = _control(hostile, command, ids, model=model, module=module)
            problems += [
                f"{module.__name__} {model} {command[:10]}: {p}"
                for p in _problems_of_error(answer, code, message, statuses)
            ]
        answer = _control(hostile, "list", model="manylora_control", module=module)
        if not isinstance(answer, InferenceServerException) or not re.search(
            "unknown model|not found|not ready|unavailable", answer.message() or "", re.I
        ):
            problems.append(f"the left-out control model answered: {answer}")
    sender.join(120)
    assert not problems, "\n".join(problems)
    assert len(answers) == len(good)
    for request, answer in zip(good, answers):
        assert not _problems_of_answer(hostile, request, answer), request.adapter
    resident = _listing(hostile)
    assert {"enc-r8", "qv-r8"} <= set(resident["host"]), "the refused evict changed nothing"
    with httpclient.InferenceServerClient(hostile.server.http_url) as client:
        assert not client.is_model_ready("manylora_control") and client.is_model_ready(RO)
    _healthy(hostile, seed=62)


# ---------------------------------------------------------------------------------- item 6

LONG_KEY_SCHEMA = '{"entities": ["person"], "' + "k" * 60_000 + '": 1}'
HUGE_INTEGER_SCHEMA = '{"entities": ["person"], "x": ' + "9" * 5000 + "}"


def _long_and_huge_cases(hostile: Hostile) -> list[tuple]:
    request = _request("Tim Cook runs Apple in Cupertino.")
    return [
        (
            arrays_of(request, SCHEMA=bytes_item(LONG_KEY_SCHEMA.encode())),
            "INVALID_ARG",
            r"(?s)^SCHEMA is not a valid GLiNER2 schema.*\(cut; \d+ characters in all\)$",
        ),
        (
            arrays_of(request, SCHEMA=bytes_item(HUGE_INTEGER_SCHEMA.encode())),
            "INVALID_ARG",
            "SCHEMA is not valid JSON",
        ),
        (
            arrays_of(request, ADAPTER_ID=bytes_item(b"a" * 60_000)),
            "INVALID_ARG",
            "^invalid adapter id 'a{80}\\.\\.\\.'",
        ),
        _refusal(hostile, "config-huge-integer"),
        _refusal(hostile, "secret-long-key"),
    ]


def test_long_messages_and_huge_integers_over_grpc(hostile):
    """Item 6: a 60 KB unknown schema key (its message once came back as RESOURCE_EXHAUSTED
    'Stream removed'), a 5,000-digit JSON integer in a schema and in an adapter config (INTERNAL
    before), a 60 KB adapter id and a 60 KB config pattern: INVALID_ARG with at most 1,000
    characters, in one batch with good requests."""
    _run_batch(hostile, _long_and_huge_cases(hostile), _good(seed=71))


def test_long_messages_and_huge_integers_over_http(hostile):
    """Item 6, over HTTP (400, the same messages), sent alongside gRPC good requests in one batch."""
    server = hostile.server
    cases = _long_and_huge_cases(hostile)
    good = _good(seed=71)
    for request in good:
        hostile.references.expected(request)
    problems = []
    with httpclient.InferenceServerClient(server.http_url, concurrency=len(cases)) as http:
        before = execution_counts(server.grpc_url)
        pending = []
        for arrays, code, message in cases:
            arrays = arrays.to_arrays() if isinstance(arrays, Request) else arrays
            pending.append((http.async_infer("gliner2", infer_inputs(httpclient, arrays)), code, message))
        answers = send_together(server.grpc_url, [infer_inputs(grpcclient, r.to_arrays()) for r in good])
        for handle, code, message in pending:
            try:
                answer = handle.get_result()
            except InferenceServerException as exc:
                answer = exc
            problems += _problems_of_error(answer, code, message, HTTP_STATUS)
    for request, answer in zip(good, answers):
        problems += _problems_of_answer(hostile, request, answer)
    assert not problems, "\n".join(problems)
    wait_until(lambda: execution_counts(server.grpc_url)[1] - before[1] >= len(cases) + len(good), 10)
    after = execution_counts(server.grpc_url)
    assert after[0] - before[0] == 1 and after[1] - before[1] == len(cases) + len(good)


FREEZER_MODEL = '''
import signal
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Freezes in execute when asked (a busy loop that ignores SIGINT and SIGTERM, as model
    code stuck in a C extension would); answers "ok" otherwise."""

    def initialize(self, args):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def execute(self, requests):
        texts = [pb_utils.get_input_tensor_by_name(r, "TEXT").as_numpy()[0, 0] for r in requests]
        while b"freeze" in texts:
            pass
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([[b"ok"]], dtype=np.object_))]) for _ in texts]
'''
FREEZER_CONFIG = """
name: "freezer"
backend: "python"
max_batch_size: 4
input [ { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_STRING dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""


@pytest.mark.parametrize("how", ["stopped", "killed"])
def test_a_frozen_stub_is_killed_with_its_server(tmp_path, how):
    """Item 6: a real tritonserver whose Python stub is frozen in model code (100% CPU, deaf to
    SIGINT / SIGTERM). Stopped (manylora.tritonserver's stop: SIGINT, SIGKILL after the
    deadline), it exits within its deadline and the stub goes with it, its /dev/shm region too
    (both outlived the server before). Killed alone (SIGKILL to tritonserver only, as a crash or
    the OOM killer would), the stub does not outlive it either. Its own server: the test ends it."""
    repo = tmp_path / "repo"
    (repo / "freezer" / "1").mkdir(parents=True)
    (repo / "freezer" / "config.pbtxt").write_text(FREEZER_CONFIG)
    (repo / "freezer" / "1" / "model.py").write_text(FREEZER_MODEL)
    server = TritonServer(repo, log_file=tmp_path / "server.log", exit_timeout=2).start(timeout=120)
    region = None
    try:
        (stub,) = stub_pids(server.process.pid, "freezer_0_0")
        region = stub_shm_region(stub)
        ask = [infer_inputs(grpcclient, {"TEXT": bytes_item(b"hello")})]
        (answer,) = send_together(server.grpc_url, ask, "freezer")
        assert answer.as_numpy("OUT")[0, 0] == b"ok"
        client = grpcclient.InferenceServerClient(server.grpc_url)
        client.async_infer("freezer", infer_inputs(grpcclient, {"TEXT": bytes_item(b"freeze")}), lambda *a: None)
        start_cpu = _cpu_seconds(stub)
        time.sleep(1.5)
        assert _cpu_seconds(stub) - start_cpu > 0.5, "the stub is frozen in execute"
        client.close()
        started = time.monotonic()
        if how == "stopped":
            server.stop(timeout=10)
        else:
            os.kill(server.process.pid, signal.SIGKILL)
            server.process.wait(10)
        ended = time.monotonic() - started
        assert wait_until(lambda: _gone(stub), 5), "the frozen stub outlived its server"
    finally:
        server.stop(timeout=5)  # after a kill: reaps what is left of the server's group
    assert ended < 15, f"the server took {ended:.1f} s to end"
    if region is not None and how == "stopped":
        assert not region.exists(), "its shared-memory region was left in /dev/shm"
    elif region is not None:
        region.unlink(missing_ok=True)  # what a killed server leaves behind


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


# ---------------------------------------------------------------------------------- item 7


def _peft_applied(model) -> set[str]:
    """The modules PEFT put a LoRA layer on, in a GLiNER2 model given to PeftModel.from_pretrained."""
    return {name for name, module in model.named_modules() if "default" in getattr(module, "lora_A", {})}


def test_tensors_peft_ignores_are_ignored_and_listed(hostile):
    """Item 7: enc-r8's weights under configs that select some of its modules (target_modules as
    names and as a regex, layers_to_transform with and without layers_pattern, exclude_modules as
    names and as a regex): answers equal GLiNER2 + PEFT on that folder, in one batch with good
    requests, and `list` names the modules of each whose tensors are ignored: exactly those PEFT
    left without a LoRA layer."""
    names = [n for n in hostile.expected if n.startswith("select-")]
    texts = [" ".join(t.split()[:40]) for t in demo_texts(len(names), seed=81)]
    _run_batch(hostile, [], [_request(t, a) for t, a in zip(texts, names)] + [_request(texts[0], "enc-r8")])
    listing = _listing(hostile)
    file_modules = {
        k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]
        for k in load_file(str(hostile.root / "enc-r8" / "adapter_model.safetensors"))
    }
    for name in names:
        applied = _peft_applied(hostile.peft_reference(hostile.root / name))
        assert applied and applied < file_modules, name
        assert name in listing["host"], name
        assert listing["ignored"].get(name) == sorted(file_modules - applied), name
    assert "enc-r8" not in listing["ignored"]
