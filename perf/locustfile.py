"""Locust load test of the gliner2 model over gRPC and HTTP, built on tritonclient.

Each simulated user sends one GLiNER2 request at a time with a random demo text and a
random adapter (uniform over the adapter folder, or none), and reports every answer or
error to locust under the name of its protocol.

    MANYLORA_ADAPTERS=models/demo-tiny-adapters locust -f perf/locustfile.py --headless \\
        -u 64 -r 16 -t 60s -H localhost --csv perf/results/locust
    # ports: MANYLORA_GRPC_PORT (8001), MANYLORA_HTTP_PORT (8000); user classes: GrpcUser, HttpUser
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

import gevent
from locust import User, between, task

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import ENTITY_SCHEMA  # noqa: E402
from manylora.client import protocol  # noqa: E402
from manylora.client.transport import infer_inputs  # noqa: E402

from manylora.demo import demo_texts  # noqa: E402

TEXTS = demo_texts(256, seed=7)
SCHEMA = json.dumps(ENTITY_SCHEMA)


def _adapters() -> list[str]:
    folder = os.environ.get("MANYLORA_ADAPTERS", "")
    if not folder:
        return [""]
    return sorted(p.name for p in Path(folder).iterdir() if (p / "adapter_model.safetensors").is_file()) or [""]


ADAPTERS = _adapters()


class _TritonUser(User):
    abstract = True
    wait_time = between(0, 0.01)
    protocol_name = ""
    port_env, default_port = "", 0

    def on_start(self):
        host = (self.host or "localhost").split("://")[-1].split(":")[0]
        self.url = f"{host}:{os.environ.get(self.port_env, self.default_port)}"
        self.client = self.make_client(self.url)

    @task
    def extract(self):
        request = protocol.Request(random.choice(TEXTS), SCHEMA, adapter=random.choice(ADAPTERS))
        started = time.perf_counter()
        exception, length = None, 0
        try:
            response = self.call(
                self.client.infer,
                protocol.MODEL_NAME,
                infer_inputs(self.protocol_name, request),
                headers=protocol.routing_headers(request),  # adapter-affinity gateways route on it
            )
            length = len(response.as_numpy(protocol.RESULT).reshape(-1)[0])
        except Exception as exc:  # reported to locust as a failure
            exception = exc
        self.environment.events.request.fire(
            request_type=self.protocol_name,
            name="gliner2",
            response_time=(time.perf_counter() - started) * 1e3,
            response_length=length,
            exception=exception,
            context={},
        )


class GrpcUser(_TritonUser):
    protocol_name, port_env, default_port = "grpc", "MANYLORA_GRPC_PORT", 8001

    @staticmethod
    def call(fn, *args, **kwargs):
        # grpcio blocks the gevent loop: run each call on gevent's OS-thread pool instead
        hub = gevent.get_hub()
        hub.threadpool.maxsize = max(hub.threadpool.maxsize, 256)
        return hub.threadpool.apply(fn, args, kwargs)

    @staticmethod
    def make_client(url):
        import tritonclient.grpc as grpcclient

        return grpcclient.InferenceServerClient(url)


class HttpUser(_TritonUser):
    protocol_name, port_env, default_port = "http", "MANYLORA_HTTP_PORT", 8000

    @staticmethod
    def call(fn, *args, **kwargs):  # tritonclient.http is built on geventhttpclient: cooperative already
        return fn(*args, **kwargs)

    @staticmethod
    def make_client(url):
        import tritonclient.http as httpclient

        return httpclient.InferenceServerClient(url)
