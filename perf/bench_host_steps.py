"""The pipeline's host-only steps (the fronts' pre and post, the GPU stage's parse, padding,
compaction and packing), timed per row on this machine's CPU.

    python perf/bench_host_steps.py --checkpoint models/demo-tiny [--rows 1024] [--repeats 20]

The GPU stage is one process whose host work bounds it at saturation (about one core-second
per second on the H200, session 9): these are the steps of ``gliner2_core`` that are pure host
work whatever the device, each on the rows of one big call (16 rows per front request, the
benchmarks' entity schema, texts of 60-120 words): parsing the fronts' requests
(``CoreModelHandler._parse``), padding a chunk (``pad_batch``), splitting a chunk's hits into
rows (``compact_dense_begin``'s finish, from tensors on the CPU) and packing the responses
(``_responses``), and with ``core_process`` on the job's message to the worker and back into
rows. The fronts' own per-request steps (pre and post) come first, for the fronts' share of
the host. Prints the best of ``--repeats`` in microseconds per row, one line per step;
an A/B is this script at two commits, paired (whole process) or line by line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import ENTITY_SCHEMA  # noqa: E402  (the benchmarks' schema)


class _Tensor:
    def __init__(self, name, array):
        self.name, self.array = name, array

    def as_numpy(self):
        return self.array


class _Pb:
    """The parts of triton_python_backend_utils that the front's BLS request and the GPU stage's parse and pack use."""

    Tensor = _Tensor

    class InferenceResponse:
        def __init__(self, output_tensors, error=None):
            self.output_tensors, self.error = output_tensors, error

    class InferenceRequest:  # what a front's BLS call sends: here, its inputs by name
        def __init__(self, model_name, inputs, requested_output_names):
            self.inputs = {t.name: t.array for t in inputs}

    @staticmethod
    def get_input_tensor_by_name(request, name):
        return _Tensor(name, request.inputs[name]) if name in request.inputs else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    from manylora.config import EngineConfig
    from manylora.demo import demo_texts
    from manylora.engine import Engine, Request
    from manylora.serving import CallDeadline, CoreModelHandler, TritonModelHandler

    engine = Engine(EngineConfig.from_parameters({"checkpoint": str(args.checkpoint)}))
    core = CoreModelHandler.__new__(CoreModelHandler)
    core.pb_utils, core.engine, core.vocab = _Pb, engine, len(engine.processor.tokenizer)
    schema = json.dumps(ENTITY_SCHEMA)
    texts = demo_texts(args.rows, seed=5, min_words=60, max_words=120)
    prepared = [engine.pre.prepare(i, Request(t, schema)) for i, t in enumerate(texts)]

    front = TritonModelHandler.__new__(TritonModelHandler)  # the fronts' own BLS request building
    front.pb_utils, front.core_model = _Pb, "gliner2_core"
    requests = [front._core_request(prepared[i : i + 16]) for i in range(0, args.rows, 16)]
    job = core._parse(requests)
    items = job[1]
    answers = engine.run_core(items)
    records = [engine.pre.core_record(ids, words, schema)[0] for ids, words, *_ in items]
    # one chunk's heads on the CPU, stopped before its host part (compact_dense_begin's finish)
    chunk = [engine.prepare(i, Request(t, schema)) for i, t in enumerate(texts)]
    with torch.inference_mode():
        batch, states, slots = engine.forward(chunk)
        finish = engine.compact_begin(chunk, batch, states, slots)

    requests_in = [Request(t, schema) for t in texts]
    # a stream's new words (amounts, names): each repeat other texts, so the word cache misses
    fresh = iter(
        [
            [Request(t, schema) for t in demo_texts(args.rows, seed=1000 + k, min_words=60, max_words=120)]
            for k in range(args.repeats)
        ]
    )
    deadline = CallDeadline(20.0)
    from manylora.core_process import decode_job, encode_job, unframe

    message = encode_job(0, job, 0.0)
    steps = {
        "front: pre (Preprocessor.prepare)": lambda: [engine.pre.prepare(i, r) for i, r in enumerate(requests_in)],
        "front: pre, texts not seen before": lambda: [engine.pre.prepare(i, r) for i, r in enumerate(next(fresh))],
        # the thread each front batch's BLS call runs on (core_timeout), here around a no-op call
        "front: the GPU-stage call's deadline (CallDeadline.call, one per 16 rows)": lambda: [
            deadline.call(lambda: None) for _ in requests
        ],
        "front: post (PostDecoder.decode)": lambda: [
            engine.post.decode(row, q.record, q.metadata, 0.5) for q, row in zip(prepared, answers)
        ],
        "parse (CoreModelHandler._parse)": lambda: core._parse(requests),
        "pad (RecordBuilder.pad_batch)": lambda: engine.records.pad_batch(records),
        "compact rows (compact_dense_begin's finish)": finish,
        "pack (CoreModelHandler._responses)": lambda: core._responses(job, answers),
        # core_process on: what the socket between the stub and its worker adds per call
        "core_process: the stub's job message (encode_job)": lambda: encode_job(0, job, 0.0),
        "core_process: the worker's job (decode_job)": lambda: decode_job(*unframe(message)),
    }
    for name, step in steps.items():
        best = float("inf")
        for _ in range(args.repeats):
            started = time.perf_counter()
            with torch.inference_mode():
                step()
            best = min(best, time.perf_counter() - started)
        print(f"{name}: {best * 1e6 / args.rows:.1f} us/row (best of {args.repeats}, {args.rows} rows)")
    # a word no cache holds: transformers' tokenize against the backend path pre uses
    import random

    from manylora.preprocess import word_tokenizer

    rng = random.Random(7)
    words = [
        f"{rng.randint(0, 10**9)}" if k % 2 else "".join(rng.choices("abcdefghijklmnop", k=7)) for k in range(4000)
    ]
    tokenizer = engine.processor.tokenizer
    for name, split in (
        ("transformers' tokenize", tokenizer.tokenize),
        ("pre's word_tokenizer", word_tokenizer(tokenizer)),
    ):
        best = float("inf")
        for _ in range(args.repeats):
            started = time.perf_counter()
            for word in words:
                split(word)
            best = min(best, time.perf_counter() - started)
        print(
            f"front: a new word's pieces, {name}: {best * 1e6 / len(words):.1f} us/word (best of {args.repeats}, {len(words)} words)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
