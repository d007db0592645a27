"""Public API: backends agree, lora_apply = shrink + expand, and the fused q/k/v recipe
(one shrink over stacked A, three expands into column slices)."""

import manylora.kernels as K
import pytest
import torch
from sgmv_cases import assert_close, make_lora, make_slot_per_token


def test_backends_agree(device):
    gen = torch.Generator().manual_seed(31)
    slots = make_slot_per_token("zipf", 150, 10, True, gen)
    meta = K.build_sgmv_meta(slot_per_token=slots, device=device)
    lora_a, lora_b, scales = make_lora(10, 16, 80, 48, torch.bfloat16, device, gen)
    x = torch.randn(150, 80, generator=gen).to(device, torch.bfloat16)
    y0 = torch.randn(150, 48, generator=gen).to(device, torch.bfloat16)
    results = {
        backend: K.lora_apply(x, y0.clone(), lora_a, lora_b, scales, meta, backend=backend) for backend in K.BACKENDS
    }
    assert_close(results["triton"], results["torch"], torch.bfloat16)
    assert not torch.equal(results["torch"], y0)


def test_fused_qkv(device):
    gen = torch.Generator().manual_seed(32)
    num_slots, rank, hidden = 8, 8, 64
    slots = make_slot_per_token("uniform", 100, num_slots, True, gen)
    meta = K.build_sgmv_meta(slot_per_token=slots, device=device)
    parts = [make_lora(num_slots, rank, hidden, hidden, torch.float16, device, gen) for _ in range(3)]
    x = torch.randn(100, hidden, generator=gen).to(device, torch.float16)
    y0 = torch.randn(100, 3 * hidden, generator=gen).to(device, torch.float16)

    # Stacked A: x is read once for q, k and v; v_qkv[:, 8i:8i+8] is part i's projection.
    stacked_a = torch.cat([a for a, _, _ in parts], dim=1)
    v_qkv = torch.empty(100, 3 * rank, dtype=torch.float32, device=device)
    K.shrink(x, stacked_a, meta, v_qkv)
    fused = y0.clone()
    for i, (_, lora_b, scales) in enumerate(parts):
        K.expand(v_qkv[:, i * rank : (i + 1) * rank], lora_b, scales, meta, fused, y_offset=i * hidden)

    separate = y0.clone()
    for i, (lora_a, lora_b, scales) in enumerate(parts):
        K.lora_apply(x, separate, lora_a, lora_b, scales, meta, backend="torch", y_offset=i * hidden)
    assert_close(fused, separate, torch.float16)


def test_unknown_backend_is_refused(device):
    meta = K.build_sgmv_meta(slot_per_token=[0], device=device)
    x = torch.zeros(1, 4, device=device)
    with pytest.raises(AssertionError, match="backend"):
        K.shrink(x, torch.zeros(1, 16, 4, device=device), meta, torch.zeros(1, 16, device=device), backend="cuda")


def test_shape_mismatch_is_refused(device):
    meta = K.build_sgmv_meta(slot_per_token=[0, 0], device=device)
    x = torch.randn(2, 32, device=device)
    with pytest.raises(AssertionError, match="hidden size"):
        K.shrink(x, torch.randn(1, 16, 31, device=device), meta, torch.empty(2, 16, device=device))
    with pytest.raises(AssertionError, match="do not fit"):
        K.expand(
            torch.randn(2, 16, device=device),
            torch.randn(1, 8, 16, device=device),
            torch.ones(1, device=device),
            meta,
            torch.randn(2, 10, device=device),
            y_offset=4,
        )


@pytest.mark.parametrize("gelu", [False, True])
def test_row_lengths_skip_the_padding_and_nothing_else(device, gelu):
    """Tiles from each row's real length (the engine's lora_skip_padding): real tokens get the
    update (and the epilogue) exactly as with whole rows; padded tokens keep what y held."""
    gen = torch.Generator().manual_seed(33)
    rows, row_len, num_slots = 12, 24, 6
    slot_per_row = sorted(torch.randint(0, num_slots, (rows,), generator=gen).tolist())
    lens = torch.randint(1, row_len + 1, (rows,), generator=gen).tolist()
    lens[0] = row_len
    lora_a, lora_b, scales = make_lora(num_slots, 8, 64, 48, torch.bfloat16, device, gen)
    x = torch.randn(rows * row_len, 64, generator=gen).to(device, torch.bfloat16)
    y0 = torch.randn(rows * row_len, 48, generator=gen).to(device, torch.bfloat16)
    real = torch.tensor([k < n for n in lens for k in range(row_len)], device=device)
    for backend in K.BACKENDS:
        whole = K.build_sgmv_meta(slot_per_row=slot_per_row, row_len=row_len, device=device)
        skip = K.build_sgmv_meta(slot_per_row=slot_per_row, row_len=row_len, row_lens=lens, device=device)
        full = K.lora_apply(x, y0.clone(), lora_a, lora_b, scales, whole, backend=backend, gelu=gelu)
        part = K.lora_apply(x, y0.clone(), lora_a, lora_b, scales, skip, backend=backend, gelu=gelu)
        assert torch.equal(part[real], full[real]), backend
        assert torch.equal(part[~real], y0[~real]), backend
        assert not torch.equal(full[~real], y0[~real])  # the whole rows did change the padding
