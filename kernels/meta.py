"""Batch metadata for the SGMV kernels: built once per forward, shared by every LoRA layer.

Tokens arrive grouped: all tokens of one adapter are contiguous (the engine sorts its
rows by GPU slot). A *segment* is a maximal run of tokens with the same slot. The
kernels do not walk segments; they walk *tiles*: pieces of at most BLOCK_M tokens that
never cross a segment boundary, so every program works for exactly one adapter and no
program is launched for an empty tile or for tokens without an adapter (slot -1).

Running example (the comments below refer to it): 10 tokens, 4 segments, BLOCK_M = 4.

    token              0   1   2   3   4   5   6   7   8   9
    slot_per_token     3   3   3   3   3  -1  -1   0   7   7

    segment            0 (slot 3)          1 (-1)  2   3 (slot 7)
    seg_starts     [0, 5, 7, 8, 10, ...]   int32 [S_cap + 1]
    seg_slots      [3, -1, 0, 7, ...]      int32 [S_cap]
    num_segments   [4]                     int32 [1]

    tiles for BLOCK_M = 4 (segment 1 has slot -1: no tile)
    tile               0   1   2   3
    tile_slot      [   3,  3,  0,  7, ...]   int32 [tile_cap]
    tile_start     [   0,  4,  7,  8, ...]   first token of the tile
    tile_end       [   4,  5,  8, 10, ...]   one past its last token
    num_tiles      [4]                       int32 [1]

Entries past num_segments / num_tiles are never read (they may hold an older batch).

A program for tile i computes tokens [tile_start[i], tile_end[i]) with adapter
tile_slot[i]. Tiles are built for every BLOCK_M in BLOCK_M_CHOICES, so each kernel
config can pick its own BLOCK_M without rebuilding anything.

The arrays live in two int32 buffers preallocated for `max_tokens` (segments; tiles, one
row per BLOCK_M), filled in place by device-side torch ops: building never waits for the GPU (no .item(), no nonzero()), and
the buffer addresses stay fixed across forwards (CUDA-graph friendly). The only
host-side number a launch needs is a bound on the tile count; it is
cdiv(T, BLOCK_M) + segments_bound, where segments_bound is exact when the slots come
from the host and an upper bound otherwise. The kernels loop over tiles with a grid
stride, so an undersized bound costs speed, never correctness.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# BLOCK_M values a launch config may use; tiles are precomputed for each.
BLOCK_M_CHOICES = (16, 32, 64, 128)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class SgmvTiles:
    """Tiles of one BLOCK_M: one packed view of the metadata buffer,
    tile_slot | tile_start | tile_end (tile_cap each) | num_tiles (1), so a kernel takes
    one pointer and tile_cap instead of four pointers."""

    block_m: int
    packed: torch.Tensor  # int32 [3 * tile_cap + 1]
    tile_cap: int
    grid_bound: int  # host-side bound on num_tiles, sizes the launch grid

    @property
    def tile_slot(self) -> torch.Tensor:  # int32 [tile_cap]
        return self.packed[: self.tile_cap]

    @property
    def tile_start(self) -> torch.Tensor:  # int32 [tile_cap]
        return self.packed[self.tile_cap : 2 * self.tile_cap]

    @property
    def tile_end(self) -> torch.Tensor:  # int32 [tile_cap]
        return self.packed[2 * self.tile_cap : 3 * self.tile_cap]

    @property
    def num_tiles(self) -> torch.Tensor:  # int32 [1]
        return self.packed[3 * self.tile_cap :]


@dataclass(frozen=True)
class SgmvMeta:
    """Segments and tiles of one batch; see the module docstring for the layout."""

    num_tokens: int  # T
    seg_starts: torch.Tensor  # int32 [S_cap + 1]
    seg_slots: torch.Tensor  # int32 [S_cap]
    num_segments: torch.Tensor  # int32 [1]
    segments_bound: int  # host: exact segment count, or an upper bound
    max_rank: int | None  # largest adapter rank in the batch (sizes the rank tile); None = the stack's R_max
    tiles_by_block_m: dict[int, SgmvTiles]

    @property
    def device(self) -> torch.device:
        return self.seg_starts.device

    def tiles(self, block_m: int) -> SgmvTiles:
        assert block_m in self.tiles_by_block_m, (
            f"BLOCK_M={block_m} has no tiles; launch configs must use one of {BLOCK_M_CHOICES}"
        )
        return self.tiles_by_block_m[block_m]

    def segments(self) -> list[tuple[int, int, int]]:
        """(start, end, slot) per segment, on the host. Synchronizes; for references and tests."""
        count = int(self.num_segments.item())
        starts = self.seg_starts[: count + 1].tolist()
        slots = self.seg_slots[:count].tolist()
        return [(starts[s], starts[s + 1], slots[s]) for s in range(count)]


class SgmvMetaBuilder:
    """Owns the preallocated metadata buffers of one device; `build` fills them per forward.

    A built SgmvMeta is a view of the buffers: it stays valid until the next `build`.
    Work and buffer entries touched scale with the batch, not with max_tokens; entries
    past a batch's counts keep stale values that nothing reads.
    """

    def __init__(
        self,
        max_tokens: int,
        device: torch.device | str = "cpu",
        block_m_choices: tuple[int, ...] = BLOCK_M_CHOICES,
    ):
        assert max_tokens >= 1, f"max_tokens must be >= 1, got {max_tokens}"
        self.max_tokens = max_tokens
        self.device = torch.device(device)
        self.block_m_choices = tuple(block_m_choices)
        # A segment has at least one token; a tile has at least one token and at most
        # one partial tile per segment.
        self._tile_cap = _cdiv(max_tokens, min(block_m_choices)) + max_tokens
        self._segments = torch.empty(2 * max_tokens + 2, dtype=torch.int32, device=self.device)
        self._seg_starts = self._segments[: max_tokens + 1]  # [S_cap + 1]
        self._seg_slots = self._segments[max_tokens + 1 : 2 * max_tokens + 1]  # [S_cap]
        self._num_segments = self._segments[2 * max_tokens + 1 :]  # [1]
        # One row per BLOCK_M: tile_slot | tile_start | tile_end | num_tiles (SgmvTiles.packed).
        cap = self._tile_cap
        self._tiles = torch.empty(len(block_m_choices), 3 * cap + 1, dtype=torch.int32, device=self.device)
        self._block_m = torch.tensor(block_m_choices, dtype=torch.int64, device=self.device)[:, None]
        self._arange = torch.arange(cap, dtype=torch.int64, device=self.device)

    def build(
        self,
        *,
        slot_per_row: torch.Tensor | Sequence[int] | None = None,
        row_len: int | None = None,
        slot_per_token: torch.Tensor | Sequence[int] | None = None,
        max_rank: int | None = None,
        max_segments: int | None = None,
    ) -> SgmvMeta:
        """Fill the buffers from a slot per row ([B] with rows of `row_len` tokens, T = B * row_len)
        or a slot per token ([T]); slot -1 means no adapter. Same-slot tokens should be
        contiguous (one segment per adapter); other orders work but make more segments.

        max_rank: largest rank of the batch's adapters (host int), or None.
        max_segments: host bound on the segment count when the slots are a device tensor
        (for example distinct adapters + 1); it only sizes the grid.
        """
        assert (slot_per_row is None) != (slot_per_token is None), (
            "give exactly one of slot_per_row (with row_len) or slot_per_token"
        )
        if slot_per_row is not None:
            assert row_len is not None and row_len >= 1, f"slot_per_row needs row_len >= 1, got {row_len}"
            units, unit_len = slot_per_row, row_len
        else:
            assert row_len is None, "row_len only goes with slot_per_row"
            units, unit_len = slot_per_token, 1
        if not isinstance(units, torch.Tensor):
            units = torch.tensor(list(units), dtype=torch.int32)
        assert units.dim() == 1, f"slots must be 1-D, got shape {tuple(units.shape)}"
        num_units = units.numel()
        num_tokens = num_units * unit_len
        assert 1 <= num_tokens <= self.max_tokens, (
            f"batch has {num_tokens} tokens; this builder holds 1..{self.max_tokens}"
        )

        if units.device.type == "cpu":
            # The slots are on the host: count the segments exactly, for free.
            segments_bound = 1 + int((units[1:] != units[:-1]).sum())
            if self.device.type == "cuda":
                units = units.to(torch.int32).pin_memory()  # pinned: the copy below is truly asynchronous
        else:
            segments_bound = num_units if max_segments is None else min(max_segments, num_units)
        units = units.to(device=self.device, dtype=torch.int32, non_blocking=True)

        # Segments over units (rows or tokens), then scaled to token offsets.
        # Example: units [3 3 3 3 3 -1 -1 0 7 7] -> seg_of_unit [0 0 0 0 0 1 1 2 3 3].
        new_segment = torch.ones(num_units, dtype=torch.bool, device=self.device)
        torch.ne(units[1:], units[:-1], out=new_segment[1:])
        seg_of_unit = torch.cumsum(new_segment, 0) - 1
        self._num_segments.copy_(seg_of_unit[-1:] + 1)
        seg_starts = self._seg_starts[: num_units + 1]
        seg_starts.fill_(num_units)
        seg_starts.scatter_reduce_(0, seg_of_unit, self._arange[:num_units].to(torch.int32), reduce="amin")
        if unit_len != 1:
            seg_starts.mul_(unit_len)
        seg_slots = self._seg_slots[:num_units]
        seg_slots.fill_(-1)
        seg_slots.scatter_(0, seg_of_unit, units)

        # Tiles, every BLOCK_M at once (rows of [C, ...]). Example, BLOCK_M = 4: segment
        # lengths [5 2 1 2] -> tiles per segment [2 0 1 1] (slot -1 gets none) ->
        # cumulative [2 2 3 4]; tile i belongs to the first segment whose cumulative count
        # exceeds i: tiles 0,1 -> segment 0; 2 -> 2; 3 -> 3.
        cap = self._tile_cap
        block_m = self._block_m  # [C, 1]
        seg_len = seg_starts[1:] - seg_starts[:-1]  # [U]; 0 past the last segment
        tiles_per_seg = torch.where(seg_slots >= 0, (seg_len + (block_m - 1)) // block_m, 0)  # [C, U]
        tiles_cum = torch.cumsum(tiles_per_seg, 1)  # [C, U]
        self._tiles[:, 3 * cap].copy_(tiles_cum[:, -1])
        grid_bounds = [min(cap, _cdiv(num_tokens, bm) + segments_bound) for bm in self.block_m_choices]
        tile_ids = self._arange[: max(grid_bounds)].repeat(len(grid_bounds), 1)  # [C, N]
        seg = torch.searchsorted(tiles_cum, tile_ids, right=True).clamp_(max=num_units - 1)
        first_tile = tiles_cum.gather(1, seg) - tiles_per_seg.gather(1, seg)
        start = seg_starts[seg] + (tile_ids - first_tile) * block_m
        valid = tile_ids < tiles_cum[:, -1:]
        n = tile_ids.shape[1]
        self._tiles[:, :n].copy_(torch.where(valid, seg_slots[seg], -1))
        self._tiles[:, cap : cap + n].copy_(torch.where(valid, start, 0))
        self._tiles[:, 2 * cap : 2 * cap + n].copy_(
            torch.where(valid, torch.minimum(start + block_m, seg_starts[seg + 1]), 0)
        )
        tiles = {
            bm: SgmvTiles(block_m=bm, packed=self._tiles[i], tile_cap=cap, grid_bound=grid_bounds[i])
            for i, bm in enumerate(self.block_m_choices)
        }
        return SgmvMeta(
            num_tokens=num_tokens,
            seg_starts=self._seg_starts,
            seg_slots=self._seg_slots,
            num_segments=self._num_segments,
            segments_bound=segments_bound,
            max_rank=max_rank,
            tiles_by_block_m=tiles,
        )


def build_sgmv_meta(
    *,
    slot_per_row: torch.Tensor | Sequence[int] | None = None,
    row_len: int | None = None,
    slot_per_token: torch.Tensor | Sequence[int] | None = None,
    device: torch.device | str | None = None,
    max_rank: int | None = None,
    max_segments: int | None = None,
) -> SgmvMeta:
    """One-shot SgmvMetaBuilder(T, device).build(...); the engine keeps a builder instead.

    device defaults to the slots' device (CPU for a Python list).
    """
    units = slot_per_row if slot_per_row is not None else slot_per_token
    assert units is not None, "give slot_per_row (with row_len) or slot_per_token"
    if device is None:
        device = units.device if isinstance(units, torch.Tensor) else "cpu"
    num_tokens = len(units) * (row_len if slot_per_row is not None and row_len else 1)
    builder = SgmvMetaBuilder(max(num_tokens, 1), device)
    return builder.build(
        slot_per_row=slot_per_row,
        row_len=row_len,
        slot_per_token=slot_per_token,
        max_rank=max_rank,
        max_segments=max_segments,
    )
