"""gemm_lora (a linear layer with every token's LoRA update in its epilogue) against the float32
definition: tiles spanning several adapters and rows without one, mixed ranks, odd sizes."""

import pytest
import torch
from manylora.kernels import TOLERANCES, gemm_lora_ref
from manylora.kernels.gemm_lora import DEFAULT_CONFIG, gemm_lora
from sgmv_cases import DTYPES

SMALL = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 2, "num_warps": 4, "num_stages": 2}


def _case(rows, row_len, k, n, slots, r_max, dtype, device, seed=0, ranks=None, base_rows=(0,)):
    gen = torch.Generator().manual_seed(seed)
    m = rows * row_len
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(device, dtype)
    bias = torch.randn(n, generator=gen).to(device, dtype)
    lora_b = (torch.randn(slots, n, r_max, generator=gen) / r_max**0.5).to(device, dtype)
    scales = (torch.rand(slots, generator=gen) + 0.5).to(device)
    picked = torch.randint(0, slots, (rows,), generator=gen).tolist()
    row_slots = sorted(-1 if r in base_rows else s for r, s in enumerate(picked))  # the engine sorts rows by slot
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
    "rows,row_len,k,n,slots,r_max,ranks,base_rows",
    [
        (6, 16, 48, 64, 4, 16, None, (0,)),  # 3 tiles of M, each spanning two to three rows' adapters
        (5, 13, 37, 45, 3, 8, None, (0, 1)),  # nothing aligned: ragged M, N, K; rank 8 padded to 16
        (4, 24, 32, 40, 3, 32, [32, 5, 17], ()),  # mixed ranks (padding NaN), rank tile 32
        (3, 20, 16, 32, 2, 16, None, (0, 1, 2)),  # no row with an adapter
    ],
)
def test_matches_reference(device, dtype, rows, row_len, k, n, slots, r_max, ranks, base_rows):
    x, weight, bias, v, lora_b, scales, row_slots, ranks_t = _case(
        rows, row_len, k, n, slots, r_max, dtype, device, ranks=ranks, base_rows=base_rows
    )
    got = gemm_lora(x, weight, bias, v, lora_b, scales, row_slots, row_len, ranks_t, config=SMALL)
    want = gemm_lora_ref(x, weight, bias, v, lora_b, scales, row_slots, row_len, ranks_t)
    assert got.shape == (rows * row_len, n) and got.dtype == dtype
    _check(got, want, dtype)
    base = gemm_lora_ref(x, weight, bias)
    adapted = (row_slots >= 0).repeat_interleave(row_len)
    if bool(adapted.any()):  # the update is really there
        assert (want[adapted] - base[adapted]).abs().max() > 0.1
    _check(got[~adapted], base[~adapted], dtype)


@pytest.mark.parametrize("with_bias", [True, False])
def test_without_lora_is_the_linear_layer(device, with_bias):
    x, weight, bias, *_ = _case(3, 21, 40, 50, 2, 16, torch.float32, device, seed=3)
    bias = bias if with_bias else None
    _check(gemm_lora(x, weight, bias, config=SMALL), gemm_lora_ref(x, weight, bias), torch.float32)


def test_batch_max_rank_caps_the_rank_tile(device):
    """max_rank below the stack's R_max: columns past it are never read (NaN there)."""
    x, weight, bias, v, lora_b, scales, row_slots, _ = _case(4, 16, 32, 32, 3, 32, torch.float32, device, seed=5)
    lora_b[:, :, 8:] = float("nan")
    v[:, 8:] = float("nan")
    got = gemm_lora(x, weight, bias, v, lora_b, scales, row_slots, 16, max_rank=8, config=SMALL)
    want = gemm_lora_ref(x, weight, bias, v, lora_b, scales, row_slots, 16, max_rank=8)
    _check(got, want, torch.float32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the default launch's 128-wide tiles: CUDA only")
def test_default_config_on_engine_like_shapes(device):
    x, weight, bias, v, lora_b, scales, row_slots, _ = _case(64, 48, 768, 768, 40, 16, torch.bfloat16, device)
    got = gemm_lora(x, weight, bias, v, lora_b, scales, row_slots, 48, config=DEFAULT_CONFIG)
    _check(got, gemm_lora_ref(x, weight, bias, v, lora_b, scales, row_slots, 48), torch.bfloat16)
