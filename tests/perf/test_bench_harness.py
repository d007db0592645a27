"""The benchmark harnesses produce well-formed results (speed is never asserted here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PERF = Path(__file__).resolve().parents[2] / "perf"
sys.path.insert(0, str(PERF))

import bench_server  # noqa: E402
from manylora.client import protocol  # noqa: E402


def test_engine_benchmark_smoke_writes_every_mode(tmp_path):
    out = tmp_path / "engine.jsonl"
    modes = ["base", "manylora", "hotswap", "peft-mixed"]
    proc = subprocess.run(
        [sys.executable, str(PERF / "bench_engine.py"), "--smoke", "--modes", *modes, "--peft-mixed-max", "1"]
        + ["--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    gemm = [r for r in lines if r["mode"] == "gemm_rate"]
    assert len(gemm) == 1, "the GEMM rate is measured once per run"
    assert gemm[0]["tflops"] > 0 and gemm[0]["gemm_dtype"] == "torch.float32" and gemm[0]["device"] == "cpu"
    rows = [r for r in lines if r["mode"] != "gemm_rate"]
    assert {r["mode"] for r in rows} == set(modes)
    base = next(r for r in rows if r["mode"] == "base")
    for row in rows:
        assert row["requests"] > 0 and row["req_per_s"] > 0 and row["errors"] == 0
        assert row["batch_p50_ms"] <= row["batch_p95_ms"] <= row["batch_p99_ms"]
        assert row["machine"]["torch"] and row["device"] == "cpu"
        assert row["flops_per_request"] > 0 and row["tokens_per_request"] > 0
        assert row["achieved_tflops"] == pytest.approx(row["flops_per_request"] * row["req_per_s"] / 1e12)
        assert row["fraction_of_gemm_rate"] == pytest.approx(row["achieved_tflops"] / gemm[0]["tflops"])
        if row["mode"] != "base":
            assert row["bytes_per_adapter"] > 0
            assert row["flops_per_request"] > base["flops_per_request"], "LoRA adds FLOPs to the base request"
    mixed = [r for r in rows if r["mode"] == "peft-mixed"]
    assert [r["adapters_in_flight"] for r in mixed] == [1], "peft-mixed stops at --peft-mixed-max"
    assert mixed[0]["peft_resident"] == 1 and set(mixed[0]["split_s"]) == {"pre", "core", "post"}
    assert "skipping peft-mixed at 4 adapters in flight" in proc.stderr
    assert "TFLOP/s" in proc.stdout and "of GEMM" in proc.stdout
    assert "x hotswap" in proc.stdout and "x peft-mixed" in proc.stdout, "the ratio table is printed last"


def test_engine_benchmark_interleaved_rounds(tmp_path):
    """--interleave: base and every manylora case per round, each with its answers counted; the
    --profile tables name every case of every round."""
    out, profile = tmp_path / "engine.jsonl", tmp_path / "profile.txt"
    proc = subprocess.run(
        [sys.executable, str(PERF / "bench_engine.py"), "--smoke", "--modes", "base", "manylora", "--interleave"]
        + ["--rounds", "2", "--profile", str(profile), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r for r in map(json.loads, out.read_text().splitlines()) if r["mode"] != "gemm_rate"]
    cases = [(r["round"], r["mode"], r.get("adapters_in_flight")) for r in rows]
    assert cases == [(n, m, k) for n in (0, 1) for m, k in (("base", None), ("manylora", 1), ("manylora", 4))]
    for row in rows:
        assert row["interleaved"] and row["errors"] == 0 and row["requests"] == 16  # 2 timed batches of 8
        assert row["found_per_request"] > 0 and row["cpu_ms_per_request"] > 0
    for row in rows:  # the largest pool was made resident first: no load while a case was timed
        assert row["mode"] == "base" or (row["loads"] and not any(row["loads"].values())), row.get("loads")
    tables = profile.read_text()
    for n in (0, 1):
        for tag in ("base", "manylora 1 uniform", "manylora 4 uniform"):
            assert f"==== {tag} (round {n})" in tables
    assert "median" in proc.stdout and "process CPU per request x base" in proc.stdout
    assert all(len(r["batch_ms"]) == 2 for r in rows) and "paired batches: median" in proc.stdout


def test_ratio_summary_pairs_batches_of_one_round():
    """Paired ratios: base's latency over the case's for the same batch index, pooled over rounds."""
    import bench_engine

    def row(mode, round_, req_per_s, batch_ms, k=None):
        extra = {} if mode == "base" else {"adapters_in_flight": k, "distribution": "uniform"}
        common = {"cpu_ms_per_request": 1.0, "interleaved": True}
        return {"mode": mode, "round": round_, "req_per_s": req_per_s, "batch_ms": batch_ms, **extra, **common}

    rows = [
        row("base", 0, 100.0, [10.0, 20.0]),
        row("manylora", 0, 80.0, [12.5, 25.0], k=8),  # 0.8 on both batches
        row("base", 1, 50.0, [40.0, 40.0]),  # a slow round: drift cancels within pairs
        row("manylora", 1, 40.0, [50.0, 50.0], k=8),
    ]
    (line,) = bench_engine.ratio_summary(rows)
    assert "median 0.800" in line and "paired batches: median 0.800 of 4" in line


def test_found_counts_the_items_of_an_answer():
    from bench_engine import _found

    assert _found({"entities": {"person": ["Ann", "Bo"], "date": []}}) == 2
    assert _found({"entities": {"person": [{"text": "Ann", "confidence": 0.9}]}}) == 1
    assert _found({"sentiment": "positive"}) == 1 and _found({"sentiment": ""}) == 0
    assert _found({"relation_extraction": {"works_for": [("Ann", "Acme"), ("Bo", "Zed")]}}) == 2
    assert _found({"product": [{"name": "X", "price": 3}, {"name": "Y", "price": 4}]}) == 2


def test_perf_analyzer_input_data(tmp_path):
    names = [f"adapter-{i:05d}" for i in range(50)]
    path = bench_server.make_input_data(tmp_path / "data.json", 64, names, "zipf", seed=3)
    data = json.loads(path.read_text())["data"]
    assert len(data) == 64
    for entry in data:
        assert set(entry) == {spec.name for spec in protocol.INPUTS}, "every input, as the client sends them"
        assert all(value["shape"] == [1] and len(value["content"]) == 1 for value in entry.values())
        assert entry["ADAPTER_ID"]["content"][0] in names
        json.loads(entry["SCHEMA"]["content"][0])
    chosen = [e["ADAPTER_ID"]["content"][0] for e in data]
    assert chosen.count(names[0]) > chosen.count(names[-1]), "Zipf favours the first adapters"
    base = json.loads(bench_server.make_input_data(tmp_path / "b.json", 8, [], "uniform").read_text())["data"]
    assert all(e["ADAPTER_ID"]["content"] == [""] for e in base)


# ---------------------------------------------------------------------------- bench_server pieces (no server)


def _parse_config(path: Path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def _params(config) -> dict:
    return {k: v.string_value for k, v in config.parameters.items()}


def _engine_config(config):
    """What the model's instance builds from its config (Triton hands it the JSON form)."""
    from google.protobuf import json_format

    from manylora.config import EngineConfig

    return EngineConfig.from_model_config(json_format.MessageToDict(config, preserving_proto_field_name=True))


@pytest.fixture
def engine_params(tmp_path):
    checkpoint, adapters = tmp_path / "ckpt", tmp_path / "adapters"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    adapters.mkdir()
    return {
        "checkpoint": str(checkpoint),
        "adapter_dir": str(adapters),
        "preload_adapters": "all",
        "max_gpu_adapters": "1024",
        "max_cpu_adapters": "1024",
        "max_lora_rank": "16",
        "cpu_threads": "auto",
        "max_request_tokens": "512",
    }


def test_bench_repository_pipeline_routes_engine_parameters_to_the_core(tmp_path, engine_params):
    from tritonclient.grpc import model_config_pb2

    layout = bench_server.Layout(
        design="pipeline", front_instances=6, front_max_batch=128, front_delay_us=500, core_max_batch=32
    )
    repo = bench_server.bench_repository(tmp_path / "repo", engine_params, layout)
    assert sorted(p.name for p in repo.iterdir()) == ["gliner2", "gliner2_core"]
    front, core = (
        _parse_config(repo / "gliner2" / "config.pbtxt"),
        _parse_config(repo / "gliner2_core" / "config.pbtxt"),
    )
    assert (repo / "gliner2" / "1" / "model.py").is_file() and (repo / "gliner2_core" / "1" / "model.py").is_file()
    assert _params(front) == {
        "checkpoint": engine_params["checkpoint"],
        "core_model": "gliner2_core",
        "max_request_tokens": "512",
    }
    assert _params(core) == engine_params, "every engine parameter goes to the GPU stage"
    kind = model_config_pb2.ModelInstanceGroup
    assert [(g.count, g.kind) for g in front.instance_group] == [(6, kind.KIND_CPU)]
    assert [(g.count, g.kind, list(g.gpus)) for g in core.instance_group] == [(1, kind.KIND_AUTO, [])]
    assert (front.max_batch_size, front.dynamic_batching.max_queue_delay_microseconds) == (128, 500)
    committed = _parse_config(bench_server.REPO / "gliner2_core" / "config.pbtxt")
    assert core.max_batch_size == 32
    assert core.dynamic_batching.max_queue_delay_microseconds == committed.dynamic_batching.max_queue_delay_microseconds
    assert [i.name for i in core.input] == [i.name for i in committed.input] and core.backend == "python"
    assert all(i.allow_ragged_batch for i in core.input), "the rest of the committed config is kept"
    # the engine accepts what each model was given (no unknown or misrouted parameter)
    assert _engine_config(front).core_model == "gliner2_core"
    engine = _engine_config(core)
    assert (engine.max_gpu_adapters, engine.max_request_tokens, engine.preload_adapters) == (1024, 512, "all")
    summary = bench_server.repository_summary(repo)
    assert bench_server.design_of(summary) == "pipeline"
    assert summary["gliner2"]["instance_group"] == [{"count": 6, "kind": "KIND_CPU"}]


def test_bench_repository_pipeline_serial_turns_the_core_overlap_off(tmp_path, engine_params):
    repo = bench_server.bench_repository(
        tmp_path / "repo", engine_params, bench_server.Layout(design="pipeline-serial")
    )
    core = _parse_config(repo / "gliner2_core" / "config.pbtxt")
    assert _params(core) == {**engine_params, "core_overlap": "off"}
    assert not core.model_transaction_policy.decoupled, "one response per request, through its sender"
    assert _engine_config(core).core_overlap is False
    assert bench_server.design_of(bench_server.repository_summary(repo)) == "pipeline-serial"
    committed = bench_server.bench_repository(tmp_path / "on", engine_params, bench_server.Layout(design="pipeline"))
    assert _engine_config(_parse_config(committed / "gliner2_core" / "config.pbtxt")).core_overlap is True


def test_bench_repository_core_on_listed_gpus(tmp_path, engine_params):
    layout = bench_server.Layout(design="pipeline", core_instances=2, gpus="0,1")
    repo = bench_server.bench_repository(tmp_path / "repo", engine_params, layout)
    core = _parse_config(repo / "gliner2_core" / "config.pbtxt")
    (group,) = core.instance_group
    assert (group.count, list(group.gpus)) == (2, [0, 1]) and group.kind == group.KIND_GPU
    front = _parse_config(repo / "gliner2" / "config.pbtxt")
    committed = _parse_config(bench_server.REPO / "gliner2" / "config.pbtxt")
    assert front.instance_group[0].count == committed.instance_group[0].count, "None keeps the committed count"
    assert not front.instance_group[0].gpus


def test_bench_repository_single_design_holds_the_engine_in_gliner2(tmp_path, engine_params):
    layout = bench_server.Layout(design="single", instances=3, max_batch=64, delay_us=1000, gpus="0")
    repo = bench_server.bench_repository(tmp_path / "repo", engine_params, layout)
    assert [p.name for p in repo.iterdir()] == ["gliner2"], "no GPU stage model in the single design"
    config = _parse_config(repo / "gliner2" / "config.pbtxt")
    assert _params(config) == {**engine_params, "core_model": "none"}
    (group,) = config.instance_group
    assert (group.count, group.kind, list(group.gpus)) == (3, group.KIND_GPU, [0])
    assert (config.max_batch_size, config.dynamic_batching.max_queue_delay_microseconds) == (64, 1000)
    assert _engine_config(config).core_model == "" and _engine_config(config).max_gpu_adapters == 1024
    assert bench_server.design_of(bench_server.repository_summary(repo)) == "single"
    with pytest.raises(ValueError):
        bench_server.bench_repository(tmp_path / "bad", engine_params, bench_server.Layout(design="other"))


def test_cli_routes_knobs_to_the_layout(tmp_path):
    args = bench_server.build_parser().parse_args(
        ["--checkpoint", str(tmp_path), "--out", str(tmp_path / "o.jsonl"), "--front-instances", "5"]
        + ["--core-max-batch", "16", "--design", "single", "pipeline", "--distributions", "uniform", "zipf"]
    )
    assert args.design == ["single", "pipeline"] and args.distributions == ["uniform", "zipf"]
    layout = bench_server.layout_of(args, "pipeline")
    assert (layout.front_instances, layout.core_max_batch, layout.core_instances) == (5, 16, 1)
    params = bench_server.engine_parameters(args)
    assert "adapter_dir" not in params and params["max_cpu_adapters"] == "128"
    defaults = bench_server.build_parser().parse_args(["--out", "x"])
    assert (defaults.interval_ms, defaults.max_trials, defaults.requests) == (4000, 3, 1024)


PA_HEADER = (
    "{first},Inferences/Second,Client Send,Network+Server Send/Recv,Server Queue,Server Compute Input,"
    "Server Compute Infer,Server Compute Output,Client Recv,p50 latency,p90 latency,p95 latency,p99 latency\n"
)


def _pa_csv(first: str, value: float, throughput: float) -> str:
    return (
        PA_HEADER.format(first=first) + f"{value},{throughput},10,200,3000,40,90000,30,5,95000,120000,150000,210000\n"
    )


def test_perf_analyzer_csv_and_rate_check():
    parsed = bench_server.parse_perf_csv(_pa_csv("Request Rate", 1400, 213.4))
    assert parsed["asked_rate"] == 1400.0 and parsed["req_per_s"] == 213.4
    assert (parsed["p50_ms"], parsed["p95_ms"], parsed["p99_ms"]) == (95.0, 150.0, 210.0)
    assert parsed["avg_queue_ms"] == 3.0 and parsed["avg_compute_ms"] == pytest.approx(90.07)
    result = bench_server.open_loop_result(1400.0, parsed, {}, 0.05)
    assert result["rate_ok"] is False and result["achieved_rate"] == 213.4 and result["asked_rate"] == 1400.0
    assert result["rate_warning"].startswith("WARNING") and "1400.0" in result["rate_warning"]
    assert bench_server.rate_check(1000.0, 960.0) == (True, "")
    assert bench_server.rate_check(1000.0, 1040.0)[0] and not bench_server.rate_check(1000.0, 940.0)[0]
    closed = bench_server.parse_perf_csv(_pa_csv("Concurrency", 256, 1800.0))
    assert "asked_rate" not in closed and closed["concurrency_reported"] == 256
    stdout = bench_server.parse_perf_stdout(
        "Request Rate: 1400, throughput: 213.4 infer/sec, latency 95000 usec\n"
        "WARNING: Perf Analyzer is not able to keep up with the desired load.\n"
        "    Delayed Request Count: 12\n    Delayed Request Count: 40\n"
    )
    assert stdout["pa_delayed_requests"] == 40
    assert (stdout["asked_rate"], stdout["achieved_rate"]) == (1400.0, 213.4) and len(stdout["pa_warnings"]) == 1
    # without a CSV rate (an older perf_analyzer), the summary line and the argument stand in
    fallback = bench_server.open_loop_result(700.0, {"req_per_s": 690.0}, stdout, 0.05)
    assert fallback["asked_rate"] == 1400.0 and fallback["rate_ok"] is False


def test_perf_analyzer_command_is_async_for_request_rates(tmp_path):
    cmd = bench_server.perf_analyzer_command("h:1", tmp_path / "d.json", tmp_path / "o.csv", rate=1234.5)
    assert cmd[cmd.index("--request-rate-range") + 1] == "1234.5" and "--async" in cmd
    assert int(cmd[cmd.index("--max-threads") + 1]) >= 16 and cmd[cmd.index("--request-distribution") + 1] == "poisson"
    closed = bench_server.perf_analyzer_command("h:1", tmp_path / "d.json", tmp_path / "o.csv", concurrency=512)
    assert closed[closed.index("--concurrency-range") + 1] == "512:512" and "--request-rate-range" not in closed
    sync = bench_server.perf_analyzer_command("h:1", tmp_path / "d", tmp_path / "o", concurrency=8, async_mode=False)
    assert "--async" not in sync and "--max-threads" not in sync
    with pytest.raises(ValueError):
        bench_server.perf_analyzer_command("h:1", tmp_path / "d", tmp_path / "o")


def _fake_perf_analyzer(monkeypatch, counts, achieved):
    """perf_analyzer and the server's statistics, faked: closed loop gives 10 req/s per
    concurrent request, a request rate gives achieved(asked)."""
    import subprocess

    real_run = subprocess.run

    def fake_run(cmd, **kwargs):
        if "perf_analyzer" not in cmd[0]:  # git, nvidia-smi
            return real_run(cmd, **kwargs)
        out = Path(cmd[cmd.index("-f") + 1])
        if "--request-rate-range" in cmd:
            asked = float(cmd[cmd.index("--request-rate-range") + 1])
            out.write_text(_pa_csv("Request Rate", asked, achieved(asked)))
            stdout = f"Request Rate: {asked}, throughput: {achieved(asked)} infer/sec\n"
        else:
            c = int(cmd[cmd.index("--concurrency-range") + 1].split(":")[0])
            out.write_text(_pa_csv("Concurrency", c, 10.0 * c))
            stdout = ""
        return subprocess.CompletedProcess(cmd, 0, stdout, "")

    monkeypatch.setattr(bench_server.subprocess, "run", fake_run)
    monkeypatch.setattr(bench_server, "model_counts", lambda url: next(counts))


def _bench(tmp_path, monkeypatch, counts, achieved):
    """A Bench whose perf_analyzer and server statistics are fakes."""
    _fake_perf_analyzer(monkeypatch, counts, achieved)
    args = bench_server.build_parser().parse_args(
        ["--url", "h:1", "--out", str(tmp_path / "out.jsonl"), "--concurrency", "100", "200"]
        + ["--open-fractions", "0.35", "0.7", "--light-load", "--warmup-ms", "10"]
    )
    cpu = bench_server.CpuMeter(None, host=None)
    gpu = bench_server.GpuSampler()
    common = {"adapters_available": 4, "commit": "abc1234", "dirty": True}
    return bench_server.Bench(args, "h:1", "pipeline", common, cpu, gpu, 0.0), args


def test_bench_open_loop_rows_record_asked_and_achieved_rates(tmp_path, monkeypatch, capsys):
    def counter():
        n = 0
        while True:
            yield {"gliner2": {"inference": 100 * n, "execution": 10 * n}, "gliner2_core": {"execution": 5 * n}}
            n += 1

    bench, args = _bench(tmp_path, monkeypatch, counter(), achieved=lambda asked: 500.0 if asked > 1000 else asked)
    data = tmp_path / "base.json"
    data.write_text("{}")
    bench.run([("lora", "uniform", 0, data)], light={("lora", "uniform", 0)})
    rows = [json.loads(line) for line in args.out.read_text().splitlines()]
    assert [(r["load"], r.get("concurrency"), r.get("fraction")) for r in rows] == [
        ("closed", 100, None),
        ("closed", 200, None),
        ("open", None, 0.35),
        ("open", None, 0.7),
        ("light", 1, None),
    ]
    open_35, open_70 = rows[2], rows[3]
    assert open_35["saturation"] == 2000.0 and open_35["asked_rate"] == 700.0 and open_35["rate_ok"] is True
    assert open_70["asked_rate"] == 1400.0 and open_70["achieved_rate"] == 500.0 and open_70["rate_ok"] is False
    assert "WARNING" in capsys.readouterr().out
    for row in rows:
        assert row["design"] == "pipeline" and row["commit"] == "abc1234" and row["adapters"] == 4
        assert row["requests"] == 100 and row["mean_batch"] == 10.0 and row["core_rows_per_execute"] == 20.0
        assert row["gpu_busy_pct"] is None, "no nvidia-smi samples"


def test_warmup_open_runs_a_discarded_warm_up_at_each_open_rate(tmp_path, monkeypatch):
    """--warmup-open: right before each open loop, a warm-up at that same rate whose result is
    no row (and without it, the only warm-up is the mode's, at the first concurrency)."""
    import subprocess

    def counter():
        n = 0
        while True:
            yield {"gliner2": {"inference": 100 * n, "execution": 10 * n}}
            n += 1

    commands = []
    for warm in (False, True):
        bench, args = _bench(tmp_path / str(warm), monkeypatch, counter(), achieved=lambda asked: asked)
        args.warmup_open = warm
        (tmp_path / str(warm)).mkdir()
        data = tmp_path / str(warm) / "base.json"
        data.write_text("{}")
        fake = subprocess.run
        ran = []
        monkeypatch.setattr(bench_server.subprocess, "run", lambda cmd, **kw: ran.append(cmd) or fake(cmd, **kw))
        bench.run([("base", None, 0, data)], light=set())
        loads = []
        for cmd in ran:
            if "perf_analyzer" not in cmd[0]:
                continue
            warm_up = str(cmd[cmd.index("-f") + 1]).endswith(".warmup.csv")
            rate = cmd[cmd.index("--request-rate-range") + 1] if "--request-rate-range" in cmd else None
            loads.append(("warm-up" if warm_up else "measure", rate))
        commands.append(loads)
        rows = [json.loads(line) for line in args.out.read_text().splitlines()]
        assert [r["load"] for r in rows] == ["closed", "closed", "open", "open"]
    assert commands[0] == [("warm-up", None)] + [("measure", None)] * 2 + [("measure", "700"), ("measure", "1400")]
    assert commands[1] == [("warm-up", None)] + [("measure", None)] * 2 + [
        ("warm-up", "700"),
        ("measure", "700"),
        ("warm-up", "1400"),
        ("measure", "1400"),
    ]


def test_cpu_per_request_per_stage(tmp_path):
    from bench_server import Proc

    stub = "/opt/tritonserver/backends/python/triton_python_backend_stub"

    def procs(front0, front1, core, server, other):
        def args(model, instance):
            return (stub, f"/r/{model}/1/model.py", "triton_python_backend_shm_region_1", "1048576", instance)

        return {
            100: Proc(1, ("tritonserver", "--model-repository=/r"), server),
            101: Proc(100, args("gliner2", "gliner2_0_0"), front0),
            102: Proc(100, args("gliner2", "gliner2_0_1"), front1),
            103: Proc(100, args("gliner2_core", "gliner2_core_0_0"), core),
            104: Proc(7, args("gliner2", "gliner2_0_0"), other),  # another server's stub
        }

    readings = iter([procs(1000, 2000, 5000, 300, 0), procs(1150, 2150, 5200, 350, 999)])
    meter = bench_server.CpuMeter(100, read=lambda: next(readings), host=None, hz=100)
    before, after = meter.snapshot(), meter.snapshot()
    cpu = meter.phase(before, after, requests=1000)["cpu_ms_per_req"]
    # 300 ticks of the two fronts = 3 s over 1,000 requests; 200 core ticks = 2 s; 50 server ticks
    assert cpu == {"gliner2": 3.0, "gliner2_core": 2.0, "tritonserver": 0.5}
    # a stub found only by its model file, a stage that started mid-phase, a single design (no core)
    nameless = {100: Proc(1, ("tritonserver",), 0), 110: Proc(100, (stub, "/r/gliner2/1/model.py"), 40)}
    ticks = bench_server.stage_ticks(nameless, 100, ("gliner2", "gliner2_core"))
    assert ticks == {"gliner2": {110: 40}, "gliner2_core": {}, "tritonserver": {100: 0}}
    # core_process: on: the GPU stage's worker (a child of its stub) is the GPU stage's CPU
    worker = {**procs(0, 0, 70, 0, 0), 120: Proc(103, ("python3", "-m", "manylora.core_process", "5"), 30)}
    assert bench_server.stage_ticks(worker, 100, ("gliner2", "gliner2_core"))["gliner2_core"] == {103: 70, 120: 30}
    per_req = bench_server.cpu_ms_per_request({}, ticks, 10, 100.0)
    assert per_req == {"gliner2": 40.0, "gliner2_core": None, "tritonserver": 0.0}
    assert bench_server.cpu_ms_per_request({}, ticks, 0, 100.0)["gliner2"] is None


def test_read_processes_parses_proc(tmp_path):
    pid = tmp_path / "4242"
    pid.mkdir()
    fields = ["S", "100"] + ["0"] * 9 + ["17", "5"] + ["0"] * 30  # ppid 100, utime 17, stime 5
    (pid / "stat").write_text("4242 (triton (stub) x) " + " ".join(fields) + "\n")
    (pid / "cmdline").write_bytes(b"/x/triton_python_backend_stub\0/r/gliner2/1/model.py\0gliner2_0_0\0")
    (tmp_path / "self").mkdir()
    (tmp_path / "99").mkdir()  # vanished between listing and reading
    procs = bench_server.read_processes(tmp_path)
    assert procs == {
        4242: bench_server.Proc(100, ("/x/triton_python_backend_stub", "/r/gliner2/1/model.py", "gliner2_0_0"), 22)
    }
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 1 2 3 4\n")
    assert bench_server.host_cpu_times(stat) == (150, 1000)


def test_batch_stats_and_gpu_sampler():
    before = {"gliner2": {"inference": 1000, "execution": 100, "fail": 0}, "gliner2_core": {"inference": 100}}
    after = {
        "gliner2": {"inference": 3000, "execution": 150, "fail": 2},
        "gliner2_core": {"inference": 150, "execution": 110},
    }
    stats = bench_server.batch_stats(before, after)
    assert stats == {
        "requests": 2000,
        "server_failures": 2,
        "mean_batch": 40.0,
        "mean_batch_core": round(50 / 110, 2),
        "core_rows_per_execute": round(2000 / 110, 1),
        "core_failures": 0,
    }
    single = bench_server.batch_stats({"gliner2": {}}, {"gliner2": {"inference": 10, "execution": 0}})
    assert single["mean_batch"] is None and "mean_batch_core" not in single

    sampler = bench_server.GpuSampler()
    for t, line in [(0.0, "0, 10"), (1.0, "0, 80"), (1.0, "1, 60"), (2.0, "0, 90"), (2.5, "[N/A]"), (9.0, "0, 0")]:
        sampler.add_line(line, at=t)
    assert sampler.mean(0.5, 2.0) == {"gpu_busy_pct": 76.7, "gpu_busy_pct_per_gpu": {"0": 85.0, "1": 60.0}}
    assert sampler.mean(3.0, 4.0) == {"gpu_busy_pct": None}


def test_summary_table_pairs_lora_with_base_at_the_same_load():
    def row(mode, load, req, p50, **kw):
        distribution = None if mode == "base" else "zipf"
        cpu = {"gliner2": 1.5, "gliner2_core": 0.75}
        return {
            "design": "pipeline",
            "mode": mode,
            "distribution": distribution,
            "round": 0,
            "load": load,
            "req_per_s": req,
            "p50_ms": p50,
            "p95_ms": 2 * p50,
            "p99_ms": 3 * p50,
            "gpu_busy_pct": 91.0,
            "cpu_ms_per_req": cpu,
            "mean_batch": 12.0,
            **kw,
        }

    rows = [
        row("base", "closed", 2000.0, 100.0, concurrency=512),
        row("base", "open", 700.0, 20.0, fraction=0.35, rate=700.0, asked_rate=700.0, rate_ok=True),
        row("lora", "closed", 1800.0, 110.0, concurrency=512),
        row("lora", "open", 630.0, 25.0, fraction=0.35, rate=630.0, asked_rate=630.0, rate_ok=False),
        row("lora", "closed", 1000.0, 10.0, concurrency=64),  # no base at this load
    ]
    lines = bench_server.summary_table(rows).splitlines()
    body = lines[4:9]
    assert "base" in body[0] and "c=512" in body[0] and "2000.0" in body[0] and body[0].rstrip().endswith("-")
    assert "open 35% 700/s" in body[1]
    assert "lora-zipf" in body[2] and body[2].rstrip().endswith("0.900 req/s")
    assert "open 35% 630/s !" in body[3] and body[3].rstrip().endswith("1.250 p50"), "open loop: p50 ratio"
    assert body[4].rstrip().endswith("-")
    assert " 1.50 " in body[0] and " 0.75 " in body[0] and " 91 " in body[0]
    assert lines[9:] == ["", "saturation req/s, base: pipeline 2000.0", "saturation req/s, lora-zipf: pipeline 1800.0"]
    both = rows + [dict(r, design="single", req_per_s=r["req_per_s"] / 2) for r in rows]
    assert "saturation req/s, base: pipeline 2000.0, single 1000.0 (pipeline / single 2.000)" in (
        bench_server.summary_table(both)
    )
    other_design = [dict(r, design="single") if r["mode"] == "base" else r for r in rows]
    assert bench_server.lora_base_ratio(other_design[2], other_design) is None, "never across designs"


def test_light_load_and_rounds_of_the_datasets(tmp_path):
    args = bench_server.build_parser().parse_args(
        ["--out", "x", "--modes", "base", "lora", "base", "lora", "--distributions", "uniform", "zipf"]
        + ["--requests", "8", "--light-load"]
    )
    datasets, light = bench_server.datasets_of(args, tmp_path, [f"adapter-{i:05d}" for i in range(4)])
    assert [(m, d, r) for m, d, r, _ in datasets] == [
        ("base", None, 0),
        ("lora", "uniform", 0),
        ("lora", "zipf", 0),
        ("base", None, 1),
        ("lora", "uniform", 1),
        ("lora", "zipf", 1),
    ]
    assert light == {("base", None, 0), ("lora", "uniform", 0), ("base", None, 1), ("lora", "uniform", 1)}
    zipf = json.loads((tmp_path / "lora-zipf.json").read_text())["data"]
    assert len(zipf) == 8 and all(e["ADAPTER_ID"]["content"][0].startswith("adapter-") for e in zipf)
    assert bench_server.estimate_s(args, len(datasets), len(light)) > 0


def _fake_server(monkeypatch, fails=()):
    """TritonServer replaced: records each start's repository; designs in ``fails`` fail to load."""
    import manylora.tritonserver

    started = []

    class FakeServer:
        def __init__(self, repo, log_file=None):
            self.repo, self.grpc_url, self.process = Path(repo), "h:1", type("P", (), {"pid": 999999})()
            self.metrics_url = None  # no call histograms: the phases report without them
            self.log = Path(log_file)

        def start(self, timeout):
            started.append(sorted(p.name for p in self.repo.iterdir()))
            self.log.write_text("server log\n")
            if self.repo.name.removeprefix("repo-").rsplit("-", 1)[0] in fails:  # repo-<design>-<turn>
                raise RuntimeError("model 'gliner2' failed to load")

        def log_tail(self):
            return self.log.read_text()

        def stop(self):
            pass

    monkeypatch.setattr(manylora.tritonserver, "TritonServer", FakeServer)
    monkeypatch.setattr(bench_server.GpuSampler, "start", lambda self: self)
    return started


def test_main_starts_one_server_per_design_and_prints_the_table(tmp_path, monkeypatch, capsys, engine_params):
    """The whole run with fakes: a server per design (its repository as the design says),
    every phase a row with provenance, the table last."""
    started = _fake_server(monkeypatch)

    def counter():
        n = 0
        while True:
            yield {"gliner2": {"inference": 64 * n, "execution": 8 * n}}
            n += 1

    _fake_perf_analyzer(monkeypatch, counter(), achieved=lambda asked: asked)
    out = tmp_path / "main.jsonl"
    argv = ["--checkpoint", engine_params["checkpoint"], "--design", "single", "pipeline", "--modes", "base"]
    argv += ["--concurrency", "4", "--open-fractions", "0.5", "--requests", "4", "--out", str(out)]
    assert bench_server.main(argv) == 0
    assert started == [["gliner2"], ["gliner2", "gliner2_core"]]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["design"], r["load"]) for r in rows] == [
        (d, load) for d in ("single", "pipeline") for load in ("closed", "open")
    ]
    for row in rows:
        assert row["command"].startswith("bench_server.py --checkpoint") and "machine" in row and "dirty" in row
        assert row["machine"]["cpu_count"] == os.cpu_count() and row["layout"]["design"] == row["design"]
    assert rows[0]["repository"]["gliner2"]["parameters"]["core_model"] == "none"
    assert rows[2]["repository"]["gliner2_core"]["parameters"]["max_gpu_adapters"] == "32"
    assert rows[1]["asked_rate"] == rows[1]["achieved_rate"] == 20.0 and rows[1]["rate_ok"]
    printed = capsys.readouterr().out
    assert "saturation req/s, base: single 40.0, pipeline 40.0 (pipeline / single 1.000)" in printed
    assert "pipeline        base          open 50% 20/s" in printed and "lora/base" in printed


def test_main_goes_on_when_a_design_does_not_start(tmp_path, monkeypatch, capsys, engine_params):
    started = _fake_server(monkeypatch, fails=("single",))
    counts = iter([{"gliner2": {"inference": 40 * n, "execution": 4 * n}} for n in range(10)])
    _fake_perf_analyzer(monkeypatch, counts, achieved=lambda asked: asked)
    out = tmp_path / "main.jsonl"
    argv = ["--checkpoint", engine_params["checkpoint"], "--design", "single", "pipeline", "--modes", "base"]
    assert bench_server.main(argv + ["--concurrency", "4", "--requests", "4", "--out", str(out)]) == 1
    assert len(started) == 2, "the pipeline still ran"
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["design"] for r in rows] == ["pipeline"]
    assert "the single server did not start" in capsys.readouterr().out
    assert (tmp_path / "main.single.tritonserver.log").read_text() == "server log\n", "its log is kept"


def test_a_design_given_twice_runs_twice_for_alternated_rounds(tmp_path, monkeypatch, engine_params):
    started = _fake_server(monkeypatch)
    counts = iter([{"gliner2": {"inference": 40 * n, "execution": 4 * n}} for n in range(10)])
    _fake_perf_analyzer(monkeypatch, counts, achieved=lambda asked: asked)
    out = tmp_path / "abba.jsonl"
    argv = ["--checkpoint", engine_params["checkpoint"], "--design", "pipeline", "pipeline", "--modes", "base"]
    assert bench_server.main(argv + ["--concurrency", "4", "--requests", "4", "--out", str(out)]) == 0
    assert len(started) == 2, "one server per turn"
    assert [json.loads(line)["design"] for line in out.read_text().splitlines()] == ["pipeline", "pipeline"]


def test_bench_repository_pipeline_eager_turns_the_cuda_graphs_off(tmp_path, engine_params):
    repo = bench_server.bench_repository(tmp_path / "repo", engine_params, bench_server.Layout(design="pipeline-eager"))
    core = _parse_config(repo / "gliner2_core" / "config.pbtxt")
    assert _params(core) == {**engine_params, "cuda_graphs": "off"}
    assert _engine_config(core).cuda_graphs is False and _engine_config(core).core_overlap is True
    assert bench_server.design_of(bench_server.repository_summary(repo)) == "pipeline-eager"
    committed = bench_server.bench_repository(tmp_path / "on", engine_params, bench_server.Layout(design="pipeline"))
    assert _engine_config(_parse_config(committed / "gliner2_core" / "config.pbtxt")).cuda_graphs is True


def test_bench_repository_pipeline_unpiped_turns_the_chunk_pipeline_off(tmp_path, engine_params):
    layout = bench_server.Layout(design="pipeline-unpiped")
    repo = bench_server.bench_repository(tmp_path / "repo", engine_params, layout)
    core = _parse_config(repo / "gliner2_core" / "config.pbtxt")
    assert _params(core) == {**engine_params, "chunk_pipeline": "off"}
    assert _engine_config(core).chunk_pipeline is False and _engine_config(core).cuda_graphs is True
    assert bench_server.design_of(bench_server.repository_summary(repo)) == "pipeline-unpiped"


def test_bench_repository_pipeline_unfused_turns_the_span_kernel_off(tmp_path, engine_params):
    layout = bench_server.Layout(design="pipeline-unfused")
    repo = bench_server.bench_repository(tmp_path / "repo", engine_params, layout)
    core = _parse_config(repo / "gliner2_core" / "config.pbtxt")
    assert _params(core) == {**engine_params, "fused_span_scores": "off"}
    assert _engine_config(core).fused_span_scores is False and _engine_config(core).chunk_pipeline is True
    assert bench_server.design_of(bench_server.repository_summary(repo)) == "pipeline-unfused"
    committed = bench_server.bench_repository(tmp_path / "on", engine_params, bench_server.Layout(design="pipeline"))
    assert _engine_config(_parse_config(committed / "gliner2_core" / "config.pbtxt")).fused_span_scores is True
    assert bench_server.design_of(bench_server.repository_summary(committed)) == "pipeline", "on is the default"


def test_bench_repository_pipeline_small_graphs_lowers_the_graph_cap(tmp_path, engine_params):
    repo = bench_server.bench_repository(
        tmp_path / "repo", engine_params, bench_server.Layout(design="pipeline-small-graphs")
    )
    config = _engine_config(_parse_config(repo / "gliner2_core" / "config.pbtxt"))
    assert config.cuda_graph_max_tokens == 16384 and config.cuda_graphs is True and config.fused_span_scores is True
    assert bench_server.design_of(bench_server.repository_summary(repo)) == "pipeline-small-graphs"
    committed = bench_server.bench_repository(tmp_path / "plain", engine_params, bench_server.Layout(design="pipeline"))
    assert _engine_config(_parse_config(committed / "gliner2_core" / "config.pbtxt")).cuda_graph_max_tokens == 65536
    assert bench_server.design_of(bench_server.repository_summary(committed)) == "pipeline", "65536 is the default"


def test_bench_repository_pipeline_fine_chunks_lowers_the_chunk_cost(tmp_path, engine_params):
    repo = bench_server.bench_repository(
        tmp_path / "repo", engine_params, bench_server.Layout(design="pipeline-fine-chunks")
    )
    assert _engine_config(_parse_config(repo / "gliner2_core" / "config.pbtxt")).chunk_cost_tokens == 2048
    assert bench_server.design_of(bench_server.repository_summary(repo)) == "pipeline-fine-chunks"
    committed = bench_server.bench_repository(tmp_path / "plain", engine_params, bench_server.Layout(design="pipeline"))
    assert _engine_config(_parse_config(committed / "gliner2_core" / "config.pbtxt")).chunk_cost_tokens == 0  # auto


def test_bench_repository_pipeline_eager_attention_turns_the_attention_kernel_off(tmp_path, engine_params):
    repo = bench_server.bench_repository(
        tmp_path / "repo", engine_params, bench_server.Layout(design="pipeline-eager-attention")
    )
    config = _engine_config(_parse_config(repo / "gliner2_core" / "config.pbtxt"))
    assert config.fused_attention is False and config.fused_span_scores is True
    assert bench_server.design_of(bench_server.repository_summary(repo)) == "pipeline-eager-attention"
    committed = bench_server.bench_repository(tmp_path / "plain", engine_params, bench_server.Layout(design="pipeline"))
    assert _engine_config(_parse_config(committed / "gliner2_core" / "config.pbtxt")).fused_attention is True
    assert bench_server.design_of(bench_server.repository_summary(committed)) == "pipeline", "on is the default"


def test_bench_repository_pipeline_inflight_sets_the_fronts_inflight_batches(tmp_path, engine_params):
    repo = bench_server.bench_repository(
        tmp_path / "repo", engine_params, bench_server.Layout(design="pipeline-inflight")
    )
    front = _parse_config(repo / "gliner2" / "config.pbtxt")
    assert front.parameters["front_inflight"].string_value == "4"
    assert front.parameters["core_model"].string_value == "gliner2_core"
    assert bench_server.design_of(bench_server.repository_summary(repo)) == "pipeline-inflight"
    plain = bench_server.bench_repository(tmp_path / "plain", engine_params, bench_server.Layout(design="pipeline"))
    assert "front_inflight" not in _parse_config(plain / "gliner2" / "config.pbtxt").parameters
    assert _engine_config(_parse_config(plain / "gliner2" / "config.pbtxt")).front_inflight == 1, "the default"
    assert bench_server.design_of(bench_server.repository_summary(plain)) == "pipeline"


def test_bench_repository_pipeline_2x_fronts_doubles_the_front_instances(tmp_path, engine_params):
    def fronts(name: str, **layout) -> int:
        repo = bench_server.bench_repository(tmp_path / name, engine_params, bench_server.Layout(**layout))
        return _parse_config(repo / "gliner2" / "config.pbtxt").instance_group[0].count

    committed = _parse_config(bench_server.REPO / "gliner2" / "config.pbtxt").instance_group[0].count
    assert fronts("wide", design="pipeline-2x-fronts", front_instances=16) == 32
    assert fronts("narrow", design="pipeline", front_instances=16) == 16
    assert fronts("committed", design="pipeline-2x-fronts") == 2 * committed
    assert fronts("plain", design="pipeline") == committed


def test_call_stats_are_means_of_the_phase_from_both_instances():
    """The GPU stage's call histograms, read from Prometheus text before and after a phase:
    mean rows per call, call ms and queue ms of that phase alone, summed over instances."""

    def text(rows, seconds, waits, calls, jobs, captures=0, capture_s=0.0):
        lines = ["# HELP manylora_core_call_rows Rows per GPU-stage engine call"]
        for instance in ("0", "1"):
            labels = f'{{model="gliner2_core",instance="{instance}"}}'
            lines += [
                f'manylora_core_call_rows_bucket{{model="gliner2_core",instance="{instance}",le="64"}} {calls}',
                f"manylora_core_call_rows_sum{labels} {rows}",
                f"manylora_core_call_rows_count{labels} {calls}",
                f"manylora_core_call_seconds_sum{labels} {seconds}",
                f"manylora_core_call_seconds_count{labels} {calls}",
                f"manylora_core_queue_seconds_sum{labels} {waits}",
                f"manylora_core_queue_seconds_count{labels} {jobs}",
                f'manylora_batch_waves_sum{{model="gliner2_core",instance="{instance}"}} 99',
                f"manylora_cuda_graph_captures_total{labels} {captures}",
                f"manylora_cuda_graph_capture_seconds_total{labels} {capture_s}",
                f'manylora_core_phase_seconds_total{{model="gliner2_core",instance="{instance}",phase="heads"}} {seconds}',
            ]
        return "\n".join(lines)

    before = bench_server.parse_call_metrics(text(100, 1.0, 0.5, 10, 20, captures=104, capture_s=8.0))
    after = bench_server.parse_call_metrics(text(400, 2.5, 1.7, 20, 50, captures=110, capture_s=8.45))
    assert before["manylora_core_call_rows_sum"] == 200 and "manylora_batch_waves_sum" not in before
    # per instance: 300 rows / 10 calls, 1.5 s / 10 calls, 1.2 s / 30 jobs
    assert bench_server.call_stats(before, after) == {
        "core_phase_ms_per_call": {"heads": 150.0},  # per instance 1.5 s more over 10 calls
        "core_call_rows": 30.0,
        "core_call_ms": 150.0,
        "core_queue_ms": 40.0,
        "core_graph_captures": 12,  # 6 more on each instance, 0.45 s each
        "core_capture_s": 0.9,
    }
    assert bench_server.call_stats(before, before)["core_call_rows"] is None  # no call in the phase
    assert bench_server.call_stats({}, {}) == {} and bench_server.call_metrics(None) == {}
    assert bench_server.call_stats({}, after) == {}, "a failed read before the phase: no figure"
    unlabeled = "# TYPE x histogram\nmanylora_core_call_rows_count 5\nmanylora_core_call_rows_sum NaNx\n"
    assert bench_server.parse_call_metrics(unlabeled) == {"manylora_core_call_rows_count": 5.0}


def test_bench_repository_front_inflight_goes_to_the_front(tmp_path, engine_params):
    layout = bench_server.Layout(design="pipeline", front_inflight=2)
    repo = bench_server.bench_repository(tmp_path / "repo", engine_params, layout)
    front = _parse_config(repo / "gliner2" / "config.pbtxt")
    assert _params(front)["front_inflight"] == "2" and _engine_config(front).front_inflight == 2
    assert "front_inflight" not in _params(_parse_config(repo / "gliner2_core" / "config.pbtxt"))
    plain = bench_server.bench_repository(tmp_path / "plain", engine_params, bench_server.Layout(design="pipeline"))
    assert "front_inflight" not in _params(_parse_config(plain / "gliner2" / "config.pbtxt")), "the committed 1"


def test_design_of_names_only_a_design_whose_every_setting_matches(tmp_path, engine_params):
    """A front override and a core override together, or a front_inflight no design sets, are
    no design of the list: 'pipeline-custom', never the name of one of the two arms."""

    def design(name: str, edit=None, **layout) -> str:
        repo = bench_server.bench_repository(tmp_path / name, engine_params, bench_server.Layout(**layout))
        if edit:
            edit(repo)
        return bench_server.design_of(bench_server.repository_summary(repo))

    def attention_off(repo):
        path = repo / "gliner2_core" / "config.pbtxt"
        config = _parse_config(path)
        config.parameters["fused_attention"].string_value = "off"
        from google.protobuf import text_format

        path.write_text(text_format.MessageToString(config))

    assert design("inflight", design="pipeline-inflight") == "pipeline-inflight"
    assert design("both", attention_off, design="pipeline-inflight") == "pipeline-custom"
    assert design("eight", design="pipeline", front_inflight=8) == "pipeline-custom"
    assert design("eight-eager", design="pipeline-eager-attention", front_inflight=8) == "pipeline-custom"
    assert design("four", design="pipeline", front_inflight=4) == "pipeline-inflight"
    with pytest.raises(ValueError, match="both set front_inflight"):
        design("conflict", design="pipeline-inflight", front_inflight=2)


def test_code_sha_names_the_served_code(tmp_path, capsys):
    """code_sha: the same for the same files, another when a served file changes or is added,
    blind to caches; --print-code-sha prints this checkout's."""
    for folder in bench_server.CODE_FOLDERS:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "a.py").write_text(f"# {folder}\n")
    first = bench_server.code_sha(tmp_path)
    assert len(first) == 12 and bench_server.code_sha(tmp_path) == first
    (tmp_path / "kernels" / "__pycache__").mkdir()
    (tmp_path / "kernels" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    assert bench_server.code_sha(tmp_path) == first
    (tmp_path / "model_repository" / "a.py").write_text("# changed\n")
    changed = bench_server.code_sha(tmp_path)
    (tmp_path / "manylora" / "b.py").write_text("")
    assert len({first, changed, bench_server.code_sha(tmp_path)}) == 3
    assert bench_server.main(["--print-code-sha"]) == 0
    assert capsys.readouterr().out.strip() == bench_server.code_sha()
