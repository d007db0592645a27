"""The committed model repository: config.pbtxt declares the protocol's tensors and loads as it is."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

from manylora.config import ConfigError, EngineConfig
from manylora.serving import check_model_config

MODEL_DIR = Path(__file__).resolve().parents[1] / "model_repository" / "gliner2"


def _parsed_config() -> dict:
    message = text_format.Parse((MODEL_DIR / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def test_config_pbtxt_declares_exactly_the_protocol_tensors():
    config = _parsed_config()
    check_model_config(config)  # raises on any difference
    assert config["name"] == "gliner2" and config["backend"] == "python"
    assert int(config["max_batch_size"]) > 0 and "dynamic_batching" in config


def test_a_tensor_drift_is_caught():
    config = _parsed_config()
    config["input"][0]["data_type"] = "TYPE_FP32"
    with pytest.raises(ValueError, match="do not match"):
        check_model_config(config)


def test_committed_parameters_load_as_they_are(tmp_path, tiny_checkpoint, demo_adapters):
    # the committed relative paths point at models/ beside model_repository/ (what `make demo` builds)
    model_dir = tmp_path / "model_repository" / "gliner2"
    shutil.copytree(MODEL_DIR, model_dir)
    (tmp_path / "models").mkdir()
    os.symlink(tiny_checkpoint, tmp_path / "models" / "demo-tiny")
    os.symlink(next(iter(demo_adapters.values())).parent, tmp_path / "models" / "demo-tiny-adapters")
    config = EngineConfig.from_model_config(_parsed_config(), model_dir=model_dir)
    assert config.checkpoint == (tmp_path / "models" / "demo-tiny").resolve()
    assert config.max_gpu_adapters == 32 and config.max_cpu_adapters == 128


@pytest.mark.parametrize(
    "parameters,message",
    [
        ({"gpu_slots": "4"}, "unknown parameter"),
        ({"max_gpu_adapters": "many"}, "'max_gpu_adapters'"),
        ({"max_gpu_adapters": "0"}, "'max_gpu_adapters'"),
        ({"cpu_threads": "0"}, "'cpu_threads': expected 'auto' or a positive number"),
        ({"cpu_threads": "some"}, "'cpu_threads': expected 'auto' or a positive number"),
        ({"chunk_cost_tokens": "0"}, "'chunk_cost_tokens': expected 'auto' or a positive integer"),
        ({"chunk_cost_tokens": "fine"}, "'chunk_cost_tokens': expected 'auto' or a positive integer"),
        ({"dtype": "${DTYPE}"}, "unfilled template"),
        ({"dtype": "float64"}, "'dtype'"),
        ({"kernel_backend": "cuda"}, "'kernel_backend'"),
        ({"max_gpu_adapters": "64", "max_cpu_adapters": "8"}, "max_cpu_adapters"),
        ({"adapter_dir": "/no/such/folder"}, "'adapter_dir'"),
        ({"dtype": "bfloat16"}, "needs a GPU"),
    ],
)
def test_bad_parameters_name_the_key(tiny_checkpoint, parameters, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_parameters({"checkpoint": str(tiny_checkpoint), **parameters})


def test_checkpoint_is_mandatory_and_must_be_a_checkpoint(tmp_path):
    with pytest.raises(ConfigError, match="'checkpoint' is mandatory"):
        EngineConfig.from_parameters({})
    with pytest.raises(ConfigError, match="no config.json"):
        EngineConfig.from_parameters({"checkpoint": str(tmp_path)})


def test_triton_parameter_form_is_parsed_strictly(tiny_checkpoint):
    good = {"parameters": {"checkpoint": {"string_value": str(tiny_checkpoint)}}}
    assert EngineConfig.from_model_config(good).checkpoint == Path(tiny_checkpoint)
    with pytest.raises(ConfigError, match="string_value"):
        EngineConfig.from_model_config({"parameters": {"checkpoint": str(tiny_checkpoint)}})


def test_readme_documents_every_parameter():
    readme = (MODEL_DIR.parents[1] / "README.md").read_text()
    for key, (_, mandatory, _) in EngineConfig.PARAMETERS.items():
        row = next((line for line in readme.splitlines() if line.startswith(f"| `{key}` |")), None)
        assert row is not None, f"README's parameter table lacks {key}"
        assert ("mandatory" in row) == mandatory, row


def test_cpu_threads_parameter(tiny_checkpoint):
    from manylora.serving import instance_threads

    parse = lambda **p: EngineConfig.from_parameters({"checkpoint": str(tiny_checkpoint), **p})  # noqa: E731
    assert parse().cpu_threads == 0 and parse(cpu_threads="auto").cpu_threads == 0  # 0: threads_per_instance
    assert parse(cpu_threads=" 1 ").cpu_threads == 1 and parse(cpu_threads="6").cpu_threads == 6
    four = {"instance_group": [{"count": 4}]}
    assert instance_threads(parse().cpu_threads, four, 16) == 4, "auto: the host's cores shared"
    assert instance_threads(parse(cpu_threads="1").cpu_threads, four, 16) == 1
    assert instance_threads(parse(cpu_threads="6").cpu_threads, four, 16) == 6


def test_chunk_cost_tokens_parameter(tiny_checkpoint):
    parse = lambda **p: EngineConfig.from_parameters({"checkpoint": str(tiny_checkpoint), **p})  # noqa: E731
    assert parse().chunk_cost_tokens == 0 and parse(chunk_cost_tokens="auto").chunk_cost_tokens == 0
    assert parse(chunk_cost_tokens="2048").chunk_cost_tokens == 2048
    assert parse().chunk_cost("cpu") == 128 and parse().chunk_cost("cuda") == parse().chunk_cost("xpu") == 32768
    assert parse(chunk_cost_tokens="2048").chunk_cost("cpu") == 2048


def test_threads_per_instance_share_the_host():
    from manylora.serving import threads_per_instance

    assert threads_per_instance({"instance_group": [{"count": 4, "kind": "KIND_GPU", "gpus": [0]}]}, 16) == 4
    assert threads_per_instance({"instance_group": [{"count": 4, "gpus": [0, 1]}]}, 16) == 2
    assert threads_per_instance({"instance_group": [{"count": 1}]}, 2) == 2
    assert threads_per_instance({}, 8) == 8
    assert threads_per_instance({"instance_group": [{"count": 64}]}, 16) == 1


def test_metrics_interval_parameter(tiny_checkpoint):
    """metrics_interval: seconds >= 0 (0: after every call), 0.25 by default; anything else refused."""
    parse = lambda **p: EngineConfig.from_parameters({"checkpoint": str(tiny_checkpoint), **p})  # noqa: E731
    assert parse().metrics_interval == 0.25
    assert parse(metrics_interval="0").metrics_interval == 0.0 and parse(metrics_interval="2").metrics_interval == 2.0
    for bad in ("-1", "inf", "soon"):
        with pytest.raises(ConfigError, match="metrics_interval"):
            parse(metrics_interval=bad)
