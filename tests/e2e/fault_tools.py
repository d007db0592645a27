"""Shared by the bad-input, overload and soak end-to-end tests (not a test module itself).

Model repositories with an edited copy of the committed config.pbtxt, inputs built from
raw arrays (so a test can send what no well-behaved client would), requests sent together
so that they share one dynamic batch, the GLiNER2 (+ PEFT) reference, and what Triton's
gRPC and HTTP frontends report for each ``pb_utils.TritonError`` code.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
from google.protobuf import text_format
from manylora.client import protocol
from tritonclient.grpc import model_config_pb2
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

REPO_MODEL = Path(__file__).resolve().parents[2] / "model_repository" / "gliner2"
REPO_CORE_MODEL = REPO_MODEL.parent / "gliner2_core"
REPO_CONTROL_MODEL = REPO_MODEL.parent / "manylora_control"

# What tritonclient's InferenceServerException.status() reports for each pb_utils.TritonError
# code a model answers with (measured on Triton 2.51; test_bad_input_catalogue checks all of it).
# HTTP folds UNKNOWN, ALREADY_EXISTS and CANCELLED into 400, like INVALID_ARG.
GRPC_STATUS = {
    "UNKNOWN": "StatusCode.UNKNOWN",
    "INTERNAL": "StatusCode.INTERNAL",
    "NOT_FOUND": "StatusCode.NOT_FOUND",
    "INVALID_ARG": "StatusCode.INVALID_ARGUMENT",
    "UNAVAILABLE": "StatusCode.UNAVAILABLE",
    "UNSUPPORTED": "StatusCode.UNIMPLEMENTED",
    "ALREADY_EXISTS": "StatusCode.ALREADY_EXISTS",
    "CANCELLED": "StatusCode.CANCELLED",
}
HTTP_STATUS = {
    "UNKNOWN": "400",
    "INTERNAL": "500",
    "NOT_FOUND": "404",
    "INVALID_ARG": "400",
    "UNAVAILABLE": "503",
    "UNSUPPORTED": "501",
    "ALREADY_EXISTS": "400",
    "CANCELLED": "400",
}


def write_gliner2_model(
    repo: Path,
    name: str,
    checkpoint: Path,
    parameters: Mapping[str, str] | None = None,
    edit: Callable[[model_config_pb2.ModelConfig], None] | None = None,
    core_edit: Callable[[model_config_pb2.ModelConfig], None] | None = None,
) -> Path:
    """The committed pipeline under ``repo``: the gliner2 front as ``name`` (``edit``-ed) and
    its GPU stage as ``<name>_core``, whose parameters are ``checkpoint`` + ``parameters``
    (``core_edit``-ed). Both configs are parsed as ModelConfig messages. Returns the front."""
    core = f"{name}_core"
    front_parameters = {"checkpoint": str(checkpoint), "core_model": core}
    if parameters and "max_request_tokens" in parameters:
        front_parameters["max_request_tokens"] = parameters["max_request_tokens"]
    folder = _write_model(repo / name, REPO_MODEL, name, front_parameters, edit)
    _write_model(repo / core, REPO_CORE_MODEL, core, {"checkpoint": str(checkpoint), **(parameters or {})}, core_edit)
    return folder


def pipeline_loads(name: str = protocol.MODEL_NAME) -> list[str]:
    """tritonserver arguments loading the front ``name`` and its GPU stage (explicit mode)."""
    return [f"--load-model={name}", f"--load-model={name}_core"]


def _write_model(folder: Path, source: Path, name: str, parameters: Mapping[str, str], edit) -> Path:
    (folder / "1").mkdir(parents=True)
    shutil.copy2(source / "1" / "model.py", folder / "1" / "model.py")
    config = text_format.Parse((source / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    config.name = name
    config.parameters.clear()
    for key, value in parameters.items():
        config.parameters[key].string_value = value
    if edit is not None:
        edit(config)
    (folder / "config.pbtxt").write_text(text_format.MessageToString(config))
    return folder


def arrays_of(request: protocol.Request, **changes: np.ndarray | None) -> dict[str, np.ndarray]:
    """The request's six input arrays; a change replaces one (None leaves it out)."""
    arrays = {**request.to_arrays(), **changes}
    return {name: array for name, array in arrays.items() if array is not None}


def bytes_item(value: bytes) -> np.ndarray:
    return np.array([[value]], dtype=np.object_)


def infer_inputs(module, arrays: Mapping[str, np.ndarray]) -> list:
    """InferInputs for raw arrays, each with the datatype of its numpy dtype (right or wrong)."""
    inputs = []
    for name, array in arrays.items():
        tensor = module.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def send_together(url: str, batch: Sequence[list], model: str = protocol.MODEL_NAME, timeout: float = 120.0) -> list:
    """Send every item (a list of gRPC InferInputs) at once; an InferResult or the
    InferenceServerException for each, in order."""
    client = grpcclient.InferenceServerClient(url)
    answers: dict[int, object] = {}
    done = threading.Condition()

    def callback(index):
        def store(result, error):
            with done:
                answers[index] = error if error is not None else result
                done.notify_all()

        return store

    try:
        for index, inputs in enumerate(batch):
            client.async_infer(model, inputs, callback(index))
        with done:
            if not done.wait_for(lambda: len(answers) == len(batch), timeout):
                raise TimeoutError(f"{len(batch) - len(answers)} of {len(batch)} requests unanswered after {timeout} s")
        return [answers[i] for i in range(len(batch))]
    finally:
        client.close()


def metrics_when(url: str, check: Callable[[str], None], timeout: float = 10.0) -> str:
    """The server's /metrics text once ``check(text)`` passes (it raises AssertionError until
    then): the GPU stage publishes its metrics at most every metrics_interval, after the
    answers, so a scrape right after the last answer may be a little behind."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        try:
            check(text)
            return text
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def execution_counts(url: str, model: str = protocol.MODEL_NAME) -> tuple[int, int]:
    """(executions, inferences) of the model so far: one execution per dynamic batch."""
    client = grpcclient.InferenceServerClient(url)
    try:
        stats = client.get_inference_statistics(model).model_stats[0]
        return stats.execution_count, stats.inference_count
    finally:
        client.close()


class References:
    """GLiNER2 itself (with PEFT and the adapter's folder for adapter requests), cached."""

    def __init__(self, reference_model, peft_reference, folders: Mapping[str, Path]):
        self.reference_model = reference_model
        self.peft_reference = peft_reference
        self.folders = dict(folders)  # adapter id -> folder PEFT loads (the demo adapter it copies)
        self._cache: dict[tuple, object] = {}

    def expected(self, request: protocol.Request, folder: Path | None = None):
        """What the server must answer; ``folder`` overrides the adapter's folder."""
        if folder is None and request.adapter:
            folder = self.folders[request.adapter]
        key = (request, str(folder or ""))
        if key not in self._cache:
            model = self.peft_reference(folder) if folder else self.reference_model
            self._cache[key] = reference_answer(model, request)
        return self._cache[key]


def reference_answer(model, request: protocol.Request):
    """What GLiNER2 (or its PEFT model) answers to ``request``, as it survives the wire (JSON)."""
    from gliner2.inference.schema import Schema

    (result,) = model.batch_extract(
        [request.text],
        Schema.from_json(request.schema),
        threshold=request.threshold,
        include_confidence=request.include_confidence,
        include_spans=request.include_spans,
    )
    return json.loads(json.dumps(result))  # tuples become lists


def child_pids(parent_pid: int, match: Callable[[list[bytes]], bool]) -> list[int]:
    """Processes whose parent is ``parent_pid`` and whose command line (its arguments) ``match``es."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            status = (proc / "status").read_text()
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("PPid:")), None)
        if ppid == parent_pid and match(cmdline):
            pids.append(int(proc.name))
    return pids


def stub_pids(server_pid: int, instance: str) -> list[int]:
    """Python backend stub processes of the server serving model instance ``instance`` (e.g. gliner2_0_0)."""
    return child_pids(
        server_pid,
        lambda args: any(a.endswith(b"triton_python_backend_stub") for a in args) and instance.encode() in args,
    )


def closed_loop(url: str, request_of: Callable[[int], protocol.Request], clients: int, timeout: float = 60.0):
    """``clients`` threads, each sending ``request_of(i)`` in turn (i = its index, then + clients)
    until the returned event is set; ``outcomes`` gets (sent, seconds, "ok" or "<gRPC status>
    <message>") per request. Returns (outcomes, stop event, threads)."""
    outcomes: list[tuple[float, float, str]] = []
    stop = threading.Event()

    def load(k: int) -> None:
        own = grpcclient.InferenceServerClient(url)
        i = k
        while not stop.is_set():
            sent = time.monotonic()
            try:
                own.infer(
                    protocol.MODEL_NAME, infer_inputs(grpcclient, request_of(i).to_arrays()), client_timeout=timeout
                )
                outcomes.append((sent, time.monotonic() - sent, "ok"))
            except InferenceServerException as exc:
                outcomes.append((sent, time.monotonic() - sent, f"{exc.status()} {exc.message()}"))
            i += clients

    threads = [threading.Thread(target=load, args=(k,), daemon=True) for k in range(clients)]
    for thread in threads:
        thread.start()
    return outcomes, stop, threads


def stub_shm_region(stub_pid: int) -> Path | None:
    """The shared-memory region of a stub (named on its command line). Triton leaves it in
    /dev/shm when the stub or the server is killed, or when the server's exit times out."""
    for arg in Path(f"/proc/{stub_pid}/cmdline").read_bytes().split(b"\0"):
        if arg.startswith(b"triton_python_backend_shm_region_"):
            return Path("/dev/shm") / arg.decode()
    return None


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def write_control(folder: Path, allowed_commands: str | None = None) -> None:
    """The committed control model under the folder's name, with allowed_commands when given."""
    shutil.copytree(REPO_CONTROL_MODEL, folder, ignore=shutil.ignore_patterns("__pycache__"))
    config = text_format.Parse((folder / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    config.name = folder.name
    if allowed_commands is not None:
        config.parameters["allowed_commands"].string_value = allowed_commands
    (folder / "config.pbtxt").write_text(text_format.MessageToString(config))
