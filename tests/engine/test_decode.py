"""Decoding replacements return exactly what GLiNER2's own methods return."""

import pytest
import torch

from manylora.decode import find_spans


@pytest.mark.parametrize("seed", range(20))
def test_find_spans_equals_gliner2(reference_model, seed):
    generator = torch.Generator().manual_seed(seed)
    words = ["Alpha", "beta", " ", "Gamma-1", "(x)", "delta", "e", "", "Zeta"] * 3
    text, start_map, end_map = "", [], []
    for word in words:
        start_map.append(len(text))
        text += word
        end_map.append(len(text))
        text += " "
    length = len(words) - (seed % 4)  # also shorter than the map
    scores = torch.rand(length + 2, 8, generator=generator)
    threshold = [0.0, 0.5, 0.9, 1.0][seed % 4]
    expected = type(reference_model)._find_spans(reference_model, scores, threshold, length, text, start_map, end_map)
    assert find_spans(scores, threshold, length, text, start_map, end_map) == expected
