"""sgmv_shrink against the float32 reference: popularity patterns, ranks, odd sizes, configs."""

import dataclasses

import pytest
import torch
from manylora.kernels import build_sgmv_meta, sgmv_shrink_ref
from manylora.kernels.launch_config import all_configs
from manylora.kernels.sgmv_shrink import sgmv_shrink
from sgmv_cases import DTYPES, PATTERNS, assert_close, make_lora, make_slot_per_token, rank_mask

NUM_SLOTS = 12


def run_and_check(
    device,
    slot_per_token,
    h_in,
    r_max,
    dtype,
    *,
    ranks=None,
    v_dtype=torch.float32,
    config=None,
    max_rank=None,
    seed=0,
    meta=None,
    x=None,
):
    gen = torch.Generator().manual_seed(seed)
    num_tokens = len(slot_per_token)
    if x is None:
        x = torch.randn(num_tokens, h_in, generator=gen).to(device, dtype)
    lora_a, _, _ = make_lora(NUM_SLOTS, r_max, h_in, 16, dtype, device, gen, ranks)
    ranks_dev = None if ranks is None else ranks.to(device)
    if meta is None:
        meta = build_sgmv_meta(slot_per_token=slot_per_token, device=device, max_rank=max_rank)
    v = torch.full((num_tokens, r_max), float("nan"), dtype=v_dtype, device=device)
    expected = v.clone()
    sgmv_shrink(x, lora_a, meta, v, ranks_dev, config=config)
    sgmv_shrink_ref(x, lora_a, meta, expected, ranks_dev)

    defined = rank_mask(slot_per_token, ranks, r_max, device)
    assert_close(v[defined], expected[defined], dtype)
    base_rows = torch.tensor(slot_per_token, device=device) < 0
    assert v[base_rows].isnan().all(), "rows of slot -1 must stay untouched"
    return v


@pytest.mark.parametrize("with_base", [False, True], ids=["adapters", "with_base"])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_popularity_patterns(device, dtype, pattern, with_base):
    num_tokens = 4096 if device == "cuda" else 160
    gen = torch.Generator().manual_seed(2 * PATTERNS.index(pattern) + with_base)
    slots = make_slot_per_token(pattern, num_tokens, NUM_SLOTS, with_base, gen)
    h_in = 768 if device == "cuda" else 100
    run_and_check(device, slots, h_in, 16, dtype)


@pytest.mark.parametrize("rank", [1, 2, 7, 16, 33, 64, 128])
def test_ranks(device, rank):
    num_tokens = 1000 if device == "cuda" else 40
    slots = [1] * (num_tokens // 2) + [4] * (num_tokens - num_tokens // 2)
    run_and_check(device, slots, 96, rank, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mixed_ranks_skip_padding(device, dtype):
    """Each slot has its own rank; the NaN padding past it must never be read."""
    gen = torch.Generator().manual_seed(3)
    ranks = torch.randint(1, 33, (NUM_SLOTS,), generator=gen, dtype=torch.int32)
    ranks[0] = 32
    slots = make_slot_per_token("uniform", 300 if device == "cuda" else 96, NUM_SLOTS, True, gen)
    run_and_check(device, slots, 64, 32, dtype, ranks=ranks, max_rank=32)


def test_batch_max_rank_below_stack_rank(device):
    """meta.max_rank = 8 on a stack padded to 64: only the first 8 columns are computed."""
    gen = torch.Generator().manual_seed(4)
    ranks = torch.randint(1, 9, (NUM_SLOTS,), generator=gen, dtype=torch.int32)
    slots = make_slot_per_token("zipf", 80, NUM_SLOTS, False, gen)
    run_and_check(device, slots, 50, 64, torch.bfloat16, ranks=ranks, max_rank=8)


@pytest.mark.parametrize(
    "num_tokens,h_in",
    [(1, 37), (1, 768), (3, 1), (17, 37), (33, 100), (50, 1024), (40, 3072)],
)
def test_odd_sizes(device, num_tokens, h_in):
    slots = [2] * (num_tokens - num_tokens // 3) + [5] * (num_tokens // 3)
    run_and_check(device, slots, h_in, 16, torch.float16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="large shapes only on CUDA")
@pytest.mark.parametrize("num_tokens,h_in", [(32768, 768), (16384, 4096), (8192, 1024)])
def test_large(device, num_tokens, h_in):
    gen = torch.Generator().manual_seed(5)
    slots = make_slot_per_token("zipf", num_tokens, NUM_SLOTS, True, gen)
    run_and_check(device, slots, h_in, 16, torch.bfloat16)


def test_v_in_input_dtype(device):
    slots = [0] * 20 + [-1] * 5 + [3] * 15
    run_and_check(device, slots, 100, 16, torch.bfloat16, v_dtype=torch.bfloat16)


def test_strided_x(device):
    """x as a column slice of a wider activation buffer."""
    gen = torch.Generator().manual_seed(6)
    wide = torch.randn(40, 130, generator=gen).to(device, torch.bfloat16)
    slots = [1] * 25 + [7] * 15
    run_and_check(device, slots, 100, 16, torch.bfloat16, x=wide[:, 10:110])


def test_undersized_grid_still_covers_every_tile(device):
    """The grid comes from a host bound; if that bound is too small the grid-stride loop
    must still compute every tile."""
    gen = torch.Generator().manual_seed(7)
    slots = make_slot_per_token("uniform", 120, NUM_SLOTS, True, gen)
    meta = build_sgmv_meta(slot_per_token=slots, device=device)
    tiles = {bm: dataclasses.replace(t, grid_bound=1) for bm, t in meta.tiles_by_block_m.items()}
    meta = dataclasses.replace(meta, tiles_by_block_m=tiles)
    run_and_check(device, slots, 64, 16, torch.float32, meta=meta)


@pytest.mark.parametrize("config", all_configs("sgmv_shrink"), ids=lambda c: "-".join(map(str, c.values())))
def test_every_config(device, config):
    gen = torch.Generator().manual_seed(8)
    slots = make_slot_per_token("skewed", 300 if device == "cuda" else 70, NUM_SLOTS, True, gen)
    run_and_check(device, slots, 200, 16, torch.bfloat16, config=config)


@pytest.mark.parametrize("count", [2, 3])
@pytest.mark.parametrize("h_in", [96, 100], ids=["even_k", "odd_k"])
def test_group_equals_the_separate_shrinks(device, count, h_in):
    """sgmv_shrink_group (a layer's q, k, v shrinks in one pass over x) writes each v exactly as its
    own sgmv_shrink does (the same dots in the same order), into column slices of one buffer, with
    mixed ranks (A's padding is NaN), and leaves the rows of slot -1 untouched; against the float32
    reference too."""
    from manylora.kernels.sgmv_shrink import sgmv_shrink_group

    gen = torch.Generator().manual_seed(9)
    ranks = torch.randint(1, 17, (NUM_SLOTS,), generator=gen, dtype=torch.int32).to(device)
    slots = make_slot_per_token("uniform", 300 if device == "cuda" else 90, NUM_SLOTS, True, gen)
    meta = build_sgmv_meta(slot_per_token=slots, device=device, max_rank=16)
    x = torch.randn(len(slots), h_in, generator=gen).to(device, torch.bfloat16)
    lora_as = [make_lora(NUM_SLOTS, 16, h_in, 8, torch.bfloat16, device, gen, ranks.cpu())[0] for _ in range(count)]
    grouped = torch.full((len(slots), count * 16), 5.0, device=device)
    vs = [grouped[:, i * 16 : (i + 1) * 16] for i in range(count)]
    sgmv_shrink_group(x, lora_as, meta, vs, ranks)
    base_rows = torch.tensor(slots, device=device) < 0
    for lora_a, got in zip(lora_as, vs):
        alone = sgmv_shrink(x, lora_a, meta, torch.full((len(slots), 16), 5.0, device=device), ranks)
        assert torch.equal(got, alone), "the grouped pass gives the single shrink's bits"
        want = sgmv_shrink_ref(x, lora_a, meta, torch.full((len(slots), 16), 5.0, device=device), ranks)
        assert_close(got[~base_rows], want[~base_rows], torch.bfloat16)
        assert torch.all(got[base_rows] == 5.0), "rows of slot -1 must stay untouched"
        assert got[~base_rows].abs().max() > 0.5


@pytest.mark.parametrize("r_max,fits,launches", [(16, True, [3]), (16, False, [1, 1, 1]), (64, True, [1, 1, 1])])
def test_group_falls_back_to_single_launches(device, monkeypatch, r_max, fits, launches):
    """One launch for the three linears at rank tile 16 (measured); one launch each where the three
    A tiles do not fit the tuned pipeline in shared memory (the H200 table's BLOCK_K 256, 3 stages
    at rank tile 64; forced here with ``fits`` False) or above GROUP_MAX_RANK_TILE. Either way each
    v is the single shrink's."""
    from manylora.kernels import sgmv_shrink as module

    grouped_launches = []
    if not fits:
        monkeypatch.setattr(module, "fits_shared_memory", lambda *a: False)
    launch = module._sgmv_shrink_kernel
    monkeypatch.setattr(module, "_sgmv_shrink_kernel", type("K", (), {
        "__getitem__": lambda self, grid: lambda *a, **k: grouped_launches.append(k["NUM_A"]) or launch[grid](*a, **k)
    })())  # fmt: skip
    gen = torch.Generator().manual_seed(10)
    slots = make_slot_per_token("uniform", 200 if device == "cuda" else 60, NUM_SLOTS, True, gen)
    meta = build_sgmv_meta(slot_per_token=slots, device=device)
    x = torch.randn(len(slots), 256, generator=gen).to(device, torch.bfloat16)
    lora_as = [make_lora(NUM_SLOTS, r_max, 256, 8, torch.bfloat16, device, gen)[0] for _ in range(3)]
    vs = list(torch.zeros(3, len(slots), r_max, device=device).unbind(0))
    module.sgmv_shrink_group(x, lora_as, meta, vs)
    assert grouped_launches == launches
    for lora_a, got in zip(lora_as, vs):
        assert torch.equal(got, sgmv_shrink(x, lora_a, meta, torch.zeros(len(slots), r_max, device=device)))
