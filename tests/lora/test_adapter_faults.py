"""Adapter folders under fault: nothing but AdapterError escapes, files are never memory-mapped,
and every kind of replacement changes the fingerprint the store compares."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save, save_file

from manylora.lora import adapter as adapter_module
from manylora.lora.adapter import (
    AdapterError,
    load_adapter,
    max_weights_bytes,
    resolve_adapter_dir,
    weights_fingerprint,
)

Q = "encoder.encoder.layer.0.attention.self.query_proj"
SHAPES = {Q: (8, 8), "classifier.0": (8, 16)}
KEY_A, KEY_B = f"base_model.model.{Q}.lora_A.weight", f"base_model.model.{Q}.lora_B.weight"


def _write(folder, config=None, tensors=None):
    folder.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, **(config or {})}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    tensors = {KEY_A: torch.randn(2, 8), KEY_B: torch.randn(8, 2)} if tensors is None else tensors
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def test_weights_are_read_not_mapped_so_an_in_place_overwrite_cannot_kill_the_process(tmp_path):
    """safetensors' load_file maps the file: truncating it afterwards (cp over it) is SIGBUS."""
    folder = _write(tmp_path / "x", tensors={KEY_A: torch.randn(2, 8), KEY_B: torch.randn(8, 2)})
    code = (
        "import sys, torch; from manylora.lora.adapter import load_adapter;"
        f"a = load_adapter('x', __import__('pathlib').Path({str(folder)!r}), {SHAPES!r}, 4);"
        f"open({str(folder / 'adapter_model.safetensors')!r}, 'wb').close();"
        "print(sum(float(m.a.sum() + m.b.sum()) for m in a.modules.values()))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])


def test_every_replacement_changes_the_fingerprint(tmp_path):
    folder = _write(tmp_path / "x")
    weights = folder / "adapter_model.safetensors"
    seen = {weights_fingerprint(folder)}
    stat = weights.stat()
    replacement = tmp_path / "new.safetensors"
    save_file({KEY_A: torch.randn(2, 8), KEY_B: torch.randn(8, 2)}, str(replacement))
    os.utime(replacement, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same size, same mtime (cp -p)
    os.replace(replacement, weights)  # atomic rename: a new inode
    assert weights_fingerprint(folder) not in seen
    seen.add(weights_fingerprint(folder))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 8}))
    assert weights_fingerprint(folder) not in seen, "a changed config (alpha) is a changed adapter"
    adapter = load_adapter("x", folder, SHAPES, 4)
    assert adapter.fingerprint == weights_fingerprint(folder)


def test_a_file_changed_while_it_is_read_is_unavailable_not_wrong(tmp_path, monkeypatch):
    folder = _write(tmp_path / "x")
    real_read = adapter_module._read_fd

    def touch_then_read(fd, size):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".safetensors"):  # the weights, checked and about to be read
            with open(folder / "adapter_model.safetensors", "ab") as f:  # a writer appends while we read
                f.write(b"\0")
        return real_read(fd, size)

    monkeypatch.setattr(adapter_module, "_read_fd", touch_then_read)
    with pytest.raises(AdapterError, match="changed while it was read") as info:
        load_adapter("x", folder, SHAPES, 4)
    assert info.value.code == "UNAVAILABLE"


@pytest.mark.parametrize(
    "config,tensors,message",
    [
        ({"r": "2"}, None, "must be an integer"),
        ({"r": 2.0}, None, "must be an integer"),
        ({"lora_alpha": None}, None, "must be an integer / a number"),
        ({"lora_alpha": 10**400}, None, "must be an integer / a number"),  # no float holds it
        ({"alpha_pattern": {"q": 10**400}}, None, "alpha_pattern must map"),
        ({"rank_pattern": ["q"]}, None, "rank_pattern must map module names to numbers"),
        ({"rank_pattern": {"(": 2}}, None, "is not a valid pattern"),
        ({"alpha_pattern": {"q": "x"}}, None, "alpha_pattern must map"),
        ({}, {KEY_A: torch.randn(0, 8), KEY_B: torch.randn(8, 0)}, "has rank 0"),
        ({}, {KEY_A: torch.tensor(1.0), KEY_B: torch.randn(8, 2)}, "do not fit"),
        ({}, {KEY_A: torch.ones(2, 8, dtype=torch.int32), KEY_B: torch.ones(8, 2, dtype=torch.int32)}, "floating"),
        ({}, {KEY_A: torch.full((2, 8), 1e300, dtype=torch.float64), KEY_B: torch.ones(8, 2)}, "infinite"),
    ],
)
def test_malformed_configs_and_tensors_are_refused(tmp_path, config, tensors, message):
    with pytest.raises(AdapterError, match=message) as info:
        load_adapter("x", _write(tmp_path / "x", config, tensors), SHAPES, 4)
    assert info.value.code == "INVALID_ARG"


def test_special_and_oversized_files_are_refused_unread(tmp_path):
    folder = _write(tmp_path / "fifo")
    os.remove(folder / "adapter_model.safetensors")
    os.mkfifo(folder / "adapter_model.safetensors")  # opening it to read would block
    with pytest.raises(AdapterError, match="not a regular file"):
        load_adapter("fifo", folder, SHAPES, 4)
    folder = _write(tmp_path / "huge")
    with open(folder / "adapter_model.safetensors", "r+b") as f:
        f.truncate(max_weights_bytes(SHAPES, 4) + 1)  # sparse
    with pytest.raises(AdapterError, match="above the limit of"):
        load_adapter("huge", folder, SHAPES, 4)
    folder = _write(tmp_path / "big-config")
    (folder / "adapter_config.json").write_text(" " * (adapter_module.MAX_CONFIG_BYTES + 1))
    with pytest.raises(AdapterError, match="adapter_config.json is .* above the limit"):
        load_adapter("big-config", folder, SHAPES, 4)


def test_ids_with_a_final_newline_or_control_characters_are_invalid(tmp_path):
    _write(tmp_path / "good")
    for bad in ("good\n", "good\r", "\tgood", "good\x7f"):
        with pytest.raises(AdapterError, match="invalid adapter id") as info:
            resolve_adapter_dir(tmp_path, bad)
        assert info.value.code == "INVALID_ARG"


json_values = st.recursive(
    st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=6),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=20,
)
config_keys = st.sampled_from(
    [
        "peft_type",
        "r",
        "lora_alpha",
        "rank_pattern",
        "alpha_pattern",
        "use_rslora",
        "use_dora",
        "bias",
        "target_modules",
    ]
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    config=st.dictionaries(config_keys, json_values) | json_values,
    weights=st.one_of(
        st.binary(max_size=300),
        st.builds(
            lambda a, b: save({KEY_A: a, KEY_B: b}),
            st.sampled_from([torch.randn(2, 8), torch.randn(3, 8), torch.ones(2, 8, dtype=torch.float16)]),
            st.sampled_from([torch.randn(8, 2), torch.randn(8, 3), torch.randn(2, 2)]),
        ),
        st.binary(min_size=8, max_size=64).map(lambda tail: (len(tail)).to_bytes(8, "little") + tail),
    ),
)
def test_any_folder_content_raises_only_adapter_error(tmp_path_factory, config, weights):
    folder = tmp_path_factory.mktemp("fuzz")
    (folder / "adapter_config.json").write_text(json.dumps(config))
    (folder / "adapter_model.safetensors").write_bytes(weights)
    try:
        adapter = load_adapter("x", folder, SHAPES, 4)
    except AdapterError as exc:
        assert exc.code in ("INVALID_ARG", "UNAVAILABLE")
    else:
        assert all(
            m.rank <= 4 and m.a.dtype in (torch.float32, torch.float16, torch.bfloat16)
            for m in adapter.modules.values()
        )


@pytest.mark.parametrize(
    "config,b_scale,message",
    [
        ({"lora_alpha": 1e300}, 1.0, "scale beyond float32's range"),  # a finite float64, inf in float32
        ({"lora_alpha": 1e30}, 1e10, "exceeds the torch.float32 range"),  # weights x scale overflow
    ],
)
def test_adapters_whose_scaled_weights_overflow_are_refused_at_load(tmp_path, config, b_scale, message):
    """An inf scale (or B x scale beyond the serving dtype) once turned base rows of the same
    batch into NaN through inf x 0: such adapters are refused when the store loads them."""
    from manylora.lora.store import AdapterStore

    tensors = {KEY_A: torch.randn(2, 8), KEY_B: torch.randn(8, 2) * b_scale}
    _write(tmp_path / "hostile", config, tensors)
    _write(tmp_path / "fine")
    store = AdapterStore(
        tmp_path, SHAPES, max_rank=4, gpu_slots=2, host_slots=2, device=torch.device("cpu"), dtype=torch.float32
    )
    with pytest.raises(AdapterError) as info:
        store.get("hostile")
    assert info.value.code == "INVALID_ARG" and message in info.value.message
    assert store.get("fine").name == "fine"  # the store serves the others
