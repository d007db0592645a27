"""Adapter control without a server: the control folder protocol between the control model
(Controller) and the serving instances (InstanceControl), each with its own AdapterStore."""

from __future__ import annotations

import json
import logging
import os
import stat
import tempfile
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from google.protobuf import json_format, text_format
from safetensors.torch import save_file
from tritonclient.grpc import model_config_pb2

from manylora import control as control_module
from manylora.config import ConfigError, EngineConfig
from manylora.control import (
    COMMANDS,
    MAX_COMMAND_BYTES,
    ControlError,
    Controller,
    ControlModelHandler,
    ControlSettings,
    InstanceControl,
    UnsafeControlDir,
    attach_control,
    auto_control_dir,
    check_control_config,
    control_base,
    default_control_dir,
    parse_adapter_ids,
    remove_stale_server_folders,
)
from manylora.lora.store import AdapterStore

SHAPES = {"lin": (6, 5)}
CONTROL_MODEL = Path(__file__).resolve().parents[2] / "model_repository" / "manylora_control"


def _adapter(root, name, value=1.0, modules=("lin",), **config):
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 2, **config}))
    tensors = {}
    for module in modules:
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.full((2, 6), value)
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.full((5, 2), value)
    save_file(tensors, str(folder / "adapter_model.safetensors"))


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
    assert all(i["result"] == {"gpu": [], "host": [], "ignored": {}, "loading": []} for i in listed["instances"])

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


def _control_config() -> dict:
    message = text_format.Parse((CONTROL_MODEL / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def test_committed_control_model_config_matches_the_protocol():
    config = _control_config()
    check_control_config(config)
    assert config["name"] == "manylora_control" and config["backend"] == "python"
    settings = ControlSettings.from_model_config(config, model_dir=CONTROL_MODEL)
    assert settings.control_dir is None and settings.timeout_s == 30.0, "auto: resolved by the model at load"
    assert settings.allowed_commands == COMMANDS, "committed: every command"
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
        ({"allowed_commands": "list,drop"}, "'allowed_commands'"),
        ({"allowed_commands": " , "}, "do not load manylora_control"),
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


# ---------------------------------------------------------------------- a private control folder


def _owned_by_someone_else(path: Path, monkeypatch) -> None:
    """Make ``path`` another user's: chown as root, else pretend this process has another uid."""
    if os.getuid() == 0:
        os.chown(path, 65534, 65534)
    else:
        uid = os.getuid()
        monkeypatch.setattr(os, "getuid", lambda: uid + 1)


@pytest.mark.parametrize("kind", ["someone-else", "mode-0777", "symlink", "not-a-folder", "open-parent"])
def test_a_control_folder_that_is_not_private_is_refused(kind, fleet, tmp_path, monkeypatch, caplog):
    _, make_store = fleet
    folder = tmp_path / "control"
    if kind == "someone-else":
        folder.mkdir(mode=0o700)
        _owned_by_someone_else(folder, monkeypatch)
        message = "belongs to uid"
    elif kind == "mode-0777":
        folder.mkdir()
        folder.chmod(0o777)
        message = "other users can write in it"
    elif kind == "symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        folder.symlink_to(tmp_path / "elsewhere")
        message = "is a symbolic link"
    elif kind == "not-a-folder":
        folder.write_text("")
        message = "is not a folder"
    else:  # any user can rename the folder away and put theirs in its place
        (tmp_path / "open").mkdir()
        (tmp_path / "open").chmod(0o777)
        folder = tmp_path / "open" / "control"
        message = "where other users can rename it"
    with pytest.raises(UnsafeControlDir, match=message) as info:
        InstanceControl(make_store(), folder, model="gliner2", instance="i", device="cpu", start=False)
    assert info.value.code == "UNAVAILABLE"
    with pytest.raises(UnsafeControlDir, match=message):
        Controller(folder, timeout_s=1)
    if kind in ("symlink", "someone-else"):
        assert not (tmp_path / "elsewhere" / "commands").exists(), "nothing written through the link"
    # the serving instance keeps serving without control; the refusal is logged
    with caplog.at_level(logging.ERROR, logger="manylora.control"):
        assert attach_control(_Engine(make_store(), str(folder)), {"model_instance_name": "g_0"}) is None
    assert "adapter control is off for g_0" in caplog.text and message in caplog.text


def test_a_control_folder_of_ours_readable_by_others_is_made_private(fleet, tmp_path):
    _, make_store = fleet
    folder = tmp_path / "control"
    folder.mkdir()
    folder.chmod(0o755)  # as older versions left <temp>/manylora-control-<uid>
    control = InstanceControl(make_store(), folder, model="gliner2", instance="i", device="cpu", start=False)
    for path in (folder, folder / "commands", folder / "instances"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    assert stat.S_IMODE(control.status_path.stat().st_mode) == 0o600
    control.close()


def test_auto_folders_are_private_unpredictable_and_found_by_every_instance(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    base = control_base()
    assert base == tmp_path / f"manylora-control-{os.getuid()}"
    assert auto_control_dir(create=False) is None, "nothing created when asked not to"
    found, errors = [], []

    def find():
        try:
            found.append(default_control_dir())
        except Exception as exc:  # pragma: no cover - the assertion below shows it
            errors.append(exc)

    threads = [threading.Thread(target=find) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(set(found)) == 1, "every instance of one server meets in one folder"
    folder = found[0]
    assert folder.parent == base and stat.S_IMODE(base.stat().st_mode) == stat.S_IMODE(folder.stat().st_mode) == 0o700
    prefix = f"server-{os.getppid()}-{control_module._process_start(os.getppid())}-"
    assert folder.name.startswith(prefix) and len(folder.name) > len(prefix) + 6, "a random part nobody can guess"
    assert auto_control_dir(create=False) == folder
    other = auto_control_dir(os.getpid())
    assert other != folder and other.name.startswith(f"server-{os.getpid()}-"), "another server, another folder"
    # the folders of servers that are gone are removed; the live ones stay
    gone = base / "server-999999999-1-abcdefgh"
    gone.mkdir(mode=0o700)
    (base / "server-999999999").mkdir(mode=0o700)  # the layout of older versions
    (base / ".server-999999999-1.lock").write_text("")
    remove_stale_server_folders()
    assert sorted(p.name for p in base.iterdir() if not p.name.startswith(".")) == sorted([folder.name, other.name])
    assert not (base / ".server-999999999-1.lock").exists()


@pytest.mark.parametrize("kind", ["someone-else", "mode-0777", "symlink"])
def test_a_hostile_auto_parent_is_refused(kind, tmp_path, monkeypatch):
    """Another local user who creates <temp>/manylora-control-<uid> first gets nothing from it."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    base = control_base()
    if kind == "symlink":
        (tmp_path / "theirs").mkdir(mode=0o700)
        base.symlink_to(tmp_path / "theirs")
    else:
        base.mkdir(mode=0o700)
        if kind == "mode-0777":
            base.chmod(0o777)
        else:
            _owned_by_someone_else(base, monkeypatch)
    with pytest.raises(UnsafeControlDir, match=f"{base.name}.*refused"):
        default_control_dir()
    assert not any((tmp_path / "theirs").iterdir()) if kind == "symlink" else True


class _FakePb:
    """What ControlModelHandler uses of triton_python_backend_utils."""

    class TritonError:
        INVALID_ARG, UNAVAILABLE, UNSUPPORTED, INTERNAL = "INVALID_ARG", "UNAVAILABLE", "UNSUPPORTED", "INTERNAL"

        def __init__(self, message, code):
            self.message, self.code = message, code

    class InferenceResponse:
        def __init__(self, output_tensors, error=None):
            self.output_tensors, self.error = output_tensors, error

    class Tensor:
        def __init__(self, name, array):
            self.name, self.array = name, array

        def as_numpy(self):
            return self.array

    @staticmethod
    def get_input_tensor_by_name(request, name):
        import numpy as np

        return None if name not in request else _FakePb.Tensor(name, np.array([request[name]], dtype=np.object_))


def _handler(tmp_path, **parameters) -> ControlModelHandler:
    config = _control_config()
    config["parameters"] = {k: {"string_value": v} for k, v in parameters.items()}
    args = {"model_config": json.dumps(config), "model_repository": str(tmp_path)}
    return ControlModelHandler(args, _FakePb)


def test_the_control_model_answers_unavailable_when_its_folder_is_refused(tmp_path, caplog):
    folder = tmp_path / "control"
    folder.mkdir()
    folder.chmod(0o777)
    with caplog.at_level(logging.ERROR, logger="manylora.control"):
        handler = _handler(tmp_path, control_dir=str(folder))  # loads: the server keeps serving
    assert "adapter control is off" in caplog.text
    (response,) = handler.execute([{"COMMAND": b"list"}])
    assert response.error.code == "UNAVAILABLE"
    assert "adapter control is off on this server" in response.error.message and "mode 0777" in response.error.message
    assert not (folder / "commands").exists()


def test_allowed_commands_restricts_the_control_model(two_instances, tmp_path):
    control_dir, instances = two_instances
    handler = _handler(tmp_path, control_dir=str(control_dir), allowed_commands="stats, list")
    assert handler.settings.allowed_commands == ("list", "stats")
    listed, evict, preload, unknown = handler.execute(
        [{"COMMAND": b"list"}, {"COMMAND": b"evict", "ADAPTER_IDS": b"a1"}, {"COMMAND": b"PRELOAD"}, {"COMMAND": b"x"}]
    )
    assert listed.error is None and json.loads(listed.output_tensors[0].array[0])["pending"] == []
    assert evict.error.code == preload.error.code == "UNSUPPORTED"
    assert evict.error.message == (
        "COMMAND 'evict' is turned off on this server (manylora_control allowed_commands: list, stats)"
    )
    assert unknown.error.code == "INVALID_ARG", "an unknown command is still a bad request"
    assert all(i.store.resident()["host"] == [] for i in instances)
    with pytest.raises(ControlError, match="turned off") as info:
        Controller(control_dir, timeout_s=1, allowed=("list",)).run("stats")
    assert info.value.code == "UNSUPPORTED"
    assert ControlSettings.from_model_config({"parameters": {"allowed_commands": {"string_value": "all"}}}) == (
        ControlSettings()
    )


# ---------------------------------------------------------------------- bounded command and status files


def test_command_files_are_bounded_and_never_block(fleet, tmp_path):
    _, make_store = fleet
    folder = tmp_path / "control"
    instance = InstanceControl(make_store(), folder, model="gliner2", instance="i", device="cpu", start=False)
    commands = folder / "commands"
    big = commands / "00000000000000000002-1-0.json"
    big.write_text(json.dumps({"command": "stats", "pad": "x" * MAX_COMMAND_BYTES}))
    os.mkfifo(commands / "00000000000000000003-1-0.json")  # nobody writes: an open that blocked would hang
    (commands / "00000000000000000004-1-0.json").symlink_to(big)
    (commands / "00000000000000000005-1-0.json").write_text("[" * 30_000 + "]" * 30_000)
    (commands / "00000000000000000006-1-0.json").write_text(json.dumps(["list"]))
    (commands / "00000000000000000007-1-0.json").write_text(json.dumps({"command": "evict", "adapter_ids": "a0"}))
    (commands / "00000000000000000008-1-0.json").write_text(
        json.dumps({"command": "evict", "adapter_ids": [f"a{i}" for i in range(300)]})
    )
    assert instance.poll() == 7
    answers = json.loads(instance.status_path.read_text())["answers"]
    errors = [answers[f"0000000000000000000{n}-1-0"]["error"] for n in range(2, 9)]
    assert f"above the limit of {MAX_COMMAND_BYTES}: not read" in errors[0]
    assert "is not a regular file" in errors[1] and "is a symbolic link" in errors[2]
    assert "is not readable JSON" in errors[3] and "must be a JSON object, got list" in errors[4]
    assert "adapter_ids must be a list of strings" in errors[5] and "300 adapter ids, above the limit" in errors[6]
    instance.close()


def test_answers_and_status_files_are_bounded(two_instances, monkeypatch):
    control_dir, instances = two_instances
    controller = Controller(control_dir, timeout_s=10)
    with pytest.raises(ControlError, match="above the limit of 65536 bytes") as info:
        controller.run("evict", ["x" * 255 + str(i) for i in range(256)])
    assert info.value.code == "INVALID_ARG"
    with pytest.raises(ControlError, match="ADAPTER_IDS has 60000 characters"):
        parse_adapter_ids("a" * 60_000)
    # an answer too large for the status file is replaced by an error; the file stays small
    monkeypatch.setattr(instances[0].store, "stats", lambda: {"pad": "x" * (2 << 20)})
    answer = controller.run("stats")
    first, second = answer["instances"]
    assert "above the limit" in first["error"] and "pad" not in first and second["result"]["resident"]
    assert all(i.status_path.stat().st_size < control_module.MAX_STATUS_BYTES for i in instances)
    # a status file above its limit is not read: that instance is not counted live, the others answer
    instances[1].status_path.write_text(json.dumps({"pid": os.getpid(), "pad": "x" * (2 << 20)}))
    assert [p.name for p in controller.live_instances()] == [instances[0].status_path.name]


def test_list_shows_the_tensors_peft_would_ignore(tmp_path):
    root = tmp_path / "adapters"
    _adapter(root, "partial", modules=("lin", "lin2"), target_modules=["lin"])
    _adapter(root, "whole", modules=("lin", "lin2"))
    shapes = {"lin": (6, 5), "lin2": (6, 5)}
    store = AdapterStore(
        root, shapes, max_rank=4, gpu_slots=1, host_slots=2, device=torch.device("cpu"), dtype=torch.float32
    )
    instance = InstanceControl(
        store, tmp_path / "control", model="gliner2", instance="i", device="cpu", poll_seconds=0.01
    )
    try:
        controller = Controller(tmp_path / "control", timeout_s=10)
        controller.run("preload", ["partial", "whole"])
        (listed,) = controller.run("list")["instances"]
        assert listed["result"]["ignored"] == {"partial": ["lin2"]}
        assert sorted(listed["result"]["host"]) == ["partial", "whole"]
    finally:
        instance.close()
        store.close()
