"""End-to-end: the real tritonserver serving the committed pipeline (the gliner2 CPU front and
its GPU stage gliner2_core) on the tiny checkpoint.

Answers are compared with GLiNER2 itself, over gRPC and HTTP; a dynamic batch with a
bad request answers the others; config.pbtxt is parsed strictly.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from fault_tools import (
    GRPC_STATUS,
    HTTP_STATUS,
    infer_inputs,
    metrics_when,
    pipeline_loads,
    reference_answer,
    send_together,
    write_gliner2_model,
)
from manylora.client import protocol
from tritonclient.utils import InferenceServerException

from manylora.compare import result_differences
from manylora.demo import demo_schemas, demo_texts

REPO_MODEL = Path(__file__).resolve().parents[2] / "model_repository" / "gliner2"
BATCH_DELAY_US = 300_000  # long queue delay so concurrent test requests share one dynamic batch


def _copy_model(src: Path, dst: Path, checkpoint: Path, extra_parameters: str = "", delay_us: int | None = None):
    """A copy of the committed model with its parameters replaced: the checkpoint, plus extras."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
    config = (dst / "config.pbtxt").read_text()
    config = re.sub(r'name: "gliner2"', f'name: "{dst.name}"', config, count=1)
    config = re.sub(r"parameters \{.*", "", config, flags=re.S)
    config += f'parameters {{ key: "checkpoint" value: {{ string_value: "{checkpoint}" }} }}\n'
    if delay_us is not None:
        config = re.sub(r"max_queue_delay_microseconds: \d+", f"max_queue_delay_microseconds: {delay_us}", config)
    (dst / "config.pbtxt").write_text(config + extra_parameters)


@pytest.fixture(scope="module")
def server(tmp_path_factory, triton_server_factory, tiny_checkpoint, demo_adapters):
    """The committed pipeline (CPU front gliner2 -> GPU stage gliner2_core), on the tiny checkpoint."""
    repo = tmp_path_factory.mktemp("repo")
    adapter_root = next(iter(demo_adapters.values())).parent

    def batch_delay(config):
        config.dynamic_batching.max_queue_delay_microseconds = BATCH_DELAY_US

    write_gliner2_model(
        repo,
        "gliner2",
        tiny_checkpoint,
        {"adapter_dir": str(adapter_root), "max_gpu_adapters": "4", "max_cpu_adapters": "6"},
        edit=batch_delay,
    )
    bad = {
        "gliner2_unknown_key": 'parameters { key: "gpu_slotz" value: { string_value: "4" } }\n',
        "gliner2_bad_value": 'parameters { key: "max_batch_tokens" value: { string_value: "lots" } }\n',
        "gliner2_template": 'parameters { key: "dtype" value: { string_value: "${DTYPE}" } }\n',
    }
    for name, extra in bad.items():
        _copy_model(REPO_MODEL, repo / name, tiny_checkpoint, extra_parameters=extra)
    return triton_server_factory(repo, extra_args=["--model-control-mode=explicit", *pipeline_loads()])


def _requests(n=6):
    schemas = demo_schemas()
    return [
        protocol.Request(t, json.dumps(schemas[i % len(schemas)]), include_confidence=True)
        for i, t in enumerate(demo_texts(n, seed=3))
    ]


@pytest.mark.parametrize("module", [grpcclient, httpclient], ids=["grpc", "http"])
def test_answers_equal_gliner2(server, reference_model, module):
    url = server.grpc_url if module is grpcclient else server.http_url
    client = module.InferenceServerClient(url)
    for request in _requests(4):
        response = client.infer("gliner2", infer_inputs(module, request.to_arrays()))
        got = protocol.parse_result(response.as_numpy(protocol.RESULT))
        assert not result_differences(got, reference_answer(reference_model, request))


def test_dynamic_batch_with_a_bad_request_answers_the_others(server, reference_model):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    before = client.get_inference_statistics("gliner2").model_stats[0]
    good = _requests(5)
    good.append(protocol.Request("   ", json.dumps({"entities": ["x"]}), threshold=0.0))  # served, as by GLiNER2
    bad = [
        protocol.Request("Some text.", "{broken json"),
        protocol.Request("Some text.", json.dumps({"entities": ["x"]}), adapter="no-such-adapter"),
        protocol.Request("Some text.", json.dumps({"entities": {"x": {"threshold": 1.5}}})),  # GLiNER2 refuses it
    ]
    requests = good[:2] + bad[:1] + good[2:4] + bad[1:] + good[4:]
    answers: dict[int, object] = {}

    def callback(index):
        return lambda result, error: answers.__setitem__(index, error if error else result)

    for i, request in enumerate(requests):
        client.async_infer("gliner2", infer_inputs(grpcclient, request.to_arrays()), callback(i))
    import time

    deadline = time.time() + 60
    while len(answers) < len(requests) and time.time() < deadline:
        time.sleep(0.05)
    assert len(answers) == len(requests), "every request is answered"
    for i, request in enumerate(requests):
        answer = answers[i]
        if request in bad:
            assert isinstance(answer, InferenceServerException), answer
            expected_status = "NOT_FOUND" if request.adapter else "INVALID_ARG"
            assert expected_status in answer.status(), (answer.status(), answer.message())
        else:
            assert not isinstance(answer, Exception), answer
            got = protocol.parse_result(answer.as_numpy(protocol.RESULT))
            assert not result_differences(got, reference_answer(reference_model, request))
    after = client.get_inference_statistics("gliner2").model_stats[0]
    executions = after.execution_count - before.execution_count
    inferences = after.inference_count - before.inference_count
    assert inferences == len(requests) and executions < len(requests), "requests were batched together"


@pytest.mark.parametrize(
    "model,message",
    [
        ("gliner2_unknown_key", "gpu_slotz"),
        ("gliner2_bad_value", "max_batch_tokens"),
        ("gliner2_template", "unfilled template"),
    ],
)
def test_bad_config_fails_to_load_naming_the_key(server, model, message):
    client = httpclient.InferenceServerClient(server.http_url)
    with pytest.raises(InferenceServerException, match=re.escape(message)):
        client.load_model(model)
    assert not client.is_model_ready(model)


def test_missing_input_and_wrong_shape_are_invalid_arg(server):
    client = httpclient.InferenceServerClient(server.http_url)
    text = httpclient.InferInput(protocol.TEXT, [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[b"hello"]], dtype=np.object_))
    with pytest.raises(InferenceServerException) as info:
        client.infer("gliner2", [text])  # SCHEMA missing: Triton itself rejects it
    assert "SCHEMA" in info.value.message()
    request = protocol.Request("Not UTF-8 below.", json.dumps({"entities": ["x"]}))
    inputs = infer_inputs(httpclient, request.to_arrays())
    inputs[0].set_data_from_numpy(np.array([[b"\xff\xfe bad bytes"]], dtype=np.object_))
    with pytest.raises(InferenceServerException) as info:
        client.infer("gliner2", inputs)
    assert "UTF-8" in info.value.message()


@pytest.mark.parametrize("protocol_name", ["grpc", "http"])
def test_client_mixed_adapters_equal_peft_per_adapter(server, demo_adapters, peft_reference, protocol_name):
    """>= 8 adapters (ranks 4-64, some with head LoRA) and base rows in concurrent requests:
    each answer equals GLiNER2 + PEFT with that adapter alone. 4 GPU slots force waves."""
    from gliner2.inference.schema import Schema
    from manylora.client import ManyLoRAClient

    url = server.grpc_url if protocol_name == "grpc" else server.http_url
    names = sorted(demo_adapters) + [""]
    texts = demo_texts(2 * len(names), seed=21)
    adapters = [names[i % len(names)] for i in range(len(texts))]
    schema = demo_schemas()[0]
    with ManyLoRAClient(url, protocol=protocol_name, concurrency=32) as client:
        got = client.batch_extract(texts, schema, adapter=adapters, include_confidence=True)
        entities = client.extract_entities(texts[0], ["person", "organization"], adapter="enc-heads-r16")
    for text, adapter, answer in zip(texts, adapters, got):
        model = peft_reference(demo_adapters[adapter] if adapter else None)
        (expected,) = model.batch_extract([text], Schema.from_dict(schema), include_confidence=True)
        assert not result_differences(answer, json.loads(json.dumps(expected))), adapter
    expected = peft_reference(demo_adapters["enc-heads-r16"]).extract_entities(texts[0], ["person", "organization"])
    assert entities == json.loads(json.dumps(expected))


def test_client_api_mirrors_gliner2(server, reference_model):
    from manylora.client import ManyLoRAClient

    text = demo_texts(1, seed=22)[0]
    with ManyLoRAClient(server.grpc_url) as client:
        pairs = [
            (
                client.classify_text(text, {"topic": ["business", "sport", "science"]}),
                reference_model.classify_text(text, {"topic": ["business", "sport", "science"]}),
            ),
            (
                client.extract_relations(text, ["works_for", "located_in"], include_confidence=True),
                reference_model.extract_relations(text, ["works_for", "located_in"], include_confidence=True),
            ),
            (
                client.extract_json(text, {"deal": ["buyer::str", "kind::[cash|stock]"]}),
                reference_model.extract_json(text, {"deal": ["buyer::str", "kind::[cash|stock]"]}),
            ),
        ]
    for got, expected in pairs:
        assert not result_differences(got, json.loads(json.dumps(expected)))


def test_long_methods_and_max_len_equal_gliner2(server, reference_model):
    """The *_long methods through the server: windows cut client-side, each sent with
    MAX_LEN = chunk_size as GLiNER2 passes max_len, merged as GLiNER2 merges: GLiNER2's answer,
    scores included. And extract(max_len=) itself."""
    from manylora.client import ManyLoRAClient

    text = " ".join(demo_texts(6, seed=23))
    labels = ["person", "company", "location"]
    args = (0.3, 24, 6)  # threshold, chunk_size, chunk_overlap: several windows, cut words in each
    with ManyLoRAClient(server.grpc_url) as client:
        got = client.extract_entities_long(text, labels, *args, include_confidence=True, include_spans=True)
        cut = client.extract_entities(text, labels, 0.3, True, True, True, 12)
    expected = reference_model.extract_entities_long(text, labels, *args, include_confidence=True, include_spans=True)
    assert not result_differences(got, json.loads(json.dumps(expected)), atol=1e-5)
    assert any(got["entities"].values()), "spans found: not vacuous"
    expected_cut = reference_model.extract_entities(text, labels, 0.3, True, True, True, 12)
    assert not result_differences(cut, json.loads(json.dumps(expected_cut)), atol=1e-5)


def test_server_benchmark_runs_perf_analyzer_against_the_server(server, demo_adapters, tmp_path):
    """perf/bench_server.py drives perf_analyzer (from the tritonclient wheel) at the real server."""
    import subprocess
    import sys

    perf = Path(__file__).resolve().parents[2] / "perf"
    out = tmp_path / "server.jsonl"
    adapter_root = next(iter(demo_adapters.values())).parent
    proc = subprocess.run(
        [
            sys.executable,
            str(perf / "bench_server.py"),
            "--url",
            server.grpc_url,
            "--adapters",
            str(adapter_root),
            "--concurrency",
            "2",
            "--requests",
            "16",
            "--interval-ms",
            "2000",
            "--warmup-ms",
            "1000",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["mode"] for r in rows] == ["base", "lora"]
    assert all(r["req_per_s"] > 0 and r["p50_ms"] <= r["p99_ms"] for r in rows)
    assert all(r["mean_batch"] is not None and 1 <= r["mean_batch"] <= 2 for r in rows)  # concurrency 2


def test_adapter_cache_metrics_on_the_prometheus_endpoint(server, demo_adapters):

    from manylora.client import ManyLoRAClient

    names = sorted(demo_adapters)[:6]  # more than the 4 GPU slots: misses, waves and evictions
    with ManyLoRAClient(server.grpc_url, concurrency=16) as client:
        client.batch_extract(demo_texts(12, seed=41), demo_schemas()[0], adapter=[names[i % 6] for i in range(12)])

    def check(text):
        def value(name, *labels):
            lines = [
                line
                for line in text.splitlines()
                if line.startswith(name + "{") and all(label in line for label in ('model="gliner2_core"', *labels))
            ]
            assert lines, f"{name} {labels} not exported"
            return sum(float(line.rsplit(" ", 1)[1]) for line in lines)

        assert value("manylora_adapter_cache_total", 'event="miss"', 'tier="gpu"') >= 6
        assert value("manylora_adapter_cache_total", 'event="evict"', 'tier="gpu"') >= 2
        assert value("manylora_adapters_resident", 'tier="gpu"') == 4
        assert value("manylora_adapter_load_seconds_count", 'stage="disk_to_host"') >= 6
        assert value("manylora_batch_waves_count") >= 1
        # the overlapped GPU stage's calls: rows, wall time, and each request's wait before its call
        assert value("manylora_core_call_rows_count") >= 1 and value("manylora_core_call_rows_sum") >= 12
        assert value("manylora_core_call_seconds_count") == value("manylora_core_call_rows_count")
        assert value("manylora_core_queue_seconds_count") >= value("manylora_core_call_rows_count")
        assert value("manylora_cuda_graph_captures_total") == 0, "no CUDA graphs on the CPU"

    metrics_when(server.metrics_url, check)  # published within metrics_interval of the last call


def test_locustfile_drives_grpc_and_http_users(server, demo_adapters, tmp_path):
    """perf/locustfile.py, headless for a few seconds: both user classes get answers, none fail."""
    import csv
    import os
    import subprocess
    import sys

    perf = Path(__file__).resolve().parents[2] / "perf"
    env = dict(
        os.environ,
        MANYLORA_ADAPTERS=str(next(iter(demo_adapters.values())).parent),
        MANYLORA_GRPC_PORT=str(server.grpc_port),
        MANYLORA_HTTP_PORT=str(server.http_port),
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "locust",
            "-f",
            str(perf / "locustfile.py"),
            "--headless",
            "-u",
            "4",
            "-r",
            "4",
            "-t",
            "6s",
            "-H",
            "127.0.0.1",
            "--csv",
            str(tmp_path / "locust"),
            "--only-summary",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    with open(tmp_path / "locust_stats.csv") as f:
        rows = {row["Type"]: row for row in csv.DictReader(f) if row["Name"] == "gliner2"}
    for kind in ("grpc", "http"):
        assert int(rows[kind]["Request Count"]) > 0 and int(rows[kind]["Failure Count"]) == 0, rows


# ------------------------------------------------------------------ drop-in GLiNER2 (issue 18 item 3)
EMPTY_AND_THRESHOLDS = [
    ("", {"entities": ["person", "company"]}, 0.0),
    ("  \n", {"classifications": [{"task": "sentiment", "labels": ["pos", "neg"]}]}, 0.5),
    ("", {"relations": ["works_for"], "structures": {"p": {"fields": [{"name": "a"}]}}}, -0.5),
    ("Tim Cook works for Apple in Cupertino.", {"entities": {"person": {"threshold": 0.3}, "city": {}}}, 1.5),
    ("Tim Cook works for Apple in Cupertino.", {"entities": ["person", "company"], "relations": ["works_for"]}, -2.0),
    ("Tim Cook works for Apple in Cupertino.", {"entities": {"person": {"threshold": 0.3}, "city": {}}}, float("nan")),
    ("Tim Cook works for Apple in Cupertino.", {"entities": ["person", "company"]}, -float("inf")),
]


def test_empty_texts_and_any_threshold_equal_gliner2(server, reference_model):
    """An empty (or whitespace-only) text, with a classification too, and thresholds outside
    [0, 1] (the front clamps the T_MIN it sends the GPU stage, post filters by the real one):
    GLiNER2's answers, through the drop-in client and raw tritonclient."""
    from manylora.client import ManyLoRAClient

    requests = [
        protocol.Request(text, json.dumps(schema), threshold=t, include_confidence=True, include_spans=True)
        for text, schema, t in EMPTY_AND_THRESHOLDS
    ]
    answers = send_together(server.grpc_url, [infer_inputs(grpcclient, r.to_arrays()) for r in requests])
    for request, answer in zip(requests, answers):
        assert not isinstance(answer, Exception), (request, answer)
        got = protocol.parse_result(answer.as_numpy(protocol.RESULT))
        assert not result_differences(got, reference_answer(reference_model, request)), request
    assert '"text": "."' in json.dumps(reference_answer(reference_model, requests[0])), "not vacuous"
    with ManyLoRAClient(server.grpc_url) as client:
        tasks = {"sentiment": ["pos", "neg"]}
        got = client.classify_text("", tasks, include_confidence=True)
        assert not result_differences(got, reference_model.classify_text("", tasks, include_confidence=True))
        got = client.extract_entities("", ["person"], threshold=0.0, include_confidence=True)
        expected = reference_model.extract_entities("", ["person"], threshold=0.0, include_confidence=True)
        assert not result_differences(got, expected)


def _batched(requests) -> dict:
    arrays = [r.to_arrays() for r in requests]
    return {name: np.concatenate([a[name] for a in arrays]) for name in arrays[0]}


@pytest.mark.parametrize("module", [grpcclient, httpclient], ids=["grpc", "http"])
def test_a_request_of_several_items_is_answered_item_by_item(server, reference_model, module):
    """Inputs [N, 1] (tritonclient with a batch, perf_analyzer -b N): RESULT [N, 1], each item
    GLiNER2's answer. One bad item fails the whole request (one response per request) with
    that item's code, naming it; a one-value optional input for N items is Triton's to refuse."""
    url = server.grpc_url if module is grpcclient else server.http_url
    client = module.InferenceServerClient(url)
    items = _requests(2) + [
        protocol.Request(text, json.dumps(schema), threshold=t) for text, schema, t in EMPTY_AND_THRESHOLDS[:2]
    ]
    response = client.infer("gliner2", infer_inputs(module, _batched(items)))
    result = response.as_numpy(protocol.RESULT)
    assert result.shape == (len(items), 1)
    for request, got in zip(items, protocol.parse_results(result)):
        assert not result_differences(got, reference_answer(reference_model, request)), request
    unknown = protocol.Request("Some text.", items[0].schema, adapter="no-such-adapter")
    for bad, code, message in [
        (
            protocol.Request("Some text.", "{broken json"),
            "INVALID_ARG",
            "item 1 (0-based) of 3: SCHEMA is not valid JSON",
        ),
        (unknown, "NOT_FOUND", "item 1 (0-based) of 3: unknown adapter 'no-such-adapter'"),
    ]:
        with pytest.raises(InferenceServerException) as info:
            client.infer("gliner2", infer_inputs(module, _batched([items[0], bad, items[1]])))
        assert info.value.status() == (GRPC_STATUS if module is grpcclient else HTTP_STATUS)[code]
        assert info.value.message().startswith(message), info.value.message()
    one_value = _batched(items[:2])
    one_value[protocol.THRESHOLD] = np.full((1, 1), 0.5, dtype=np.float32)
    with pytest.raises(InferenceServerException) as info:
        client.infer("gliner2", infer_inputs(module, one_value))
    assert info.value.status() == (GRPC_STATUS if module is grpcclient else HTTP_STATUS)["INVALID_ARG"]
    assert "input 'THRESHOLD' batch size does not match other inputs for 'gliner2'" in info.value.message()


def test_perf_analyzer_with_a_batch_of_two(server, tmp_path):
    """perf_analyzer -b 2 sends requests of two items: every one is answered (none fails)."""
    import os
    import shutil
    import subprocess
    import sys

    data = {
        protocol.TEXT: {"content": ["Tim Cook works for Apple."], "shape": [1]},
        protocol.SCHEMA: {"content": [json.dumps({"entities": ["person", "company"]})], "shape": [1]},
        protocol.THRESHOLD: {"content": [1.5], "shape": [1]},
    }
    (tmp_path / "data.json").write_text(json.dumps({"data": [data]}))
    env = dict(os.environ)
    try:  # perf_analyzer from the tritonclient wheel needs libcudart.so.12
        import nvidia.cuda_runtime

        lib = Path(list(nvidia.cuda_runtime.__path__)[0]) / "lib"
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(lib), env.get("LD_LIBRARY_PATH")]))
    except ImportError:
        pass
    stats = grpcclient.InferenceServerClient(server.grpc_url)
    before = stats.get_inference_statistics("gliner2").model_stats[0]
    perf = shutil.which("perf_analyzer") or str(Path(sys.prefix) / "bin" / "perf_analyzer")
    command = [perf, "-m", "gliner2", "-i", "grpc", "-u", server.grpc_url, "-b", "2"]
    command += ["--input-data", str(tmp_path / "data.json"), "--concurrency-range", "1:1"]
    command += ["--measurement-interval", "1000", "--stability-percentage", "999", "--max-trials", "3"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    after = stats.get_inference_statistics("gliner2").model_stats[0]
    assert after.inference_stats.fail.count == before.inference_stats.fail.count, "no request failed"
    assert after.inference_count - before.inference_count >= 2
