"""SgmvMeta: the documented running example, per-row vs per-token input, tile invariants."""

import pytest
import torch
from manylora.kernels import BLOCK_M_CHOICES, SgmvMetaBuilder, build_sgmv_meta
from sgmv_cases import PATTERNS, make_slot_per_token


def used(tiles):
    n = int(tiles.num_tiles)
    return tiles.tile_slot[:n].tolist(), tiles.tile_start[:n].tolist(), tiles.tile_end[:n].tolist()


def test_running_example_of_the_docstring(device):
    meta = SgmvMetaBuilder(10, device, block_m_choices=(4,)).build(slot_per_token=[3, 3, 3, 3, 3, -1, -1, 0, 7, 7])
    assert meta.seg_starts.tolist() == [0, 5, 7, 8, 10]
    assert meta.seg_slots.tolist() == [3, -1, 0, 7]
    assert meta.num_segments.tolist() == [4]
    assert meta.segments() == [(0, 5, 3), (5, 7, -1), (7, 8, 0), (8, 10, 7)]
    tile_slot, tile_start, tile_end = used(meta.tiles(4))
    assert tile_slot == [3, 3, 0, 7]
    assert tile_start == [0, 4, 7, 8]
    assert tile_end == [4, 5, 8, 10]
    assert meta.segments_bound == 4
    assert meta.tiles(4).packed[:13].tolist() == [4, 3, 0, 4, 3, 4, 5, 0, 7, 8, 7, 8, 10]


def test_rows_and_tokens_agree(device):
    rows = [2, 2, -1, 5, 5, 5, 0]
    by_row = build_sgmv_meta(slot_per_row=rows, row_len=9, device=device)
    by_token = build_sgmv_meta(slot_per_token=[s for s in rows for _ in range(9)], device=device)
    assert by_row.num_tokens == by_token.num_tokens == 63
    assert by_row.segments() == by_token.segments() == [(0, 18, 2), (18, 27, -1), (27, 54, 5), (54, 63, 0)]
    for bm in BLOCK_M_CHOICES:
        assert used(by_row.tiles(bm)) == used(by_token.tiles(bm))


@pytest.mark.parametrize("with_base", [False, True])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_tiles_cover_exactly_the_adapter_tokens(device, pattern, with_base):
    gen = torch.Generator().manual_seed(11)
    slots = make_slot_per_token(pattern, 700, 40, with_base, gen)
    meta = build_sgmv_meta(slot_per_token=torch.tensor(slots, dtype=torch.int32), device=device)
    for bm in BLOCK_M_CHOICES:
        tiles = meta.tiles(bm)
        tile_slot, tile_start, tile_end = used(tiles)
        assert -1 not in tile_slot
        assert int(tiles.num_tiles) <= tiles.grid_bound
        covered = [-1] * len(slots)
        for slot, start, end in zip(tile_slot, tile_start, tile_end, strict=True):
            assert 0 < end - start <= bm
            for t in range(start, end):
                assert covered[t] == -1, "a token in two tiles"
                covered[t] = slot
        assert covered == slots


def test_device_slots_use_the_given_bound(device):
    slots = torch.tensor([1, 1, 2, 2, 2, -1], dtype=torch.int32, device=device)
    meta = build_sgmv_meta(slot_per_token=slots, max_segments=3)
    assert meta.device.type == torch.device(device).type
    assert meta.segments_bound == 3  # the given bound on the GPU; counted exactly on the host
    assert meta.segments() == [(0, 2, 1), (2, 5, 2), (5, 6, -1)]


@pytest.mark.parametrize("row_len", [None, 3])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_host_and_device_paths_agree(device, pattern, row_len):
    """Host slots go through numpy, GPU slots through torch ops; both must give the same
    segments and tiles (the device path runs on CPU tensors here when there is no GPU)."""
    gen = torch.Generator().manual_seed(12)
    slots = make_slot_per_token(pattern, 300, 20, True, gen)
    kwargs = {"slot_per_row": slots, "row_len": row_len} if row_len else {"slot_per_token": slots}
    host = SgmvMetaBuilder(900, device).build(**kwargs)
    units = torch.tensor(slots, dtype=torch.int32, device=device)
    on_device = SgmvMetaBuilder(900, device)._build_on_device(units, row_len or 1, None, None)
    assert host.segments() == on_device.segments()
    for bm in BLOCK_M_CHOICES:
        assert used(host.tiles(bm)) == used(on_device.tiles(bm))
        assert host.tiles(bm).grid_bound == int(host.tiles(bm).num_tiles) or int(host.tiles(bm).num_tiles) == 0
        assert on_device.tiles(bm).grid_bound >= int(on_device.tiles(bm).num_tiles)


def test_builder_is_reused_across_batches(device):
    builder = SgmvMetaBuilder(64, device)
    first = builder.build(slot_per_token=[4] * 50 + [9] * 14)
    assert first.segments() == [(0, 50, 4), (50, 64, 9)]
    second = builder.build(slot_per_row=[-1, 3, 3], row_len=5)
    assert second.segments() == [(0, 5, -1), (5, 15, 3)]
    assert used(second.tiles(16)) == ([3], [5], [15])
    with pytest.raises(AssertionError, match="tokens"):
        builder.build(slot_per_token=[0] * 65)


def test_single_token_and_ungrouped_order(device):
    assert build_sgmv_meta(slot_per_token=[7], device=device).segments() == [(0, 1, 7)]
    # Interleaved slots still work; each run is its own segment.
    meta = build_sgmv_meta(slot_per_token=[1, 2, 1, 1], device=device)
    assert meta.segments() == [(0, 1, 1), (1, 2, 2), (2, 4, 1)]


def test_unknown_block_m_is_refused(device):
    meta = build_sgmv_meta(slot_per_token=[0, 0], device=device)
    with pytest.raises(AssertionError, match="BLOCK_M=48"):
        meta.tiles(48)


@pytest.mark.parametrize("row_len", [1, 7, 16])
def test_row_lengths_leave_each_rows_padding_to_no_tile(device, row_len):
    """Slots per row with each row's real length: the segments and tiles of the same slots
    given per token with the padding at -1 (the padding is never in a tile)."""
    gen = torch.Generator().manual_seed(12)
    rows = sorted(torch.randint(-1, 6, (40,), generator=gen).tolist())
    lens = torch.randint(0, row_len + 1, (40,), generator=gen).tolist()
    lens[:3] = [row_len, row_len, 0]  # whole rows of one slot merge; an empty row is all padding
    by_row = build_sgmv_meta(slot_per_row=rows, row_len=row_len, row_lens=lens, device=device)
    per_token = [s if k < n else -1 for s, n in zip(rows, lens) for k in range(row_len)]
    by_token = build_sgmv_meta(slot_per_token=per_token, device=device)
    assert by_row.num_tokens == by_token.num_tokens == 40 * row_len
    assert by_row.segments() == by_token.segments()
    for bm in BLOCK_M_CHOICES:
        assert used(by_row.tiles(bm)) == used(by_token.tiles(bm))


def test_full_row_lengths_change_nothing(device):
    rows = [2, 2, -1, 5, 5, 5, 0]
    plain = build_sgmv_meta(slot_per_row=rows, row_len=9, device=device)
    full = build_sgmv_meta(slot_per_row=rows, row_len=9, row_lens=[9] * 7, device=device)
    assert full.segments() == plain.segments()
    for bm in BLOCK_M_CHOICES:
        assert used(full.tiles(bm)) == used(plain.tiles(bm))
