"""Adapter store: adapter folders on disk -> parsed adapters in host memory -> GPU slots.

GPU slots are stacked tensors per LoRA target, preallocated at ``max_lora_rank``:
``a[name]`` is ``[slots, R_max, in]`` and ``b[name]`` is ``[slots, out, R_max]``; an
adapter occupies one slot index across all targets (zeros where it has no module, so
its update there is exactly zero). Both tiers are LRU; slots used by the batch in flight
are pinned and never evicted, so a batch that needs more distinct adapters than there
are slots is served in waves by the engine (``plan_waves``), never refused.

An adapter is looked up on disk on every use (a stat, no read): a new folder is servable
on its first request, a changed weights file (mtime, size) is reloaded, a removed folder
answers NOT_FOUND.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Iterable, Mapping, Optional

import torch

from manylora.lora.adapter import AdapterError, LoraAdapter, load_adapter, resolve_adapter_dir, weights_fingerprint

logger = logging.getLogger(__name__)


def slot_bytes(shapes: Mapping[str, tuple[int, int]], max_rank: int, dtype: torch.dtype) -> int:
    """Bytes of one GPU slot: A [R, in] and B [out, R] for every LoRA-able linear."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return sum(max_rank * (i + o) for i, o in shapes.values()) * itemsize


class AdapterStore:
    def __init__(
        self,
        root: Optional[Path],
        shapes: Mapping[str, tuple[int, int]],  # LoRA-able linear path -> (in, out)
        *,
        max_rank: int,
        gpu_slots: int,
        host_slots: int,
        device: torch.device,
        dtype: torch.dtype,
    ):
        assert host_slots >= gpu_slots >= 1, "host slots must be >= GPU slots >= 1"
        need = slot_bytes(shapes, max_rank, dtype) * gpu_slots
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            if need > 0.8 * free:
                raise MemoryError(
                    f"{gpu_slots} GPU adapter slots at rank {max_rank} need {need / 2**30:.1f} GiB; "
                    f"{free / 2**30:.1f} GiB is free: lower max_gpu_adapters or max_lora_rank"
                )
        logger.info("adapter slots: %d on %s at rank %d take %.2f GiB", gpu_slots, device, max_rank, need / 2**30)
        self.root = None if root is None else Path(root)
        self.shapes = dict(shapes)
        self.max_rank = max_rank
        self.gpu_slots = gpu_slots
        self.host_slots = host_slots
        self.device = device
        self.dtype = dtype
        self.a = {n: torch.zeros(gpu_slots, max_rank, i, device=device, dtype=dtype) for n, (i, o) in shapes.items()}
        self.b = {n: torch.zeros(gpu_slots, o, max_rank, device=device, dtype=dtype) for n, (i, o) in shapes.items()}
        self.scales = {n: torch.zeros(gpu_slots, device=device, dtype=torch.float32) for n in shapes}
        self.ranks = torch.zeros(gpu_slots, device=device, dtype=torch.int32)
        self._host: OrderedDict[str, LoraAdapter] = OrderedDict()  # LRU, most recent last
        self._gpu: OrderedDict[str, int] = OrderedDict()  # adapter id -> slot, LRU
        self._slot_owner: list[Optional[LoraAdapter]] = [None] * gpu_slots
        self._lock = threading.Lock()
        self.loads = {"disk": 0, "gpu": 0}
        # for metrics: ("hit" | "miss" | "evict", "host" | "gpu") -> count, and load latencies (s)
        self.events: Counter = Counter()
        self.load_seconds: dict[str, list[float]] = {"disk_to_host": [], "host_to_gpu": []}

    @property
    def gpu_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.a, self.b) for t in d.values())

    # ------------------------------------------------------------------ host tier
    def get(self, adapter_id: str) -> LoraAdapter:
        """The parsed adapter (from host memory, or disk when new or changed); raises AdapterError."""
        if self.root is None:
            raise AdapterError("NOT_FOUND", f"unknown adapter {adapter_id!r}: this model has no adapter directory")
        folder = resolve_adapter_dir(self.root, adapter_id)
        with self._lock:
            cached = self._host.get(adapter_id)
            try:
                fingerprint = weights_fingerprint(folder)
            except OSError:
                fingerprint = None
            if cached is not None and cached.fingerprint == fingerprint and cached.path == folder:
                self._host.move_to_end(adapter_id)
                self.events["hit", "host"] += 1
                return cached
            self.events["miss", "host"] += 1
        started = time.perf_counter()
        adapter = load_adapter(adapter_id, folder, self.shapes, self.max_rank)
        with self._lock:
            self.load_seconds["disk_to_host"].append(time.perf_counter() - started)
            self.loads["disk"] += 1
            self._host[adapter_id] = adapter
            self._host.move_to_end(adapter_id)
            while len(self._host) > self.host_slots:
                self._host.popitem(last=False)
                self.events["evict", "host"] += 1
        return adapter

    # ------------------------------------------------------------------ GPU tier
    def acquire(self, adapters: Iterable[LoraAdapter]) -> dict[str, int]:
        """GPU slots for at most ``gpu_slots`` distinct adapters, loading what is missing.

        Slots of the adapters asked for are not evicted by this call (they are the batch
        in flight); the least recently used other slots are.
        """
        wanted = {a.name: a for a in adapters}
        assert len(wanted) <= self.gpu_slots, f"{len(wanted)} adapters > {self.gpu_slots} GPU slots: plan waves"
        with self._lock:
            result = {}
            missing = []
            for name, adapter in wanted.items():
                slot = self._gpu.get(name)
                if slot is not None and self._slot_owner[slot] is adapter:
                    self._gpu.move_to_end(name)
                    result[name] = slot
                    self.events["hit", "gpu"] += 1
                else:
                    missing.append(adapter)
                    self.events["miss", "gpu"] += 1
            free = [s for s in range(self.gpu_slots) if self._slot_owner[s] is None]
            evictable = [n for n in self._gpu if n not in wanted]  # LRU order
            for adapter in missing:
                if adapter.name in self._gpu:  # stale copy of a changed adapter: reuse its slot
                    slot = self._gpu.pop(adapter.name)
                elif free:
                    slot = free.pop()
                else:
                    victim = evictable.pop(0)
                    slot = self._gpu.pop(victim)
                    self.events["evict", "gpu"] += 1
                started = time.perf_counter()
                self._write_slot(slot, adapter)
                self.load_seconds["host_to_gpu"].append(time.perf_counter() - started)
                self._gpu[adapter.name] = slot
                result[adapter.name] = slot
            return result

    def _write_slot(self, slot: int, adapter: LoraAdapter) -> None:
        for name in self.shapes:
            module = adapter.modules.get(name)
            a, b = self.a[name][slot], self.b[name][slot]
            if module is None:
                a.zero_()
                b.zero_()
                self.scales[name][slot] = 0.0
                continue
            r = module.rank
            a[:r].copy_(module.a, non_blocking=True)
            a[r:].zero_()
            b[:, :r].copy_(module.b, non_blocking=True)
            b[:, r:].zero_()
            self.scales[name][slot] = module.scale
        self.ranks[slot] = adapter.rank
        self._slot_owner[slot] = adapter
        self.loads["gpu"] += 1

    def preload(self, names: Optional[Iterable[str]] = None) -> list[str]:
        """Load adapters ahead of traffic: the named ones, or every folder of the root, as far as
        the host tier holds them; the first ``gpu_slots`` of them also go to the GPU.
        Returns the loaded names; a refused adapter is logged and skipped."""
        if names is None:
            names = sorted(p.name for p in self.root.iterdir() if (p / "adapter_model.safetensors").is_file())
        loaded = []
        for name in names:
            if len(loaded) >= self.host_slots:
                break
            try:
                loaded.append(self.get(name))
            except AdapterError as exc:
                logger.warning("preload: %s", exc.message)
        self.acquire(loaded[: self.gpu_slots])
        return [a.name for a in loaded]

    def clear(self) -> None:
        """Forget every resident adapter (both tiers); the slot tensors are kept."""
        with self._lock:
            self._host.clear()
            self._gpu.clear()
            self._slot_owner = [None] * self.gpu_slots
            self.loads = {"disk": 0, "gpu": 0}

    def owner(self, slot: int) -> Optional[LoraAdapter]:
        return self._slot_owner[slot]

    def drain_load_seconds(self) -> dict[str, list[float]]:
        """Load latencies recorded since the last drain (for histograms)."""
        with self._lock:
            drained = self.load_seconds
            self.load_seconds = {"disk_to_host": [], "host_to_gpu": []}
            return drained

    def resident(self) -> dict[str, list[str]]:
        with self._lock:
            return {"gpu": list(self._gpu), "host": list(self._host)}


def plan_waves(adapter_names: Iterable[Optional[str]], gpu_slots: int) -> list[set[str]]:
    """Split the distinct adapters of a batch into waves of at most ``gpu_slots``."""
    distinct = sorted({n for n in adapter_names if n})
    return [set(distinct[i : i + gpu_slots]) for i in range(0, len(distinct), gpu_slots)] or [set()]
