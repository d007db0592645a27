"""Adapter folders from untrusted tenants (issue 17, items 2-4): files opened without following links
or blocking, bounded regex and header work, error messages that never quote the files and are capped,
and refusals and unknown ids that keep no weights and stay within entry and byte bounds."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from manylora.lora import adapter as adapter_module
from manylora.lora import store as store_module
from manylora.lora.adapter import AdapterError, AdapterLocator, load_adapter
from manylora.lora.store import AdapterStore

Q = "encoder.encoder.layer.0.attention.self.query_proj"
K = "encoder.encoder.layer.1.attention.self.key_proj"
SHAPES = {Q: (8, 8), K: (8, 8), "classifier.0": (8, 16)}
SECRET = "TOPSECRET-4f1c"


def _key(path, ab):
    return f"base_model.model.{path}.lora_{ab}.weight"


def _write(folder, config=None, tensors=None):
    folder.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, **(config or {})}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    tensors = {_key(Q, "A"): torch.randn(2, 8), _key(Q, "B"): torch.randn(8, 2)} if tensors is None else tensors
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def _refusal(call) -> AdapterError:
    with pytest.raises(AdapterError) as info:
        call()
    assert info.value.code == "INVALID_ARG", info.value.message
    return info.value


# ---------------------------------------------------------------- files (item 3)
def test_adapter_files_that_are_symlinks_out_of_the_root_are_refused_unread(tmp_path):
    root = tmp_path / "root"
    outside = _write(tmp_path / "outside", config={"peft_type": SECRET})
    folder = _write(root / "cfg")
    os.remove(folder / "adapter_config.json")
    os.symlink(outside / "adapter_config.json", folder / "adapter_config.json")
    error = _refusal(lambda: load_adapter("cfg", folder, SHAPES, 4, root))
    assert "symbolic link" in error.message and SECRET not in error.message

    good = _write(tmp_path / "elsewhere")  # a servable adapter stored outside the root
    folder = _write(root / "weights")
    os.remove(folder / "adapter_model.safetensors")
    os.symlink(good / "adapter_model.safetensors", folder / "adapter_model.safetensors")
    error = _refusal(lambda: load_adapter("weights", folder, SHAPES, 4, root))
    assert "symbolic link" in error.message
    store = AdapterStore(
        root, SHAPES, max_rank=4, gpu_slots=1, host_slots=2, device=torch.device("cpu"), dtype=torch.float32
    )
    try:
        assert _refusal(lambda: store.get("weights")).message == error.message  # not served through the store
    finally:
        store.close()


def test_a_folder_that_resolves_outside_the_root_is_refused_on_the_opened_directory(tmp_path):
    root = tmp_path / "root"
    _write(tmp_path / "outside" / "x")
    root.mkdir()
    os.symlink(tmp_path / "outside" / "x", root / "x")  # e.g. swapped in after the request's lookup
    error = _refusal(lambda: load_adapter("x", root / "x", SHAPES, 4, root))
    assert "outside the adapter directory" in error.message
    os.symlink(tmp_path / "outside" / "x", root / "inside-link")
    inner = _write(root / "real")
    os.symlink(inner, root / "alias")  # folder symlinks inside the root stay allowed
    assert load_adapter("alias", root / "alias", SHAPES, 4, root).modules


def test_a_file_swapped_to_a_fifo_after_its_check_is_refused_without_blocking(tmp_path, monkeypatch):
    """The check saw a regular file; the open finds a FIFO (swapped in between): refused at once
    from the opened descriptor, never a read that waits for a writer."""
    folder = _write(tmp_path / "x")
    weights = folder / "adapter_model.safetensors"
    regular = tmp_path / "regular.safetensors"
    os.replace(weights, regular)
    os.mkfifo(weights)
    real_stat = Path.stat

    def stale_stat(self, *args, **kwargs):  # what a check made before the swap saw
        return real_stat(regular if self.name == weights.name else self, *args, **kwargs)

    monkeypatch.setattr(Path, "stat", stale_stat)
    outcome = []

    def load():
        try:
            load_adapter("x", folder, SHAPES, 4)
        except AdapterError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=load, daemon=True)
    started = time.perf_counter()
    thread.start()
    thread.join(5)
    if thread.is_alive():  # release the blocked reader before failing
        os.close(os.open(weights, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(5)
        pytest.fail("the load blocked on a FIFO")
    assert time.perf_counter() - started < 1
    assert outcome and "not a regular file" in outcome[0].message


def test_error_messages_never_quote_the_files_and_are_capped(tmp_path):
    cases = {
        "utf8": b'{"peft_type": "' + SECRET.encode() + b'\xff"}',
        "json": ('{"peft_type": "' + SECRET + '" oops').encode(),
        "type": json.dumps({"peft_type": SECRET}).encode(),
        "r": json.dumps({"r": SECRET}).encode(),
        "saved": json.dumps({"modules_to_save": [SECRET]}).encode(),
        "long-key": json.dumps({"rank_pattern": {"(" + "x" * 60_000: 2}}).encode(),
    }
    for name, config in cases.items():
        folder = _write(tmp_path / name)
        (folder / "adapter_config.json").write_bytes(config)
        error = _refusal(lambda: load_adapter(name, folder, SHAPES, 4))
        assert SECRET not in error.message and len(error.message) <= 1000, (name, error.message[:300])
    tensors = {_key(Q, "A"): torch.randn(2, 8), _key(Q, "B"): torch.randn(8, 2), SECRET * 100: torch.zeros(1)}
    error = _refusal(lambda: load_adapter("t", _write(tmp_path / "t", tensors=tensors), SHAPES, 4))
    assert "unexpected tensor" in error.message and SECRET not in error.message
    assert len(AdapterError("INVALID_ARG", "x" * 60_000).message) <= 1000


# ---------------------------------------------------------------- bounded work (item 2)
CATASTROPHIC = """
import json, pathlib, sys, time, torch
from safetensors.torch import save_file
from manylora.lora.adapter import AdapterError, load_adapter
path = "a" * 40 + "b"  # a long module name of a's plus 'b'
shapes = {path: (8, 8)}
results = []
for n, config in enumerate(json.loads(sys.argv[1])):
    folder = pathlib.Path(sys.argv[2]) / str(n)
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4, **config}))
    save_file({f"base_model.model.{path}.lora_A.weight": torch.randn(2, 8),
               f"base_model.model.{path}.lora_B.weight": torch.randn(8, 2)}, str(folder / "adapter_model.safetensors"))
    started = time.perf_counter()
    try:
        load_adapter("x", folder, shapes, 4)
        message = None
    except AdapterError as exc:
        message = exc.message
    results.append((time.perf_counter() - started, message))
print(json.dumps(results))
"""
CATASTROPHIC_CONFIGS = [
    {"rank_pattern": {"(a+)+$": 2}},
    {"alpha_pattern": {"(a|a)*$": 8}},
    {"target_modules": "(a+)+"},
    {"exclude_modules": "(a|aa)+"},
    {"target_modules": "(a|a)*$"},
    {"target_modules": ["b"], "layers_to_transform": [0], "layers_pattern": "(a+)+c"},
]


def test_catastrophic_config_patterns_are_refused_in_milliseconds(tmp_path):
    """Each of these makes ``re`` (and so PEFT) backtrack for hours on the module name; each load is
    refused within the pattern budget. A subprocess, so that a hang fails the test instead of freezing it."""
    result = subprocess.run(
        [sys.executable, "-c", CATASTROPHIC, json.dumps(CATASTROPHIC_CONFIGS), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    for config, (seconds, message) in zip(CATASTROPHIC_CONFIGS, json.loads(result.stdout.splitlines()[-1])):
        assert message is not None and "catastrophic" in message, (config, message)
        assert seconds < 0.5, (config, seconds)  # the load; the match itself stops after 25 ms


def test_patterns_over_the_limits_are_refused(tmp_path):
    error = _refusal(lambda: load_adapter("x", _write(tmp_path / "x", {"target_modules": "q" * 5000}), SHAPES, 4))
    assert "above the limit of 1000" in error.message
    many = {f"k{n}": 2 for n in range(2000)}
    error = _refusal(lambda: load_adapter("y", _write(tmp_path / "y", {"rank_pattern": many}), SHAPES, 4))
    assert "more than 1024 patterns" in error.message


def _safetensors(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data


def test_a_header_declaring_160000_dimensions_is_refused_in_milliseconds(tmp_path):
    folder = _write(tmp_path / "dims")
    header = {
        _key(Q, "A"): {"dtype": "F32", "shape": [2] * 160_000, "data_offsets": [0, 64]},
        _key(Q, "B"): {"dtype": "F32", "shape": [8, 2], "data_offsets": [64, 128]},
    }
    blob = _safetensors(header, bytes(128))
    assert len(blob) < adapter_module.MAX_HEADER_BYTES
    (folder / "adapter_model.safetensors").write_bytes(blob)
    started = time.perf_counter()
    error = _refusal(lambda: load_adapter("dims", folder, SHAPES, 4))
    elapsed = time.perf_counter() - started
    assert "160000 dimensions, more than 8" in error.message and len(error.message) <= 1000
    assert elapsed < 0.2, elapsed


def test_header_size_and_element_limits_come_before_any_allocation(tmp_path, monkeypatch):
    reads = []
    real = adapter_module._read_fd
    monkeypatch.setattr(adapter_module, "_read_fd", lambda fd, size: reads.append(size) or real(fd, size))
    folder = _write(tmp_path / "big-header")
    with open(folder / "adapter_model.safetensors", "r+b") as f:
        f.write((adapter_module.MAX_HEADER_BYTES + 1).to_bytes(8, "little"))  # in a file under the size limit
        f.truncate(adapter_module.MAX_HEADER_BYTES + 64)
    reads.clear()
    error = _refusal(lambda: load_adapter("big-header", folder, {Q: (4096, 4096)}, 64))
    assert "above the limit of" in error.message
    assert max(reads) < 1000, "the weights file was read before its header size was checked"  # the config only
    # a tensor larger than any adapter file of the model can hold: refused from the header, never allocated
    folder = _write(tmp_path / "elements")
    header = {_key(Q, "A"): {"dtype": "F32", "shape": [1 << 20, 1 << 20], "data_offsets": [0, 4 << 40]}}
    (folder / "adapter_model.safetensors").write_bytes(_safetensors(header, b""))
    error = _refusal(lambda: load_adapter("elements", folder, SHAPES, 4))
    limit = adapter_module.max_weights_bytes(SHAPES, 4) // 2
    assert f"more than {limit} elements" in error.message


# ---------------------------------------------------------------- PEFT's selection, bounded
def _peft_selects(config: dict, key: str) -> bool:
    from peft.tuners.tuners_utils import check_target_module_exists

    fields = ("target_modules", "exclude_modules", "layers_to_transform", "layers_pattern")
    cfg = SimpleNamespace(**{f: config.get(f) for f in fields}, modules_to_save=None, target_parameters=None)
    return bool(check_target_module_exists(cfg, key))


SELECTIONS = [
    {"target_modules": ["query_proj"]},
    {"target_modules": ["self.key_proj", "classifier.0"]},
    {"target_modules": r".*layer\.1\..*_proj"},
    {"target_modules": ["query_proj", "key_proj"], "layers_to_transform": [1]},
    {"target_modules": ["query_proj", "key_proj"], "layers_to_transform": 0, "layers_pattern": "layer"},
    {"target_modules": ["query_proj", "key_proj"], "layers_to_transform": [0, 1], "layers_pattern": ["nope"]},
    {"target_modules": ["query_proj", "key_proj", "0"], "exclude_modules": ["key_proj"]},
    {"target_modules": ["query_proj", "key_proj"], "exclude_modules": r".*layer\.0\..*"},
]


@pytest.mark.parametrize("config", SELECTIONS)
def test_target_selection_is_peft_s(tmp_path, config):
    tensors = {_key(p, ab): torch.randn(*((2, 8) if ab == "A" else (SHAPES[p][1], 2))) for p in SHAPES for ab in "AB"}
    expected = {p for p in SHAPES if _peft_selects(config, p)}
    if not expected:
        _refusal(lambda: load_adapter("x", _write(tmp_path / "x", config, tensors), SHAPES, 4))
        return
    adapter = load_adapter("x", _write(tmp_path / "x", config, tensors), SHAPES, 4)
    assert set(adapter.modules) == expected
    assert set(adapter.ignored) == set(SHAPES) - expected


def test_pattern_keys_match_as_peft_s_get_pattern_key(tmp_path):
    from peft.utils.other import get_pattern_key

    rank_pattern = {"nothing": 5, r"layer\.1\..*": 3, "query_proj": 2}
    tensors = {
        _key(Q, "A"): torch.randn(2, 8),
        _key(Q, "B"): torch.randn(8, 2),
        _key(K, "A"): torch.randn(3, 8),
        _key(K, "B"): torch.randn(8, 3),
    }
    adapter = load_adapter("x", _write(tmp_path / "x", {"rank_pattern": rank_pattern}, tensors), SHAPES, 4)
    for path, module in adapter.modules.items():
        assert module.rank == rank_pattern.get(get_pattern_key(rank_pattern.keys(), path), 2)


# ---------------------------------------------------------------- bounded memory (item 4)
def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_refused_adapters_keep_no_weights(tmp_path):
    """Refused after its 32 MiB weights file was read (config rank 8, weights rank 1024): the store
    remembers the refusal, not the bytes (before: the refusal's traceback held them)."""
    root, shapes = tmp_path / "root", {"lin": (4096, 4096)}
    source = _write(
        root / "bad0",
        config={"r": 8},
        tensors={_key("lin", "A"): torch.randn(1024, 4096), _key("lin", "B"): torch.randn(4096, 1024)},
    )
    for n in range(1, 6):  # distinct folders, one file on disk
        (root / f"bad{n}").mkdir()
        os.link(source / "adapter_config.json", root / f"bad{n}" / "adapter_config.json")
        os.link(source / "adapter_model.safetensors", root / f"bad{n}" / "adapter_model.safetensors")
    store = AdapterStore(
        root, shapes, max_rank=1024, gpu_slots=1, host_slots=1, device=torch.device("cpu"), dtype=torch.float32
    )
    try:
        gc.collect()
        before = _rss()
        for n in range(6):
            assert "does not match" in _refusal(lambda: store.get(f"bad{n}")).message
        gc.collect()
        grown = _rss() - before
        assert len(store._refused) == 6
        assert all(isinstance(x, (str, tuple, Path)) for entry in store._refused.values() for x in entry)
        assert grown < 48 << 20, f"{grown / 2**20:.0f} MiB kept for 6 refusals of a 32 MiB file"
    finally:
        store.close()


def test_thousands_of_bad_and_unknown_ids_keep_the_caches_bounded(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    bad = 5000
    for n in range(bad):
        folder = root / f"bad-{n:05d}-{'x' * 100}"
        folder.mkdir()
        (folder / "adapter_config.json").write_text("{not json")
        (folder / "adapter_model.safetensors").write_bytes(b"\0")
    store = AdapterStore(
        root, SHAPES, max_rank=4, gpu_slots=1, host_slots=1, device=torch.device("cpu"), dtype=torch.float32
    )
    try:
        for n in range(bad):
            assert "not valid JSON" in _refusal(lambda: store.get(f"bad-{n:05d}-{'x' * 100}")).message
        for n in range(10_000):
            with pytest.raises(AdapterError) as info:
                store.get(f"unknown-{n}-{'y' * 100}")
            assert info.value.code == "NOT_FOUND"
        locator = store._locator
        assert len(store._refused) <= store_module.REFUSALS_KEPT
        assert store._refused_bytes <= store_module.REFUSALS_BYTES
        assert store._refused_bytes == sum(store._refusal_size(k, v) for k, v in store._refused.items())
        assert len(locator._paths) <= AdapterLocator.MAX_IDS and locator.cached_bytes <= AdapterLocator.MAX_BYTES
        assert not any(k.startswith("unknown") for k in locator._paths), "unknown ids are not cached"
        # the most recent refusals are the ones kept, and still answered without a read
        last = f"bad-{bad - 1:05d}-{'x' * 100}"
        assert last in store._refused and store.get.__self__ is store
    finally:
        store.close()
