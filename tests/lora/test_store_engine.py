"""The tiered cache inside the engine: more distinct adapters than GPU + host slots, background
prefetch, preload and evict from other threads while batches run, hot reload and removal.

Every answer is checked against GLiNER2 + PEFT with that adapter alone (``peft_reference``).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import threading

import pytest
import torch

from manylora.compare import result_differences
from manylora.config import EngineConfig
from manylora.demo import demo_schemas, demo_texts
from manylora.engine import Engine, Request
from manylora.lora.demo_adapters import clone_random_adapters

ADAPTERS = 12
GPU_SLOTS, HOST_SLOTS = 2, 3


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_checkpoint, demo_adapters):
    """12 random adapters on encoder and heads (rank 16), cloned from a PEFT-written one."""
    root = tmp_path_factory.mktemp("fleet")
    folders = clone_random_adapters(demo_adapters["enc-heads-r16"], root, ADAPTERS, seed=7, dtype=torch.float32)
    return root, [f.name for f in folders]


@pytest.fixture
def engine(fleet, tiny_checkpoint, tmp_path):
    root = tmp_path / "adapters"
    shutil.copytree(fleet[0], root)
    parameters = {
        "checkpoint": str(tiny_checkpoint),
        "adapter_dir": str(root),
        "max_gpu_adapters": str(GPU_SLOTS),
        "max_cpu_adapters": str(HOST_SLOTS),
    }
    engine = Engine(EngineConfig.from_parameters(parameters))
    yield engine
    engine.store.close()


def _requests(names, seed):
    schemas = demo_schemas()
    texts = demo_texts(len(names), seed=seed)
    return [
        Request(text, json.dumps(schemas[i % 2]), adapter=name, include_confidence=True)
        for i, (text, name) in enumerate(zip(texts, names))
    ]


def _expected(requests, folder_of, peft_reference):
    from gliner2.inference.schema import Schema

    expected = []
    for request in requests:
        model = peft_reference(folder_of(request.adapter) if request.adapter else None)
        (answer,) = model.batch_extract([request.text], Schema.from_json(request.schema), include_confidence=True)
        expected.append(answer)
    return expected


def _check(requests, answers, expected):
    failures = []
    for request, answer, reference in zip(requests, answers, expected):
        assert isinstance(answer, dict), (request.adapter, answer)
        diffs = result_differences(answer, reference, atol=1e-4)
        if diffs:
            failures.append(f"adapter={request.adapter or 'base'}: {diffs[:2]}")
    assert not failures, "\n".join(failures[:10])


def test_more_adapters_than_both_tiers_under_background_churn(engine, fleet, peft_reference):
    """Batches over 12 adapters (> 2 GPU + 3 host slots) on the engine thread while two other
    threads prefetch, preload and evict at random: every answer equals PEFT's."""
    source, names = fleet
    store = engine.store
    stop = threading.Event()
    errors: list[BaseException] = []

    def churn(seed):
        rng = random.Random(seed)
        try:
            while not stop.is_set():
                action = rng.random()
                if action < 0.4:
                    store.prefetch(rng.sample(names, 3))
                elif action < 0.7:
                    store.evict(rng.sample(names, 2))
                else:
                    store.preload(rng.sample(names, 2))
                stop.wait(0.05)  # the control watcher acts at most every 0.1 s
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    rng = random.Random(3)
    batches = [_requests([rng.choice(names + [""]) for _ in range(8)], seed=100 + b) for b in range(4)]
    expected = [_expected(requests, lambda n: source / n, peft_reference) for requests in batches]
    threads = [threading.Thread(target=churn, args=(seed,)) for seed in (1, 2)]
    for thread in threads:
        thread.start()
    answers = []
    try:
        for requests in batches:
            store.prefetch(r.adapter for r in requests)  # loads in flight before the batch asks
            answers.append(engine.run(requests))
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    assert not errors, errors
    for requests, got, reference in zip(batches, answers, expected):
        _check(requests, got, reference)
    stats = store.stats()
    assert stats["resident"]["host"] <= HOST_SLOTS and stats["resident"]["gpu"] <= GPU_SLOTS
    assert stats["events"]["gpu"]["evict"] > 0 and stats["events"]["host"]["evict"] > 0


def test_hot_reload_and_removal(engine, fleet, peft_reference):
    source, names = fleet
    root = engine.store.root
    first, second, third = names[:3]
    requests = _requests([first, second, third, ""], seed=200)
    before = engine.run(requests)
    _check(requests, before, _expected(requests, lambda n: source / n, peft_reference))

    # hot reload: `first` now holds the weights of names[5]; written aside and renamed in
    for file in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copyfile(source / names[5] / file, root / f".{file}.new")
        os.replace(root / f".{file}.new", root / first / file)
    again = _requests([first, second, third, ""], seed=200)
    answers = engine.run(again)
    _check(again, answers, _expected(again, lambda n: source / (names[5] if n == first else n), peft_reference))
    assert result_differences(answers[0], before[0]), "the new weights change the answer"

    # removal: the adapter answers NOT_FOUND, the rest of the batch is served
    shutil.rmtree(root / second)
    mixed = _requests([second, third, ""], seed=201)
    got = engine.run(mixed)
    assert getattr(got[0], "code", None) == "NOT_FOUND"
    _check(mixed[1:], got[1:], _expected(mixed[1:], lambda n: source / n, peft_reference))


def test_a_batch_looks_each_adapter_up_once(engine, fleet, monkeypatch):
    """A batch repeating adapters checks each folder once (one host hit per adapter), and its
    start-up prefetch makes no futures for adapters already in host memory; every request is
    still answered with its own adapter."""
    names = sorted(fleet[1])[:3]
    for name in names:
        engine.store.get(name)
    looked_up, futures = [], []
    get, prefetch = engine.store.get, engine.store._prefetch
    monkeypatch.setattr(engine.store, "get", lambda name: looked_up.append(name) or get(name))
    monkeypatch.setattr(engine.store, "_prefetch", lambda *a, **k: futures.append(a[0]) or prefetch(*a, **k))
    hits = engine.store.stats()["events"]["host"]["hit"]
    schema = json.dumps(demo_schemas()[0])
    requests = [Request(t, schema, adapter=names[i % 3]) for i, t in enumerate(demo_texts(9, seed=5))]
    results = engine.run(requests)
    assert sorted(looked_up) == names and futures == []
    assert engine.store.stats()["events"]["host"]["hit"] - hits == 3
    alone = [engine.run([r])[0] for r in requests]  # each request in a batch of its own
    assert [result_differences(a, b, atol=1e-5) for a, b in zip(results, alone)] == [[]] * len(requests)


def test_a_stuck_load_fails_only_its_requests_and_serves_later_ones(engine, fleet, peft_reference, monkeypatch):
    """A load that blocks (a hung file system) past adapter_load_timeout: the requests for that
    adapter get UNAVAILABLE, the rest of the batch equals GLiNER2 + PEFT, nothing waits longer
    than the deadline, and once the load ends its adapter serves the next requests."""
    import time

    from manylora.lora import store as store_module

    root, names = fleet
    stuck, others = names[0], names[1:3]
    release = threading.Event()
    load = store_module.load_adapter

    def slow_load(adapter_id, *args, **kwargs):
        if adapter_id == stuck:
            release.wait(30)
        return load(adapter_id, *args, **kwargs)

    monkeypatch.setattr(store_module, "load_adapter", slow_load)
    engine.store.load_timeout = 0.5
    requests = _requests([stuck, others[0], "", others[1], stuck], seed=31)
    started = time.perf_counter()
    answers = engine.run(requests)
    assert time.perf_counter() - started < 10, "the batch waited for the stuck load"
    for request, answer in zip(requests, answers):
        if request.adapter == stuck:
            assert getattr(answer, "code", None) == "UNAVAILABLE", answer
            assert "did not load within 0.5 s" in answer.message
    good = [(r, a) for r, a in zip(requests, answers) if r.adapter != stuck]
    _check(
        [r for r, _ in good], [a for _, a in good], _expected([r for r, _ in good], lambda n: root / n, peft_reference)
    )
    release.set()
    deadline = time.monotonic() + 20
    while engine.store._loading.get(stuck) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    again = [r for r in requests if r.adapter == stuck]
    _check(again, engine.run(again), _expected(again, lambda n: root / n, peft_reference))
