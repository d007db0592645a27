"""Per-forward LoRA state: which GPU slot each row uses, and the SGMV metadata for its tokens.

Built once per encoder forward and handed to every adapter-aware linear. Rows arrive
sorted by slot, so each adapter's tokens are contiguous and form one SGMV segment.
"""

from __future__ import annotations

from typing import Sequence

import torch

from manylora import kernels
from manylora.lora.store import AdapterStore


class LoraBatch:
    def __init__(
        self,
        store: AdapterStore,
        meta_builder,
        slot_per_row: Sequence[int],
        row_len: int,
        targets: set[str],
        backend: str,
    ):
        assert list(slot_per_row) == sorted(slot_per_row), "rows must be sorted by slot"
        self.store = store
        self.backend = backend
        self.targets = targets  # modules that at least one adapter of this batch adapts
        used = [s for s in slot_per_row if s >= 0]
        max_rank = int(max((store.owner(s).rank for s in set(used)), default=0)) or None
        self.meta = meta_builder.build(
            slot_per_row=torch.tensor(list(slot_per_row), dtype=torch.int32), row_len=row_len, max_rank=max_rank
        )
        # position tables: one per distinct slot of the batch (the base model's included)
        group_slots = sorted(set(slot_per_row))
        index = {s: g for g, s in enumerate(group_slots)}
        device = store.device
        self.group_slots = torch.tensor([max(s, 0) for s in group_slots], device=device)
        self.group_has_adapter = torch.tensor([s >= 0 for s in group_slots], device=device)
        self.row_table = torch.tensor([index[s] for s in slot_per_row], device=device)
        self._scratch: dict = {}

    def apply(self, name: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += each token's scale * (x A^T) B^T for its row's adapter (in place)."""
        if name not in self.targets:
            return
        store = self.store
        v = self._scratch.get(x.shape[0])
        if v is None:
            v = self._scratch[x.shape[0]] = torch.empty(
                x.shape[0], store.max_rank, dtype=torch.float32, device=x.device
            )
        kernels.lora_apply(
            x,
            y,
            store.a[name],
            store.b[name],
            store.scales[name],
            self.meta,
            backend=self.backend,
            ranks=store.ranks,
            v=v,
        )

    def project_table(self, name: str, window: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """Position table through ``name`` per slot group: ``base`` [1, W, out] + each adapter's update."""
        if name not in self.targets:
            return base
        store = self.store
        a = store.a[name].index_select(0, self.group_slots).float()  # [G, R, in]
        b = store.b[name].index_select(0, self.group_slots).float()  # [G, out, R]
        scale = store.scales[name].index_select(0, self.group_slots) * self.group_has_adapter
        delta = torch.matmul(torch.matmul(window.float(), a.transpose(1, 2)), b.transpose(1, 2))
        return base + (delta * scale.view(-1, 1, 1)).to(base.dtype)
