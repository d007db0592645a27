"""Decoding replacements return exactly what GLiNER2's own methods return."""

import pytest
import torch

from manylora.decode import find_spans


@pytest.mark.parametrize("seed", range(20))
def test_find_spans_equals_gliner2(reference_model, seed):
    generator = torch.Generator().manual_seed(seed)
    words = ["Alpha", "beta", " ", "Gamma-1", "(x)", "delta", "e", "", "Zeta"] * 3
    text, start_map, end_map = _text_maps(words)
    length = len(words) - (seed % 4)  # also shorter than the map
    scores = torch.rand(length + 2, 8, generator=generator)
    threshold = [0.0, 0.5, 0.9, 1.0][seed % 4]
    expected = type(reference_model)._find_spans(reference_model, scores, threshold, length, text, start_map, end_map)
    assert find_spans(scores, threshold, length, text, start_map, end_map) == expected


def _text_maps(words):
    text, start_map, end_map = "", [], []
    for word in words:
        start_map.append(len(text))
        text += word
        end_map.append(len(text))
        text += " "
    return text, start_map, end_map


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(6))
def test_span_finder_on_views_of_one_packed_tensor(reference_model, dtype, seed):
    """As GLiNER2's GPU decoding calls it: views [text_len, W] of one packed host tensor
    (per request and label), several thresholds, sliced rows (``[:, -text_len:]``)."""
    from manylora.decode import SpanFinder

    generator = torch.Generator().manual_seed(seed)
    words = ["Alpha", "beta", " ", "Gamma-1", "(x)", "delta", "e", "", "Zeta", "eta"] * 2
    text, start_map, end_map = _text_maps(words)
    finder = SpanFinder()
    pieces, views = [], []
    for request in range(5):
        count, labels, length, width = 1 + request % 2, 3, len(words) - request, 6
        pieces.append(torch.rand(count, labels, length + 3, width, generator=generator).to(dtype))
    offsets, packed = [], torch.cat([p.reshape(-1) for p in pieces])
    start = 0
    for p in pieces:
        offsets.append(packed[start : start + p.numel()].reshape(p.shape))
        start += p.numel()
    for request, span_scores in enumerate(offsets):
        length = len(words) - request
        scores = span_scores[0, :, -length:]
        for label in range(scores.shape[0]):
            views.append((scores[label], length))
    for threshold in (0.3, 0.5, 0.9):
        for view, length in views:
            expected = type(reference_model)._find_spans(
                reference_model, view, threshold, length, text, start_map, end_map
            )
            assert finder(view, threshold, length, text, start_map, end_map) == expected
    finder.clear()


def test_span_finder_falls_back_on_other_layouts(reference_model):
    from manylora.decode import SpanFinder

    text, start_map, end_map = _text_maps(["a", "bb", "ccc", "dd", "e"])
    finder = SpanFinder()
    base = torch.rand(8, 5, generator=torch.Generator().manual_seed(1))
    row = torch.rand(1, 6, generator=torch.Generator().manual_seed(2))
    views = (base.t()[:5], base[::2], base[:, 1:4], torch.rand(0, 3), row.expand(3, 6), row, base.t()[:1])
    for view in views:
        expected = type(reference_model)._find_spans(reference_model, view, 0.4, 5, text, start_map, end_map)
        assert finder(view, 0.4, 5, text, start_map, end_map) == expected


def test_encode_padded_equals_gliner2_padding(reference_model):
    from types import SimpleNamespace

    from manylora.decode import encode_padded

    lengths = [5, 2, 7]
    mask = torch.zeros(3, 7, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    hidden = torch.randn(3, 16, reference_model.hidden_size)  # the engine pads to 16
    batch = SimpleNamespace(attention_mask=mask)
    per_row = [hidden[row, :n] for row, n in enumerate(lengths)]
    expected = type(reference_model).encode_tokens(reference_model, batch, per_row)
    assert torch.equal(encode_padded(batch, hidden), expected)
