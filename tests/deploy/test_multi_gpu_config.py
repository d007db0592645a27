"""deploy/multi-gpu/config.pbtxt: a valid part of a model config, with parameters the engine
accepts, and the same config the container writes from the equivalent environment."""

from __future__ import annotations

from deploy_files import REPO, load_script
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from manylora.config import EngineConfig

SNIPPET = REPO / "deploy" / "multi-gpu" / "config.pbtxt"


def snippet():
    return text_format.Parse(SNIPPET.read_text(), model_config_pb2.ModelConfig())


def test_parameters_parse_as_the_engine_parses_them():
    values = {k: v.string_value for k, v in snippet().parameters.items()}
    assert set(values) <= set(EngineConfig.PARAMETERS)
    for key, raw in values.items():
        EngineConfig.PARAMETERS[key][0](key, raw)
    assert int(values["max_cpu_adapters"]) >= int(values["max_gpu_adapters"])


def test_all_gpus_with_several_instances_each():
    (group,) = snippet().instance_group
    assert group.kind == group.KIND_GPU and group.count > 1 and len(group.gpus) > 1


def test_container_environment_renders_the_same_config():
    wanted = snippet()
    (group,) = wanted.instance_group
    env = {
        "MANYLORA_GPUS": ",".join(map(str, group.gpus)),
        "MANYLORA_INSTANCES_PER_GPU": str(group.count),
        "MANYLORA_CHECKPOINT": wanted.parameters["checkpoint"].string_value,
        "MANYLORA_ADAPTER_DIR": wanted.parameters["adapter_dir"].string_value,
    }
    for key, value in wanted.parameters.items():
        if key not in ("checkpoint", "adapter_dir"):
            env["MANYLORA_PARAM_" + key.upper()] = value.string_value
    render_config = load_script("docker/render_config.py")
    committed = REPO / "model_repository" / "gliner2"
    rendered = text_format.Parse(
        render_config.render_config((committed / "config.pbtxt").read_text(), env, model_dir=committed),
        model_config_pb2.ModelConfig(),
    )
    assert list(rendered.instance_group) == list(wanted.instance_group)
    for key, value in wanted.parameters.items():
        assert rendered.parameters[key].string_value == value.string_value
