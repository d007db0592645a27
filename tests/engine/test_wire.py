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


def test_compact_rows_pack_byte_for_byte_as_their_arrays_do():
    """post.pack_compact_rows (the GPU stage's answer) is pack_rows of the rows' to_arrays(), to
    the byte: failed rows, rows without hits, attribute-logit lines, views, two dtypes."""
    import torch

    from manylora.post import CompactRow, pack_compact_rows

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
    for chosen in (rows, rows[:1], [None], []):
        want = wire.pack_rows([None if r is None else r.to_arrays() for r in chosen])
        assert pack_compact_rows(chosen) == want
    back = wire.unpack_rows(pack_compact_rows(rows))
    assert CompactRow.from_arrays(back[4]).hit_logits.shape == (1, 2) and back[3] is None
