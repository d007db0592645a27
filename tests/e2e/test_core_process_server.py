"""End-to-end: the GPU stage with ``core_process: on`` (the engine in a child process of the
gliner2_core stub, ``manylora.core_process``) in a real tritonserver, on the tiny checkpoint.

Answers equal GLiNER2 + PEFT per adapter; a bad request in a dynamic batch fails alone with its
code; the worker's metrics and adapter control reach Triton's endpoint and the control model;
a killed worker fails its requests in flight UNAVAILABLE (none waits for a deadline) and a new
worker serves the same answers, without a reload of the model.
"""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from fault_tools import (
    GRPC_STATUS,
    child_pids,
    closed_loop,
    infer_inputs,
    metrics_when,
    pipeline_loads,
    reference_answer,
    send_together,
    stub_pids,
    wait_until,
    write_control,
    write_gliner2_model,
)
from manylora.client import protocol
from tritonclient.utils import InferenceServerException

from manylora.compare import result_differences
from manylora.control import ADAPTER_IDS, COMMAND, RESULT
from manylora.demo import demo_schemas, demo_texts

CORE_INSTANCE = "gliner2_core_0_0"
BATCH_DELAY_US = 200_000  # concurrent test requests share one dynamic batch


@pytest.fixture(scope="module")
def server(tmp_path_factory, triton_server_factory, tiny_checkpoint, demo_adapters):
    repo = tmp_path_factory.mktemp("repo-core-process")
    adapter_root = next(iter(demo_adapters.values())).parent

    def batch_delay(config):
        config.dynamic_batching.max_queue_delay_microseconds = BATCH_DELAY_US

    write_gliner2_model(
        repo,
        "gliner2",
        tiny_checkpoint,
        {"adapter_dir": str(adapter_root), "max_gpu_adapters": "4", "max_cpu_adapters": "6", "core_process": "on"},
        edit=batch_delay,
    )
    write_control(repo / "manylora_control")
    return triton_server_factory(
        repo, extra_args=["--model-control-mode=explicit", *pipeline_loads(), "--load-model=manylora_control"]
    )


def _worker_pids(server) -> list[int]:
    """The worker processes (children of the gliner2_core stub running manylora.core_process)."""
    (stub,) = stub_pids(server.process.pid, CORE_INSTANCE)
    return child_pids(stub, lambda args: b"manylora.core_process" in args)


def test_mixed_adapters_equal_peft_and_a_bad_request_fails_alone(server, demo_adapters, peft_reference):
    assert len(_worker_pids(server)) == 1, "the GPU stage runs its engine in one worker process"
    names = sorted(demo_adapters) + [""]
    schema = json.dumps(demo_schemas()[0])
    texts = demo_texts(len(names), seed=23)
    requests = [
        protocol.Request(text, schema, adapter=name, include_confidence=True) for text, name in zip(texts, names)
    ]
    bad = protocol.Request("Some text.", schema, adapter="no-such-adapter")
    batch = [infer_inputs(grpcclient, r.to_arrays()) for r in [*requests[:3], bad, *requests[3:]]]
    answers = send_together(server.grpc_url, batch)
    error = answers.pop(3)
    assert isinstance(error, InferenceServerException) and "NOT_FOUND" in error.status(), error.message()
    for request, answer in zip(requests, answers):
        assert not isinstance(answer, Exception), (request.adapter, answer)
        model = peft_reference(demo_adapters[request.adapter] if request.adapter else None)
        got = protocol.parse_result(answer.as_numpy(protocol.RESULT))
        assert not result_differences(got, reference_answer(model, request)), request.adapter


def test_the_workers_metrics_and_adapter_control_reach_triton(server, demo_adapters):
    name = sorted(demo_adapters)[0]
    client = grpcclient.InferenceServerClient(server.grpc_url)
    request = protocol.Request("Cobalt Motors opened an office in Lisbon.", json.dumps({"entities": ["company"]}))
    client.infer("gliner2", infer_inputs(grpcclient, request.to_arrays()))

    def published(text: str) -> None:
        assert (
            'manylora_core_phase_seconds_total{instance="gliner2_core_0_0",model="gliner2_core",phase="parse"}' in text
        )
        assert 'phase="respond"' in text and 'phase="prepare"' in text  # the stub's and the worker's
        assert "manylora_core_call_rows_count" in text

    metrics_when(server.metrics_url, published)
    preloaded = _command(server, "preload", name)
    (instance,) = preloaded["instances"]
    assert instance["instance"] == CORE_INSTANCE and instance["result"]["loaded"] == [name], preloaded
    assert instance["pid"] in _worker_pids(server), "the worker answers the control model"


def _command(server, command: str, adapter_ids: str) -> dict:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    inputs = []
    for name, text in ((COMMAND, command), (ADAPTER_IDS, adapter_ids)):
        tensor = grpcclient.InferInput(name, [1], "BYTES")
        tensor.set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
        inputs.append(tensor)
    try:
        return json.loads(client.infer("manylora_control", inputs).as_numpy(RESULT)[0])
    finally:
        client.close()


def test_a_killed_worker_fails_its_requests_and_a_new_one_serves(server, reference_model):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    schema = json.dumps(demo_schemas()[0])
    requests = [protocol.Request(t, schema) for t in demo_texts(8, seed=91, min_words=150, max_words=250)]
    outcomes, stop, threads = closed_loop(server.grpc_url, lambda i: requests[i % 8], 4)
    assert wait_until(lambda: len(outcomes) >= 4, 60), "the load is answered"
    (worker,) = _worker_pids(server)
    os.kill(worker, signal.SIGKILL)
    killed = len(outcomes)
    # the new worker loads its engine (seconds); the clients' requests fail meanwhile
    assert wait_until(lambda: any(o[2] == "ok" for o in outcomes[killed + 8 :]), 120), "a new worker serves"
    assert len(_worker_pids(server)) == 1 and _worker_pids(server) != [worker]
    stop.set()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a client is still waiting"
    failed = [status for _, _, status in outcomes if status != "ok"]
    assert failed, "requests sent while the worker was down failed"
    assert all(status.startswith(GRPC_STATUS["UNAVAILABLE"]) for status in failed), set(failed)
    assert all("worker process is not running" in status for status in failed), set(failed)
    assert all(seconds < 30 for _, seconds, _ in outcomes), max(o[1] for o in outcomes)
    assert client.is_model_ready("gliner2_core"), "no reload was needed"
    for request in requests[:2]:
        answer = client.infer("gliner2", infer_inputs(grpcclient, request.to_arrays()), client_timeout=60)
        got = protocol.parse_result(answer.as_numpy(protocol.RESULT))
        assert not result_differences(got, reference_answer(reference_model, request))
