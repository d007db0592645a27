"""Server benchmark: the real tritonserver + perf_analyzer, GLiNER2 requests with a random adapter each.

Writes perf_analyzer ``--input-data`` JSON (per-request TEXT, SCHEMA, ADAPTER_ID drawn
like the engine benchmark: uniform or Zipf over N adapters, or none for the no-LoRA
base), then sweeps concurrency (closed loop) and, optionally, request rates (open loop)
and reports throughput with p50/p95/p99 latency from perf_analyzer's CSV.

    # start a server on a copy of model_repository/gliner2 with these settings, then measure
    python perf/bench_server.py --checkpoint models/demo-base --adapters models/bench-adapters \\
        --instances 4 --gpu-slots 1024 --concurrency 64 128 256 --out perf/results/server.jsonl
    # measure a server that is already running
    python perf/bench_server.py --url localhost:8001 --adapters models/demo-tiny-adapters --out ...
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_engine import ENTITY_SCHEMA, machine, pick_adapters  # same request distributions as the engine benchmark

REPO_MODEL = Path(__file__).resolve().parents[1] / "model_repository" / "gliner2"


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
        }
        for text, adapter in zip(texts, chosen)
    ]
    path.write_text(json.dumps({"data": data}))
    return path


def bench_repository(
    dst: Path, parameters: dict[str, str], instances: int, max_batch: int, delay_us: int, gpus: str = ""
) -> Path:
    """A copy of model_repository/gliner2 with the benchmark's settings; ``gpus`` ("0,1"):
    ``instances`` instances on each of these GPUs, each with its own adapter caches."""
    model = dst / "gliner2"
    shutil.copytree(REPO_MODEL, model, ignore=shutil.ignore_patterns("__pycache__"))
    config = (model / "config.pbtxt").read_text()
    config = re.sub(r"max_batch_size: \d+", f"max_batch_size: {max_batch}", config)
    config = re.sub(r"max_queue_delay_microseconds: \d+", f"max_queue_delay_microseconds: {delay_us}", config)
    group = f"count: {instances}" + (f"\n    kind: KIND_GPU\n    gpus: [ {gpus.replace(',', ', ')} ]" if gpus else "")
    config = re.sub(r"count: \d+", group, config)
    config = re.sub(r"parameters \{.*", "", config, flags=re.S)  # replaced below
    for key, value in parameters.items():
        config += f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n'
    (model / "config.pbtxt").write_text(config)
    return dst


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


def server_counts(url: str) -> tuple[int, int]:
    """(requests, model executions) the server has run for gliner2 so far: their deltas over a
    measurement give the mean dynamic batch size."""
    import tritonclient.grpc as grpcclient

    stats = grpcclient.InferenceServerClient(url).get_inference_statistics("gliner2", as_json=True)
    model = stats["model_stats"][0]
    return int(model.get("inference_count", 0)), int(model.get("execution_count", 0))


def run_perf_analyzer(
    url: str,
    data: Path,
    csv_path: Path,
    *,
    concurrency: int | None = None,
    rate: float | None = None,
    interval_ms: int = 8000,
    protocol: str = "grpc",
) -> dict:
    cmd = [
        shutil.which("perf_analyzer") or str(Path(sys.prefix) / "bin" / "perf_analyzer"),
        "-m",
        "gliner2",
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
        "999",
        "--max-trials",
        "3",
    ]
    cmd += ["--concurrency-range", str(concurrency)] if concurrency else ["--request-rate-range", str(rate)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=perf_analyzer_env())
    if proc.returncode != 0:
        raise RuntimeError(f"perf_analyzer failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    with open(csv_path) as f:
        row = next(csv.DictReader(f))
    return {
        "req_per_s": float(row["Inferences/Second"]),
        "p50_ms": float(row["p50 latency"]) / 1e3,
        "p95_ms": float(row["p95 latency"]) / 1e3,
        "p99_ms": float(row["p99 latency"]) / 1e3,
        "avg_queue_ms": float(row.get("Server Queue", 0)) / 1e3,
        "avg_compute_ms": (
            float(row.get("Server Compute Input", 0))
            + float(row.get("Server Compute Infer", 0))
            + float(row.get("Server Compute Output", 0))
        )
        / 1e3,
    }


def main(argv=None) -> int:
    # a stage timeout (SIGTERM) still stops the server and keeps its log (the finally below)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    p = argparse.ArgumentParser(description="ManyLoRA server benchmark (tritonserver + perf_analyzer)")
    p.add_argument("--url", help="measure a running server (gRPC host:port) instead of starting one")
    p.add_argument("--checkpoint", type=Path)
    p.add_argument("--adapters", type=Path)
    p.add_argument("--adapters-in-flight", type=int, default=0, help="use the first N adapters (0 = all)")
    p.add_argument("--modes", nargs="+", default=["base", "lora"])
    p.add_argument("--distribution", choices=["uniform", "zipf"], default="uniform")
    p.add_argument("--concurrency", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--rates", type=float, nargs="*", default=[], help="open-loop request rates (req/s)")
    p.add_argument("--instances", type=int, default=1, help="instances per GPU")
    p.add_argument("--gpus", default="", help='instance group GPUs, e.g. "0,1" (default: Triton places them)')
    p.add_argument("--gpu-slots", type=int, default=32)
    p.add_argument("--host-slots", type=int, default=128)
    p.add_argument("--max-rank", type=int, default=16)
    p.add_argument("--cpu-threads", default="auto", help="torch CPU threads per instance (config cpu_threads)")
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("--delay-us", type=int, default=2000)
    p.add_argument("--requests", type=int, default=2048, help="distinct requests in the input data")
    p.add_argument("--interval-ms", type=int, default=8000)
    p.add_argument("--warmup-ms", type=int, default=5000, help="measurement window of the discarded warm-up run")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="manylora-server-bench-"))
    names = adapter_names(args.adapters)
    if args.adapters_in_flight:
        names = names[: args.adapters_in_flight]
    server = None
    url = args.url
    if url is None:
        from manylora.tritonserver import TritonServer

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
        repo = bench_repository(work / "repo", params, args.instances, args.max_batch, args.delay_us, args.gpus)
        server = TritonServer(repo, log_file=work / "tritonserver.log")
        print(f"starting tritonserver: {args.instances} instance(s) per GPU, {len(names)} adapters", flush=True)
        try:
            server.start(timeout=900)
        except BaseException:  # failed or timed out while loading: keep the log to see why
            server.stop()
            if (work / "tritonserver.log").is_file():
                shutil.copy(work / "tritonserver.log", args.out.with_suffix(".tritonserver.log"))
            raise
        print("server ready", flush=True)
        url = server.grpc_url
    rows = []
    try:
        for mode in args.modes:
            data = make_input_data(
                work / f"{mode}.json", args.requests, names if mode == "lora" else [], args.distribution
            )
            # warm-up pass (discarded): adapters reach the caches, kernels compile, shapes are seen
            run_perf_analyzer(
                url, data, work / f"{mode}-warmup.csv", concurrency=args.concurrency[0], interval_ms=args.warmup_ms
            )
            loads = [("concurrency", c) for c in args.concurrency] + [("rate", r) for r in args.rates]
            for kind, value in loads:
                before = server_counts(url)
                result = run_perf_analyzer(
                    url,
                    data,
                    work / f"{mode}-{kind}-{value}.csv",
                    concurrency=value if kind == "concurrency" else None,
                    rate=value if kind == "rate" else None,
                    interval_ms=args.interval_ms,
                )
                after = server_counts(url)
                executions = after[1] - before[1]
                result["mean_batch"] = round((after[0] - before[0]) / executions, 1) if executions else None
                row = {
                    "mode": mode,
                    kind: value,
                    "adapters": len(names) if mode == "lora" else 0,
                    "distribution": args.distribution,
                    "instances": args.instances,
                    "gpus": args.gpus or "default",
                    "gpu_slots": args.gpu_slots,
                    **result,
                    "machine": machine(),
                }
                rows.append(row)
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
                print(
                    f"{mode:5s} {kind} {value:>7}: {result['req_per_s']:9.1f} req/s  p50 {result['p50_ms']:7.1f}"
                    f"  p95 {result['p95_ms']:7.1f}  p99 {result['p99_ms']:7.1f} ms  mean batch {result['mean_batch']}",
                    flush=True,
                )
    finally:
        if server is not None:
            server.stop()
        if (work / "tritonserver.log").is_file():
            shutil.copy(work / "tritonserver.log", args.out.with_suffix(".tritonserver.log"))
    best = {m: max((r["req_per_s"] for r in rows if r["mode"] == m), default=0.0) for m in args.modes}
    if best.get("base") and best.get("lora"):
        print(f"\nlora / base (best throughput): {best['lora'] / best['base']:.3f}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
