"""encode_padded returns exactly the token states GLiNER2's own encode_tokens builds."""

import torch


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
