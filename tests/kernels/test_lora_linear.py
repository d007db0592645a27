"""lora_linear (base GEMM + every token's LoRA update + epilogue in one kernel) against the float32
reference: popularity patterns, dtypes, ranks, bias, residual, GELU, odd sizes, column offsets."""

import pytest
import torch
from manylora.kernels import build_sgmv_meta, lora_linear_ref
from manylora.kernels.lora_linear import lora_linear
from sgmv_cases import DTYPES, PATTERNS, assert_close, make_lora, make_slot_per_token

NUM_SLOTS = 12


def run_and_check(
    device,
    slot_per_token,
    h_in,
    h_out,
    r_max,
    dtype,
    *,
    ranks=None,
    bias=True,
    residual=False,
    gelu=False,
    y_width=None,
    y_offset=0,
    config=None,
    seed=0,
):
    gen = torch.Generator().manual_seed(seed)
    num_tokens = len(slot_per_token)
    _, lora_b, scales = make_lora(NUM_SLOTS, r_max, h_in, h_out, dtype, device, gen, ranks)
    ranks_dev = None if ranks is None else ranks.to(device)
    x = torch.randn(num_tokens, h_in, generator=gen).to(device, dtype)
    weight = (torch.randn(h_out, h_in, generator=gen) / h_in**0.5).to(device, dtype)
    b = torch.randn(h_out, generator=gen).to(device, dtype) if bias else None
    v = torch.randn(num_tokens, r_max, generator=gen).to(device, torch.float32)
    if ranks is not None:  # columns past a token's rank are never read: poison them
        rank_of_token = ranks[torch.tensor(slot_per_token)].long()
        v[(torch.arange(r_max)[None, :] >= rank_of_token[:, None]).to(device)] = float("nan")
    res = torch.randn(num_tokens, h_out, generator=gen).to(device, dtype) if residual else None
    meta = build_sgmv_meta(slot_per_token=slot_per_token, device=device)
    expected = lora_linear_ref(x, weight, b, v, lora_b, scales, meta, ranks_dev, res, gelu)
    y_width = h_out if y_width is None else y_width
    y = torch.full((num_tokens, y_width), 7.0, dtype=dtype, device=device)
    out = lora_linear(x, weight, b, v, lora_b, scales, meta, y, ranks_dev, y_offset, res, gelu, config)
    assert out is y
    assert_close(y[:, y_offset : y_offset + h_out], expected, dtype)
    outside = torch.ones(y_width, dtype=torch.bool)
    outside[y_offset : y_offset + h_out] = False
    assert (y[:, outside.to(device)] == 7.0).all(), "columns outside the slice were written"
    return y


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_patterns_and_dtypes(device, pattern, dtype):
    gen = torch.Generator().manual_seed(PATTERNS.index(pattern))
    slots = make_slot_per_token(pattern, 70, NUM_SLOTS, with_base=False, gen=gen)
    run_and_check(device, slots, 48, 40, 16, dtype)


@pytest.mark.parametrize(("residual", "gelu"), [(True, False), (False, True), (True, True)])
def test_epilogues(device, residual, gelu):
    gen = torch.Generator().manual_seed(3)
    slots = make_slot_per_token("uniform", 53, NUM_SLOTS, with_base=False, gen=gen)
    run_and_check(device, slots, 64, 32, 16, torch.bfloat16, residual=residual, gelu=gelu)


def test_mixed_ranks_never_read_padding(device):
    gen = torch.Generator().manual_seed(4)
    slots = make_slot_per_token("zipf", 61, NUM_SLOTS, with_base=False, gen=gen)
    ranks = torch.tensor([4, 8, 16, 2, 16, 1, 8, 4, 16, 12, 5, 16], dtype=torch.int32)
    run_and_check(device, slots, 32, 48, 16, torch.bfloat16, ranks=ranks)


def test_odd_sizes_no_bias_and_column_offset(device):
    """K and N not multiples of the tiles; y a slice of a wider output (fused q/k/v)."""
    gen = torch.Generator().manual_seed(5)
    slots = make_slot_per_token("distinct", 37, NUM_SLOTS, with_base=False, gen=gen)
    run_and_check(device, slots, 50, 27, 8, torch.float16, bias=False, y_width=90, y_offset=31)


def test_a_small_grid_still_covers_every_tile(device):
    """The tiles are walked with a grid stride: a grid smaller than the tile count (a CUDA graph
    captured on a smaller batch) must still write every row."""
    gen = torch.Generator().manual_seed(6)
    slots = make_slot_per_token("uniform", 90, NUM_SLOTS, with_base=False, gen=gen)
    meta = build_sgmv_meta(slot_per_token=slots, device=device)
    small = {bm: t.__class__(t.block_m, t.packed, 1) for bm, t in meta.tiles_by_block_m.items()}
    object.__setattr__(meta, "tiles_by_block_m", small)
    x = torch.randn(90, 32, generator=gen).to(device)
    weight = torch.randn(16, 32, generator=gen).to(device)
    _, lora_b, scales = make_lora(NUM_SLOTS, 8, 32, 16, torch.float32, device, gen)
    v = torch.randn(90, 8, generator=gen).to(device)
    expected = lora_linear_ref(x, weight, None, v, lora_b, scales, meta)
    assert_close(lora_linear(x, weight, None, v, lora_b, scales, meta), expected, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("residual", [False, True])
def test_tma_loads(device, dtype, residual):
    """The tensor-descriptor form of the K loop (whole boxes, rows past a tile's end loaded and
    never stored, zeros past the tensor's end) gives the pointer form's answers."""
    gen = torch.Generator().manual_seed(7)
    slots = make_slot_per_token("uniform", 75, NUM_SLOTS, with_base=False, gen=gen)
    config = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 3, "TMA": True}
    run_and_check(device, slots, 80, 48, 16, dtype, residual=residual, config=config)
