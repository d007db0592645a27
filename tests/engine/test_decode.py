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
    # padding that holds NaN or inf (lora_skip_padding leaves it as it is): still zeros
    poisoned = hidden.clone()
    for row, n in enumerate(lengths):
        poisoned[row, n:] = float("nan") if row % 2 else float("inf")
    assert torch.equal(encode_padded(batch, poisoned), expected)


def test_device_lists_are_the_lists_in_order_through_one_copy():
    """manylora.decode.device_lists: each list as an int64 tensor with its values, empty ones
    included, all views of one tensor (one host-to-device copy for all of them)."""
    from manylora.decode import device_lists

    lists = [[3, 1, 4], [], [1], [5, 9, 2, 6], []]
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    out = device_lists(lists, device)
    assert [t.tolist() for t in out] == lists
    assert all(t.dtype == torch.int64 and t.device.type == torch.device(device).type for t in out)
    base = out[0].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == base for t in out)
