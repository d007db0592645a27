"""Faster equivalents of GLiNER2 decoding steps, bound onto the served GLiNER2 instance.

Each replacement returns exactly what the GLiNER2 method returns (tests compare them on
random inputs); only the way values leave the tensors changes:

* ``find_spans``: GLiNER2's ``_find_spans`` with one ``tolist()`` per call instead of an
  ``.item()`` per candidate.
* ``SpanFinder``: the same answer, but the threshold test runs once per score storage and
  threshold instead of once per (request, label). GLiNER2's GPU decoding copies every
  span score of the batch to the host in one packed tensor and then calls ``_find_spans``
  on a view of it per request and label (5 labels x 256 requests = 1,280 calls, each a
  few tensor ops). The finder thresholds the whole packed storage once, keeps the sorted
  flat positions of the hits, and answers each view by bisecting its range.
* ``encode_padded``: GLiNER2's ``encode_tokens`` takes per-row states and pads them again
  (a copy per row); the engine already has them padded, so this masks the padding in one
  operation (GLiNER2 zero-fills it; the values read downstream are the same).
"""

from __future__ import annotations

from bisect import bisect_left

import torch


def _spans(starts, widths, confidences, text_len: int, text: str, start_map, end_map):
    spans = []
    for start, width, confidence in zip(starts, widths, confidences):
        end = start + width + 1
        if not (0 <= start < text_len and end <= text_len):
            continue
        try:
            char_start, char_end = start_map[start], end_map[end - 1]
        except (IndexError, KeyError):
            continue
        piece = text[char_start:char_end].strip()
        if piece:
            spans.append((piece, confidence, char_start, char_end))
    return spans


def find_spans(scores: torch.Tensor, threshold: float, text_len: int, text: str, start_map, end_map):
    """GLiNER2's ``_find_spans`` with one ``tolist()`` instead of an ``.item()`` per candidate.

    Returns ``(text, confidence, char_start, char_end)`` for every (start, width) whose score
    reaches ``threshold``, in row-major order, skipping spans past the text or empty after
    stripping.
    """
    starts, widths = torch.where(scores >= threshold)
    confidences = scores[starts, widths].tolist()
    return _spans(starts.tolist(), widths.tolist(), confidences, text_len, text, start_map, end_map)


class SpanFinder:
    """``find_spans`` answered from one threshold pass per (storage, dtype, threshold).

    Valid while the storages it has seen are not written to: the engine calls ``clear()``
    after every decoded chunk (score tensors are fresh per chunk and read-only while
    decoding). Views it cannot answer by bisection (not on the CPU, not 2-D, or rows not
    unit-stride) go through ``find_spans``.
    """

    def __init__(self):
        # key -> (storage, sorted flat hit positions, their values); the storage is held so
        # that its memory cannot be freed and reused by another tensor while cached
        self._hits: dict[tuple, tuple] = {}

    def clear(self) -> None:
        self._hits.clear()

    def _storage_hits(self, scores: torch.Tensor, threshold: float) -> tuple[list[int], list[float]]:
        storage = scores.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes(), scores.dtype, threshold)
        hits = self._hits.get(key)
        if hits is None:
            flat = torch.empty(0, dtype=scores.dtype).set_(storage, 0, (storage.nbytes() // scores.element_size(),))
            positions = torch.nonzero(flat >= threshold).flatten()
            hits = self._hits[key] = (storage, positions.tolist(), flat[positions].tolist())
        return hits[1], hits[2]

    def __call__(self, scores: torch.Tensor, threshold: float, text_len: int, text: str, start_map, end_map):
        if scores.device.type != "cpu" or scores.dim() != 2 or scores.stride(1) != 1 or scores.numel() == 0:
            return find_spans(scores, threshold, text_len, text, start_map, end_map)
        rows, width = scores.shape
        row_stride = scores.stride(0) if rows > 1 else width  # one row: its stride is never used
        if row_stride < width:  # overlapping or broadcast rows: not a plain 2-D view
            return find_spans(scores, threshold, text_len, text, start_map, end_map)
        positions, values = self._storage_hits(scores, threshold)
        first = scores.storage_offset()
        last = first + (rows - 1) * row_stride + width
        lo, hi = bisect_left(positions, first), bisect_left(positions, last)
        starts, widths, confidences = [], [], []
        for k in range(lo, hi):
            start, column = divmod(positions[k] - first, row_stride)
            if column < width:
                starts.append(start)
                widths.append(column)
                confidences.append(values[k])
        return _spans(starts, widths, confidences, text_len, text, start_map, end_map)


def encode_padded(batch, hidden_states: torch.Tensor) -> torch.Tensor:
    """GLiNER2's ``encode_tokens(batch, hidden_states)`` for states already padded.

    ``hidden_states`` is the engine's [B, L', H] encoder output with L' >= the batch's
    padded length L; returns [B, L, H] with the padding zeroed, as GLiNER2's re-padding does.
    """
    mask = batch.attention_mask
    hidden = hidden_states[:, : mask.shape[1]]
    return hidden * mask.unsqueeze(-1).to(hidden.dtype)


def bind_fast_decoding(model) -> SpanFinder:
    """Replace GLiNER2's span finder and token-state padding on this instance.

    Returns the span finder, whose cache the caller clears after every decoded batch.
    """
    finder = SpanFinder()
    model._find_spans = finder
    encode_tokens = model.encode_tokens

    def encode(batch, hidden_states=None):
        if isinstance(hidden_states, torch.Tensor):
            return encode_padded(batch, hidden_states)
        return encode_tokens(batch, hidden_states)

    model.encode_tokens = encode
    return finder
