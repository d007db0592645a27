"""The pipeline with ``front_inflight`` 3 on the gliner2 front, in a real tritonserver: each front
instance answers its batches from pool threads through the requests' response senders. Many
concurrent requests over several dynamic batches, a malformed one among them, all answered
once: the good ones as GLiNER2 answers them, the bad one with its own INVALID_ARG."""

from __future__ import annotations

import json

import pytest
import tritonclient.grpc as grpcclient
from fault_tools import GRPC_STATUS, infer_inputs, pipeline_loads, reference_answer, send_together, write_gliner2_model
from manylora.client import protocol
from tritonclient.utils import InferenceServerException

from manylora.compare import result_differences
from manylora.demo import demo_schemas, demo_texts


@pytest.fixture(scope="module")
def server(tmp_path_factory, triton_server_factory, tiny_checkpoint):
    repo = tmp_path_factory.mktemp("repo-inflight")

    def front(config):
        config.parameters["front_inflight"].string_value = "3"
        config.max_batch_size = 4  # several small batches per instance, some of them in flight together
        config.dynamic_batching.max_queue_delay_microseconds = 20_000

    write_gliner2_model(repo, "gliner2", tiny_checkpoint, edit=front)
    return triton_server_factory(repo, extra_args=["--model-control-mode=explicit", *pipeline_loads()])


def test_batches_in_flight_answer_every_request_as_gliner2(server, reference_model):
    schemas = demo_schemas()
    requests = [
        protocol.Request(t, json.dumps(schemas[i % len(schemas)]), include_confidence=True)
        for i, t in enumerate(demo_texts(24, seed=61))
    ]
    bad = protocol.Request("Some text.", "{broken json")
    batch = [infer_inputs(grpcclient, r.to_arrays()) for r in requests]
    batch.insert(7, infer_inputs(grpcclient, bad.to_arrays()))
    answers = send_together(server.grpc_url, batch)
    error = answers.pop(7)
    assert isinstance(error, InferenceServerException) and error.status() == GRPC_STATUS["INVALID_ARG"]
    for request, answer in zip(requests, answers):
        assert not isinstance(answer, InferenceServerException), answer
        got = protocol.parse_result(answer.as_numpy(protocol.RESULT))
        assert not result_differences(got, reference_answer(reference_model, request))
    # several front batches (max_batch_size 4); that execute() hands them on before they are
    # answered is shown in process (tests/engine/test_post.py): Triton's statistics count a
    # request's compute until its response either way
    stats = grpcclient.InferenceServerClient(server.grpc_url).get_inference_statistics("gliner2").model_stats[0]
    assert stats.execution_count >= 7
