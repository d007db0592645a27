"""manylora.post: compact GPU answers decode to exactly what GLiNER2 returns.

GLiNER2 2.1.0 is the reference everywhere: its dense head outputs are computed with its own
batch functions, its own decoding (``_extract_from_batch_sync_collapsed`` /
``_decode_span_probabilities`` + ``format_results``) gives the expected answers, and ours
(``compact_batch`` -> ``CompactRow`` arrays -> ``PostDecoder.decode``) must equal them with
no tolerance: same structure, same labels, the same float scores.
"""

from __future__ import annotations

import json
import math
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from manylora.compare import result_differences
from manylora.demo import demo_schemas, demo_texts
from manylora.post import (
    CompactRow,
    PostDecoder,
    compact_batch,
    core_threshold,
    dtype_floor,
    head_outputs,
    needs_raw_logits,
    normalize_overlap_policy,
    resolve_overlaps,
    sparsify_threshold,
)

OPTIONS = [(False, False), (True, False), (False, True), (True, True)]  # include_confidence, include_spans
POLICIES = [None, "allow", "nested", "flat", "longest"]

TEXTS = [
    "Tim Cook leads Apple in Cupertino and met Satya Nadella of Microsoft in Seattle on 12 May 2021",
    "¡Hola! José García moved from São Paulo to Zürich — in 2019 — with €1,200 and a new job at Siemens.",
    "IBM, Microsoft and Google (Alphabet) met on 12/03/2024 at 9:30am; no deal was signed in Berlin.",
    "   Leading and trailing spaces around Berlin and Munich, where BMW builds cars.   ",
]


# ---------------------------------------------------------------------------- schemas
def _feature_schemas() -> list:
    """Schemas covering every decoding feature (built with GLiNER2's own Schema builder)."""
    from gliner2.inference.schema import AttributeGroup, RegexValidator, Schema

    entities = Schema().entities(
        {
            "person": {"description": "full names of people", "threshold": 0.37},
            "date": {"dtype": "str"},
            "organization": "companies and institutions",
            "money": {"dtype": "str", "threshold": 0.45},
        }
    )
    entities.entities(["location"], validators=[RegexValidator(r"[A-Z]\w+", flags=0)])
    entities.entities({"city": {"dtype": "str"}}, validators=[RegexValidator("the", mode="partial", exclude=True)])

    relations = Schema().entities(["person", "organization"])
    relations.relations({"works_for": {"threshold": 0.37}, "located_in": "a place and where it is"})
    relations.relations(["founded"], threshold=0.6)

    structures = Schema()
    deal = structures.structure("deal")
    deal.field("buyer", dtype="str", threshold=0.4)
    deal.field("kind", dtype="str", choices=["acquisition", "merger", "lawsuit"])
    deal.field("tags", dtype="list", choices=["finance", "technology", "health"], threshold=0.3)
    deal.field("amount", validators=[RegexValidator(r"\d", mode="partial")])
    deal.field("people", description="people named in the deal")
    profile = structures.structure("profile")
    profile.field("name", dtype="str")
    profile.field("level", dtype="str", choices=["junior", "senior"], threshold=0.6)
    profile.field("skills", choices=["python", "sales"])

    attributes = Schema().entities(["person", "organization"])
    attributes.entities({"product": {"dtype": "str", "threshold": 0.45}})
    attributes.entity_attributes(
        {
            "sentiment": AttributeGroup(labels=["positive", "negative", "neutral"]),
            "role": AttributeGroup(
                labels=["buyer", "seller"], multi_label=True, threshold=0.3, applies_to=["organization"]
            ),
            "status": AttributeGroup(labels=["new", "old"], qualify_labels=True),
            "stance": AttributeGroup(labels=["pro", "con"], multi_label=True),  # sigmoid(0) == 0.5: a tie
        }
    )

    classes = Schema()
    topics = ["business", "politics", "sports", "science", "health"]
    classes.classification("topic", topics, multi_label=True, cls_threshold=0.3, top_k=2)
    classes.classification("tone", ["formal", "casual"], class_act="sigmoid")
    classes.classification("flags", ["a", "b", "c"], multi_label=True, class_act="softmax", cls_threshold=0.2)
    classes.classification("mood", {"calm": "quiet", "angry": "loud"}, cls_threshold=0.9, multi_label=True)

    mixed = Schema().entities(["person", "location"]).classification("sentiment", ["positive", "negative"])
    mixed.relations(["works_for"])
    mixed.structure("event").field("what", dtype="str").field("kind", choices=["meeting", "sale"])

    raw_dict = {  # GLiNER2's internal form (no Schema): no relation order, so empty relations stay top-level
        "entities": {"person": "", "company": ""},
        "relations": [{"works_for": {"head": "", "tail": ""}}],
        "json_structures": [{"deal": {"buyer": "", "kind": {"value": "", "choices": ["sale", "merger"]}}}],
        "classifications": [{"task": "sentiment", "labels": ["positive", "negative"]}],
    }
    return [entities, relations, structures, attributes, classes, mixed, raw_dict]


def _all_schemas() -> list:
    from gliner2.inference.schema import Schema

    return [Schema.from_dict(s) for s in demo_schemas()] + _feature_schemas()


def _cases(n_texts: int = 2) -> list:
    schemas = _all_schemas()
    texts = TEXTS + demo_texts(len(schemas) * n_texts, seed=3, min_words=15, max_words=45)
    return [(texts[i], schemas[i % len(schemas)]) for i in range(len(schemas) * n_texts)]


# ---------------------------------------------------------------------------- GLiNER2 side
def _bf16_model(tiny_checkpoint):
    from gliner2 import GLiNER2

    return GLiNER2.from_pretrained(str(tiny_checkpoint)).to(torch.bfloat16).eval()


@pytest.fixture(scope="module")
def models(reference_model, tiny_checkpoint):
    return {torch.float32: reference_model, torch.bfloat16: _bf16_model(tiny_checkpoint)}


class Dense:
    """GLiNER2's dense head outputs for some cases (its own batch functions, on CPU)."""

    def __init__(self, model, cases, dtype):
        self.model = model
        processor = model.processor
        processor.change_mode(is_training=False)
        schema_dicts, self.metadata = model._build_schema_dicts_and_metadata([s for _, s in cases])
        self.records = [processor.transform_record(text, sd) for (text, _), sd in zip(cases, schema_dicts)]
        batch = processor._pad_batch(self.records)
        self.batch = batch.to(torch.device("cpu"), dtype if dtype != torch.float32 else None)
        with torch.inference_mode():
            tokens, self.schema_embs = processor.extract_embeddings_from_batch(
                model.encode_tokens(self.batch, None), self.batch.input_ids, self.batch
            )
            self.raw_logits, self.pred_counts, self.cls_probs, self.skipped = head_outputs(
                model, self.batch, tokens, self.schema_embs
            )

    def metadata_with(self, policy):
        if policy is None:
            return self.metadata
        return [{**m, "_overlap_policy": policy} for m in self.metadata]

    def reference(self, threshold, include_confidence, include_spans, metadata=None):
        from gliner2.inference.runtime import format_results

        metadata = metadata or self.metadata
        with torch.inference_mode():
            raw = self.model._extract_from_batch_sync_collapsed(
                batch=self.batch,
                all_schema_embs=self.schema_embs,
                all_raw_logits=self.raw_logits,
                all_pred_counts=self.pred_counts,
                threshold=threshold,
                metadata_list=metadata,
                include_confidence=include_confidence,
                include_spans=include_spans,
            )
        return [
            format_results(r, include_confidence, m.get("relation_order", []), m.get("classification_tasks", []))
            for r, m in zip(raw, metadata)
        ]

    def compact(self, threshold, metadata=None, t_min=None):
        metadata = metadata or self.metadata
        t_min = t_min if t_min is not None else [sparsify_threshold(threshold, m) for m in metadata]
        rows = compact_batch(
            self.raw_logits,
            self.pred_counts,
            self.cls_probs,
            t_min,
            logit_tasks=[needs_raw_logits(r, m) for r, m in zip(self.records, metadata)],
            skipped=self.skipped,
        )
        return [CompactRow.from_arrays(row.to_arrays()) for row in rows]  # as they travel through Triton

    def ours(self, threshold, include_confidence, include_spans, metadata=None, rows=None):
        metadata = metadata or self.metadata
        rows = rows if rows is not None else self.compact(threshold, metadata)
        decoder = PostDecoder.from_model(self.model)
        return [
            decoder.decode(row, record, meta, threshold, include_confidence, include_spans)
            for row, record, meta in zip(rows, self.records, metadata)
        ]


def _assert_equal(got, expected, cases, label=""):
    failures = []
    for i, (g, e) in enumerate(zip(got, expected)):
        diffs = result_differences(g, e, atol=0.0)
        if diffs or json.dumps(g) != json.dumps(e):
            failures.append(f"case {i} text={cases[i][0][:40]!r}: {diffs[:3] or (g, e)}")
    assert len(got) == len(expected)
    assert not failures, f"{label}: {len(failures)} of {len(got)} differ:\n" + "\n".join(failures[:5])


@pytest.fixture(scope="module")
def dense(models):
    cases = _cases(2)
    short = _cases(1)[: len(_all_schemas())]
    return {
        dtype: (Dense(model, cases, dtype), cases, Dense(model, short, dtype), short) for dtype, model in models.items()
    }


# ---------------------------------------------------------------------------- real model
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("threshold", [0.0, 0.37, 0.5, 0.99])
def test_equals_gliner2(dense, dtype, threshold):
    full, cases, short, short_cases = dense[dtype]
    which, which_cases = (short, short_cases) if threshold == 0.0 else (full, cases)
    options = OPTIONS[::3] if threshold == 0.0 else OPTIONS
    for include_confidence, include_spans in options:
        expected = which.reference(threshold, include_confidence, include_spans)
        got = which.ours(threshold, include_confidence, include_spans)
        _assert_equal(
            got, expected, which_cases, f"{dtype} t={threshold} conf={include_confidence} spans={include_spans}"
        )


@pytest.mark.parametrize("policy", POLICIES[1:])
def test_overlap_policies_equal_gliner2(dense, policy):
    for dtype in (torch.float32, torch.bfloat16):
        full, cases, _, _ = dense[dtype]
        metadata = full.metadata_with(policy)
        for threshold in (0.3, 0.5):
            expected = full.reference(threshold, True, True, metadata)
            got = full.ours(threshold, True, True, metadata)
            _assert_equal(got, expected, cases, f"{dtype} {policy} t={threshold}")


def test_harness_matches_batch_extract(dense, models):
    """The dense path used above is GLiNER2's own: batch_extract answers the same."""
    settings = {torch.float32: [(0.5, True, False)], torch.bfloat16: [(0.37, False, True)]}
    for dtype, model in models.items():
        full, cases, _, _ = dense[dtype]
        for threshold, include_confidence, include_spans in settings[dtype]:
            expected = model.batch_extract(
                [t for t, _ in cases],
                [s for _, s in cases],
                batch_size=len(cases),
                threshold=threshold,
                include_confidence=include_confidence,
                include_spans=include_spans,
            )
            got = full.ours(threshold, include_confidence, include_spans)
            _assert_equal(got, expected, cases, f"batch_extract {dtype} t={threshold}")


def test_cases_cover_features(dense):
    full, cases, _, _ = dense[torch.float32]
    expected = full.reference(0.3, True, True)
    text = json.dumps(expected)
    # every kind of answer appears, so the equality above is not vacuous
    for needle in ('"relation_extraction"', '"head"', '"sentiment"', '"role"', '"topic"', '"kind"', '"tags"'):
        assert needle in text, needle
    assert sum(text.count('"confidence"') for text in map(json.dumps, expected)) > 3 * len(cases)
    counts = [c for row in full.pred_counts for c in row]
    assert 0 in counts and max(counts) >= 2
    assert any(any(row) for row in (needs_raw_logits(r, m) for r, m in zip(full.records, full.metadata)))


def test_sparsification_drops_elements_and_t_min_changes_nothing(dense):
    for dtype in (torch.float32, torch.bfloat16):
        full, cases, _, _ = dense[dtype]
        threshold = 0.5
        rows = full.compact(threshold)
        dense_size = sum(t.numel() for row in full.raw_logits for t in row if t is not None)
        kept = sum(len(r.scores) for r in rows)
        assert 0 < kept < dense_size / 10, (kept, dense_size)
        t_min = [sparsify_threshold(threshold, m) for m in full.metadata]
        assert min(t_min) < threshold  # per-entity / per-field thresholds below the request's
        for row, floor_at in zip(rows, t_min):
            assert (row.scores >= dtype_floor(floor_at, dtype)).all()
        everything = full.compact(threshold, t_min=[-math.inf] * len(cases))
        assert sum(len(r.scores) for r in everything) == dense_size
        expected = full.reference(threshold, True, True)
        _assert_equal(full.ours(threshold, True, True, rows=everything), expected, cases, "dense")
        _assert_equal(full.ours(threshold, True, True, rows=rows), expected, cases, "sparse")


# GLiNER2 takes any request threshold: above 1 nothing passes, below 0 acts as 0 (scores are
# sigmoids in [0, 1]). The GPU stage takes T_MIN in [0, 1] only: the front sends the clamped
# core_threshold, the decoder compares with the request's own threshold. Values are FP32 (the wire).
OUT_OF_RANGE = [float(np.float32(t)) for t in (-0.5, -1e30, 1.0, 1.0000001, 1.5, 1e30, -np.inf, np.inf, np.nan)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_out_of_range_thresholds_equal_gliner2_with_a_clamped_t_min(dense, dtype):
    _, _, short, cases = dense[dtype]
    for threshold in OUT_OF_RANGE:
        t_min = [core_threshold(threshold, m) for m in short.metadata]
        assert all(0.0 <= t <= 1.0 for t in t_min)
        rows = short.compact(threshold, t_min=t_min)
        for include_confidence, include_spans in OPTIONS[::3]:
            expected = short.reference(threshold, include_confidence, include_spans)
            got = short.ours(threshold, include_confidence, include_spans, rows=rows)
            _assert_equal(got, expected, cases, f"{dtype} t={threshold}")
    below = short.reference(-0.5, True, True)
    assert below == short.reference(0.0, True, True), "below 0 acts as 0"
    assert any(r != e for r, e in zip(below, short.reference(0.5, True, True))), "not vacuous"


def test_core_threshold_is_sparsify_threshold_clamped_into_0_1():
    metadata = {"entity_metadata": {"a": {"threshold": 0.3}}}
    assert core_threshold(0.5, metadata) == 0.3 and core_threshold(0.5, {}) == 0.5
    assert core_threshold(-2.0, metadata) == 0.0 and core_threshold(7.0, {}) == 1.0
    assert core_threshold(7.0, metadata) == 0.3, "a per-entity threshold below the request's still counts"
    assert core_threshold(float("nan"), {}) == 1.0


def test_row_arrays_round_trip(dense):
    full, _, _, _ = dense[torch.bfloat16]
    for row in full.compact(0.5):
        arrays = row.to_arrays()
        assert all(isinstance(a, np.ndarray) for a in arrays.values())
        back = CompactRow.from_arrays(arrays)
        assert back.dtype == torch.bfloat16
        for key, value in back.to_arrays().items():
            assert np.array_equal(value, arrays[key], equal_nan=True), key


# ---------------------------------------------------------------------------- fabricated outputs
@pytest.fixture(scope="module")
def pool(reference_model):
    """Records (GLiNER2's own transform) of every schema on short texts, for random head outputs."""
    processor = reference_model.processor
    processor.change_mode(is_training=False)
    schemas = _all_schemas()
    texts = TEXTS[:2] + demo_texts(len(schemas), seed=11, min_words=4, max_words=25)
    schema_dicts, metadata = reference_model._build_schema_dicts_and_metadata(schemas)
    return [
        (processor.transform_record(texts[i % len(texts)], sd), meta)
        for i, (sd, meta) in enumerate(zip(schema_dicts, metadata))
    ]


def _fabricate(rng, records, dtype, width):
    """Random head outputs with ties, masked (-inf) spans, zero counts, missing logits, skipped tasks."""
    from gliner2.inference.runtime import ExtractorRuntimeMixin

    raw, counts, probs, embs, skipped = [], [], [], [], []
    for record in records:
        length = len(record.text_tokens)
        raw_r, counts_r, probs_r, embs_r, skipped_r = [], [], [], [], []
        for t, (tokens, task_type) in enumerate(zip(record.schema_tokens_list, record.task_types)):
            skip = rng.random() < 0.05
            n_special = 1 + sum(tok in ("[E]", "[C]", "[R]", "[L]") for tok in tokens)
            embs_r.append([] if skip else [torch.tensor([len(raw), t], dtype=torch.float32)] * n_special)
            skipped_r.append(skip)
            fields = sum(tok in ("[E]", "[C]", "[R]") for tok in tokens[:-1])
            if task_type == "classifications":
                config = ExtractorRuntimeMixin._resolve_classification_config(
                    tokens[2], record.schema.get("classifications", [])
                )
                values = rng.choice([0.1, 0.3, 0.5, 0.7, rng.random()], size=n_special - 1)
                p = torch.tensor(values, dtype=torch.float32).to(dtype)
                probs_r.append(None if skip or config is None else p)
                raw_r.append(None)
                counts_r.append(0)
                continue
            probs_r.append(None)
            count = int(rng.choice([0, 1, 1, 2, 3]))
            counts_r.append(count)
            if count == 0 or fields == 0 or skip or rng.random() < 0.03:
                raw_r.append(None)
                continue
            instances = 1 if task_type == "entities" else count
            logits = rng.normal(0.0, 2.0, size=(instances, fields, length, width))
            tie = rng.random(logits.shape) < 0.3
            logits[tie] = rng.choice([-1.0, 0.0, 0.5, 1.5], size=int(tie.sum()))
            starts, widths = np.meshgrid(np.arange(length), np.arange(width), indexing="ij")
            logits[:, :, starts + widths >= length] = -math.inf  # GLiNER2 masks spans past the text
            raw_r.append(torch.tensor(logits, dtype=torch.float32).to(dtype))
        raw.append(raw_r)
        counts.append(counts_r)
        probs.append(probs_r)
        embs.append(embs_r)
        skipped.append(skipped_r)
    return raw, counts, probs, embs, skipped


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    policy=st.sampled_from(POLICIES),
    options=st.sampled_from(OPTIONS),
    threshold_kind=st.sampled_from(["fixed", "score", "below", "above"]),
)
def test_random_outputs_equal_gliner2_decoding(reference_model, pool, seed, dtype, policy, options, threshold_kind):
    from gliner2.inference.runtime import format_results

    model = reference_model
    rng = np.random.default_rng(seed)
    chosen = [pool[i] for i in rng.choice(len(pool), size=int(rng.integers(1, 4)), replace=False)]
    records = [r for r, _ in chosen]
    metadata = [m if policy is None else {**m, "_overlap_policy": policy} for _, m in chosen]
    raw, counts, probs, embs, skipped = _fabricate(rng, records, dtype, width=int(rng.integers(3, 9)))
    threshold = float(rng.choice([0.0, 0.37, 0.5, 0.99]))
    scores = [torch.sigmoid(t).reshape(-1) for row in raw for t in row if t is not None]
    if threshold_kind != "fixed" and scores:
        flat = torch.cat(scores)
        value = flat[int(rng.integers(len(flat)))].float()
        step = {"score": 0.0, "below": -1e-7, "above": 1e-7}[threshold_kind]
        threshold = float(value) + step  # exactly a score, or between two float32 neighbours of it

    def classification(schema, stacked, tokens, temperature=1.0):
        config = model._resolve_classification_config(tokens[2], schema.get("classifications", []))
        row, task = int(stacked[0, 0]), int(stacked[0, 1])
        return None if config is None else (config["task"], config, probs[row][task])

    batch = model.processor._pad_batch(records)
    include_confidence, include_spans = options
    with mock.patch.object(model, "_compute_classification_probabilities", classification):
        raw_results = model._extract_from_batch_sync_collapsed(
            batch, embs, raw, counts, threshold, metadata, include_confidence, include_spans
        )
    expected = [
        format_results(r, include_confidence, m.get("relation_order", []), m.get("classification_tasks", []))
        for r, m in zip(raw_results, metadata)
    ]
    rows = compact_batch(
        raw,
        counts,
        probs,
        [sparsify_threshold(threshold, m) for m in metadata],
        logit_tasks=[needs_raw_logits(r, m) for r, m in zip(records, metadata)],
        skipped=skipped,
    )
    decoder = PostDecoder.from_model(model)
    got = [
        decoder.decode(CompactRow.from_arrays(row.to_arrays()), rec, meta, threshold, include_confidence, include_spans)
        for row, rec, meta in zip(rows, records, metadata)
    ]
    cases = [(r.text, None) for r in records]
    _assert_equal(got, expected, cases, f"seed={seed} {dtype} {policy} t={threshold!r}")


# ---------------------------------------------------------------------------- pieces
@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    spans=st.lists(
        st.tuples(st.sampled_from([0.1, 0.5, 0.5, 0.9, 0.25]), st.integers(0, 12), st.integers(1, 6)), max_size=9
    ),
    policy=st.sampled_from(["allow", "nested", "disallow", "flat", "longest", "keep-longest"]),
)
def test_resolve_overlaps_equals_gliner2(spans, policy):
    from gliner2.inference.overlap import resolve_overlaps as reference

    items = [(f"s{i}", score, start, start + length) for i, (score, start, length) in enumerate(spans)]
    expected = reference(items, policy, score=lambda s: s[1], start=lambda s: s[2], end=lambda s: s[3])
    assert resolve_overlaps(items, policy) == expected


def test_overlap_policy_names_and_decoder_settings(reference_model):
    from gliner2.inference.overlap import normalize_overlap_policy as reference

    for name in ["allow", "ALL", "none", "nested", "allow-nested", "flat", "disallow", "no_overlap", "longest"]:
        assert normalize_overlap_policy(name) == reference(name)
    with pytest.raises(ValueError):
        normalize_overlap_policy("sideways")
    decoder = PostDecoder.from_model(reference_model)
    assert decoder.overlap_policy is reference_model._resolved_overlap_policy(None)
    for policy in POLICIES:
        assert decoder._policy({"_overlap_policy": policy}) == reference_model._metadata_overlap_policy(
            {"_overlap_policy": policy}
        )


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    value=st.floats(-2.0, 2.0, allow_nan=False) | st.sampled_from([0.0, 0.37, 0.7, 0.9, 1.0, -1e-30, 1e-30, 1e-45]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
)
def test_dtype_floor_keeps_everything_torch_accepts(value, dtype):
    floor = dtype_floor(value, dtype)
    as_dtype = torch.tensor([floor], dtype=torch.float64).to(dtype)
    assert float(as_dtype[0]) == floor and floor <= value  # a value of the dtype, not above
    # every value of the dtype that torch's comparison with `value` accepts is >= the floor
    neighbours = torch.tensor([floor], dtype=dtype)
    below = torch.nextafter(neighbours.float(), torch.tensor([-math.inf])).to(dtype)
    candidates = torch.cat([below, neighbours, torch.tensor([value], dtype=torch.float64).to(dtype)])
    accepted = candidates[candidates >= value]
    assert bool((accepted >= torch.tensor(floor, dtype=dtype)).all())


def test_sparsify_threshold_reads_every_metadata_threshold():
    metadata = {
        "entity_metadata": {"a": {"threshold": 0.6}, "b": {"threshold": None}},
        "field_metadata": {"s.x": {"threshold": 0.3}},
        "relation_metadata": {"r": {"threshold": 0.45}},
    }
    assert sparsify_threshold(0.5, metadata) == 0.3
    assert sparsify_threshold(0.2, metadata) == 0.2
    assert sparsify_threshold(0.5, {}) == 0.5
    assert sparsify_threshold(float("nan"), {}) == math.inf


# ---------------------------------------------------------------------------- the CPU front
class FakePb:
    """The parts of triton_python_backend_utils the front and the GPU stage use; a BLS request
    (``InferenceRequest.exec``) runs the in-process GPU stage ``FakePb.core``."""

    core = None  # a CoreModelHandler (core_overlap off), set by the fixture

    class TritonError:
        UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED = range(6)

        def __init__(self, message: str, code: int = 0):
            self._message, self.code = message, code

        def message(self) -> str:
            return self._message

    class Tensor:
        def __init__(self, name: str, array: np.ndarray):
            self._name, self.array = name, array

        def name(self) -> str:
            return self._name

        def as_numpy(self) -> np.ndarray:
            return self.array

    class InferenceResponse:
        def __init__(self, output_tensors: list, error=None):
            self.output_tensors, self._error = output_tensors, error

        def has_error(self) -> bool:
            return self._error is not None

        def error(self):
            return self._error

    class InferenceRequest:
        def __init__(self, model_name: str, inputs: list, requested_output_names: list):
            self.inputs = {t.name(): t.as_numpy() for t in inputs}

        def exec(self):
            (response,) = FakePb.core.execute([self.inputs])
            return response

    @staticmethod
    def get_input_tensor_by_name(request: dict, name: str):
        return None if name not in request else FakePb.Tensor(name, request[name])

    @staticmethod
    def get_output_tensor_by_name(response, name: str):
        return next((t for t in response.output_tensors if t.name() == name), None)


CODE_NAMES = {v: k for k, v in vars(FakePb.TritonError).items() if isinstance(v, int)}


class NoMetrics:
    def publish(self, engine) -> None:
        pass


@pytest.fixture(scope="module")
def front(tiny_engine):
    """The gliner2 front (TritonModelHandler._execute_front) with its GPU stage in process."""
    from manylora.serving import CoreModelHandler, ExecuteProfiler, TritonModelHandler

    core = CoreModelHandler.__new__(CoreModelHandler)
    core.pb_utils, core.engine, core.metrics, core.control = FakePb, tiny_engine, NoMetrics(), None
    core.profiler, core.vocab = ExecuteProfiler(None, ""), len(tiny_engine.processor.tokenizer)
    FakePb.core = core
    handler = TritonModelHandler.__new__(TritonModelHandler)
    handler.pb_utils, handler.core_model = FakePb, "gliner2_core"
    handler.pre, handler.post, handler.profiler = tiny_engine.pre, tiny_engine.post, ExecuteProfiler(None, "")
    return handler


def _gliner2(model, request):
    from gliner2.inference.schema import Schema

    result = model.extract(
        request.text,
        Schema.from_json(request.schema),
        request.threshold,
        True,
        request.include_confidence,
        request.include_spans,
    )
    return json.loads(json.dumps(result))


def _answers(responses) -> list:
    """Per response: its results (a list, one per item) or (code name, message)."""
    from manylora.client import protocol

    out = []
    for response in responses:
        if response.has_error():
            out.append((CODE_NAMES[response.error().code], response.error().message()))
        else:
            (tensor,) = response.output_tensors
            assert tensor.name() == protocol.RESULT and tensor.array.shape[1:] == (1,)
            out.append(protocol.parse_results(tensor.array))
    return out


def _front_cases():
    """(text, schema, threshold) covering every task kind, per-entity / per-field thresholds,
    empty and whitespace-only texts, and thresholds outside [0, 1]."""
    schemas = [
        {"entities": {"person": {"threshold": 0.2}, "company": "a business", "date": {"dtype": "str"}}},
        {"relations": ["works_for"], "classifications": [{"task": "sentiment", "labels": ["pos", "neg"]}]},
        {
            "structures": {
                "deal": {
                    "fields": [
                        {"name": "buyer", "dtype": "str"},
                        {"name": "kind", "dtype": "str", "choices": ["cash", "stock"]},
                        {"name": "tags", "threshold": 0.1},
                    ]
                }
            },
            "classifications": [{"task": "topic", "labels": ["a", "b", "c"], "multi_label": True}],
        },
    ]
    texts = ["Tim Cook works for Apple since 2019", "", "  ", "\n\t", "\u3000"]
    thresholds = [0.5, 0.0, -0.5, 1.0, 1.5, 1e30, float("nan"), -float("inf")]
    return [
        (text, json.dumps(schema), thresholds[(i + j) % len(thresholds)])
        for i, text in enumerate(texts)
        for j, schema in enumerate(schemas)
    ]


def test_front_answers_empty_texts_and_any_threshold_as_gliner2(front, reference_model):
    """Through pre, the GPU stage (T_MIN clamped into [0, 1], which it requires) and post:
    an empty or whitespace-only text, a classification of one, and thresholds outside [0, 1]
    answer what GLiNER2.extract answers."""
    from manylora.client.protocol import Request

    requests = [
        Request(t, s, threshold=th, include_confidence=True, include_spans=k % 2 == 0)
        for k, (t, s, th) in enumerate(_front_cases())
    ]
    got = _answers(front.execute([r.to_arrays() for r in requests]))
    failures = []
    for request, answer in zip(requests, got):
        expected = _gliner2(reference_model, request)
        if not isinstance(answer, list) or result_differences(answer[0], expected, atol=1e-4):
            failures.append(f"{request.text!r} t={request.threshold} {request.schema[:50]}: {answer} != {expected}")
    assert not failures, "\n".join(failures[:5])
    empty_low = [a[0] for r, a in zip(requests, got) if not r.text.strip() and r.threshold <= 0]
    assert any('"text"' in json.dumps(a) for a in empty_low), "spans on an empty text's '.': not vacuous"


def _batch(requests) -> dict:
    """One Triton request of several items: each input [N, 1]."""
    arrays = [r.to_arrays() for r in requests]
    return {name: np.concatenate([a[name] for a in arrays]) for name in arrays[0]}


def test_front_answers_a_request_of_several_items_item_by_item(front, reference_model):
    """Inputs [N, 1] (perf_analyzer -b N, tritonclient with a batch): RESULT [N, 1], each item
    GLiNER2's answer, next to one-item requests in the same execute."""
    from manylora.client.protocol import Request

    cases = _front_cases()
    items = [Request(t, s, threshold=th, include_spans=k % 3 == 0) for k, (t, s, th) in enumerate(cases[:5])]
    single = Request(*cases[5][:2], include_confidence=True)
    absent = _batch(items[:2])  # optional inputs left out: their defaults for every item
    for name in ("ADAPTER_ID", "THRESHOLD", "INCLUDE_CONFIDENCE", "INCLUDE_SPANS"):
        del absent[name]
    responses = front.execute([_batch(items), single.to_arrays(), absent])
    assert responses[0].output_tensors[0].array.shape == (5, 1)
    got_items, (got_single,), got_absent = _answers(responses)
    defaults = [Request(r.text, r.schema) for r in items[:2]]
    for request, answer in zip(items + [single] + defaults, got_items + [got_single] + got_absent):
        assert not result_differences(answer, _gliner2(reference_model, request), atol=1e-4), request


def test_one_bad_item_fails_its_whole_request_alone(front, reference_model):
    """A request is answered once: its first bad item (found by the front, or by the GPU stage)
    fails it with that item's code, the item named; the other requests are answered."""
    from manylora.client.protocol import Request

    good = Request("Ada Lovelace met Charles Babbage in London.", json.dumps({"entities": ["person", "city"]}))
    bad_schema = Request("Some text.", "{broken")
    unknown = Request("Some text.", good.schema, adapter="no-such-adapter")
    one_value = _batch([good, good])
    one_value["THRESHOLD"] = np.full((1, 1), 0.5, dtype=np.float32)  # Triton refuses this itself too
    not_utf8 = _batch([good, good, good])
    not_utf8["TEXT"][2, 0] = b"\xff"
    batch = [_batch([good, bad_schema, bad_schema]), good.to_arrays(), _batch([good, unknown]), one_value, not_utf8]
    got = _answers(front.execute(batch))
    assert got[0][0] == "INVALID_ARG" and got[0][1].startswith("item 1 (0-based) of 3: SCHEMA is not valid JSON")
    assert got[2][0] == "NOT_FOUND" and got[2][1].startswith("item 1 (0-based) of 2: unknown adapter 'no-such-adapter'")
    assert got[3] == (
        "INVALID_ARG",
        "input THRESHOLD has shape (1, 1), but the request has 2 items (TEXT): "
        "every input present needs one value per item, shape [2, 1]",
    )
    assert got[4][0] == "INVALID_ARG" and got[4][1].startswith("item 2 (0-based) of 3: TEXT is not valid UTF-8")
    assert not result_differences(got[1][0], _gliner2(reference_model, good), atol=1e-4)
    (alone,) = _answers(front.execute([bad_schema.to_arrays()]))
    assert alone[0] == "INVALID_ARG" and alone[1].startswith("SCHEMA is not valid JSON"), "one item: no item named"


def test_single_design_answers_a_request_of_several_items(tiny_engine, reference_model):
    """Without a GPU stage (core_model none), the instance runs every stage: the same contract."""
    from manylora.client.protocol import Request

    from manylora.serving import ExecuteProfiler, TritonModelHandler

    handler = TritonModelHandler.__new__(TritonModelHandler)
    handler.pb_utils, handler.engine, handler.metrics = FakePb, tiny_engine, NoMetrics()
    handler.profiler = ExecuteProfiler(None, "")
    items = [Request(t, s, threshold=th) for t, s, th in _front_cases()[:4]]
    bad = Request("Some text.", items[0].schema, adapter="no-such-adapter")
    got = _answers(handler.execute([_batch(items), _batch([items[0], bad])]))
    for request, answer in zip(items, got[0]):
        assert not result_differences(answer, _gliner2(reference_model, request), atol=1e-4), request
    assert got[1][0] == "NOT_FOUND" and got[1][1].startswith("item 1 (0-based) of 2: unknown adapter")


class _SenderRequest(dict):
    """A request (its input arrays) with a response sender that records what was sent."""

    def __init__(self, arrays: dict):
        super().__init__(arrays)
        self.sent: list = []

    def get_response_sender(self):
        return self

    def send(self, response=None, flags=0):
        self.sent.append((response, flags))


def test_front_with_batches_in_flight_answers_each_request_once_as_the_waiting_front(front, monkeypatch):
    """front_inflight > 1: execute() returns None at once for each batch; pool threads call the
    GPU stage and answer each request exactly once, with the final flag, through its sender:
    the same answers as the waiting front's, a malformed request's error included."""
    import copy
    import threading

    from manylora.client import protocol
    from manylora.client.protocol import Request

    monkeypatch.setattr(FakePb, "TRITONSERVER_RESPONSE_COMPLETE_FINAL", 1, raising=False)
    cases = [c for c in _front_cases() if 0.0 <= c[2] <= 1.0]
    batches = [
        [Request(t, s, threshold=th, include_confidence=True).to_arrays() for t, s, th in cases[k::3]] for k in range(3)
    ]
    del batches[1][0][protocol.TEXT]  # a malformed request among good ones
    want = [_answers(front.execute(batch)) for batch in batches]
    assert want[1][0][0] == "INVALID_ARG" and all(not isinstance(a, tuple) for a in want[0])
    lock = threading.Lock()  # the in-process GPU stage is one engine: one call at a time, as its own process runs
    real_exec = FakePb.InferenceRequest.exec
    handed_on = threading.Event()  # set once the first two execute() calls have returned

    def exec_one_at_a_time(self):
        # a front that waited for its GPU-stage call in execute() would never set the event:
        # its batches would then fail (INTERNAL) and differ from the waiting front's answers
        assert handed_on.wait(60), "execute() waited for the GPU stage"
        with lock:
            return real_exec(self)

    monkeypatch.setattr(FakePb.InferenceRequest, "exec", exec_one_at_a_time)
    inflight = copy.copy(front)
    inflight.start_inflight(2)
    sent = []
    try:
        for k, batch in enumerate(batches):
            requests = [_SenderRequest(arrays) for arrays in batch]
            assert inflight.execute(requests) is None
            sent.append(requests)
            if k == 1:  # both slots taken, nothing answered yet: the third execute() waits for a slot
                assert not any(r.sent for rs in sent for r in rs)
                handed_on.set()
    finally:
        handed_on.set()
        inflight._inflight[0].shutdown(wait=True)  # every batch answered
    for requests, expected in zip(sent, want):
        assert all(len(r.sent) == 1 and r.sent[0][1] == 1 for r in requests), "one final response each"
        assert _answers([r.sent[0][0] for r in requests]) == expected
    slots = inflight._inflight[1]
    assert all(slots.acquire(blocking=False) for _ in range(2)), "every slot is free again"


def test_front_in_flight_answers_every_request_when_its_batch_fails(front, monkeypatch):
    """A batch whose GPU-stage call or decoding raises (a bug) still answers each of its
    requests once, with INTERNAL, and frees its slot; after unload a batch is answered in
    execute() itself."""
    import copy

    from manylora.client.protocol import Request

    monkeypatch.setattr(FakePb, "TRITONSERVER_RESPONSE_COMPLETE_FINAL", 1, raising=False)
    inflight = copy.copy(front)
    inflight.start_inflight(1)
    monkeypatch.setattr(inflight, "_front_finish", lambda *job: 1 / 0)
    requests = [_SenderRequest(Request(f"text {k}", '{"entities": ["x"]}').to_arrays()) for k in range(3)]
    assert inflight.execute(requests) is None
    inflight._inflight[0].shutdown(wait=True)
    assert [CODE_NAMES[r.sent[0][0].error().code] for r in requests] == ["INTERNAL"] * 3
    assert all(len(r.sent) == 1 and "ZeroDivisionError" in r.sent[0][0].error().message() for r in requests)
    assert inflight._inflight[1].acquire(blocking=False), "the slot is free again"
    inflight._inflight[1].release()
    late = [_SenderRequest(Request("late", '{"entities": ["x"]}').to_arrays())]
    assert inflight.execute(late) is None and len(late[0].sent) == 1  # the pool is shut down: answered here
