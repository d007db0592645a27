"""End-to-end: the manylora_control model steers the adapter caches of two gliner2 instances.

The real tritonserver serves the committed control model and gliner2 with two instances
(two processes, two caches). They meet in the per-server control folder (``control_dir``
auto). list / preload / evict / stats go over gRPC and HTTP; the gliner2 answers still equal
GLiNER2 + PEFT, and the stats show the effect of each command on every instance.

Until ``manylora/serving.py`` calls ``attach_control`` itself, the gliner2 model.py of this
test adds that one line (GLINER2_MODEL_PY); the call is idempotent, so the test keeps
working once serving.py makes it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import text_format
from manylora.client import protocol
from tritonclient.grpc import model_config_pb2
from tritonclient.utils import InferenceServerException

from manylora.compare import result_differences
from manylora.control import ADAPTER_IDS, COMMAND, RESULT, default_control_dir
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


@pytest.fixture(scope="module")
def control(tmp_path_factory, triton_server_factory, tiny_checkpoint, demo_adapters):
    repo = tmp_path_factory.mktemp("control") / "repo"
    parameters = {
        "checkpoint": str(tiny_checkpoint),
        "adapter_dir": str(next(iter(demo_adapters.values())).parent),
        "max_gpu_adapters": "2",
        "max_cpu_adapters": "3",
    }
    write_gliner2(repo / "gliner2", parameters, instances=2)
    shutil.copytree(CONTROL_MODEL, repo / "manylora_control", ignore=shutil.ignore_patterns("__pycache__"))
    return triton_server_factory(repo)


def _command(server, command: str, adapter_ids: str | None = None, module=grpcclient) -> dict:
    client = module.InferenceServerClient(server.grpc_url if module is grpcclient else server.http_url)
    inputs = []
    for name, text in ((COMMAND, command), (ADAPTER_IDS, adapter_ids)):
        if text is not None:
            tensor = module.InferInput(name, [1], "BYTES")
            tensor.set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
            inputs.append(tensor)
    try:
        return json.loads(client.infer("manylora_control", inputs).as_numpy(RESULT)[0])
    finally:
        client.close()


def _results(answer: dict) -> dict[str, dict]:
    assert answer["pending"] == [], answer["pending"]
    return {i["instance"]: i["result"] for i in answer["instances"]}


def _extract(server, peft_reference, demo_adapters, adapter: str, seed: int) -> None:
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
    (expected,) = peft_reference(demo_adapters[adapter]).batch_extract([request.text], Schema.from_json(request.schema))
    assert not result_differences(got, json.loads(json.dumps(expected))), adapter


def test_control_reaches_both_instances_over_the_per_server_folder(control, demo_adapters):
    server = control
    listed = _command(server, "list")
    assert listed["adapters"] == sorted(demo_adapters)
    assert sorted(i["instance"] for i in listed["instances"]) == ["gliner2_0_0", "gliner2_0_1"]
    assert len({i["pid"] for i in listed["instances"]}) == 2, "two processes, two caches"
    instances = Path(listed["adapter_dirs"][0])  # sanity: the adapter folder the instances report
    assert instances == next(iter(demo_adapters.values())).parent.resolve()
    folder = default_control_dir().parent / f"server-{server.process.pid}"
    status_files = list((folder / "instances").glob("*.json"))
    assert len(status_files) == 2, "auto control_dir: one folder per tritonserver process"


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
