"""sgmv_expand against the float32 reference: popularity patterns, ranks, odd sizes,
column-offset writes, configs. Rows of slot -1 and columns outside the slice must stay
bit-identical."""

import dataclasses

import pytest
import torch
from manylora.kernels import build_sgmv_meta, sgmv_expand_ref
from manylora.kernels.launch_config import all_configs
from manylora.kernels.sgmv_expand import sgmv_expand
from sgmv_cases import DTYPES, PATTERNS, assert_close, make_lora, make_slot_per_token

NUM_SLOTS = 12


def run_and_check(
    device,
    slot_per_token,
    h_out,
    r_max,
    dtype,
    *,
    ranks=None,
    v_dtype=torch.float32,
    config=None,
    max_rank=None,
    y_width=None,
    y_offset=0,
    seed=0,
    meta=None,
):
    gen = torch.Generator().manual_seed(seed)
    num_tokens = len(slot_per_token)
    y_width = h_out if y_width is None else y_width
    _, lora_b, scales = make_lora(NUM_SLOTS, r_max, 8, h_out, dtype, device, gen, ranks)
    ranks_dev = None if ranks is None else ranks.to(device)
    v = torch.randn(num_tokens, r_max, generator=gen).to(device, v_dtype)
    if ranks is not None:
        # Columns past a token's rank are never read: poison them.
        slots = torch.tensor(slot_per_token)
        rank_of_token = ranks[slots.clamp(min=0)].long()
        v[(torch.arange(r_max)[None, :] >= rank_of_token[:, None]).to(device)] = float("nan")
    if meta is None:
        meta = build_sgmv_meta(slot_per_token=slot_per_token, device=device, max_rank=max_rank)
    y_before = torch.randn(num_tokens, y_width, generator=gen).to(device, dtype)
    y = y_before.clone()
    expected = y_before.clone()
    sgmv_expand(v, lora_b, scales, meta, y, ranks_dev, y_offset, config=config)
    sgmv_expand_ref(v, lora_b, scales, meta, expected, ranks_dev, y_offset)

    assert_close(y, expected, dtype)
    base_rows = torch.tensor(slot_per_token, device=device) < 0
    assert torch.equal(y[base_rows], y_before[base_rows]), "rows of slot -1 must stay untouched"
    outside = torch.ones(y_width, dtype=torch.bool, device=device)
    outside[y_offset : y_offset + h_out] = False
    assert torch.equal(y[:, outside], y_before[:, outside]), "columns outside the slice must stay untouched"
    if (~base_rows).any():
        assert not torch.equal(y[~base_rows], y_before[~base_rows]), "adapter rows must change"


@pytest.mark.parametrize("with_base", [False, True], ids=["adapters", "with_base"])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_popularity_patterns(device, dtype, pattern, with_base):
    num_tokens = 4096 if device == "cuda" else 160
    gen = torch.Generator().manual_seed(100 + 2 * PATTERNS.index(pattern) + with_base)
    slots = make_slot_per_token(pattern, num_tokens, NUM_SLOTS, with_base, gen)
    h_out = 768 if device == "cuda" else 100
    run_and_check(device, slots, h_out, 16, dtype)


@pytest.mark.parametrize("rank", [1, 2, 7, 16, 33, 64, 128])
def test_ranks(device, rank):
    num_tokens = 1000 if device == "cuda" else 40
    slots = [1] * (num_tokens // 2) + [4] * (num_tokens - num_tokens // 2)
    run_and_check(device, slots, 96, rank, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mixed_ranks_skip_padding(device, dtype):
    gen = torch.Generator().manual_seed(3)
    ranks = torch.randint(1, 33, (NUM_SLOTS,), generator=gen, dtype=torch.int32)
    ranks[0] = 32
    slots = make_slot_per_token("uniform", 300 if device == "cuda" else 96, NUM_SLOTS, True, gen)
    run_and_check(device, slots, 64, 32, dtype, ranks=ranks, max_rank=32)


def test_batch_max_rank_below_stack_rank(device):
    gen = torch.Generator().manual_seed(4)
    ranks = torch.randint(1, 9, (NUM_SLOTS,), generator=gen, dtype=torch.int32)
    slots = make_slot_per_token("zipf", 80, NUM_SLOTS, False, gen)
    run_and_check(device, slots, 50, 64, torch.bfloat16, ranks=ranks, max_rank=8)


@pytest.mark.parametrize(
    "num_tokens,h_out",
    [(1, 37), (1, 768), (3, 1), (17, 37), (33, 100), (50, 1024), (20, 3072)],
)
def test_odd_sizes(device, num_tokens, h_out):
    slots = [2] * (num_tokens - num_tokens // 3) + [5] * (num_tokens // 3)
    run_and_check(device, slots, h_out, 16, torch.float16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="large shapes only on CUDA")
@pytest.mark.parametrize("num_tokens,h_out", [(32768, 768), (32768, 3072), (8192, 4096)])
def test_large(device, num_tokens, h_out):
    gen = torch.Generator().manual_seed(5)
    slots = make_slot_per_token("zipf", num_tokens, NUM_SLOTS, True, gen)
    run_and_check(device, slots, h_out, 16, torch.bfloat16)


@pytest.mark.parametrize("y_offset", [0, 64, 128], ids=lambda o: f"q_k_v_{o // 64}")
def test_column_offset_into_fused_output(device, y_offset):
    """One of q/k/v (64 columns each) written into its slice of a [T, 192] output."""
    gen = torch.Generator().manual_seed(9)
    slots = make_slot_per_token("uniform", 90, NUM_SLOTS, True, gen)
    run_and_check(device, slots, 64, 16, torch.bfloat16, y_width=192, y_offset=y_offset)


def test_odd_column_offset(device):
    slots = [3] * 30 + [-1] * 4 + [8] * 10
    run_and_check(device, slots, 37, 8, torch.float32, y_width=101, y_offset=13)


def test_v_in_weight_dtype(device):
    slots = [0] * 20 + [-1] * 5 + [3] * 15
    run_and_check(device, slots, 100, 16, torch.bfloat16, v_dtype=torch.bfloat16)


def test_undersized_grid_still_covers_every_tile(device):
    gen = torch.Generator().manual_seed(7)
    slots = make_slot_per_token("uniform", 120, NUM_SLOTS, True, gen)
    meta = build_sgmv_meta(slot_per_token=slots, device=device)
    tiles = {bm: dataclasses.replace(t, grid_bound=1) for bm, t in meta.tiles_by_block_m.items()}
    meta = dataclasses.replace(meta, tiles_by_block_m=tiles)
    run_and_check(device, slots, 64, 16, torch.float32, meta=meta)


@pytest.mark.parametrize("config", all_configs("sgmv_expand"), ids=lambda c: "-".join(map(str, c.values())))
def test_every_config(device, config):
    gen = torch.Generator().manual_seed(8)
    slots = make_slot_per_token("skewed", 300 if device == "cuda" else 70, NUM_SLOTS, True, gen)
    run_and_check(device, slots, 200, 16, torch.bfloat16, config=config)


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("h_out,y_offset,y_width", [(200, 0, 200), (37, 13, 101)], ids=["even", "odd_slice"])
def test_write_mode_never_reads_y(device, dtype, with_bias, h_out, y_offset, y_width):
    """accumulate=False writes bias + update (for the base GEMM to add itself afterwards): the old
    contents of adapter rows are never read (NaN there stays out), slot -1 rows and the columns
    outside the slice stay as they were, and the values are the float32 definition's."""
    gen = torch.Generator().manual_seed(11)
    slots = make_slot_per_token("skewed", 150, NUM_SLOTS, True, gen)
    _, lora_b, scales = make_lora(NUM_SLOTS, 16, 8, h_out, dtype, device, gen)
    v = torch.randn(len(slots), 16, generator=gen).to(device)
    bias = torch.randn(h_out, generator=gen).to(device, dtype) if with_bias else None
    meta = build_sgmv_meta(slot_per_token=slots, device=device)
    adapted = torch.tensor(slots, device=device) >= 0
    y_before = torch.randn(len(slots), y_width, generator=gen).to(device, dtype)
    y_before[adapted, y_offset : y_offset + h_out] = float("nan")
    got, want = y_before.clone(), y_before.clone()
    sgmv_expand(v, lora_b, scales, meta, got, None, y_offset, accumulate=False, bias=bias)
    sgmv_expand_ref(v, lora_b, scales, meta, want, None, y_offset, accumulate=False, bias=bias)
    assert not got[adapted, y_offset : y_offset + h_out].isnan().any(), "y was read"
    assert_close(got, want, dtype)
    slot_index = torch.tensor(slots, device=device).clamp(min=0)
    update = torch.einsum("tr,tor->to", v.float(), lora_b[slot_index].float()) * scales[slot_index, None]
    defined = update + (0 if bias is None else bias.float())
    assert_close(got[adapted, y_offset : y_offset + h_out], defined[adapted].to(dtype), dtype)
    same = lambda a, b: torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))  # noqa: E731
    assert same(got[~adapted], y_before[~adapted]), "rows of slot -1 must stay untouched"
    outside = torch.ones(y_width, dtype=torch.bool, device=device)
    outside[y_offset : y_offset + h_out] = False
    assert same(got[:, outside], y_before[:, outside]), "columns outside the slice must stay untouched"


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_bias_only_when_writing(device, backend):
    """Both backends refuse a bias in accumulate mode (the kernel would silently drop it)."""
    from manylora.kernels import expand

    slots = [0] * 8
    _, lora_b, scales = make_lora(NUM_SLOTS, 16, 8, 32, torch.float32, device, torch.Generator().manual_seed(1))
    meta = build_sgmv_meta(slot_per_token=slots, device=device)
    v, y = torch.zeros(8, 16, device=device), torch.zeros(8, 32, device=device)
    with pytest.raises(AssertionError, match="bias"):
        expand(v, lora_b, scales, meta, y, backend=backend, accumulate=True, bias=torch.zeros(32, device=device))


@pytest.mark.parametrize("epilogue", ["residual", "gelu", "both"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("h_out,y_offset,y_width", [(200, 0, 200), (37, 13, 101)], ids=["even", "odd_slice"])
def test_epilogue_equals_the_separate_passes(device, dtype, epilogue, h_out, y_offset, y_width):
    """The residual add and the exact GELU inside the expand give what the update followed by
    torch's own add and gelu give (each step rounded to y's dtype), against the float32
    definition; rows of slot -1 and the columns outside the slice stay as they were."""
    gen = torch.Generator().manual_seed(13)
    slots = make_slot_per_token("uniform", 150, NUM_SLOTS, True, gen)
    _, lora_b, scales = make_lora(NUM_SLOTS, 16, 8, h_out, dtype, device, gen)
    v = torch.randn(len(slots), 16, generator=gen).to(device)
    meta = build_sgmv_meta(slot_per_token=slots, device=device)
    residual = torch.randn(len(slots), h_out, generator=gen).to(device, dtype) if epilogue != "gelu" else None
    gelu = epilogue != "residual"
    y_before = torch.randn(len(slots), y_width, generator=gen).to(device, dtype)
    got, want = y_before.clone(), y_before.clone()
    sgmv_expand(v, lora_b, scales, meta, got, None, y_offset, residual=residual, gelu=gelu)
    sgmv_expand_ref(v, lora_b, scales, meta, want, None, y_offset, residual=residual, gelu=gelu)
    assert_close(got, want, dtype)
    adapted = torch.tensor(slots, device=device) >= 0
    slot_index = torch.tensor(slots, device=device).clamp(min=0)
    update = torch.einsum("tr,tor->to", v.float(), lora_b[slot_index].float()) * scales[slot_index, None]
    defined = (y_before[:, y_offset : y_offset + h_out].float() + update).to(dtype)  # the stored row
    if residual is not None:
        defined = defined + residual
    if gelu:
        defined = torch.nn.functional.gelu(defined)
    assert_close(got[adapted, y_offset : y_offset + h_out], defined[adapted], dtype)
    assert torch.equal(got[~adapted], y_before[~adapted]), "rows of slot -1 must stay untouched"
    outside = torch.ones(y_width, dtype=torch.bool, device=device)
    outside[y_offset : y_offset + h_out] = False
    assert torch.equal(got[:, outside], y_before[:, outside]), "columns outside the slice must stay untouched"
    if gelu:  # the activation really ran: GELU never goes below about -0.17
        assert got[adapted, y_offset : y_offset + h_out].float().min() > -0.2


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_epilogue_only_when_accumulating(device, backend):
    """Both backends refuse an epilogue in write mode (the base GEMM adds itself after it there)."""
    from manylora.kernels import expand

    slots = [0] * 8
    _, lora_b, scales = make_lora(NUM_SLOTS, 16, 8, 32, torch.float32, device, torch.Generator().manual_seed(1))
    meta = build_sgmv_meta(slot_per_token=slots, device=device)
    v, y = torch.zeros(8, 16, device=device), torch.zeros(8, 32, device=device)
    with pytest.raises(AssertionError, match="epilogue"):
        expand(v, lora_b, scales, meta, y, backend=backend, accumulate=False, gelu=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("h_out", [200, 768])
def test_layer_norm_epilogue_equals_the_separate_passes(device, dtype, h_out):
    """The update, the residual add and DeBERTa's layer norm in one expand (one block spans the
    row) give what the update followed by torch's own add and layer_norm give, against the float32
    definition; rows of slot -1 stay as they were."""
    gen = torch.Generator().manual_seed(17)
    slots = make_slot_per_token("skewed", 120, NUM_SLOTS, True, gen)
    _, lora_b, scales = make_lora(NUM_SLOTS, 16, 8, h_out, dtype, device, gen)
    v = torch.randn(len(slots), 16, generator=gen).to(device)
    meta = build_sgmv_meta(slot_per_token=slots, device=device)
    residual = torch.randn(len(slots), h_out, generator=gen).to(device, dtype)
    norm = (
        (1 + 0.1 * torch.randn(h_out, generator=gen)).to(device, dtype),
        (0.1 * torch.randn(h_out, generator=gen)).to(device, dtype),
        1e-7,
    )
    y_before = (3 * torch.randn(len(slots), h_out, generator=gen) + 1).to(device, dtype)
    got, want = y_before.clone(), y_before.clone()
    sgmv_expand(v, lora_b, scales, meta, got, residual=residual, layer_norm=norm)
    sgmv_expand_ref(v, lora_b, scales, meta, want, residual=residual, layer_norm=norm)
    assert_close(got, want, dtype)
    adapted = torch.tensor(slots, device=device) >= 0
    slot_index = torch.tensor(slots, device=device).clamp(min=0)
    update = torch.einsum("tr,tor->to", v.float(), lora_b[slot_index].float()) * scales[slot_index, None]
    stored = ((y_before.float() + update).to(dtype) + residual).float()
    defined = torch.nn.functional.layer_norm(stored, (h_out,), norm[0].float(), norm[1].float(), norm[2])
    assert_close(got[adapted], defined[adapted].to(dtype), dtype)
    assert torch.equal(got[~adapted], y_before[~adapted]), "rows of slot -1 must stay untouched"
    assert got[adapted].float().mean(dim=1).abs().max() < 0.5, "normalised rows"


@pytest.mark.parametrize("mode", ["accumulate", "write", "residual", "gelu"])
def test_programs_walking_several_column_blocks(device, mode):
    """N_PER_PROG > BLOCK_N (a program walks its columns in blocks, the v tile loaded once) gives
    the reference's answer, also where the last program's blocks pass the row's end."""
    gen = torch.Generator().manual_seed(19)
    h_out, dtype = 200, torch.bfloat16
    slots = make_slot_per_token("skewed", 150, NUM_SLOTS, True, gen)
    _, lora_b, scales = make_lora(NUM_SLOTS, 16, 8, h_out, dtype, device, gen)
    v = torch.randn(len(slots), 16, generator=gen).to(device)
    meta = build_sgmv_meta(slot_per_token=slots, device=device)
    kw = {
        "accumulate": {},
        "write": {"accumulate": False, "bias": torch.randn(h_out, generator=gen).to(device, dtype)},
        "residual": {"residual": torch.randn(len(slots), h_out, generator=gen).to(device, dtype)},
        "gelu": {"gelu": True},
    }[mode]
    y_before = torch.randn(len(slots), h_out, generator=gen).to(device, dtype)
    want = sgmv_expand_ref(v, lora_b, scales, meta, y_before.clone(), **kw)
    for config in ({"N_PER_PROG": 128}, {"N_PER_PROG": 256}):
        config.update(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=2)
        got = sgmv_expand(v, lora_b, scales, meta, y_before.clone(), config=config, **kw)
        assert_close(got, want, dtype)
