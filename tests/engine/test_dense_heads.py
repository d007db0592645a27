"""The GPU stage's dense heads path (HeadLoras.span_logits_dense + post.compact_dense_begin) gives
the compact rows of the per-row list path (GLiNER2's batched span scoring with its
per-row layout + post.compact_batch), field for field (scores to float32 rounding), for mixed schemas, thresholds and
adapters with head LoRA. Both paths' answers are checked against GLiNER2 + PEFT elsewhere
(test_fidelity, test_post, the end-to-end suite); this pins the two layouts to each other."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from manylora.config import EngineConfig
from manylora.demo import demo_schemas, demo_texts
from manylora.engine import Engine, Request

DEVICE = "cuda:0" if torch.cuda.is_available() else "cpu"
EDGE_TEXTS = ["Apple", "Did Marie Curie work in Paris?", "¡Hola! José García moved from São Paulo to Zürich."]


@pytest.fixture(scope="module")
def engine(tiny_checkpoint, demo_adapters):
    root = next(iter(demo_adapters.values())).parent
    params = {"checkpoint": str(tiny_checkpoint), "adapter_dir": str(root), "max_gpu_adapters": "8"}
    return Engine(EngineConfig.from_parameters(params, device=DEVICE))


# On a GPU (bfloat16) two layouts of the same heads may round differently: another batch of
# rows in a GEMM, or another count of GRU steps before the count embedding's projector, and the
# tiny checkpoint's span logits cancel a lot. Hits then agree except where a score lies within
# this much of the threshold. Measured on the H200 (session 12), the count gate's arms (1 GRU
# step against the tasks' counts): two hits changed at threshold 0.2 with a tolerance of 0.02,
# and a hit's score differed by 0.053 (0.395 against 0.447). On the CPU (float32) rows are equal.
GPU_SCORE_TOL = 0.1


def _assert_same_hits(a: dict, b: dict, threshold: float, where) -> None:
    """Rows ``a`` and ``b`` (``CompactRow.to_arrays``) have the same hits and scores; on a GPU,
    up to ``GPU_SCORE_TOL``, and a hit that only one of them has scores within it of the threshold."""
    if DEVICE == "cpu":
        assert np.array_equal(a["hits"], b["hits"]), where
        assert np.allclose(a["scores"], b["scores"], rtol=1e-5, atol=1e-8), where
        return
    ours = dict(zip(map(tuple, a["hits"].tolist()), a["scores"].tolist()))
    theirs = dict(zip(map(tuple, b["hits"].tolist()), b["scores"].tolist()))
    for hit in ours.keys() ^ theirs.keys():
        score = ours.get(hit, theirs.get(hit))
        assert score < threshold + GPU_SCORE_TOL, (where, hit, score)
    for hit in ours.keys() & theirs.keys():
        assert abs(ours[hit] - theirs[hit]) <= GPU_SCORE_TOL, (where, hit, ours[hit], theirs[hit])


def _rows(engine, prepared, list_heads: bool):
    engine.list_heads = list_heads
    try:
        out = {}
        for chunk in engine._chunks(list(prepared)):
            batch, states, slots = engine.forward(chunk)
            for p, row in zip(chunk, engine.compact(chunk, batch, states, slots)):
                out[p.index] = row
        return out
    finally:
        engine.list_heads = False


@pytest.mark.parametrize("threshold", [0.0, 0.37, 0.5, 0.9])
def test_dense_rows_equal_list_rows(engine, demo_adapters, threshold):
    adapters = [""] + sorted(n for n in demo_adapters if "heads" in n) + sorted(demo_adapters)[:3]
    schemas = demo_schemas()
    texts = demo_texts(20, seed=13, min_words=5, max_words=60) + EDGE_TEXTS
    requests = [
        Request(t, json.dumps(schemas[i % len(schemas)]), adapter=adapters[i % len(adapters)], threshold=threshold)
        for i, t in enumerate(texts)
    ]
    found: dict = {}
    prepared = [engine.prepare(i, r, found) for i, r in enumerate(requests)]
    with torch.inference_mode():
        dense, listed = _rows(engine, prepared, False), _rows(engine, prepared, True)
    assert sorted(dense) == sorted(listed) == list(range(len(requests)))
    hits = 0
    for index in range(len(requests)):
        a, b = dense[index].to_arrays(), listed[index].to_arrays()
        assert a.keys() == b.keys()
        for key in a:
            assert a[key].shape == b[key].shape, (index, key)
            if key in ("scores", "cls_probs", "hit_logits"):
                # the same GEMMs on the same values, but CPU float32 BLAS may round the last bit
                # differently for differently placed buffers (measured: 3 of ~90k scores, <= 2e-9)
                assert np.allclose(a[key], b[key], rtol=1e-5, atol=1e-8, equal_nan=True), (index, key)
            else:
                assert np.array_equal(a[key], b[key]), (index, key)
        hits += len(a["hits"])
    assert hits > 0  # the comparison saw span hits, not only empty rows


def test_fused_span_scores_give_the_same_rows(engine, demo_adapters, monkeypatch):
    """``fused_span_scores`` (kernels/spanscores.py; on the CPU under the Triton interpreter) gives
    the dense path's compact rows: the same hits and scores up to float32 summation order, with
    head LoRA on the span projections and mixed schemas."""
    adapters = [""] + sorted(n for n in demo_adapters if "heads" in n)
    schemas = demo_schemas()
    texts = demo_texts(6, seed=29, min_words=5, max_words=40) + EDGE_TEXTS
    requests = [
        Request(t, json.dumps(schemas[i % len(schemas)]), adapter=adapters[i % len(adapters)], threshold=0.3)
        for i, t in enumerate(texts)
    ]
    found: dict = {}
    prepared = [engine.prepare(i, r, found) for i, r in enumerate(requests)]
    from manylora import kernels

    calls = []
    kernel = kernels.span_scores
    monkeypatch.setattr(kernels, "span_scores", lambda *a: calls.append(a[0].shape) or kernel(*a))
    default = engine.heads.span_kernel  # on by default on a GPU with the triton backend
    try:
        with torch.inference_mode():
            engine.heads.span_kernel = False
            plain = _rows(engine, prepared, False)
            assert not calls
            engine.heads.span_kernel = True
            fused = _rows(engine, prepared, False)
    finally:
        engine.heads.span_kernel = default
    assert calls, "the kernel did not run"
    hits = 0
    for index in range(len(requests)):
        a, b = fused[index].to_arrays(), plain[index].to_arrays()
        assert a.keys() == b.keys()
        for key in a:
            if key in ("scores", "cls_probs", "hit_logits"):
                assert np.allclose(a[key], b[key], rtol=1e-4, atol=1e-6, equal_nan=True), (index, key)
            else:
                assert np.array_equal(a[key], b[key]), (index, key)
        hits += len(a["hits"])
    assert hits > 0


def test_fused_span_scores_is_checked_at_load(tiny_checkpoint, monkeypatch):
    """On with the triton backend: the kernel meets GLiNER2's span head at load, and a kernel
    that does not match refuses the load with the parameter's name; on the torch backend the
    parameter leaves GLiNER2's head in place."""
    from manylora import kernels
    from manylora.config import ConfigError

    params = {"checkpoint": str(tiny_checkpoint), "fused_span_scores": "on"}
    assert Engine(EngineConfig.from_parameters({**params, "kernel_backend": "triton"}, device=DEVICE)).heads.span_kernel
    if DEVICE == "cpu":
        assert not Engine(EngineConfig.from_parameters(params, device=DEVICE)).heads.span_kernel  # torch backend
    kernel = kernels.span_scores
    monkeypatch.setattr(kernels, "span_scores", lambda *a: kernel(*a) + 1.0)
    with pytest.raises(ConfigError, match="parameter 'fused_span_scores': the span kernel's logits differ"):
        Engine(EngineConfig.from_parameters({**params, "kernel_backend": "triton"}, device=DEVICE))


@pytest.mark.parametrize("zeros", ["half", "all"])
def test_entity_only_chunks_gate_their_hits_by_count(engine, demo_adapters, monkeypatch, zeros):
    """A chunk of entity tasks only (classification tasks beside them) does not wait for the
    count head in its heads: each task's count gates its hits on the GPU and reaches the host
    with them. Its rows equal the list path's field for field (hits on a GPU: see
    ``_assert_same_hits``), with counts of 0 forced for about
    half the prompts (chosen by their own features; 2 for the others) or for all, and head-LoRA
    adapters."""
    import manylora.engine as engine_module

    schemas = [s for s in demo_schemas() if set(s) == {"entities"}]
    # rows of 1, 3 and 5 entity types in one chunk (queries padded per row, and rows of one
    # width), and a classification task beside entities
    sentiment = {"task": "sentiment", "labels": ["positive", "negative", "neutral"]}
    schemas += [
        {"entities": ["person"]},
        {"entities": ["person", "company", "city", "date", "product"]},
        {"entities": ["person", "location"], "classifications": [sentiment]},
    ]
    adapters = [""] + sorted(n for n in demo_adapters if "heads" in n)
    texts = demo_texts(12, seed=31, min_words=5, max_words=50) + EDGE_TEXTS
    requests = [
        Request(t, json.dumps(schemas[i % len(schemas)]), adapter=adapters[i % len(adapters)], threshold=0.2)
        for i, t in enumerate(texts)
    ]
    count_pred = engine.model.count_pred

    class CountsSomeZero(torch.nn.Module):
        """Counts of 0 for the chosen prompts and of 2 for the others, all by a clear margin: the
        paths run the count head on differently stacked rows, and in bfloat16 on a GPU a
        near-tie of the head's own logits could pick another count in each."""

        def forward(self, x):
            out = count_pred(x).clone()
            chosen = (x.float()[:, :8].sum(dim=1) * 1e4).long() % 2 == 0
            if zeros == "all":
                chosen[:] = True
            out[chosen, 0] = out.max() + 1.0
            out[~chosen, 2] = out.max() + 1.0
            return out

    plans = []
    real = engine_module.compact_dense_begin
    monkeypatch.setattr(
        engine_module, "compact_dense_begin", lambda logits, plan, *a: plans.append(plan) or real(logits, plan, *a)
    )
    found: dict = {}
    prepared = [engine.prepare(i, r, found) for i, r in enumerate(requests)]
    engine.model.count_pred = CountsSomeZero()  # not monkeypatch: its undo deletes a submodule
    try:
        with torch.inference_mode():
            dense, listed = _rows(engine, prepared, False), _rows(engine, prepared, True)
            engine.heads.count_gate = False  # the A/B's other arm: the wait for the count head
            waited = _rows(engine, prepared, False)
    finally:
        engine.model.count_pred = count_pred
        engine.heads.count_gate = True
    gated_plans = len(plans) - sum("counts" not in p for p in plans)
    assert gated_plans and gated_plans < len(plans), "the entity-only chunks took the gated path, then not"
    for index in range(len(requests)):  # the other arm gives the same rows
        _assert_same_hits(dense[index].to_arrays(), waited[index].to_arrays(), 0.2, (index, "waited"))
    zero = gated_rows = hits = probabilities = 0
    for index in range(len(requests)):
        a, b = dense[index].to_arrays(), listed[index].to_arrays()
        _assert_same_hits(a, b, 0.2, (index, "listed"))
        for key in a.keys() - {"hits", "scores"}:
            if key in ("cls_probs", "hit_logits"):
                assert np.allclose(a[key], b[key], rtol=1e-5, atol=1e-8, equal_nan=True), (index, key)
            else:
                assert np.array_equal(a[key], b[key]), (index, key)
        zero += int((a["counts"] == 0).sum())
        gated_rows += int(a["grid"].sum() == 0)
        hits += len(a["hits"])
        probabilities += len(a["cls_probs"])
    assert zero and gated_rows and probabilities, (zero, gated_rows, probabilities)
    assert (hits > 0) == (zeros == "half"), hits  # hits where counts are above 0, none where all are 0
