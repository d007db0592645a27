"""The float32 reference against a per-token float64 loop (the reference is what every
kernel test trusts, so it is checked on its own), plus the torch backend's contract."""

import pytest
import torch
from manylora.kernels import build_sgmv_meta, sgmv_expand_ref, sgmv_shrink_ref
from sgmv_cases import make_lora, make_slot_per_token


@pytest.mark.parametrize("with_ranks", [False, True])
def test_reference_matches_per_token_float64(with_ranks):
    gen = torch.Generator().manual_seed(21)
    num_slots, r_max, h_in, h_out = 6, 8, 30, 20
    ranks = torch.randint(1, r_max + 1, (num_slots,), generator=gen, dtype=torch.int32) if with_ranks else None
    slots = make_slot_per_token("uniform", 50, num_slots, True, gen)
    lora_a, lora_b, scales = make_lora(num_slots, r_max, h_in, h_out, torch.float32, "cpu", gen)
    x = torch.randn(50, h_in, generator=gen)
    y0 = torch.randn(50, h_out + 4, generator=gen)
    meta = build_sgmv_meta(slot_per_token=slots)

    v = torch.full((50, r_max), float("nan"))
    sgmv_shrink_ref(x, lora_a, meta, v, ranks)
    y = sgmv_expand_ref(v, lora_b, scales, meta, y0.clone(), ranks, y_offset=2)

    for t, slot in enumerate(slots):
        if slot < 0:
            assert v[t].isnan().all()
            assert torch.equal(y[t], y0[t])
            continue
        rank = r_max if ranks is None else int(ranks[slot])
        v_t = x[t].double() @ lora_a[slot, :rank].double().t()
        torch.testing.assert_close(v[t, :rank].double(), v_t, atol=1e-5, rtol=1e-5)
        assert (v[t, rank:] == 0).all()
        y_t = y0[t].double().clone()
        y_t[2 : 2 + h_out] += float(scales[slot]) * (v_t @ lora_b[slot, :, :rank].double().t())
        torch.testing.assert_close(y[t].double(), y_t, atol=1e-5, rtol=1e-5)
