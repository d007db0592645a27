"""deploy/multi-gpu/: the parts of the two pipeline configs that change for all GPUs of one
host. gliner2_core.config.pbtxt (the GPU stage: one instance per GPU, parameters the engine
accepts) and gliner2.config.pbtxt (the CPU fronts' count only) are valid parts of model
configs, and the container writes the same configs from the equivalent environment."""

from __future__ import annotations

import re

from deploy_files import REPO, load_script
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from manylora.config import EngineConfig

FOLDER = REPO / "deploy" / "multi-gpu"
CORE_SNIPPET = FOLDER / "gliner2_core.config.pbtxt"
FRONT_SNIPPET = FOLDER / "gliner2.config.pbtxt"
FRONT_READS = {"checkpoint", "max_request_tokens", "core_model"}


def snippet(path):
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def test_the_folder_holds_one_part_per_pipeline_model():
    assert sorted(p.name for p in FOLDER.iterdir()) == sorted([CORE_SNIPPET.name, FRONT_SNIPPET.name])
    for path in (CORE_SNIPPET, FRONT_SNIPPET):
        model = path.name.removesuffix(".config.pbtxt")
        assert (REPO / "model_repository" / model / "config.pbtxt").is_file(), model
        assert f"model_repository/{model}/config.pbtxt" in path.read_text()


def test_core_parameters_parse_as_the_engine_parses_them():
    values = {k: v.string_value for k, v in snippet(CORE_SNIPPET).parameters.items()}
    assert set(values) <= set(EngineConfig.PARAMETERS) - {"core_model"}
    for key, raw in values.items():
        EngineConfig.PARAMETERS[key][0](key, raw)
    assert int(values["max_cpu_adapters"]) >= int(values["max_gpu_adapters"])


def test_one_core_instance_on_every_gpu_and_cpu_fronts():
    (group,) = snippet(CORE_SNIPPET).instance_group
    assert group.kind == group.KIND_GPU and group.count == 1 and len(group.gpus) > 1
    front = snippet(FRONT_SNIPPET)
    (fronts,) = front.instance_group
    assert fronts.kind == fronts.KIND_CPU and fronts.count >= len(group.gpus)
    assert not front.parameters  # the front keeps its committed parameters


def test_container_environment_renders_the_same_configs():
    core = snippet(CORE_SNIPPET)
    (group,) = core.instance_group
    (fronts,) = snippet(FRONT_SNIPPET).instance_group
    env = {
        "MANYLORA_GPUS": ",".join(map(str, group.gpus)),
        "MANYLORA_INSTANCES_PER_GPU": str(group.count),
        "MANYLORA_FRONT_INSTANCES": str(fronts.count),
        "MANYLORA_CHECKPOINT": core.parameters["checkpoint"].string_value,
        "MANYLORA_ADAPTER_DIR": core.parameters["adapter_dir"].string_value,
    }
    for key, value in core.parameters.items():
        if key not in ("checkpoint", "adapter_dir"):
            env["MANYLORA_PARAM_" + key.upper()] = value.string_value
    # the settings the comment names are these
    header = CORE_SNIPPET.read_text()
    for name in ("MANYLORA_INSTANCES_PER_GPU", "MANYLORA_FRONT_INSTANCES"):
        assert re.search(rf"{name}={env[name]}\b", header), name
    render_config = load_script("docker/render_config.py")
    rendered = {
        name: text_format.Parse(text, model_config_pb2.ModelConfig())
        for name, text in render_config.render_models(REPO / "model_repository", env).items()
    }
    assert list(rendered["gliner2_core"].instance_group) == list(core.instance_group)
    for key, value in core.parameters.items():
        assert rendered["gliner2_core"].parameters[key].string_value == value.string_value
    front = rendered["gliner2"]
    assert list(front.instance_group) == list(snippet(FRONT_SNIPPET).instance_group)
    # the front reads the same checkpoint's tokenizer, and none of the engine's settings
    assert front.parameters["checkpoint"].string_value == core.parameters["checkpoint"].string_value
    assert set(front.parameters) <= FRONT_READS
