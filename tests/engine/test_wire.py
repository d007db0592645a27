"""manylora.wire: the GPU stage's packed rows (post.pack_compact_rows) come back exactly as packed."""

import numpy as np
import pytest
import torch

from manylora import wire
from manylora.post import CompactRow, pack_compact_rows


def _rows():
    """Failed rows, rows without hits, attribute-logit lines, views of one array, two dtypes."""
    rng = np.random.default_rng(5)
    flat_hits = rng.integers(0, 40, size=(9, 5)).astype(np.int32)  # rows' hits: views of one array
    rows = []
    for k in range(6):
        if k == 3:
            rows.append(None)
            continue
        hits = flat_hits[k : k + k % 3]
        rows.append(
            CompactRow(
                counts=np.array([k, -1, 0][: k % 3 + 1], dtype=np.int32),
                cls_sizes=np.zeros(k % 3 + 1, dtype=np.int32),
                cls_probs=rng.random(k % 2 * 3).astype(np.float32),
                hits=hits,
                scores=rng.random(len(hits)).astype(np.float32),
                hit_logits=rng.random((len(hits), 2)).astype(np.float32) if k == 4 else np.zeros((0, 0), np.float32),
                grid=np.array([k, 12] if len(hits) else [0, 0], dtype=np.int32),
                dtype=torch.bfloat16 if k % 2 else torch.float32,
            )
        )
    return rows


@pytest.mark.parametrize("take", [slice(None), slice(0, 1), slice(3, 4), slice(0, 0)])
def test_compact_rows_round_trip(take):
    """Every row's arrays come back with their dtypes, shapes and values; failed rows as None."""
    rows = _rows()[take]
    back = wire.unpack_rows(pack_compact_rows(rows))
    assert [r is None for r in back] == [r is None for r in rows]
    for got, want in zip(back, rows):
        if want is None:
            continue
        expected = want.to_arrays()
        assert list(got) == list(expected)
        for name, array in expected.items():
            assert got[name].dtype == array.dtype and got[name].shape == array.shape, name
            assert np.array_equal(got[name], array), name
        row = CompactRow.from_arrays(got)
        assert row.dtype == want.dtype and row.hit_logits.shape == np.asarray(want.hit_logits).shape


def test_unpack_refuses_a_truncated_buffer():
    data = pack_compact_rows(_rows())
    with pytest.raises(ValueError):
        wire.unpack_rows(data[:-3])
