"""The adapter store under many threads: requests, prefetches, preloads and evictions at once.

One thread plays the engine (``get`` then ``acquire`` for waves, then reads its slots back
while the others work: the slots of the batch in flight must not change). The others
prefetch, preload and evict at random, as the control watcher and the request path do.
Among the adapters are a corrupt one and one that is rewritten (hot reload) during the
run. Afterwards every resident adapter and every mapped slot equals a direct load.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time

import torch
from safetensors.torch import save_file

from manylora.lora.adapter import AdapterError, load_adapter
from manylora.lora.store import AdapterStore

SHAPES = {"x.lin": (6, 5), "y.lin": (4, 7)}
NAMES = [f"a{i:02d}" for i in range(24)]
GPU_SLOTS, HOST_SLOTS = 3, 5
BATCHES = 60


def _write(root, name, seed, rank):
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for path, (i, o) in SHAPES.items():
        if seed % 3 == 0 and path == "y.lin":
            continue  # some adapters leave a target alone: its slot rows must be zero
        tensors[f"base_model.model.{path}.lora_A.weight"] = torch.randn(rank, i, generator=generator)
        tensors[f"base_model.model.{path}.lora_B.weight"] = torch.randn(o, rank, generator=generator)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": rank + 1}))
    save_file(tensors, str(folder / "adapter_model.safetensors.tmp"))
    os.replace(folder / "adapter_model.safetensors.tmp", folder / "adapter_model.safetensors")


def _check_slot(store, slot, adapter):
    for path in SHAPES:
        module = adapter.modules.get(path)
        a, b = store.a[path][slot], store.b[path][slot]
        if module is None:
            assert not a.any() and not b.any() and store.scales[path][slot] == 0
            continue
        r = module.rank
        assert torch.equal(a[:r], module.a) and not a[r:].any()
        assert torch.equal(b[:, :r], module.b) and not b[:, r:].any()
        assert store.scales[path][slot] == module.scale
    assert store.ranks[slot] == adapter.rank


def _equal_to_direct_load(root, adapter):
    direct = load_adapter(adapter.name, root / adapter.name, SHAPES, 4)
    assert direct.fingerprint == adapter.fingerprint
    assert set(direct.modules) == set(adapter.modules)
    for path, module in direct.modules.items():
        assert torch.equal(module.a, adapter.modules[path].a) and torch.equal(module.b, adapter.modules[path].b)
        assert module.scale == adapter.modules[path].scale


def test_many_threads_never_corrupt_the_cache(tmp_path):
    for i, name in enumerate(NAMES):
        _write(tmp_path, name, seed=i, rank=1 + i % 4)
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2}))
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{bad json")
    store = AdapterStore(
        tmp_path,
        SHAPES,
        max_rank=4,
        gpu_slots=GPU_SLOTS,
        host_slots=HOST_SLOTS,
        device=torch.device("cpu"),
        dtype=torch.float32,
        load_workers=3,
    )
    pool = NAMES + ["corrupt", "missing"]
    stop = threading.Event()
    failures: list[str] = []
    counts = {"batches": 0, "refused": 0}

    def guard(body):
        def run(seed):
            rng = random.Random(seed)
            try:
                while not stop.is_set():
                    body(rng)
                    time.sleep(0.0005)  # let the others in: the GIL would otherwise serialise whole loops
            except Exception as exc:  # reported below: an assertion in a thread must fail the test
                failures.append(f"{type(exc).__name__}: {exc}")
                stop.set()

        return run

    @guard
    def engine(rng):
        names = rng.sample(pool, rng.randint(1, 6))
        adapters = []
        for name in names:
            try:
                adapters.append(store.get(name))
            except AdapterError as exc:
                # a23 may be caught mid-deploy (new config, old weights): refused, never cached
                assert name in ("corrupt", "missing", "a23"), exc.message
                counts["refused"] += 1
        by_name = {a.name: a for a in adapters}
        distinct = sorted(by_name)
        for i in range(0, len(distinct), GPU_SLOTS):  # waves, as the engine plans them
            wave = [by_name[n] for n in distinct[i : i + GPU_SLOTS]]
            slots = store.acquire(wave)
            assert sorted(slots) == sorted(a.name for a in wave) and len(set(slots.values())) == len(wave)
            for adapter in wave:
                assert store.owner(slots[adapter.name]) is adapter
                _check_slot(store, slots[adapter.name], adapter)
            time.sleep(0.001)  # the "forward": others preload and evict meanwhile
            for adapter in wave:  # the batch in flight still reads its own weights
                assert store.owner(slots[adapter.name]) is adapter
                _check_slot(store, slots[adapter.name], adapter)
        counts["batches"] += 1
        if counts["batches"] == BATCHES:
            stop.set()

    @guard
    def prefetcher(rng):
        for future in store.prefetch(rng.sample(pool, 4)).values():
            try:
                future.result(10)
            except (AdapterError, Exception):
                pass

    @guard
    def requester(rng):
        try:
            assert store.get(rng.choice(pool)).name in NAMES
        except AdapterError:
            pass

    @guard
    def operator(rng):
        if rng.random() < 0.5:
            store.evict(rng.sample(pool, 2))
        else:
            report = store.preload_report(rng.sample(pool, 3))
            assert "corrupt" not in report["loaded"] and "missing" not in report["loaded"]
        time.sleep(0.002)

    @guard
    def deployer(rng):  # hot reload: a23 gets new weights, new rank, now and then
        time.sleep(0.05)
        _write(tmp_path, "a23", seed=rng.randint(100, 10_000), rank=rng.randint(1, 4))

    roles = [engine, prefetcher, prefetcher, requester, requester, operator, deployer]
    threads = [threading.Thread(target=role, args=(i,)) for i, role in enumerate(roles)]
    for thread in threads:
        thread.start()
    stop.wait(60)
    stop.set()
    for thread in threads:
        thread.join(30)
    store.close()
    assert not failures, failures[:5]
    assert counts["batches"] == BATCHES and counts["refused"] > 0

    resident = store.resident()
    assert len(resident["host"]) <= HOST_SLOTS and len(resident["gpu"]) <= GPU_SLOTS
    assert "corrupt" not in resident["host"] and store.loading() == []
    for name in resident["host"]:
        _equal_to_direct_load(tmp_path, store.get(name))
    with store._lock:
        mapped = dict(store._gpu)
    assert len(set(mapped.values())) == len(mapped)
    for name, slot in mapped.items():
        owner = store.owner(slot)
        assert owner.name == name
        _check_slot(store, slot, owner)
    stats = store.stats()
    assert stats["events"]["host"]["miss"] > 0 and stats["events"]["gpu"]["evict"] > 0
    # the hot-reloaded adapter answers with its latest weights
    _equal_to_direct_load(tmp_path, store.get("a23"))
