"""Adapter store: adapter folders on disk -> parsed adapters in host memory -> GPU slots.

Tiers, each LRU:

- **GPU slots** are stacked tensors per LoRA target, preallocated at ``max_lora_rank``:
  ``a[name]`` is ``[slots, R_max, in]`` and ``b[name]`` is ``[slots, out, R_max]``; an adapter
  occupies one slot index across all targets (zeros where it has no module, so its update
  there is exactly zero).
- **Host** adapters are kept in the serving dtype, packed into one buffer per adapter, in
  page-locked memory when the slots live on a GPU. They are converted once, when read: a
  slot receives exactly the values it would have rounded a float32 copy to, and a 16-bit
  host tier takes half the memory of a float32 one.
- **Disk**: an adapter is looked up on every use (a stat, no read). A new folder is
  servable on its first request, a changed one (config or weights) is reloaded, a removed
  one answers NOT_FOUND.

Loading. ``get`` is the request path: a hit, or a wait for the load of that adapter
already in flight, or a load on the calling thread (a request never queues behind
background work). ``prefetch`` starts loads on a small thread pool and returns at once;
``preload`` uses it to fill the tiers ahead of traffic. A refused adapter is an error for
whoever waits on it and is never cached. One lock guards both LRUs, the slot table and the
counters; disk reads and parsing run outside it, so ``get``, ``prefetch``, ``preload`` and
``evict`` may be called from any thread.

GPU slots. ``acquire`` gives one wave of a batch its slots. Those slots stay pinned until
the next ``acquire`` (they are the batch in flight): ``preload`` and ``evict`` from other
threads never overwrite them, so a batch that needs more distinct adapters than there are
slots is served in waves by the engine (``plan_waves``), never refused. On CUDA the
host->GPU copies are issued with ``non_blocking=True`` on a side stream. Before it
overwrites a slot, the side stream waits on an event recorded on the compute stream after
the last batch that read that slot (its kernels may still be queued); the compute stream
waits on the copy's event before the batch that uses the slot. Copies for other slots
(a preload) overlap the batch in flight. On the CPU every copy is synchronous.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
import weakref
from collections import Counter, OrderedDict, deque
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Iterable, Mapping, Optional

import numpy as np
import torch

from manylora.lora.adapter import (
    AdapterError,
    AdapterLocator,
    LoraAdapter,
    LoraModule,
    all_finite,
    load_adapter,
)

logger = logging.getLogger(__name__)
REFUSALS_KEPT = 4096  # refused adapter folders remembered (until their files change), least recent out first
REFUSALS_BYTES = 4 << 20  # ... and at most this much of their ids, paths and messages

LOAD_WORKERS = 2  # background disk -> host loader threads per store
# deadline of a batch's wait for one adapter's load (config adapter_load_timeout): a load stuck in
# the kernel (a hung network file system) fails the requests that need it, not the whole stage
LOAD_TIMEOUT_S = 10.0


def slot_bytes(shapes: Mapping[str, tuple[int, int]], max_rank: int, dtype: torch.dtype) -> int:
    """Bytes of one GPU slot: A [R, in] and B [out, R] for every LoRA-able linear."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return sum(max_rank * (i + o) for i, o in shapes.values()) * itemsize


def adapter_bytes(adapter: LoraAdapter) -> int:
    """Host memory of an adapter's weights: its packed slot-layout buffer once in the host tier,
    else its modules at their own ranks and dtype."""
    if adapter.packed is not None:
        return adapter.packed.numel() * adapter.packed.element_size()
    return sum(m.a.numel() * m.a.element_size() + m.b.numel() * m.b.element_size() for m in adapter.modules.values())


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _available_host_memory() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


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
        load_workers: int = LOAD_WORKERS,
        load_timeout: Optional[float] = LOAD_TIMEOUT_S,
    ):
        per_slot = slot_bytes(shapes, max_rank, dtype)
        if gpu_slots < 1:
            raise ValueError(f"max_gpu_adapters must be >= 1, got {gpu_slots}")
        if host_slots < gpu_slots:
            raise ValueError(
                f"max_cpu_adapters ({host_slots}) must be >= max_gpu_adapters ({gpu_slots}): the adapters in GPU "
                f"slots stay in host memory too. At rank {max_rank} in {dtype}, one adapter takes up to "
                f"{per_slot / 2**20:.1f} MiB, so {gpu_slots} host slots need up to {_gib(gpu_slots * per_slot)} "
                f"of host memory (and {_gib(gpu_slots * per_slot)} of {device} memory for the GPU slots)"
            )
        need = per_slot * gpu_slots
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            if need > 0.8 * free:
                raise MemoryError(
                    f"{gpu_slots} GPU adapter slots at rank {max_rank} need {_gib(need)}; "
                    f"{_gib(free)} is free: lower max_gpu_adapters or max_lora_rank"
                )
        host_bound = per_slot * host_slots
        logger.info(
            "adapter slots: %d on %s at rank %d take %s; the host tier holds %d adapters in %s, up to %s",
            gpu_slots,
            device,
            max_rank,
            _gib(need),
            host_slots,
            dtype,
            _gib(host_bound),
        )
        available = _available_host_memory()
        if available is not None and host_bound > available:
            logger.warning(
                "the host tier (%d adapters) can take up to %s at rank %d, more than the %s of host memory "
                "available now; lower max_cpu_adapters unless the adapters' ranks are well below max_lora_rank",
                host_slots,
                _gib(host_bound),
                max_rank,
                _gib(available),
            )
        self.root = None if root is None else Path(root)
        self._locator = None if root is None else AdapterLocator(self.root)
        self.shapes = dict(shapes)
        self.max_rank = max_rank
        self.gpu_slots = gpu_slots
        self.host_slots = host_slots
        self.device = device
        self.dtype = dtype
        # One slab row per GPU slot holds every module's A [R, in] and B [out, R] back to back, in
        # the same layout as an adapter's packed host buffer: a slot is filled by one copy.
        # self.a / self.b are per-module strided views [slots, R, in] / [slots, out, R] into it.
        self._offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for n, (i, o) in shapes.items():
            self._offsets[n] = (offset, offset + max_rank * i)
            offset += max_rank * (i + o)
        self.slot_numel = offset
        self._slab = torch.zeros(gpu_slots, self.slot_numel, device=device, dtype=dtype)
        self.a = {
            n: self._slab[:, oa : oa + max_rank * shapes[n][0]].unflatten(1, (max_rank, shapes[n][0]))
            for n, (oa, _) in self._offsets.items()
        }
        self.b = {
            n: self._slab[:, ob : ob + max_rank * shapes[n][1]].unflatten(1, (shapes[n][1], max_rank))
            for n, (_, ob) in self._offsets.items()
        }
        # scales [modules, slots]: each module's row is contiguous for the kernels
        self._scale_table = torch.zeros(len(shapes), gpu_slots, device=device, dtype=torch.float32)
        self.scales = {n: self._scale_table[k] for k, n in enumerate(shapes)}
        self.scale_rows = {n: k for k, n in enumerate(shapes)}  # module -> its row of scale_table
        self.ranks = torch.zeros(gpu_slots, device=device, dtype=torch.int32)
        self.pin_memory = device.type == "cuda"
        self._lock = threading.Lock()
        self._host: OrderedDict[str, LoraAdapter] = OrderedDict()  # LRU, most recent last
        self._host_bytes: dict[str, int] = {}
        self._loading: dict[str, Future] = {}  # adapter id -> its load in flight (queued or running)
        self._gpu: OrderedDict[str, int] = OrderedDict()  # adapter id -> slot, LRU
        self._slot_owner: list[Optional[LoraAdapter]] = [None] * gpu_slots  # whose weights each slot holds
        self._pinned: frozenset[int] = frozenset()  # slots of the batch in flight (the last acquire)
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._compute_stream = None  # the stream of the last acquire
        self._slot_ready: dict[int, torch.cuda.Event] = {}  # slot -> event of its last copy
        self._slot_used: dict[int, torch.cuda.Event] = {}  # slot -> event after the last batch that read it
        self._copy_timings: deque = deque(maxlen=4096)  # (start, end) CUDA events of copies not yet measured
        self._pin_warned = False
        self._executor = ThreadPoolExecutor(max_workers=load_workers, thread_name_prefix="manylora-adapter-load")
        # a batch waits at most this long for one adapter's disk load (None: no deadline, loads may
        # run in the caller's thread); the load goes on, and its adapter serves later requests
        self.load_timeout = load_timeout
        weakref.finalize(self, self._executor.shutdown, wait=False, cancel_futures=True)
        # adapter id -> (folder, fingerprint, code, message): a refused folder is not read again until it
        # changes. Only strings are kept, never the exception (its traceback holds the file's bytes)
        self._refused: OrderedDict[str, tuple[Path, tuple, str, str]] = OrderedDict()
        self._refused_bytes = 0
        self.loads = {"disk": 0, "gpu": 0}
        # for metrics: ("hit" | "miss" | "evict", "host" | "gpu") -> count, and load latencies (s)
        self.events: Counter = Counter()
        self.load_seconds: dict[str, list[float]] = {"disk_to_host": [], "host_to_gpu": []}

    @property
    def gpu_bytes(self) -> int:
        return self._slab.numel() * self._slab.element_size()

    @property
    def scale_table(self) -> torch.Tensor:
        """Every module's scale per slot, float32 [modules, slots] (row of a module: scale_rows)."""
        return self._scale_table

    @property
    def host_bytes(self) -> int:
        """Host memory of the adapters in the host tier."""
        with self._lock:
            return sum(self._host_bytes.values())

    # ------------------------------------------------------------------ host tier
    def get(self, adapter_id: str) -> LoraAdapter:
        """The parsed adapter (from host memory, or disk when new or changed); raises AdapterError.

        Waits only for this adapter's own load when one is already in flight."""
        folder, fingerprint = self._locate(adapter_id)
        refused = self._refusal(adapter_id, folder, fingerprint)
        if refused is not None:
            raise refused
        counted = False
        while True:
            with self._lock:
                cached = self._fresh(adapter_id, folder, fingerprint)
                if cached is not None:
                    self._host.move_to_end(adapter_id)
                    if not counted:
                        self.events["hit", "host"] += 1
                    return cached
                future = self._loading.get(adapter_id)
                joined = future is not None and future.fingerprint == fingerprint and not future.cancelled()
                if not joined:
                    future = self._new_load(adapter_id, folder, fingerprint)
                if not counted:  # a host miss is a disk load; whoever started it (get or prefetch) counts it
                    if not joined:
                        self.events["miss", "host"] += 1
                    counted = True
                # a new load, or one still queued behind others: this request runs it now rather
                # than wait for a loader thread
                claimed = future.set_running_or_notify_cancel() if not (future.running() or future.done()) else False
            if claimed and self.load_timeout is None:
                self._load(adapter_id, folder, future)
            elif claimed:  # on a thread of its own, so that the wait below has a deadline
                threading.Thread(
                    target=self._load, args=(adapter_id, folder, future), name="manylora-adapter-load", daemon=True
                ).start()
            try:
                adapter = future.result(timeout=self.load_timeout)
            except CancelledError:  # evicted while queued: load it again
                continue
            except FutureTimeout:
                raise AdapterError(
                    "UNAVAILABLE",
                    f"adapter {adapter_id!r} did not load within {self.load_timeout:g} s (adapter_load_timeout); "
                    "its load goes on: retry later",
                ) from None
            if claimed or adapter.fingerprint == fingerprint:
                return adapter
            # the load we waited for read an older version: look at the folder again
            folder, fingerprint = self._locate(adapter_id)

    def prefetch(self, adapter_ids: Iterable[Optional[str]]) -> dict[str, Future]:
        """Start loading what is not in host memory yet, on the loader threads; returns at once.

        One future (its LoraAdapter, or its AdapterError) per distinct id that is not in host
        memory. Ids already there get none and cost a dict lookup: they are marked most recent,
        so that the loads started here do not evict them, and are not looked up on disk again
        (``get`` does that when it is used)."""
        ids = dict.fromkeys(n for n in adapter_ids if n)
        with self._lock:
            missing = []
            for name in ids:
                if name in self._host:
                    self._host.move_to_end(name)
                else:
                    missing.append(name)
        return {name: self._prefetch(name, verify=False, count_miss=True) for name in missing}

    def _prefetch(self, adapter_id: str, verify: bool, count_miss: bool = False) -> Future:
        # count_miss: a load started for requests (a batch's prefetch) is their host miss;
        # a preload (control model, preload_adapters) is not a request and counts none
        if not verify:
            with self._lock:
                cached = self._host.get(adapter_id)
                if cached is not None:
                    self._host.move_to_end(adapter_id)
                    return _done(cached)
                if adapter_id in self._loading:
                    return self._loading[adapter_id]
        try:
            folder, fingerprint = self._locate(adapter_id)
        except AdapterError as exc:
            return _failed(exc)
        refused = self._refusal(adapter_id, folder, fingerprint)
        if refused is not None:
            return _failed(refused)
        with self._lock:
            cached = self._fresh(adapter_id, folder, fingerprint)
            if cached is not None:
                self._host.move_to_end(adapter_id)
                return _done(cached)
            future = self._loading.get(adapter_id)
            if future is not None and future.fingerprint == fingerprint and not future.cancelled():
                return future
            future = self._new_load(adapter_id, folder, fingerprint)
            if count_miss:
                self.events["miss", "host"] += 1
            try:
                self._executor.submit(self._load_queued, adapter_id, folder, future)
            except RuntimeError:  # closed: the caller's own get() still loads it
                del self._loading[adapter_id]
                future.cancel()
        return future

    def _locate(self, adapter_id: str) -> tuple[Path, Optional[tuple]]:
        if self.root is None:
            raise AdapterError("NOT_FOUND", f"unknown adapter {adapter_id!r}: this model has no adapter directory")
        return self._locator(adapter_id)

    def _refusal(self, adapter_id: str, folder: Path, fingerprint) -> Optional[AdapterError]:
        """The refusal of this exact folder content, if it was refused before (a fresh copy)."""
        with self._lock:
            entry = self._refused.get(adapter_id)
            if entry is None or fingerprint is None or entry[:2] != (folder, fingerprint):
                return None
            self._refused.move_to_end(adapter_id)
            return AdapterError(entry[2], entry[3])

    @staticmethod
    def _refusal_size(adapter_id: str, entry: tuple) -> int:
        return len(adapter_id) + 2 * len(str(entry[0])) + len(entry[3]) + 512  # strings, Path, tuples, entry

    def _remember_refusal(self, adapter_id: str, entry: tuple) -> None:
        """Under the lock: keep a refusal, within REFUSALS_KEPT entries and REFUSALS_BYTES."""
        self._forget_refusal(adapter_id)
        self._refused[adapter_id] = entry
        self._refused_bytes += self._refusal_size(adapter_id, entry)
        while len(self._refused) > REFUSALS_KEPT or self._refused_bytes > REFUSALS_BYTES:
            old_id, old = self._refused.popitem(last=False)
            self._refused_bytes -= self._refusal_size(old_id, old)

    def _forget_refusal(self, adapter_id: str) -> None:
        old = self._refused.pop(adapter_id, None)
        if old is not None:
            self._refused_bytes -= self._refusal_size(adapter_id, old)

    def _fresh(self, adapter_id: str, folder: Path, fingerprint) -> Optional[LoraAdapter]:
        cached = self._host.get(adapter_id)
        if (
            cached is not None
            and fingerprint is not None
            and cached.fingerprint == fingerprint
            and cached.path == folder
        ):
            return cached
        return None

    def _new_load(self, adapter_id: str, folder: Path, fingerprint) -> Future:
        superseded = self._loading.get(adapter_id)
        if superseded is not None:
            superseded.cancel()  # only a queued one; a running one finishes but is not cached
        future: Future = Future()
        future.fingerprint = fingerprint  # what the folder looked like when the load was asked for
        self._loading[adapter_id] = future
        return future

    def _load_queued(self, adapter_id: str, folder: Path, future: Future) -> None:
        with self._lock:
            if future.running() or future.done() or not future.set_running_or_notify_cancel():
                return  # a request claimed it, or it was evicted before it started
        self._load(adapter_id, folder, future)

    def _load(self, adapter_id: str, folder: Path, future: Future) -> None:
        """Read, check and convert one adapter, then publish it (host tier and future)."""
        started = time.perf_counter()
        try:
            adapter = self._to_host(load_adapter(adapter_id, folder, self.shapes, self.max_rank, self.root))
        except BaseException as exc:
            if isinstance(exc, AdapterError):
                # a fresh error, without the traceback of the load (whose frames hold the file's bytes)
                exc = AdapterError(exc.code, exc.message)
            with self._lock:
                if self._loading.get(adapter_id) is future:
                    del self._loading[adapter_id]
                if isinstance(exc, AdapterError) and exc.code == "INVALID_ARG" and future.fingerprint is not None:
                    self._remember_refusal(adapter_id, (folder, future.fingerprint, exc.code, exc.message))
            if not isinstance(exc, AdapterError):
                logger.exception("loading adapter %r failed", adapter_id)
            future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        with self._lock:
            self.load_seconds["disk_to_host"].append(time.perf_counter() - started)
            self.loads["disk"] += 1
            self._forget_refusal(adapter_id)
            if self._loading.get(adapter_id) is future:  # not evicted or superseded meanwhile
                del self._loading[adapter_id]
                self._host[adapter_id] = adapter
                self._host.move_to_end(adapter_id)
                self._host_bytes[adapter_id] = adapter_bytes(adapter)
                self._trim_host(keep=adapter_id)
        future.set_result(adapter)

    def _to_host(self, adapter: LoraAdapter) -> LoraAdapter:
        """The adapter in the serving dtype, packed in GPU-slot layout into one (page-locked on
        CUDA) buffer, zero beyond each module's rank and for modules it leaves out."""
        # Whole-adapter work (per-module torch ops cost ~35 ms per adapter, for a fleet of 1,024 at
        # start-up): at most one conversion to the serving dtype, rounded as a copy_ of the float32
        # weights would round them, then numpy slice copies of the raw bits (numpy has no bfloat16).
        source = adapter.weights
        if source.dtype != self.dtype:
            source = source.to(self.dtype)
            if self.dtype != torch.float32 and not all(map(torch.isfinite, torch.aminmax(source))):
                bad = next(
                    p
                    for p, m in adapter.modules.items()
                    if not (all_finite(m.a.to(self.dtype)) and all_finite(m.b.to(self.dtype)))
                )
                raise AdapterError(
                    "INVALID_ARG",
                    f"adapter {adapter.name!r} cannot be served: {bad} holds weights beyond the {self.dtype} range",
                )
        self._check_scaled_range(adapter)
        buffer = self._host_buffer(self.slot_numel)
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[buffer.element_size()]
        src, dst = source.view(bits).numpy(), buffer.view(bits).numpy()
        base, r_max = buffer.storage_offset(), self.max_rank
        packed, scales = {}, [0.0] * len(self.shapes)
        for k, (name, (in_features, out_features)) in enumerate(self.shapes.items()):
            oa, ob = self._offsets[name]
            module = adapter.modules.get(name)
            if module is None:
                dst[oa : ob + out_features * r_max] = 0
                continue
            r, (sa, sb) = module.rank, adapter.offsets[name]
            dst[oa : oa + r * in_features] = src[sa : sa + r * in_features]
            dst[oa + r * in_features : ob] = 0
            b = dst[ob : ob + out_features * r_max].reshape(out_features, r_max)
            b[:, :r] = src[sb : sb + out_features * r].reshape(out_features, r)
            b[:, r:] = 0
            packed[name] = LoraModule(
                buffer.as_strided((r, in_features), (in_features, 1), base + oa),
                buffer.as_strided((out_features, r), (r_max, 1), base + ob),
                module.scale,
            )
            scales[k] = module.scale
        return dataclasses.replace(
            adapter,
            modules=packed,
            packed=buffer,
            scale_vector=torch.tensor(scales, dtype=torch.float32),
            weights=None,  # the file's copy is not kept in the host tier
            offsets=None,
        )

    def _check_scaled_range(self, adapter) -> None:
        """Refuse an adapter whose scale, or whose B weights times its scale, are not finite in
        the serving dtype (a ``lora_alpha`` far above float32's range made batch-mates' answers
        NaN through inf x 0). One whole-adapter bound first; modules only when it is exceeded."""
        limit = float(torch.finfo(self.dtype).max)
        scales = {name: module.scale for name, module in adapter.modules.items()}
        for name, scale in scales.items():
            # a scale beyond float32's range is refused before its float32 cast, which numpy warns about
            too_large = not math.isfinite(scale) or abs(scale) > float(np.finfo(np.float32).max)
            if too_large or abs(float(np.float32(scale))) > limit:
                raise AdapterError(
                    "INVALID_ARG",
                    f"adapter {adapter.name!r} cannot be served: {name} has a scale beyond float32's range",
                )
        low, high = torch.aminmax(adapter.weights)
        peak = max(abs(float(low)), abs(float(high)))
        if peak * max((abs(v) for v in scales.values()), default=0.0) <= limit:
            return
        for name, module in adapter.modules.items():
            if float(module.b.abs().max()) * abs(module.scale) > limit:
                raise AdapterError(
                    "INVALID_ARG",
                    f"adapter {adapter.name!r} cannot be served: {name} scaled by {module.scale:.3g} "
                    f"exceeds the {self.dtype} range",
                )

    def _host_buffer(self, numel: int) -> torch.Tensor:
        if self.pin_memory:
            try:
                return torch.empty(numel, dtype=self.dtype, pin_memory=True)
            except RuntimeError as exc:
                if not self._pin_warned:
                    self._pin_warned = True
                    logger.warning("page-locked host memory unavailable (%s); host->GPU copies are synchronous", exc)
        return torch.empty(numel, dtype=self.dtype)

    def _trim_host(self, keep: str) -> None:
        """Evict least recently used host adapters beyond ``host_slots``; those in GPU slots last."""
        on_gpu = {id(self._slot_owner[s]) for s in self._gpu.values()}
        while len(self._host) > self.host_slots:
            candidates = [n for n in self._host if n != keep]
            victim = next((n for n in candidates if id(self._host[n]) not in on_gpu), candidates[0])
            del self._host[victim]
            del self._host_bytes[victim]
            self.events["evict", "host"] += 1

    # ------------------------------------------------------------------ GPU tier
    def acquire(self, adapters: Iterable[LoraAdapter]) -> dict[str, int]:
        """GPU slots for at most ``gpu_slots`` distinct adapters (one wave), loading what is missing.

        Slots of the adapters asked for are not evicted by this call, and stay pinned until the
        next ``acquire`` (they are the batch in flight); the least recently used other slots are
        evicted. On CUDA the current stream waits for the copies before the batch runs.
        """
        wanted = {a.name: a for a in adapters}
        assert len(wanted) <= self.gpu_slots, f"{len(wanted)} adapters > {self.gpu_slots} GPU slots: plan waves"
        with self._lock:
            if self._copy_stream is not None:
                self._compute_stream = torch.cuda.current_stream(self.device)
            self._unpin()  # the previous batch is done (on the host side)
            result = self._assign(wanted)
            self._pinned = frozenset(result.values())
            if self._copy_stream is not None:
                for slot in result.values():
                    event = self._slot_ready.pop(slot, None)
                    if event is not None:
                        self._compute_stream.wait_event(event)
            return result

    def _unpin(self) -> None:
        if self._pinned and self._copy_stream is not None:  # the pinned batch's kernels are all queued by now
            queued = (self._compute_stream or torch.cuda.current_stream(self.device)).record_event()
            for slot in self._pinned:
                self._slot_used[slot] = queued
        self._pinned = frozenset()

    def _assign(self, wanted: Mapping[str, LoraAdapter], place_all: bool = True) -> dict[str, int]:
        """Slots for ``wanted`` (under the lock), never touching pinned slots; with
        ``place_all=False`` the adapters that find no slot are left out."""
        result, missing = {}, []
        for name, adapter in wanted.items():
            slot = self._gpu.get(name)
            if slot is not None and self._slot_owner[slot] is adapter:
                self._gpu.move_to_end(name)
                result[name] = slot
                self.events["hit", "gpu"] += 1
            else:
                missing.append(adapter)
                self.events["miss", "gpu"] += 1
        if not missing:  # every adapter has its slot: no walk over all gpu_slots (1,024 each) below
            return result
        mapped = set(self._gpu.values())
        free = [s for s in range(self.gpu_slots) if s not in mapped and s not in self._pinned]
        evictable = [n for n, s in self._gpu.items() if n not in wanted and s not in self._pinned]  # LRU order
        writes = []
        for adapter in missing:
            stale = self._gpu.pop(adapter.name, None)
            if stale is not None and stale not in self._pinned:  # old copy of a changed adapter: reuse its slot
                slot = stale
            elif free:
                slot = free.pop()
            elif evictable:
                slot = self._gpu.pop(evictable.pop(0))
                self.events["evict", "gpu"] += 1
            else:
                assert not place_all, "no GPU slot left for a wave within gpu_slots"
                if stale is not None:
                    self._gpu[adapter.name] = stale
                break
            writes.append((slot, adapter))
            self._gpu[adapter.name] = slot
            result[adapter.name] = slot
        self._write_slots(writes)
        return result

    def _write_slots(self, writes: list[tuple[int, LoraAdapter]]) -> None:
        if not writes:
            return
        stream = self._copy_stream
        if stream is None:
            for slot, adapter in writes:
                started = time.perf_counter()
                self._write_slot(slot, adapter)
                self.load_seconds["host_to_gpu"].append(time.perf_counter() - started)
            return
        with torch.cuda.stream(stream):
            for slot, adapter in writes:
                used = self._slot_used.pop(slot, None)
                if used is not None:  # kernels of an earlier batch may still read this slot
                    stream.wait_event(used)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(stream)
                self._write_slot(slot, adapter)
                end.record(stream)
                self._slot_ready[slot] = end
                self._copy_timings.append((start, end))

    def _write_slot(self, slot: int, adapter: LoraAdapter) -> None:
        # every adapter reaches the GPU from the host tier, packed by _to_host
        self._slab[slot].copy_(adapter.packed, non_blocking=True)
        self._scale_table[:, slot].copy_(adapter.scale_vector, non_blocking=True)
        self.ranks[slot] = adapter.rank
        self._slot_owner[slot] = adapter
        self.loads["gpu"] += 1

    # ------------------------------------------------------------------ fleet operations
    def preload(self, names: Optional[Iterable[str]] = None) -> list[str]:
        """Load adapters ahead of traffic: the named ones, or every folder of the root, as far as
        the host tier holds them; the first ``gpu_slots`` of them also go to the GPU (slots of a
        batch in flight excepted). Returns the loaded names; a refused adapter is logged and skipped."""
        return self.preload_report(names)["loaded"]

    def preload_report(self, names: Optional[Iterable[str]] = None) -> dict:
        """``preload``, answering {"loaded", "refused" (id -> message), "skipped" (beyond the
        host tier), "gpu" (those now in GPU slots)}. Loads run on the loader threads, as many at
        once as the host tier has room for."""
        if names is None:
            names = self.servable()
        pending = list(dict.fromkeys(names))
        loaded: list[LoraAdapter] = []
        refused: dict[str, str] = {}
        in_flight: list[tuple[str, Future]] = []
        while pending or in_flight:
            while pending and len(loaded) + len(in_flight) < self.host_slots:
                name = pending.pop(0)
                in_flight.append((name, self._prefetch(name, verify=True)))
            if not in_flight:
                break
            name, future = in_flight.pop(0)
            try:
                loaded.append(future.result())
            except AdapterError as exc:
                refused[name] = exc.message
                logger.warning("preload: %s", exc.message)
            except CancelledError:
                refused[name] = f"adapter {name!r} was evicted while it loaded"
        with self._lock:
            placed = self._assign({a.name: a for a in loaded[: self.gpu_slots]}, place_all=False)
        return {"loaded": [a.name for a in loaded], "refused": refused, "skipped": pending, "gpu": list(placed)}

    def servable(self) -> list[str]:
        """Adapter folders of the root (those with a weights file), sorted."""
        if self.root is None:
            return []
        return sorted(
            p.name
            for p in self.root.iterdir()
            if not p.name.startswith(".") and (p / "adapter_model.safetensors").is_file()
        )

    def evict(self, names: Iterable[str]) -> list[str]:
        """Forget these adapters in both tiers and cancel their loads; returns those that were
        resident or loading. A slot of the batch in flight keeps its weights until the batch is done."""
        evicted = []
        with self._lock:
            for name in dict.fromkeys(names):
                found = self._host.pop(name, None) is not None
                self._host_bytes.pop(name, None)
                future = self._loading.pop(name, None)
                if future is not None:
                    future.cancel()
                    found = True
                found = self._gpu.pop(name, None) is not None or found
                if found:
                    evicted.append(name)
        return evicted

    def clear(self) -> None:
        """Forget every resident adapter (both tiers) and cancel queued loads; the slot tensors are kept."""
        with self._lock:
            for future in self._loading.values():
                future.cancel()
            self._loading.clear()
            self._host.clear()
            self._host_bytes.clear()
            self._gpu.clear()
            self._slot_owner = [None] * self.gpu_slots
            self._unpin()
            self.loads = {"disk": 0, "gpu": 0}

    def close(self) -> None:
        """Stop the loader threads (queued loads are cancelled); ``get`` still works."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            for name, future in list(self._loading.items()):
                if future.cancel():
                    del self._loading[name]
        self._executor.shutdown(wait=True)

    # ------------------------------------------------------------------ introspection
    def owner(self, slot: int) -> Optional[LoraAdapter]:
        """The adapter whose weights slot ``slot`` holds."""
        return self._slot_owner[slot]

    def pinned(self, adapters: Iterable[LoraAdapter], slots: Iterable[int]) -> bool:
        """Whether each adapter still holds its slot, pinned by the last ``acquire`` (False once
        another ``acquire`` has come between: the slot may have been given to another adapter)."""
        with self._lock:
            return all(s in self._pinned and self._slot_owner[s] is a for a, s in zip(adapters, slots))

    def in_host(self, names: Iterable[str]) -> bool:
        """Whether every adapter named is in host memory now (``get`` will not wait for a load)."""
        with self._lock:
            return all(name in self._host for name in names)

    def drain_load_seconds(self) -> dict[str, list[float]]:
        """Load latencies recorded since the last drain (for histograms). On CUDA a host->GPU
        latency is the copy's own time on the side stream, counted once the copy has finished."""
        with self._lock:
            drained = self.load_seconds
            self.load_seconds = {"disk_to_host": [], "host_to_gpu": []}
            while self._copy_timings and self._copy_timings[0][1].query():  # copies finish in order
                start, end = self._copy_timings.popleft()
                drained["host_to_gpu"].append(start.elapsed_time(end) / 1000.0)
            return drained

    def host_adapters(self) -> list[LoraAdapter]:
        """The adapters in host memory now (least recent first)."""
        with self._lock:
            return list(self._host.values())

    def resident(self, *, ignored: bool = False) -> dict:
        """Adapter ids in GPU slots and in host memory (least recent first). With ``ignored``, also
        ``"ignored"``: resident adapter id -> the modules whose tensors its file holds but its
        config does not select (PEFT ignores them, and so do we), for the adapters that have any;
        at most 64 modules each, then ``"... and N more"``."""
        with self._lock:
            answer: dict = {"gpu": list(self._gpu), "host": list(self._host)}
            if ignored:
                adapters = {name: self._slot_owner[slot] for name, slot in self._gpu.items()}
                adapters.update(self._host)
                answer["ignored"] = {
                    name: list(a.ignored[:64])
                    + ([f"... and {len(a.ignored) - 64} more"] if len(a.ignored) > 64 else [])
                    for name, a in sorted(adapters.items())
                    if a is not None and a.ignored
                }
            return answer

    def loading(self) -> list[str]:
        """Adapters whose load is queued or running."""
        with self._lock:
            return list(self._loading)

    def stats(self) -> dict:
        """A JSON-ready snapshot: capacity, residents, counters, memory."""
        with self._lock:
            return {
                "slots": {"gpu": self.gpu_slots, "host": self.host_slots},
                "resident": {"gpu": len(self._gpu), "host": len(self._host)},
                "loading": len(self._loading),
                "events": {t: {e: self.events[e, t] for e in ("hit", "miss", "evict")} for t in ("host", "gpu")},
                "loads": dict(self.loads),
                "bytes": {"gpu_slots": self.gpu_bytes, "host": sum(self._host_bytes.values())},
                "dtype": str(self.dtype).removeprefix("torch."),
                "max_rank": self.max_rank,
                "pinned_host_memory": self.pin_memory and not self._pin_warned,
            }


def _done(adapter: LoraAdapter) -> Future:
    future: Future = Future()
    future.set_result(adapter)
    return future


def _failed(exc: BaseException) -> Future:
    future: Future = Future()
    future.set_exception(exc)
    return future


def plan_waves(adapter_names: Iterable[Optional[str]], gpu_slots: int) -> list[set[str]]:
    """Split the distinct adapters of a batch into waves of at most ``gpu_slots``."""
    distinct = sorted({n for n in adapter_names if n})
    return [set(distinct[i : i + gpu_slots]) for i in range(0, len(distinct), gpu_slots)] or [set()]
