"""Encoder states -> the token states GLiNER2's heads read.

``encode_padded``: GLiNER2's ``encode_tokens`` takes per-row states and pads them again (a
copy per row); the engine already has them padded, so this masks the padding in one
operation (GLiNER2 zero-fills it; the values read downstream are the same). Decoding itself
is ``manylora.post``'s.
"""

from __future__ import annotations

import torch


def encode_padded(batch, hidden_states: torch.Tensor) -> torch.Tensor:
    """GLiNER2's ``encode_tokens(batch, hidden_states)`` for states already padded.

    ``hidden_states`` is the engine's [B, L', H] encoder output with L' >= the batch's
    padded length L; returns [B, L, H] with the padding zeroed, as GLiNER2's re-padding does.
    """
    mask = batch.attention_mask
    hidden = hidden_states[:, : mask.shape[1]]
    return hidden * mask.unsqueeze(-1).to(hidden.dtype)
