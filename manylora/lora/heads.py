"""Adapter-aware GLiNER2 heads: one adapter active at a time, set per group of rows.

GLiNER2's span/count/classifier heads run through GLiNER2's own decoding code. The
engine decodes each adapter's rows as one group, with that adapter's head LoRA active
(``HeadLoras.active``); the encoder, which holds nearly all the work, stays one mixed
SGMV batch.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import torch
from torch import nn

from manylora.lora.store import AdapterStore

HEAD_MODULES = ("span_rep", "classifier", "count_pred", "count_embed")


class HeadLoraLinear(nn.Module):
    def __init__(self, base: nn.Linear):
        super().__init__()
        self.base = base
        self.delta: Optional[tuple[torch.Tensor, torch.Tensor, float]] = None  # (A [r,in], B [out,r], scale)

    @property
    def weight(self) -> torch.Tensor:  # GLiNER2 reads .weight.dtype / .device in places
        return self.base.weight

    @property
    def bias(self):
        return self.base.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.delta is not None:
            a, b, scale = self.delta
            y = y + scale * torch.nn.functional.linear(torch.nn.functional.linear(x, a), b)
        return y


class HeadLoras:
    """Wraps every nn.Linear under GLiNER2's head modules, in place."""

    def __init__(self, model: nn.Module):
        self.linears: dict[str, HeadLoraLinear] = {}
        for prefix in HEAD_MODULES:
            root = getattr(model, prefix, None)
            if root is None:
                continue
            for name, module in list(root.named_modules()):
                if isinstance(module, nn.Linear):
                    parent_name, _, child = name.rpartition(".")
                    parent = root.get_submodule(parent_name) if parent_name else root
                    wrapper = HeadLoraLinear(module)
                    setattr(parent, child, wrapper)
                    self.linears[f"{prefix}.{name}"] = wrapper

    def shapes(self) -> dict[str, tuple[int, int]]:
        return {n: (m.base.in_features, m.base.out_features) for n, m in self.linears.items()}

    @contextmanager
    def active(self, store: AdapterStore, slot: int):
        """Apply the head modules of the adapter in GPU ``slot`` while the block runs."""
        adapter = store.owner(slot)
        try:
            for name, module in adapter.modules.items():
                wrapper = self.linears.get(name)
                if wrapper is not None:
                    r = module.rank
                    wrapper.delta = (store.a[name][slot, :r], store.b[name][slot, :, :r], module.scale)
            yield
        finally:
            for wrapper in self.linears.values():
                wrapper.delta = None
