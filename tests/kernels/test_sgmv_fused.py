"""sgmv_write_group (shrink and write-first expand of up to three linears in one pass) against the
split kernels it replaces and the float32 reference."""

import pytest
import torch
from manylora.kernels import build_sgmv_meta, sgmv_expand_ref, sgmv_shrink_ref, write_group, write_group_supported
from manylora.kernels.sgmv_expand import sgmv_expand
from manylora.kernels.sgmv_fused import sgmv_write_group
from manylora.kernels.sgmv_shrink import sgmv_shrink_group
from sgmv_cases import DTYPES, assert_close, make_lora, make_slot_per_token

NUM_SLOTS = 12


def _case(device, dtype, count, h_in, h_out, pattern, with_base, seed, mixed_ranks=True):
    gen = torch.Generator().manual_seed(seed)
    ranks = None
    if mixed_ranks:
        ranks = torch.randint(1, 17, (NUM_SLOTS,), generator=gen, dtype=torch.int32)
    slots = make_slot_per_token(pattern, 320 if device == "cuda" else 96, NUM_SLOTS, with_base, gen)
    meta = build_sgmv_meta(slot_per_token=slots, device=device, max_rank=16)
    x = torch.randn(len(slots), h_in, generator=gen).to(device, dtype)
    loras = [make_lora(NUM_SLOTS, 16, h_in, h_out, dtype, device, gen, ranks) for _ in range(count)]
    biases = [torch.randn(h_out, generator=gen).to(device, dtype) for _ in range(count)]
    return slots, meta, x, loras, biases, None if ranks is None else ranks.to(device)


@pytest.mark.parametrize("count", [1, 2, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("pattern,with_base", [("uniform", True), ("distinct", False), ("skewed", True)])
def test_write_group_equals_the_split_kernels(device, dtype, count, pattern, with_base):
    """Each y has the bits the grouped shrink into float32 v's and the write-first expand give (rows
    of bias plus the update), with mixed ranks (the padding of A and B is NaN: never read), an H_out
    that is no multiple of BLOCK_N, and rows of slot -1 left as they were; and it is close to the
    float32 definition."""
    h_in, h_out = (768, 320) if device == "cuda" else (96, 72)
    slots, meta, x, loras, biases, ranks = _case(device, dtype, count, h_in, h_out, pattern, with_base, seed=count)
    lora_as, lora_bs, scales = ([lora[i] for lora in loras] for i in range(3))
    got = [torch.full((len(slots), h_out), 7.0, device=device, dtype=dtype) for _ in range(count)]
    sgmv_write_group(x, lora_as, lora_bs, scales, meta, got, biases, ranks)

    vs = list(torch.zeros(count, len(slots), 16, device=device).unbind(0))
    sgmv_shrink_group(x, lora_as, meta, vs, ranks)  # the table's BLOCK_K, as the fused pass takes it
    base_rows = torch.tensor(slots, device=device) < 0
    for i in range(count):
        split = sgmv_expand(
            vs[i], lora_bs[i], scales[i], meta, torch.full_like(got[i], 7.0), ranks, accumulate=False, bias=biases[i]
        )
        assert torch.equal(got[i], split), "the split kernels' bits"
        v_ref = sgmv_shrink_ref(x, lora_as[i], meta, torch.zeros(len(slots), 16, device=device), ranks)
        want = sgmv_expand_ref(
            v_ref, lora_bs[i], scales[i], meta, torch.full_like(got[i], 7.0), ranks, 0, False, biases[i]
        )
        assert_close(got[i][~base_rows], want[~base_rows], dtype)
        assert torch.all(got[i][base_rows] == 7.0), "rows of slot -1 are not written"
        assert (got[i][~base_rows].float() - biases[i].float()).abs().max() > 0.1, "an update was added"


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_write_group_backends_without_bias(device, backend):
    """kernels.write_group on either backend: no bias means y = the update alone, as
    lora_apply(accumulate=False) per linear writes it."""
    from manylora.kernels import lora_apply

    dtype = torch.bfloat16
    slots, meta, x, loras, _, ranks = _case(device, dtype, 3, 64, 48, "uniform", False, seed=5, mixed_ranks=False)
    lora_as, lora_bs, scales = ([lora[i] for lora in loras] for i in range(3))
    got = [torch.empty(len(slots), 48, device=device, dtype=dtype) for _ in range(3)]
    write_group(x, lora_as, lora_bs, scales, meta, got, None, ranks, backend=backend)
    for i in range(3):
        want = torch.empty_like(got[i])
        lora_apply(x, want, lora_as[i], lora_bs[i], scales[i], meta, backend="torch", accumulate=False)
        assert_close(got[i], want, dtype)


def test_write_group_takes_rank_tiles_up_to_16(device):
    """One pass only where three rank-16 accumulators live through the column walk: a larger rank
    tile is refused (the engine shrinks and expands apart there)."""
    assert write_group_supported(16, "triton") and write_group_supported(4, "triton")
    assert not write_group_supported(17, "triton") and not write_group_supported(16, "torch")
    gen = torch.Generator().manual_seed(3)
    slots = make_slot_per_token("uniform", 40, NUM_SLOTS, False, gen)
    meta = build_sgmv_meta(slot_per_token=slots, device=device, max_rank=32)
    a, b, s = make_lora(NUM_SLOTS, 32, 64, 32, torch.bfloat16, device, gen)
    x = torch.randn(len(slots), 64, generator=gen).to(device, torch.bfloat16)
    with pytest.raises(AssertionError, match="rank tile 32"):
        sgmv_write_group(x, [a], [b], [s], meta, [torch.empty(len(slots), 32, device=device, dtype=torch.bfloat16)])
