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

``control_dir = auto`` is ``<temp>/manylora-control-<uid>/server-<pid>-<start>-<random>``, where
pid and start are those of the tritonserver (every model instance is a child process of the
tritonserver that started it, so all models of one server meet there without configuration,
and two servers on one host never mix) and <random> is chosen by the first instance to get
there (``tempfile.mkdtemp``, under a lock). An explicit folder must be the same in both models'
configs and local to the host (instances are known to be alive by their process ids).

Who can write there decides who can steer the caches, so the folder must be private: the
control folder and its ``manylora-control-<uid>`` parent are created owner-only (0700) and
checked before use: a directory (not a symbolic link), owned by this process's uid, with no
group or other permission, under folders that no other user can rename (owned by root or by
us, not writable by others unless sticky). A folder that fails (another local user created it
first, mode 0777, a symlink) is refused with ``UnsafeControlDir``: the serving instances then
serve without control (logged), and the control model answers every command UNAVAILABLE with
the reason. A folder of ours with group or other *read* permission only (as older versions made
the parent) is tightened to 0700. Command files (64 KiB, at most 256 adapter ids) and status
files (1 MiB) are bounded: larger ones are refused without being read whole, and are never
written. Files are opened without following links or blocking, and checked to be regular.

Who can send commands: anyone who can send inference requests to the server, through the
``manylora_control`` model. Its ``allowed_commands`` parameter restricts that (``list,stats``
makes it read-only; refused commands answer UNSUPPORTED); not loading the model (leave it out
of ``--load-model`` in ``--model-control-mode=explicit``, or delete its folder from the
repository) removes the channel.

Files are written aside and renamed into place, so a reader never sees half of one. Nothing
here imports torch: the control model's process stays small.
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import os
import re
import stat
import tempfile
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, TextIO

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
MAX_ADAPTER_IDS = 256  # per command; 256 ids of the longest (128 characters) fit MAX_COMMAND_BYTES
MAX_ADAPTER_IDS_CHARS = 48 * 1024  # the ADAPTER_IDS text, checked before it is split
MAX_COMMAND_BYTES = 64 * 1024  # a command file; larger ones are neither written nor read
MAX_STATUS_BYTES = 1024 * 1024  # a status file (identity and the last ANSWERS_KEPT answers)
MAX_ANSWER_BYTES = MAX_STATUS_BYTES // 4  # one answer in it (a list of a large host tier fits)
PARAMETERS = ("control_dir", "timeout_s", "allowed_commands")
_PLACEHOLDER = re.compile(r"\$\{[^}]*\}")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_SERVER_FOLDER = re.compile(r"server-(\d+)(?:-(\d+)-.+)?")  # server-<pid>-<start>-<random>; server-<pid> (old)
_SERVER_LOCK = re.compile(r"\.server-(\d+)-(\d+)\.lock")


class ControlError(Exception):
    """A control request that cannot be answered; ``code`` is the Triton error code."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class UnsafeControlDir(ControlError):
    """A control folder that other users could reach: refused."""

    def __init__(self, message: str):
        super().__init__("UNAVAILABLE", message)


# ---------------------------------------------------------------------- the private folder


def control_base() -> Path:
    """``<temp>/manylora-control-<uid>``: the private parent of every auto control folder of this user."""
    return Path(tempfile.gettempdir()) / f"manylora-control-{os.getuid()}"


def _mode(st: os.stat_result) -> str:
    return f"{stat.S_IMODE(st.st_mode):04o}"


def _check_private(path: Path) -> None:
    """``path`` must be a directory, not a symlink, owned by our uid, with no group/other access.

    A folder of ours that others can read but not write is tightened to 0700 (nothing of
    theirs can be in it); one they can write, or that is not ours, is refused.
    """
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise UnsafeControlDir(f"control folder {path} cannot be checked: {exc.strerror}") from None
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeControlDir(f"control folder {path} is a symbolic link: refused (remove it, or set control_dir)")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeControlDir(f"control folder {path} is not a folder: refused (remove it, or set control_dir)")
    uid = os.getuid()
    if st.st_uid != uid:
        raise UnsafeControlDir(
            f"control folder {path} belongs to uid {st.st_uid}, not to this server's uid {uid}: refused "
            "(another local user may have created it to steer adapter control; remove it, or set control_dir)"
        )
    if st.st_mode & 0o022:
        raise UnsafeControlDir(
            f"control folder {path} has mode {_mode(st)}: other users can write in it: refused "
            "(it must be 0700; remove it, or set control_dir)"
        )
    if st.st_mode & 0o077:
        os.chmod(path, 0o700, follow_symlinks=False)
        logger.warning("adapter control: %s had mode %s, now 0700", path, _mode(st))


def _check_ancestors(path: Path) -> None:
    """No other user can rename or replace ``path`` through one of the folders above it."""
    uid = os.getuid()
    real = Path(os.path.realpath(path.parent))
    for folder in (real, *real.parents):
        try:
            st = os.stat(folder)
        except OSError as exc:
            raise UnsafeControlDir(f"control folder {path}: {folder} cannot be checked: {exc.strerror}") from None
        if st.st_uid not in (0, uid):
            raise UnsafeControlDir(
                f"control folder {path} is inside {folder}, which belongs to uid {st.st_uid}: that user could "
                "replace it: refused (set control_dir to a folder of this server's user)"
            )
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise UnsafeControlDir(
                f"control folder {path} is inside {folder} (mode {_mode(st)}), where other users can rename it: "
                "refused (set control_dir to a folder of this server's user)"
            )


def _private_dir(path: Path, *, create: bool = True) -> Path:
    """Create ``path`` owner-only if it is missing (its parents as needed), then check it is private."""
    if create:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise UnsafeControlDir(f"control folder {path} cannot be created: {exc.strerror or exc}") from None
    _check_ancestors(path)
    _check_private(path)
    return path


def auto_control_dir(server_pid: Optional[int] = None, *, create: bool = True) -> Optional[Path]:
    """The private control folder of the tritonserver ``server_pid`` (default: our parent process).

    ``<control_base()>/server-<pid>-<start>-<random>``: the first process to get here creates
    it with an unpredictable name, under a lock; the others find it. None when ``create`` is
    False and there is none. Raises UnsafeControlDir.
    """
    pid = os.getppid() if server_pid is None else server_pid
    prefix = f"server-{pid}-{_process_start(pid) or 0}-"
    base = control_base()
    if not create and not base.exists():
        return None
    _private_dir(base, create=create)
    lock = None
    try:
        if create:
            import fcntl

            flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
            lock = os.open(base / f".{prefix[:-1]}.lock", flags, 0o600)
            fcntl.flock(lock, fcntl.LOCK_EX)
        for candidate in sorted(base.glob(f"{prefix}*")):
            try:
                return _private_dir(candidate, create=False)
            except UnsafeControlDir as exc:
                logger.error("adapter control: %s", exc.message)
        if not create:
            return None
        return Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    except OSError as exc:
        raise UnsafeControlDir(f"control folder in {base} cannot be created: {exc.strerror or exc}") from None
    finally:
        if lock is not None:
            os.close(lock)  # releases the lock


def default_control_dir() -> Path:
    """The auto control folder of this process's tritonserver: in a Triton model instance the
    parent process is the tritonserver, shared by every model it serves. Created if missing."""
    return auto_control_dir()


def remove_stale_server_folders() -> None:
    """Remove the auto control folders (and their lock files) of tritonservers that are gone."""
    import shutil

    base = control_base()
    try:
        _private_dir(base, create=False)
        entries = list(base.iterdir())
    except (OSError, UnsafeControlDir):
        return
    for entry in entries:
        match = _SERVER_FOLDER.fullmatch(entry.name) or _SERVER_LOCK.fullmatch(entry.name)
        if match is None:
            continue
        pid, started = int(match.group(1)), match.group(2)
        started = None if started in (None, "0") else started
        if _alive({"pid": pid, "process_start": started}):
            continue
        if entry.is_symlink() or not entry.is_dir():
            _remove(entry)
        else:
            shutil.rmtree(entry, ignore_errors=True)


def _prepare(control_dir: Path) -> tuple[Path, Path]:
    """The commands and instances folders of a control folder, created private and checked.
    Raises UnsafeControlDir."""
    control_dir = Path(control_dir)
    _private_dir(control_dir)
    commands, instances = control_dir / "commands", control_dir / "instances"
    for folder in (commands, instances):
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise UnsafeControlDir(f"control folder {folder} cannot be created: {exc.strerror}") from None
        _check_private(folder)
    return commands, instances


def resolve_control_dir(value: str) -> Optional[Path]:
    """The folder a ``control_dir`` parameter names: 'auto' (created), 'none' (None) or a path."""
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


# ---------------------------------------------------------------------- bounded files


class _Unreadable(Exception):
    """A control file that is not read: too large, not a regular file, not JSON."""


def _write_json(path: Path, value: Any, limit: int) -> None:
    """Write ``value`` as JSON aside and rename it into place; refuses (ValueError) above ``limit`` bytes."""
    data = json.dumps(value).encode("utf-8")
    if len(data) > limit:
        raise ValueError(f"{path.name} would be {len(data)} bytes, above the limit of {limit}")
    staging = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    os.replace(staging, path)


def _read_json(path: Path, limit: int) -> Optional[Any]:
    """The JSON in ``path``; None when it is gone. Raises _Unreadable for a symlink, a FIFO or
    other non-regular file, a file above ``limit`` bytes (never read whole) or bad JSON."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _Unreadable(f"{path.name} is a symbolic link") from None
        raise _Unreadable(f"{path.name} cannot be opened: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _Unreadable(f"{path.name} is not a regular file")
        if st.st_size > limit:
            raise _Unreadable(f"{path.name} is {st.st_size} bytes, above the limit of {limit}: not read")
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise _Unreadable(f"{path.name} grew above the limit of {limit} bytes while it was read: not read")
    finally:
        os.close(fd)
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, RecursionError) as exc:
        raise _Unreadable(f"{path.name} is not readable JSON ({type(exc).__name__})") from None


def _read_status(path: Path) -> Optional[Any]:
    """A status file; None when it is gone or unreadable (logged)."""
    try:
        return _read_json(path, MAX_STATUS_BYTES)
    except _Unreadable as exc:
        logger.warning("adapter control: status file %s", exc)
        return None


def _json_files(folder: Path) -> list[Path]:
    try:
        return sorted(p for p in folder.iterdir() if p.suffix == ".json" and not p.name.startswith("."))
    except OSError:
        return []


# ---------------------------------------------------------------------- serving instances


class InstanceControl:
    """Applies the control model's commands to one model instance's adapter store.

    Raises UnsafeControlDir when ``control_dir`` is not private.
    """

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
                try:
                    command = _read_json(path, MAX_COMMAND_BYTES)
                except _Unreadable as exc:
                    logger.warning("adapter control: command file %s", exc)
                    answer = {"error": f"command file {exc}"}
                else:
                    if command is None:
                        continue  # removed meanwhile
                    answer = _bounded(self.apply(command))
                self._answers[path.stem] = answer
                while len(self._answers) > ANSWERS_KEPT:
                    self._answers.popitem(last=False)
                applied += 1
            if applied:
                self._write_status()
            return applied

    def apply(self, command: Any) -> dict:
        """One command on this instance's store: {"result": ...} or {"error": message}."""
        if not isinstance(command, Mapping):
            return {"error": f"a command must be a JSON object, got {type(command).__name__}"}
        name, ids = command.get("command"), command.get("adapter_ids") or []
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            return {"error": "adapter_ids must be a list of strings"}
        if len(ids) > MAX_ADAPTER_IDS:
            return {"error": f"{len(ids)} adapter ids, above the limit of {MAX_ADAPTER_IDS}"}
        store = self.store
        try:
            if name == "list":
                result = {**store.resident(ignored=True), "loading": store.loading()}
            elif name == "stats":
                result = store.stats()
            elif name == "preload":
                result = store.preload_report(ids)
            elif name == "evict":
                evicted = store.evict(ids)
                result = {"evicted": evicted, "not_resident": [i for i in dict.fromkeys(ids) if i not in evicted]}
            else:
                return {"error": f"unknown command {str(name)[:100]!r}"}
        except Exception as exc:
            logger.exception("adapter control: %s failed", name)
            return {"error": f"{type(exc).__name__}: {str(exc)[:1000]}"}
        return {"result": result}

    def _write_status(self) -> None:
        """The status file, within MAX_STATUS_BYTES: the oldest answers go first."""
        answers = self._answers
        while True:
            try:
                _write_json(self.status_path, {**self.identity, "answers": dict(answers)}, MAX_STATUS_BYTES)
                return
            except ValueError:
                if len(answers) <= 1:
                    raise
                answers.popitem(last=False)

    def close(self) -> None:
        """Stop the watcher and withdraw this instance from the control folder."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(10)
        self._finalizer()


def _bounded(answer: dict) -> dict:
    """An answer that fits a status file with room for others: above MAX_ANSWER_BYTES, an error instead."""
    size = len(json.dumps(answer))
    if size <= MAX_ANSWER_BYTES:
        return answer
    return {"error": f"the answer is {size} bytes, above the limit of {MAX_ANSWER_BYTES} for one answer"}


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
    initialize() arguments. Idempotent per engine; None when the model's ``control_dir`` is
    'none', or when the folder is not private (logged as an error: the model serves without
    adapter control).
    """
    with _attach_lock:
        if engine in _attached:
            return _attached[engine]
        instance = str(args.get("model_instance_name") or f"pid{os.getpid()}")
        try:
            folder = resolve_control_dir(getattr(engine.config, "control_dir", "auto"))
            if folder is None:
                return None
            control = InstanceControl(
                engine.store,
                folder,
                model=str(args.get("model_name") or "gliner2"),
                instance=instance,
                device=str(engine.device),
            )
        except UnsafeControlDir as exc:
            logger.error("adapter control is off for %s: %s", instance, exc.message)
            return None
        _attached[engine] = control
        logger.info("adapter control: %s answers commands in %s", instance, folder)
        return control


# ---------------------------------------------------------------------- the control model


def parse_adapter_ids(raw: Optional[str]) -> list[str]:
    """Comma-separated adapter ids, blanks dropped, order kept, duplicates removed."""
    if raw is None:
        return []
    if len(raw) > MAX_ADAPTER_IDS_CHARS:
        raise ControlError(
            "INVALID_ARG", f"ADAPTER_IDS has {len(raw)} characters, above the limit of {MAX_ADAPTER_IDS_CHARS}"
        )
    ids = list(dict.fromkeys(part.strip() for part in raw.split(",") if part.strip()))
    if len(ids) > MAX_ADAPTER_IDS:
        raise ControlError(
            "INVALID_ARG", f"{len(ids)} adapter ids, above the limit of {MAX_ADAPTER_IDS}: send several commands"
        )
    return ids


def parse_allowed_commands(value: str) -> tuple[str, ...]:
    """``allowed_commands``: comma-separated commands (``all`` for every one), in COMMANDS order."""
    names = {part.strip().lower() for part in value.split(",") if part.strip()}
    if names == {"all"}:
        return COMMANDS
    unknown = sorted(names - set(COMMANDS))
    if unknown or not names:
        raise ValueError(
            f"parameter 'allowed_commands': expected 'all' or some of {', '.join(COMMANDS)} (comma-separated), "
            f"got {value!r}; to remove adapter control, do not load manylora_control"
        )
    return tuple(c for c in COMMANDS if c in names)


class Controller:
    """The control model's side: send a command to every live instance and gather the answers.

    Raises UnsafeControlDir when ``control_dir`` is not private.
    """

    _counter = itertools.count()

    def __init__(self, control_dir: Path, timeout_s: float, allowed: Iterable[str] = COMMANDS):
        self.commands, self.instances = _prepare(Path(control_dir))
        self.timeout_s = timeout_s
        self.allowed = tuple(allowed)

    def live_instances(self) -> dict[Path, dict]:
        """Status file -> identity of every live instance; files of exited ones are removed."""
        live = {}
        for path in _json_files(self.instances):
            status = _read_status(path)
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
            shown = command if len(command) <= 100 else command[:100] + "..."
            raise ControlError("INVALID_ARG", f"unknown COMMAND {shown!r}; expected one of {', '.join(COMMANDS)}")
        if command not in self.allowed:
            raise ControlError(
                "UNSUPPORTED",
                f"COMMAND {command!r} is turned off on this server (manylora_control allowed_commands: "
                f"{', '.join(self.allowed)})",
            )
        if command in NEEDS_IDS and not ids:
            raise ControlError("INVALID_ARG", f"{command} needs ADAPTER_IDS (comma-separated adapter ids)")
        if command not in NEEDS_IDS and ids:
            raise ControlError("INVALID_ARG", f"{command} takes no ADAPTER_IDS")
        if len(ids) > MAX_ADAPTER_IDS:
            raise ControlError("INVALID_ARG", f"{len(ids)} adapter ids, above the limit of {MAX_ADAPTER_IDS}")
        instances = self.live_instances()
        if not instances:
            raise ControlError(
                "UNAVAILABLE",
                f"no model instance answers adapter control in {self.commands.parent}: is the gliner2 model "
                "loaded, and does it use the same control_dir?",
            )
        command_id = f"{time.time_ns():020d}-{os.getpid()}-{next(self._counter)}"
        command_path = self.commands / f"{command_id}.json"
        try:
            _write_json(command_path, {"id": command_id, "command": command, "adapter_ids": ids}, MAX_COMMAND_BYTES)
        except ValueError:
            raise ControlError(
                "INVALID_ARG", f"the command is above the limit of {MAX_COMMAND_BYTES} bytes: send fewer adapter ids"
            ) from None
        answers: dict[Path, dict] = {}
        deadline = time.monotonic() + self.timeout_s
        while True:
            for path in instances:
                if path in answers:
                    continue
                try:
                    status = _read_json(path, MAX_STATUS_BYTES)
                except _Unreadable as exc:
                    answers[path] = {"error": f"status file {exc}"}
                    continue
                if isinstance(status, dict) and command_id in (status.get("answers") or {}):
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
            folders = sorted({i["adapter_dir"] for i in instances.values() if isinstance(i.get("adapter_dir"), str)})
            result["adapter_dirs"] = folders
            result["adapters"] = sorted({name for folder in folders for name in _servable(Path(folder))})
        shown = ("model", "instance", "pid", "device")
        result["instances"] = [
            {**{k: instances[p].get(k) for k in shown}, **answers[p]}
            for p in sorted(
                instances, key=lambda p: (str(instances[p].get("model")), str(instances[p].get("instance")))
            )
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
    """The control model's config.pbtxt parameters, parsed strictly. ``control_dir`` None: auto."""

    control_dir: Optional[Path] = None
    timeout_s: float = 30.0
    allowed_commands: tuple[str, ...] = COMMANDS

    @classmethod
    def from_model_config(cls, model_config: Mapping, *, model_dir: Optional[Path] = None) -> "ControlSettings":
        raw = {}
        for key, value in (model_config.get("parameters") or {}).items():
            if not isinstance(value, Mapping) or not isinstance(value.get("string_value"), str):
                raise ValueError(f"parameter {key!r}: expected {{string_value: ...}}, got {value!r}")
            if _PLACEHOLDER.search(value["string_value"]):
                raise ValueError(f"parameter {key!r} holds an unfilled template {value['string_value']!r}")
            raw[key] = value["string_value"].strip()
        unknown = sorted(set(raw) - set(PARAMETERS))
        if unknown:
            raise ValueError(f"unknown parameter(s) {', '.join(map(repr, unknown))}; known: {', '.join(PARAMETERS)}")
        folder = raw.get("control_dir", "auto")
        if folder in ("", "none"):
            raise ValueError(f"parameter 'control_dir': expected 'auto' or a folder, got {folder!r}")
        path = None
        if folder != "auto":
            path = Path(os.path.expanduser(folder))
            if not path.is_absolute() and model_dir is not None:
                path = (Path(model_dir) / path).resolve()
        try:
            timeout = float(raw.get("timeout_s", "30"))
        except ValueError:
            raise ValueError(f"parameter 'timeout_s': expected seconds, got {raw['timeout_s']!r}") from None
        if not 0 < timeout <= 3600:
            raise ValueError(f"parameter 'timeout_s': expected seconds in (0, 3600], got {raw['timeout_s']!r}")
        allowed = parse_allowed_commands(raw.get("allowed_commands", "all"))
        return cls(path, timeout, allowed)


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
    """What the control model's model.py delegates to.

    A control folder that is not private does not fail the load (the server keeps serving):
    it is logged as an error, and every command answers UNAVAILABLE with the reason.
    """

    def __init__(self, args: Mapping, pb_utils):
        self.pb_utils = pb_utils
        model_config = json.loads(args["model_config"])
        check_control_config(model_config)
        settings = ControlSettings.from_model_config(model_config, model_dir=Path(args["model_repository"]))
        self.settings = settings
        self.controller: Optional[Controller] = None
        self.refusal: Optional[ControlError] = None
        try:
            folder = settings.control_dir
            if folder is None:
                remove_stale_server_folders()
                folder = default_control_dir()
            self.controller = Controller(folder, settings.timeout_s, settings.allowed_commands)
        except UnsafeControlDir as exc:
            logger.error("adapter control is off: %s", exc.message)
            self.refusal = ControlError("UNAVAILABLE", f"adapter control is off on this server: {exc.message}")
            return
        logger.info("adapter control in %s (commands: %s)", folder, ", ".join(settings.allowed_commands))

    def execute(self, requests: list) -> list:
        """One response per request; a bad one fails alone."""
        import numpy as np

        pb = self.pb_utils
        responses = []
        for request in requests:
            try:
                if self.controller is None:
                    raise self.refusal
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
                error = pb.TritonError(f"{type(exc).__name__}: {str(exc)[:1000]}", pb.TritonError.INTERNAL)
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
        if len(value) > MAX_COMMAND_BYTES:
            raise ControlError("INVALID_ARG", f"{name} has {len(value)} bytes, above the limit of {MAX_COMMAND_BYTES}")
        try:
            return value.decode("utf-8") if isinstance(value, bytes) else str(value)
        except UnicodeDecodeError as exc:
            raise ControlError("INVALID_ARG", f"{name} is not valid UTF-8: {exc}") from None


# ---------------------------------------------------------------------- the command line

# exit statuses of `manylora control` and `python -m manylora.control`
EXIT_OK, EXIT_REFUSED, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3
EXIT_CODES_HELP = """exit status:
  0  every instance answered, and nothing was refused
  1  the server refused the command (unknown, turned off by allowed_commands, bad ADAPTER_IDS), or a
     preload refused or skipped an adapter, or an instance failed or did not answer within timeout_s
  2  usage error
  3  the server cannot be reached, does not serve manylora_control, or adapter control is
     unavailable there (no model instance answers it, or its control folder was refused)"""
DEFAULT_URLS = {"grpc": "localhost:8001", "http": "localhost:8000"}


def send(
    url: str,
    command: str,
    adapter_ids: Iterable[str] = (),
    *,
    model: str = "manylora_control",
    protocol: str = "grpc",
    timeout: Optional[float] = None,
) -> dict:
    """Send one control command over gRPC or HTTP (``host:port``) and return the parsed RESULT.

    Raises tritonclient's InferenceServerException (the server's error) or OSError."""
    import numpy as np

    if protocol == "grpc":
        import tritonclient.grpc as client_module
    elif protocol == "http":
        import tritonclient.http as client_module
    else:
        raise ValueError(f"protocol must be 'grpc' or 'http', got {protocol!r}")
    inputs = []
    for name, text in ((COMMAND, command), (ADAPTER_IDS, ",".join(adapter_ids))):
        if name == ADAPTER_IDS and not text:
            continue
        tensor = client_module.InferInput(name, [1], "BYTES")
        tensor.set_data_from_numpy(np.array([text.encode("utf-8")], dtype=np.object_))
        inputs.append(tensor)
    if protocol == "grpc":
        with client_module.InferenceServerClient(url) as client:
            response = client.infer(model, inputs, client_timeout=timeout)
    else:
        kwargs = {} if timeout is None else {"connection_timeout": timeout, "network_timeout": timeout}
        with client_module.InferenceServerClient(url, **kwargs) as client:
            response = client.infer(model, inputs)
    return json.loads(response.as_numpy(RESULT)[0])


def problems(result: Mapping[str, Any]) -> list[str]:
    """What a control RESULT reports as not done: refused or skipped adapters, failed or silent instances."""
    found = []
    for answer in result.get("instances") or []:
        who = answer.get("instance") or answer.get("pid")
        if "error" in answer:
            found.append(f"{who}: {answer['error']}")
            continue
        outcome = answer.get("result") or {}
        for adapter, message in (outcome.get("refused") or {}).items():
            found.append(f"{who}: refused {adapter}: {message}")
        if outcome.get("skipped"):
            found.append(f"{who}: skipped (the host tier is full): {', '.join(outcome['skipped'])}")
    for silent in result.get("pending") or []:
        found.append(f"{silent.get('instance') or silent.get('pid')}: did not answer within timeout_s")
    return found


def _server_error(exc: Exception, url: str, model: str) -> tuple[int, str]:
    """Exit status and one-line message for a failed send()."""
    if isinstance(exc, OSError):
        return EXIT_UNREACHABLE, f"the server at {url} cannot be reached: {exc.strerror or exc}"
    status = getattr(exc, "status", None)
    code = str((status() if callable(status) else None) or "").removeprefix("StatusCode.")
    text = getattr(exc, "message", None)
    message = " ".join(str((text() if callable(text) else None) or exc).split())
    if len(message) > 1000:
        message = message[:1000] + "..."
    if "unknown model" in message.lower():
        return EXIT_UNREACHABLE, f"the server at {url} does not serve the model {model!r} (not loaded): {message}"
    if code == "UNAVAILABLE" and "failed to connect" in message:
        return EXIT_UNREACHABLE, f"the server at {url} cannot be reached: {message}"
    if code in ("UNAVAILABLE", "DEADLINE_EXCEEDED", "503"):
        return EXIT_UNREACHABLE, f"[{code}] {message}"
    return EXIT_REFUSED, f"[{code or type(exc).__name__}] {message}"


def run_command(
    command: str,
    adapter_ids: Iterable[str] = (),
    *,
    url: Optional[str] = None,
    protocol: str = "grpc",
    model: str = "manylora_control",
    timeout: Optional[float] = None,
    stdout: Optional[TextIO] = None,
    stderr: Optional[TextIO] = None,
    sender=send,
    prog: str = "manylora control",
) -> int:
    """Send one command, print its RESULT (JSON, stdout) and what went wrong (stderr); the exit status."""
    import sys

    stdout, stderr = stdout or sys.stdout, stderr or sys.stderr
    url = url or DEFAULT_URLS[protocol]
    adapter_ids = list(adapter_ids)
    if command in NEEDS_IDS and not adapter_ids:
        print(f"{prog}: error: {command} needs at least one ADAPTER_ID", file=stderr)
        return EXIT_USAGE
    if command not in NEEDS_IDS and adapter_ids:
        print(f"{prog}: error: {command} takes no ADAPTER_ID", file=stderr)
        return EXIT_USAGE
    try:
        result = sender(url, command, adapter_ids, model=model, protocol=protocol, timeout=timeout)
    except ValueError as exc:  # a bad URL or protocol
        print(f"{prog}: error: {exc}", file=stderr)
        return EXIT_USAGE
    except Exception as exc:  # the server's answer (InferenceServerException) or no connection
        status, message = _server_error(exc, url, model)
        print(f"{prog}: error: {message}", file=stderr)
        return status
    print(json.dumps(result, indent=1), file=stdout)
    found = problems(result)
    for line in found:
        print(f"{prog}: {line}", file=stderr)
    return EXIT_REFUSED if found else EXIT_OK


def add_control_arguments(parser) -> None:
    """The arguments of a control command line (``manylora control`` and ``python -m manylora.control``)."""
    parser.add_argument("action", choices=COMMANDS, metavar="{" + ",".join(COMMANDS) + "}", help="the command")
    parser.add_argument("adapter_ids", nargs="*", metavar="ADAPTER_ID", help="adapter ids (preload, evict)")
    parser.add_argument("--url", help="HOST:PORT (default localhost:8001 gRPC, localhost:8000 HTTP)")
    parser.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    parser.add_argument("--model", default="manylora_control", help="the control model's name (default %(default)s)")
    parser.add_argument("--timeout", type=_positive_seconds, help="seconds to wait for the answer (default: no limit)")


def _positive_seconds(value: str) -> float:
    import argparse

    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return seconds


def main(argv: Optional[list[str]] = None) -> int:
    import argparse
    import sys

    class Parser(argparse.ArgumentParser):
        def error(self, message):  # usage errors: one message, exit status 2, no traceback
            self.print_usage(sys.stderr)
            print(f"{self.prog}: error: {message}", file=sys.stderr)
            raise SystemExit(EXIT_USAGE)

    parser = Parser(
        prog="python -m manylora.control",
        description="List, preload, evict adapters or read cache stats (also: manylora control).",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_control_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    return run_command(
        args.action,
        args.adapter_ids,
        url=args.url,
        protocol=args.protocol,
        model=args.model,
        timeout=args.timeout,
        prog=parser.prog,
    )


if __name__ == "__main__":
    raise SystemExit(main())
