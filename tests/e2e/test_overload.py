"""Overload, end to end: a bounded loopback load at twice the tiny server's capacity.

The model gets a small queue (``default_queue_policy`` in a test copy of config.pbtxt):
at capacity nothing is rejected; at twice the capacity the excess is rejected at once with
UNAVAILABLE, nothing else fails, the server survives, and every answer it gives equals
GLiNER2 (+ PEFT). The counts are printed (``pytest -s``).
"""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
from collections import Counter

import pytest
import tritonclient.grpc as grpcclient
from fault_tools import GRPC_STATUS, References, infer_inputs, send_together, write_gliner2_model
from manylora.client import protocol
from tritonclient.grpc import model_config_pb2
from tritonclient.utils import InferenceServerException

from manylora.compare import result_differences
from manylora.demo import demo_schemas, demo_texts

MAX_BATCH = 8
QUEUE = 16
QUEUE_TIMEOUT_US = 30_000_000  # rejections come from the queue size only
ADAPTERS = ("", "enc-r8", "heads-r8")
CAPACITY_SECONDS = 4.0
OVERLOAD_SECONDS = 10.0
REJECTED = re.compile(r"Exceeds maximum queue size|Request timeout expired")


@pytest.fixture(scope="module")
def overload(tmp_path_factory, triton_server_factory, tiny_checkpoint, demo_adapters, reference_model, peft_reference):
    base = tmp_path_factory.mktemp("overload")
    for name in filter(None, ADAPTERS):
        shutil.copytree(demo_adapters[name], base / "adapters" / name)

    def small_queue(config: model_config_pb2.ModelConfig) -> None:
        config.max_batch_size = MAX_BATCH
        batching = config.dynamic_batching
        batching.max_queue_delay_microseconds = 2000
        batching.default_queue_policy.max_queue_size = QUEUE
        batching.default_queue_policy.default_timeout_microseconds = QUEUE_TIMEOUT_US
        batching.default_queue_policy.timeout_action = model_config_pb2.ModelQueuePolicy.REJECT

    parameters = {"adapter_dir": str(base / "adapters")}
    write_gliner2_model(base / "repo", "gliner2", tiny_checkpoint, parameters, edit=small_queue)
    server = triton_server_factory(base / "repo")
    references = References(reference_model, peft_reference, {n: demo_adapters[n] for n in filter(None, ADAPTERS)})
    schema = json.dumps(demo_schemas()[0])
    pool = [
        protocol.Request(text, schema, adapter=ADAPTERS[i % len(ADAPTERS)], include_confidence=True)
        for i, text in enumerate(demo_texts(12, seed=61))
    ]
    expected = [references.expected(r) for r in pool]
    return server, pool, expected


def _classify(answer, expected) -> str:
    if isinstance(answer, InferenceServerException):
        if answer.status() == GRPC_STATUS["UNAVAILABLE"] and REJECTED.search(answer.message() or ""):
            return "rejected"
        return f"failed: {answer.status()} {answer.message()}"
    differences = result_differences(protocol.parse_result(answer.as_numpy(protocol.RESULT)), expected)
    return f"wrong answer: {differences[:3]}" if differences else "accepted"


def _closed_loop(url: str, pool, expected, concurrency: int, seconds: float) -> Counter:
    """``concurrency`` clients, each sending its next request when the last is answered."""
    counts: Counter = Counter()
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def client(offset: int) -> None:
        with grpcclient.InferenceServerClient(url) as grpc:
            n = offset
            while time.monotonic() < deadline:
                index = n % len(pool)
                try:
                    answer = grpc.infer(protocol.MODEL_NAME, infer_inputs(grpcclient, pool[index].to_arrays()))
                except InferenceServerException as exc:
                    answer = exc
                with lock:
                    counts[_classify(answer, expected[index])] += 1
                n += concurrency

    threads = [threading.Thread(target=client, args=(i,)) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return counts


def _open_loop(url: str, pool, expected, rate: float, seconds: float, burst: int) -> Counter:
    """``burst`` requests at once, then ``rate`` per second whatever the answers: the queue
    must absorb or reject them."""
    grpc = grpcclient.InferenceServerClient(url)
    answers: list = []
    done = threading.Condition()

    def callback(index):
        def store(result, error):
            with done:
                answers.append((index, error if error is not None else result))
                done.notify_all()

        return store

    inputs = [infer_inputs(grpcclient, request.to_arrays()) for request in pool]
    start = time.monotonic()
    sent = 0
    while time.monotonic() - start < seconds:
        delay = start + max(0, sent - burst) / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        grpc.async_infer(protocol.MODEL_NAME, inputs[sent % len(pool)], callback(sent % len(pool)))
        sent += 1
    with done:
        assert done.wait_for(lambda: len(answers) == sent, QUEUE_TIMEOUT_US / 1e6 + 60), "every request is answered"
    grpc.close()
    counts = Counter(_classify(answer, expected[index]) for index, answer in answers)
    counts["sent"] = sent
    return counts


def test_twice_the_capacity_rejects_the_excess_cleanly_and_answers_the_rest_exactly(overload):
    server, pool, expected = overload
    _closed_loop(server.grpc_url, pool, expected, concurrency=4, seconds=1.0)  # warm-up
    # QUEUE clients never overflow a queue of QUEUE: the instance is kept busy, nothing is rejected
    at_capacity = _closed_loop(server.grpc_url, pool, expected, QUEUE, CAPACITY_SECONDS)
    assert set(at_capacity) == {"accepted"}, f"within the queue every request is answered exactly: {at_capacity}"
    capacity = at_capacity["accepted"] / CAPACITY_SECONDS

    burst = 2 * (MAX_BATCH + QUEUE)  # more than a batch and a full queue at once: rejections are certain
    client_cpu = time.process_time()
    overloaded = _open_loop(server.grpc_url, pool, expected, 2 * capacity, OVERLOAD_SECONDS, burst)
    client_cpu = time.process_time() - client_cpu
    sent, accepted, rejected = overloaded.pop("sent"), overloaded.pop("accepted", 0), overloaded.pop("rejected", 0)
    print(
        f"\noverload: capacity {capacity:.1f} req/s (batch {MAX_BATCH}, queue {QUEUE}); a burst of {burst}, then "
        f"{2 * capacity:.1f} req/s for {OVERLOAD_SECONDS:.0f} s: sent {sent}, accepted {accepted} "
        f"({accepted / OVERLOAD_SECONDS:.1f} req/s), rejected {rejected}, failed {sum(overloaded.values())} "
        f"(client CPU {client_cpu:.1f} s)"
    )
    assert not overloaded, f"no crash, no wrong answer, no error but UNAVAILABLE: {dict(overloaded)}"
    assert rejected > 0, "the burst overflows the queue"
    assert accepted > 0, "the server keeps answering"

    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        assert client.is_server_live() and client.is_model_ready(protocol.MODEL_NAME)
    (answer,) = send_together(server.grpc_url, [infer_inputs(grpcclient, pool[0].to_arrays())])
    assert _classify(answer, expected[0]) == "accepted"
