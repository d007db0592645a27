"""gemm_lora (a linear layer with every token's LoRA update in its epilogue) against the float32
definition: tiles spanning several adapters and rows without one, mixed ranks, odd sizes."""

import pytest
import torch
from manylora.kernels import TOLERANCES, gemm_lora_ref
from manylora.kernels.gemm_lora import DEFAULT_CONFIG, gemm_lora
from sgmv_cases import DTYPES

SMALL = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 2, "num_warps": 4, "num_stages": 2}


def _case(row_slots, row_len, k, n, slots, r_max, dtype, device, seed=0, ranks=None):
    """row_slots: each row's slot (-1: no adapter), sorted as the engine sorts its rows."""
    gen = torch.Generator().manual_seed(seed)
    m = len(row_slots) * row_len
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(device, dtype)
    bias = torch.randn(n, generator=gen).to(device, dtype)
    lora_b = (torch.randn(slots, n, r_max, generator=gen) / r_max**0.5).to(device, dtype)
    scales = (torch.rand(slots, generator=gen) + 0.5).to(device)
    assert list(row_slots) == sorted(row_slots)
    row_slots = torch.tensor(row_slots, device=device)
    v = torch.randn(m, r_max, generator=gen).to(device)
    v[(row_slots < 0).repeat_interleave(row_len)] = float("nan")  # rows without an adapter: never read
    if ranks is not None:
        ranks = torch.tensor(ranks, dtype=torch.int32, device=device)
        for slot, rank in enumerate(ranks.tolist()):
            lora_b[slot, :, rank:] = float("nan")  # padding past a slot's rank: never read
    return x, weight, bias, v, lora_b, scales, row_slots, ranks


def _check(got, want, dtype):
    atol, rtol = TOLERANCES[dtype]
    scale = (
        max(1.0, want.abs().max().item() / 8) if want.numel() else 1.0
    )  # K-long dot products: tolerance grows with the values
    torch.testing.assert_close(got.float(), want, atol=atol * scale, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "row_slots,row_len,k,n,slots,r_max,ranks",
    [
        # 12-token rows in 32-token tiles: tile 0 meets slots -1, 0 and 1, tile 1 slots 1, 2 and
        # 3, tile 2 slot 3 alone
        ([-1, 0, 1, 2, 3, 3], 12, 48, 64, 4, 16, None),
        # nothing aligned (13-token rows, ragged N and K), rank 8 in a 16-wide tile: tile 0 meets
        # two rows without an adapter and slot 0, tile 1 slots 0, 1 and 2
        ([-1, -1, 0, 1, 2, 2, 2], 13, 37, 45, 3, 8, None),
        # mixed ranks (padding past each rank is NaN), rank tile 32; repeated and skipped slots
        ([0, 1, 1, 2, 4, 4], 12, 32, 40, 5, 32, [32, 5, 17, 3, 9]),
        ([-1, -1, -1], 20, 16, 32, 2, 16, None),  # no row with an adapter
    ],
)
def test_matches_reference(device, dtype, row_slots, row_len, k, n, slots, r_max, ranks):
    x, weight, bias, v, lora_b, scales, row_slots, ranks_t = _case(
        row_slots, row_len, k, n, slots, r_max, dtype, device, ranks=ranks
    )
    got = gemm_lora(x, weight, bias, v, lora_b, scales, row_slots, row_len, ranks_t, config=SMALL)
    want = gemm_lora_ref(x, weight, bias, v, lora_b, scales, row_slots, row_len, ranks_t)
    assert got.shape == (len(row_slots) * row_len, n) and got.dtype == dtype
    _check(got, want, dtype)
    base = gemm_lora_ref(x, weight, bias)
    adapted = (row_slots >= 0).repeat_interleave(row_len)
    if bool(adapted.any()):  # the update is really there
        assert (want[adapted] - base[adapted]).abs().max() > 0.1
    _check(got[~adapted], base[~adapted], dtype)


@pytest.mark.parametrize("with_bias", [True, False])
def test_without_lora_is_the_linear_layer(device, with_bias):
    x, weight, bias, *_ = _case([-1, 0, 1], 21, 40, 50, 2, 16, torch.float32, device, seed=3)
    bias = bias if with_bias else None
    _check(gemm_lora(x, weight, bias, config=SMALL), gemm_lora_ref(x, weight, bias), torch.float32)


def test_batch_max_rank_caps_the_rank_tile(device):
    """max_rank below the stack's R_max: columns past it are never read (NaN there)."""
    x, weight, bias, v, lora_b, scales, row_slots, _ = _case(
        [0, 1, 2, 2], 16, 32, 32, 3, 32, torch.float32, device, seed=5
    )
    lora_b[:, :, 8:] = float("nan")
    v[:, 8:] = float("nan")
    got = gemm_lora(x, weight, bias, v, lora_b, scales, row_slots, 16, max_rank=8, config=SMALL)
    want = gemm_lora_ref(x, weight, bias, v, lora_b, scales, row_slots, 16, max_rank=8)
    _check(got, want, torch.float32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the default launch's 128-wide tiles: CUDA only")
def test_default_config_on_engine_like_shapes(device):
    row_slots = sorted(torch.randint(-1, 40, (64,), generator=torch.Generator().manual_seed(1)).tolist())
    x, weight, bias, v, lora_b, scales, row_slots, _ = _case(row_slots, 48, 768, 768, 40, 16, torch.bfloat16, device)
    got = gemm_lora(x, weight, bias, v, lora_b, scales, row_slots, 48, config=DEFAULT_CONFIG)
    _check(got, gemm_lora_ref(x, weight, bias, v, lora_b, scales, row_slots, 48), torch.bfloat16)
