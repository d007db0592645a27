"""docker/render_config.py: every environment setting lands on the model of the pipeline that
reads it (gliner2, the CPU front; gliner2_core, the GPU stage; manylora_control), the rest of
each committed config is kept, and the rendered configs parse as the models will parse them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from deploy_files import REPO, load_script
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

from manylora.config import EngineConfig

render_config = load_script("docker/render_config.py")
SOURCE = REPO / "model_repository"
FRONT, CORE, CONTROL = "gliner2", "gliner2_core", "manylora_control"
# what the front reads (manylora.serving.TritonModelHandler with core_model set); written
# out here, not taken from the renderer, so a routing change has to change this test too
FRONT_READS = {"checkpoint", "max_request_tokens", "core_model"}
KIND_CPU = model_config_pb2.ModelInstanceGroup.Kind.KIND_CPU
KIND_GPU = model_config_pb2.ModelInstanceGroup.Kind.KIND_GPU


def committed(name: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse((SOURCE / name / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())


def render(env: dict) -> dict[str, model_config_pb2.ModelConfig | None]:
    rendered = render_config.render_models(SOURCE, env)
    return {
        name: None if text is None else text_format.Parse(text, model_config_pb2.ModelConfig())
        for name, text in rendered.items()
    }


def parameters(config) -> dict[str, str]:
    return {k: v.string_value for k, v in config.parameters.items()}


def groups(config) -> list[tuple]:
    return [(g.count, g.kind, list(g.gpus)) for g in config.instance_group]


@pytest.fixture
def model_files(tmp_path) -> tuple[Path, Path]:
    """A checkpoint folder (config.json only) and an adapter folder, for EngineConfig's checks."""
    checkpoint, adapters = tmp_path / "checkpoint", tmp_path / "adapters"
    checkpoint.mkdir()
    adapters.mkdir()
    (checkpoint / "config.json").write_text("{}")
    return checkpoint, adapters


def engine_config(config) -> EngineConfig:
    """The rendered config as the model's initialize() parses it."""
    as_json = json.loads(json_format.MessageToJson(config, preserving_proto_field_name=True))
    return EngineConfig.from_model_config(as_json, model_dir=SOURCE / config.name)


def test_committed_layout_is_the_pipeline():
    front, core = committed(FRONT), committed(CORE)
    assert parameters(front)["core_model"] == CORE == core.name
    assert set(parameters(front)) <= FRONT_READS
    assert "core_model" not in parameters(core) and "adapter_dir" in parameters(core)
    assert groups(front) == [(2, KIND_CPU, [])]
    assert [(g.count, list(g.gpus)) for g in core.instance_group] == [(1, [])]


def test_no_settings_keep_the_committed_configs_with_absolute_paths():
    rendered = render({})
    assert set(rendered) == {FRONT, CORE}  # manylora_control untouched
    for name in (FRONT, CORE):
        config, original = rendered[name], committed(name)
        for key in ("checkpoint", "adapter_dir"):
            if key in original.parameters:
                relative = original.parameters[key].string_value
                assert Path(config.parameters[key].string_value) == (SOURCE / name / relative).resolve()
                config.parameters[key].string_value = original.parameters[key].string_value = ""
        assert config == original, name
    assert [i.name for i in rendered[FRONT].input] == [
        "TEXT",
        "SCHEMA",
        "ADAPTER_ID",
        "THRESHOLD",
        "INCLUDE_CONFIDENCE",
        "INCLUDE_SPANS",
        "MAX_LEN",
    ]


@pytest.mark.parametrize("key", sorted(EngineConfig.PARAMETERS))
def test_each_parameter_goes_to_the_model_that_reads_it(key):
    value = {"core_model": CORE, "control_dir": "/srv/control"}.get(key, f"/value/of/{key}")
    rendered = render({"MANYLORA_PARAM_" + key.upper(): value})
    front, core = parameters(rendered[FRONT]), parameters(rendered[CORE])
    assert (front.get(key) == value) == (key in FRONT_READS), f"{key} on the front"
    assert (core.get(key) == value) == (key != "core_model"), f"{key} on the GPU stage"
    # nothing else moved
    for name, values in ((FRONT, front), (CORE, core)):
        others = {k: v for k, v in values.items() if k != key}
        untouched = {k: v for k, v in parameters(render({})[name]).items() if k != key}
        assert others == untouched, name


def test_shorthands_and_a_full_deployment(model_files):
    checkpoint, adapters = model_files
    rendered = render(
        {
            "MANYLORA_CHECKPOINT": str(checkpoint),
            "MANYLORA_ADAPTER_DIR": str(adapters),
            "MANYLORA_PARAM_MAX_GPU_ADAPTERS": "256",
            "MANYLORA_PARAM_MAX_CPU_ADAPTERS": "512",
            "MANYLORA_PARAM_MAX_REQUEST_TOKENS": "2048",
            "MANYLORA_PARAM_PRELOAD_ADAPTERS": "all",
            "MANYLORA_PARAM_CPU_THREADS": "4",
        }
    )
    front, core = parameters(rendered[FRONT]), parameters(rendered[CORE])
    assert front == {"checkpoint": str(checkpoint), "core_model": CORE, "max_request_tokens": "2048"}
    assert core == {
        "checkpoint": str(checkpoint),
        "adapter_dir": str(adapters),
        "max_gpu_adapters": "256",
        "max_cpu_adapters": "512",
        "max_request_tokens": "2048",
        "preload_adapters": "all",
        "cpu_threads": "4",
    }
    # both load as their models will load them
    front_config, core_config = engine_config(rendered[FRONT]), engine_config(rendered[CORE])
    assert front_config.core_model == CORE and front_config.max_request_tokens == 2048
    assert core_config.core_model == "" and core_config.adapter_dir == adapters
    assert (core_config.max_gpu_adapters, core_config.max_cpu_adapters) == (256, 512)


def test_a_param_wins_over_its_shorthand_and_an_empty_adapter_dir_means_none():
    rendered = render(
        {"MANYLORA_CHECKPOINT": "/a", "MANYLORA_PARAM_CHECKPOINT": "/b", "MANYLORA_ADAPTER_DIR": ""},
    )
    assert parameters(rendered[FRONT])["checkpoint"] == parameters(rendered[CORE])["checkpoint"] == "/b"
    assert "adapter_dir" not in parameters(rendered[CORE])  # base model only


def test_relative_settings_are_made_absolute_for_both_models():
    rendered = render({"MANYLORA_CHECKPOINT": "../../models/other", "MANYLORA_ADAPTER_DIR": "../adapters"})
    wanted = (SOURCE / "gliner2_core" / "../../models/other").resolve()
    for name in (FRONT, CORE):
        assert Path(parameters(rendered[name])["checkpoint"]) == wanted
    assert Path(parameters(rendered[CORE])["adapter_dir"]) == (SOURCE / "adapters").resolve()


def test_gpu_settings_go_to_the_gpu_stage_and_front_instances_to_the_front():
    rendered = render({"MANYLORA_GPUS": "0,2", "MANYLORA_INSTANCES_PER_GPU": "3"})
    assert groups(rendered[CORE]) == [(3, KIND_GPU, [0, 2])]
    assert groups(rendered[FRONT]) == groups(committed(FRONT))
    every = render({"MANYLORA_GPUS": "all"})
    assert groups(every[CORE]) == [(1, KIND_GPU, [])]
    assert groups(every[FRONT]) == groups(committed(FRONT))
    counted = render({"MANYLORA_INSTANCES_PER_GPU": "2"})  # no MANYLORA_GPUS: the committed group's count
    assert [g.count for g in counted[CORE].instance_group] == [2]
    fronts = render({"MANYLORA_FRONT_INSTANCES": "6"})
    assert groups(fronts[FRONT]) == [(6, KIND_CPU, [])]
    assert groups(fronts[CORE]) == groups(committed(CORE))


@pytest.mark.parametrize(
    "env",
    [
        {"MANYLORA_GPUS": "0,x"},
        {"MANYLORA_GPUS": "1,1"},
        {"MANYLORA_GPUS": "-1"},
        {"MANYLORA_INSTANCES_PER_GPU": "0"},
        {"MANYLORA_FRONT_INSTANCES": "0"},
        {"MANYLORA_FRONT_INSTANCES": "two"},
        {"MANYLORA_PARAM_CORE_MODEL": "some_other_model"},
        {"MANYLORA_PARAM_CORE_MODEL": "none", "MANYLORA_FRONT_INSTANCES": "4"},
    ],
)
def test_bad_settings_are_refused(env):
    with pytest.raises(render_config.RenderError):
        render_config.render_models(SOURCE, env)


def test_core_model_none_is_one_model_running_every_stage(model_files):
    checkpoint, adapters = model_files
    rendered = render(
        {
            "MANYLORA_PARAM_CORE_MODEL": "none",
            "MANYLORA_CHECKPOINT": str(checkpoint),
            "MANYLORA_ADAPTER_DIR": str(adapters),
            "MANYLORA_PARAM_MAX_GPU_ADAPTERS": "8",
            "MANYLORA_GPUS": "1",
        }
    )
    assert rendered[CORE] is None  # left out of the copy: nothing would send it work
    single = rendered[FRONT]
    values = parameters(single)
    core_defaults = parameters(committed(CORE))
    assert values["core_model"] == "none" and values["max_gpu_adapters"] == "8"
    assert values["adapter_dir"] == str(adapters) and values["checkpoint"] == str(checkpoint)
    assert set(core_defaults) <= set(values)  # the GPU stage's committed settings came along
    assert values["max_cpu_adapters"] == core_defaults["max_cpu_adapters"]
    assert groups(single) == [(1, KIND_GPU, [1])]
    config = engine_config(single)
    assert config.core_model == "" and config.adapter_dir == adapters
    # without GPU settings: the GPU stage's committed instance group, not the fronts'
    assert groups(render({"MANYLORA_PARAM_CORE_MODEL": "none"})[FRONT]) == groups(committed(CORE))


@pytest.mark.parametrize(
    ("value", "wanted"),
    [("/srv/control", "/srv/control"), ("control", str((SOURCE / CORE / "control").resolve()))],
)
def test_control_dir_reaches_the_control_model_too(value, wanted):
    rendered = render({"MANYLORA_PARAM_CONTROL_DIR": value})
    assert parameters(rendered[CORE])["control_dir"] == wanted
    assert parameters(rendered[CONTROL])["control_dir"] == wanted
    assert "control_dir" not in parameters(rendered[FRONT])
    control = rendered[CONTROL]
    control.parameters["control_dir"].string_value = committed(CONTROL).parameters["control_dir"].string_value
    assert control == committed(CONTROL)
    off = render({"MANYLORA_PARAM_CONTROL_DIR": "none"})
    assert parameters(off[CORE])["control_dir"] == "none" and CONTROL not in off


def test_render_repository_writes_every_model(tmp_path):
    out = tmp_path / "repository"
    render_config.render_repository(SOURCE, out, {"MANYLORA_FRONT_INSTANCES": "3", "MANYLORA_GPUS": "all"})
    for name in (FRONT, CORE, CONTROL):
        assert (out / name / "1" / "model.py").is_file()
    front = text_format.Parse((out / FRONT / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    core = text_format.Parse((out / CORE / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    assert groups(front) == [(3, KIND_CPU, [])] and groups(core) == [(1, KIND_GPU, [])]
    assert (out / CONTROL / "config.pbtxt").read_text() == (SOURCE / CONTROL / "config.pbtxt").read_text()
    assert not list(out.rglob("__pycache__"))

    render_config.render_repository(SOURCE, out, {"MANYLORA_PARAM_CORE_MODEL": "none"})
    assert not (out / CORE).exists() and (out / FRONT / "config.pbtxt").is_file()

    with pytest.raises(render_config.RenderError):
        render_config.render_repository(SOURCE, out, {"MANYLORA_GPUS": "x"})
    assert (out / FRONT / "config.pbtxt").is_file()  # a refused setting leaves the last copy alone


def test_main_prints_every_rendered_config(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MANYLORA_PARAM_MAX_GPU_ADAPTERS", "7")
    assert render_config.main(["--source", str(SOURCE), "--out", str(tmp_path / "r")]) == 0
    printed = capsys.readouterr().out
    assert "# gliner2/config.pbtxt\n" in printed and "# gliner2_core/config.pbtxt\n" in printed
    assert 'name: "gliner2"' in printed and 'name: "gliner2_core"' in printed
    monkeypatch.setenv("MANYLORA_GPUS", "bad")
    assert render_config.main(["--source", str(SOURCE), "--out", str(tmp_path / "r")]) == 2
    assert "MANYLORA_GPUS" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("value", "wanted"),
    [("list,stats", "list,stats"), (" Stats , LIST ", "list,stats"), ("evict,preload,list", "list,preload,evict")],
)
def test_control_commands_restrict_the_control_model(value, wanted):
    from manylora.control import ControlSettings

    rendered = render({"MANYLORA_CONTROL_COMMANDS": value})
    control = rendered[CONTROL]
    assert parameters(control)["allowed_commands"] == wanted
    as_json = json.loads(json_format.MessageToJson(control, preserving_proto_field_name=True))
    settings = ControlSettings.from_model_config(as_json, model_dir=SOURCE / CONTROL)  # as the model loads it
    assert ",".join(settings.allowed_commands) == wanted
    control.parameters["allowed_commands"].string_value = committed(CONTROL).parameters["allowed_commands"].string_value
    assert control == committed(CONTROL), "nothing else of the control model moved"
    assert rendered[FRONT] == render({})[FRONT] and rendered[CORE] == render({})[CORE]
    both = render({"MANYLORA_CONTROL_COMMANDS": value, "MANYLORA_PARAM_CONTROL_DIR": "/srv/control"})
    assert parameters(both[CONTROL])["allowed_commands"] == wanted
    assert parameters(both[CONTROL])["control_dir"] == parameters(both[CORE])["control_dir"] == "/srv/control"
    assert CONTROL not in render({"MANYLORA_CONTROL_COMMANDS": ""}), "empty: the committed config (all)"
    assert parameters(render({"MANYLORA_CONTROL_COMMANDS": "ALL"})[CONTROL])["allowed_commands"] == "all"


def test_control_commands_none_leaves_the_control_model_out(tmp_path, capsys):
    rendered = render({"MANYLORA_CONTROL_COMMANDS": "none", "MANYLORA_PARAM_CONTROL_DIR": "/srv/control"})
    assert rendered[CONTROL] is None and parameters(rendered[CORE])["control_dir"] == "/srv/control"
    out = tmp_path / "repository"
    render_config.render_repository(SOURCE, out, {"MANYLORA_CONTROL_COMMANDS": "none"})
    assert not (out / CONTROL).exists() and (out / CORE / "config.pbtxt").is_file()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MANYLORA_CONTROL_COMMANDS", "none")
        assert render_config.main(["--source", str(SOURCE), "--out", str(tmp_path / "r")]) == 0
    assert "# manylora_control: left out (MANYLORA_CONTROL_COMMANDS=none" in capsys.readouterr().out
    assert not (tmp_path / "r" / CONTROL).exists()


@pytest.mark.parametrize("value", ["drop", "list,drop", "all,list", "none,list", "list,,stats", ","])
def test_bad_control_commands_are_refused_by_name(value):
    with pytest.raises(render_config.RenderError, match="MANYLORA_CONTROL_COMMANDS"):
        render_config.render_models(SOURCE, {"MANYLORA_CONTROL_COMMANDS": value})
