"""Encoder states -> the token states GLiNER2's heads read.

``device_tensor`` / ``device_lists`` / ``host_to_device`` / ``batch_to_device``: host data to the GPU without a
stream sync each. ``encode_padded``: GLiNER2's ``encode_tokens`` takes per-row states and pads them again (a
copy per row); the engine already has them padded, so this masks the padding in one
operation (GLiNER2 zero-fills it; the values read downstream are the same). Decoding itself
is ``manylora.post``'s.
"""

from __future__ import annotations

from itertools import chain
from typing import Sequence

import torch


def encode_padded(batch, hidden_states: torch.Tensor) -> torch.Tensor:
    """GLiNER2's ``encode_tokens(batch, hidden_states)`` for states already padded.

    ``hidden_states`` is the engine's [B, L', H] encoder output with L' >= the batch's
    padded length L; returns [B, L, H] with the padding zeroed, as GLiNER2's re-padding does.
    Filled, not multiplied by the mask: with ``lora_skip_padding`` a padded token may hold any
    value, NaN included, and NaN x 0 is NaN.
    """
    mask = batch.attention_mask
    hidden = hidden_states[:, : mask.shape[1]]
    return hidden.masked_fill(~mask.bool().unsqueeze(-1), 0)


def device_tensor(values, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A small host list as a tensor on ``device``, without a stream sync: through pinned memory
    and an asynchronous copy on CUDA (a plain ``torch.tensor(..., device=cuda)`` waits for the
    GPU to drain the stream, serialising the host with the kernels already queued)."""
    return host_to_device(torch.tensor(values, dtype=dtype), device)


def device_lists(lists: Sequence[Sequence[int]], device: torch.device) -> list[torch.Tensor]:
    """Several small host lists of ints as int64 tensors on ``device`` through one copy: views
    of one tensor, in order (``device_tensor`` costs three operations and a copy per list)."""
    flat = torch.tensor(list(chain.from_iterable(lists)), dtype=torch.int64)
    return list(host_to_device(flat, device).split([len(values) for values in lists]))


def host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without a stream sync (see ``device_tensor``): PyTorch's
    caching host allocator keeps the pinned copy until the transfer is done."""
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def batch_to_device(batch, device: torch.device):
    """GLiNER2's ``PreprocessedBatch.to(device)`` (its tensors are all integer or boolean)
    without its stream sync per tensor."""
    import dataclasses

    moved = {
        f.name: host_to_device(value, device)
        for f in dataclasses.fields(batch)
        if isinstance(value := getattr(batch, f.name), torch.Tensor)
    }
    out = dataclasses.replace(batch, **moved)
    out.host = batch  # the host tensors too (the heads' CUDA graphs index words from the host)
    return out
