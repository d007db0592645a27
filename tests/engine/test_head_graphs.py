"""The heads of entity-only chunks as CUDA graphs (manylora.lora.head_graphs) give the dense
heads path's compact rows: rows, words, records and fields padded to buckets, head-LoRA
adapters and base rows in one chunk, rows of different label counts, per-row thresholds,
counts of 0. On the CPU the same padded body runs eagerly (``capture=False``), in float32, and
must give the eager path's rows; on a GPU the engine's own graphs are captured and replayed,
and hits are compared with test_dense_heads' tolerance (bfloat16 GEMMs of other shapes)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_dense_heads import DEVICE, EDGE_TEXTS, _assert_same_hits, _rows

from manylora.config import EngineConfig
from manylora.demo import demo_texts
from manylora.engine import Engine, Request
from manylora.lora.head_graphs import HeadGraphs, count_bucket


@pytest.fixture(scope="module")
def engine(tiny_checkpoint, demo_adapters):
    root = next(iter(demo_adapters.values())).parent
    params = {"checkpoint": str(tiny_checkpoint), "adapter_dir": str(root), "max_gpu_adapters": "8"}
    engine = Engine(EngineConfig.from_parameters(params, device=DEVICE))
    if DEVICE == "cpu":
        assert engine.heads.graphs is None  # a GPU-stage feature: off on the CPU
        engine.heads.graphs = HeadGraphs(
            engine.heads, engine.encoder.geometry.hidden_size, engine.dtype, DEVICE, capture=False
        )
    return engine


SCHEMAS = [
    {"entities": ["person", "organization", "location", "date", "money"]},
    {"entities": ["person"]},
    {"entities": {"person": "names of people", "city": "cities and towns", "product": "products"}},
    {"entities": ["person", "location"], "classifications": [{"task": "tone", "labels": ["calm", "angry"]}]},
]


def _requests(demo_adapters, n: int, seed: int, schemas, thresholds=(0.2, 0.35, 0.6)):
    adapters = [""] + sorted(n for n in demo_adapters if "heads" in n) + sorted(demo_adapters)[:2]
    texts = demo_texts(n, seed=seed, min_words=3, max_words=70) + EDGE_TEXTS
    return [
        Request(
            t,
            json.dumps(schemas[i % len(schemas)]),
            adapter=adapters[i % len(adapters)],
            threshold=thresholds[i % len(thresholds)],
        )
        for i, t in enumerate(texts)
    ]


def _compare(engine, prepared, threshold_floor: float) -> tuple[int, int]:
    """Hits of the graphed rows (equal to the eager rows'), and tasks they counted 0."""
    graphs = engine.heads.graphs
    before = graphs.stats["replays"]
    with torch.inference_mode():
        graphed = _rows(engine, prepared, False)
        engine.heads.graphs = None
        try:
            eager = _rows(engine, prepared, False)
        finally:
            engine.heads.graphs = graphs
    assert graphs.stats["replays"] > before, "no chunk took the graph path"
    hits = zeros = 0
    for index in eager:
        a, b = graphed[index].to_arrays(), eager[index].to_arrays()
        assert a.keys() == b.keys()
        _assert_same_hits(a, b, threshold_floor, index)
        for key in a.keys() - {"hits", "scores"}:
            if key in ("cls_probs", "hit_logits"):
                assert np.allclose(a[key], b[key], rtol=1e-5, atol=1e-6, equal_nan=True), (index, key)
            else:
                assert np.array_equal(a[key], b[key]), (index, key)
        hits += len(a["hits"])
        zeros += int((a["counts"] == 0).sum())
    return hits, zeros


@pytest.mark.parametrize("span_kernel", [False, True])
def test_graphed_heads_give_the_eager_rows(engine, demo_adapters, span_kernel):
    if DEVICE == "cuda:0" and not span_kernel:
        pytest.skip("on a GPU the engine's span kernel is the serving path")
    prepared = [engine.prepare(i, r, {}) for i, r in enumerate(_requests(demo_adapters, 21, 41, SCHEMAS))]
    default = engine.heads.span_kernel
    engine.heads.span_kernel = span_kernel  # the CPU runs the kernel under the Triton interpreter
    try:
        hits, _ = _compare(engine, prepared, 0.2)
    finally:
        engine.heads.span_kernel = default
    assert hits > 0


def test_graphed_heads_gate_counts_of_zero(engine, demo_adapters):
    """Counts of 0 forced for about half the prompts: those tasks get no hits in either path."""
    count_pred = engine.model.count_pred

    class SomeZero(torch.nn.Module):
        """Without host syncs (boolean-mask writes): a CUDA graph captures it."""

        def forward(self, x):
            out = count_pred(x).clone()
            chosen = (x.float()[:, :8].sum(dim=1) * 1e4).long() % 2 == 0
            top = out.max() + 1.0
            out[:, 0] = torch.where(chosen, top, out[:, 0])
            out[:, 2] = torch.where(chosen, out[:, 2], top)
            return out

    prepared = [engine.prepare(i, r, {}) for i, r in enumerate(_requests(demo_adapters, 15, 43, SCHEMAS[:3]))]
    graphs = engine.heads.graphs
    # graphs replay the modules they captured: new graphs, captured with the forced counts
    engine.heads.graphs = HeadGraphs(
        engine.heads, engine.encoder.geometry.hidden_size, engine.dtype, DEVICE, capture=DEVICE != "cpu"
    )
    engine.model.count_pred = SomeZero()  # not monkeypatch: its undo deletes a submodule
    try:
        hits, zeros = _compare(engine, prepared, 0.2)
    finally:
        engine.model.count_pred = count_pred
        engine.heads.graphs = graphs
    assert hits > 0 and zeros > 0, (hits, zeros)  # tasks counted 0 (gated) beside tasks with hits


def test_shapes_outside_the_buckets_run_eagerly(engine):
    graphs = engine.heads.graphs
    assert graphs.key(5, 40, 5, 25, 5, True)[:4] == (6, 48, 6, 32)
    assert graphs.key(2000, 40, 5, 25, 5, True) is None  # rows past the largest bucket
    assert graphs.key(4, 600, 4, 4, 1, False) is None  # words past the largest length bucket
    assert count_bucket(1025) == 1280 and count_bucket(20000) is None
