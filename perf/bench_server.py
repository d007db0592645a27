"""Server benchmark: the real tritonserver + perf_analyzer, GLiNER2 requests with a random adapter each.

Writes perf_analyzer ``--input-data`` JSON (per-request TEXT, SCHEMA, ADAPTER_ID drawn like the
engine benchmark: uniform or Zipf over N adapters, or none for the no-LoRA base), starts a
server on a copy of the model repository laid out as one of two designs, and measures each
mode (base, and lora once per --distributions entry):

  closed loop   perf_analyzer --concurrency-range C, for each --concurrency; the best of them
                is the mode's saturation throughput
  open loop     perf_analyzer --request-rate-range R (async, Poisson arrivals) at each
                --open-fractions of that saturation (and at each absolute --rates); the row
                records asked_rate and achieved_rate, and rate_ok: false (with a WARNING)
                when they differ by more than --rate-tolerance
  light load    concurrency 1 (--light-load), for base and the first lora distribution

Each phase (one perf_analyzer run) also records: the mean dynamic batch of gliner2 and of
gliner2_core (inference_count / execution_count deltas), the GPU busy share (mean of an
``nvidia-smi -lms 500`` sampler over the phase; absent without nvidia-smi), and the host CPU
per completed request of each stage: utime + stime of the server's Python-backend stubs
grouped by model (front gliner2, GPU stage gliner2_core), of tritonserver itself and of
perf_analyzer. A compact table closes the run.

Designs (--design, several run one after the other, each with its own server):
  pipeline  gliner2: --front-instances CPU fronts (pre/post) sending each batch by BLS to
            gliner2_core: --core-instances per GPU holding the engine (the committed layout)
  pipeline-serial  the same with gliner2_core's core_overlap off: each GPU-stage batch parsed,
            run and answered in turn (the A/B of the overlap, in the same run)
  pipeline-eager  the same with gliner2_core's cuda_graphs off: every encoder kernel launched
            from Python (the A/B of the CUDA graphs, in the same run)
  pipeline-unpiped  the same with gliner2_core's chunk_pipeline off: each chunk's forward, heads
            and host step in turn (the A/B of the chunk pipeline, in the same run)
  pipeline-unfused  the same with gliner2_core's fused_span_scores off: GLiNER2's own span head
            instead of kernels/spanscores.py (the A/B of the kernel, on by default since session 12)
  pipeline-eager-attention  the same with gliner2_core's fused_attention off: the bias tensor
            (kernels/relpos.py) and SDPA instead of kernels/disattn.py (the A/B of the kernel, on by
            default since session 13)
  pipeline-eager-heads  the same with gliner2_core's cuda_graph_heads off: the heads of
            entity-only chunks launched from Python instead of replayed as CUDA graphs (its A/B)
  pipeline-inflight  the same with the fronts' front_inflight 4: each front hands its batch's
            GPU-stage call and decoding to a pool thread and takes its next batch meanwhile (the A/B
            of the fronts' blocking call)
  pipeline-unfused-epilogue  the same with gliner2_core's fused_lora_epilogue off: DeBERTa's
            residual adds and GELU as their own passes instead of inside the LoRA expand (its A/B, on
            by default since session 14)
  pipeline-skip-padding  the same with gliner2_core's lora_skip_padding on: the LoRA kernels leave
            each row's padding alone (its A/B; off by default until measured on a GPU)
  pipeline-core-process  the same with gliner2_core's core_process on: the engine and its GPU
            thread in a child process of the stub, away from the interpreter lock of Triton's parse and
            responses (its A/B; off by default until measured on a GPU)
  pipeline-2x-fronts  the same with twice the fronts (2 x --front-instances): twice the batches in
            the GPU stage at once with each front's blocking call (the alternative to front_inflight,
            whose pool threads leave batches unanswered when a front's stub dies)
  pipeline-small-graphs  the same with gliner2_core's cuda_graph_max_tokens 16384 (the default
            before session 12): the big chunks of saturation launch every kernel (the A/B of the cap)
  pipeline-fine-chunks  the same with gliner2_core's chunk_cost_tokens 2048: a call's rows are cut
            into more, less padded chunks (the A/B of that knob; session 17: slower at saturation)
  single    gliner2 alone (core_model none): --instances GPU instances per GPU, each doing
            pre, GPU and post in series (the earlier design, for an A/B in the same run)

    # the H200 report (perf/run_h200.sh): both designs, base + lora uniform/zipf, open loop, light load
    python perf/bench_server.py --checkpoint models/demo-base --adapters models/bench-adapters \\
        --design single pipeline --gpu-slots 1024 --host-slots 1024 --distributions uniform zipf \\
        --open-fractions 0.35 0.7 --light-load --out perf/results/server.jsonl
    # measure a server that is already running (its design is read from its config)
    python perf/bench_server.py --url localhost:8001 --adapters models/demo-tiny-adapters --out ...
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import os
import platform
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, NamedTuple, Optional

from bench_engine import ENTITY_SCHEMA, pick_adapters  # same request distributions as the engine benchmark

ROOT = Path(__file__).resolve().parents[1]
REPO = ROOT / "model_repository"
FRONT, CORE = "gliner2", "gliner2_core"
# core_overlap / cuda_graphs / chunk_pipeline / fused_span_scores off, the graph cap of before session 12
DESIGNS = (
    "pipeline",
    "pipeline-serial",
    "pipeline-eager",
    "pipeline-unpiped",
    "pipeline-unfused",
    "pipeline-eager-attention",
    "pipeline-eager-heads",
    "pipeline-inflight",
    "pipeline-small-graphs",
    "pipeline-unfused-epilogue",
    "pipeline-2x-fronts",
    "pipeline-fine-chunks",
    "pipeline-skip-padding",
    "pipeline-core-process",
    "single",
)
CORE_OVERRIDES = {
    "pipeline-serial": {"core_overlap": "off"},
    "pipeline-eager": {"cuda_graphs": "off"},
    "pipeline-unpiped": {"chunk_pipeline": "off"},
    "pipeline-unfused": {"fused_span_scores": "off"},
    "pipeline-eager-attention": {"fused_attention": "off"},
    "pipeline-eager-heads": {"cuda_graph_heads": "off"},
    "pipeline-small-graphs": {"cuda_graph_max_tokens": "16384"},
    "pipeline-unfused-epilogue": {"fused_lora_epilogue": "off"},
    "pipeline-fine-chunks": {"chunk_cost_tokens": "2048"},
    "pipeline-skip-padding": {"lora_skip_padding": "on"},
    "pipeline-core-process": {"core_process": "on"},
}
# designs that change the front (gliner2) instead
FRONT_OVERRIDES = {"pipeline-inflight": {"front_inflight": "4"}}
# designs that multiply the fronts' instance count (--front-instances, or the committed count);
# a running server's design_of cannot tell them from "pipeline": its settings are the same
FRONT_MULTIPLIERS = {"pipeline-2x-fronts": 2}
# parameters the pipeline's front reads (manylora.serving.TritonModelHandler with core_model set)
FRONT_KEYS = ("checkpoint", "max_request_tokens")
STUB = "triton_python_backend_stub"
PHASE_OVERHEAD_S = 3.0  # perf_analyzer start, data load, the drain after its last window
# one server's start with 1,024 adapters preloaded (H200, session 13: 30-55 s); the estimate
# printed before a run leaves it out of "measurement", and --time-budget-s must cover both
SERVER_START_S = 45.0


def adapter_names(folder: Path | None) -> list[str]:
    if folder is None:
        return []
    return sorted(
        p.name
        for p in Path(folder).iterdir()
        if p.is_dir() and (p / "adapter_model.safetensors").is_file() and not p.name.startswith("_")
    )


def make_input_data(
    path: Path, count: int, adapters: list[str], distribution: str, seed: int = 0, words=(60, 120), schema=ENTITY_SCHEMA
) -> Path:
    """perf_analyzer --input-data JSON: one entry per request, cycled by perf_analyzer."""
    from manylora.demo import demo_texts

    texts = demo_texts(count, seed=seed, min_words=words[0], max_words=words[1])
    chosen = pick_adapters(adapters, count, distribution, seed) if adapters else [""] * count
    data = [
        {
            "TEXT": {"content": [text], "shape": [1]},
            "SCHEMA": {"content": [json.dumps(schema)], "shape": [1]},
            "ADAPTER_ID": {"content": [adapter], "shape": [1]},
            "THRESHOLD": {"content": [0.5], "shape": [1]},
            "INCLUDE_CONFIDENCE": {"content": [False], "shape": [1]},
            "INCLUDE_SPANS": {"content": [False], "shape": [1]},
            "MAX_LEN": {"content": [0], "shape": [1]},  # every input, as the client sends them: one batch
        }
        for text, adapter in zip(texts, chosen)
    ]
    path.write_text(json.dumps({"data": data}))
    return path


# ---------------------------------------------------------------------------- the repository


@dataclass(frozen=True)
class Layout:
    """How the benchmark's repository copy is laid out; None keeps the committed value."""

    design: str = "pipeline"
    front_instances: Optional[int] = None  # pipeline: gliner2 CPU fronts
    front_max_batch: Optional[int] = None
    front_delay_us: Optional[int] = None
    front_inflight: Optional[int] = None  # pipeline: the front's front_inflight (default: committed, 1)
    core_instances: int = 1  # pipeline: gliner2_core instances per GPU
    core_max_batch: Optional[int] = None
    core_delay_us: Optional[int] = None
    instances: int = 4  # single: gliner2 GPU instances per GPU
    max_batch: Optional[int] = None  # single: gliner2's dynamic batch (default: the committed front's)
    delay_us: Optional[int] = None
    gpus: str = ""  # "0,1": the GPU models' instances on these GPUs (default: Triton places them)


def read_config(path: Path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    return text_format.Parse(Path(path).read_text(), model_config_pb2.ModelConfig())


def _write_model(
    dst: Path,
    name: str,
    params: Mapping[str, str],
    *,
    count: int | None,
    kind: str | None,
    gpus: str,
    max_batch: int | None,
    delay_us: int | None,
) -> None:
    """Copy model_repository/<name> to dst/<name> with these parameters (all of them, the
    committed ones dropped), instance group, dynamic batch and queue delay."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    folder = dst / name
    shutil.copytree(REPO / name, folder, ignore=shutil.ignore_patterns("__pycache__"))
    config = read_config(folder / "config.pbtxt")
    if max_batch is not None:
        config.max_batch_size = max_batch
    if delay_us is not None:
        config.dynamic_batching.max_queue_delay_microseconds = delay_us
    if count is not None or kind is not None or gpus:
        committed = config.instance_group[0].count if config.instance_group else 1
        del config.instance_group[:]
        group = config.instance_group.add()
        group.count = count if count is not None else committed
        if kind is not None:
            group.kind = getattr(model_config_pb2.ModelInstanceGroup, kind)
        if gpus:
            group.gpus.extend(int(g) for g in gpus.split(","))
    config.ClearField("parameters")
    for key, value in params.items():
        config.parameters[key].string_value = str(value)
    text = text_format.MessageToString(config)
    (folder / "config.pbtxt").write_text(f"# written by perf/bench_server.py from model_repository/{name}\n{text}")


def bench_repository(dst: Path, params: Mapping[str, str], layout: Layout) -> Path:
    """A copy of the model repository for one design. ``params`` are the engine's parameters
    (checkpoint, adapter_dir, max_gpu_adapters, ...): in the pipeline they go to gliner2_core
    and the front gets only checkpoint (+ max_request_tokens) and core_model; in the single
    design gliner2 gets them all and core_model none, and gliner2_core is not written."""
    if layout.design not in DESIGNS:
        raise ValueError(f"design {layout.design!r}: expected one of {DESIGNS}")
    dst.mkdir(parents=True, exist_ok=True)
    if layout.design.startswith("pipeline"):
        front = {k: params[k] for k in FRONT_KEYS if k in params}
        front["core_model"] = CORE
        front.update(FRONT_OVERRIDES.get(layout.design, {}))
        if layout.front_inflight:
            if "front_inflight" in FRONT_OVERRIDES.get(layout.design, {}):
                raise ValueError(f"--front-inflight and --design {layout.design} both set front_inflight")
            front["front_inflight"] = str(layout.front_inflight)
        fronts = layout.front_instances
        if layout.design in FRONT_MULTIPLIERS:
            committed = read_config(REPO / FRONT / "config.pbtxt").instance_group[0].count
            fronts = (fronts or committed) * FRONT_MULTIPLIERS[layout.design]
        _write_model(
            dst,
            FRONT,
            front,
            count=fronts,
            kind="KIND_CPU",
            gpus="",
            max_batch=layout.front_max_batch,
            delay_us=layout.front_delay_us,
        )
        _write_model(
            dst,
            CORE,
            {**params, **CORE_OVERRIDES.get(layout.design, {})},
            count=layout.core_instances,
            kind="KIND_GPU" if layout.gpus else None,  # no kind: count on each GPU (KIND_CPU without one)
            gpus=layout.gpus,
            max_batch=layout.core_max_batch,
            delay_us=layout.core_delay_us,
        )
    else:
        _write_model(
            dst,
            FRONT,
            {**params, "core_model": "none"},
            count=layout.instances,
            kind="KIND_GPU",
            gpus=layout.gpus,
            max_batch=layout.max_batch,
            delay_us=layout.delay_us,
        )
    return dst


def repository_summary(repo: Path) -> dict:
    """What the written (or a running server's) configs say: per model, its batching,
    instance groups and parameters; recorded in every row."""
    out = {}
    for name in (FRONT, CORE):
        path = Path(repo) / name / "config.pbtxt"
        if path.is_file():
            out[name] = config_summary(read_config(path))
    return out


def config_summary(config) -> dict:
    from tritonclient.grpc import model_config_pb2

    kinds = model_config_pb2.ModelInstanceGroup.Kind
    return {
        "max_batch_size": config.max_batch_size,
        "max_queue_delay_us": config.dynamic_batching.max_queue_delay_microseconds,
        "instance_group": [
            {"count": g.count, "kind": kinds.Name(g.kind), **({"gpus": list(g.gpus)} if g.gpus else {})}
            for g in config.instance_group
        ],
        "parameters": {k: v.string_value for k, v in sorted(config.parameters.items())},
    }


def server_summary(url: str) -> dict:
    """repository_summary of a running server (--url), from its model configs."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    out = {}
    for name in (FRONT, CORE):
        try:
            out[name] = config_summary(client.get_model_config(name).config)
        except Exception:  # not loaded (the single design has no gliner2_core)
            continue
    return out


def design_of(summary: Mapping) -> str:
    if FRONT not in summary:
        return "unknown"
    front = summary[FRONT].get("parameters", {})
    if front.get("core_model", "none").strip() in ("", "none"):
        return "single"
    from manylora.config import EngineConfig

    core = summary.get(CORE, {}).get("parameters", {})

    def default(key: str) -> str:  # an absent key has the engine's default
        value = getattr(EngineConfig, key)
        return ("on" if value else "off") if isinstance(value, bool) else str(value)

    def settings(parameters: Mapping, table: Mapping) -> dict:  # the keys any design of table sets
        return {k: parameters.get(k, default(k)).strip() for overrides in table.values() for k in overrides}

    actual = (settings(front, FRONT_OVERRIDES), settings(core, CORE_OVERRIDES))
    for design in DESIGNS:  # the one design whose every setting matches, defaults included
        if design == "single":
            continue
        wanted = tuple({**settings({}, table), **table.get(design, {})} for table in (FRONT_OVERRIDES, CORE_OVERRIDES))
        if actual == wanted:
            return design
    return "pipeline-custom"  # settings of no one design (several overrides, or other values)


# ---------------------------------------------------------------------------- perf_analyzer


def perf_analyzer_env() -> dict:
    """perf_analyzer from the tritonclient wheel needs libcudart.so.12 (nvidia-cuda-runtime-cu12)."""
    env = dict(os.environ)
    try:
        import nvidia.cuda_runtime

        lib = Path(list(nvidia.cuda_runtime.__path__)[0]) / "lib"
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(lib), env.get("LD_LIBRARY_PATH")]))
    except ImportError:  # the GPU bundle / NGC image put it on the library path already
        pass
    return env


def perf_analyzer_command(
    url: str,
    data: Path,
    csv_path: Path,
    *,
    concurrency: int | None = None,
    rate: float | None = None,
    interval_ms: int = 4000,
    max_trials: int = 3,
    protocol: str = "grpc",
    async_mode: bool = True,
    max_threads: int = 16,
    request_distribution: str = "poisson",
) -> list[str]:
    """One perf_analyzer run at one load. Request-rate runs are always async: synchronous
    calls give each of --max-threads threads one request in flight (the default 4 threads
    made ~213 req/s of an asked 1,400), so the rate was never offered."""
    if (concurrency is None) == (rate is None):
        raise ValueError("give exactly one of concurrency and rate")
    cmd = [
        shutil.which("perf_analyzer") or str(Path(sys.prefix) / "bin" / "perf_analyzer"),
        "-m",
        FRONT,
        "-i",
        protocol,
        "-u",
        url,
        "--input-data",
        str(data),
        "--measurement-interval",
        str(interval_ms),
        "--percentile",
        "95",
        "-f",
        str(csv_path),
        "--stability-percentage",
        "999",  # never retried for stability: max_trials windows, the last 3 reported
        "--max-trials",
        str(max_trials),
    ]
    if rate is not None:
        asked = f"{rate:.3f}".rstrip("0").rstrip(".")
        cmd += ["--request-rate-range", asked, "--request-distribution", request_distribution]
        cmd += ["--async", "--max-threads", str(max_threads)]
    else:
        cmd += ["--concurrency-range", f"{concurrency}:{concurrency}"]
        if async_mode:
            cmd += ["--async", "--max-threads", str(max(1, min(max_threads, concurrency)))]
    return cmd


def parse_perf_csv(text: str) -> dict:
    """The one row of perf_analyzer's -f CSV (latencies there are in µs)."""
    row = next(csv.DictReader(io.StringIO(text)))

    def us(key: str) -> float:
        value = row.get(key)
        return float(value) if value not in (None, "") else 0.0

    out = {
        "req_per_s": float(row["Inferences/Second"]),
        "p50_ms": us("p50 latency") / 1e3,
        "p95_ms": us("p95 latency") / 1e3,
        "p99_ms": us("p99 latency") / 1e3,
        "avg_queue_ms": us("Server Queue") / 1e3,
        "avg_compute_ms": (us("Server Compute Input") + us("Server Compute Infer") + us("Server Compute Output")) / 1e3,
    }
    if row.get("Request Rate") not in (None, ""):
        out["asked_rate"] = float(row["Request Rate"])
    if row.get("Concurrency") not in (None, ""):
        out["concurrency_reported"] = int(float(row["Concurrency"]))
    return out


_STDOUT_RATE = re.compile(r"Request Rate:\s*([0-9.]+)\s*,\s*throughput:\s*([0-9.]+)\s*infer/sec")


def parse_perf_stdout(text: str) -> dict:
    """Asked and achieved rate from perf_analyzer's summary lines ("Request Rate: 1400,
    throughput: 213.4 infer/sec"), and its warnings (e.g. not keeping up with the rate)."""
    out: dict = {}
    matches = _STDOUT_RATE.findall(text)
    if matches:
        asked, achieved = matches[-1]
        out["asked_rate"], out["achieved_rate"] = float(asked), float(achieved)
    delayed = [int(n) for n in re.findall(r"Delayed Request Count:\s*(\d+)", text)]
    if delayed:
        out["pa_delayed_requests"] = max(delayed)  # sent later than scheduled (the client fell behind)
    warnings = []
    for line in text.splitlines():
        line = line.strip()
        if ("warning" in line.lower() or "not able to keep up" in line.lower()) and line not in warnings:
            warnings.append(line)
    if warnings:
        out["pa_warnings"] = warnings[:5]
    return out


def rate_check(asked: float, achieved: float, tolerance: float = 0.05) -> tuple[bool, str]:
    """Whether an open-loop run offered the rate it was asked for (within tolerance)."""
    if asked <= 0:
        return False, f"asked rate {asked} is not positive"
    off = achieved / asked - 1.0
    if abs(off) > tolerance:
        return False, (
            f"WARNING: asked {asked:.1f} req/s, achieved {achieved:.1f} req/s ({100 * off:+.1f}%, "
            f"beyond ±{100 * tolerance:.0f}%): this is not an open-loop measurement at the asked rate"
        )
    return True, ""


def open_loop_result(asked_arg: float, csv_fields: dict, stdout_fields: dict, tolerance: float) -> dict:
    """The rate fields of an open-loop row: asked (the CSV's Request Rate, else the argument),
    achieved (the CSV's Inferences/Second, else the summary line), rate_ok and the warning."""
    asked = csv_fields.get("asked_rate", stdout_fields.get("asked_rate", asked_arg))
    achieved = csv_fields.get("req_per_s", stdout_fields.get("achieved_rate"))
    ok, message = rate_check(asked, achieved, tolerance)
    out = {"asked_rate": asked, "achieved_rate": achieved, "rate_ok": ok}
    if message:
        out["rate_warning"] = message
    return out


def run_perf_analyzer(url: str, data: Path, csv_path: Path, **kwargs) -> dict:
    cmd = perf_analyzer_command(url, data, csv_path, **kwargs)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=perf_analyzer_env())
    if proc.returncode != 0:
        raise RuntimeError(f"perf_analyzer failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    result = parse_perf_csv(Path(csv_path).read_text())
    result["_stdout"] = parse_perf_stdout(proc.stdout + "\n" + proc.stderr)
    return result


# ---------------------------------------------------------------------------- server-side accounting


def model_counts(url: str) -> dict[str, dict[str, int]]:
    """Per loaded model: requests run (inference_count), model executions, failed requests."""
    import tritonclient.grpc as grpcclient

    stats = grpcclient.InferenceServerClient(url).get_inference_statistics("", as_json=True)
    out: dict[str, dict[str, int]] = {}
    for model in stats.get("model_stats", []):
        entry = out.setdefault(model["name"], {"inference": 0, "execution": 0, "fail": 0})
        entry["inference"] += int(model.get("inference_count", 0))
        entry["execution"] += int(model.get("execution_count", 0))
        entry["fail"] += int(model.get("inference_stats", {}).get("fail", {}).get("count", 0))
    return out


def batch_stats(before: Mapping, after: Mapping) -> dict:
    """Deltas of model_counts over a phase: requests completed at the public model, the mean
    dynamic batch of each model, and the rows per GPU-stage execute (gliner2_core's own
    count is BLS requests, one per front batch)."""

    def delta(model: str, key: str) -> int:
        return int(after.get(model, {}).get(key, 0)) - int(before.get(model, {}).get(key, 0))

    requests, executions = delta(FRONT, "inference"), delta(FRONT, "execution")
    out = {
        "requests": requests,
        "server_failures": delta(FRONT, "fail"),
        "mean_batch": round(requests / executions, 1) if executions else None,
    }
    if CORE in after:
        core_requests, core_executions = delta(CORE, "inference"), delta(CORE, "execution")
        out["mean_batch_core"] = round(core_requests / core_executions, 2) if core_executions else None
        out["core_rows_per_execute"] = round(requests / core_executions, 1) if core_executions else None
        out["core_failures"] = delta(CORE, "fail")
    return out


CALL_METRICS = ("manylora_core_call_rows", "manylora_core_call_seconds", "manylora_core_queue_seconds")
# counters: the GPU stage's CUDA graph captures (a phase that captures pays ~50-100 ms a shape)
CAPTURE_METRICS = ("manylora_cuda_graph_captures_total", "manylora_cuda_graph_capture_seconds_total")
# counter per phase of the GPU stage (manylora.metrics): kept per label as "<name>:<phase>"
PHASE_METRIC = "manylora_core_phase_seconds_total"


def call_metrics(metrics_url: Optional[str]) -> dict[str, float]:
    """The GPU stage's call histograms' _sum and _count and its graph-capture counters on the
    Prometheus endpoint, summed over instances ({} without a URL or when it cannot be read: the
    phase still reports)."""
    if not metrics_url:
        return {}
    import urllib.request

    try:
        text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    except Exception:
        return {}
    return parse_call_metrics(text)


def parse_call_metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        histogram = name.endswith(("_sum", "_count")) and name.rsplit("_", 1)[0] in CALL_METRICS
        if name == PHASE_METRIC and 'phase="' in line:
            name = name + ":" + line.split('phase="', 1)[1].split('"', 1)[0]
            histogram = True
        if histogram or name in CAPTURE_METRICS:
            try:
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
            except ValueError:
                continue
    return out


def call_stats(before: Mapping, after: Mapping) -> dict:
    """Deltas of call_metrics over a phase: the GPU thread's mean rows per engine call, its mean
    call time, a GPU-stage request's mean wait before its call (ms), and the CUDA graphs it
    captured and the seconds those captures took (both 0 without graphs)."""

    def mean(name: str, scale: float = 1.0) -> Optional[float]:
        count = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
        total = after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)
        return round(total / count * scale, 2) if count > 0 else None

    if not before or not after:  # a read failed: no phase figure rather than one since the start
        return {}
    calls = after.get("manylora_core_call_rows_count", 0.0) - before.get("manylora_core_call_rows_count", 0.0)
    phases = {
        key.split(":", 1)[1]: round((after[key] - before.get(key, 0.0)) / calls * 1e3, 2)
        for key in sorted(after)
        if key.startswith(f"{PHASE_METRIC}:") and calls > 0
    }
    return {
        "core_phase_ms_per_call": phases,
        "core_call_rows": mean("manylora_core_call_rows"),
        "core_call_ms": mean("manylora_core_call_seconds", 1e3),
        "core_queue_ms": mean("manylora_core_queue_seconds", 1e3),
        "core_graph_captures": round(after.get(CAPTURE_METRICS[0], 0.0) - before.get(CAPTURE_METRICS[0], 0.0)),
        "core_capture_s": round(after.get(CAPTURE_METRICS[1], 0.0) - before.get(CAPTURE_METRICS[1], 0.0), 3),
    }


class Proc(NamedTuple):
    ppid: int
    args: tuple[str, ...]
    ticks: int  # utime + stime, in clock ticks


def parse_stat(text: str) -> tuple[int, int]:
    """(ppid, utime + stime) from /proc/<pid>/stat (comm may hold spaces and parentheses)."""
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[1]), int(fields[11]) + int(fields[12])


def read_processes(root: Path = Path("/proc")) -> dict[int, Proc]:
    procs = {}
    for entry in root.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid, ticks = parse_stat((entry / "stat").read_text())
            args = tuple(a.decode("utf-8", "replace") for a in (entry / "cmdline").read_bytes().split(b"\0") if a)
        except (OSError, ValueError, IndexError):
            continue  # gone, or not readable
        procs[int(entry.name)] = Proc(ppid, args, ticks)
    return procs


def stage_of(args: Iterable[str], models: Iterable[str]) -> Optional[str]:
    """The model a Python-backend stub serves: its command line names the instance
    (gliner2_0_0 for a front, gliner2_core_0_0 for the GPU stage; tests/e2e/fault_tools.py)."""
    args = tuple(args)
    if not any(a.endswith(STUB) for a in args):
        return None
    models = sorted(models, key=len, reverse=True)
    for model in models:
        pattern = re.compile(rf"{re.escape(model)}(_\d+)+")
        if any(pattern.fullmatch(a) for a in args):
            return model
    for model in models:  # else its model file: <repository>/<model>/<version>/model.py
        if any(a.endswith("model.py") and len(Path(a).parts) >= 3 and Path(a).parts[-3] == model for a in args):
            return model
    return None


def stage_ticks(procs: Mapping[int, Proc], server_pid: int, models: Iterable[str]) -> dict[str, dict[int, int]]:
    """CPU ticks per stage, per process: the server's Python-backend stubs grouped by model (with
    their children: a ``core_process`` worker), and tritonserver (the server's other descendants:
    a wrapper that did not exec, say)."""
    models = tuple(models)
    out: dict[str, dict[int, int]] = {m: {} for m in models}
    out["tritonserver"] = {}
    children: dict[int, list[int]] = {}
    for pid, proc in procs.items():
        children.setdefault(proc.ppid, []).append(pid)
    todo = [(server_pid, None)] if server_pid in procs else []
    while todo:
        pid, stage = todo.pop()
        proc = procs[pid]
        if stage is None and any(a.endswith(STUB) for a in proc.args):
            stage = stage_of(proc.args, models)
            if stage is None:
                continue  # a stub of another model, and its children
        # a stub's children are its stage (core_process: on: the GPU stage's worker process)
        out[stage or "tritonserver"][pid] = proc.ticks
        todo += [(child, stage) for child in children.get(pid, [])]
    return out


def cpu_ms_per_request(
    before: Mapping[str, Mapping[int, int]], after: Mapping[str, Mapping[int, int]], requests: int, hz: float
) -> dict[str, Optional[float]]:
    """Host CPU of each stage over a phase per completed request (ms). A process that started
    during the phase counts from zero; one that ended is lost (its time cannot be read)."""
    out: dict[str, Optional[float]] = {}
    for stage, pids in after.items():
        if not pids:
            out[stage] = None
            continue
        ticks = sum(t - before.get(stage, {}).get(pid, 0) for pid, t in pids.items())
        out[stage] = round(1e3 * ticks / hz / requests, 3) if requests else None
    return out


def host_cpu_times(path: Path = Path("/proc/stat")) -> tuple[int, int]:
    """(busy, total) jiffies of all cores."""
    values = [int(v) for v in Path(path).read_text().splitlines()[0].split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return sum(values) - idle, sum(values)


class CpuMeter:
    """Snapshots of the stages' CPU (stubs of one server pid), the host's cores and this
    process's children (perf_analyzer). ``read`` and ``host`` are injectable for tests."""

    def __init__(
        self,
        server_pid: Optional[int],
        models: Iterable[str] = (FRONT, CORE),
        read: Callable[[], Mapping[int, Proc]] = read_processes,
        host: Optional[Callable[[], tuple[int, int]]] = host_cpu_times,
        hz: Optional[float] = None,
    ):
        self.server_pid, self.models, self.read, self.host = server_pid, tuple(models), read, host
        self.hz = hz or float(os.sysconf("SC_CLK_TCK"))

    def snapshot(self) -> dict:
        snap: dict = {"client": _children_cpu_s()}
        if self.server_pid is not None:
            try:
                snap["stages"] = stage_ticks(self.read(), self.server_pid, self.models)
            except OSError:
                pass
        if self.host is not None:
            try:
                snap["host"] = self.host()
            except (OSError, ValueError, IndexError):
                pass
        return snap

    def phase(self, before: Mapping, after: Mapping, requests: int) -> dict:
        out: dict = {}
        if "stages" in before and "stages" in after:
            out["cpu_ms_per_req"] = cpu_ms_per_request(before["stages"], after["stages"], requests, self.hz)
        if requests:
            out["client_cpu_ms_per_req"] = round(1e3 * (after["client"] - before["client"]) / requests, 3)
        if "host" in before and "host" in after:
            busy, total = after["host"][0] - before["host"][0], after["host"][1] - before["host"][1]
            if total > 0:
                out["host_cpu_busy_pct"] = round(100.0 * busy / total, 1)
                out["host_cores_busy"] = round(busy / total * (os.cpu_count() or 1), 1)
        return out


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class GpuSampler:
    """``nvidia-smi --query-gpu=index,utilization.gpu -lms 500`` in the background; ``mean``
    gives the busy share over a window (all GPUs' samples in it). Without nvidia-smi it
    stays empty and every mean is None."""

    def __init__(self, period_ms: int = 500, clock: Callable[[], float] = time.monotonic):
        self.period_ms, self.clock = period_ms, clock
        self.samples: list[tuple[float, int, float]] = []
        self.proc: Optional[subprocess.Popen] = None
        self.lock = threading.Lock()

    def start(self) -> "GpuSampler":
        exe = shutil.which("nvidia-smi")
        if exe is None:
            print("nvidia-smi not found: no GPU busy share", flush=True)
            return self
        cmd = [exe, "--query-gpu=index,utilization.gpu", "--format=csv,noheader,nounits", "-lms", str(self.period_ms)]
        try:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError as exc:
            print(f"nvidia-smi could not start ({exc}): no GPU busy share", flush=True)
            return self
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()
        return self

    def _read(self, stream) -> None:
        for line in stream:
            self.add_line(line)

    def add_line(self, line: str, at: Optional[float] = None) -> None:
        try:
            index, value = (part.strip() for part in line.split(","))
            sample = (self.clock() if at is None else at, int(index), float(value))
        except ValueError:  # "[N/A]", a header, a partial line
            return
        with self.lock:
            self.samples.append(sample)

    def mean(self, t0: float, t1: float) -> dict:
        with self.lock:
            window = [(i, v) for t, i, v in self.samples if t0 <= t <= t1]
        if not window:
            return {"gpu_busy_pct": None}
        out: dict = {"gpu_busy_pct": round(sum(v for _, v in window) / len(window), 1)}
        per = {}
        for index in sorted({i for i, _ in window}):
            values = [v for i, v in window if i == index]
            per[str(index)] = round(sum(values) / len(values), 1)
        if len(per) > 1:
            out["gpu_busy_pct_per_gpu"] = per
        return out

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()


# ---------------------------------------------------------------------------- provenance


def git_info(root: Path = ROOT) -> dict:
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
        status = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": os.environ.get("GIT_COMMIT"), "dirty": None}
    if commit.returncode != 0:  # a copy of the tree without .git
        return {"commit": os.environ.get("GIT_COMMIT"), "dirty": None}
    return {"commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip()) if status.returncode == 0 else None}


CODE_FOLDERS = ("manylora", "kernels", "model_repository")  # what the server runs


def code_sha(root: Path = ROOT) -> str:
    """The first 12 hex digits of a SHA-256 over the served code (every file under CODE_FOLDERS
    but caches, by path): it names the code a run measured where ``git`` cannot, as on the lent
    GPU host, whose copy of the tree keeps the git state of the session's start (the rows of
    sessions 18 and 19 carry that commit). ``--print-code-sha`` prints it for a checkout."""
    digest = hashlib.sha256()
    for folder in CODE_FOLDERS:
        files = sorted(p for p in (Path(root) / folder).rglob("*") if p.is_file())
        for path in files:
            if "__pycache__" in path.parts or path.suffix == ".pyc":
                continue
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def machine_info() -> dict:
    info = {"host": platform.node(), "python": platform.python_version(), "cpu_count": os.cpu_count()}
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch"] = torch.__version__
    exe = shutil.which("nvidia-smi")
    if exe:
        try:
            out = subprocess.run(
                [exe, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            ).stdout
            gpus = [line.strip() for line in out.splitlines() if line.strip()]
            if gpus:
                info["gpus"] = gpus
                info["gpu"] = gpus[0].split(",")[0].strip()
        except (OSError, subprocess.TimeoutExpired):
            pass
    return info


# ---------------------------------------------------------------------------- the summary


def _mode_label(row: Mapping) -> str:
    return row["mode"] if row["mode"] == "base" else f"lora-{row.get('distribution', '?')}"


def _load_key(row: Mapping) -> tuple:
    if row.get("load") == "open":
        return ("open", row.get("fraction"), None if row.get("fraction") is not None else row.get("rate"))
    return (row.get("load", "closed"), row.get("concurrency"))


def _load_label(row: Mapping) -> str:
    load = row.get("load", "closed")
    if load == "open":
        rate = row.get("asked_rate", row.get("rate"))
        frac = f"{100 * row['fraction']:.0f}% " if row.get("fraction") is not None else ""
        return f"open {frac}{rate:.0f}/s" + ("" if row.get("rate_ok", True) else " !")
    if load == "light":
        return f"light c={row.get('concurrency')}"
    return f"c={row.get('concurrency')}"


def _fmt(value, spec: str = ".1f", width: int = 7) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


def lora_base_ratio(row: Mapping, rows: list[Mapping]) -> Optional[tuple[float, str]]:
    """lora / base at the same load (same design, round and load): throughput for closed
    loop, p50 latency for open loop and light load (where the rate, not the server, sets req/s)."""
    if row["mode"] == "base":
        return None
    for other in rows:
        if (
            other["mode"] == "base"
            and other.get("design") == row.get("design")
            and other.get("round", 0) == row.get("round", 0)
            and _load_key(other) == _load_key(row)
        ):
            if row.get("load", "closed") == "closed":
                return (row["req_per_s"] / other["req_per_s"], "req/s") if other["req_per_s"] else None
            return (row["p50_ms"] / other["p50_ms"], "p50") if other["p50_ms"] else None
    return None


def summary_table(rows: list[Mapping]) -> str:
    head = (
        f"{'design':15s} {'mode':13s} {'load':18s} {'req/s':>8s} {'p50':>7s} {'p95':>7s} {'p99':>7s}"
        f" {'GPU%':>5s} {'front':>6s} {'core':>6s} {'batch':>6s} {'lora/base':>14s}"
    )
    lines = [
        "latency ms; GPU% = nvidia-smi busy share; front/core = host CPU ms per request of the gliner2 /"
        " gliner2_core stubs",
        "(single design: every stage in gliner2); batch = gliner2's mean dynamic batch; lora/base at the same"
        " load: req/s closed, p50 open/light; ! = rate not met",
        head,
        "-" * len(head),
    ]
    for row in rows:
        cpu = row.get("cpu_ms_per_req") or {}
        ratio = lora_base_ratio(row, rows)
        lines.append(
            f"{row.get('design', '?'):15s} {_mode_label(row):13s} {_load_label(row):18s}"
            f" {row['req_per_s']:8.1f} {_fmt(row['p50_ms'])} {_fmt(row['p95_ms'])} {_fmt(row['p99_ms'])}"
            f" {_fmt(row.get('gpu_busy_pct'), '.0f', 5)} {_fmt(cpu.get(FRONT), '.2f', 6)}"
            f" {_fmt(cpu.get(CORE), '.2f', 6)} {_fmt(row.get('mean_batch'), '.1f', 6)}"
            f" {(f'{ratio[0]:.3f} {ratio[1]}' if ratio else '-'):>14s}"
        )
    return "\n".join(lines + saturation_lines(rows))


def saturation_lines(rows: list[Mapping]) -> list[str]:
    """Each mode's saturation (best closed-loop req/s) per design, and the designs' ratio."""
    best: dict[tuple, dict[str, float]] = {}
    for row in rows:
        if row.get("load", "closed") == "closed":
            per = best.setdefault((_mode_label(row), row.get("round", 0)), {})
            per[row.get("design", "?")] = max(per.get(row.get("design", "?"), 0.0), row["req_per_s"])
    lines = []
    for (mode, round_), per in best.items():
        text = ", ".join(f"{design} {value:.1f}" for design, value in per.items())
        if per.get("single") and per.get("pipeline"):
            text += f" (pipeline / single {per['pipeline'] / per['single']:.3f})"
        lines.append(f"saturation req/s, {mode}{f' round {round_}' if round_ else ''}: {text}")
    return ["", *lines] if lines else []


# ---------------------------------------------------------------------------- the run


def estimate_s(args, n_modes: int, n_light: int) -> float:
    point = args.max_trials * args.interval_ms / 1e3 + PHASE_OVERHEAD_S
    warm = args.max_trials * args.warmup_ms / 1e3 + PHASE_OVERHEAD_S
    opens = len(args.open_fractions) + len(args.rates)
    per_mode = warm * (1 + opens * args.warmup_open) + point * (len(args.concurrency) + opens)
    return n_modes * per_mode + n_light * point


class Bench:
    """One design's measurements against one server: each phase writes a row."""

    def __init__(
        self,
        args,
        url: str,
        design: str,
        common: dict,
        cpu: CpuMeter,
        gpu: GpuSampler,
        t_start: float,
        metrics_url: Optional[str] = None,
    ):
        self.args, self.url, self.design, self.common = args, url, design, common
        self.metrics_url = metrics_url  # the GPU stage's call histograms (manylora_core_call_*)
        self.cpu, self.gpu, self.t_start = cpu, gpu, t_start
        self.rows: list[dict] = []
        self.failures = 0

    def out_of_time(self, seconds: float, what: str) -> bool:
        budget = self.args.time_budget_s
        if budget and time.monotonic() - self.t_start + seconds > budget:
            print(f"skipping {what}: it would end past --time-budget-s {budget:g}", flush=True)
            return True
        return False

    def warmup(self, data: Path, tag: str, rate: Optional[float] = None) -> None:
        """A discarded run: at the first closed-loop concurrency, or at an open-loop ``rate``
        (``--warmup-open``: each open loop's batch shapes have their CUDA graphs captured before
        it is measured, as in a server that has run at that load; the row still counts the
        captures made while measuring)."""
        if self.out_of_time(self.args.max_trials * self.args.warmup_ms / 1e3 + PHASE_OVERHEAD_S, f"{tag} warm-up"):
            return
        # adapters reach the caches, kernels compile, shapes are seen: discarded
        try:
            run_perf_analyzer(
                self.url,
                data,
                data.with_suffix(".warmup.csv"),
                concurrency=None if rate is not None else self.args.concurrency[0],
                rate=rate,
                interval_ms=self.args.warmup_ms,
                max_trials=self.args.max_trials,
                async_mode=not self.args.closed_sync,
                max_threads=self.args.max_threads,
                request_distribution=self.args.request_distribution,
            )
        except RuntimeError as exc:
            print(f"{self.design} {tag} warm-up: FAILED: {exc}", flush=True)
            self.failures += 1

    def measure(self, data: Path, mode: str, distribution, round_: int, load: str, **kw) -> Optional[dict]:
        """One perf_analyzer run; kw: concurrency=C or rate=R (+ fraction, saturation)."""
        a = self.args
        value = kw.get("concurrency") or kw.get("rate")
        tag = f"{self.design} {mode}{'-' + distribution if distribution else ''} {load} {value}"
        if self.out_of_time(a.max_trials * a.interval_ms / 1e3 + PHASE_OVERHEAD_S, tag):
            return None
        rate = kw.get("rate")
        if rate is not None and a.warmup_open:
            self.warmup(data, tag, rate=rate)
        calls0 = call_metrics(self.metrics_url)
        before, snap0, t0 = model_counts(self.url), self.cpu.snapshot(), time.monotonic()
        try:
            result = run_perf_analyzer(
                self.url,
                data,
                data.with_name(f"{data.stem}-{load}-{value}-{self.design}.csv"),
                concurrency=kw.get("concurrency"),
                rate=rate,
                interval_ms=a.interval_ms,
                max_trials=a.max_trials,
                async_mode=not a.closed_sync,
                max_threads=a.max_threads,
                request_distribution=a.request_distribution,
            )
        except RuntimeError as exc:  # one load failing (overload, a crash) still lets the rest report
            print(f"{tag}: FAILED: {exc}", flush=True)
            self.failures += 1
            return None
        t1, snap1, after = time.monotonic(), self.cpu.snapshot(), model_counts(self.url)
        stdout = result.pop("_stdout")
        counts = {**batch_stats(before, after), **call_stats(calls0, call_metrics(self.metrics_url))}
        row = {
            "design": self.design,
            "mode": mode,
            "distribution": distribution,
            "round": round_,
            "load": load,
            **{k: v for k, v in kw.items() if v is not None},
            **result,
            **counts,
            **self.gpu.mean(t0, t1),
            **self.cpu.phase(snap0, snap1, counts["requests"]),
            "phase_s": round(t1 - t0, 1),
        }
        for key in ("pa_warnings", "pa_delayed_requests"):
            if key in stdout:
                row[key] = stdout[key]
        if rate is not None:
            row.update(open_loop_result(rate, result, stdout, a.rate_tolerance))
            if not row["rate_ok"]:
                print(f"{tag}: {row['rate_warning']}", flush=True)
        row.update(self.common)
        row["adapters"] = self.common["adapters_available"] if mode == "lora" else 0
        self.rows.append(row)
        with open(a.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        cpu = row.get("cpu_ms_per_req") or {}
        print(
            f"{tag:>34s}: {row['req_per_s']:8.1f} req/s  p50 {row['p50_ms']:7.1f}  p95 {row['p95_ms']:7.1f}"
            f"  p99 {row['p99_ms']:7.1f} ms  batch {row['mean_batch']}/{row.get('core_rows_per_execute', '-')}"
            f"  GPU {row.get('gpu_busy_pct')}%  CPU ms/req {cpu.get(FRONT)}/{cpu.get(CORE)}"
            f"  core call {row.get('core_call_rows')} rows {row.get('core_call_ms')} ms"
            f" queue {row.get('core_queue_ms')} ms  graphs captured {row.get('core_graph_captures')}"
            f" ({row.get('core_capture_s')} s)",
            flush=True,
        )
        if row.get("core_phase_ms_per_call"):
            print(f"{'':>34s}  GPU stage ms per call: {row['core_phase_ms_per_call']}", flush=True)
        return row

    def run(self, datasets: list[tuple[str, Optional[str], int, Path]], light: set) -> None:
        a = self.args
        for mode, distribution, round_, data in datasets:
            tag = f"{mode}-{distribution}" if distribution else mode
            self.warmup(data, tag)
            closed = [self.measure(data, mode, distribution, round_, "closed", concurrency=c) for c in a.concurrency]
            closed = [r for r in closed if r is not None]
            saturation = max((r["req_per_s"] for r in closed), default=0.0)
            for fraction in a.open_fractions:
                if saturation <= 0:
                    print(f"no closed-loop saturation for {tag}: open loop skipped", flush=True)
                    break
                rate = round(fraction * saturation, 1)
                self.measure(
                    data, mode, distribution, round_, "open", rate=rate, fraction=fraction, saturation=saturation
                )
            for rate in a.rates:
                self.measure(data, mode, distribution, round_, "open", rate=rate)
            if (mode, distribution, round_) in light:
                self.measure(data, mode, distribution, round_, "light", concurrency=1)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="ManyLoRA server benchmark (tritonserver + perf_analyzer)")
    p.add_argument("--url", help="measure a running server (gRPC host:port) instead of starting one")
    p.add_argument("--server-pid", type=int, help="with --url: the local tritonserver's pid (CPU per stage)")
    p.add_argument("--metrics-url", help="with --url: its /metrics address (the GPU stage's call histograms)")
    p.add_argument("--checkpoint", type=Path)
    p.add_argument("--adapters", type=Path)
    p.add_argument("--adapters-in-flight", type=int, default=0, help="use the first N adapters (0 = all)")
    p.add_argument("--modes", nargs="+", default=["base", "lora"], help="repeat for rounds: base lora base lora")
    p.add_argument("--distributions", "--distribution", nargs="+", choices=["uniform", "zipf"], default=["uniform"])
    p.add_argument("--design", nargs="+", choices=DESIGNS, default=["pipeline"], help="one server each, in order")
    p.add_argument("--concurrency", type=int, nargs="+", default=[256, 512, 1024], help="closed-loop loads")
    p.add_argument("--open-fractions", type=float, nargs="*", default=[], help="open loop at these x saturation")
    p.add_argument("--rates", type=float, nargs="*", default=[], help="open loop at these request rates (req/s)")
    p.add_argument("--light-load", action="store_true", help="concurrency 1 for base and the first lora")
    p.add_argument("--rate-tolerance", type=float, default=0.05, help="achieved vs asked rate (fraction)")
    p.add_argument("--request-distribution", choices=["poisson", "constant"], default="poisson")
    p.add_argument("--max-threads", type=int, default=16, help="perf_analyzer threads (async)")
    p.add_argument("--closed-sync", action="store_true", help="closed loop with synchronous calls (one thread each)")
    # the repository layout
    p.add_argument("--front-instances", type=int, help="pipeline: gliner2 CPU fronts (default: committed)")
    p.add_argument("--front-max-batch", type=int)
    p.add_argument("--front-delay-us", type=int)
    p.add_argument("--front-inflight", type=int, help="pipeline: batches a front instance has in the GPU stage at once")
    p.add_argument("--core-instances", type=int, default=1, help="pipeline: gliner2_core instances per GPU")
    p.add_argument("--core-max-batch", type=int)
    p.add_argument("--core-delay-us", type=int)
    p.add_argument("--instances", type=int, default=4, help="single design: gliner2 GPU instances per GPU")
    p.add_argument("--max-batch", type=int, help="single design: gliner2 max_batch_size (default: committed)")
    p.add_argument("--delay-us", type=int, help="single design: gliner2 queue delay (default: committed)")
    p.add_argument("--gpus", default="", help='GPU instances on these GPUs, e.g. "0,1" (default: Triton places them)')
    # engine parameters
    p.add_argument("--gpu-slots", type=int, default=32)
    p.add_argument("--host-slots", type=int, default=128)
    p.add_argument("--max-rank", type=int, default=16)
    p.add_argument("--cpu-threads", default="auto", help="torch CPU threads per GPU instance (config cpu_threads)")
    p.add_argument("--max-request-tokens", type=int)
    p.add_argument("--max-batch-tokens", type=int)
    # timing
    p.add_argument("--requests", type=int, default=1024, help="distinct requests in the input data")
    p.add_argument("--interval-ms", type=int, default=4000)
    p.add_argument("--max-trials", type=int, default=3, help="perf_analyzer windows per load (>= 3)")
    p.add_argument("--warmup-ms", type=int, default=1000, help="window of the discarded warm-up run of each mode")
    p.add_argument(
        "--print-code-sha",
        action="store_true",
        help="print the served code's hash (the rows' code_sha) for this checkout and exit",
    )
    p.add_argument(
        "--warmup-open",
        action="store_true",
        help="also a discarded warm-up at each open-loop rate, right before it is measured",
    )
    p.add_argument("--time-budget-s", type=float, default=0, help="skip phases that would end past this (0 = none)")
    p.add_argument("--server-timeout-s", type=float, default=600)
    p.add_argument("--out", type=Path, required=True)
    return p


def engine_parameters(args) -> dict[str, str]:
    params = {
        "checkpoint": str(args.checkpoint.resolve()),
        "max_gpu_adapters": str(args.gpu_slots),
        "cpu_threads": args.cpu_threads,
        "max_cpu_adapters": str(max(args.host_slots, args.gpu_slots)),
        "max_lora_rank": str(args.max_rank),
    }
    if args.adapters:
        params["adapter_dir"] = str(args.adapters.resolve())
        params["preload_adapters"] = "all"  # steady state: the fleet is resident before traffic
    if args.max_request_tokens:
        params["max_request_tokens"] = str(args.max_request_tokens)
    if args.max_batch_tokens:
        params["max_batch_tokens"] = str(args.max_batch_tokens)
    return params


def layout_of(args, design: str) -> Layout:
    return Layout(
        design=design,
        front_instances=args.front_instances,
        front_max_batch=args.front_max_batch,
        front_delay_us=args.front_delay_us,
        front_inflight=args.front_inflight,
        core_instances=args.core_instances,
        core_max_batch=args.core_max_batch,
        core_delay_us=args.core_delay_us,
        instances=args.instances,
        max_batch=args.max_batch,
        delay_us=args.delay_us,
        gpus=args.gpus,
    )


def datasets_of(args, work: Path, names: list[str]) -> tuple[list, set]:
    """(mode, distribution, round, input data) per measured mode, and which get light load."""
    out, seen, light = [], {}, set()
    for mode in args.modes:
        round_ = seen.get(mode, 0)
        seen[mode] = round_ + 1
        for distribution in [None] if mode == "base" else args.distributions:
            path = work / f"{mode}{'-' + distribution if distribution else ''}.json"
            if not path.exists():
                make_input_data(path, args.requests, names if mode == "lora" else [], distribution or "uniform")
            out.append((mode, distribution, round_, path))
            if args.light_load and distribution in (None, args.distributions[0]):
                light.add((mode, distribution, round_))
    return out, light


def main(argv=None) -> int:
    # a stage timeout (SIGTERM) still stops the server, keeps its log and prints the table (finally)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if "--print-code-sha" in (sys.argv[1:] if argv is None else argv):
        print(code_sha())
        return 0
    args = build_parser().parse_args(argv)
    if args.max_trials < 3:
        raise SystemExit("--max-trials must be >= 3 (perf_analyzer's stability check needs 3 windows)")
    if args.url is None and args.checkpoint is None:
        raise SystemExit("give --checkpoint (start a server) or --url (measure a running one)")
    t_start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="manylora-server-bench-"))
    names = adapter_names(args.adapters)
    if args.adapters_in_flight:
        names = names[: args.adapters_in_flight]
    datasets, light = datasets_of(args, work, names)
    designs = ["external"] if args.url else args.design
    estimate = len(designs) * estimate_s(args, len(datasets), len(light))
    starts = 0 if args.url else len(designs) * SERVER_START_S
    print(
        f"{len(datasets)} mode(s) x {len(designs)} design(s): ~{estimate:.0f} s of measurement"
        + (f" + ~{starts:.0f} s of server starts (~{estimate + starts:.0f} s in all)" if starts else ""),
        flush=True,
    )
    common_base = {
        "command": shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(["bench_server.py", *argv]),
        **git_info(),
        "code_sha": code_sha(),
        "machine": machine_info(),
        "adapters_available": len(names),
        "gpu_slots": args.gpu_slots,
        "host_slots": args.host_slots,
        "requests_in_data": args.requests,
        "interval_ms": args.interval_ms,
        "max_trials": args.max_trials,
        "closed_async": not args.closed_sync,  # open loop: always async
        "max_threads": args.max_threads,
        "request_distribution": args.request_distribution,
    }
    gpu = GpuSampler().start()
    rows: list[dict] = []
    failures = 0
    try:
        for turn, design in enumerate(designs):  # a design may come again (alternated A/B rounds)
            server, url, log = None, args.url, work / f"tritonserver-{design}-{turn}.log"
            left = args.time_budget_s - (time.monotonic() - t_start)
            if args.time_budget_s and url is None and left < 90:
                print(f"skipping the {design} design: {left:.0f} s left of --time-budget-s", flush=True)
                continue
            try:
                if url is None:
                    from manylora.tritonserver import TritonServer

                    layout = layout_of(args, design)
                    repo = bench_repository(work / f"repo-{design}-{turn}", engine_parameters(args), layout)
                    summary = repository_summary(repo)
                    server = TritonServer(repo, log_file=log)
                    print(f"starting tritonserver ({design}): {json.dumps(summary)}", flush=True)
                    t0 = time.monotonic()
                    try:
                        server.start(timeout=args.server_timeout_s)
                    except Exception as exc:  # failed or timed out while loading: the log (kept below) says why
                        print(f"the {design} server did not start: {exc}\n{server.log_tail()}", flush=True)
                        failures += 1
                        continue
                    start_s = round(time.monotonic() - t0, 1)
                    print(f"server ready in {start_s} s", flush=True)
                    url, pid, metrics_url = server.grpc_url, server.process.pid, server.metrics_url
                    knobs = asdict(layout)
                else:
                    summary, start_s, pid, metrics_url = server_summary(url), None, args.server_pid, args.metrics_url
                    design = design_of(summary)
                    knobs = {"design": design}
                common = {
                    **common_base,
                    "design": design,
                    "layout": knobs,
                    "repository": summary,
                    "server_start_s": start_s,
                    "gpus": args.gpus or "default",
                }
                if design == "single":
                    common["instances"] = summary.get(FRONT, {}).get("instance_group", [{}])[0].get("count")
                bench = Bench(args, url, design, common, CpuMeter(pid), gpu, t_start, metrics_url)
                try:
                    bench.run(datasets, light)
                finally:
                    rows += bench.rows
                    failures += bench.failures
            finally:
                if server is not None:
                    server.stop()
                if log.is_file():
                    shutil.copy(log, args.out.with_suffix(f".{design}{f'-{turn}' if turn else ''}.tritonserver.log"))
    finally:
        gpu.stop()
        if rows:
            print("\n" + summary_table(rows), flush=True)
        print(f"bench_server: {time.monotonic() - t_start:.0f} s in all", flush=True)
    if failures:
        print(f"{failures} phase(s) failed", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
