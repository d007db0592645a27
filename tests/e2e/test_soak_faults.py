"""A bounded soak with injected faults: every response is correct or a clean error.

Clients (gRPC and HTTP) send a steady stream of requests over five adapters while the test:

1. switches an adapter to a new version atomically (a symlink replaced with ``os.replace``);
2. overwrites another adapter's weights in place, over and over (what ``cp`` does: truncate,
   then write), while it is being served;
3. deletes a third adapter and puts it back;
4. kills the Python backend stub with SIGKILL, then unloads and loads the model (a
   watchdog's job: Triton 2.51 neither restarts the stub nor marks the model unready);
5. kills tritonserver itself (SIGKILL) and starts it again on the same ports while the
   clients keep retrying.

A success must equal GLiNER2 (+ PEFT) for one of the versions the adapter had during the
run; an error must be one of the clean ones below. Counts are printed (``pytest -s``).
Opt-in: ``pytest -m soak tests/e2e/test_soak_faults.py``. ``MANYLORA_SOAK_SECONDS`` sets the
length of the load (default 45 s; the faults are spread over it) and also runs it.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from fault_tools import (
    References,
    infer_inputs,
    pipeline_loads,
    stub_pids,
    stub_shm_region,
    wait_until,
    write_gliner2_model,
)
from manylora.client import protocol
from tritonclient.utils import InferenceServerException

from manylora.compare import result_differences
from manylora.demo import demo_schemas, demo_texts
from manylora.tritonserver import TritonServer, free_ports

SOAK_SECONDS = float(os.environ.get("MANYLORA_SOAK_SECONDS", "45"))
pytestmark = pytest.mark.soak


@pytest.fixture(autouse=True)
def _only_when_asked(request):
    """1-2 minutes on a 2-core machine (model reload and server restart included): too long for
    every run of the suite. ``pytest -m soak`` or MANYLORA_SOAK_SECONDS=... runs it."""
    expression = request.config.getoption("markexpr") or ""
    if ("soak" not in expression or "not soak" in expression) and "MANYLORA_SOAK_SECONDS" not in os.environ:
        pytest.skip("a 1-2 minute soak: run it with `pytest -m soak`")


INSTANCE = "gliner2_0_0"  # the stub's model instance name
# adapter id in the soak -> the demo adapters whose answers it may give during the run
VERSIONS = {
    "": [None],
    "stable": ["enc-r8"],
    "swap": ["enc-r4", "enc-heads-r12"],  # switched atomically once
    "vanish": ["qv-r8"],  # deleted, then put back
    "inplace": ["heads-r8", "enc-r8"],  # weights overwritten in place, alternating
}
# errors a fault may cause, tried in order; anything else fails the test
CLEAN_ERRORS = (
    ("adapter deleted", re.compile(r"^unknown adapter 'vanish'")),
    ("adapter mid-change", re.compile(r"^adapter '(vanish|inplace)' (cannot be served|changed while it was read)")),
    ("stub killed", re.compile(r"^Stub process '.*' is not healthy")),
    ("model reloading", re.compile(r"Request for unknown model|is not ready|unloaded")),
    (
        "server down",
        re.compile(r"failed to connect|connection refused|Socket closed|Connection reset|Broken pipe", re.I),
    ),
)


@dataclass
class Soak:
    grpc_url: str
    http_url: str
    pool: list
    accepted: dict  # pool index -> list of acceptable results
    stop: threading.Event = field(default_factory=threading.Event)
    outcomes: list = field(default_factory=list)  # (time sent, kind, adapter, detail)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, sent: float, kind: str, adapter: str, detail: str = "") -> None:
        with self.lock:
            self.outcomes.append((sent, kind, adapter, detail))


def _error_kind(exc: Exception) -> str:
    if not isinstance(exc, InferenceServerException):  # the HTTP client's own socket errors
        return "server down" if isinstance(exc, OSError) else f"UNCLEAN {type(exc).__name__}: {exc}"
    for kind, pattern in CLEAN_ERRORS:
        if pattern.search(exc.message() or ""):
            return kind
    return f"UNCLEAN {exc.status()}: {exc.message()}"


def _client(soak: Soak, module, seed: int) -> None:
    """A closed-loop client that reconnects and retries whatever happens to the server."""
    rng = random.Random(seed)
    url = soak.grpc_url if module is grpcclient else soak.http_url
    client = None
    while not soak.stop.is_set():
        index = rng.randrange(len(soak.pool))
        request = soak.pool[index]
        sent = time.monotonic()
        try:
            if client is None:
                client = module.InferenceServerClient(url)
            inputs = infer_inputs(module, request.to_arrays())
            if module is grpcclient:
                answer = client.infer(protocol.MODEL_NAME, inputs, client_timeout=120.0)
            else:
                answer = client.infer(protocol.MODEL_NAME, inputs)
        except Exception as exc:  # noqa: BLE001 - every failure is classified, clean or not
            kind = _error_kind(exc)
            soak.record(sent, kind, request.adapter, str(exc)[:200])
            if kind == "server down" and client is not None:
                client.close()
                client = None
            time.sleep(0.1)  # a client that retries, not one that spins
            continue
        got = protocol.parse_result(answer.as_numpy(protocol.RESULT))
        matches = [i for i, expected in enumerate(soak.accepted[index]) if not result_differences(got, expected)]
        soak.record(sent, f"correct v{matches[0]}" if matches else "WRONG", request.adapter)
    if client is not None:
        client.close()  # an open HTTP connection would hold up the server's exit


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_soak_with_faults_every_answer_correct_or_a_clean_error(
    tmp_path, tiny_checkpoint, demo_adapters, reference_model, peft_reference
):
    root = tmp_path / "adapters"
    _copy(demo_adapters["enc-r8"], root / "stable")
    swap_v1 = _copy(demo_adapters["enc-r4"], root / ".versions" / "swap-1")
    swap_v2 = _copy(demo_adapters["enc-heads-r12"], root / ".versions" / "swap-2")
    os.symlink(swap_v1.relative_to(root), root / "swap")
    _copy(demo_adapters["qv-r8"], root / "vanish")
    _copy(demo_adapters["heads-r8"], root / "inplace")
    inplace_weights = [(demo_adapters[n] / "adapter_model.safetensors").read_bytes() for n in VERSIONS["inplace"]]
    parameters = {"adapter_dir": str(root), "max_gpu_adapters": "4", "max_cpu_adapters": "8"}
    write_gliner2_model(tmp_path / "repo", "gliner2", tiny_checkpoint, parameters)

    references = References(reference_model, peft_reference, {})
    schema = json.dumps(demo_schemas()[0])
    pool, accepted = [], {}
    for text in demo_texts(3, seed=71, min_words=20, max_words=50):
        for adapter, versions in VERSIONS.items():
            request = protocol.Request(text, schema, adapter=adapter, include_confidence=True)
            accepted[len(pool)] = [references.expected(request, demo_adapters.get(v)) for v in versions]
            pool.append(request)

    http_port, grpc_port, metrics_port = free_ports(3)

    def start_server(log: str) -> TritonServer:
        server = TritonServer(
            tmp_path / "repo",
            http_port=http_port,
            grpc_port=grpc_port,
            metrics_port=metrics_port,
            log_file=tmp_path / log,
            extra_args=["--model-control-mode=explicit", *pipeline_loads()],
        )
        return server.start(timeout=300)

    server = start_server("server-1.log")
    soak = Soak(server.grpc_url, server.http_url, pool, accepted)
    clients = [
        threading.Thread(target=_client, args=(soak, module, seed), daemon=True)
        for seed, module in enumerate([grpcclient, grpcclient, httpclient])
    ]
    events: dict[str, float] = {}
    regions: list[Path] = []
    started = time.monotonic()

    def at(fraction: float) -> None:  # wait until this fraction of the soak has passed
        time.sleep(max(0.0, started + fraction * SOAK_SECONDS - time.monotonic()))

    try:
        for thread in clients:
            thread.start()
        at(0.05)
        link = root / "swap.new"
        os.symlink(swap_v2.relative_to(root), link)
        os.replace(link, root / "swap")  # atomic: every request sees v1 or v2
        events["swap switched"] = time.monotonic()

        at(0.10)
        shutil.rmtree(root / "vanish")
        events["vanish deleted"] = time.monotonic()
        for i in range(8):  # in place, as cp does: the file is truncated, then written
            at(0.10 + 0.02 * i)
            with open(root / "inplace" / "adapter_model.safetensors", "wb") as f:
                data = inplace_weights[(i + 1) % 2]
                f.write(data[: len(data) // 2])
                f.flush()
                time.sleep(0.01)
                f.write(data[len(data) // 2 :])
        _copy(demo_adapters["qv-r8"], root / ".vanish.tmp").rename(root / "vanish")
        events["vanish restored"] = time.monotonic()

        at(0.30)
        regions += _shm_regions(server.process.pid)
        (stub,) = stub_pids(server.process.pid, INSTANCE)
        os.kill(stub, signal.SIGKILL)
        events["stub killed"] = time.monotonic()
        assert wait_until(lambda: _saw(soak, "stub killed"), 30), "requests fail once the stub is gone"
        with httpclient.InferenceServerClient(server.http_url) as admin:
            assert admin.is_model_ready(protocol.MODEL_NAME), "Triton 2.51 still calls the model ready"
            admin.unload_model(protocol.MODEL_NAME)  # the watchdog (a load alone reloads only changed files)
            assert wait_until(lambda: not admin.is_model_ready(protocol.MODEL_NAME), 60)
            admin.load_model(protocol.MODEL_NAME)
        events["model reloaded"] = time.monotonic()
        assert stub_pids(server.process.pid, INSTANCE), "a new stub serves the model"

        at(0.55)
        regions += _shm_regions(server.process.pid)
        os.killpg(server.process.pid, signal.SIGKILL)  # tritonserver and its stub crash together
        server.process.wait()
        events["server killed"] = time.monotonic()
        for region in regions:  # what SIGKILL leaves behind: the stubs' shared memory
            region.unlink(missing_ok=True)
        server = start_server("server-2.log")
        events["server restarted"] = time.monotonic()

        at(1.0)
        wait_until(lambda: all(_served_after(soak, events["server restarted"], a) for a in VERSIONS), 60)
    finally:
        soak.stop.set()
        for thread in clients:
            thread.join(timeout=120)
        server.stop()

    counts = Counter(kind for _, kind, _, _ in soak.outcomes)
    timeline = ", ".join(f"{name} at {t - started:.1f} s" for name, t in events.items())
    print(f"\nsoak {SOAK_SECONDS:.0f} s: {sum(counts.values())} requests {dict(sorted(counts.items()))}\n{timeline}")
    unclean = [(kind, adapter, detail) for _, kind, adapter, detail in soak.outcomes if kind.startswith("UNCLEAN")]
    assert counts["WRONG"] == 0, [o for o in soak.outcomes if o[1] == "WRONG"][:5]
    assert not unclean, unclean[:10]
    restarted = events["server restarted"]
    swapped = [k for t, k, a, _ in soak.outcomes if a == "swap" and t > events["swap switched"]]
    assert "correct v0" not in swapped, "the switched adapter never answers as its old version"
    for adapter in VERSIONS:
        assert _served_after(soak, restarted, adapter), f"{adapter!r} answers correctly after the restart"


def _saw(soak: Soak, kind: str) -> bool:
    with soak.lock:
        return any(k == kind for _, k, _, _ in soak.outcomes)


def _served_after(soak: Soak, since: float, adapter: str) -> bool:
    with soak.lock:
        return any(t > since and k.startswith("correct") and a == adapter for t, k, a, _ in soak.outcomes)


def _shm_regions(server_pid: int) -> list[Path]:
    return [region for pid in stub_pids(server_pid, INSTANCE) if (region := stub_shm_region(pid)) is not None]
