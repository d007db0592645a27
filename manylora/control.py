"""Adapter control: list, preload, evict and stats for the adapter caches of every model instance.

Triton runs each model instance in its own Python backend process, and each one keeps its
own ``AdapterStore``. The control model (``model_repository/manylora_control``) is one more
process: it cannot call into the others. They meet in a control folder instead:

    <control_dir>/instances/<model>.<instance>.<pid>.json   one status file per serving instance:
                                                           who it is, its adapter folder, and its
                                                           answers to the latest commands
    <control_dir>/commands/<id>.json                        one file per command

Each serving instance runs a watcher thread (``InstanceControl``, started by ``attach_control``
once its engine is built). The thread polls the commands folder every 0.1 s, applies each new
command to its own store and writes the answer into its status file. The control model
writes a command, waits until every live instance has answered (or ``timeout_s`` passed) and
returns all answers as one JSON document. Commands act between and during batches: the
store's lock and the pinning of the batch in flight make that safe, and loads from disk run on
the store's loader threads, never on the request path. Commands already in the folder when an
instance starts are not applied by it; commands are events, not a desired state.

``control_dir = auto`` is ``<temp>/manylora-control-<uid>/server-<pid of tritonserver>``: every model
instance is a child process of the tritonserver that started it, so all models of one server
meet there without configuration, and two servers on one host never mix. An explicit folder
must be the same in both models' configs and local to the host (instances are known to be
alive by their process ids).

Files are written aside and renamed into place, so a reader never sees half of one. Nothing
here imports torch: the control model's process stays small.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import tempfile
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

logger = logging.getLogger(__name__)

COMMANDS = ("list", "preload", "evict", "stats")
NEEDS_IDS = ("preload", "evict")
COMMAND, ADAPTER_IDS, RESULT = "COMMAND", "ADAPTER_IDS", "RESULT"
# the control model's tensors: name -> (config.pbtxt data_type, dims, optional); checked at load
INPUTS = {COMMAND: ("TYPE_STRING", (1,), False), ADAPTER_IDS: ("TYPE_STRING", (1,), True)}
OUTPUTS = {RESULT: ("TYPE_STRING", (1,), False)}
POLL_SECONDS = 0.1
ANSWERS_KEPT = 16  # answers per status file; the control model reads its own within timeout_s
COMMAND_TTL_SECONDS = 600  # unanswered command files are removed after this
MAX_ADAPTER_IDS = 4096
_PLACEHOLDER = re.compile(r"\$\{[^}]*\}")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


class ControlError(Exception):
    """A control request that cannot be answered; ``code`` is the Triton error code."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def default_control_dir() -> Path:
    """``<temp>/manylora-control-<uid>/server-<parent pid>``: in a Triton model instance the
    parent process is the tritonserver, shared by every model it serves."""
    return Path(tempfile.gettempdir()) / f"manylora-control-{os.getuid()}" / f"server-{os.getppid()}"


def remove_stale_server_folders() -> None:
    """Remove the auto control folders of tritonservers that are gone."""
    import shutil

    for folder in default_control_dir().parent.glob("server-*"):
        pid = folder.name.removeprefix("server-")
        if pid.isdigit() and not _alive({"pid": int(pid)}):
            shutil.rmtree(folder, ignore_errors=True)


def _prepare(control_dir: Path) -> tuple[Path, Path]:
    """The commands and instances folders (created; the control folder itself private)."""
    control_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    commands, instances = control_dir / "commands", control_dir / "instances"
    commands.mkdir(exist_ok=True)
    instances.mkdir(exist_ok=True)
    return commands, instances


def resolve_control_dir(value: str) -> Optional[Path]:
    """The folder a ``control_dir`` parameter names: 'auto', 'none' (None) or a path."""
    if value == "none":
        return None
    if value == "auto":
        return default_control_dir()
    return Path(value)


def _process_start(pid: int) -> Optional[str]:
    """Start time of a process (clock ticks since boot), to tell a live instance from a reused pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(identity: Mapping[str, Any]) -> bool:
    pid = identity.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    started = identity.get("process_start")
    return started is None or _process_start(pid) in (None, started)


def _write_json(path: Path, value: Any) -> None:
    staging = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    staging.write_text(json.dumps(value))
    os.replace(staging, path)


def _read_json(path: Path) -> Optional[Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _json_files(folder: Path) -> list[Path]:
    try:
        return sorted(p for p in folder.iterdir() if p.suffix == ".json" and not p.name.startswith("."))
    except OSError:
        return []


# ---------------------------------------------------------------------- serving instances


class InstanceControl:
    """Applies the control model's commands to one model instance's adapter store."""

    def __init__(
        self,
        store,
        control_dir: Path,
        *,
        model: str,
        instance: str,
        device: str,
        poll_seconds: float = POLL_SECONDS,
        start: bool = True,
    ):
        self.store = store
        self.commands, instances = _prepare(Path(control_dir))
        pid = os.getpid()
        self.identity = {
            "model": model,
            "instance": instance,
            "pid": pid,
            "process_start": _process_start(pid),
            "device": device,
            "adapter_dir": None if store.root is None else str(store.root),
        }
        self.status_path = instances / f"{_UNSAFE.sub('_', model)}.{_UNSAFE.sub('_', instance)}.{pid}.json"
        self.poll_seconds = poll_seconds
        self._answers: OrderedDict[str, dict] = OrderedDict()
        self._seen = {p.stem for p in _json_files(self.commands)}  # earlier commands are not for this instance
        self._poll_lock = threading.Lock()
        self._stop = threading.Event()
        self._write_status()
        self._thread = None
        if start:
            self._thread = threading.Thread(target=self._run, name=f"manylora-control-{instance}", daemon=True)
            self._thread.start()
        self._finalizer = weakref.finalize(self, _remove, self.status_path)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            try:
                self.poll()
            except Exception:  # the watcher must outlive any one bad command or full disk
                logger.exception("adapter control: polling %s failed", self.commands)

    def poll(self) -> int:
        """Apply every command not applied yet; returns how many were applied."""
        with self._poll_lock:
            files = _json_files(self.commands)
            self._seen &= {p.stem for p in files}
            applied = 0
            for path in files:
                if path.stem in self._seen:
                    continue
                self._seen.add(path.stem)
                command = _read_json(path)
                if command is None:
                    if not path.exists():
                        continue  # removed meanwhile
                    answer = {"error": f"command file {path.name} is not readable JSON"}
                else:
                    answer = self.apply(command)
                self._answers[path.stem] = answer
                while len(self._answers) > ANSWERS_KEPT:
                    self._answers.popitem(last=False)
                applied += 1
            if applied:
                self._write_status()
            return applied

    def apply(self, command: Mapping[str, Any]) -> dict:
        """One command on this instance's store: {"result": ...} or {"error": message}."""
        name, ids = command.get("command"), list(command.get("adapter_ids") or [])
        store = self.store
        try:
            if name == "list":
                result = {**store.resident(), "loading": store.loading()}
            elif name == "stats":
                result = store.stats()
            elif name == "preload":
                result = store.preload_report(ids)
            elif name == "evict":
                evicted = store.evict(ids)
                result = {"evicted": evicted, "not_resident": [i for i in dict.fromkeys(ids) if i not in evicted]}
            else:
                return {"error": f"unknown command {name!r}"}
        except Exception as exc:
            logger.exception("adapter control: %s failed", name)
            return {"error": f"{type(exc).__name__}: {exc}"}
        return {"result": result}

    def _write_status(self) -> None:
        _write_json(self.status_path, {**self.identity, "answers": dict(self._answers)})

    def close(self) -> None:
        """Stop the watcher and withdraw this instance from the control folder."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(10)
        self._finalizer()


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


_attached: "weakref.WeakKeyDictionary[Any, InstanceControl]" = weakref.WeakKeyDictionary()
_attach_lock = threading.Lock()


def attach_control(engine, args: Mapping[str, Any]) -> Optional[InstanceControl]:
    """Answer the control model's commands for this model instance (a watcher thread).

    The one call the serving layer makes, once ``engine`` is built; ``args`` are Triton's
    initialize() arguments. Idempotent per engine; None when the model's ``control_dir`` is 'none'.
    """
    with _attach_lock:
        if engine in _attached:
            return _attached[engine]
        folder = resolve_control_dir(getattr(engine.config, "control_dir", "auto"))
        if folder is None:
            return None
        control = InstanceControl(
            engine.store,
            folder,
            model=str(args.get("model_name") or "gliner2"),
            instance=str(args.get("model_instance_name") or f"pid{os.getpid()}"),
            device=str(engine.device),
        )
        _attached[engine] = control
        logger.info("adapter control: %s answers commands in %s", control.identity["instance"], folder)
        return control


# ---------------------------------------------------------------------- the control model


def parse_adapter_ids(raw: Optional[str]) -> list[str]:
    """Comma-separated adapter ids, blanks dropped, order kept, duplicates removed."""
    if raw is None:
        return []
    ids = list(dict.fromkeys(part.strip() for part in raw.split(",") if part.strip()))
    if len(ids) > MAX_ADAPTER_IDS:
        raise ControlError("INVALID_ARG", f"{len(ids)} adapter ids, above the limit of {MAX_ADAPTER_IDS}")
    return ids


class Controller:
    """The control model's side: send a command to every live instance and gather the answers."""

    _counter = itertools.count()

    def __init__(self, control_dir: Path, timeout_s: float):
        self.commands, self.instances = _prepare(Path(control_dir))
        self.timeout_s = timeout_s

    def live_instances(self) -> dict[Path, dict]:
        """Status file -> identity of every live instance; files of exited ones are removed."""
        live = {}
        for path in _json_files(self.instances):
            status = _read_json(path)
            if not isinstance(status, dict):
                continue
            if _alive(status):
                live[path] = {k: v for k, v in status.items() if k != "answers"}
            else:
                _remove(path)
        return live

    def run(self, command: str, adapter_ids: Iterable[str] = ()) -> dict:
        """The JSON answer to one command; raises ControlError."""
        ids = list(adapter_ids)
        if command not in COMMANDS:
            raise ControlError("INVALID_ARG", f"unknown COMMAND {command!r}; expected one of {', '.join(COMMANDS)}")
        if command in NEEDS_IDS and not ids:
            raise ControlError("INVALID_ARG", f"{command} needs ADAPTER_IDS (comma-separated adapter ids)")
        if command not in NEEDS_IDS and ids:
            raise ControlError("INVALID_ARG", f"{command} takes no ADAPTER_IDS")
        instances = self.live_instances()
        if not instances:
            raise ControlError(
                "UNAVAILABLE",
                f"no model instance answers adapter control in {self.commands.parent}: is the gliner2 model "
                "loaded, and does it use the same control_dir?",
            )
        command_id = f"{time.time_ns():020d}-{os.getpid()}-{next(self._counter)}"
        command_path = self.commands / f"{command_id}.json"
        _write_json(command_path, {"id": command_id, "command": command, "adapter_ids": ids})
        answers: dict[Path, dict] = {}
        deadline = time.monotonic() + self.timeout_s
        while True:
            for path in instances:
                if path in answers:
                    continue
                status = _read_json(path)
                if isinstance(status, dict) and command_id in status.get("answers", {}):
                    answers[path] = status["answers"][command_id]
                elif (status is None and not path.exists()) or not _alive(instances[path]):
                    answers[path] = {"error": "the instance exited before it answered"}
            if len(answers) == len(instances) or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        if len(answers) == len(instances):
            _remove(command_path)
        self._collect_garbage()
        return self._result(command, ids, instances, answers)

    def _result(self, command, ids, instances, answers) -> dict:
        result: dict[str, Any] = {"command": command}
        if ids:
            result["adapter_ids"] = ids
        if command == "list":
            folders = sorted({i["adapter_dir"] for i in instances.values() if i.get("adapter_dir")})
            result["adapter_dirs"] = folders
            result["adapters"] = sorted({name for folder in folders for name in _servable(Path(folder))})
        shown = ("model", "instance", "pid", "device")
        result["instances"] = [
            {**{k: instances[p].get(k) for k in shown}, **answers[p]}
            for p in sorted(instances, key=lambda p: (instances[p].get("model"), instances[p].get("instance")))
            if p in answers
        ]
        result["pending"] = [{k: instances[p].get(k) for k in shown} for p in instances if p not in answers]
        return result

    def _collect_garbage(self) -> None:
        oldest = time.time_ns() - COMMAND_TTL_SECONDS * 10**9
        for path in _json_files(self.commands):
            try:
                written = int(path.stem.split("-", 1)[0])
            except ValueError:
                written = 0
            if written < oldest:
                _remove(path)


def _servable(folder: Path) -> list[str]:
    try:
        return [
            p.name
            for p in folder.iterdir()
            if not p.name.startswith(".") and (p / "adapter_model.safetensors").is_file()
        ]
    except OSError:
        return []


@dataclass(frozen=True)
class ControlSettings:
    """The control model's config.pbtxt parameters, parsed strictly."""

    control_dir: Path
    timeout_s: float = 30.0

    @classmethod
    def from_model_config(cls, model_config: Mapping, *, model_dir: Optional[Path] = None) -> "ControlSettings":
        raw = {}
        for key, value in (model_config.get("parameters") or {}).items():
            if not isinstance(value, Mapping) or not isinstance(value.get("string_value"), str):
                raise ValueError(f"parameter {key!r}: expected {{string_value: ...}}, got {value!r}")
            if _PLACEHOLDER.search(value["string_value"]):
                raise ValueError(f"parameter {key!r} holds an unfilled template {value['string_value']!r}")
            raw[key] = value["string_value"].strip()
        unknown = sorted(set(raw) - {"control_dir", "timeout_s"})
        if unknown:
            raise ValueError(f"unknown parameter(s) {', '.join(map(repr, unknown))}; known: control_dir, timeout_s")
        folder = raw.get("control_dir", "auto")
        if folder in ("", "none"):
            raise ValueError(f"parameter 'control_dir': expected 'auto' or a folder, got {folder!r}")
        path = resolve_control_dir(folder)
        if not path.is_absolute() and model_dir is not None:
            path = (Path(model_dir) / path).resolve()
        try:
            timeout = float(raw.get("timeout_s", "30"))
        except ValueError:
            raise ValueError(f"parameter 'timeout_s': expected seconds, got {raw['timeout_s']!r}") from None
        if not 0 < timeout <= 3600:
            raise ValueError(f"parameter 'timeout_s': expected seconds in (0, 3600], got {raw['timeout_s']!r}")
        return cls(path, timeout)


def check_control_config(model_config: Mapping) -> None:
    """The parsed config.pbtxt must declare exactly INPUTS and OUTPUTS."""
    declared = {
        t["name"]: (t["data_type"], tuple(int(d) for d in t["dims"]), bool(t.get("optional", False)))
        for t in list(model_config.get("input", [])) + list(model_config.get("output", []))
    }
    expected = {**INPUTS, **OUTPUTS}
    if declared != expected:
        raise ValueError(f"config.pbtxt tensors {declared} do not match the control protocol {expected}")


class ControlModelHandler:
    """What the control model's model.py delegates to."""

    def __init__(self, args: Mapping, pb_utils):
        self.pb_utils = pb_utils
        model_config = json.loads(args["model_config"])
        check_control_config(model_config)
        settings = ControlSettings.from_model_config(model_config, model_dir=Path(args["model_repository"]))
        if settings.control_dir == default_control_dir():
            remove_stale_server_folders()
        self.controller = Controller(settings.control_dir, settings.timeout_s)
        logger.info("adapter control in %s", settings.control_dir)

    def execute(self, requests: list) -> list:
        """One response per request; a bad one fails alone."""
        import numpy as np

        pb = self.pb_utils
        responses = []
        for request in requests:
            try:
                command = self._text(request, COMMAND)
                if command is None:
                    raise ControlError("INVALID_ARG", f"{COMMAND} is missing")
                result = self.controller.run(
                    command.strip().lower(), parse_adapter_ids(self._text(request, ADAPTER_IDS))
                )
                payload = np.array([json.dumps(result).encode("utf-8")], dtype=np.object_)
                responses.append(pb.InferenceResponse(output_tensors=[pb.Tensor(RESULT, payload)]))
            except ControlError as exc:
                code = getattr(pb.TritonError, exc.code, pb.TritonError.INTERNAL)
                responses.append(pb.InferenceResponse(output_tensors=[], error=pb.TritonError(exc.message, code)))
            except Exception as exc:
                logger.exception("adapter control request failed")
                error = pb.TritonError(f"{type(exc).__name__}: {exc}", pb.TritonError.INTERNAL)
                responses.append(pb.InferenceResponse(output_tensors=[], error=error))
        return responses

    def _text(self, request, name: str) -> Optional[str]:
        tensor = self.pb_utils.get_input_tensor_by_name(request, name)
        if tensor is None:
            return None
        values = tensor.as_numpy().reshape(-1)
        if values.size != 1:
            raise ControlError("INVALID_ARG", f"{name} must hold one string, got {values.size}")
        value = values[0]
        try:
            return value.decode("utf-8") if isinstance(value, bytes) else str(value)
        except UnicodeDecodeError as exc:
            raise ControlError("INVALID_ARG", f"{name} is not valid UTF-8: {exc}") from None


def send(url: str, command: str, adapter_ids: Iterable[str] = (), *, model: str = "manylora_control") -> dict:
    """Send one control command over gRPC (``host:port``) and return the parsed RESULT."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, text in ((COMMAND, command), (ADAPTER_IDS, ",".join(adapter_ids))):
        if name == ADAPTER_IDS and not text:
            continue
        tensor = grpcclient.InferInput(name, [1], "BYTES")
        tensor.set_data_from_numpy(np.array([text.encode("utf-8")], dtype=np.object_))
        inputs.append(tensor)
    with grpcclient.InferenceServerClient(url) as client:
        response = client.infer(model, inputs)
    return json.loads(response.as_numpy(RESULT)[0])


def main(argv: Optional[list[str]] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m manylora.control", description="List, preload, evict adapters or read cache stats"
    )
    parser.add_argument("command", choices=COMMANDS)
    parser.add_argument("adapter_ids", nargs="*", help="adapter ids (preload, evict)")
    parser.add_argument("--url", default="localhost:8001", help="Triton gRPC host:port")
    args = parser.parse_args(argv)
    print(json.dumps(send(args.url, args.command, args.adapter_ids), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
