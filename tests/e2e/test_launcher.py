"""The tritonserver launcher: a real server, both protocols, clean stops, clear failures."""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from manylora.tritonserver import TritonServer, free_ports

FIXTURES = Path(__file__).parent / "fixtures"
REPO_ROOT = Path(__file__).resolve().parents[2]
TEXTS = ["hello", "héllo wörld ✓", ""]


def batch(texts: list[str]) -> np.ndarray:
    return np.array([[t.encode()] for t in texts], dtype=np.object_)


def infer_http(url: str, texts: list[str]) -> httpclient.InferResult:
    client = httpclient.InferenceServerClient(url)
    try:
        text = httpclient.InferInput("TEXT", [len(texts), 1], "BYTES")
        text.set_data_from_numpy(batch(texts))
        return client.infer("echo", [text])
    finally:
        client.close()


def infer_grpc(url: str, texts: list[str]) -> grpcclient.InferResult:
    client = grpcclient.InferenceServerClient(url)
    try:
        text = grpcclient.InferInput("TEXT", [len(texts), 1], "BYTES")
        text.set_data_from_numpy(batch(texts))
        return client.infer("echo", [text])
    finally:
        client.close()


@pytest.mark.parametrize("infer", [infer_http, infer_grpc], ids=["http", "grpc"])
def test_echo_round_trip(echo_server: TritonServer, infer) -> None:
    url = echo_server.http_url if infer is infer_http else echo_server.grpc_url
    result = infer(url, TEXTS)
    assert [row[0].decode() for row in result.as_numpy("ECHO")] == TEXTS


def test_stub_imports_manylora_from_this_checkout(echo_server: TritonServer) -> None:
    info = json.loads(infer_http(echo_server.http_url, ["x"]).as_numpy("INFO")[0, 0])
    assert Path(info["manylora"]).resolve().is_relative_to(REPO_ROOT)
    # manylora.kernels maps to the top-level kernels/ folder (package-dir in pyproject).
    assert Path(info["manylora.kernels"]).resolve() == REPO_ROOT / "kernels" / "__init__.py"
    assert Path(info["prefix"]).resolve() == Path(sys.prefix).resolve()
    # Same patch release: the stub runs this interpreter's libpython, not the system's.
    assert info["python"] == platform.python_version()
    assert info["numpy"].startswith("1.")  # numpy 2 breaks the 2.51 stub (docs/architecture.md, "Traps")
    assert info["tag"] == "committed"


def test_metrics_endpoint(echo_server: TritonServer) -> None:
    infer_http(echo_server.http_url, ["x"])
    with urllib.request.urlopen(echo_server.metrics_url, timeout=10) as response:
        metrics = response.read().decode()
    assert 'nv_inference_request_success{model="echo",version="1"}' in metrics


def test_context_manager_stops_cleanly(tmp_path: Path) -> None:
    with TritonServer(FIXTURES / "echo_repo", log_file=tmp_path / "server.log") as server:
        assert server.running
        result = infer_grpc(server.grpc_url, ["bye"])
        assert result.as_numpy("ECHO")[0, 0] == b"bye"
    assert server.process is not None and server.process.returncode == 0
    assert not server.running
    assert "successfully unloaded 'echo'" in server.log_path.read_text()


def test_failed_start_reports_server_log(tmp_path: Path) -> None:
    broken = tmp_path / "repo" / "broken" / "1"
    broken.mkdir(parents=True)
    (broken / "model.py").write_text("raise ImportError('broken on purpose')\n")
    (broken.parent / "config.pbtxt").write_text('backend: "python"\nmax_batch_size: 0\n')
    server = TritonServer(tmp_path / "repo", log_file=tmp_path / "server.log")
    with pytest.raises(RuntimeError, match="broken on purpose"):
        server.start(timeout=60)
    assert not server.running


def test_cli_runs_in_foreground_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    http_port, grpc_port, metrics_port = free_ports(3)
    log = tmp_path / "server.log"
    cli = subprocess.Popen(
        [sys.executable, "-m", "manylora.tritonserver",
         "--model-repository", str(FIXTURES / "echo_repo"),
         "--http-port", str(http_port), "--grpc-port", str(grpc_port),
         "--metrics-port", str(metrics_port), "--log-file", str(log),
         "--parameter", "echo:tag=from-cli", "--", "--log-verbose=1"],
        stdout=subprocess.PIPE, text=True,
        # Ctrl-C reaches a foreground program with SIGINT at its default; pytest itself may run
        # with SIGINT ignored (a background job of a non-interactive shell), which children inherit
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        assert cli.stdout is not None
        banner = [cli.stdout.readline() for _ in range(4)]
        assert banner[0].startswith("tritonserver is ready"), banner
        assert f"http://127.0.0.1:{http_port}" in banner[1]
        assert f"127.0.0.1:{grpc_port}" in banner[2]
        assert f"http://127.0.0.1:{metrics_port}/metrics" in banner[3]
        assert infer_http(f"127.0.0.1:{http_port}", ["cli"]).as_numpy("ECHO")[0, 0] == b"cli"
        cli.send_signal(signal.SIGINT)
        assert cli.wait(timeout=60) == 0
    finally:
        if cli.poll() is None:  # SIGTERM takes the CLI's clean path, which stops its server too
            cli.send_signal(signal.SIGTERM)
            try:
                cli.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.kill(cli.pid, signal.SIGKILL)  # its server (own process group) may then outlive it
                cli.wait()


def test_stop_kills_a_stub_left_frozen_in_the_servers_group(tmp_path):
    """A stub frozen in model code outlived its server (100% CPU, its /dev/shm region left
    behind): stop() kills the stubs left in the server's process group and removes their
    regions. Here a stand-in server exits on SIGINT and leaves a stand-in stub that ignores it."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    from manylora.tritonserver import STUB_NAME, TritonServer

    region = f"triton_python_backend_shm_region_test_{os.getpid()}"
    (Path("/dev/shm") / region).write_bytes(b"x")
    stub = tmp_path / STUB_NAME
    ready = tmp_path / "stub-ignores-sigint"  # written once SIGINT is ignored: a SIGINT before it kills
    stub.write_text(  # the stand-in stub, and stop() then finds no stub to reap (CI, session 12)
        f"#!{sys.executable}\nimport signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        f"open({str(ready)!r}, 'w').close()\nwhile True: time.sleep(0.1)\n"
    )
    stub.chmod(0o755)
    server = tmp_path / "fake-tritonserver"
    server.write_text(
        # SIGINT as Python's default even where it is inherited ignored (a job started in the
        # background without job control): ignored, stop() would time out and SIGKILL the group
        f"#!{sys.executable}\nimport signal, subprocess, time\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
        f"subprocess.Popen([{str(stub)!r}, {region!r}])\n"
        "try:\n    time.sleep(60)\nexcept KeyboardInterrupt:\n    pass\n"
    )
    server.chmod(0o755)
    triton = TritonServer(tmp_path)
    triton.process = subprocess.Popen([str(server)], start_new_session=True)
    deadline = time.monotonic() + 30
    stubs: list = []
    while not (stubs and ready.exists()) and time.monotonic() < deadline:  # the stand-in stub runs, SIGINT ignored
        time.sleep(0.2)
        stubs = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline_has(p, region)]
    assert stubs and ready.exists(), "the stand-in stub started"
    triton.stop(timeout=10)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(_cmdline_has(p, region) for p in stubs):
        time.sleep(0.1)
    assert not any(_cmdline_has(p, region) for p in stubs), "the frozen stub was killed"
    assert not (Path("/dev/shm") / region).exists(), "its shared-memory region was removed"


def _cmdline_has(proc, name: str) -> bool:
    try:
        return any(a.endswith(name.encode()) for a in (proc / "cmdline").read_bytes().split(b"\0"))
    except OSError:
        return False


def test_backend_copies_of_removed_or_changed_stubs_are_pruned_once_idle(tmp_path: Path, monkeypatch) -> None:
    """A backend copy whose stub is gone or changed since is removed once unused for a day; one
    used lately, one whose stub is as it was, and a copy without SOURCE (made before SOURCE
    existed) younger than a week stay. The launcher's own copy names its stub and is touched."""
    import json
    import time

    from manylora import tritonserver as ts

    backends = tmp_path / "triton-backends"
    live = tmp_path / "venv" / "stub"
    live.parent.mkdir()
    live.write_text("stub")
    changed = tmp_path / "venv" / "old-stub"
    changed.write_text("stub")
    changed_identity = ts._stub_identity(changed)
    changed.write_text("a reinstalled stub")
    now = time.time()
    cases = {  # name: (SOURCE, days unused)
        "py3.11-gone": ({"path": str(tmp_path / "deleted-venv" / "stub"), "size": 1, "mtime_ns": 1}, 2),
        "py3.11-changed": (changed_identity, 2),
        "py3.11-gone-but-in-use": ({"path": str(tmp_path / "deleted" / "stub"), "size": 1, "mtime_ns": 1}, 0.1),
        "py3.11-live": (ts._stub_identity(live), 30),
        "py3.11-unknown-recent": (None, 2),
        "py3.11-unknown-old": (None, 8),
    }
    for name, (source, days) in cases.items():
        (backends / name / "python").mkdir(parents=True)
        if source is not None:
            (backends / name / ts.SOURCE_FILE).write_text(json.dumps(source))
        os.utime(backends / name, (now - days * 86400, now - days * 86400))
    removed = ts.prune_backend_copies(backends, now=now)
    assert sorted(p.name for p in removed) == ["py3.11-changed", "py3.11-gone", "py3.11-unknown-old"]
    assert sorted(p.name for p in backends.iterdir()) == [
        "py3.11-gone-but-in-use",
        "py3.11-live",
        "py3.11-unknown-recent",
    ]

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("TRITONSERVER", raising=False)
    made = ts.find_install().backend_dir
    assert made.parent == tmp_path / "cache" / "manylora" / "triton-backends"
    source = json.loads((made / ts.SOURCE_FILE).read_text())
    assert ts._stub_identity(Path(source["path"])) == source
    os.utime(made, (now - 5 * 86400, now - 5 * 86400))
    assert ts.find_install().backend_dir == made and time.time() - made.stat().st_mtime < 60, "use touches it"
