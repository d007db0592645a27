"""A batch mixing many adapters and base rows: every answer equals GLiNER2 + PEFT with that adapter alone."""

from __future__ import annotations

import json

import pytest

from manylora.compare import result_differences
from manylora.config import EngineConfig
from manylora.demo import demo_schemas, demo_texts
from manylora.engine import Engine, Request


def _engine(checkpoint, adapters_root, device="cpu", **parameters):
    values = {"checkpoint": str(checkpoint), "adapter_dir": str(adapters_root)}
    values.update({k: str(v) for k, v in parameters.items()})
    return Engine(EngineConfig.from_parameters(values, device=device))


def _mixed_requests(adapter_names, per_adapter=3, seed=11):
    schemas = demo_schemas()
    texts = demo_texts(per_adapter * (len(adapter_names) + 1), seed=seed)
    requests = []
    names = list(adapter_names) + [""]  # "" = base rows in the same batch
    for i, text in enumerate(texts):
        name = names[i % len(names)]
        requests.append(Request(text, json.dumps(schemas[i % len(schemas)]), adapter=name, include_confidence=True))
    return requests


def _check_against_peft(requests, got, demo_adapters, peft_reference):
    from gliner2.inference.schema import Schema

    failures = []
    for request, answer in zip(requests, got):
        model = peft_reference(demo_adapters[request.adapter] if request.adapter else None)
        (expected,) = model.batch_extract([request.text], Schema.from_json(request.schema), include_confidence=True)
        diffs = result_differences(answer, expected, atol=1e-4)
        if diffs:
            failures.append(f"adapter={request.adapter or 'base'}: {diffs[:2]}")
    assert not failures, "\n".join(failures[:10])


def test_adapters_change_answers(demo_adapters, peft_reference):
    """Guard against a vacuous comparison: every demo adapter changes GLiNER2's own answer."""
    from gliner2.inference.schema import Schema

    text = demo_texts(1, seed=5)[0]
    schema = Schema.from_dict(demo_schemas()[0])
    base = peft_reference(None).batch_extract([text], schema, include_confidence=True)[0]
    for name, folder in demo_adapters.items():
        adapted = peft_reference(folder).batch_extract([text], schema, include_confidence=True)[0]
        assert result_differences(adapted, base), f"adapter {name} does not change the answer"


def test_mixed_batch_equals_peft_per_adapter(tiny_checkpoint, demo_adapters, peft_reference):
    names = sorted(demo_adapters)
    assert len(names) >= 8
    engine = _engine(tiny_checkpoint, next(iter(demo_adapters.values())).parent, max_gpu_adapters=16)
    requests = _mixed_requests(names)
    got = engine.run(requests)
    _check_against_peft(requests, got, demo_adapters, peft_reference)
    assert engine.store.loads["gpu"] == len(names)


def test_more_adapters_than_gpu_slots_are_served_in_waves(tiny_checkpoint, demo_adapters, peft_reference):
    names = sorted(demo_adapters)
    engine = _engine(tiny_checkpoint, next(iter(demo_adapters.values())).parent, max_gpu_adapters=3, max_cpu_adapters=4)
    requests = _mixed_requests(names, per_adapter=2, seed=12)
    chunks = engine._chunks([engine.prepare(i, r) for i, r in enumerate(requests)])
    assert len(chunks) >= len(names) // 3
    assert all(len({p.request.adapter for p in c if p.request.adapter}) <= 3 for c in chunks)
    got = engine.run(requests)
    _check_against_peft(requests, got, demo_adapters, peft_reference)


def test_triton_kernels_in_the_engine(tiny_checkpoint, demo_adapters, peft_reference):
    """The Triton SGMV kernels (interpreted on CPU, real on GPU) inside a full forward."""
    pytest.importorskip("triton")
    import torch

    names = ["enc-r4", "enc-heads-r16", "patterns-r12"]
    # Triton kernels need CUDA tensors where a GPU is present (the interpreter is on only without one)
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    engine = _engine(
        tiny_checkpoint, next(iter(demo_adapters.values())).parent, device, kernel_backend="triton", dtype="float32"
    )
    requests = _mixed_requests(names, per_adapter=1, seed=13)
    got = engine.run(requests)
    _check_against_peft(requests, got, demo_adapters, peft_reference)


def test_unknown_and_invalid_adapters_fail_alone(tiny_checkpoint, demo_adapters):
    engine = _engine(tiny_checkpoint, next(iter(demo_adapters.values())).parent)
    good = Request("Grace Hopper worked at Harvard.", json.dumps({"entities": ["person"]}), adapter="enc-r4")
    bad = [Request(good.text, good.schema, adapter=a) for a in ("missing-adapter", "../enc-r4", "/etc", "a" * 300)]
    got = engine.run([good, *bad])
    assert isinstance(got[0], dict)
    assert [getattr(g, "code", None) for g in got[1:]] == ["NOT_FOUND", "INVALID_ARG", "INVALID_ARG", "INVALID_ARG"]


def test_position_kernel_equals_the_eager_path_in_the_engine(tiny_checkpoint, demo_adapters, monkeypatch):
    """The fused position-score kernel (on CUDA when present, else interpreted) inside a full
    float32 forward of a mixed batch: the same encoder states and answers as the eager path."""
    import torch

    from manylora import encoder as encoder_module

    pytest.importorskip("triton")
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    values = {"checkpoint": str(tiny_checkpoint), "adapter_dir": str(next(iter(demo_adapters.values())).parent)}
    values["dtype"] = "float32"  # "auto" is bfloat16 on CUDA, where 1-ulp score changes move answers
    engine = Engine(EngineConfig.from_parameters(values, device=device))
    engine.graphs = None  # every forward runs eagerly: a replayed graph would not see the patches below
    engine.encoder.backend = "triton"  # the position and bias kernels; SGMV on the device's default
    assert engine.dtype == torch.float32
    names = ["enc-r8", "qv-r8", "enc-heads-r16", "patterns-r12", ""]
    texts = demo_texts(len(names), seed=17, min_words=10, max_words=20)  # short: the interpreter is slow
    schema = json.dumps(demo_schemas()[0])
    requests = [Request(t, schema, adapter=n, include_confidence=True) for t, n in zip(texts, names)]
    calls = []
    fused = encoder_module.kernels.position_scores
    monkeypatch.setattr(
        encoder_module.kernels, "position_scores", lambda *a, **k: calls.append(k["backend"]) or fused(*a, **k)
    )
    with torch.inference_mode():
        prepared = [engine.prepare(i, r) for i, r in enumerate(requests)]
        (chunk,) = engine._chunks(prepared)
        _, kernel_states, _ = engine.forward(list(chunk))
        assert "triton" in calls, "the kernel ran"
        kernel_answers = engine.run(requests) if device != "cpu" else None  # interpreted: the states suffice
        monkeypatch.setattr(encoder_module.kernels, "position_scores_supported", lambda head_size: False)
        _, eager_states, _ = engine.forward(list(chunk))
        eager_answers = engine.run(requests) if device != "cpu" else None
    torch.testing.assert_close(kernel_states, eager_states, atol=1e-4, rtol=1e-4)
    if kernel_answers is not None:
        diffs = [result_differences(a, b, atol=1e-4) for a, b in zip(kernel_answers, eager_answers)]
        assert diffs == [[]] * len(requests)


def test_write_first_equals_the_update_after_the_gemm(tiny_checkpoint, demo_adapters, monkeypatch):
    """Every row with an adapter: each target's output is written as bias + update, then the base
    GEMM adds itself (LoraBatch.writes_first). Same encoder states and answers as updating the
    GEMM's output afterwards, and the write path really ran; with one base row it does not."""
    import torch

    from manylora import kernels

    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    values = {"checkpoint": str(tiny_checkpoint), "adapter_dir": str(next(iter(demo_adapters.values())).parent)}
    engine = Engine(EngineConfig.from_parameters({**values, "dtype": "float32"}, device=device))
    engine.graphs = None  # every forward runs eagerly: a replayed graph would not record its launches
    engine.encoder.lora_fuse_epilogue = False  # else the targets with an epilogue update after the GEMM
    names = ["enc-r8", "qv-r8", "enc-heads-r16", "patterns-r12", "enc-r8"]
    schema = json.dumps(demo_schemas()[0])
    texts = demo_texts(len(names), seed=23, min_words=10, max_words=30)
    requests = [Request(t, schema, adapter=n, include_confidence=True) for t, n in zip(texts, names)]
    modes = []
    apply = kernels.lora_apply
    monkeypatch.setattr(kernels, "lora_apply", lambda *a, **k: modes.append(k["accumulate"]) or apply(*a, **k))

    def run(write_first: bool, batch):
        engine.encoder.lora_write_first = write_first
        modes.clear()
        with torch.inference_mode():
            (chunk,) = engine._chunks([engine.prepare(i, r) for i, r in enumerate(batch)])
            states = engine.forward(list(chunk))[1]
        return states, engine.run(batch), list(modes)

    written, written_answers, written_modes = run(True, requests)
    updated, updated_answers, updated_modes = run(False, requests)
    assert written_modes and not any(written_modes), "every target was written first"
    assert updated_modes and all(updated_modes)
    torch.testing.assert_close(written, updated, atol=1e-5, rtol=1e-5)
    diffs = [result_differences(a, b, atol=1e-4) for a, b in zip(written_answers, updated_answers)]
    assert diffs == [[]] * len(requests)
    with_base = requests[:-1] + [Request(texts[-1], schema, adapter="", include_confidence=True)]
    with_base_modes = run(True, with_base)[2]
    assert with_base_modes and all(with_base_modes), "a row without an adapter: the update goes after the GEMM"


def _eager_engine(tiny_checkpoint, demo_adapters, backend, names, seed):
    """A float32 engine of ``backend`` whose forwards all run eagerly (a replayed graph would not
    record its launches), and one request per adapter name ("" = a base row)."""
    import torch

    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    values = {"checkpoint": str(tiny_checkpoint), "adapter_dir": str(next(iter(demo_adapters.values())).parent)}
    engine = Engine(
        EngineConfig.from_parameters({**values, "dtype": "float32", "kernel_backend": backend}, device=device)
    )
    engine.graphs = None
    schema = json.dumps(demo_schemas()[0])
    texts = demo_texts(len(names), seed=seed, min_words=10, max_words=30)
    return engine, [Request(t, schema, adapter=n, include_confidence=True) for t, n in zip(texts, names)], texts, schema


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fused_epilogue_equals_the_separate_passes(tiny_checkpoint, demo_adapters, monkeypatch, backend):
    """Every row with an adapter: DeBERTa's residual adds, layer norms and GELU run inside the LoRA
    expand (fused_lora_epilogue, LoraBatch.fuses_epilogue). Same encoder states and answers as the
    separate passes, and the epilogues really ran; with one base row they do not."""
    if backend == "triton":
        pytest.importorskip("triton")
    import torch

    from manylora import kernels

    names = ["enc-r8", "qv-r8", "enc-heads-r16", "patterns-r12", "enc-r8"]
    engine, requests, texts, schema = _eager_engine(tiny_checkpoint, demo_adapters, backend, names, 29)
    epilogues = []
    apply = kernels.lora_apply
    monkeypatch.setattr(
        kernels,
        "lora_apply",
        lambda *a, **k: (
            epilogues.append((k.get("residual") is not None, k.get("gelu", False), k.get("layer_norm") is not None))
            or apply(*a, **k)
        ),
    )

    def run(fused: bool, batch):
        engine.encoder.lora_fuse_epilogue = fused
        epilogues.clear()
        with torch.inference_mode():
            (chunk,) = engine._chunks([engine.prepare(i, r) for i, r in enumerate(batch)])
            states = engine.forward(list(chunk))[1]
        return states, engine.run(batch), list(epilogues)

    fused, fused_answers, fused_calls = run(True, requests)
    separate, separate_answers, separate_calls = run(False, requests)
    layers = len(engine.encoder.layers)
    assert fused_calls.count((True, False, True)) >= 2 * layers, (
        "attention output and FFN output carry the residual and the layer norm"
    )
    assert fused_calls.count((False, True, False)) >= layers, "the intermediate dense carries the GELU"
    assert separate_calls and not any(any(call) for call in separate_calls)
    torch.testing.assert_close(fused, separate, atol=1e-5, rtol=1e-5)
    diffs = [result_differences(a, b, atol=1e-4) for a, b in zip(fused_answers, separate_answers)]
    assert diffs == [[]] * len(requests)
    with_base = requests[:-1] + [Request(texts[-1], schema, adapter="", include_confidence=True)]
    with_base_calls = run(True, with_base)[2]
    assert with_base_calls and not any(any(call) for call in with_base_calls), "a base row: the passes run apart"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fused_epilogue_answers_equal_peft(tiny_checkpoint, demo_adapters, peft_reference, backend):
    """A batch whose every row has an adapter, with the epilogue fused: every answer is GLiNER2 +
    PEFT's with that adapter alone."""
    if backend == "triton":
        pytest.importorskip("triton")
    import torch

    device = "cuda:0" if torch.cuda.is_available() and backend == "triton" else "cpu"
    names = ["enc-r4", "enc-heads-r16", "patterns-r12", "qv-r8"]
    engine = _engine(
        tiny_checkpoint,
        next(iter(demo_adapters.values())).parent,
        device,
        kernel_backend=backend,
        dtype="float32",
        fused_lora_epilogue="on",
    )
    requests = [r for r in _mixed_requests(names, per_adapter=1, seed=31) if r.adapter]
    got = engine.run(requests)
    _check_against_peft(requests, got, demo_adapters, peft_reference)


def test_position_factors_prepared_at_once_equal_one_module_at_a_time(tiny_checkpoint, demo_adapters, monkeypatch):
    """LoraBatch.prepare_positions (every position module's factors in a few launches, here in
    chunks of two modules) gives each module s·A·windowᵀ of its row groups' slots (float32
    reference below), on a batch with adapters of different targets and ranks and a base row;
    the encoder takes the prepared factors, and its states are those of one module per chunk."""
    import torch

    from manylora.lora.batch import LoraBatch

    root = next(iter(demo_adapters.values())).parent
    engine = _engine(tiny_checkpoint, root, dtype="float32", max_gpu_adapters=5)
    names = ["enc-r8", "qv-r8", "enc-heads-r16", "patterns-r12", ""]
    texts = demo_texts(len(names), seed=31, min_words=8, max_words=16)
    schema = json.dumps(demo_schemas()[0])
    requests = [Request(t, schema, adapter=n) for t, n in zip(texts, names)]
    batches, used = [], []
    forward, factors = engine.encoder.forward, LoraBatch.position_factors
    monkeypatch.setattr(
        engine.encoder, "forward", lambda ids, mask, lora=None: batches.append(lora) or forward(ids, mask, lora)
    )
    monkeypatch.setattr(
        LoraBatch, "position_factors", lambda self, name, w: used.append((name, factors(self, name, w))) or used[-1][1]
    )
    with torch.inference_mode():
        # slot 0 (the last free one) holds an adapter that no row uses: the base row's group
        # gathers slot 0's A, so only the mask keeps it out of the base row
        engine.store.acquire([engine.store.get(n) for n in names if n])
        assert engine.store.acquire([engine.store.get("enc-r4")]) == {"enc-r4": 0}
        (chunk,) = engine._chunks([engine.prepare(i, r) for i, r in enumerate(requests)])
        prepared_states = engine.forward(list(chunk))[1].clone()
        lora = batches[-1]
        modules = engine.encoder.position_modules
        assert 0 not in lora.row_slots.tolist() and -1 in lora.row_slots.tolist()
        assert engine.store.a[modules[0]][0].abs().max() > 0
        assert lora._positions_window is not None and set(lora._positions) == set(modules) & lora.targets
        assert used and all(got is lora._positions[name] for name, got in used), "the encoder used them"
        monkeypatch.setattr(LoraBatch, "position_factors", factors)
        window = engine.encoder.rel_table[:40]
        groups, (_, rank, hidden) = lora.group_slots.shape[0], engine.store.a[modules[0]].shape
        monkeypatch.setattr(LoraBatch, "POSITION_CHUNK", 2 * groups * rank * hidden)
        lora.prepare_positions(modules, window)
        assert len([m for m in modules if m in lora.targets]) > 2, "more than one chunk of modules"
        slots = lora.group_slots.tolist()
        assert lora.base_group, "the base row's group is group 0"
        has = [k > 0 for k in range(len(slots))]
        for name in modules:
            got = lora.position_factors(name, window)
            if name not in lora.targets:
                assert got is None
                continue
            assert got is lora._positions[name] and got.lora_b is engine.store.b[name]
            a, scale = engine.store.a[name], engine.store.scales[name]
            want = torch.stack([h * scale[s] * a[s].double() @ window.double().t() for s, h in zip(slots, has)])
            torch.testing.assert_close(got.v.double(), want, atol=1e-5, rtol=1e-5)
            assert want.abs().max() > 0
        monkeypatch.setattr(LoraBatch, "POSITION_CHUNK", 1)  # one module per chunk
        alone_states = engine.forward(list(chunk))[1]
    torch.testing.assert_close(prepared_states, alone_states, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_grouped_qkv_shrinks_equal_the_separate_ones(tiny_checkpoint, demo_adapters, monkeypatch, backend):
    """A layer's query, key and value shrinks run as one pass over its input (LoraBatch.
    shrink_together, kernels.shrink_group) and their applies skip their own: bit-identical encoder
    states and answers to the separate shrinks, one grouped shrink per layer, every q, k, v apply
    served from it; with the grouping off, none. Mixed batches (an adapter of q and v only, a base
    row) included."""
    if backend == "triton":
        pytest.importorskip("triton")
    import torch

    from manylora import kernels

    names = ["enc-r8", "qv-r8", "enc-heads-r16", "patterns-r12", ""]
    engine, requests, _, _ = _eager_engine(tiny_checkpoint, demo_adapters, backend, names, 31)
    groups, shrunk = [], []
    group, apply = kernels.shrink_group, kernels.lora_apply
    monkeypatch.setattr(kernels, "shrink_group", lambda *a, **k: groups.append(len(a[1])) or group(*a, **k))
    monkeypatch.setattr(kernels, "lora_apply", lambda *a, **k: shrunk.append(k.get("shrunk")) or apply(*a, **k))

    def run(grouped: bool):
        engine.encoder.lora_group_shrinks = grouped
        groups.clear()
        shrunk.clear()
        with torch.inference_mode():
            (chunk,) = engine._chunks([engine.prepare(i, r) for i, r in enumerate(requests)])
            states = engine.forward(list(chunk))[1]
        calls = (list(groups), sum(bool(s) for s in shrunk))
        return states, engine.run(requests), calls

    grouped, grouped_answers, (group_calls, served) = run(True)
    separate, separate_answers, (separate_groups, separate_served) = run(False)
    layers = len(engine.encoder.layers)
    assert group_calls == [3] * layers, group_calls
    assert served == 3 * layers
    assert separate_groups == [] and separate_served == 0
    assert torch.equal(grouped, separate)
    diffs = [result_differences(a, b, atol=0) for a, b in zip(grouped_answers, separate_answers)]
    assert diffs == [[]] * len(requests)


def test_lora_tiles_that_skip_the_padding_leave_real_tokens_alone(tiny_checkpoint, demo_adapters, monkeypatch):
    """lora_skip_padding with the attention kernel (triton backend: interpreted on the CPU): every
    row has an adapter, so the updates are written first and the epilogues fused, and no tile
    covers a padded token. After every LoRA call the padded tokens are set to NaN, worse than any
    value they can hold: the real tokens' states still equal those of tiles over whole rows (no
    step reads a padded token), and so do the answers."""
    pytest.importorskip("triton")
    import torch

    from manylora import kernels

    names = ["enc-r8", "qv-r8", "enc-heads-r16", "patterns-r12", "enc-r8"]
    engine, requests, _, _ = _eager_engine(tiny_checkpoint, demo_adapters, "triton", names, 37)
    engine.encoder.lora_fuse_epilogue = True
    assert engine.encoder.padding_unread(engine.device)
    apply = kernels.lora_apply
    poisoned = []

    def poison(*args, **kwargs):
        out = apply(*args, **kwargs)
        y, meta = args[1], args[5]
        covered = torch.zeros(y.shape[0], dtype=torch.bool, device=y.device)
        for start, end, slot in meta.segments():
            covered[start:end] |= slot >= 0
        if engine.encoder.lora_skip_padding:
            y[~covered] = float("nan")
            poisoned.append(int((~covered).sum()))
        return out

    monkeypatch.setattr(kernels, "lora_apply", poison)

    def run(skip: bool):
        engine.encoder.lora_skip_padding = skip
        with torch.inference_mode():
            (chunk,) = engine._chunks([engine.prepare(i, r) for i, r in enumerate(requests)])
            batch, states, _ = engine.forward(list(chunk))
        real = batch.attention_mask.bool().to(states.device)  # the forward pads further, to a multiple of 16
        return states[:, : real.shape[1]][real], engine.run(requests)

    whole, whole_answers = run(False)
    skipped, skipped_answers = run(True)
    assert poisoned and min(poisoned) > 0, "rows of several lengths: some tokens are padding"
    torch.testing.assert_close(skipped, whole, atol=1e-5, rtol=1e-5)
    assert [result_differences(a, b, atol=1e-4) for a, b in zip(skipped_answers, whole_answers)] == [[]] * len(names)
