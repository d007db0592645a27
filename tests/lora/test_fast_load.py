"""Whole-adapter loading (own safetensors header parser, one conversion per adapter, numpy packing)
gives bit for bit what per-tensor torch ops gave, and refuses every file the safetensors library refuses."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save

from manylora.lora.adapter import AdapterError, load_adapter
from manylora.lora.store import AdapterStore

SHAPES = {"q": (8, 8), "up": (8, 24), "down": (24, 8), "absent": (8, 8)}
MAX_RANK = 4


def _key(module: str, which: str) -> str:
    return f"base_model.model.{module}.lora_{which}.weight"


def _tensors(ranks: dict[str, int], dtypes: tuple[torch.dtype, torch.dtype], seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, rank in ranks.items():
        in_features, out_features = SHAPES[module]
        # a spread of magnitudes, so that every rounding mode and subnormals are exercised
        a = torch.randn(rank, in_features, generator=generator) * 10.0 ** torch.randint(-9, 3, (rank, in_features))
        tensors[_key(module, "A")] = a.to(dtypes[0])
        tensors[_key(module, "B")] = torch.randn(out_features, rank, generator=generator).to(dtypes[1])
    return tensors


def _folder(tmp_path, name: str, weights: bytes, ranks: dict[str, int]):
    folder = tmp_path / name
    folder.mkdir()
    config = {"peft_type": "LORA", "r": MAX_RANK, "lora_alpha": 8, "rank_pattern": ranks}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    (folder / "adapter_model.safetensors").write_bytes(weights)
    return folder


def _misaligned(tensors: dict) -> bytes:
    """The same file with a header of odd length: the data section starts at an odd byte."""
    data = save(tensors)
    size = int.from_bytes(data[:8], "little")
    header = data[8 : 8 + size].rstrip(b" ") + b" "
    if len(header) % 2 == 0:
        header += b" "
    return struct.pack("<Q", len(header)) + header + data[8 + size :]


def _reference_slot(tensors: dict, dtype: torch.dtype) -> torch.Tensor:
    """The slot as the per-tensor path filled it: float32 copies, each copied into the zeroed layout."""
    float32 = {k: t.float() for k, t in load_safetensors(save(tensors)).items()}
    pieces = []
    for module, (in_features, out_features) in SHAPES.items():
        a, b = torch.zeros(MAX_RANK, in_features, dtype=dtype), torch.zeros(out_features, MAX_RANK, dtype=dtype)
        if _key(module, "A") in float32:
            rank = float32[_key(module, "A")].shape[0]
            a[:rank].copy_(float32[_key(module, "A")])
            b[:, :rank].copy_(float32[_key(module, "B")])
        pieces += [a.reshape(-1), b.reshape(-1)]
    return torch.cat(pieces)


LAYOUTS = {
    "float32": (torch.float32, torch.float32),
    "bfloat16": (torch.bfloat16, torch.bfloat16),
    "float16": (torch.float16, torch.float16),
    "float64": (torch.float64, torch.float64),
    "float16 A, float32 B": (torch.float16, torch.float32),
    "bfloat16 A, float64 B": (torch.bfloat16, torch.float64),
}


@pytest.mark.parametrize("serving", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("misaligned", [False, True])
def test_slots_hold_exactly_what_per_tensor_conversion_gave(tmp_path, serving, layout, misaligned):
    ranks = {"q": 4, "up": 1, "down": 3}  # "absent" is left out: its slot part stays zero
    tensors = _tensors(ranks, LAYOUTS[layout])
    weights = _misaligned(tensors) if misaligned else save(tensors)
    folder = _folder(tmp_path, "x", weights, ranks)
    adapter = load_adapter("x", folder, SHAPES, MAX_RANK)
    for module, rank in ranks.items():
        loaded = adapter.modules[module]
        assert loaded.rank == rank and loaded.scale == 8 / rank
        assert torch.equal(loaded.a.float(), tensors[_key(module, "A")].float())
        assert torch.equal(loaded.b.float(), tensors[_key(module, "B")].float())
    store = AdapterStore(
        tmp_path, SHAPES, max_rank=MAX_RANK, gpu_slots=1, host_slots=1, device=torch.device("cpu"), dtype=serving
    )
    host = store.get("x")
    reference = _reference_slot(tensors, serving)
    assert torch.equal(_bits(host.packed), _bits(reference)), "bit for bit, signed zeros included"
    assert host.weights is None, "the file's copy is not kept in the host tier"
    for module, rank in ranks.items():
        for which, packed in (("A", host.modules[module].a), ("B", host.modules[module].b)):
            assert torch.equal(_bits(packed), _bits(tensors[_key(module, which)].float().to(serving)))
    assert torch.equal(host.scale_vector, torch.tensor([8 / 4, 8 / 1, 8 / 3, 0.0]))
    slot = store.acquire([host])["x"]
    assert torch.equal(_bits(store._slab[slot]), _bits(reference))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _raw(header: dict, data: bytes, pad: int = 0) -> bytes:
    text = json.dumps(header).encode() + b" " * pad
    return struct.pack("<Q", len(text)) + text + data


A_KEY, B_KEY = _key("q", "A"), _key("q", "B")
GOOD = {A_KEY: {"dtype": "F32", "shape": [1, 8], "data_offsets": [0, 32]},
        B_KEY: {"dtype": "F32", "shape": [8, 1], "data_offsets": [32, 64]}}  # fmt: skip


@pytest.mark.parametrize(
    "weights",
    [
        pytest.param(_raw(GOOD, bytes(64))[:-1], id="truncated"),
        pytest.param(_raw(GOOD, bytes(65)), id="trailing-byte"),
        pytest.param(_raw({**GOOD, B_KEY: {**GOOD[B_KEY], "data_offsets": [36, 68]}}, bytes(68)), id="gap"),
        pytest.param(_raw({**GOOD, B_KEY: {**GOOD[B_KEY], "data_offsets": [28, 60]}}, bytes(60)), id="overlap"),
        pytest.param(_raw({**GOOD, B_KEY: {**GOOD[B_KEY], "data_offsets": [32, 60]}}, bytes(60)), id="short-tensor"),
        pytest.param(_raw({**GOOD, B_KEY: {**GOOD[B_KEY], "dtype": "F33"}}, bytes(64)), id="unknown-dtype"),
        pytest.param(_raw({**GOOD, B_KEY: {**GOOD[B_KEY], "dtype": ["F32"]}}, bytes(64)), id="dtype-not-a-string"),
        pytest.param(_raw({**GOOD, B_KEY: {**GOOD[B_KEY], "shape": [8, 1.0]}}, bytes(64)), id="float-dim"),
        pytest.param(_raw({**GOOD, B_KEY: {**GOOD[B_KEY], "shape": [8, -1]}}, bytes(64)), id="negative-dim"),
        pytest.param(_raw({**GOOD, B_KEY: {**GOOD[B_KEY], "data_offsets": [32]}}, bytes(64)), id="one-offset"),
        pytest.param(_raw({**GOOD, B_KEY: {**GOOD[B_KEY], "data_offsets": [64, 32]}}, bytes(64)), id="reversed"),
        pytest.param(_raw({**GOOD, "__metadata__": {"format": 1}}, bytes(64)), id="metadata-not-strings"),
        pytest.param(_raw([1, 2], b""), id="header-not-object"),
        pytest.param(struct.pack("<Q", 1 << 40) + b"{}", id="header-longer-than-file"),
        pytest.param(b"\x03\x00\x00", id="shorter-than-size"),
        pytest.param(struct.pack("<Q", 2) + b"\xff\xfe", id="header-not-utf8"),
    ],
)
def test_malformed_files_are_refused_as_the_library_refuses_them(tmp_path, weights):
    with pytest.raises((SafetensorError, ValueError, RuntimeError, KeyError, TypeError)):
        load_safetensors(weights)
    folder = _folder(tmp_path, "x", weights, {})
    with pytest.raises(AdapterError, match="not a readable safetensors file") as info:
        load_adapter("x", folder, SHAPES, MAX_RANK)
    assert info.value.code == "INVALID_ARG"


def test_hand_written_files_with_metadata_and_padding_load(tmp_path):
    values = torch.arange(16, dtype=torch.float32)
    header = {"__metadata__": {"format": "pt"}, **GOOD}
    folder = _folder(tmp_path, "x", _raw(header, values.numpy().tobytes(), pad=5), {"q": 1})
    adapter = load_adapter("x", folder, SHAPES, MAX_RANK)
    assert torch.equal(adapter.modules["q"].a, values[:8].view(1, 8))
    assert torch.equal(adapter.modules["q"].b, values[8:].view(8, 1))


@pytest.mark.parametrize(
    "dtype,serving,value",
    [
        (torch.float32, torch.bfloat16, 3.4e38),  # rounds up past the largest bfloat16
        (torch.float32, torch.float16, 65520.0),  # the first value float16 rounds to infinity
        (torch.bfloat16, torch.float16, 1e5),
    ],
)
def test_the_module_beyond_the_serving_range_is_named(tmp_path, dtype, serving, value):
    ranks = {"q": 2, "down": 2}
    tensors = _tensors(ranks, (dtype, dtype))
    tensors[_key("down", "B")][3, 1] = value
    _folder(tmp_path, "x", save(tensors), ranks)
    store = AdapterStore(
        tmp_path, SHAPES, max_rank=MAX_RANK, gpu_slots=1, host_slots=1, device=torch.device("cpu"), dtype=serving
    )
    with pytest.raises(AdapterError, match=f"down holds weights beyond the {serving} range") as info:
        store.get("x")
    assert info.value.code == "INVALID_ARG"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_or_infinity_is_refused_with_its_module_whatever_the_dtype(tmp_path, dtype, bad):
    ranks = {"q": 2, "up": 2}
    tensors = _tensors(ranks, (dtype, dtype))
    tensors[_key("up", "A")][1, 5] = bad
    folder = _folder(tmp_path, "x", save(tensors), ranks)
    with pytest.raises(AdapterError, match="up holds NaN or infinite weights"):
        load_adapter("x", folder, SHAPES, MAX_RANK)
