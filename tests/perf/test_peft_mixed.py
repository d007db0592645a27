"""The peft-mixed benchmark mode: GLiNER2 + PEFT with a different adapter on every row of one batch.

Its answers must be those of GLiNER2 + PEFT with each request's adapter alone; otherwise the
benchmark would compare ManyLoRA against something that is not the reference.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))

import bench_engine  # noqa: E402


@pytest.fixture(scope="module")
def mixed_server(tiny_checkpoint, demo_adapters):
    names = sorted(demo_adapters)
    root = demo_adapters[names[0]].parent
    return bench_engine.PeftMixedServer(tiny_checkpoint, root, names, "cpu", torch.float32)


@pytest.mark.parametrize("schema", [bench_engine.ENTITY_SCHEMA, bench_engine.MIXED_SCHEMA], ids=["entities", "mixed"])
def test_mixed_batch_equals_one_adapter_at_a_time(schema, mixed_server, demo_adapters, peft_reference):
    from gliner2.inference.schema import Schema

    from manylora.compare import result_differences
    from manylora.demo import demo_texts

    names = sorted(demo_adapters)
    # every demo adapter (ranks 4-64, encoder and heads, rsLoRA, rank patterns), repeats, a base row
    adapters = names + [names[2], "", names[0], names[5]]
    texts = demo_texts(len(adapters), seed=11, min_words=15, max_words=45)
    schema_obj = Schema.from_dict(schema)
    got, seconds = mixed_server.extract_batch(texts, schema_obj, adapters)
    assert len(seconds) == 3 and all(s >= 0 for s in seconds)
    changed = 0
    for text, adapter, result in zip(texts, adapters, got):
        folder = demo_adapters[adapter] if adapter else None
        expected = peft_reference(folder).batch_extract([text], Schema.from_dict(schema))[0]
        assert result_differences(result, expected) == [], f"row with adapter {adapter!r}"
        base = peft_reference(None).batch_extract([text], Schema.from_dict(schema))[0]
        changed += bool(adapter) and bool(result_differences(base, expected))
    assert changed >= len(names) // 2, "the adapters change answers, so the comparison is not vacuous"
    assert mixed_server._rows is None and mixed_server._single is None and mixed_server._table is None
