"""End-to-end: a fleet of 300 adapters through 8 GPU slots and 32 host slots.

The real tritonserver serves the committed pipeline on the tiny checkpoint with 300 random rank-16 adapters on encoder
and heads. Every adapter is asked for at once (plus repeats), far more than both tiers hold:
every request is answered, a sample of the answers equals GLiNER2 + PEFT with that adapter
alone, and the metrics show the cache at work (misses, evictions in both tiers, residents
within capacity, batches served in waves).
"""

from __future__ import annotations

import json
import random
import re

import pytest
import torch
import tritonclient.grpc as grpcclient
from fault_tools import infer_inputs, metrics_when, send_together, write_gliner2_model
from manylora.client import protocol

from manylora.compare import result_differences
from manylora.demo import demo_schemas, demo_texts
from manylora.lora.demo_adapters import clone_random_adapters

ADAPTERS, GPU_SLOTS, HOST_SLOTS = 300, 8, 32
REPEATS = 40  # requests for adapters already asked for: some hit the tiers
SAMPLE = 8


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, triton_server_factory, tiny_checkpoint, demo_adapters):
    base = tmp_path_factory.mktemp("fleet")
    folders = clone_random_adapters(
        demo_adapters["enc-heads-r16"], base / "adapters", ADAPTERS, seed=11, dtype=torch.float32
    )
    parameters = {
        "adapter_dir": str(base / "adapters"),
        "max_gpu_adapters": str(GPU_SLOTS),
        "max_cpu_adapters": str(HOST_SLOTS),
    }

    def patient(config):  # a loaded 2-core machine may need longer than the committed 30 s queue policy
        config.dynamic_batching.default_queue_policy.default_timeout_microseconds = 300_000_000

    write_gliner2_model(base / "repo", "gliner2", tiny_checkpoint, parameters, edit=patient, core_edit=patient)
    return triton_server_factory(base / "repo"), {f.name: f for f in folders}


def _send_together(url: str, requests: list) -> list:
    """Every request at once (async gRPC); the InferResult or the exception of each, in order."""
    return send_together(url, [infer_inputs(grpcclient, r.to_arrays()) for r in requests], timeout=600)


def _metric(text: str, name: str, *labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(label in line for label in labels):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_300_adapters_through_8_gpu_and_32_host_slots(fleet, peft_reference):
    server, folders = fleet
    names = sorted(folders)
    rng = random.Random(5)
    picked = names + [rng.choice(names) for _ in range(REPEATS)]
    rng.shuffle(picked)
    texts = demo_texts(len(picked), seed=31, min_words=12, max_words=30)
    schema = json.dumps(demo_schemas()[0])
    requests = [protocol.Request(t, schema, adapter=a, include_confidence=True) for t, a in zip(texts, picked)]

    answers = _send_together(server.grpc_url, requests)
    failed = [(r.adapter, a.status(), a.message()) for r, a in zip(requests, answers) if isinstance(a, Exception)]
    assert not failed, failed[:3]

    from gliner2.inference.schema import Schema

    for index in rng.sample(range(len(requests)), SAMPLE):
        request = requests[index]
        got = protocol.parse_result(answers[index].as_numpy(protocol.RESULT))
        model = peft_reference(folders[request.adapter])
        (expected,) = model.batch_extract([request.text], Schema.from_json(request.schema), include_confidence=True)
        assert not result_differences(got, json.loads(json.dumps(expected)), atol=1e-4), request.adapter

    cache = "manylora_adapter_cache_total"

    def check(metrics):
        assert _metric(metrics, cache, 'event="miss"', 'tier="host"') >= ADAPTERS
        assert _metric(metrics, cache, 'event="evict"', 'tier="host"') >= ADAPTERS - HOST_SLOTS
        assert _metric(metrics, cache, 'event="evict"', 'tier="gpu"') >= ADAPTERS - GPU_SLOTS
        assert _metric(metrics, "manylora_adapters_resident", 'tier="host"') == HOST_SLOTS
        assert _metric(metrics, "manylora_adapters_resident", 'tier="gpu"') == GPU_SLOTS
        assert _metric(metrics, "manylora_adapters_loading") == 0
        # every host copy is packed in GPU-slot layout (all linears at max rank): equal sizes, each at
        # least the adapter's own weights
        host_bytes = int(_metric(metrics, "manylora_adapter_host_bytes"))
        assert host_bytes % HOST_SLOTS == 0 and host_bytes // HOST_SLOTS >= _adapter_bytes(folders[names[0]])
        waves = re.findall(r'manylora_batch_waves_bucket\{.*le="1".*\} (\S+)', metrics)
        batches = _metric(metrics, "manylora_batch_waves_count")
        assert waves and float(waves[0]) < batches, "some dynamic batches needed more than one wave"

    metrics_when(server.metrics_url, check)  # published within metrics_interval of the last call


def _adapter_bytes(folder) -> int:
    from safetensors.torch import load_file

    return sum(t.numel() * 4 for t in load_file(str(folder / "adapter_model.safetensors")).values())
