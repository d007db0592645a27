"""Bounded memory end to end (issue 17, item 4): a flood of distinct large inputs through the
real tritonserver leaves the CPU fronts' and the GPU stage's resident memory flat.

Each round sends, together (one dynamic batch), distinct huge one-word texts, schemas over
the token limit and texts of hundreds of distinct words (all refused with INVALID_ARG),
accepted texts with words too long to cache and accepted new schemas, next to good requests
whose answers must equal GLiNER2 (+ PEFT). The server runs with ``max_request_tokens`` 128,
so that the largest refused inputs are 4,096 characters and cheap to tokenize; it is its
own server for that reason (the catalogue's limit of 4,096 tokens would make each huge text
32 times larger). Before the caches were bounded these rounds grew a front by about 100 MiB.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import string
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
from fault_tools import References, execution_counts, infer_inputs, send_together, wait_until, write_gliner2_model
from manylora.client import protocol
from tritonclient.utils import InferenceServerException

from manylora.compare import result_differences
from manylora.demo import demo_schemas, demo_texts

LIMIT = 128  # max_request_tokens of the front and the GPU stage
BATCH_DELAY_US = 500_000  # a round goes out well within this: one dynamic batch
ROUNDS = 8
ADAPTER = "enc-r8"
SCHEMA = json.dumps({"entities": ["person", "organization"]})
# VmRSS growth allowed per stub between the end of the first round and the end of the last:
# allocator slack only, since refused inputs leave nothing and the accepted new schemas and
# long-word texts of seven rounds hold well under 1 MiB in the bounded caches.
RSS_MARGIN_KIB = 24 << 10
TOO_LONG = re.compile(rf"^text and schema are \d+ tokens, above the limit of {LIMIT} \(max_request_tokens\)")


@pytest.fixture(scope="module")
def bounded(tmp_path_factory, triton_server_factory, tiny_checkpoint, demo_adapters, reference_model, peft_reference):
    base = tmp_path_factory.mktemp("bounded-memory")
    shutil.copytree(demo_adapters[ADAPTER], base / "adapters" / ADAPTER)

    def batch_delay(config):
        config.dynamic_batching.max_queue_delay_microseconds = BATCH_DELAY_US

    parameters = {"adapter_dir": str(base / "adapters"), "max_request_tokens": str(LIMIT)}
    write_gliner2_model(base / "repo", "gliner2", tiny_checkpoint, parameters, edit=batch_delay)
    server = triton_server_factory(base / "repo")
    return server, References(reference_model, peft_reference, {ADAPTER: demo_adapters[ADAPTER]})


def _stubs(server_pid: int) -> dict[str, int]:
    """Model instance name (gliner2_0_0, gliner2_core_0_0, ...) -> its Python backend stub's pid."""
    stubs = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            status = (proc / "status").read_text()
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("PPid:")), None)
        if ppid != server_pid or not any(a.endswith(b"triton_python_backend_stub") for a in args):
            continue
        names = [a.decode() for a in args if re.fullmatch(rb"gliner2(_core)?_\d+_\d+", a)]
        if names:
            stubs[names[0]] = int(proc.name)
    return stubs


def _rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))


def _word(rng: random.Random, n: int) -> str:
    return "".join(rng.choices(string.ascii_lowercase, k=n))


def _round(rng: random.Random, seed: int) -> tuple[list, list]:
    """(bad requests, good requests) of one round, every large one distinct."""
    bad = [protocol.Request(_word(rng, 4_000), SCHEMA) for _ in range(90)]  # one word, ~3,400 tokens
    for _ in range(35):  # a schema of ~500 tokens, over the limit alone, with a short text
        labels = [f"{_word(rng, 6)} {j}" + " word" * 8 for j in range(20)]
        bad.append(protocol.Request("Tim Cook runs Apple.", json.dumps({"entities": labels})))
    bad += [protocol.Request(" ".join(_word(rng, 6) for _ in range(300)), SCHEMA) for _ in range(4)]
    texts = demo_texts(4, seed=seed)
    good = [
        protocol.Request(
            " ".join(t.split()[:20]), json.dumps(demo_schemas()[2 * (i % 2)]), adapter=ADAPTER if i % 2 else ""
        )
        for i, t in enumerate(texts)
    ]
    # accepted, and new: words over the cache's 64 characters, and a schema never seen before
    good += [protocol.Request(f"Tim Cook met {'the' * 22}{_word(rng, 3)} in Cupertino.", SCHEMA) for _ in range(2)]
    good += [protocol.Request("Tim Cook runs Apple.", json.dumps({"entities": [_word(rng, 7), "person"]}))]
    return bad, good


def test_a_flood_of_distinct_large_inputs_leaves_the_stubs_memory_flat(bounded):
    server, references = bounded
    rng = random.Random(47)
    rss: dict[str, list[int]] = {}
    for index in range(ROUNDS):
        bad, good = _round(rng, seed=300 + index)
        expected = [references.expected(r) for r in good]  # before sending: the batch stays whole
        items = bad + good
        order = list(range(len(items)))
        rng.shuffle(order)
        before = execution_counts(server.grpc_url)
        answers = send_together(server.grpc_url, [infer_inputs(grpcclient, items[i].to_arrays()) for i in order])
        # Triton counts a batch just after it answers: wait for it
        wait_until(lambda: execution_counts(server.grpc_url)[1] - before[1] >= len(items), 10)
        after = execution_counts(server.grpc_url)
        by_item = dict(zip(order, answers))
        problems = []
        for i, request in enumerate(bad):
            answer = by_item[i]
            if not isinstance(answer, InferenceServerException):
                problems.append(f"bad {i} answered")
            elif answer.status() != "StatusCode.INVALID_ARGUMENT" or not TOO_LONG.search(answer.message() or ""):
                problems.append(f"bad {i}: {answer.status()} {answer.message()[:200]}")
        for k, (request, want) in enumerate(zip(good, expected)):
            answer = by_item[len(bad) + k]
            if isinstance(answer, Exception):
                problems.append(f"good {k} failed: {answer}")
            else:
                got = protocol.parse_result(answer.as_numpy(protocol.RESULT))
                problems += [f"good {k}: {d}" for d in result_differences(got, want)]
        assert not problems, "\n".join(problems[:20])
        assert after[1] - before[1] == len(items) and after[0] - before[0] <= 2, "the round shares its batches"
        for name, pid in _stubs(server.process.pid).items():
            rss.setdefault(name, []).append(_rss_kib(pid))
    assert {n.startswith("gliner2_core") for n in rss} == {True, False}, f"fronts and GPU stage found: {sorted(rss)}"
    grown = {name: values[-1] - values[0] for name, values in rss.items()}
    print("VmRSS KiB per round:", rss)
    assert all(g < RSS_MARGIN_KIB for g in grown.values()), f"VmRSS growth (KiB) after the first round: {grown}"
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        assert client.is_server_ready() and client.is_model_ready("gliner2") and client.is_model_ready("gliner2_core")
    request = protocol.Request(" ".join(demo_texts(1, seed=99)[0].split()[:20]), SCHEMA, adapter=ADAPTER)
    (answer,) = send_together(server.grpc_url, [infer_inputs(grpcclient, request.to_arrays())])
    assert not result_differences(protocol.parse_result(answer.as_numpy(protocol.RESULT)), references.expected(request))
