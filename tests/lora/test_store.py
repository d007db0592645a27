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


@pytest.fixture
def store(tmp_path):
    for i in range(6):
        _adapter(tmp_path, f"a{i}", value=float(i + 1))
    return AdapterStore(
        tmp_path, SHAPES, max_rank=4, gpu_slots=2, host_slots=3, device=torch.device("cpu"), dtype=torch.float32
    )


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
