"""Start and stop a real tritonserver: for tests, benchmarks and `make serve`.

By default the server is the one inside the `nvidia-pytriton` wheel (Triton 2.51.0, the
same release as NGC 24.10): `pytriton/tritonserver/bin/tritonserver`, its shared libraries
in `nvidia_pytriton.libs/` and the Python backend in `pytriton/tritonserver/backends/`.
The wheel ships backend stubs for several Pythons, so a backend directory is assembled
once in a cache directory with the stub for the running Python copied next to
`libtriton_python.so`, where the backend looks for it. Copies made from a stub that is gone or changed
since (a deleted venv or clone, a reinstall) are removed after a day unused, when a new copy
is made (`prune_backend_copies`).

`TRITONSERVER=/path/to/bin/tritonserver` selects another server (the NGC image, a GPU
bundle); its backends are taken from `TRITON_BACKENDS` or else `<bin>/../backends`, and
`<bin>/../lib` joins the library path when it exists.

The Python backend stub ignores PYTHONPATH: it builds its `sys.path` from the `python3`
that comes first on PATH, site-packages and `.pth` files included. The server is
therefore started with this interpreter's `bin/` (the virtualenv's) first on PATH, and
`import manylora` inside a model.py resolves exactly as it does here. The stub must also
load this interpreter's own libpython (same patch release as the stdlib it will run), so
its folder goes on LD_LIBRARY_PATH when it is not a system folder.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self needs 3.11; NGC 24.10 runs 3.10

STUB_NAME = "triton_python_backend_stub"
# Searched by the dynamic linker anyway; putting them on LD_LIBRARY_PATH could only shadow.
SYSTEM_LIB_DIRS = tuple(Path(d) for d in ("/lib", "/lib64", "/usr/lib", "/usr/lib64"))


@dataclass(frozen=True)
class TritonInstall:
    """Where a tritonserver binary, its backends and its shared libraries live."""

    binary: Path
    backend_dir: Path
    lib_dirs: tuple[Path, ...]


def free_ports(n: int) -> list[int]:
    """Return `n` distinct TCP ports that are free on the loopback interface right now."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "manylora"


def find_install() -> TritonInstall:
    """Locate tritonserver: `$TRITONSERVER` if set, else the nvidia-pytriton wheel."""
    if binary := os.environ.get("TRITONSERVER"):
        binary_path = Path(binary).resolve()
        if not os.access(binary_path, os.X_OK):
            raise FileNotFoundError(f"TRITONSERVER={binary} is not an executable file")
        root = binary_path.parent.parent
        backends = Path(os.environ.get("TRITON_BACKENDS") or root / "backends")
        if not (backends / "python").is_dir():
            raise FileNotFoundError(f"no python backend in {backends} (set TRITON_BACKENDS)")
        lib_dirs = (root / "lib",) if (root / "lib").is_dir() else ()
        return TritonInstall(binary_path, backends, lib_dirs)

    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("nvidia-pytriton is not installed: run `make setup`, or set TRITONSERVER")
    server_root = Path(next(iter(spec.submodule_search_locations))) / "tritonserver"
    libs = server_root.parent.parent / "nvidia_pytriton.libs"
    return TritonInstall(
        binary=server_root / "bin" / "tritonserver",
        backend_dir=_backend_dir_with_stub(server_root),
        lib_dirs=(libs,) if libs.is_dir() else (),
    )


def _backend_dir_with_stub(server_root: Path) -> Path:
    """A copy of the wheel's backends with this Python's stub in backends/python/."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = server_root / "python_backend_stubs" / version / STUB_NAME
    if not stub.is_file():
        raise FileNotFoundError(f"the nvidia-pytriton wheel has no stub for Python {version}")
    # Keyed by wheel location and content so several checkouts and venvs never share one.
    stat = stub.stat()
    key = hashlib.sha256(f"{server_root}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    target = cache_dir() / "triton-backends" / f"py{version}-{key[:12]}"
    if (target / "python" / STUB_NAME).is_file():
        with contextlib.suppress(OSError):  # in use: prune_backend_copies keeps it a while
            os.utime(target)
        return target

    # Built aside and renamed into place: concurrent test sessions may race here.
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    try:
        shutil.copytree(
            server_root / "backends",
            staging,
            dirs_exist_ok=True,
            ignore=shutil.ignore_patterns("__pycache__"),
        )
        shutil.copy2(stub, staging / "python" / STUB_NAME)
        (staging / SOURCE_FILE).write_text(json.dumps(_stub_identity(stub)))
        try:
            staging.rename(target)
        except OSError:
            if not (target / "python" / STUB_NAME).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    prune_backend_copies(target.parent)
    return target


SOURCE_FILE = "SOURCE"  # in each backend copy: the stub it was made from (path, size, mtime)
PRUNE_IDLE_SECONDS = 24 * 3600  # a copy unused this long whose stub is gone or changed is removed
PRUNE_UNKNOWN_SECONDS = 7 * 24 * 3600  # one without SOURCE (made before it existed): unused this long


def _stub_identity(stub: Path) -> dict:
    stat = stub.stat()
    return {"path": str(stub), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def prune_backend_copies(folder: Path, now: float | None = None) -> list[Path]:
    """Remove the backend copies (~3 MB each) nothing will use again: every fresh venv or clone,
    and every reinstall of the wheel, made one, and none was ever removed (42 copies, 115 MB, on
    this project's CPU host after two days of sessions). A copy goes once its stub is gone or
    changed and it has not been used for PRUNE_IDLE_SECONDS (a server started from it may still
    run, and may restart a stub from it); a copy without SOURCE after PRUNE_UNKNOWN_SECONDS.
    Use is the copy folder's mtime, which ``find_install`` touches."""
    now = time.time() if now is None else now
    removed = []
    for copy in folder.glob("py*-*"):
        try:
            idle = now - copy.stat().st_mtime
            source = copy / SOURCE_FILE
            if not source.is_file():
                stale = idle > PRUNE_UNKNOWN_SECONDS
            else:
                made_from = json.loads(source.read_text())
                stub = Path(made_from["path"])
                stale = idle > PRUNE_IDLE_SECONDS and (not stub.is_file() or _stub_identity(stub) != made_from)
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if stale:
            shutil.rmtree(copy, ignore_errors=True)
            removed.append(copy)
    return removed


def python_lib_dir() -> Path | None:
    """The folder of this interpreter's shared libpython, unless the system's linker finds it.

    The stub links `libpython3.X.so.1.0` by soname. Without help the linker finds the
    system's copy (Debian's 3.11.2 here), which then runs the stdlib and extension modules of
    this interpreter (pyenv's 3.11.7): `_ssl` fails with "undefined symbol: _PyModule_Add".
    """
    lib_dir = sysconfig.get_config_var("LIBDIR")
    soname = sysconfig.get_config_var("INSTSONAME")
    if not (sysconfig.get_config_var("Py_ENABLE_SHARED") and lib_dir and soname):
        return None
    path = Path(lib_dir)
    if not (path / soname).is_file() or any(path.is_relative_to(d) for d in SYSTEM_LIB_DIRS):
        return None
    return path


def server_env(install: TritonInstall, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for tritonserver: this venv's bin/ first on PATH, libraries found."""
    env = dict(os.environ)
    # sys.prefix is the venv even when sys.executable was reached through a symlink.
    venv_bin = str(Path(sys.prefix) / "bin")
    env["PATH"] = os.pathsep.join([venv_bin, env.get("PATH", "")]).rstrip(os.pathsep)
    lib_path = [str(d) for d in install.lib_dirs]
    if (libpython_dir := python_lib_dir()) is not None:
        lib_path.append(str(libpython_dir))
    if env.get("LD_LIBRARY_PATH"):
        lib_path.append(env["LD_LIBRARY_PATH"])
    if lib_path:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(lib_path)
    # The stub's interpreter must not be pointed elsewhere by the caller's settings.
    env.pop("PYTHONHOME", None)
    env.update(extra or {})
    return env


class TritonServer:
    """One tritonserver process; a context manager that stops it on exit.

    >>> with TritonServer("model_repository", log_file="triton.log") as server:
    ...     print(server.http_url, server.grpc_url)

    `model_parameters={"gliner2": {"checkpoint": "/abs/dir"}}` overrides string parameters
    of a model's committed config.pbtxt without copying the repository: the server starts
    in explicit model-control mode and loads every model of the repository through the
    load API, the named ones with their edited config. Relative paths in a config keep
    their meaning, because the model folder stays where it is.
    """

    def __init__(
        self,
        model_repository: str | os.PathLike[str],
        *,
        http_port: int | None = None,
        grpc_port: int | None = None,
        metrics_port: int | None = None,
        address: str = "127.0.0.1",
        log_file: str | os.PathLike[str] | None = None,
        exit_timeout: int = 10,
        auto_complete_config: bool = False,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        model_parameters: Mapping[str, Mapping[str, str]] | None = None,
        install: TritonInstall | None = None,
    ):
        self.model_repository = Path(model_repository).resolve()
        if not self.model_repository.is_dir():
            raise FileNotFoundError(f"model repository {self.model_repository} does not exist")
        ports = iter(free_ports(3))
        self.http_port = http_port or next(ports)
        self.grpc_port = grpc_port or next(ports)
        self.metrics_port = metrics_port or next(ports)
        self.address = address
        self.log_path = Path(log_file).resolve() if log_file is not None else None
        self.exit_timeout = exit_timeout
        self.auto_complete_config = auto_complete_config
        self.extra_args = list(extra_args)
        self.model_parameters = {m: dict(p) for m, p in (model_parameters or {}).items()}
        if self.model_parameters and any(
            a.startswith(("--model-control-mode", "--load-model")) for a in self.extra_args
        ):
            raise ValueError("model_parameters load the models themselves (explicit mode)")
        self.extra_env = dict(env or {})
        self.install = install
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def _host(self) -> str:
        return "127.0.0.1" if self.address in ("0.0.0.0", "") else self.address

    @property
    def http_url(self) -> str:
        """host:port, the form tritonclient.http expects."""
        return f"{self._host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        """host:port, the form tritonclient.grpc expects."""
        return f"{self._host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self._host}:{self.metrics_port}/metrics"

    def command(self) -> list[str]:
        assert self.install is not None
        return [
            str(self.install.binary),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={self.install.backend_dir}",
            f"--http-address={self.address}",
            f"--http-port={self.http_port}",
            f"--grpc-address={self.address}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.address}",
            f"--metrics-port={self.metrics_port}",
            # Triton waits this long for open client connections when asked to stop.
            f"--exit-timeout-secs={self.exit_timeout}",
            # Auto-completion starts one extra backend stub per model, importing model.py
            # (torch and all) a second time; the project's configs are complete.
            *([] if self.auto_complete_config else ["--disable-auto-complete-config"]),
            *(["--model-control-mode=explicit"] if self.model_parameters else []),
            *self.extra_args,
        ]

    def start(self, timeout: float = 120.0) -> Self:
        """Start the server and wait until /v2/health/ready answers; raise if it cannot."""
        if self.process is not None:
            raise RuntimeError("server already started")
        if self.install is None:
            self.install = find_install()
        output = None
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            output = open(self.log_path, "wb")  # noqa: SIM115 - the child owns it from here
        try:
            self.process = subprocess.Popen(
                self.command(),
                env=server_env(self.install, self.extra_env),
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT if output else None,
                # Own process group: a terminal's Ctrl-C reaches us, and we stop the server
                # (and its backend stubs) deliberately.
                start_new_session=True,
            )
        finally:
            if output is not None:
                output.close()
        try:
            deadline = time.monotonic() + timeout
            self.wait_ready(timeout)
            if self.model_parameters:
                self.load_models_with_parameters(deadline - time.monotonic())
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout: float) -> None:
        import tritonclient.http as httpclient
        from tritonclient.utils import InferenceServerException

        assert self.process is not None
        client = httpclient.InferenceServerClient(self.http_url, network_timeout=5.0)
        deadline = time.monotonic() + timeout
        try:
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"tritonserver exited with code {self.process.returncode} "
                        f"before it was ready\n{self.log_tail()}"
                    )
                # Connections are refused or reset until the HTTP endpoint is up.
                with contextlib.suppress(OSError, InferenceServerException):
                    if client.is_server_ready():
                        return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"tritonserver not ready after {timeout:.0f} s\n{self.log_tail()}")
                time.sleep(0.2)
        finally:
            client.close()

    def load_models_with_parameters(self, timeout: float) -> None:
        """Load each model of the repository, overriding parameters where asked."""
        import tritonclient.http as httpclient
        from google.protobuf import json_format, text_format
        from tritonclient.grpc import model_config_pb2
        from tritonclient.utils import InferenceServerException

        client = httpclient.InferenceServerClient(
            self.http_url, connection_timeout=timeout, network_timeout=max(timeout, 1.0)
        )
        try:
            names = [m["name"] for m in client.get_model_repository_index()]
            unknown = sorted(set(self.model_parameters) - set(names))
            if unknown:
                raise ValueError(f"no model {unknown} in {self.model_repository}")
            for name in names:
                config = None
                if name in self.model_parameters:
                    text = (self.model_repository / name / "config.pbtxt").read_text()
                    message = text_format.Parse(text, model_config_pb2.ModelConfig())
                    for key, value in self.model_parameters[name].items():
                        message.parameters[key].string_value = value
                    config = json_format.MessageToJson(message, preserving_proto_field_name=True)
                try:
                    client.load_model(name, config=config)
                except InferenceServerException as err:
                    raise RuntimeError(f"model {name!r} failed to load: {err.message()}\n{self.log_tail()}") from None
        finally:
            client.close()

    def stop(self, timeout: float | None = None) -> int | None:
        """SIGINT (Triton unloads its models and exits), SIGKILL if that takes too long.

        `timeout` defaults to the server's exit timeout plus 20 s. A second Ctrl-C while
        waiting kills the server at once. Returns the exit code (None if never started).
        """
        process = self.process
        if process is None:
            return None
        if process.poll() is None:
            _signal_group(process, signal.SIGINT)
            try:
                process.wait(self.exit_timeout + 20 if timeout is None else timeout)
            except (subprocess.TimeoutExpired, KeyboardInterrupt) as err:
                _signal_group(process, signal.SIGKILL)
                process.wait()
                if isinstance(err, KeyboardInterrupt):
                    raise
        _reap_group(process.pid)
        return process.returncode

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.is_file():
            return "(server output was not captured)"
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(["--- tail of " + str(self.log_path)] + text[-lines:])

    def __enter__(self) -> Self:
        return self.start() if self.process is None else self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _signal_group(process: subprocess.Popen[bytes], signum: int) -> None:
    """Signal the server and its backend stubs (they share its process group)."""
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:
        pass


def _reap_group(pgid: int) -> list[int]:
    """Kill the Python backend stubs left in a stopped server's process group and remove the
    shared-memory regions they named. A Python backend stub frozen in a model's code outlived
    its server: it ran on at 100% CPU and its /dev/shm region stayed. Returns the pids killed."""
    left, regions = [], []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # after "pid (comm) ": state, ppid, pgrp, ...
        stub = any(a.endswith(STUB_NAME.encode()) for a in cmdline)  # never anything else that took the id
        if stub and len(fields) > 2 and fields[2] == str(pgid):
            left.append(int(proc.name))
            regions += [
                a.decode(errors="replace") for a in cmdline if a.startswith(b"triton_python_backend_shm_region")
            ]
    for pid in left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    for region in regions:
        if "/" not in region:
            with contextlib.suppress(OSError):
                (Path("/dev/shm") / region).unlink()
    return left


def _raise_keyboard_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(
        prog="python -m manylora.tritonserver",
        description="Run tritonserver in the foreground; arguments after -- go to it as they are.",
    )
    parser.add_argument("--model-repository", required=True)
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--address", default="127.0.0.1", help="0.0.0.0 to listen on all interfaces")
    parser.add_argument("--log-file", help="server output goes here instead of the terminal")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for ready")
    parser.add_argument(
        "--parameter",
        action="append",
        default=[],
        metavar="MODEL:KEY=VALUE",
        help="override a string parameter of a model's config.pbtxt (repeatable)",
    )
    args = parser.parse_args(argv)
    model_parameters: dict[str, dict[str, str]] = {}
    for item in args.parameter:
        model, sep, assignment = item.partition(":")
        key, eq, value = assignment.partition("=")
        if not (sep and eq and model and key):
            parser.error(f"--parameter {item!r}: expected MODEL:KEY=VALUE")
        model_parameters.setdefault(model, {})[key] = value

    # SIGTERM (docker stop, kill) takes the same clean path as Ctrl-C.
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    server = None
    try:
        server = TritonServer(
            args.model_repository,
            http_port=args.http_port,
            grpc_port=args.grpc_port,
            metrics_port=args.metrics_port,
            address=args.address,
            log_file=args.log_file,
            extra_args=extra,
            model_parameters=model_parameters,
        )
        server.start(timeout=args.timeout)
        print(
            "tritonserver is ready (Ctrl-C stops it)\n"
            f"  HTTP     http://{server.http_url}\n"
            f"  gRPC     {server.grpc_url}\n"
            f"  metrics  {server.metrics_url}",
            flush=True,
        )
        assert server.process is not None
        server.process.wait()
    except KeyboardInterrupt:
        print("stopping tritonserver (Ctrl-C again kills it)", file=sys.stderr, flush=True)
    except (ImportError, OSError, ValueError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    try:
        code = server.stop() if server is not None else 0
    except KeyboardInterrupt:
        return 130
    return code if code is None or code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
