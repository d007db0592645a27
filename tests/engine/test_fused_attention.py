"""``fused_attention`` (kernels/disattn.py in the encoder; on the CPU under the Triton
interpreter, on a GPU for real): answers equal the eager attention's and GLiNER2 + PEFT's, with
adapters on the attention's projections and rows of different lengths in one chunk (padding
keys skipped); the load-time check refuses a kernel that does not match."""

from __future__ import annotations

import json

import pytest
import torch

from manylora import kernels
from manylora.compare import result_differences
from manylora.config import ConfigError, EngineConfig
from manylora.demo import demo_schemas, demo_texts
from manylora.engine import Engine, Request

DEVICE = "cuda:0" if torch.cuda.is_available() else "cpu"


def _engine(checkpoint, adapters_root, **parameters) -> Engine:
    values = {"checkpoint": str(checkpoint), "adapter_dir": str(adapters_root), "kernel_backend": "triton"}
    values.update({"dtype": "float32", "cuda_graphs": "off", **parameters})
    return Engine(EngineConfig.from_parameters(values, device=DEVICE))


def test_fused_attention_answers_like_the_eager_attention_and_peft(
    tiny_checkpoint, demo_adapters, peft_reference, monkeypatch
):
    from gliner2.inference.schema import Schema

    root = next(iter(demo_adapters.values())).parent
    engine = _engine(tiny_checkpoint, root, fused_attention="on")
    assert engine.encoder.fused_attention
    names = ["enc-heads-r16", "qv-r8", ""]  # LoRA on query/key (the position terms too) and base rows
    texts = demo_texts(5, seed=41, min_words=4, max_words=70)  # one chunk, rows padded to its longest
    schemas = demo_schemas()
    requests = [
        Request(t, json.dumps(schemas[i % len(schemas)]), adapter=names[i % len(names)], include_confidence=True)
        for i, t in enumerate(texts)
    ]
    calls = []
    kernel = kernels.disentangled_attention
    monkeypatch.setattr(kernels, "disentangled_attention", lambda *a: calls.append(a[0].shape) or kernel(*a))
    fused = engine.run(requests)
    ran = len(calls)
    assert ran >= engine.encoder.geometry.num_layers, "every layer of the forward"
    engine.encoder.fused_attention = False
    eager = engine.run(requests)
    assert len(calls) == ran, "off: the eager attention"
    assert [result_differences(a, b, atol=1e-4) for a, b in zip(fused, eager)] == [[]] * len(requests)
    for request, answer in zip(requests, fused):
        model = peft_reference(demo_adapters[request.adapter] if request.adapter else None)
        (expected,) = model.batch_extract([request.text], Schema.from_json(request.schema), include_confidence=True)
        assert result_differences(answer, expected, atol=1e-4) == [], request.adapter


def test_fused_attention_is_checked_at_load(tiny_checkpoint, demo_adapters, monkeypatch):
    """On with the triton backend: the kernel meets the eager attention at load, and one that does
    not match refuses the load with the parameter's name; on the torch backend the parameter
    leaves the eager attention in place."""
    root = next(iter(demo_adapters.values())).parent
    if DEVICE == "cpu":
        torch_backend = _engine(tiny_checkpoint, root, fused_attention="on", kernel_backend="torch")
        assert not torch_backend.encoder.fused_attention
    kernel = kernels.disentangled_attention
    monkeypatch.setattr(kernels, "disentangled_attention", lambda *a: kernel(*a) + 1.0)
    with pytest.raises(ConfigError, match="parameter 'fused_attention': the attention kernel's output differs"):
        _engine(tiny_checkpoint, root, fused_attention="on")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and bfloat16 need a CUDA device")
def test_fused_attention_replays_in_cuda_graphs_in_bfloat16(tiny_checkpoint, demo_adapters):
    """The serving setting: bfloat16 and CUDA graphs. Base rows of varied lengths (padded rows
    and keys) through a graph of the fused attention (its flag in the key) give the eager
    encoder's hidden states on every real token, within bfloat16's tolerance."""
    root = next(iter(demo_adapters.values())).parent
    engine = _engine(tiny_checkpoint, root, fused_attention="on", dtype="bfloat16", cuda_graphs="on")
    graphs = engine.graphs
    gen = torch.Generator().manual_seed(5)
    rows, length = 5, 48
    ids = torch.randint(5, 100, (rows, length), generator=gen).to(DEVICE)
    mask = (torch.arange(length)[None, :] < torch.tensor([48, 30, 1, 17, 47])[:, None]).long().to(DEVICE)
    before = dict(graphs.stats)
    with torch.inference_mode():
        replayed = graphs.run(ids, mask, [-1] * rows, None, None).clone()
        again = graphs.run(ids, mask, [-1] * rows, None, None).clone()
        engine.encoder.fused_attention = False
        eager = engine.encoder(ids, mask)
    assert any(key[4] for key in graphs.graphs), "a graph of the fused attention"
    assert graphs.stats["replays"] >= before["replays"] + 2
    real = mask.bool()
    atol, rtol = kernels.TOLERANCES[torch.bfloat16]
    torch.testing.assert_close(replayed[real].float(), eager[real].float(), atol=atol, rtol=rtol)
    assert torch.equal(replayed, again)
