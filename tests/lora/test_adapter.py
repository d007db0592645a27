"""Adapter folders: strict reading, exact PEFT scales, refusals with reasons, nothing unpickled."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from manylora.lora.adapter import (
    AdapterError,
    AdapterLocator,
    load_adapter,
    resolve_adapter_dir,
    weights_fingerprint,
)

SHAPES = {"encoder.encoder.layer.0.attention.self.query_proj": (8, 8), "classifier.0": (8, 16)}


def _write(folder, config=None, tensors=None):
    folder.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["query_proj"], **(config or {})}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    if tensors is None:
        tensors = {
            "base_model.model.encoder.encoder.layer.0.attention.self.query_proj.lora_A.weight": torch.randn(2, 8),
            "base_model.model.encoder.encoder.layer.0.attention.self.query_proj.lora_B.weight": torch.randn(8, 2),
        }
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def test_reads_targets_from_keys_and_scales_like_peft(tmp_path):
    adapter = load_adapter("a", _write(tmp_path / "a"), SHAPES, max_rank=4)
    (module,) = adapter.modules.values()
    assert module.scale == 2.0 and adapter.rank == 2
    rs = load_adapter("b", _write(tmp_path / "b", {"use_rslora": True}), SHAPES, max_rank=4)
    assert next(iter(rs.modules.values())).scale == pytest.approx(4 / math.sqrt(2))


def test_peft_written_adapters_load(demo_adapters, tiny_engine):
    for name, folder in demo_adapters.items():
        adapter = load_adapter(name, folder, tiny_engine.store.shapes, max_rank=64)
        tensors = load_file(str(folder / "adapter_model.safetensors"))
        assert len(adapter.modules) * 2 == len(tensors)


@pytest.mark.parametrize(
    "config,message",
    [
        ({"use_dora": True}, "DoRA"),
        ({"modules_to_save": ["classifier"]}, "modules_to_save"),
        ({"bias": "all"}, "biases"),
        ({"peft_type": "IA3"}, "not LORA"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out"),
        ({"r": 3}, "does not match"),
    ],
)
def test_refused_configs_say_why(tmp_path, config, message):
    with pytest.raises(AdapterError, match=message) as info:
        load_adapter("x", _write(tmp_path / "x", config), SHAPES, max_rank=4)
    assert info.value.code == "INVALID_ARG"


def test_rank_above_maximum_is_refused(tmp_path):
    with pytest.raises(AdapterError, match="above max_lora_rank"):
        load_adapter("x", _write(tmp_path / "x"), SHAPES, max_rank=1)


@pytest.mark.parametrize(
    "key,shape,message",
    [
        ("base_model.model.encoder.embeddings.word_embeddings.lora_embedding_A", (2, 8), "embeddings"),
        ("base_model.model.nope.lora_A.weight", (2, 8), "not a linear layer"),
        ("base_model.model.encoder.encoder.layer.0.attention.self.query_proj.lora_A.weight", (2, 5), "do not fit"),
    ],
)
def test_bad_tensors_are_refused(tmp_path, key, shape, message):
    tensors = {
        key: torch.randn(*shape),
        key.replace("lora_A", "lora_B").replace("embedding_A", "embedding_B"): torch.randn(8, 2),
    }
    with pytest.raises(AdapterError, match=message):
        load_adapter("x", _write(tmp_path / "x", tensors=tensors), SHAPES, max_rank=4)


def test_pickle_only_and_corrupt_files_are_refused_without_unpickling(tmp_path):
    folder = _write(tmp_path / "x")
    os.remove(folder / "adapter_model.safetensors")
    (folder / "adapter_model.bin").write_bytes(b"\x80\x04 this would be a pickle")
    with pytest.raises(AdapterError, match="never loaded"):
        load_adapter("x", folder, SHAPES, max_rank=4)
    folder = _write(tmp_path / "y")
    data = (folder / "adapter_model.safetensors").read_bytes()
    (folder / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(AdapterError, match="safetensors"):
        load_adapter("y", folder, SHAPES, max_rank=4)
    (folder / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterError, match="JSON"):
        load_adapter("y", folder, SHAPES, max_rank=4)


def test_adapter_ids_stay_inside_the_root(tmp_path):
    root = tmp_path / "root"
    _write(root / "good")
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", root / "escape")
    assert resolve_adapter_dir(root, "good") == (root / "good").resolve()
    for bad in ("../outside", "/etc", "a/b", "..", ".hidden", "x\x00y", "a\\b", "%2e%2e", "escape", "é", ""):
        with pytest.raises(AdapterError) as info:
            resolve_adapter_dir(root, bad)
        assert info.value.code in ("INVALID_ARG", "NOT_FOUND")
    with pytest.raises(AdapterError) as info:
        resolve_adapter_dir(root, "escape")
    assert "outside" in info.value.message
    shutil.rmtree(root / "good")
    with pytest.raises(AdapterError) as info:
        resolve_adapter_dir(root, "good")
    assert info.value.code == "NOT_FOUND"


def _outcome(call, *args):
    try:
        return call(*args)
    except AdapterError as exc:
        return exc.code, exc.message


def test_locator_agrees_with_the_full_resolve(tmp_path):
    """The per-request locator (three stats) gives what resolve_adapter_dir + weights_fingerprint
    give, for plain folders, symlinks inside and outside the root, files, bad ids, and changes."""
    root = tmp_path / "root"
    _write(root / "good")
    _write(tmp_path / "elsewhere" / "inside")
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", root / "escape")
    os.symlink(root / "good", root / "alias")
    (root / "plain-file").write_text("not a folder")
    (root / "half").mkdir()
    (root / "half" / "adapter_config.json").write_text("{}")
    locate = AdapterLocator(root)

    def full(adapter_id):
        folder = resolve_adapter_dir(root, adapter_id)
        try:
            return folder, weights_fingerprint(folder)
        except OSError:
            return folder, None

    def same(adapter_id):
        expected, got = _outcome(full, adapter_id), _outcome(locate, adapter_id)
        if isinstance(expected[1], str):  # an error: the same code and message
            assert got == expected, adapter_id
        else:  # the same folder (symlinks resolved only where there is one) and fingerprint
            assert os.path.realpath(got[0]) == str(expected[0]) and got[1] == expected[1], adapter_id
        return got

    ids = ("good", "alias", "escape", "plain-file", "half", "missing", "../outside", "a/b", "..", ".hidden", "")
    for _ in range(2):  # the second round reads the cached paths
        for adapter_id in ids:
            same(adapter_id)
    assert same("alias")[0] == (root / "good").resolve(), "a symlinked adapter is its target folder"
    before = same("good")[1]
    _write(root / "good", config={"lora_alpha": 8})
    assert same("good")[1] != before, "a changed config is a changed fingerprint"
    shutil.rmtree(root / "good")
    assert same("good")[0] == "NOT_FOUND" and same("alias")[0] == "NOT_FOUND"
    os.symlink(tmp_path / "elsewhere" / "inside", root / "good")  # the folder becomes a symlink out of the root
    assert same("good")[0] == "INVALID_ARG"


def test_locator_follows_the_root_path_as_the_full_resolve_does(tmp_path):
    """'..' after a symlinked part of the root, a root symlink flipped to a new version
    (atomic deploys), and a symlink loop (NOT_FOUND, not an escaping RuntimeError)."""
    (tmp_path / "x" / "y").mkdir(parents=True)
    _write(tmp_path / "x" / "adapters" / "a1")
    (tmp_path / "srv").mkdir()
    os.symlink(tmp_path / "x" / "y", tmp_path / "srv" / "link")
    root = tmp_path / "srv" / "link" / ".." / "adapters"  # is x/adapters, not srv/adapters
    locate = AdapterLocator(root)
    folder, fingerprint = locate("a1")
    assert os.path.realpath(folder) == str(resolve_adapter_dir(root, "a1"))
    assert fingerprint == weights_fingerprint(resolve_adapter_dir(root, "a1"))

    _write(tmp_path / "v1" / "a1")
    _write(tmp_path / "v2" / "a1", config={"lora_alpha": 8})
    current = tmp_path / "current"
    os.symlink(tmp_path / "v1", current)
    flipped = AdapterLocator(current)
    before = flipped("a1")[1]
    os.symlink(tmp_path / "v2", tmp_path / "next")
    os.replace(tmp_path / "next", current)
    assert flipped("a1")[1] == weights_fingerprint(tmp_path / "v2" / "a1") != before

    real_root = tmp_path / "x" / "adapters"
    os.symlink(real_root / "loop", real_root / "loop")
    for call in (lambda: resolve_adapter_dir(root, "loop"), lambda: locate("loop")):
        with pytest.raises(AdapterError) as info:
            call()
        assert info.value.code == "NOT_FOUND"
