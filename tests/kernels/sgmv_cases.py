"""Batches and checks shared by the kernel tests: adapter popularity patterns, random
LoRA stacks, and the comparison against the float32 reference (TOLERANCES)."""

from __future__ import annotations

import torch
from manylora.kernels import TOLERANCES

PATTERNS = ("distinct", "uniform", "zipf", "identical", "skewed")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def make_slot_per_token(
    pattern: str, num_tokens: int, num_slots: int, with_base: bool, gen: torch.Generator
) -> list[int]:
    """Rows of random length get slots by `pattern`, then rows are grouped by slot (as the
    engine does) and expanded to one slot per token. with_base: about a quarter of the
    rows are base-model rows (slot -1)."""
    if pattern == "skewed":
        # One big segment; the rest spread thinly (rows of 1-3 tokens) over the other slots.
        lengths = [max(1, num_tokens * 2 // 3)]
        while sum(lengths) < num_tokens:
            lengths.append(int(torch.randint(1, 4, (1,), generator=gen)))
        lengths[-1] -= sum(lengths) - num_tokens
    elif pattern == "distinct":
        # As many rows as slots (fewer for tiny batches), cut at random points.
        num_rows = min(num_slots, num_tokens)
        cuts = sorted(torch.randperm(num_tokens - 1, generator=gen)[: num_rows - 1].add(1).tolist())
        lengths = [b - a for a, b in zip([0, *cuts], [*cuts, num_tokens], strict=True)]
    else:
        lengths = []
        while sum(lengths) < num_tokens:
            lengths.append(int(torch.randint(1, 16, (1,), generator=gen)))
        lengths[-1] -= sum(lengths) - num_tokens
    num_rows = len(lengths)

    if pattern == "distinct":
        slots = torch.randperm(num_slots, generator=gen)[:num_rows]
    elif pattern == "uniform":
        slots = torch.randint(0, num_slots, (num_rows,), generator=gen)
    elif pattern == "zipf":
        weights = 1.0 / torch.arange(1, num_slots + 1, dtype=torch.float64) ** 1.2
        slots = torch.multinomial(weights, num_rows, replacement=True, generator=gen)
    elif pattern == "identical":
        slots = torch.full((num_rows,), int(torch.randint(0, num_slots, (1,), generator=gen)))
    elif pattern == "skewed":
        slots = torch.cat([torch.tensor([0]), 1 + torch.arange(num_rows - 1) % (num_slots - 1)])
    else:
        raise ValueError(pattern)
    slots = slots.tolist()
    if with_base:
        base_rows = torch.rand(num_rows, generator=gen) < 0.25
        base_rows[int(torch.randint(0, num_rows, (1,), generator=gen))] = True
        slots = [-1 if b else s for s, b in zip(slots, base_rows.tolist(), strict=True)]

    order = sorted(range(num_rows), key=lambda r: slots[r])
    return [slots[r] for r in order for _ in range(lengths[r])]


def make_lora(
    num_slots: int,
    r_max: int,
    h_in: int,
    h_out: int,
    dtype: torch.dtype,
    device: str,
    gen: torch.Generator,
    ranks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A [S, R_max, H_in], B [S, H_out, R_max], scales fp32 [S], scaled so that v and the
    update are ~N(0, 1). With ranks, the padding past each slot's rank is NaN: a kernel
    that reads it fails the comparison."""
    lora_a = torch.randn(num_slots, r_max, h_in, generator=gen) / h_in**0.5
    lora_b = torch.randn(num_slots, h_out, r_max, generator=gen) / r_max**0.5
    scales = torch.rand(num_slots, generator=gen) * 1.5 + 0.5
    if ranks is not None:
        for slot, rank in enumerate(ranks.tolist()):
            lora_a[slot, rank:] = float("nan")
            lora_b[slot, :, rank:] = float("nan")
    return lora_a.to(device, dtype), lora_b.to(device, dtype), scales.to(device)


def rank_mask(slot_per_token: list[int], ranks: torch.Tensor | None, width: int, device: str) -> torch.Tensor:
    """bool [T, width]: the v entries shrink defines (slot >= 0, column < rank(slot))."""
    slots = torch.tensor(slot_per_token)
    rank_of_token = torch.full_like(slots, width) if ranks is None else ranks.cpu()[slots.clamp(min=0)].long()
    rank_of_token[slots < 0] = 0
    return (torch.arange(width)[None, :] < rank_of_token[:, None]).to(device)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)
