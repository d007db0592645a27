"""span_scores (GLiNER2's span logits without the span tensor) against the float32 reference, and
against GLiNER2's own ``SpanMarkerV0.score_queries`` through ``fused_span_scores``: in float32,
and in bfloat16 where the kernel must round its sums as GLiNER2's separate ops do."""

import pytest
import torch
from manylora.kernels import TOLERANCES, span_scores, span_scores_ref

from manylora.lora.heads import fusable_span_layer, fused_span_scores


def _case(batch, length, k_dim, num_q, dtype, device, seed=0, biases=True, strided=False):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    if strided:  # halves of one wider tensor, as views with a row stride above K
        both = rand(batch, length, 2 * k_dim + 8)
        start, end = both[..., :k_dim], both[..., k_dim + 8 :]
    else:
        start, end = rand(batch, length, k_dim), rand(batch, length, k_dim)
    queries = rand(batch, num_q, k_dim) / k_dim**0.5
    bias = rand(k_dim) if biases else None
    query_bias = rand(batch, num_q) if biases else None
    lengths = torch.randint(1, length + 1, (batch,), generator=gen).to(device)
    lengths[0] = length
    return start, end, bias, queries, query_bias, lengths


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "batch,length,k_dim,num_q,width,strided",
    [(2, 7, 40, 3, 4, False), (3, 13, 96, 20, 12, True), (1, 5, 64, 70, 12, False), (2, 1, 16, 1, 12, False)],
)
def test_matches_reference(device, dtype, batch, length, k_dim, num_q, width, strided):
    args = _case(batch, length, k_dim, num_q, dtype, device, strided=strided)
    got = span_scores(*args, width)
    want = span_scores_ref(*args, width)
    assert got.shape == (batch, num_q, length, width) and got.dtype == dtype
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite), "the -inf spans differ"
    atol, rtol = TOLERANCES[dtype]
    # 16-bit sums are rounded before the ReLU, as GLiNER2 rounds them: allow one more rounding step
    scale = 1.0 if dtype == torch.float32 else 2.0
    torch.testing.assert_close(got.float()[finite], want[finite], atol=atol * scale, rtol=rtol * scale)
    assert bool((got[~finite] == float("-inf")).all())


def test_without_biases(device):
    args = _case(2, 9, 48, 5, torch.float32, device, seed=4, biases=False)
    torch.testing.assert_close(span_scores(*args, 6), span_scores_ref(*args, 6), atol=1e-4, rtol=1e-4)


def test_reference_is_the_direct_formula():
    """One span by hand: relu(start[l] + end[l + w] + c) · q + g; -inf past the row's words."""
    start, end, bias, queries, query_bias, lengths = _case(2, 6, 8, 3, torch.float32, "cpu", seed=2)
    lengths[1] = 4
    ref = span_scores_ref(start, end, bias, queries, query_bias, lengths, 3)
    b, q, lo, w = 1, 2, 1, 2
    want = (start[b, lo] + end[b, lo + w] + bias).relu() @ queries[b, q] + query_bias[b, q]
    torch.testing.assert_close(ref[b, q, lo, w], want)
    assert ref[1, 0, 2, 2] == float("-inf") and ref[1, 0, 2, 1] > float("-inf")  # 2 + 2 >= 4 words
    assert ref[0, 0, 5, 1] == float("-inf")  # past L itself


def _span_layer(hidden: int, max_width: int, seed: int):
    from gliner2.layers import SpanMarkerV0

    torch.manual_seed(seed)
    layer = SpanMarkerV0(hidden, max_width, dropout=0.1).eval()
    with torch.no_grad():  # biases away from zero: the ReLUs cut at different places
        for module in layer.modules():
            if isinstance(module, torch.nn.Linear):
                module.bias.normal_(0.0, 0.5)
    return layer


def _gliner2_case(dtype, device, batch=3, length=11, hidden=32, num_q=4, max_width=5, seed=0):
    layer = _span_layer(hidden, max_width, seed).to(device, dtype)
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(batch, length, hidden, generator=gen).to(device, dtype)
    queries = torch.randn(batch, num_q, hidden, generator=gen).to(device, dtype)
    lengths = torch.tensor([length, 7, 3][:batch], device=device)
    return layer, h, queries, lengths


def test_fusable_span_layer_checks_the_form():
    class Model(torch.nn.Module):
        pass

    model = Model()
    model.span_rep = torch.nn.Module()
    model.span_rep.span_rep_layer = _span_layer(16, 4, 0)
    assert fusable_span_layer(model) is model.span_rep.span_rep_layer
    model.span_rep.span_rep_layer.train()
    assert fusable_span_layer(model) is None  # dropout would act
    model.span_rep.span_rep_layer.eval()
    model.span_rep.span_rep_layer.out_project = torch.nn.Sequential(torch.nn.Linear(32, 16))
    assert fusable_span_layer(model) is None


@torch.no_grad()
def test_equals_gliner2_score_queries_float32(device):
    layer, h, queries, lengths = _gliner2_case(torch.float32, device)
    want = layer.score_queries(h, queries, lengths, mask_invalid=True)
    got = fused_span_scores(layer, h, queries, lengths)
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_equals_gliner2_score_queries_bfloat16(device):
    """In bfloat16, GLiNER2 rounds start + end, then + bias, before the ReLU, and its batched GEMM
    rounds each logit once: the kernel rounds the same sums. On the CPU (the interpreter, whose dot
    accumulates in float32 in order) the logits are GLiNER2's bit for bit; on a GPU only the dot's
    summation order differs."""
    layer, h, queries, lengths = _gliner2_case(torch.bfloat16, device, hidden=64, seed=3)
    want = layer.score_queries(h, queries, lengths, mask_invalid=True)
    got = fused_span_scores(layer, h, queries, lengths)
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite)
    if device == "cpu":
        assert torch.equal(got, want)
    else:
        scale = want[finite].abs().max().item()
        torch.testing.assert_close(got[finite].float(), want[finite].float(), atol=scale * 2.0**-7, rtol=0)
    # without those roundings the logits are not GLiNER2's: the test can tell them apart
    first, final = layer.out_project[0], layer.out_project[3]
    start = torch.nn.functional.linear(layer.project_start(h).relu(), first.weight[:, :64])
    end = torch.nn.functional.linear(layer.project_end(h).relu(), first.weight[:, 64:])
    folded, bias = torch.matmul(queries, final.weight), torch.matmul(queries, final.bias)
    unrounded = span_scores_ref(start, end, first.bias, folded, bias, lengths, layer.max_width).to(torch.bfloat16)
    assert not torch.equal(unrounded[finite], want[finite])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_load_time_check_passes_and_catches_a_wrong_kernel(device, dtype, monkeypatch):
    from manylora import kernels
    from manylora.lora.heads import check_span_kernel

    class Model(torch.nn.Module):
        pass

    model = Model()
    model.span_rep = torch.nn.Module()
    model.span_rep.span_rep_layer = _span_layer(32, 6, 1).to(device, dtype)
    assert check_span_kernel(model) == ""
    kernel = kernels.span_scores
    monkeypatch.setattr(kernels, "span_scores", lambda *a: kernel(*a) * 1.05)
    assert "differ from GLiNER2's by up to" in check_span_kernel(model)
    monkeypatch.setattr(kernels, "span_scores", lambda *a: kernel(*a).nan_to_num(neginf=0.0))
    assert "masked spans differ" in check_span_kernel(model)

    def second_tile_wrong(*a):  # right for up to 64 queries: the check's second shape has 70
        out = kernel(*a)
        out[:, 64:] *= 1.5
        return out

    monkeypatch.setattr(kernels, "span_scores", second_tile_wrong)
    assert "differ from GLiNER2's by up to" in check_span_kernel(model)

    def broken(*a):
        raise RuntimeError("out of resources")

    monkeypatch.setattr(kernels, "span_scores", broken)
    assert check_span_kernel(model) == "the span kernel failed: RuntimeError: out of resources"
    model.span_rep.span_rep_layer.train()
    assert "not GLiNER2's SpanMarkerV0 form" in check_span_kernel(model)
