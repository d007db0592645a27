"""The adapter store: LRU tiers, slots of the batch in flight never evicted, waves, hot reload, removal."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import torch
from safetensors.torch import save_file

from manylora.lora.adapter import AdapterError
from manylora.lora.store import AdapterStore, plan_waves

SHAPES = {"lin": (6, 5)}


def _adapter(root, name, value=1.0, rank=2):
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": rank}))
    save_file(
        {
            "base_model.model.lin.lora_A.weight": torch.full((rank, 6), value),
            "base_model.model.lin.lora_B.weight": torch.full((5, rank), value),
        },
        str(folder / "adapter_model.safetensors"),
    )
    return folder


def _store(root, gpu_slots: int, host_slots: int, **options) -> AdapterStore:
    """A store over SHAPES at rank 4, on the CPU in float32 unless ``options`` say otherwise."""
    options = {"max_rank": 4, "device": torch.device("cpu"), "dtype": torch.float32, **options}
    return AdapterStore(root, SHAPES, gpu_slots=gpu_slots, host_slots=host_slots, **options)


@pytest.fixture
def store(tmp_path):
    for i in range(6):
        _adapter(tmp_path, f"a{i}", value=float(i + 1))
    return _store(tmp_path, 2, 3)


def test_slots_hold_the_adapter_weights_zero_padded_to_max_rank(store):
    slots = store.acquire([store.get("a2")])
    slot = slots["a2"]
    assert torch.all(store.a["lin"][slot, :2] == 3.0) and torch.all(store.a["lin"][slot, 2:] == 0)
    assert torch.all(store.b["lin"][slot, :, :2] == 3.0) and torch.all(store.b["lin"][slot, :, 2:] == 0)
    assert store.scales["lin"][slot] == 1.0 and store.ranks[slot] == 2


def test_gpu_lru_keeps_requested_and_evicts_least_recent(store):
    first = store.acquire([store.get("a0"), store.get("a1")])
    store.acquire([store.get("a0")])  # a0 is now the most recent
    second = store.acquire([store.get("a2")])
    assert second["a2"] == first["a1"], "the least recently used slot (a1) is reused"
    assert set(store.resident()["gpu"]) == {"a0", "a2"}
    # the adapters of one wave are never evicted by that wave
    both = store.acquire([store.get("a3"), store.get("a2")])
    assert both["a2"] == second["a2"] and set(store.resident()["gpu"]) == {"a2", "a3"}


def test_host_lru_is_bounded(store):
    for i in range(5):
        store.get(f"a{i}")
    assert store.resident()["host"] == ["a2", "a3", "a4"]
    assert store.loads["disk"] == 5
    store.get("a4")
    assert store.loads["disk"] == 5, "a hit reads nothing from disk"


def test_prefetch_keeps_the_batch_s_resident_adapters_over_its_own_loads(store):
    """A batch's start-up loads evict host adapters, but not the resident ones the same batch
    is about to use: prefetch marks those most recent before any load begins."""
    for name in ("a0", "a1", "a2"):
        store.get(name)
    assert list(store.prefetch(["a0", "a3", "", None])) == ["a3"], "a future only for what is not in memory"
    store.get("a3")  # waits for (or does) the load started above
    assert store.resident()["host"] == ["a2", "a0", "a3"], "a1 is the least recent: it goes"
    loads = store.loads["disk"]
    store.get("a0")
    assert store.loads["disk"] == loads == 4, "a0 stayed in host memory"


def test_a_wave_larger_than_the_slots_is_a_bug_not_an_eviction(store):
    with pytest.raises(AssertionError, match="plan waves"):
        store.acquire([store.get("a0"), store.get("a1"), store.get("a2")])


def test_plan_waves():
    assert plan_waves(["a", "b", "", None, "a", "c"], 2) == [{"a", "b"}, {"c"}]
    assert plan_waves(["", ""], 2) == [set()]


def test_changed_adapter_is_reloaded_and_removed_one_is_not_found(store, tmp_path):
    store.acquire([store.get("a0")])
    time.sleep(0.01)
    _adapter(tmp_path, "a0", value=9.0, rank=3)
    os.utime(tmp_path / "a0" / "adapter_model.safetensors")
    reloaded = store.get("a0")
    assert reloaded.rank == 3 and store.loads["disk"] == 2
    slot = store.acquire([reloaded])["a0"]
    assert torch.all(store.a["lin"][slot, :3] == 9.0) and store.ranks[slot] == 3
    shutil.rmtree(tmp_path / "a0")
    with pytest.raises(AdapterError) as info:
        store.get("a0")
    assert info.value.code == "NOT_FOUND"


def test_new_adapter_is_servable_on_first_request(store, tmp_path):
    with pytest.raises(AdapterError):
        store.get("late")
    _adapter(tmp_path, "late")
    assert store.get("late").name == "late"


def test_refused_adapter_does_not_poison_the_store(store, tmp_path):
    bad = _adapter(tmp_path, "bad")
    (bad / "adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(AdapterError):
        store.get("bad")
    assert "bad" not in store.resident()["host"]
    slots = store.acquire([store.get("a1")])
    assert torch.all(store.a["lin"][slots["a1"], :2] == 2.0)


def test_preload_fills_host_then_gpu_and_skips_refused(store, tmp_path):
    bad = _adapter(tmp_path, "a00-bad")
    (bad / "adapter_model.safetensors").write_bytes(b"garbage")
    loaded = store.preload()
    assert loaded == ["a0", "a1", "a2"], "host tier holds 3; the refused one is skipped"
    assert set(store.resident()["gpu"]) == {"a0", "a1"}
    assert store.preload(["a5"]) == ["a5"] and "a5" in store.resident()["gpu"]


def test_slot_memory_is_what_the_tensors_take(store):
    from manylora.lora.store import slot_bytes

    assert store.gpu_bytes == slot_bytes(SHAPES, 4, torch.float32) * 2 == 2 * 4 * (6 + 5) * 4


# ---------------------------------------------------------------- host tier in the serving dtype


def _random_adapter(root, name, seed, rank=3):
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank}))
    generator = torch.Generator().manual_seed(seed)
    save_file(
        {
            "base_model.model.lin.lora_A.weight": torch.randn(rank, 6, generator=generator),
            "base_model.model.lin.lora_B.weight": torch.randn(5, rank, generator=generator),
        },
        str(folder / "adapter_model.safetensors"),
    )
    return folder


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_host_tier_in_serving_dtype_fills_slots_exactly_as_before(tmp_path, dtype):
    """A 16-bit host copy takes half the memory, and the slot holds what a float32 host copy
    copied into the 16-bit slot held (the path before the host tier was converted)."""
    from manylora.lora.adapter import load_adapter
    from manylora.lora.store import adapter_bytes

    _random_adapter(tmp_path, "r", seed=1)
    kwargs = dict(max_rank=4, gpu_slots=1, host_slots=1, device=torch.device("cpu"))
    half = AdapterStore(tmp_path, SHAPES, dtype=dtype, **kwargs)
    full = AdapterStore(tmp_path, SHAPES, dtype=torch.float32, **kwargs)
    adapter = half.get("r")
    assert adapter.modules["lin"].a.dtype == dtype and adapter.modules["lin"].b.dtype == dtype
    assert adapter_bytes(adapter) * 2 == adapter_bytes(full.get("r")) == half.host_bytes * 2
    slot = half.acquire([adapter])["r"]
    reference = load_adapter("r", tmp_path / "r", SHAPES, 4).modules["lin"]  # float32
    before_a = torch.zeros(4, 6, dtype=dtype)
    before_a[:3].copy_(reference.a)
    before_b = torch.zeros(5, 4, dtype=dtype)
    before_b[:, :3].copy_(reference.b)
    assert torch.equal(half.a["lin"][slot], before_a) and torch.equal(half.b["lin"][slot], before_b)
    assert half.scales["lin"][slot] == reference.scale == 2.0
    assert half.stats()["dtype"] == str(dtype).removeprefix("torch.")


def test_weights_beyond_the_16_bit_range_are_refused(tmp_path):
    _adapter(tmp_path, "huge", value=1e6)
    store = _store(tmp_path, 1, 1, dtype=torch.float16)
    with pytest.raises(AdapterError, match="beyond the torch.float16 range") as info:
        store.get("huge")
    assert info.value.code == "INVALID_ARG" and store.resident()["host"] == []


def test_host_slots_below_gpu_slots_is_refused_with_the_memory_it_needs(tmp_path):
    with pytest.raises(ValueError, match=r"max_cpu_adapters \(2\) must be >= max_gpu_adapters \(3\).*GiB"):
        _store(tmp_path, 3, 2)


# ---------------------------------------------------------------- pinning, preload and evict


def test_preload_never_takes_the_slots_of_the_batch_in_flight(store):
    in_flight = store.acquire([store.get("a0"), store.get("a1")])  # both GPU slots
    report = store.preload_report(["a2"])
    assert report["loaded"] == ["a2"] and report["gpu"] == [], "no free slot: a2 stays in host memory"
    assert store.acquire([store.get("a0"), store.get("a1")]) == in_flight and store.loads["gpu"] == 2
    store.acquire([store.get("a0")])  # the next batch only pins a0
    assert store.preload_report(["a2"])["gpu"] == ["a2"]
    assert set(store.resident()["gpu"]) == {"a0", "a2"}


def test_evict_forgets_both_tiers_but_the_batch_in_flight_keeps_its_weights(store):
    slots = store.acquire([store.get("a0"), store.get("a1")])
    assert store.evict(["a0", "a5", "a0"]) == ["a0"]
    assert "a0" not in store.resident()["gpu"] and "a0" not in store.resident()["host"]
    assert store.owner(slots["a0"]).name == "a0", "the slot still holds a0 for the batch in flight"
    assert store.preload_report(["a2"])["gpu"] == [], "a0's slot is pinned until the next acquire"
    assert torch.all(store.a["lin"][slots["a0"], :2] == 1.0)
    store.acquire([store.get("a1")])
    assert store.preload_report(["a3"])["gpu"] == ["a3"], "now a0's old slot is free"
    disk = store.loads["disk"]
    store.get("a0")
    assert store.loads["disk"] == disk + 1, "an evicted adapter is read from disk again"


def test_host_eviction_spares_adapters_in_gpu_slots(store):
    store.acquire([store.get("a0")])
    for name in ("a1", "a2", "a3"):
        store.get(name)
    assert store.resident()["host"] == ["a0", "a2", "a3"], "a0 is in a GPU slot: a1 goes first"


def test_stats_and_clear(store):
    store.acquire([store.get("a0"), store.get("a1")])
    store.get("a0")
    stats = store.stats()
    assert stats["resident"] == {"gpu": 2, "host": 2} and stats["slots"] == {"gpu": 2, "host": 3}
    assert stats["events"]["host"] == {"hit": 1, "miss": 2, "evict": 0}
    assert stats["events"]["gpu"]["miss"] == 2 and stats["loads"] == {"disk": 2, "gpu": 2}
    # host copies are packed in slot layout (max rank), so one copy fills a GPU slot
    assert stats["bytes"]["host"] == 2 * store.slot_numel * 4 and not stats["pinned_host_memory"]
    json.dumps(stats)
    store.clear()
    assert store.resident() == {"gpu": [], "host": []} and store.host_bytes == 0


# ---------------------------------------------------------------- background loading


@pytest.fixture
def gated(monkeypatch):
    """Loads of the adapters named in ``gates`` block until their event is set."""
    import threading

    from manylora.lora import store as store_module

    gates: dict[str, threading.Event] = {}
    started: list[str] = []
    real = store_module.load_adapter

    def load(name, *args):
        started.append(name)
        if name in gates:
            assert gates[name].wait(10), f"gate of {name} never opened"
        return real(name, *args)

    monkeypatch.setattr(store_module, "load_adapter", load)
    return gates, started


def test_prefetch_returns_at_once_and_get_waits_only_for_its_own_adapter(store, gated):
    import threading

    gates, started = gated
    gates["a0"] = threading.Event()
    futures = store.prefetch(["a0", "a0", "", None])
    assert list(futures) == ["a0"] and not futures["a0"].done()
    assert store.get("a1").name == "a1", "another adapter does not wait for a0's load"
    assert store.loading() == ["a0"]
    waiter = threading.Thread(target=store.get, args=("a0",))
    waiter.start()
    time.sleep(0.1)
    assert waiter.is_alive(), "get(a0) waits for the load in flight"
    gates["a0"].set()
    waiter.join(5)
    assert futures["a0"].result().name == "a0" and store.get("a0") is futures["a0"].result()
    assert started.count("a0") == 1 and store.loads["disk"] == 2, "the waiting get joined the prefetch"
    assert store.loading() == []


def test_get_loads_a_queued_prefetch_itself_instead_of_queueing_behind_others(tmp_path, gated):
    import threading

    gates, started = gated
    for i in range(3):
        _adapter(tmp_path, f"a{i}", value=float(i + 1))
    store = _store(tmp_path, 1, 3, load_workers=1)
    gates["a0"] = threading.Event()
    futures = store.prefetch(["a0", "a1"])  # the only loader thread blocks on a0; a1 waits in the queue
    assert store.get("a1") is futures["a1"].result(), "the request loaded a1 itself"
    assert not futures["a0"].done()
    gates["a0"].set()
    assert futures["a0"].result().name == "a0"
    store.close()
    assert started.count("a1") == 1


def test_evicting_a_queued_load_cancels_it_and_get_still_serves(tmp_path, gated):
    import threading

    gates, _ = gated
    for i in range(2):
        _adapter(tmp_path, f"a{i}")
    store = _store(tmp_path, 1, 2, load_workers=1)
    gates["a0"] = threading.Event()
    futures = store.prefetch(["a0", "a1"])
    assert store.evict(["a1"]) == ["a1"] and futures["a1"].cancelled()
    gates["a0"].set()
    futures["a0"].result()
    assert store.resident()["host"] == ["a0"], "the cancelled load never ran"
    assert store.get("a1").name == "a1"


def test_a_refused_prefetch_reports_its_error_and_is_not_cached(store, tmp_path):
    bad = _adapter(tmp_path, "bad")
    (bad / "adapter_model.safetensors").write_bytes(b"garbage")
    futures = store.prefetch(["bad", "missing", "../x"])
    codes = {name: future.exception(5).code for name, future in futures.items()}
    assert codes == {"bad": "INVALID_ARG", "missing": "NOT_FOUND", "../x": "INVALID_ARG"}
    assert store.resident()["host"] == [] and store.loading() == []
    report = store.preload_report(["bad", "a1"])
    assert report["loaded"] == ["a1"] and "cannot be served" in report["refused"]["bad"]


def test_preload_beyond_the_host_tier_reports_what_it_skipped(store):
    report = store.preload_report([f"a{i}" for i in range(5)])
    assert report["loaded"] == ["a0", "a1", "a2"] and report["skipped"] == ["a3", "a4"]
    assert report["gpu"] == ["a0", "a1"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_host_tier_is_pinned_and_copies_run_on_a_side_stream(tmp_path):
    for i in range(3):
        _random_adapter(tmp_path, f"r{i}", seed=i)
    store = _store(tmp_path, 2, 3, device=torch.device("cuda"), dtype=torch.bfloat16)
    adapters = [store.get(f"r{i}") for i in range(3)]
    assert all(m.a.is_pinned() and m.b.is_pinned() for a in adapters for m in a.modules.values())
    assert store.stats()["pinned_host_memory"]
    slots = store.acquire(adapters[:2])
    assert store.preload_report(["r2"])["gpu"] == [], "both slots belong to the batch in flight"
    torch.cuda.current_stream().synchronize()
    for adapter in adapters[:2]:
        module = adapter.modules["lin"]
        assert torch.equal(store.a["lin"][slots[adapter.name], :3].cpu(), module.a)
        assert torch.equal(store.b["lin"][slots[adapter.name], :, :3].cpu(), module.b)
    slot = store.acquire([adapters[2]])["r2"]  # overwrites a slot the previous batch read
    assert torch.equal(store.a["lin"][slot, :3].cpu(), adapters[2].modules["lin"].a)
    torch.cuda.synchronize()
    assert len(store.drain_load_seconds()["host_to_gpu"]) == 3


def test_a_refused_folder_is_not_read_again_until_it_changes(store, tmp_path, monkeypatch):
    import manylora.lora.store as store_module

    bad = _adapter(tmp_path, "bad")
    (bad / "adapter_model.safetensors").write_bytes(b"garbage")
    reads = []
    load = store_module.load_adapter
    monkeypatch.setattr(store_module, "load_adapter", lambda *a, **k: reads.append(a[0]) or load(*a, **k))
    messages = set()
    for _ in range(3):
        with pytest.raises(AdapterError) as info:
            store.get("bad")
        assert info.value.code == "INVALID_ARG"
        messages.add(info.value.message)
    assert store.prefetch(["bad"])["bad"].exception(5).code == "INVALID_ARG"
    assert reads == ["bad"] and len(messages) == 1, "refused once, answered from memory after"
    time.sleep(0.01)
    _adapter(tmp_path, "bad", value=4.0)  # fixed: new content, new fingerprint
    assert store.get("bad").name == "bad" and reads == ["bad", "bad"]
    slot = store.acquire([store.get("bad")])["bad"]
    assert torch.all(store.a["lin"][slot, :2] == 4.0)
