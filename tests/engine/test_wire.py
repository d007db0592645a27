"""manylora.wire: the GPU stage's packed rows come back exactly as packed."""

import numpy as np
import pytest

from manylora import wire


def _rows():
    rng = np.random.default_rng(3)
    rows = []
    for k in range(7):
        if k == 2:
            rows.append(None)  # a failed row
            continue
        hits = rng.integers(0, 50, size=(k, 5)).astype(np.int32)
        rows.append(
            {
                "counts": np.arange(k % 3 + 1, dtype=np.int32),
                "hits": hits if k != 4 else hits[::-1],  # not contiguous
                "scores": rng.random(k).astype(np.float32),
                "hit_logits": rng.random((k, 2)).astype(np.float32) if k % 2 else np.zeros((0, 0), np.float32),
                "dtype": np.array([1], dtype=np.int8),
            }
        )
    return rows


def test_pack_rows_round_trip():
    rows = _rows()
    back = wire.unpack_rows(wire.pack_rows(rows))
    assert [r is None for r in back] == [r is None for r in rows]
    for got, want in zip(back, rows):
        if want is None:
            continue
        assert list(got) == list(want)
        for name in want:
            assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
            assert np.array_equal(got[name], want[name]), name


def test_pack_rows_with_rows_of_different_ranks():
    rows = [{"a": np.arange(3, dtype=np.int32)}, {"a": np.arange(4, dtype=np.int32).reshape(2, 2)}]
    back = wire.unpack_rows(wire.pack_rows(rows))
    assert back[0]["a"].reshape(-1).tolist() == [0, 1, 2] and back[1]["a"].tolist() == [[0, 1], [2, 3]]


def test_unpack_refuses_a_truncated_buffer():
    data = wire.pack_rows(_rows())
    with pytest.raises(ValueError):
        wire.unpack_rows(data[:-3])
