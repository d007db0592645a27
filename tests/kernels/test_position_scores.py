"""position_scores (DeBERTa's position scores with every row's own LoRA on the position
projection, one pass) against the float32 reference, and the encoder's eager path against
the same reference."""

import math

import pytest
import torch
from manylora.kernels import TOLERANCES, position_scores_ref
from manylora.kernels.posscores import position_scores

from manylora.encoder import _position_scores
from manylora.lora.batch import PositionLora


def _case(batch, length, heads, head, window, rank, slots, dtype, device, seed=0, base_rows=(0,)):
    """Unit-scale operands; B factors as strided views into wider slab rows, like the store's."""
    gen = torch.Generator().manual_seed(seed)
    hidden = heads * head
    x = (torch.randn(batch * length, hidden, generator=gen) / math.sqrt(head)).to(device, dtype)
    table = torch.randn(window, hidden, generator=gen).to(device, dtype)
    slab = (torch.randn(slots, 7 + hidden * rank, generator=gen) / math.sqrt(head)).to(device, dtype)
    lora_b = slab[:, 7:].unflatten(1, (hidden, rank))
    picked = torch.randint(0, slots, (batch,), generator=gen).tolist()
    row_slots = sorted(-1 if b in base_rows else s for b, s in enumerate(picked))
    groups = sorted(set(row_slots))
    v = torch.randn(len(groups), rank, window, generator=gen) / math.sqrt(rank)
    if groups[0] == -1:
        v[0] = 0  # the no-adapter group: scale 0
    as_tensor = lambda values: torch.tensor(values, dtype=torch.int64, device=device)  # noqa: E731
    row_group = as_tensor([groups.index(s) for s in row_slots])
    return x, table, lora_b, as_tensor(row_slots), v.to(device, dtype), row_group


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "batch,length,heads,head,window,rank,slots,base_rows",
    [
        (3, 16, 2, 16, 32, 16, 4, (0,)),  # aligned tiles, one base row
        (4, 37, 3, 32, 50, 8, 5, (1, 2)),  # ragged L and W, rank padded to 16, two base rows
        (2, 70, 2, 64, 139, 32, 3, ()),  # L and W over one tile, rank 32, no base row
        (5, 9, 1, 16, 17, 4, 2, (0, 1, 2, 3, 4)),  # every row without an adapter
    ],
)
def test_matches_reference(device, dtype, batch, length, heads, head, window, rank, slots, base_rows):
    x, table, lora_b, row_slots, v, row_group = _case(
        batch, length, heads, head, window, rank, slots, dtype, device, base_rows=base_rows
    )
    got = position_scores(x, table, batch, length, heads, lora_b, row_slots, v, row_group)
    want = position_scores_ref(x, table, batch, length, heads, lora_b, row_slots, v, row_group)
    assert got.shape == (batch, heads, length, window) and got.dtype == dtype
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)
    base_only = position_scores_ref(x, table, batch, length, heads)
    adapted = row_slots >= 0
    if bool(adapted.any()):  # the low-rank term is really there
        assert (want[adapted] - base_only[adapted]).abs().max() > 10 * atol
    torch.testing.assert_close(got[~adapted].float(), base_only[~adapted], atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "block_l,block_w,num_warps,w_tiles",
    [
        (64, 64, 4, 1),  # one W tile per program
        (64, 64, 4, 8),  # the whole window in one program's loop (clamped to the tiles there are)
        (32, 64, 4, 2),  # W spans of two tiles, the last one partial
        (64, 128, 4, 4),
        (128, 64, 8, 3),
    ],
)
def test_tile_shapes_and_w_loops_match_reference(device, dtype, block_l, block_w, num_warps, w_tiles):
    """Every launch shape the benchmark tries gives the reference's scores (ragged L and W, a base row)."""
    batch, length, heads, window = 3, 70, 2, 200
    x, table, lora_b, row_slots, v, row_group = _case(batch, length, heads, 64, window, 16, 4, dtype, device, seed=3)
    got = position_scores(
        x, table, batch, length, heads, lora_b, row_slots, v, row_group, block_l, block_w, num_warps, w_tiles
    )
    want = position_scores_ref(x, table, batch, length, heads, lora_b, row_slots, v, row_group)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_without_lora_is_the_base_gemm(device, dtype):
    x, table, *_ = _case(3, 21, 4, 16, 45, 16, 2, dtype, device, seed=2)
    got = position_scores(x, table, 3, 21, 4)
    want = position_scores_ref(x, table, 3, 21, 4)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("with_lora", [True, False])
def test_encoder_eager_path_matches_reference(with_lora):
    """The CPU serving path (base GEMM per head + in-place rank-R GEMM) has the kernel's semantics."""
    batch, length, heads = 4, 23, 2
    x, table, lora_b, row_slots, v, row_group = _case(batch, length, heads, 16, 40, 8, 3, torch.float32, "cpu", seed=4)
    lora = PositionLora(lora_b, v, row_slots, row_group) if with_lora else None
    got = _position_scores(x, table, lora, batch, length, heads, "torch")
    args = (lora_b, row_slots, v, row_group) if with_lora else ()
    want = position_scores_ref(x, table, batch, length, heads, *args)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
