"""relpos_bias (DeBERTa's mask + c2p + p2c in one pass) against the float32 gather reference,
and the reference against the eager formulation the encoder used before (two gathers over
[L, L] index tables, the p2c one transposed)."""

import pytest
import torch
from manylora.kernels import TOLERANCES, relpos_bias_ref
from manylora.kernels.relpos import relpos_bias


def _case(batch, heads, length, width, dtype, device, seed=0, strided=False):
    gen = torch.Generator().manual_seed(seed)
    if strided:  # the encoder's layout: one GEMM per head, [h, B, L, W] seen as [B, h, L, W]
        c2p = torch.randn(heads, batch, length, width, generator=gen).to(device, dtype).transpose(0, 1)
        p2c = torch.randn(heads, batch, length, width, generator=gen).to(device, dtype).transpose(0, 1)
    else:
        c2p = torch.randn(batch, heads, length, width, generator=gen).to(device, dtype)
        p2c = torch.randn(batch, heads, length, width, generator=gen).to(device, dtype)
    # relative index: monotone in j - i, clamped into the W rows (as log buckets are)
    rel = torch.arange(-(length - 1), length)
    rel_index = torch.clamp(rel // 2 + width // 2, 0, width - 1).to(torch.int32).to(device)
    mask = torch.rand(batch, length, generator=gen) < 0.2
    key_bias = (mask.float() * torch.finfo(dtype).min).to(device)
    return c2p, p2c, rel_index, key_bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "batch,heads,length,width,strided",
    [(2, 3, 16, 31, False), (3, 2, 37, 20, True), (1, 4, 70, 139, False), (2, 1, 5, 9, True)],
)
def test_matches_reference(device, dtype, batch, heads, length, width, strided):
    c2p, p2c, rel_index, key_bias = _case(batch, heads, length, width, dtype, device, strided=strided)
    scale = 0.125
    got = relpos_bias(c2p, p2c, rel_index, key_bias, scale, dtype).float()
    want = relpos_bias_ref(c2p, p2c, rel_index, key_bias, scale, torch.float32)
    atol, rtol = TOLERANCES[dtype]
    finite = torch.isfinite(want) & (want > torch.finfo(dtype).min / 2)
    torch.testing.assert_close(got[finite], want[finite], atol=atol, rtol=rtol)
    # masked keys stay (at least) as negative as the mask
    assert bool((got[~finite] <= torch.finfo(dtype).min / 2).all())


@pytest.mark.parametrize("which", ["c2p", "p2c"])
def test_one_term_only(device, which):
    c2p, p2c, rel_index, key_bias = _case(2, 2, 24, 47, torch.float32, device, seed=3)
    args = (c2p, None) if which == "c2p" else (None, p2c)
    got = relpos_bias(*args, rel_index, key_bias, 0.5, torch.float32)
    want = relpos_bias_ref(*args, rel_index, key_bias, 0.5, torch.float32)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_reference_equals_eager_gathers():
    """The reference equals what DeBERTa computes: c2p gathered by idx[i, j], p2c gathered by
    idx[j, i] and transposed, when idx depends on i - j only (the encoder's tables)."""
    c2p, p2c, rel_index, key_bias = _case(2, 3, 19, 25, torch.float32, "cpu", seed=5)
    length = 19
    pos = torch.arange(length)
    c2p_index = rel_index.long()[pos[None, :] - pos[:, None] + length - 1]  # [i, j]
    p2c_index = rel_index.long()[pos[:, None] - pos[None, :] + length - 1]  # [j, i] -> same rel(i, j)
    eager = torch.gather(c2p, -1, c2p_index.expand(2, 3, length, length))
    eager = eager + torch.gather(p2c, -1, p2c_index.expand(2, 3, length, length)).transpose(-1, -2)
    want = eager * 0.3 + key_bias.view(2, 1, 1, length)
    got = relpos_bias_ref(c2p, p2c, rel_index, key_bias, 0.3, torch.float32)
    torch.testing.assert_close(got, want)
