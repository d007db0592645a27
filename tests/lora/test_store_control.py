"""Adapter control without a server: the control folder protocol between the control model
(Controller) and the serving instances (InstanceControl), each with its own AdapterStore."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from google.protobuf import json_format, text_format
from safetensors.torch import save_file
from tritonclient.grpc import model_config_pb2

from manylora.config import ConfigError, EngineConfig
from manylora.control import (
    ControlError,
    Controller,
    ControlSettings,
    InstanceControl,
    attach_control,
    check_control_config,
    default_control_dir,
    parse_adapter_ids,
)
from manylora.lora.store import AdapterStore

SHAPES = {"lin": (6, 5)}
CONTROL_MODEL = Path(__file__).resolve().parents[2] / "model_repository" / "manylora_control"


def _adapter(root, name, value=1.0):
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 2}))
    save_file(
        {
            "base_model.model.lin.lora_A.weight": torch.full((2, 6), value),
            "base_model.model.lin.lora_B.weight": torch.full((5, 2), value),
        },
        str(folder / "adapter_model.safetensors"),
    )


@pytest.fixture
def fleet(tmp_path):
    root = tmp_path / "adapters"
    for i in range(4):
        _adapter(root, f"a{i}", float(i + 1))
    bad = root / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text("{}")
    (bad / "adapter_model.safetensors").write_bytes(b"garbage")

    def store():
        return AdapterStore(
            root, SHAPES, max_rank=4, gpu_slots=1, host_slots=2, device=torch.device("cpu"), dtype=torch.float32
        )

    return root, store


@pytest.fixture
def two_instances(fleet, tmp_path):
    _, make_store = fleet
    control_dir = tmp_path / "control"
    instances = [
        InstanceControl(
            make_store(), control_dir, model="gliner2", instance=f"gliner2_{i}", device="cpu", poll_seconds=0.01
        )
        for i in range(2)
    ]
    yield control_dir, instances
    for instance in instances:
        instance.close()
        instance.store.close()


def test_list_preload_evict_stats_reach_every_instance(two_instances, fleet):
    root, _ = fleet
    control_dir, instances = two_instances
    controller = Controller(control_dir, timeout_s=10)

    listed = controller.run("list")
    assert listed["adapters"] == ["a0", "a1", "a2", "a3", "bad"] and listed["adapter_dirs"] == [str(root)]
    assert [i["instance"] for i in listed["instances"]] == ["gliner2_0", "gliner2_1"] and listed["pending"] == []
    assert all(i["result"] == {"gpu": [], "host": [], "loading": []} for i in listed["instances"])

    preloaded = controller.run("preload", ["a1", "bad", "nope", "a2", "a3"])
    for answer in preloaded["instances"]:
        result = answer["result"]
        assert result["loaded"] == ["a1", "a2"] and result["skipped"] == ["a3"] and result["gpu"] == ["a1"]
        assert set(result["refused"]) == {"bad", "nope"} and "unknown adapter" in result["refused"]["nope"]
    assert all(i.store.resident() == {"gpu": ["a1"], "host": ["a1", "a2"]} for i in instances)

    evicted = controller.run("evict", ["a1", "a0"])
    assert all(i["result"] == {"evicted": ["a1"], "not_resident": ["a0"]} for i in evicted["instances"])
    assert all(i.store.resident() == {"gpu": [], "host": ["a2"]} for i in instances)

    stats = controller.run("stats")
    for answer in stats["instances"]:
        assert answer["result"]["resident"] == {"gpu": 0, "host": 1}
        assert answer["result"]["loads"]["disk"] == 2 and answer["result"]["slots"] == {"gpu": 1, "host": 2}
    assert list(control_dir.joinpath("commands").iterdir()) == [], "answered commands are removed"


def test_bad_requests_and_no_instances(tmp_path):
    controller = Controller(tmp_path / "control", timeout_s=1)
    with pytest.raises(ControlError, match="unknown COMMAND") as info:
        controller.run("drop")
    assert info.value.code == "INVALID_ARG"
    with pytest.raises(ControlError, match="preload needs ADAPTER_IDS"):
        controller.run("preload")
    with pytest.raises(ControlError, match="stats takes no ADAPTER_IDS"):
        controller.run("stats", ["a0"])
    with pytest.raises(ControlError, match="no model instance answers") as info:
        controller.run("stats")
    assert info.value.code == "UNAVAILABLE"
    assert parse_adapter_ids(" a, b,,a ,") == ["a", "b"] and parse_adapter_ids(None) == []
    with pytest.raises(ControlError, match="above the limit"):
        parse_adapter_ids(",".join(f"x{i}" for i in range(5000)))


def test_silent_and_exited_instances(fleet, tmp_path):
    _, make_store = fleet
    control_dir = tmp_path / "control"
    silent = InstanceControl(make_store(), control_dir, model="gliner2", instance="silent", device="cpu", start=False)
    exited = control_dir / "instances" / "gliner2.gone.999999999.json"
    exited.write_text(json.dumps({"model": "gliner2", "instance": "gone", "pid": 999_999_999, "answers": {}}))
    answer = Controller(control_dir, timeout_s=0.3).run("stats")
    assert answer["instances"] == [] and [p["instance"] for p in answer["pending"]] == ["silent"]
    assert not exited.exists(), "the status file of an exited instance is removed"
    assert silent.poll() == 1, "the command waits in the folder for the late instance"
    silent.close()
    assert not silent.status_path.exists()


def test_commands_older_than_an_instance_are_not_applied(fleet, tmp_path):
    _, make_store = fleet
    control_dir = tmp_path / "control"
    first = InstanceControl(make_store(), control_dir, model="gliner2", instance="first", device="cpu", start=False)
    (control_dir / "commands" / "00000000000000000001-1-0.json").write_text(
        json.dumps({"id": "old", "command": "preload", "adapter_ids": ["a0"]})
    )
    late = InstanceControl(make_store(), control_dir, model="gliner2", instance="late", device="cpu", start=False)
    assert late.poll() == 0 and late.store.resident()["host"] == []
    assert first.poll() == 1 and first.store.resident()["host"] == ["a0"]
    assert first.apply({"command": "reboot"}) == {"error": "unknown command 'reboot'"}
    for instance in (first, late):
        instance.close()


class _Engine:  # what attach_control reads of an Engine
    def __init__(self, store, control_dir):
        self.config, self.store, self.device = SimpleNamespace(control_dir=control_dir), store, "cpu"


def test_attach_control_follows_the_engine_config(fleet, tmp_path):
    _, make_store = fleet
    engine = _Engine(make_store(), str(tmp_path / "control"))
    args = {"model_name": "gliner2", "model_instance_name": "gliner2_0_0"}
    control = attach_control(engine, args)
    assert attach_control(engine, args) is control, "idempotent per engine"
    assert control.status_path.parent == tmp_path / "control" / "instances"
    assert control.status_path.name == f"gliner2.gliner2_0_0.{os.getpid()}.json"
    control.close()
    assert attach_control(_Engine(make_store(), "none"), args) is None
    assert default_control_dir().name == f"server-{os.getppid()}"


def _control_config() -> dict:
    message = text_format.Parse((CONTROL_MODEL / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def test_committed_control_model_config_matches_the_protocol():
    config = _control_config()
    check_control_config(config)
    assert config["name"] == "manylora_control" and config["backend"] == "python"
    settings = ControlSettings.from_model_config(config, model_dir=CONTROL_MODEL)
    assert settings.control_dir == default_control_dir() and settings.timeout_s == 30.0
    config["input"][0]["data_type"] = "TYPE_FP32"
    with pytest.raises(ValueError, match="do not match"):
        check_control_config(config)


@pytest.mark.parametrize(
    "parameters,message",
    [
        ({"control_dirr": "auto"}, "unknown parameter"),
        ({"timeout_s": "soon"}, "'timeout_s'"),
        ({"timeout_s": "0"}, "'timeout_s'"),
        ({"control_dir": "none"}, "'control_dir'"),
        ({"control_dir": "${DIR}"}, "unfilled template"),
    ],
)
def test_control_parameters_are_parsed_strictly(parameters, message):
    config = {"parameters": {k: {"string_value": v} for k, v in parameters.items()}}
    with pytest.raises(ValueError, match=message):
        ControlSettings.from_model_config(config)


def test_engine_config_control_dir(tiny_checkpoint, tmp_path):
    def parse(value):
        return EngineConfig.from_parameters(
            {"checkpoint": str(tiny_checkpoint), "control_dir": value}, model_dir=tmp_path
        ).control_dir

    assert EngineConfig.from_parameters({"checkpoint": str(tiny_checkpoint)}).control_dir == "auto"
    assert parse("none") == "none" and parse(" auto ") == "auto"
    assert parse("ctl") == str(tmp_path / "ctl")
    with pytest.raises(ConfigError, match="'control_dir'"):
        parse("  ")
