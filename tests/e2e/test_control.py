"""End-to-end: the manylora_control model steers the adapter caches of two gliner2 instances.

The real tritonserver serves the committed control model and gliner2 with two instances
(two processes, two caches). They meet in the per-server control folder (``control_dir``
auto), private and of an unpredictable name. list / preload / evict / stats go over gRPC and
HTTP; the gliner2 answers still equal GLiNER2 + PEFT, and the stats show the effect of each
command on every instance. The same server also serves a read-only copy of the control
model (``allowed_commands`` list,stats), and the ``manylora control`` command line is run
against both.

Until ``manylora/serving.py`` calls ``attach_control`` itself, the gliner2 model.py of this
test adds that one line (GLINER2_MODEL_PY); the call is idempotent, so the test keeps
working once serving.py makes it.
"""

from __future__ import annotations

import io
import json
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from fault_tools import write_control  # noqa: E402
from google.protobuf import text_format
from manylora.client import cli, protocol
from tritonclient.grpc import model_config_pb2
from tritonclient.utils import InferenceServerException

from manylora.compare import result_differences
from manylora.control import ADAPTER_IDS, COMMAND, RESULT, auto_control_dir, control_base
from manylora.demo import demo_schemas, demo_texts

REPOSITORY = Path(__file__).resolve().parents[2] / "model_repository"
CONTROL_MODEL = REPOSITORY / "manylora_control"
GLINER2_MODEL_PY = '''"""gliner2 with adapter control attached (the line serving.py needs)."""

import triton_python_backend_utils as pb_utils

from manylora.control import attach_control
from manylora.serving import TritonModelHandler


class TritonPythonModel:
    def initialize(self, args):
        self.handler = TritonModelHandler(args, pb_utils)
        attach_control(self.handler.engine, args)

    def execute(self, requests):
        return self.handler.execute(requests)

    def finalize(self):
        self.handler.finalize()
'''


def write_gliner2(folder: Path, parameters: dict[str, str], instances: int) -> None:
    """The committed gliner2 config with these parameters and instances; model.py with control attached."""
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.py").write_text(GLINER2_MODEL_PY)
    config = text_format.Parse((REPOSITORY / "gliner2" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    config.parameters.clear()
    for key, value in parameters.items():
        config.parameters[key].string_value = value
    del config.instance_group[:]
    config.instance_group.add(count=instances)
    (folder / "config.pbtxt").write_text(text_format.MessageToString(config))


PARTIAL = "enc-r8-partial"  # enc-r8's file, with a config that leaves one of its modules out


def _partial_adapter(adapters: Path, demo_adapters: dict) -> str:
    """enc-r8's weights under a config whose target_modules leave one module out; that module."""
    folder = adapters / PARTIAL
    shutil.copytree(demo_adapters["enc-r8"], folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    left_out = sorted(config["target_modules"])[0]
    config["target_modules"] = sorted(set(config["target_modules"]) - {left_out})
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return left_out


@pytest.fixture(scope="module")
def control(tmp_path_factory, triton_server_factory, tiny_checkpoint, demo_adapters):
    root = tmp_path_factory.mktemp("control")
    repo, adapters = root / "repo", root / "adapters"
    shutil.copytree(next(iter(demo_adapters.values())).parent, adapters)
    left_out = _partial_adapter(adapters, demo_adapters)
    parameters = {
        "checkpoint": str(tiny_checkpoint),
        "adapter_dir": str(adapters),
        "max_gpu_adapters": "2",
        "max_cpu_adapters": "3",
    }
    write_gliner2(repo / "gliner2", parameters, instances=2)
    write_control(repo / "manylora_control")
    write_control(repo / "manylora_control_ro", allowed_commands="list,stats")
    server = triton_server_factory(repo)
    server.adapters, server.left_out = adapters, left_out
    return server


def _command(server, command: str, adapter_ids: str | None = None, module=grpcclient, model="manylora_control") -> dict:
    client = module.InferenceServerClient(server.grpc_url if module is grpcclient else server.http_url)
    inputs = []
    for name, text in ((COMMAND, command), (ADAPTER_IDS, adapter_ids)):
        if text is not None:
            tensor = module.InferInput(name, [1], "BYTES")
            tensor.set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
            inputs.append(tensor)
    try:
        return json.loads(client.infer(model, inputs).as_numpy(RESULT)[0])
    finally:
        client.close()


def _results(answer: dict) -> dict[str, dict]:
    assert answer["pending"] == [], answer["pending"]
    return {i["instance"]: i["result"] for i in answer["instances"]}


def _extract(server, peft_reference, demo_adapters, adapter: str, seed: int, folder: Path | None = None) -> None:
    """One request through gliner2; its answer must equal GLiNER2 + PEFT with that adapter."""
    from gliner2.inference.schema import Schema

    request = protocol.Request(demo_texts(1, seed=seed)[0], json.dumps(demo_schemas()[0]), adapter=adapter)
    inputs = []
    for name, array in request.to_arrays().items():
        tensor = grpcclient.InferInput(name, list(array.shape), protocol.SPECS[name].triton_dtype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        got = protocol.parse_result(client.infer("gliner2", inputs).as_numpy(protocol.RESULT))
    finally:
        client.close()
    reference = peft_reference(folder or demo_adapters[adapter])
    (expected,) = reference.batch_extract([request.text], Schema.from_json(request.schema))
    assert not result_differences(got, json.loads(json.dumps(expected))), adapter


def test_control_reaches_both_instances_over_the_per_server_folder(control, demo_adapters):
    server = control
    listed = _command(server, "list")
    assert listed["adapters"] == sorted([*demo_adapters, PARTIAL])
    assert sorted(i["instance"] for i in listed["instances"]) == ["gliner2_0_0", "gliner2_0_1"]
    assert len({i["pid"] for i in listed["instances"]}) == 2, "two processes, two caches"
    instances = Path(listed["adapter_dirs"][0])  # sanity: the adapter folder the instances report
    assert instances == server.adapters.resolve()
    folder = auto_control_dir(server.process.pid, create=False)
    assert folder is not None and folder.parent == control_base()
    assert folder.name.startswith(f"server-{server.process.pid}-") and len(folder.name.split("-")) >= 4
    for private in (control_base(), folder, folder / "commands", folder / "instances"):
        assert stat.S_IMODE(private.stat().st_mode) == 0o700, private
    status_files = list((folder / "instances").glob("*.json"))
    assert len(status_files) == 2, "auto control_dir: one folder per tritonserver process"
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in status_files)


def test_preload_then_requests_read_nothing_from_disk(control, peft_reference, demo_adapters):
    server = control
    _command(server, "evict", "enc-r8,qv-r8")
    before = _results(_command(server, "stats"))
    results = _results(_command(server, "preload", "enc-r8, qv-r8,no-such-adapter"))
    for result in results.values():
        assert result["loaded"] == ["enc-r8", "qv-r8"] and result["gpu"] == ["enc-r8", "qv-r8"]
        assert "unknown adapter 'no-such-adapter'" in result["refused"]["no-such-adapter"]
    for seed in range(4):
        _extract(server, peft_reference, demo_adapters, "enc-r8", seed)
        _extract(server, peft_reference, demo_adapters, "qv-r8", seed)
    after = _results(_command(server, "stats", module=httpclient))
    for name, stats in after.items():
        assert stats["events"]["host"]["miss"] == before[name]["events"]["host"]["miss"], "no request went to disk"
        assert stats["loads"]["disk"] == before[name]["loads"]["disk"] + 2
        assert stats["resident"]["host"] >= 2 and stats["resident"]["gpu"] == 2
    assert sum(s["events"]["host"]["hit"] - before[n]["events"]["host"]["hit"] for n, s in after.items()) == 8


def test_evict_forgets_the_adapter_everywhere_and_it_still_serves(control, peft_reference, demo_adapters):
    server = control
    _command(server, "preload", "heads-r8")
    evicted = _results(_command(server, "evict", "heads-r8,enc-r4", module=httpclient))
    for result in evicted.values():
        assert result["evicted"] == ["heads-r8"] and result["not_resident"] == ["enc-r4"]
    for listing in _results(_command(server, "list")).values():
        assert "heads-r8" not in listing["host"] and "heads-r8" not in listing["gpu"]
    before = _results(_command(server, "stats"))
    _extract(server, peft_reference, demo_adapters, "heads-r8", seed=9)
    after = _results(_command(server, "stats"))
    assert sum(after[n]["loads"]["disk"] - before[n]["loads"]["disk"] for n in after) == 1, "read from disk again"


@pytest.mark.parametrize("module", [grpcclient, httpclient], ids=["grpc", "http"])
def test_bad_commands_are_invalid_arg(control, module):
    server = control
    for command, ids, message in (
        ("drop", None, "unknown COMMAND 'drop'"),
        ("preload", None, "preload needs ADAPTER_IDS"),
        ("stats", "enc-r8", "stats takes no ADAPTER_IDS"),
    ):
        with pytest.raises(InferenceServerException, match=message) as info:
            _command(server, command, ids, module=module)
        assert ("INVALID_ARGUMENT" if module is grpcclient else "400") in str(info.value.status())


@pytest.mark.parametrize("module", [grpcclient, httpclient], ids=["grpc", "http"])
def test_allowed_commands_makes_a_control_model_read_only(control, module):
    server = control
    listed = _command(server, "list", module=module, model="manylora_control_ro")
    assert len(listed["instances"]) == 2 and listed["pending"] == []
    with pytest.raises(InferenceServerException, match="COMMAND 'evict' is turned off on this server") as info:
        _command(server, "evict", "enc-r8", module=module, model="manylora_control_ro")
    assert ("StatusCode.UNIMPLEMENTED" if module is grpcclient else "501") in str(info.value.status())


def _cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    status = cli.main(["control", *argv], stdout=out, stderr=err)
    return status, out.getvalue(), err.getvalue()


def test_the_control_command_line_exits_by_what_happened(control):
    server = control
    status, out, err = _cli("stats", "--url", server.grpc_url)
    assert (status, err) == (0, "") and len(json.loads(out)["instances"]) == 2
    status, out, err = _cli("preload", "enc-r4", "no-such-adapter", "--url", server.http_url, "--protocol", "http")
    assert status == 1 and "refused no-such-adapter: unknown adapter 'no-such-adapter'" in err
    assert all(i["result"]["loaded"] == ["enc-r4"] for i in json.loads(out)["instances"]), "the answer is printed"
    status, out, err = _cli("evict", "enc-r4", "--url", server.grpc_url, "--model", "manylora_control_ro")
    assert (status, out) == (1, "") and "is turned off on this server" in err
    status, out, err = _cli("list", "--url", server.grpc_url, "--model", "no_such_model")
    assert (status, out) == (3, "") and "does not serve the model 'no_such_model'" in err
    # python -m manylora.control: the same exits, no traceback
    done = subprocess.run(
        [sys.executable, "-m", "manylora.control", "evict", "enc-r4", "--url", server.grpc_url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and json.loads(done.stdout)["instances"], done.stderr
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "manylora.control",
            "evict",
            "x",
            "--url",
            server.grpc_url,
            "--model",
            "manylora_control_ro",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr and "turned off" in done.stderr


def test_list_shows_the_tensors_peft_ignores(control, peft_reference, demo_adapters):
    """Last in this module: its request pins a GPU slot, which the preload test above counts on."""
    server = control
    _command(server, "preload", PARTIAL)
    for listing in _results(_command(server, "list")).values():
        assert PARTIAL in listing["host"]
        assert listing["ignored"] == {PARTIAL: [server.left_out]}, "enc-r8 itself ignores nothing"
    _extract(server, peft_reference, demo_adapters, PARTIAL, seed=3, folder=server.adapters / PARTIAL)
    _command(server, "evict", PARTIAL)
