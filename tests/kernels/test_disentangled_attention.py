"""disentangled_attention (kernels/disattn.py: DeBERTa's scores, relative-position bias, softmax
and values in one kernel) against the float32 reference (relpos_bias_ref + softmax), and against
the encoder's eager path (relpos.py's bias, then scaled_dot_product_attention) in the serving
dtypes: on real query positions, with padded rows and keys, and rows without any real token."""

import pytest
import torch
import torch.nn.functional as F
from manylora.kernels import TOLERANCES, disentangled_attention_ref, key_lengths
from manylora.kernels.disattn import disentangled_attention
from manylora.kernels.relpos import relpos_bias


def _case(batch, heads, length, head_dim, width, dtype, device, lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = heads * head_dim

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    q, k, v = randn(batch * length, hidden), randn(batch * length, hidden), randn(batch * length, hidden)
    # the encoder's layout: one GEMM per head, [h, B, L, W] seen as [B, h, L, W]
    c2p = randn(heads, batch, length, width).transpose(0, 1)
    p2c = randn(heads, batch, length, width).transpose(0, 1)
    rel = torch.arange(-(length - 1), length)
    rel_index = torch.clamp(rel // 2 + width // 2, 0, width - 1).to(torch.int32).to(device)
    mask = (torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]).long().to(device)
    key_bias = (1.0 - mask.float()) * torch.finfo(dtype).min
    return q, k, v, c2p, p2c, rel_index, mask, key_bias


def _real(out: torch.Tensor, lengths, length: int) -> torch.Tensor:
    """The rows of real query positions (each batch row's first lengths[b] tokens)."""
    keep = torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]
    return out[keep.reshape(-1).to(out.device)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "batch,heads,length,head_dim,width,lengths",
    [
        (2, 2, 16, 16, 31, [16, 9]),
        (3, 2, 70, 32, 40, [70, 1, 65]),  # two key tiles, a row of one token
        (2, 1, 130, 16, 64, [130, 60]),  # three query tiles, one of them past the second row's tokens
    ],
)
def test_matches_reference(device, dtype, batch, heads, length, head_dim, width, lengths):
    q, k, v, c2p, p2c, rel_index, mask, key_bias = _case(batch, heads, length, head_dim, width, dtype, device, lengths)
    scale = 1.0 / (3 * head_dim) ** 0.5
    got = disentangled_attention(q, k, v, c2p, p2c, rel_index, key_bias, key_lengths(mask), scale, batch, length, heads)
    want = disentangled_attention_ref(q, k, v, c2p, p2c, rel_index, key_bias, scale, batch, length, heads)
    assert got.shape == q.shape and got.dtype == dtype
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(_real(got.float(), lengths, length), _real(want, lengths, length), atol=atol, rtol=rtol)
    assert bool(torch.isfinite(got.float()).all())


@pytest.mark.parametrize("which", ["c2p", "p2c", "none"])
def test_one_term_or_none(device, which):
    lengths = [24, 11]
    q, k, v, c2p, p2c, rel_index, mask, key_bias = _case(2, 2, 24, 16, 47, torch.float32, device, lengths, seed=3)
    terms = {"c2p": (c2p, None), "p2c": (None, p2c), "none": (None, None)}[which]
    got = disentangled_attention(q, k, v, *terms, rel_index, key_bias, key_lengths(mask), 0.2, 2, 24, 2)
    want = disentangled_attention_ref(q, k, v, *terms, rel_index, key_bias, 0.2, 2, 24, 2)
    torch.testing.assert_close(_real(got, lengths, 24), _real(want, lengths, 24), atol=1e-5, rtol=1e-5)


def test_rows_without_tokens_are_zero_and_key_lengths_ignore_gaps(device):
    """A row with no real token (a CUDA graph's padding row) gets zeros, not NaN. key_lengths is
    1 + the last real position, so a mask with a gap still has its masked keys in range (the
    kernel applies the key bias inside that range)."""
    lengths = [0, 20]
    q, k, v, c2p, p2c, rel_index, mask, key_bias = _case(2, 2, 20, 16, 39, torch.float32, device, lengths, seed=7)
    mask[1, 5] = 0  # a gap inside the second row
    key_bias = (1.0 - mask.float()) * torch.finfo(torch.float32).min
    kv_len = key_lengths(mask)
    assert kv_len.tolist() == [0, 20]
    got = disentangled_attention(q, k, v, c2p, p2c, rel_index, key_bias, kv_len, 0.3, 2, 20, 2)
    want = disentangled_attention_ref(q, k, v, c2p, p2c, rel_index, key_bias, 0.3, 2, 20, 2)
    assert bool((got[:20] == 0).all())
    torch.testing.assert_close(got[20:], want[20:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_the_eager_path_in_the_serving_dtype(device, dtype):
    """Against what the encoder runs without the kernel: relpos.py's bias stored in the serving
    dtype, then scaled_dot_product_attention. The kernel rounds the position term the same way,
    so the two differ by the attention's own summation order and its rounding of p."""
    batch, heads, length, head_dim, lengths = 3, 2, 40, 32, [40, 17, 33]
    q, k, v, c2p, p2c, rel_index, mask, key_bias = _case(batch, heads, length, head_dim, 41, dtype, device, lengths, 11)
    scale = 1.0 / (3 * head_dim) ** 0.5
    got = disentangled_attention(q, k, v, c2p, p2c, rel_index, key_bias, key_lengths(mask), scale, batch, length, heads)
    bias = relpos_bias(c2p, p2c, rel_index, key_bias, scale, dtype)

    def split(t):
        return t.view(batch, length, heads, head_dim).transpose(1, 2)

    eager = F.scaled_dot_product_attention(split(q), split(k), split(v), attn_mask=bias, scale=scale)
    eager = eager.transpose(1, 2).reshape(batch * length, heads * head_dim)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(
        _real(got, lengths, length).float(), _real(eager, lengths, length).float(), atol=atol, rtol=rtol
    )


def test_padding_query_tiles_are_zero_and_a_masked_first_tile_stays_finite(device):
    """Query tiles that start past a row's last real token are written as 0 (the row's real
    positions still match the reference). In float16 a key bias of finfo.min plus a negative
    position term rounds to -inf: a first key tile masked entirely (a mask that is not a
    prefix) must not turn the row's sums into NaN."""
    dtype = torch.float16
    lengths = [130, 60]
    q, k, v, c2p, p2c, rel_index, mask, key_bias = _case(2, 1, 130, 16, 64, dtype, device, lengths, seed=13)
    c2p, p2c = c2p * 0 - 400, p2c * 0 - 400  # a position term far below 0: -inf biases in float16
    mask[0, :64] = 0  # the first row's first key tile: masked keys only
    key_bias = (1.0 - mask.float()) * torch.finfo(dtype).min
    scale = 0.25
    got = disentangled_attention(q, k, v, c2p, p2c, rel_index, key_bias, key_lengths(mask), scale, 2, 130, 1)
    want = disentangled_attention_ref(q, k, v, c2p, p2c, rel_index, key_bias, scale, 2, 130, 1)
    assert bool(torch.isfinite(got.float()).all())
    second = got[130:].float()
    assert bool((second[64:] == 0).all()), "tiles from position 64 on start past the second row's 60 tokens"
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(second[:60], want[130:190], atol=atol, rtol=rtol)
    torch.testing.assert_close(got[:130].float(), want[:130], atol=atol, rtol=rtol)


@pytest.mark.parametrize(
    "launch",
    [
        {"block_m": 64, "block_n": 32},
        {"block_m": 128, "block_n": 32, "num_warps": 8},
        {"block_m": 32, "block_n": 64, "num_stages": 3},
    ],
    ids=["64x32", "128x32-w8", "32x64-s3"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_launch_variants_match_the_reference(device, dtype, launch):
    """The launch settings bench_attention.py sweeps (tiles, warps, stages) change no answer
    beyond the dtype's tolerance."""
    batch, heads, length, head_dim, width, lengths = 3, 2, 70, 32, 40, [70, 1, 65]
    q, k, v, c2p, p2c, rel_index, mask, key_bias = _case(batch, heads, length, head_dim, width, dtype, device, lengths)
    scale = 1.0 / (3 * head_dim) ** 0.5
    kv_len = key_lengths(mask)
    got = disentangled_attention(q, k, v, c2p, p2c, rel_index, key_bias, kv_len, scale, batch, length, heads, **launch)
    want = disentangled_attention_ref(q, k, v, c2p, p2c, rel_index, key_bias, scale, batch, length, heads)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(_real(got.float(), lengths, length), _real(want, lengths, length), atol=atol, rtol=rtol)
    assert bool(torch.isfinite(got.float()).all())
