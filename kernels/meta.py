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
    seg_starts     [0, 5, 7, 8, 10]        int32 [S + 1]
    seg_slots      [3, -1, 0, 7]           int32 [S]
    num_segments   [4]                     int32 [1]

    tiles for BLOCK_M = 4 (segment 1 has slot -1: no tile)
    tile               0   1   2   3
    slot               3   3   0   7
    start              0   4   7   8       first token of the tile
    end                4   5   8  10       one past its last token

    packed tiles   [4,  3, 0, 4,  3, 4, 5,  0, 7, 8,  7, 8, 10, ...]   int32 [1 + 3 * tile_cap]
                    ^num_tiles, then (slot, start, end) per tile

A program for tile i reads packed[1 + 3i : 4 + 3i] and computes tokens [start, end) with
adapter `slot`. Tiles are built for every BLOCK_M in BLOCK_M_CHOICES (one packed row
each), so each kernel config picks its own BLOCK_M without rebuilding anything. Entries
past num_segments / num_tiles are never read (they may hold an older batch).

Two ways to build, same result:
- slots on the host (a list or CPU tensor, the engine's usual case): computed with numpy
  on exact sizes, then one asynchronous pinned copy of the used prefix of the tile rows.
  The segments stay on the host (segments() costs no sync), and grid_bound is the exact
  tile count.
- slots already on the GPU: computed by device-side torch ops, never waiting for the GPU
  (no .item(), no nonzero()); grid_bound is cdiv(T, BLOCK_M) + a segment bound.
Either way the tile rows live in one buffer preallocated for `max_tokens`, at fixed
addresses across forwards (CUDA-graph friendly). The kernels loop over tiles with a grid
stride, so a grid smaller than the tile count (a graph captured on a smaller batch, a low
segment bound) costs speed, never correctness.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

# BLOCK_M values a launch config may use; tiles are precomputed for each.
BLOCK_M_CHOICES = (16, 32, 64, 128)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class SgmvTiles:
    """Tiles of one BLOCK_M: a view of one packed row, num_tiles then (slot, start, end) per tile."""

    block_m: int
    packed: torch.Tensor  # int32 [1 + 3 * tile_cap]
    grid_bound: int  # host-side bound on num_tiles, sizes the launch grid

    @property
    def num_tiles(self) -> torch.Tensor:  # int32 [1]
        return self.packed[:1]

    @property
    def tile_slot(self) -> torch.Tensor:  # int32 [tile_cap]
        return self.packed[1::3]

    @property
    def tile_start(self) -> torch.Tensor:  # int32 [tile_cap]
        return self.packed[2::3]

    @property
    def tile_end(self) -> torch.Tensor:  # int32 [tile_cap]
        return self.packed[3::3]


@dataclass(frozen=True)
class SgmvMeta:
    """Segments and tiles of one batch; see the module docstring for the layout."""

    num_tokens: int  # T
    device: torch.device  # where the kernels run (the tiles' device)
    seg_starts: torch.Tensor  # int32 [>= S + 1]; on the host when the slots came from the host
    seg_slots: torch.Tensor  # int32 [>= S]
    num_segments: torch.Tensor  # int32 [1]
    segments_bound: int  # host: exact segment count, or an upper bound
    max_rank: int | None  # largest adapter rank in the batch (sizes the rank tile); None = the stack's R_max
    tiles_by_block_m: dict[int, SgmvTiles]

    def tiles(self, block_m: int) -> SgmvTiles:
        assert block_m in self.tiles_by_block_m, (
            f"BLOCK_M={block_m} has no tiles; launch configs must use one of {BLOCK_M_CHOICES}"
        )
        return self.tiles_by_block_m[block_m]

    def segments(self) -> list[tuple[int, int, int]]:
        """(start, end, slot) per segment, on the host (synchronizes if the segments are on the GPU)."""
        count = int(self.num_segments.item())
        starts = self.seg_starts[: count + 1].tolist()
        slots = self.seg_slots[:count].tolist()
        return [(starts[s], starts[s + 1], slots[s]) for s in range(count)]


class SgmvMetaBuilder:
    """Owns the preallocated tile buffer of one device; `build` fills it per forward.

    A built SgmvMeta is a view of the buffer: it stays valid until the next `build`.
    Work scales with the batch, not with max_tokens.
    """

    def __init__(
        self,
        max_tokens: int,
        device: torch.device | str = "cpu",
        block_m_choices: tuple[int, ...] = BLOCK_M_CHOICES,
    ):
        assert max_tokens >= 1, f"max_tokens must be >= 1, got {max_tokens}"
        self.max_tokens = max_tokens
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())  # compare equal to tensors' devices
        self.device = device
        self.block_m_choices = tuple(block_m_choices)
        # A tile has at least one token, and each segment adds at most one partial tile.
        self._tile_cap = _cdiv(max_tokens, min(block_m_choices)) + max_tokens
        self._tiles = torch.zeros(len(block_m_choices), 1 + 3 * self._tile_cap, dtype=torch.int32, device=self.device)

    def build(
        self,
        *,
        slot_per_row: torch.Tensor | Sequence[int] | None = None,
        row_len: int | None = None,
        slot_per_token: torch.Tensor | Sequence[int] | None = None,
        max_rank: int | None = None,
        max_segments: int | None = None,
        row_lens: Sequence[int] | None = None,
    ) -> SgmvMeta:
        """Fill the buffer from a slot per row ([B] with rows of `row_len` tokens, T = B * row_len)
        or a slot per token ([T]); slot -1 means no adapter. Same-slot tokens should be
        contiguous (one segment per adapter); other orders work but make more segments.

        max_rank: largest rank of the batch's adapters (host int), or None.
        max_segments: host bound on the segment count when the slots are a GPU tensor
        (for example distinct adapters + 1); it only sizes the grid.
        row_lens: with host slots per row, each row's real tokens (0..row_len, the rest of the
        row is padding): the padding gets slot -1, so no tile covers it and the kernels leave it
        as they found it (``Engine``'s ``lora_skip_padding``).
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
        num_tokens = units.numel() * unit_len
        assert 1 <= num_tokens <= self.max_tokens, (
            f"batch has {num_tokens} tokens; this builder holds 1..{self.max_tokens}"
        )
        if row_lens is not None:
            assert slot_per_row is not None and units.device.type == "cpu", "row_lens go with host slots per row"
            assert len(row_lens) == units.numel(), f"{len(row_lens)} row lengths for {units.numel()} rows"
        if units.device.type == "cpu":
            return self._build_on_host(units.numpy().astype(np.int64), unit_len, max_rank, row_lens)
        return self._build_on_device(units.to(self.device, torch.int32), unit_len, max_rank, max_segments)

    def _build_on_host(
        self, units: np.ndarray, unit_len: int, max_rank: int | None, row_lens: Sequence[int] | None = None
    ) -> SgmvMeta:
        num_units = len(units)
        if row_lens is not None:  # each row's real tokens, then its padding (slot -1): pieces of 2 per row
            lens = np.clip(np.asarray(row_lens, dtype=np.int64), 0, unit_len)
            starts = np.arange(num_units, dtype=np.int64) * unit_len
            piece_start = np.stack([starts, starts + lens], axis=1).reshape(-1)
            piece_slot = np.stack([units, np.full(num_units, -1, dtype=np.int64)], axis=1).reshape(-1)
            kept = np.stack([lens > 0, lens < unit_len], axis=1).reshape(-1)  # no empty piece
            piece_start, piece_slot = piece_start[kept], piece_slot[kept]
            first = np.concatenate(([True], piece_slot[1:] != piece_slot[:-1]))  # equal neighbours: one segment
            seg_starts = np.concatenate((piece_start[first], [num_units * unit_len]))
            seg_slots = piece_slot[first]
        else:
            # Example: units [3 3 3 3 3 -1 -1 0 7 7] -> segment starts (in units) [0 5 7 8 10].
            unit_starts = np.concatenate(([0], np.flatnonzero(units[1:] != units[:-1]) + 1, [num_units]))
            seg_starts = unit_starts * unit_len
            seg_slots = units[unit_starts[:-1]]
        seg_len = np.diff(seg_starts)
        num_segments = len(seg_slots)

        rows, counts = [], []
        for bm in self.block_m_choices:
            # Example, BLOCK_M = 4: lengths [5 2 1 2] -> tiles per segment [2 0 1 1].
            tiles_per_seg = np.where(seg_slots >= 0, (seg_len + bm - 1) // bm, 0)
            seg_of_tile = np.repeat(np.arange(num_segments), tiles_per_seg)  # [0 0 2 3]
            first_tile = np.cumsum(tiles_per_seg) - tiles_per_seg  # [0 2 2 3]
            start = seg_starts[seg_of_tile] + (np.arange(len(seg_of_tile)) - first_tile[seg_of_tile]) * bm
            end = np.minimum(start + bm, seg_starts[seg_of_tile + 1])
            rows.append(np.stack([seg_slots[seg_of_tile], start, end], axis=1).reshape(-1))
            counts.append(len(seg_of_tile))
        width = 1 + 3 * max(counts)
        staged = np.zeros((len(rows), width), dtype=np.int32)
        for i, (row, count) in enumerate(zip(rows, counts, strict=True)):
            staged[i, 0] = count
            staged[i, 1 : 1 + len(row)] = row
        staged_tensor = torch.from_numpy(staged)
        if self.device.type == "cuda":
            staged_tensor = staged_tensor.pin_memory()  # pinned: the copy below is truly asynchronous
        self._tiles[:, :width].copy_(staged_tensor, non_blocking=True)

        return SgmvMeta(
            num_tokens=num_units * unit_len,
            device=self.device,
            seg_starts=torch.from_numpy(seg_starts.astype(np.int32)),
            seg_slots=torch.from_numpy(seg_slots.astype(np.int32)),
            num_segments=torch.tensor([num_segments], dtype=torch.int32),
            segments_bound=num_segments,
            max_rank=max_rank,
            tiles_by_block_m={
                bm: SgmvTiles(block_m=bm, packed=self._tiles[i], grid_bound=max(1, counts[i]))
                for i, bm in enumerate(self.block_m_choices)
            },
        )

    def _build_on_device(
        self, units: torch.Tensor, unit_len: int, max_rank: int | None, max_segments: int | None
    ) -> SgmvMeta:
        num_units = units.numel()
        num_tokens = num_units * unit_len
        device = units.device
        arange = torch.arange(num_units + 1, dtype=torch.int64, device=device)
        # Segments over units (rows or tokens), then scaled to token offsets. Sized by the
        # unit count: entries past num_segments are padding (starts = T, slots = -1).
        # Example: units [3 3 3 3 3 -1 -1 0 7 7] -> seg_of_unit [0 0 0 0 0 1 1 2 3 3].
        new_segment = torch.ones(num_units, dtype=torch.bool, device=device)
        torch.ne(units[1:], units[:-1], out=new_segment[1:])
        seg_of_unit = torch.cumsum(new_segment, 0) - 1
        num_segments = (seg_of_unit[-1:] + 1).to(torch.int32)
        seg_starts = torch.full((num_units + 1,), num_units, dtype=torch.int64, device=device)
        seg_starts.scatter_reduce_(0, seg_of_unit, arange[:num_units], reduce="amin")
        seg_starts.mul_(unit_len)
        seg_slots = torch.full((num_units,), -1, dtype=torch.int32, device=device)
        seg_slots.scatter_(0, seg_of_unit, units)

        # Tiles, every BLOCK_M at once (rows of [C, ...]); see _build_on_host for the example.
        segments_bound = num_units if max_segments is None else max(1, min(max_segments, num_units))
        block_m = torch.tensor(self.block_m_choices, dtype=torch.int64, device=device)[:, None]  # [C, 1]
        seg_len = seg_starts[1:] - seg_starts[:-1]  # [U]; 0 past the last segment
        tiles_per_seg = torch.where(seg_slots >= 0, (seg_len + (block_m - 1)) // block_m, 0)  # [C, U]
        tiles_cum = torch.cumsum(tiles_per_seg, 1)  # [C, U]
        grid_bounds = [min(self._tile_cap, _cdiv(num_tokens, bm) + segments_bound) for bm in self.block_m_choices]
        count = max(grid_bounds)
        tile_ids = torch.arange(count, dtype=torch.int64, device=device).repeat(len(grid_bounds), 1)  # [C, N]
        # Tile i belongs to the first segment whose cumulative tile count exceeds i.
        seg = torch.searchsorted(tiles_cum, tile_ids, right=True).clamp_(max=num_units - 1)
        first_tile = tiles_cum.gather(1, seg) - tiles_per_seg.gather(1, seg)
        start = seg_starts[seg] + (tile_ids - first_tile) * block_m
        end = torch.minimum(start + block_m, seg_starts[seg + 1])
        packed = torch.stack([seg_slots[seg].to(torch.int64), start, end], dim=2)  # [C, N, 3]
        self._tiles[:, 0].copy_(tiles_cum[:, -1])
        self._tiles[:, 1 : 1 + 3 * count].copy_(packed.view(len(grid_bounds), 3 * count))

        return SgmvMeta(
            num_tokens=num_tokens,
            device=self.device,
            seg_starts=seg_starts.to(torch.int32),
            seg_slots=seg_slots,
            num_segments=num_segments,
            segments_bound=segments_bound,
            max_rank=max_rank,
            tiles_by_block_m={
                bm: SgmvTiles(block_m=bm, packed=self._tiles[i], grid_bound=grid_bounds[i])
                for i, bm in enumerate(self.block_m_choices)
            },
        )


def build_sgmv_meta(
    *,
    slot_per_row: torch.Tensor | Sequence[int] | None = None,
    row_len: int | None = None,
    slot_per_token: torch.Tensor | Sequence[int] | None = None,
    device: torch.device | str | None = None,
    max_rank: int | None = None,
    max_segments: int | None = None,
    row_lens: Sequence[int] | None = None,
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
        row_lens=row_lens,
    )
