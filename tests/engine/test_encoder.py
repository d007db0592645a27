"""Our encoder against transformers' DebertaV2Model (the reference), fp32, within 1e-5,
with the attention bias built by the torch gathers and by the Triton kernel (run by the
interpreter on CPU: tests/conftest.py sets TRITON_INTERPRET=1 there)."""

import pytest
import torch
from transformers import DebertaV2Config, DebertaV2Model

from manylora.encoder import Encoder, EncoderGeometry


def _config(**overrides):
    kw = dict(
        vocab_size=300,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=512,
        relative_attention=True,
        position_buckets=256,
        max_relative_positions=-1,
        pos_att_type=["p2c", "c2p"],
        share_att_key=True,
        norm_rel_ebd="layer_norm",
        position_biased_input=False,
        type_vocab_size=0,
        hidden_act="gelu",
    )
    kw.update(overrides)
    return DebertaV2Config(**kw)


def _reference_and_ours(config, seed=0):
    torch.manual_seed(seed)
    ref = DebertaV2Model(config).eval()
    # random (not default-initialised) layer norms and biases so every term matters
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return ref, Encoder(ref).eval()


@pytest.mark.parametrize("lengths", [[7], [5, 12, 3], [140, 60]])
@pytest.mark.parametrize("pos_att", [["p2c", "c2p"], ["c2p"]])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_hidden_states_match_transformers(lengths, pos_att, backend):
    ref, ours = _reference_and_ours(_config(pos_att_type=pos_att))
    ours.backend = backend
    width = max(lengths)
    ids = torch.randint(1, 300, (len(lengths), width))
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    ids = ids * mask
    with torch.no_grad():
        expected = ref(input_ids=ids, attention_mask=mask).last_hidden_state
    got = ours(ids, mask)
    for row, n in enumerate(lengths):
        torch.testing.assert_close(got[row, :n], expected[row, :n], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_long_sequence_uses_log_buckets(backend):
    # beyond position_buckets / 2 the relative positions are log-bucketed
    ref, ours = _reference_and_ours(_config(position_buckets=16, max_position_embeddings=64))
    ours.backend = backend
    ids = torch.randint(1, 300, (2, 50))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        expected = ref(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(ours(ids, mask), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "option,value",
    [
        ("share_att_key", False),
        ("position_biased_input", True),
        ("type_vocab_size", 2),
        ("relative_attention", False),
    ],
)
def test_unsupported_geometry_is_refused_by_name(option, value):
    with pytest.raises(ValueError, match=option):
        EncoderGeometry.from_config(_config(**{option: value}))
