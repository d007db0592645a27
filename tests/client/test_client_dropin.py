"""The clients as drop-in GLiNER2 2.1.0: signatures, builders, formatting, empty text, long documents.

Where behavior is checked against GLiNER2 itself, a fake transport answers each request
with GLiNER2 on the tiny demo checkpoint (what the server's engine reproduces; the engine
is checked against GLiNER2 elsewhere), so the client's own parts (schemas it builds, the
answers it gives without asking, chunking and merging) meet GLiNER2's end to end.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import random
import subprocess
import sys

import numpy as np
import pytest
from gliner2.inference import chunking as g2_chunking
from gliner2.inference import runtime as g2_runtime
from gliner2.inference.schema import Schema
from manylora.client import ManyLoRAClient, ManyLoRAError, protocol
from manylora.client import client as client_lib
from manylora.client.aio import AsyncManyLoRAClient
from tritonclient.utils import InferenceServerException

from manylora.compare import result_differences

LOCAL_ONLY = {"from_api"}  # GLiNER2's classmethod that makes an API client instead of a model
PUBLIC = sorted(
    name
    for name, value in vars(g2_runtime.ExtractorRuntimeMixin).items()
    if not name.startswith("_") and callable(getattr(value, "__func__", value)) and name not in LOCAL_ONLY
)


class Response:
    def __init__(self, result):
        self._array = protocol.result_array(result)

    def as_numpy(self, name):
        return self._array if name == protocol.RESULT else None


class GLiNER2Transport:
    """Answers each request with GLiNER2 (or ``answer``), records what was sent."""

    def __init__(self, model=None, answer=None, fail=None, max_len=None):
        self.model, self.answer, self.fail = model, answer, fail or {}
        # GLiNER2's *_long extract each chunk with max_len=chunk_size: the client sends it (MAX_LEN)
        # and the answer uses the request's own; ``max_len`` is the chunk size a test expects
        self.max_len = max_len
        self.sent = []

    def respond(self, request):
        self.sent.append(request)
        if request.text in self.fail:
            raise self.fail[request.text]
        if self.answer is not None:
            return Response(self.answer(request))
        schema = Schema.from_dict(json.loads(request.schema))
        result = self.model.extract(
            request.text,
            schema,
            request.threshold,
            True,
            request.include_confidence,
            request.include_spans,
            max_len=request.max_len or None,
        )
        return Response(json.loads(json.dumps(result)))

    def infer(self, model_name, request):
        return self.respond(request)

    def submit(self, model_name, request):
        future = concurrent.futures.Future()
        try:
            future.set_result(self.respond(request))
        except Exception as exc:
            future.set_exception(exc)
        return future

    def close(self):
        pass


def make_client(transport, **kwargs) -> ManyLoRAClient:
    client = ManyLoRAClient("localhost:1", **kwargs)
    client._transport.close()
    client._transport = transport
    return client


def make_aio_client(transport, **kwargs) -> AsyncManyLoRAClient:
    client = AsyncManyLoRAClient("localhost:1", **kwargs)

    async def infer(request):  # the seam below Request: the wire itself is tritonclient's
        await asyncio.sleep(random.uniform(0, 0.002))
        try:
            response = transport.respond(request)
        except Exception as exc:
            raise client_lib.error_from_exception(exc) from exc
        return client_lib._decode_response(response)

    client.infer = infer
    return client


@pytest.fixture(scope="module")
def gliner2(reference_model):
    return reference_model


# ------------------------------------------------------------------ signatures


def _positional(function) -> list[tuple[str, object]]:
    parameters = list(inspect.signature(function).parameters.values())[1:]  # without self
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [(p.name, p.default) for p in parameters if p.kind in kinds]


@pytest.mark.parametrize("cls", [ManyLoRAClient, AsyncManyLoRAClient])
@pytest.mark.parametrize("name", PUBLIC)
def test_every_gliner2_method_has_gliner2s_positional_parameters_and_defaults(cls, name):
    theirs = _positional(getattr(g2_runtime.ExtractorRuntimeMixin, name))
    ours = _positional(getattr(cls, name))
    assert ours == theirs, f"{cls.__name__}.{name}"
    extra = set(inspect.signature(getattr(cls, name)).parameters) - {"self"} - {n for n, _ in theirs}
    assert extra <= {"adapter", "raise_on_error"}
    for extra_name in extra:
        assert inspect.signature(getattr(cls, name)).parameters[extra_name].kind is inspect.Parameter.KEYWORD_ONLY


def test_the_public_list_is_gliner2s_whole_extraction_api():
    assert {"extract", "batch_extract", "extract_long", "format_results", "create_schema"} <= set(PUBLIC)
    assert sum(name.endswith("_long") for name in PUBLIC) == 10


# -------------------------------------------------------------------- builders


ENTITY_TYPES = [
    ["person", "company"],
    "person",
    {"person": "a human", "company": ""},
    {"person": {"description": "a human", "dtype": "str", "threshold": 0.3}, "date": {}},
    {"person": {"dtype": "str"}, "x": 3},
]
RELATION_TYPES = [["works_for", "lives_in"], "works_for", {"works_for": "employment", "x": {"threshold": 0.2}}]
TASKS = [
    {"sentiment": ["pos", "neg"]},
    {"sentiment": {"pos": "good", "neg": "bad"}},
    {
        "topic": {"labels": ["a", "b", "c"], "multi_label": True, "cls_threshold": 0.3, "top_k": 2},
        "tone": {"labels": ["x", "y"], "examples": [("t", "x")], "prompt": "tone?", "class_act": "softmax"},
    },
]
STRUCTURES = [
    {"product": ["name::str", "price::str::the price", "tags", "kind::[a|b]", "mode::[x|y]::list::how"]},
    {"p": [{"name": "n", "dtype": "str", "choices": ["u", "v"], "description": "d"}], "q": ["a", "a::str"]},
]


def _gliner2_dict(builder) -> str:
    return json.dumps(builder.to_dict(), ensure_ascii=False)


@pytest.mark.parametrize("entity_types", ENTITY_TYPES)
def test_entity_schema_is_gliner2s(entity_types):
    ours = client_lib.entities_schema(entity_types)
    assert ours.json == _gliner2_dict(Schema().entities(entity_types))
    schema = Schema().entities(entity_types)
    assert ours.scalar_labels == g2_runtime.ExtractorRuntimeMixin._scalar_entity_labels(schema)


@pytest.mark.parametrize("relation_types", RELATION_TYPES)
def test_relation_schema_is_gliner2s(relation_types):
    assert client_lib.relations_schema(relation_types).json == _gliner2_dict(Schema().relations(relation_types))


@pytest.mark.parametrize("tasks", TASKS)
def test_classification_schema_is_gliner2s(tasks, gliner2):
    assert client_lib.classification_schema(tasks).json == _gliner2_dict(gliner2._classification_schema(tasks))


@pytest.mark.parametrize("structures", STRUCTURES)
def test_json_schema_is_gliner2s_on_span_models(structures, gliner2):
    assert not getattr(gliner2, "enable_records", False)
    assert client_lib.json_schema(structures).json == _gliner2_dict(gliner2._json_schema(structures))


def test_builders_refuse_what_gliner2_refuses():
    with pytest.raises(ValueError, match="Threshold"):
        client_lib.entities_schema({"a": {"threshold": 2}})
    with pytest.raises(ValueError, match="cls_threshold"):
        client_lib.classification_schema({"t": {"labels": ["a"], "cls_threshold": 1.5}})
    with pytest.raises(ValueError, match="Invalid entity_types"):
        client_lib.entities_schema(3)
    with pytest.raises(client_lib.SchemaError, match="no task"):
        client_lib.entities_schema([])


def test_json_schema_methods_do_not_import_torch_or_gliner2():
    code = """
import sys, concurrent.futures
from manylora.client import ManyLoRAClient, protocol
class T:
    def infer(self, m, r): return R()
    def submit(self, m, r):
        f = concurrent.futures.Future(); f.set_result(R()); return f
    def close(self): pass
class R:
    def as_numpy(self, name): return protocol.result_array({"ok": True})
c = ManyLoRAClient("localhost:1"); c._transport.close(); c._transport = T()
c.extract_entities("Tim", ["person"]); c.batch_extract_relations(["a"], ["r"]); c.classify_text("a", {"t": ["x"]})
c.extract_json("a", {"p": ["n::str"]}); c.extract("a", {"entities": ["x"]}); c.extract_entities_long("a b c", ["x"])
c.extract_entities("", ["x"])
print(sorted(m for m in ("torch", "gliner2", "transformers") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------- format_results


def _raw_results():
    return [
        {"entities": [{"person": [("Tim", 0.9, 0, 3), ("tim", 0.8, 0, 3), ("Cook", 0.7, 4, 8)], "org": []}]},
        {"entities": [{"person": ("Tim", 0.9, 0, 3), "org": None, "x": [{"text": "A", "start": 1, "end": 2}]}]},
        {"entities": []},
        {"sentiment": ("pos", 0.8), "topic": [("a", 0.6), ("b", 0.4)], "pair": ["x", "y"]},
        {
            "works_for": [("Tim", "Apple")],
            "lives_in": [],
            "p": [{"name": [("n", 0.5, 0, 1)], "kind": ("a", 0.9, 0, 1)}],
        },
        {"rel": [{"head": "a", "tail": "b"}], "s": {"f": ["u", "U", "v"], "g": "", "h": ("t", 0.2, 0, 1)}},
        {"plain": "text", "n": 3, "labels": [["a", 0.3], ["b", 0.1]]},
    ]


@pytest.mark.parametrize("include_confidence", [False, True])
@pytest.mark.parametrize("index", range(7))
def test_format_results_is_gliner2s(gliner2, index, include_confidence):
    raw = _raw_results()[index]
    relations, tasks = ["works_for", "missing"], ["sentiment", "topic", "labels"]
    expected = gliner2.format_results(raw, include_confidence, relations, tasks)
    client = make_client(GLiNER2Transport())
    assert client.format_results(raw, include_confidence, relations, tasks) == expected
    assert client.format_results(raw) == gliner2.format_results(raw)


# ------------------------------------------------------------------ empty text


EMPTY_CASES = [
    ("extract_entities", ["person", "company"]),
    ("extract_entities", {"person": {"dtype": "str"}, "org": "an org"}),
    ("extract_relations", ["works_for", "lives_in"]),
    ("extract_json", {"product": ["name::str", "tags", "kind::[a|b]"], "other": ["x"]}),
    ("classify_text", {"sentiment": ["pos", "neg"]}),
]


@pytest.mark.parametrize("text", ["", "   ", "\n\t"])
@pytest.mark.parametrize("method,argument", EMPTY_CASES)
def test_empty_text_is_sent_and_answered_as_gliner2(gliner2, method, argument, text):
    """GLiNER2 extracts from an empty text: its processor makes it "." (a text without final
    punctuation gets one), so a low threshold finds spans there and classifications score
    their labels. The client sends it like any text (the server serves it)."""
    transport = GLiNER2Transport(gliner2)
    client = make_client(transport)
    low = {}
    for threshold in (0.5, 0.0):
        for flags in [(False, False), (True, True)]:
            expected = json.loads(json.dumps(getattr(gliner2, method)(text, argument, threshold, True, *flags)))
            assert getattr(client, method)(text, argument, threshold, True, *flags) == expected
            texts = [text, "Tim Cook works for Apple.", text]
            batch = getattr(client, f"batch_{method}")(texts, argument, 8, threshold, True, *flags)
            theirs = getattr(gliner2, f"batch_{method}")(texts, argument, 8, threshold, True, *flags)
            assert batch[0] == batch[2] == expected  # the fake answers one by one
            assert not result_differences(json.loads(json.dumps(theirs[0])), expected)  # batched: float noise
            low[threshold, flags] = expected
    assert [r.text for r in transport.sent].count(text) == 3 * 4, "every empty text is sent"
    if method != "classify_text":
        assert low[0.0, (True, True)] != low[0.5, (True, True)], "spans on the '.' at threshold 0: not vacuous"


def test_empty_text_of_a_mixed_schema_and_of_a_schema_object(gliner2):
    data = {
        "relations": ["r1"],
        "structures": {"p": {"fields": [{"name": "a"}]}, "q": {"fields": [{"name": "b", "dtype": "str"}]}},
        "entities": {"x": {"dtype": "str"}, "y": "a thing"},
        "classifications": [{"task": "t", "labels": ["l1", "l2"]}],
    }
    transport = GLiNER2Transport(gliner2)
    client = make_client(transport)
    for threshold in (0.5, 0.0):
        expected = json.loads(json.dumps(gliner2.extract("", Schema.from_dict(data), threshold)))
        assert client.extract("", data, threshold) == expected
        assert client.extract("", json.dumps(data), threshold) == expected
        assert client.extract("", Schema.from_dict(data), threshold) == expected
    assert [r.text for r in transport.sent] == [""] * 6


def test_empty_long_text_is_one_chunk_as_in_gliner2(gliner2):
    """GLiNER2's *_long answer an empty text from one chunk of it (max_len=chunk_size)."""
    transport = GLiNER2Transport(gliner2, max_len=client_lib.DEFAULT_CHUNK_SIZE)
    client = make_client(transport)
    types = ["person", "company"]
    for text in ["", "  "]:
        expected = gliner2.extract_entities_long(text, types, 0.0, include_confidence=True, include_spans=True)
        got = client.extract_entities_long(text, types, 0.0, include_confidence=True, include_spans=True)
        assert got == json.loads(json.dumps(expected)) and got["entities"]["person"], "spans on the '.'"
    assert [r.text for r in transport.sent] == ["", "  "]


# ------------------------------------------------------------------ thresholds


@pytest.mark.parametrize("threshold", [-0.5, -1e30, 0.0, 1.0, 1.0000001, 1.5, 1e30])
def test_any_finite_threshold_is_sent_as_gliner2_takes_it(gliner2, threshold):
    """GLiNER2 takes any threshold: above 1 nothing passes, below 0 acts as 0 (scores are in
    [0, 1]). The client sends it (as FP32, the wire's type) and answers what GLiNER2 answers."""
    transport = GLiNER2Transport(gliner2)
    client = make_client(transport)
    text, types = "Tim Cook works for Apple in Cupertino.", ["person", "company"]
    wire = float(np.float32(threshold))
    got = client.extract_entities(text, types, threshold, True, True)
    assert got == json.loads(json.dumps(gliner2.extract_entities(text, types, wire, True, True)))
    assert transport.sent[-1].threshold == wire
    if threshold < 0:
        assert got == json.loads(json.dumps(gliner2.extract_entities(text, types, 0.0, True, True)))
    if threshold > 1:
        assert got == {"entities": {"person": [], "company": []}}


@pytest.mark.parametrize("threshold", [float("nan"), float("inf"), -float("inf"), 1e39])
def test_non_finite_thresholds_answer_as_gliner2(gliner2, threshold):
    """GLiNER2 2.1.0 takes NaN and +-inf (NaN and inf find nothing, -inf acts as 0); so does the
    client, with 1e39 sent as FP32 makes it (inf)."""
    text, types = "Tim Cook works for Apple in Cupertino.", ["person", "company"]
    transport = GLiNER2Transport(gliner2)
    got = make_client(transport).extract_entities(text, types, threshold, True, True)
    wire = float(np.float32(threshold))
    assert got == json.loads(json.dumps(gliner2.extract_entities(text, types, wire, True, True)))
    if threshold > 0 or threshold != threshold:  # NaN, inf
        assert got == {"entities": {"person": [], "company": []}}
    else:
        assert got == json.loads(json.dumps(gliner2.extract_entities(text, types, 0.0, True, True)))


@pytest.mark.parametrize("value", [-0.5, 1.5, float("nan")])
def test_schema_thresholds_outside_0_1_are_refused_as_gliner2_refuses_them(gliner2, value):
    """Per-entity, per-relation and per-field thresholds and cls_threshold: GLiNER2's builder
    raises ValueError and Schema.from_dict raises (pydantic); so do the client's builders, and
    the server answers a SCHEMA holding one INVALID_ARG (``SCHEMA is not a valid GLiNER2 schema``)."""
    from pydantic import ValidationError

    with pytest.raises(ValueError, match="Threshold must be 0-1"):
        Schema().entities({"person": {"threshold": value}})
    with pytest.raises(ValueError, match="Threshold must be 0-1"):
        client_lib.entities_schema({"person": {"threshold": value}})
    with pytest.raises(ValueError, match="Threshold must be 0-1"):
        client_lib.relations_schema({"works_for": {"threshold": value}})
    for data in [
        {"entities": {"person": {"threshold": value}}},
        {"relations": {"works_for": {"threshold": value}}},
        {"structures": {"p": {"fields": [{"name": "a", "threshold": value}]}}},
        {"classifications": [{"task": "t", "labels": ["a", "b"], "cls_threshold": value}]},
    ]:
        with pytest.raises(ValidationError):
            Schema.from_dict(data)
    with pytest.raises(ValueError, match="cls_threshold"):
        client_lib.classification_schema({"t": {"labels": ["a", "b"], "cls_threshold": value}})


# ------------------------------------------------------------- long documents


def _long_text(words: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    vocabulary = "Tim Cook runs Apple from Cupertino , California . Ana works for Acme in Lisbon since 2019 ; "
    vocabulary += "e-mail ana@acme.com or see https://acme.com/x?y=1 — café naïve Zoë co-founder @acme 3.5% !"
    pool = vocabulary.split()
    return " ".join(rng.choice(pool) for _ in range(words)) + rng.choice(["", " ", "\n"])


@pytest.mark.parametrize("size,overlap", [(384, 64), (16, 4), (7, 0), (5, 4), (1, 0)])
@pytest.mark.parametrize("seed", range(3))
def test_chunks_are_gliner2s(size, overlap, seed):
    text = _long_text(120, seed)
    assert client_lib.split_text_into_chunks(text, size, overlap) == [
        client_lib.TextChunk(**vars(chunk)) for chunk in g2_chunking.split_text_into_chunks(text, size, overlap)
    ]


@pytest.mark.parametrize("text", ["", "  ", "one", "a  b\tc\n"])
def test_chunks_of_short_and_empty_texts_are_gliner2s(text):
    ours = client_lib.split_text_into_chunks(text, 2, 1)
    assert ours == [client_lib.TextChunk(**vars(c)) for c in g2_chunking.split_text_into_chunks(text, 2, 1)]
    for bad in [(0, 0), (4, 4), (4, -1)]:
        with pytest.raises(ValueError):
            client_lib.split_text_into_chunks(text, *bad)


def _chunk_answer(rng: random.Random, chunk_text: str) -> dict:
    """A GLiNER2-shaped answer (confidences and spans on) with overlapping candidates."""

    def span():
        start = rng.randrange(0, max(1, len(chunk_text) - 1))
        end = min(len(chunk_text), start + rng.randint(1, 12))
        return {"text": chunk_text[start:end], "confidence": round(rng.random(), 2), "start": start, "end": end}

    return {
        "entities": {
            "person": [span() for _ in range(rng.randint(0, 5))],
            "city": span() if rng.random() < 0.6 else None,
        },
        "sentiment": {"label": rng.choice(["pos", "neg"]), "confidence": rng.random()},
        "topic": [{"label": t, "confidence": rng.random()} for t in rng.sample(["a", "b", "c"], rng.randint(0, 2))],
        "product": [{"name": span(), "kind": {"text": rng.choice(["x", "y"]), "confidence": rng.random()}}],
        "relation_extraction": {
            "works_for": [{"head": span(), "tail": span()} for _ in range(rng.randint(0, 2))]
            + [
                {
                    "head": {"text": "Tim", "confidence": 0.5, "start": 0, "end": 3},
                    "tail": {"text": "A", "confidence": rng.random(), "start": 4, "end": 5},
                }
            ]
        },
    }


@pytest.mark.parametrize("flags", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("seed", range(4))
def test_merge_of_chunk_answers_is_gliner2s(seed, flags):
    rng = random.Random(seed)
    text = _long_text(200, seed)
    chunks = client_lib.split_text_into_chunks(text, 24, 8)
    answers = [_chunk_answer(rng, chunk.text) for chunk in chunks]
    theirs = g2_chunking.merge_chunk_results(
        text,
        g2_chunking.split_text_into_chunks(text, 24, 8),
        json.loads(json.dumps(answers)),
        *flags,
        scalar_entity_labels={"city"},
        overlap_policy=None,  # what GLiNER2's span models pass (resolved to "disallow")
    )
    ours = client_lib.merge_chunk_results(text, chunks, json.loads(json.dumps(answers)), *flags, {"city"})
    assert ours == theirs


def test_long_methods_send_one_request_per_chunk_and_merge_as_gliner2(gliner2):
    text = _long_text(90, 7)
    transport = GLiNER2Transport(gliner2, max_len=20)
    client = make_client(transport, adapter="acme")
    args = (0.05, 20, 5, 1, 0, True, True, True)  # batch_size 1: GLiNER2 runs chunks one by one, as the fake
    ours = client.extract_entities_long(text, ["person", "city"], *args)
    expected = json.loads(json.dumps(gliner2.extract_entities_long(text, ["person", "city"], *args)))
    assert ours == expected and any(ours["entities"].values()), "the tiny model finds spans at a low threshold"
    chunks = client_lib.split_text_into_chunks(text, 20, 5)
    assert [r.text for r in transport.sent] == [c.text for c in chunks]
    assert all(r.include_confidence and r.include_spans and r.adapter == "acme" for r in transport.sent)
    assert all(r.max_len == 20 for r in transport.sent), "max_len=chunk_size, as GLiNER2 passes it"
    for method, argument in [
        ("extract_relations_long", ["works_for"]),
        ("extract_json_long", {"p": ["name::str", "tags"]}),
        ("classify_text_long", {"sentiment": ["pos", "neg"]}),
        ("extract_entities_long", {"person": {"dtype": "str"}}),
    ]:
        for flags in [(False, False), (True, True)]:
            long_args = (0.05, 20, 5, 1, 0, True, *flags)
            got = getattr(client, method)(text, argument, *long_args)
            assert got == json.loads(json.dumps(getattr(gliner2, method)(text, argument, *long_args))), method
    docs = [text, "", _long_text(30, 8)]
    assert client.batch_extract_entities_long(docs, ["person"], 1, 0.05, 0, True, True, False, 20, 5) == json.loads(
        json.dumps(gliner2.batch_extract_entities_long(docs, ["person"], 1, 0.05, 0, True, True, False, 20, 5))
    )


def test_a_failed_chunk_fails_its_document():
    transport = GLiNER2Transport(answer=lambda r: {"entities": {"x": []}}, fail={"bad": _unavailable()})
    client = make_client(transport)
    results = client.batch_extract_entities_long(
        ["a b", "ok bad", "c"], ["x"], raise_on_error=False, chunk_size=1, chunk_overlap=0
    )
    assert results[0] == results[2] == {"entities": {"x": []}}
    assert isinstance(results[1], ManyLoRAError) and results[1].index == 1
    with pytest.raises(ManyLoRAError) as info:
        client.extract_entities_long("ok bad", ["x"], 0.5, 1, 0)
    assert info.value.index == 0
    with pytest.raises(ValueError, match="format_results=True"):
        client.extract_long("a", {"entities": ["x"]}, 0.5, 384, 64, 8, 0, False)
    with pytest.raises(ValueError, match="overlap_policy"):
        client.extract_entities_long("a", ["x"], overlap_policy="allow")


def _unavailable():
    return InferenceServerException("down", status="StatusCode.UNAVAILABLE")


# --------------------------------------------------------------------- asyncio


def test_the_asyncio_client_answers_as_the_sync_one(gliner2):
    text = _long_text(60, 3)

    async def run():
        transport = GLiNER2Transport(gliner2, fail={"bad": _unavailable()}, max_len=20)
        async with make_aio_client(transport, concurrency=4) as client:
            batch = await client.batch_extract_entities(["Tim Cook", "", "Ana in Lisbon"], ["person"], 8, 0.05)
            long = await client.extract_entities_long(text, ["person"], 0.05, 20, 5, 1)
            single = await client.extract_relations("", ["r"])
            mixed = await client.batch_extract(["x", "bad"], {"entities": ["a"]}, raise_on_error=False)
            with pytest.raises(ManyLoRAError) as info:
                await client.extract("bad", {"entities": ["a"]})
            return batch, long, single, mixed, info.value, transport

    batch, long, single, mixed, error, transport = asyncio.run(run())
    assert batch == json.loads(
        json.dumps(gliner2.batch_extract_entities(["Tim Cook", "", "Ana in Lisbon"], ["person"], 8, 0.05))
    )
    assert long == json.loads(json.dumps(gliner2.extract_entities_long(text, ["person"], 0.05, 20, 5, 1)))
    assert single == {"relation_extraction": {"r": []}}
    assert isinstance(mixed[1], ManyLoRAError) and mixed[1].index == 1 and mixed[1].code == "UNAVAILABLE"
    assert error.index is None and error.code == "UNAVAILABLE"


def test_the_asyncio_client_keeps_at_most_batch_size_in_flight():
    state = {"now": 0, "most": 0}

    async def run():
        client = AsyncManyLoRAClient("localhost:1", concurrency=3)

        async def infer(request):
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
            await asyncio.sleep(0.005)
            state["now"] -= 1
            return {"text": request.text}

        client.infer = infer
        default = await client.batch_extract([str(i) for i in range(20)], {"entities": ["a"]})
        most_default, state["most"] = state["most"], 0
        explicit = await client.batch_extract([str(i) for i in range(20)], {"entities": ["a"]}, 5)
        await client.close()
        return default, most_default, explicit

    default, most_default, explicit = asyncio.run(run())
    assert [r["text"] for r in default] == [str(i) for i in range(20)] == [r["text"] for r in explicit]
    assert most_default == 3 and state["most"] == 5
