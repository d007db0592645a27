"""The engine answers exactly what GLiNER2.batch_extract answers (structure exact, scores 1e-4).

GLiNER2 itself is the reference; nothing here compares against our own earlier outputs.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from manylora.compare import result_differences
from manylora.demo import demo_schemas, demo_texts
from manylora.engine import Request

EDGE_TEXTS = [
    "Apple",
    "Tim Cook leads Apple in Cupertino",  # no final period: GLiNER2 adds one
    "Did Marie Curie work in Paris?",
    "¡Hola! José García moved from São Paulo to Zürich — in 2019 — with €1,200.",
    "IBM, Microsoft and Google (Alphabet) met on 12/03/2024 at 9:30am; no deal.",
    "   Leading and trailing spaces around Berlin and Munich.   ",
    "UPPER CASE TEXT ABOUT NASA AND THE EUROPEAN SPACE AGENCY!",
    "line one about Oslo\nline two about Bergen\ttabbed.",
]


def _cases():
    texts = demo_texts(48, seed=7) + EDGE_TEXTS + demo_texts(2, seed=8, min_words=250, max_words=300)
    schemas = demo_schemas()
    return [(text, schemas[i % len(schemas)]) for i, text in enumerate(texts)]


def _reference(model, cases, **options):
    from gliner2.inference.schema import Schema

    texts = [t for t, _ in cases]
    schemas = [Schema.from_dict(s) for _, s in cases]
    return model.batch_extract(texts, schemas, batch_size=8, **options)


def _assert_same(got, expected, cases):
    failures = []
    for (text, schema), g, e in zip(cases, got, expected):
        diffs = result_differences(g, e, atol=1e-4)
        if diffs:
            failures.append(f"text={text[:60]!r} schema={json.dumps(schema)[:80]}: {diffs[:3]}")
    assert not failures, f"{len(failures)} of {len(cases)} differ:\n" + "\n".join(failures[:10])


def test_cases_cover_all_task_kinds():
    kinds = set()
    for _, schema in _cases():
        kinds |= {k for k in ("entities", "classifications", "relations", "structures") if schema.get(k)}
        if isinstance(schema.get("entities"), dict):
            kinds.add("entity descriptions")
        for c in schema.get("classifications", []):
            kinds.add("multi_label" if c.get("multi_label") else "single_label")
        for s in (schema.get("structures") or {}).values():
            if any(f.get("choices") for f in s["fields"]):
                kinds.add("choices")
    assert {
        "entities",
        "entity descriptions",
        "classifications",
        "single_label",
        "multi_label",
        "relations",
        "structures",
        "choices",
    } <= kinds
    assert len(_cases()) >= 50


def test_mixed_batch_equals_gliner2(tiny_engine, reference_model):
    cases = _cases()
    expected = _reference(reference_model, cases, include_confidence=True)
    got = tiny_engine.run([Request(t, json.dumps(s), include_confidence=True) for t, s in cases])
    _assert_same(got, expected, cases)
    # the calibrated demo heads must make this comparison meaningful: spans are found
    assert sum(json.dumps(r).count('"confidence"') for r in got) > len(cases)


@pytest.mark.parametrize("threshold,include_spans", [(0.3, True), (0.8, False)])
def test_threshold_and_spans_options(tiny_engine, reference_model, threshold, include_spans):
    cases = _cases()[:20]
    expected = _reference(
        reference_model, cases, threshold=threshold, include_confidence=True, include_spans=include_spans
    )
    got = tiny_engine.run(
        [
            Request(t, json.dumps(s), threshold=threshold, include_confidence=True, include_spans=include_spans)
            for t, s in cases
        ]
    )
    _assert_same(got, expected, cases)


@pytest.mark.parametrize("max_len", [3, 8])
def test_max_len_cuts_the_text_as_gliner2(tiny_engine, reference_model, max_len):
    """GLiNER2's max_len (MAX_LEN): at most that many word tokens of each text are read, the
    text stays whole for offsets; spans are only found in what was read. Rows with and without
    it share one call."""
    cases = _cases()[:16]
    expected = _reference(reference_model, cases, include_confidence=True, include_spans=True, max_len=max_len)
    full = _reference(reference_model, cases, include_confidence=True, include_spans=True)
    requests = [
        Request(t, json.dumps(s), include_confidence=True, include_spans=True, max_len=max_len) for t, s in cases
    ]
    got = tiny_engine.run(
        requests + [Request(t, json.dumps(s), include_confidence=True, include_spans=True) for t, s in cases]
    )
    _assert_same(got[: len(cases)], expected, cases)
    _assert_same(got[len(cases) :], full, cases)
    assert expected != full, "max_len cut something: not vacuous"


def test_requests_with_different_options_in_one_call(tiny_engine, reference_model):
    cases = _cases()[:6]
    requests = [
        Request(t, json.dumps(s), threshold=0.3 + 0.1 * i, include_confidence=bool(i % 2))
        for i, (t, s) in enumerate(cases)
    ]
    got = tiny_engine.run(requests)
    for request, case, g in zip(requests, cases, got):
        (e,) = _reference(
            reference_model, [case], threshold=request.threshold, include_confidence=request.include_confidence
        )
        assert not result_differences(g, e), (case, g, e)


def test_token_budget_splits_batches_without_changing_answers(tiny_checkpoint, reference_model):
    from manylora.config import EngineConfig
    from manylora.engine import Engine

    engine = Engine(EngineConfig.from_parameters({"checkpoint": str(tiny_checkpoint), "max_batch_tokens": "300"}))
    cases = _cases()[:12]
    chunks = engine._chunks([engine.prepare(i, Request(t, json.dumps(s))) for i, (t, s) in enumerate(cases)])
    assert len(chunks) > 1
    assert all(len(c) * -(-max(p.num_tokens for p in c) // 16) * 16 <= 300 or len(c) == 1 for c in chunks)
    got = engine.run([Request(t, json.dumps(s), include_confidence=True) for t, s in cases])
    _assert_same(got, _reference(reference_model, cases, include_confidence=True), cases)


def test_encoder_states_equal_transformers_on_checkpoint(tiny_engine, reference_model, tiny_checkpoint):
    from gliner2.inference.schema import Schema

    cases = _cases()[:8]
    batch = reference_model.processor.collate_fn_inference([(t, Schema.from_dict(s).build()) for t, s in cases])
    with torch.no_grad():
        expected = reference_model.encoder(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask
        ).last_hidden_state
    got = tiny_engine.encoder(batch.input_ids, batch.attention_mask)
    mask = batch.attention_mask.bool()
    torch.testing.assert_close(got[mask], expected[mask], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "request_kwargs,message",
    [
        (dict(text="x", schema="{not json"), "not valid JSON"),
        (dict(text="x", schema="[1, 2]"), "must be a JSON object"),
        (dict(text="x", schema="{}"), "At least one of entities"),
        (dict(text="x", schema='{"entities": []}'), "cannot be empty"),
        (dict(text="x", schema='{"entitys": ["a"]}'), "not a valid GLiNER2 schema"),
        (dict(text="x", schema='{"classifications": [{"task": "t", "labels": ["only"]}]}'), "labels"),
        (dict(text="x", schema='{"entities": ["a"]}', adapter="nope"), "unknown adapter"),
    ],
)
def test_bad_requests_fail_alone(tiny_engine, reference_model, request_kwargs, message):
    good = Request("Ada Lovelace met Charles Babbage in London.", json.dumps({"entities": ["person", "city"]}))
    bad = Request(**request_kwargs)
    got = tiny_engine.run([good, bad, good])
    assert getattr(got[1], "code", None) in ("INVALID_ARG", "NOT_FOUND")
    assert message in got[1].message
    (expected,) = _reference(reference_model, [(good.text, json.loads(good.schema))])
    assert not result_differences(got[0], expected) and not result_differences(got[2], expected)


def test_long_texts_are_refused_with_the_limit(tiny_checkpoint):
    from manylora.config import EngineConfig
    from manylora.engine import Engine

    engine = Engine(EngineConfig.from_parameters({"checkpoint": str(tiny_checkpoint), "max_request_tokens": "64"}))
    schema = json.dumps({"entities": ["person"]})
    short, long_, huge = "Ada met Grace.", " ".join(["word"] * 100), "x" * 10_000
    got = engine.run([Request(short, schema), Request(long_, schema), Request(huge, schema)])
    assert isinstance(got[0], dict)
    assert got[1].code == "INVALID_ARG" and "above the limit of 64" in got[1].message
    assert got[2].code == "INVALID_ARG" and "characters" in got[2].message


def test_out_of_memory_splits_the_batch(tiny_engine, reference_model, monkeypatch):
    cases = _cases()[:8]
    real_forward = tiny_engine.forward
    sizes = []

    def forward(chunk):
        sizes.append(len(chunk))
        if len(chunk) > 2:
            raise torch.cuda.OutOfMemoryError("simulated")
        return real_forward(chunk)

    monkeypatch.setattr(tiny_engine, "forward", forward)
    got = tiny_engine.run([Request(t, json.dumps(s), include_confidence=True) for t, s in cases])
    assert sizes[0] == 8 and max(sizes[1:]) <= 4 and 2 in sizes
    _assert_same(got, _reference(reference_model, cases, include_confidence=True), cases)


def _pipeline_steps(engine, monkeypatch, failing: str) -> tuple[list, list]:
    """Run 40 cases in chunks of a 1,024-token budget, logging each chunk step (A forward, B
    heads, C host step) in ``steps``; the second chunk's ``failing`` step ("A" or "C") raises
    once, logged as "!" after it. Returns (steps, the answers)."""
    cases = _cases()[:40]
    steps: list[str] = []
    real_forward, real_begin = engine.forward, engine.compact_begin

    def fail_once(step: str) -> None:
        steps.append(step)
        if step == failing and steps.count(step) == 2 and "!" not in steps:
            steps.append("!")
            raise RuntimeError(f"simulated failure in step {step}")

    def forward(chunk):
        fail_once("A")
        return real_forward(chunk)

    def compact_begin(chunk, *launched):
        steps.append("B")
        finish = real_begin(chunk, *launched)

        def logged_finish():
            fail_once("C")
            return finish()

        return logged_finish

    monkeypatch.setattr(engine, "config", dataclasses.replace(engine.config, max_batch_tokens=1024))
    monkeypatch.setattr(engine, "forward", forward)
    monkeypatch.setattr(engine, "compact_begin", compact_begin)
    return steps, engine.run([Request(t, json.dumps(s), include_confidence=True) for t, s in cases])


def test_chunk_pipeline_order_and_a_failing_host_step(tiny_engine, reference_model, monkeypatch):
    """Several chunks run as a pipeline: chunk k's host step C (its rows) comes after chunk
    k+1's forward (A) and before its heads (B). A chunk whose C raises is answered again
    without the pipeline; every answer still equals GLiNER2's."""
    steps, got = _pipeline_steps(tiny_engine, monkeypatch, failing="C")
    assert "!" in steps
    pipelined = "".join(steps).split("ABC")[0]  # up to the chunk the failure runs again alone
    assert pipelined.startswith("ABACBAC!"), steps
    cases = _cases()[:40]
    _assert_same(got, _reference(reference_model, cases, include_confidence=True), cases)


def test_a_failing_forward_is_run_again_after_the_chunk_before_is_finished(tiny_engine, reference_model, monkeypatch):
    """Chunk k+1's forward (A) raises once: chunk k's host step C runs first, then chunk k+1 is
    answered without the pipeline. A rerun replays the heads' CUDA graphs on a GPU, whose
    outputs chunk k's C still reads (lora.head_graphs), so the order matters; every answer
    still equals GLiNER2's."""
    steps, got = _pipeline_steps(tiny_engine, monkeypatch, failing="A")
    assert "".join(steps).startswith("ABA!CAB"), steps  # C of chunk 0, then chunk 1 run again
    cases = _cases()[:40]
    _assert_same(got, _reference(reference_model, cases, include_confidence=True), cases)


def test_a_chunk_run_again_in_the_pipeline_leaves_the_next_chunk_its_adapters(
    tiny_checkpoint, demo_adapters, peft_reference, monkeypatch
):
    """One GPU slot, two adapters with head LoRA: a wave (chunk) each. Chunk 0's host step C
    fails once and chunk 0 runs again alone, after chunk 1's forward and before its heads;
    that run takes the slot. Chunk 1's heads must still read chunk 1's adapter (they once
    read chunk 0's). Every answer equals GLiNER2 + PEFT with the row's adapter."""
    from gliner2.inference.schema import Schema

    import manylora.engine as engine_module
    from manylora.config import EngineConfig
    from manylora.demo import demo_schemas
    from manylora.engine import Engine

    root = next(iter(demo_adapters.values())).parent
    values = {"checkpoint": str(tiny_checkpoint), "adapter_dir": str(root), "max_gpu_adapters": "1"}
    engine = Engine(EngineConfig.from_parameters(values))
    schema = json.dumps(demo_schemas()[0])
    names = ["heads-r8", "enc-heads-r16"]
    requests = [
        Request(t, schema, adapter=names[i % 2], include_confidence=True)
        for i, t in enumerate(demo_texts(6, seed=3, min_words=8, max_words=20))
    ]
    real, failed = engine_module.compact_dense_begin, []

    def failing_once(*args, **kwargs):
        finish = real(*args, **kwargs)
        if failed:
            return finish

        def boom():
            failed.append(True)
            raise RuntimeError("simulated failure in step C")

        return boom

    monkeypatch.setattr(engine_module, "compact_dense_begin", failing_once)
    assert len(engine._chunks([engine.prepare(i, r) for i, r in enumerate(requests)])) == 2
    got = engine.run(requests)
    assert failed == [True]
    for request, answer in zip(requests, got):
        model = peft_reference(demo_adapters[request.adapter])
        (expected,) = model.batch_extract([request.text], Schema.from_json(request.schema), include_confidence=True)
        assert result_differences(answer, expected, atol=1e-4) == [], request.adapter
