"""In-process engine benchmark: every mode measured in the same run, reported as ratios too.

Modes
  base      ManyLoRA engine, no adapter on any request (the no-LoRA ceiling)
  manylora  ManyLoRA engine, a random adapter per request (uniform or Zipf) out of N
  hotswap   the path users run today: GLiNER2 + PEFT, one adapter active per forward behind a
            25-adapter LRU and one lock, loading from disk on a miss (time-capped: it is slow)
  peft-mixed  GLiNER2 + PEFT's own mixed batching (``adapter_names`` per row), every adapter in
            flight preloaded into one PeftModel; only where they fit (adapters in flight <=
            --peft-mixed-max, default 32) and only when asked for (not in the default --modes)

Each mode runs closed-loop batches of --batch requests (what Triton's dynamic batcher hands
execute()), after warm-up; it reports req/s, batch latency p50/p95/p99, and the split of
time into pre (validate + tokenize), core (encoder) and post (heads + decoding).

The physical limit (``limits.py``): the dense GEMM rate of this device is measured once per
run and written as its own line (``"mode": "gemm_rate"``); every mode's line also carries
the FLOPs of its average request (encoder, heads and its adapter's LoRA), the TFLOP/s that
makes at its req/s, and that as a fraction of the GEMM rate.

    python perf/bench_engine.py --checkpoint models/demo-base --adapters models/bench-adapters \\
        --adapters-in-flight 1 8 32 128 1024 --out perf/results/engine.jsonl
    python perf/bench_engine.py --smoke --out /tmp/engine.jsonl      # CPU, tiny, seconds
    python perf/bench_engine.py ... --modes base manylora peft-mixed --adapters-in-flight 1 8 32
    python perf/plot.py perf/results/engine.jsonl --png engine.png --md engine.md
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Optional

import torch
from limits import RequestShape, adapter_bytes, adapter_ranks, flop_breakdown, measure_gemm_rate

MODES = ("base", "manylora", "hotswap", "peft-mixed")
ENTITY_SCHEMA = {"entities": ["person", "organization", "location", "date", "product"]}
MIXED_SCHEMA = {
    "classifications": [{"task": "sentiment", "labels": ["positive", "negative", "neutral"]}],
    "relations": ["works_for", "located_in"],
}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def pick_adapters(names, n_requests, distribution, seed):
    rng = random.Random(seed)
    if distribution == "uniform":
        return [rng.choice(names) for _ in range(n_requests)]
    weights = [1.0 / (rank + 1) ** 1.1 for rank in range(len(names))]  # Zipf(1.1)
    return rng.choices(names, weights=weights, k=n_requests)


def _timings(n: int, elapsed: float, errors: int, latencies: list, split: dict) -> dict:
    """The fields every mode reports: counts, req/s, batch latency percentiles, time split."""
    return {
        "requests": n,
        "seconds": elapsed,
        "req_per_s": n / elapsed,
        "errors": errors,
        "batch_p50_ms": 1e3 * _percentile(latencies, 50),
        "batch_p95_ms": 1e3 * _percentile(latencies, 95),
        "batch_p99_ms": 1e3 * _percentile(latencies, 99),
        "split_s": {k: round(v, 4) for k, v in split.items()},
    }


def _found(answer: dict) -> int:
    """How many items (spans, labels, relations) an answer holds: decoding work scales with it.

    An item is a leaf under a task of the answer: a non-empty string or a number, a relation
    tuple, or a dict of plain values (``{"text", "confidence", ...}``)."""
    return sum(_items(value) for value in answer.values())


def _items(value) -> int:
    containers = (dict, list, tuple)
    if isinstance(value, dict):
        if not any(isinstance(v, containers) for v in value.values()):
            return 1 if value else 0  # one item with fields
        return sum(_items(v) for v in value.values())
    if isinstance(value, tuple) and not any(isinstance(v, containers) for v in value):
        return 1  # a relation (head, tail)
    if isinstance(value, (list, tuple)):
        return sum(_items(v) for v in value)
    return 0 if value in ("", None) else 1


def _run_batch(engine, requests, device, split) -> list:
    """One batch as the engine runs it (prepare, forward, decode), its phases added to ``split``."""
    t0 = time.perf_counter()
    prepared = [engine.prepare(i, r) for i, r in enumerate(requests)]
    t1 = time.perf_counter()
    outs = []
    for chunk in engine._chunks(prepared):
        c0 = time.perf_counter()
        batch_, states, slots = engine.forward(chunk)
        _sync(device)
        c1 = time.perf_counter()
        outs.extend(engine.decode(chunk, batch_, states, slots))
        c2 = time.perf_counter()
        split["core"] += c1 - c0
        split["post"] += c2 - c1
    split["pre"] += t1 - t0
    return outs


class EngineCase:
    """One engine mode's closed-loop batches: ``warm()`` runs the warm-up batches, each
    ``step()`` one timed batch; ``result()`` the fields every mode reports. Steps of several
    cases can interleave (``--interleave``), so that a shared host's drift hits them alike."""

    def __init__(self, engine, texts, schema, adapters, batch, warmup_batches, device):
        from manylora.engine import Request

        requests = [Request(t, json.dumps(schema), adapter=a) for t, a in zip(texts, adapters)]
        batches = [requests[i : i + batch] for i in range(0, len(requests), batch)]
        self.engine, self.device = engine, device
        self.warmup, self.timed = batches[:warmup_batches], batches[warmup_batches:]
        self.latencies: list[float] = []
        self.cpu = 0.0
        self.split = {"pre": 0.0, "core": 0.0, "post": 0.0}
        self.errors = self.found = self.n = 0
        self.loads: dict = {}  # adapter loads (per tier) while this case's timed batches ran
        self.peak_mib = 0.0  # CUDA: the largest peak allocation of its timed batches

    def warm(self) -> None:
        for b in self.warmup:
            self.engine.run(b)
        _sync(self.device)

    def step(self, index: int) -> None:
        b = self.timed[index]
        cuda = self.device.startswith("cuda")
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        loads = dict(self.engine.store.loads)
        t0, c0 = time.perf_counter(), time.process_time()
        outs = _run_batch(self.engine, b, self.device, self.split)
        self.latencies.append(time.perf_counter() - t0)
        self.cpu += time.process_time() - c0
        for tier, count in self.engine.store.loads.items():
            self.loads[tier] = self.loads.get(tier, 0) + count - loads.get(tier, 0)
        if cuda:
            self.peak_mib = max(self.peak_mib, torch.cuda.max_memory_allocated(self.device) / 2**20)
        self.n += len(b)
        self.errors += sum(not isinstance(o, dict) for o in outs)
        self.found += sum(_found(o) for o in outs if isinstance(o, dict))

    def profile(self, profile) -> None:
        """One more batch under ``profile`` (a cProfile.Profile), after the timed ones."""
        profile.enable()
        _run_batch(self.engine, self.timed[-1], self.device, {"pre": 0.0, "core": 0.0, "post": 0.0})
        profile.disable()

    def result(self, elapsed: Optional[float] = None) -> dict:
        """req/s over ``elapsed`` (default: the sum of the timed batches' latencies)."""
        elapsed = sum(self.latencies) if elapsed is None else elapsed
        return {
            **_timings(self.n, elapsed, self.errors, self.latencies, self.split),
            "found_per_request": self.found / self.n,
            "cpu_ms_per_request": 1e3 * self.cpu / self.n,  # process CPU time: less hit by descheduling
            "batch_ms": [round(1e3 * t, 3) for t in self.latencies],  # in timed order (batch i = same texts)
            **({"gpu_peak_mib": round(self.peak_mib, 1)} if self.device.startswith("cuda") else {}),
        }


def run_engine_mode(engine, texts, schema, adapters, batch, warmup_batches, device, profile=None):
    """Closed-loop batches after warm-up; with ``profile`` (a cProfile.Profile), one more
    batch runs under it after the timed ones."""
    case = EngineCase(engine, texts, schema, adapters, batch, warmup_batches, device)
    case.warm()
    start = time.perf_counter()
    for index in range(len(case.timed)):
        case.step(index)
    elapsed = time.perf_counter() - start
    if profile is not None:
        case.profile(profile)
    return case.result(elapsed)


class HotSwapServer:
    """GLiNER2 + PEFT hot-swap behind an LRU of ``capacity`` adapters and one lock."""

    def __init__(self, checkpoint, adapter_root, capacity, device, dtype):
        from gliner2 import GLiNER2

        self.model = GLiNER2.from_pretrained(str(checkpoint)).to(device=device, dtype=dtype).eval()
        self.root, self.capacity, self.device, self.dtype = Path(adapter_root), capacity, device, dtype
        self.peft = None
        self.lru: OrderedDict[str, None] = OrderedDict()
        self.lock = threading.Lock()
        self.disk_loads = 0

    def _activate(self, name):
        from peft import PeftModel

        if name in self.lru:
            self.lru.move_to_end(name)
        else:
            path = str(self.root / name)
            if self.peft is None:
                self.peft = PeftModel.from_pretrained(self.model, path, adapter_name=name)
            else:
                self.peft.load_adapter(path, adapter_name=name)
            self.peft.to(device=self.device, dtype=self.dtype)
            self.disk_loads += 1
            self.lru[name] = None
            while len(self.lru) > self.capacity:
                victim, _ = self.lru.popitem(last=False)
                self.peft.delete_adapter(victim)
        self.peft.set_adapter(name)

    def extract(self, text, schema, name):
        with self.lock:
            self._activate(name)
            return self.model.batch_extract([text], schema)[0]


def run_hotswap_mode(server, texts, schema, adapters, seconds_cap, device):
    from gliner2.inference.schema import Schema

    schema_obj = Schema.from_dict(schema)
    latencies = []
    start = time.perf_counter()
    n = 0
    for text, name in zip(texts, adapters):
        t0 = time.perf_counter()
        server.extract(text, schema_obj, name)
        _sync(device)
        latencies.append(time.perf_counter() - t0)
        n += 1
        if time.perf_counter() - start > seconds_cap:
            break
    elapsed = time.perf_counter() - start
    row = _timings(n, elapsed, 0, latencies, {})
    del row["split_s"]  # one request at a time: no pre/core/post split
    return {**row, "disk_loads": server.disk_loads}


class PeftMixedServer:
    """GLiNER2 + PEFT's mixed-adapter batching: every adapter preloaded into one PeftModel.

    PEFT mixes adapters within a batch through ``adapter_names``, one name per input row:
    ``LoraModel._enable_peft_forward_hooks(adapter_names=...)`` puts the names into the
    keyword arguments of every LoRA layer's forward, which checks ``len(x) == len(names)``
    and adds each adapter's update to its own rows (``Linear._mixed_batch_forward``).
    GLiNER2 cannot take that path as it stands (docs/architecture.md, "Traps"): DeBERTa's query_proj and
    key_proj also project the shared relative-position table (a batch of one), and GLiNER2
    calls its heads on tensors whose rows are not requests. So, per batch:

    * encoder: one forward of the whole batch (GLiNER2's own collation and
      ``encode_tokens``), every LoRA layer given the per-row names by a pre-hook like
      PEFT's (registered once, not per call); the position scores
      (``disentangled_attention_bias``) run once per adapter group of rows, with that
      adapter's projected table, because stock DeBERTa has one table per batch;
    * heads and decoding: ``batch_extract(hidden_states=...)`` once per adapter group,
      every LoRA layer given that group's adapter.

    Preprocessing runs twice (for the encoder pass, then inside ``batch_extract``); the
    pre/core/post split shows it.
    """

    BASE = "__base__"  # PEFT's name for "no adapter" in adapter_names

    def __init__(self, checkpoint, adapter_root, names, device, dtype):
        from gliner2 import GLiNER2
        from gliner2.training.trainer import ExtractorCollator
        from peft import PeftModel
        from peft.tuners.lora import LoraLayer

        model = GLiNER2.from_pretrained(str(checkpoint))
        root = Path(adapter_root)
        peft = PeftModel.from_pretrained(model, str(root / names[0]), adapter_name=names[0])
        for name in names[1:]:
            peft.load_adapter(str(root / name), adapter_name=name)
        self.model = model.to(device=device, dtype=dtype).eval()
        self.model.processor.change_mode(is_training=False)
        self.device, self.dtype, self.resident = torch.device(device), dtype, list(names)
        self.collator = ExtractorCollator(model.processor, is_training=False, architecture=model.architecture)
        self._rows = None  # adapter name per encoder row, during the encoder forward
        self._groups = None  # [(name, row indices)] of those rows
        self._table = None  # the adapter whose position table is being projected
        self._single = None  # the adapter of every row, during one group's heads
        for module in model.modules():
            if isinstance(module, LoraLayer):
                module.register_forward_pre_hook(self._adapter_names, with_kwargs=True)
        for module in model.encoder.modules():
            if hasattr(module, "disentangled_attention_bias"):
                module.disentangled_attention_bias = self._per_adapter_bias(module, module.disentangled_attention_bias)

    def _adapter_names(self, module, args, kwargs):
        x = args[0] if args else kwargs["x"]
        if self._single is not None:
            names = [self._single] * len(x)
        elif self._table is not None:
            names = [self._table] * len(x)
        elif self._rows is not None:
            if len(x) != len(self._rows):
                raise RuntimeError(f"a LoRA layer got {len(x)} rows in a batch of {len(self._rows)}")
            names = self._rows
        else:
            return None
        kwargs["adapter_names"] = names
        return args, kwargs

    def _per_adapter_bias(self, attention, original):
        """DeBERTa's c2p + p2c scores, each group of rows with its own adapter's position table."""

        def bias(query_layer, key_layer, relative_pos, rel_embeddings, scale_factor):
            groups = self._groups
            if groups is None or len(groups) == 1:
                self._table = groups[0][0] if groups else self._single
                try:
                    return original(query_layer, key_layer, relative_pos, rel_embeddings, scale_factor)
                finally:
                    self._table = None
            heads, rows = attention.num_attention_heads, len(self._rows)
            q_len, k_len = query_layer.shape[-2], key_layer.shape[-2]
            q = query_layer.view(rows, heads, q_len, -1)
            k = key_layer.view(rows, heads, k_len, -1)
            scores = query_layer.new_empty(rows, heads, q_len, k_len)
            try:
                for name, index in groups:
                    self._table = name
                    part = original(
                        q[index].flatten(0, 1), k[index].flatten(0, 1), relative_pos, rel_embeddings, scale_factor
                    )
                    scores[index] = part.view(len(index), heads, q_len, k_len)
            finally:
                self._table = None
            return scores.view(rows * heads, q_len, k_len)

        return bias

    def extract_batch(self, texts, schema, adapters):
        """GLiNER2 results for ``texts`` (one ``schema``), row i with adapter ``adapters[i]`` ('' = none).

        Returns (results, seconds of pre, core, post).
        """
        t0 = time.perf_counter()
        names = [a or self.BASE for a in adapters]
        schema_dicts, _ = self.model._build_schema_dicts_and_metadata([schema] * len(texts))
        batch = self.collator(list(zip(texts, schema_dicts)))
        batch = batch.to(self.device, self.dtype if self.dtype != torch.float32 else None)
        members: dict[str, list[int]] = {}
        for i, name in enumerate(names):
            members.setdefault(name, []).append(i)
        t1 = time.perf_counter()
        self._rows = names
        self._groups = [(n, torch.tensor(rows, device=self.device)) for n, rows in members.items()]
        try:
            with torch.inference_mode():
                states = self.model.encode_tokens(batch)
        finally:
            self._rows = self._groups = None
        lengths = batch.attention_mask.sum(dim=-1).tolist()
        _sync(str(self.device))
        t2 = time.perf_counter()
        results = [None] * len(texts)
        for name, rows in members.items():
            self._single = name
            try:
                with torch.inference_mode():
                    out = self.model.batch_extract(
                        [texts[i] for i in rows],
                        schema,
                        batch_size=len(rows),
                        hidden_states=[states[i, : lengths[i]] for i in rows],
                    )
            finally:
                self._single = None
            for i, result in zip(rows, out):
                results[i] = result
        _sync(str(self.device))
        return results, (t1 - t0, t2 - t1, time.perf_counter() - t2)


def run_peft_mixed_mode(server, texts, schema, adapters, batch, warmup_batches, device):
    from gliner2.inference.schema import Schema

    schema_obj = Schema.from_dict(schema)
    starts = list(range(0, len(texts), batch))
    for s in starts[:warmup_batches]:
        server.extract_batch(texts[s : s + batch], schema_obj, adapters[s : s + batch])
    latencies, split = [], {"pre": 0.0, "core": 0.0, "post": 0.0}
    errors = n = 0
    start = time.perf_counter()
    for s in starts[warmup_batches:]:
        t0 = time.perf_counter()
        outs, seconds = server.extract_batch(texts[s : s + batch], schema_obj, adapters[s : s + batch])
        latencies.append(time.perf_counter() - t0)
        for key, value in zip(split, seconds):
            split[key] += value
        errors += sum(not isinstance(o, dict) for o in outs)
        n += len(outs)
    elapsed = time.perf_counter() - start
    return {**_timings(n, elapsed, errors, latencies, split), "peft_resident": len(server.resident)}


class RequestCost:
    """FLOPs of this run's requests (``limits.py``) and bytes of its adapters, worked out once.

    Every request's counts (tokens, words, span fields, labels) come from the record the
    engine builds for it; the position-table projection is shared by a batch of ``batch``.
    """

    def __init__(self, engine, checkpoint, adapter_root, texts, schema, batch):
        from manylora.engine import Request

        schema_json = json.dumps(schema)
        self.requests = [
            RequestShape.from_record(engine.prepare(i, Request(t, schema_json)).record) for i, t in enumerate(texts)
        ]
        self.checkpoint, self.root, self.batch = checkpoint, adapter_root, batch
        self.mean_tokens = statistics.mean(r.tokens for r in self.requests)
        self.base = [sum(flop_breakdown(checkpoint, request=r, batch=batch).values()) for r in self.requests]
        self._lora: dict[tuple, list[float]] = {}  # adapter ranks -> LoRA FLOPs of every request

    def _lora_flops(self, name: str) -> list[float]:
        ranks = adapter_ranks(self.root / name)
        key = tuple(sorted(ranks.items()))
        if key not in self._lora:
            self._lora[key] = [
                flop_breakdown(self.checkpoint, request=r, batch=self.batch, lora_ranks=ranks)["lora"]
                for r in self.requests
            ]
        return self._lora[key]

    def flops(self, adapters=None) -> float:
        """Mean FLOPs per request; ``adapters``: the adapter of each request ('' = none)."""
        if not adapters:
            return statistics.mean(self.base)
        lora = {name: self._lora_flops(name) for name in set(adapters) if name}
        return statistics.mean(b + (lora[a][i] if a else 0.0) for i, (b, a) in enumerate(zip(self.base, adapters)))

    def bytes_per_adapter(self, adapters, dtype) -> float:
        """Mean bytes (A and B in the serving dtype) of the distinct adapters of ``adapters``."""
        distinct = sorted({a for a in adapters if a})
        return statistics.mean(adapter_bytes(self.root / name, dtype) for name in distinct)


def machine() -> dict:
    info = {"host": platform.node(), "python": platform.python_version(), "torch": torch.__version__}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="ManyLoRA in-process engine benchmark")
    p.add_argument("--checkpoint", type=Path)
    p.add_argument("--adapters", type=Path, help="folder of adapter folders (made if --make-adapters)")
    p.add_argument("--make-adapters", type=int, default=0, help="clone this many random rank-16 adapters")
    p.add_argument("--adapters-in-flight", type=int, nargs="+", default=[1, 8, 32, 128, 1024])
    p.add_argument("--distributions", nargs="+", default=["uniform", "zipf"])
    p.add_argument(
        "--modes",
        nargs="*",
        choices=MODES,
        default=["base", "manylora", "hotswap"],
        help="none: only --make-adapters, then exit; peft-mixed only when named",
    )
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--gpu-slots", type=int, default=32)
    p.add_argument("--host-slots", type=int, default=128)
    p.add_argument("--max-rank", type=int, default=16)
    p.add_argument("--hotswap-seconds", type=float, default=20.0)
    p.add_argument(
        "--peft-mixed-max",
        type=int,
        default=32,
        help="peft-mixed runs only at adapters-in-flight up to this many, all preloaded into one PeftModel",
    )
    p.add_argument(
        "--hotswap-at",
        type=int,
        nargs="*",
        default=None,
        help="adapters-in-flight values at which to run hotswap (default: all)",
    )
    p.add_argument(
        "--cold",
        action="store_true",
        help="start every case with empty adapter caches (default: preload the pool, steady state)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat base and manylora this many times, alternating (hotswap and peft-mixed run in round 0); "
        "ratios are taken within a round, and the summary gives their median over rounds",
    )
    p.add_argument(
        "--interleave",
        action="store_true",
        help="run the timed batches of base and every manylora case in turn, batch by batch (rotating the "
        "order), instead of one mode after the other: a shared host's drift then hits every mode alike; "
        "base and manylora only, with every pool resident (gpu and host slots >= the largest pool)",
    )
    p.add_argument("--words", type=int, nargs=2, default=[60, 120])
    p.add_argument("--schema", choices=["entities", "mixed"], default="entities")
    p.add_argument("--smoke", action="store_true", help="tiny CPU run in seconds (harness check)")
    p.add_argument(
        "--profile",
        type=Path,
        help="append a cProfile table (host functions by own time) of one extra batch per engine mode here",
    )
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)

    from manylora.config import EngineConfig
    from manylora.demo import build_demo_checkpoint, demo_texts
    from manylora.engine import Engine, freeze_long_lived
    from manylora.lora.demo_adapters import DemoAdapter, build_demo_adapter, clone_random_adapters

    device = "cuda:0" if torch.cuda.is_available() and not args.smoke else "cpu"
    tmp = Path(tempfile.mkdtemp(prefix="manylora-bench-"))
    if args.smoke:
        args.checkpoint = build_demo_checkpoint(tmp / "demo-tiny", size="tiny")
        args.adapters, args.make_adapters = tmp / "adapters", 6
        args.adapters_in_flight, args.distributions = [1, 4], ["uniform"]
        args.batch, args.batches, args.warmup, args.host_slots = 8, 2, 1, 4
        args.gpu_slots = 4 if args.interleave else 2  # interleaving keeps every pool resident
        args.hotswap_seconds = 2.0
    if args.make_adapters:
        template = args.adapters / "_template"
        if not (template / "adapter_model.safetensors").is_file():
            build_demo_adapter(
                args.checkpoint, template, DemoAdapter("template", 16, 32, ["encoder", "all_task_heads"]), seed=0
            )
        made = sum(1 for p in args.adapters.iterdir() if p.name.startswith("adapter-"))
        if made < args.make_adapters:  # a second stage of the same session reuses them
            clone_random_adapters(template, args.adapters, args.make_adapters, seed=1)
        if not args.modes:
            return 0
    names = sorted(p.name for p in args.adapters.iterdir() if p.name.startswith("adapter-")) if args.adapters else []

    schema = ENTITY_SCHEMA if args.schema == "entities" else MIXED_SCHEMA
    n_requests = args.batch * (args.batches + args.warmup)
    texts = demo_texts(n_requests, seed=42, min_words=args.words[0], max_words=args.words[1])
    params = {
        "checkpoint": str(args.checkpoint),
        "max_gpu_adapters": str(args.gpu_slots),
        "max_cpu_adapters": str(args.host_slots),
        "max_lora_rank": str(args.max_rank),
    }
    if args.adapters:
        params["adapter_dir"] = str(args.adapters)
    engine = Engine(EngineConfig.from_parameters(params, device=device))
    freeze_long_lived()  # as each server instance does
    dtype = engine.dtype
    rows = []
    context = {
        "machine": machine(),
        "device": device,
        "dtype": str(dtype),
        "batch": args.batch,
        "schema": args.schema,
        "gpu_slots": args.gpu_slots,
        "host_slots": args.host_slots,
    }

    gemm = measure_gemm_rate(device, dtype)
    with open(args.out, "a") as f:
        f.write(json.dumps({"mode": "gemm_rate", **gemm, **context}) + "\n")
    print(f"dense GEMM {gemm['tflops']:.3f} TFLOP/s ({gemm['gemm_dtype']}, {gemm['gemm_size']}^3)", flush=True)
    cost = RequestCost(engine, args.checkpoint, args.adapters, texts, schema, args.batch)

    def emit(row, adapters=None):
        flops = cost.flops(adapters)
        row.update(
            {
                **context,
                "tokens_per_request": cost.mean_tokens,
                "flops_per_request": flops,
                "achieved_tflops": flops * row["req_per_s"] / 1e12,
                "fraction_of_gemm_rate": flops * row["req_per_s"] / 1e12 / gemm["tflops"],
            }
        )
        if adapters:
            row["bytes_per_adapter"] = cost.bytes_per_adapter(adapters, dtype)
        if device.startswith("cuda"):  # engine modes carry their timed batches' peak; others: since the last row
            row.setdefault("gpu_peak_mib", round(torch.cuda.max_memory_allocated(device) / 2**20, 1))
            torch.cuda.reset_peak_memory_stats(device)
        rows.append(row)
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(
            f"{row['mode']:10s} {row.get('adapters_in_flight', 0):5d} {row.get('distribution', '-'):8s} "
            f"{row['req_per_s']:9.1f} req/s  p95 {row['batch_p95_ms']:8.1f} ms  "
            f"{row['achieved_tflops']:9.3g} TFLOP/s ({row['fraction_of_gemm_rate']:.1%} of GEMM)  "
            f"found/request {row.get('found_per_request', float('nan')):.2f}  {row.get('split_s', '')}",
            flush=True,
        )

    def profiled(tag, run):
        """``run(profile)`` with a cProfile when --profile is given; its table appended there."""
        if not args.profile:
            return run(None)
        profile = cProfile.Profile()
        result = run(profile)
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(35)
        with open(args.profile, "a") as f:
            f.write(f"==== {tag} (round {context['round']}): one batch, host functions by own time\n")
            f.write(out.getvalue() + "\n")
        return result

    def fill(pool):
        """Empty the caches, then (unless --cold) make ``pool`` resident as far as the tiers allow."""
        engine.store.clear()
        if not args.cold:
            adapters = [engine.store.get(name) for name in pool]
            for i in range(0, len(adapters), args.gpu_slots):
                engine.store.acquire(adapters[i : i + args.gpu_slots])

    def interleaved_round():
        """Every base and manylora case of a round, their timed batches interleaved (rotating
        order); all pools are prefixes of one pool that stays resident throughout."""
        cases = []  # (row fields, adapters chosen, case)
        if "base" in args.modes:
            base_case = EngineCase(engine, texts, schema, [""] * n_requests, args.batch, args.warmup, device)
            cases.append(({"mode": "base"}, None, base_case))
        fitting = [k for k in args.adapters_in_flight if k <= len(names)] if "manylora" in args.modes else []
        for k in fitting:
            for dist in args.distributions:
                chosen = pick_adapters(names[:k], n_requests, dist, seed=k)
                row = {"mode": "manylora", "adapters_in_flight": k, "distribution": dist}
                cases.append((row, chosen, EngineCase(engine, texts, schema, chosen, args.batch, args.warmup, device)))
        fill(names[: max(fitting, default=0)])
        for _, _, case in cases:
            case.warm()
        for index in range(args.batches):
            shift = index % len(cases)
            for _, _, case in cases[shift:] + cases[:shift]:
                case.step(index)
        for row, chosen, case in cases:
            tag = " ".join(str(row[key]) for key in ("mode", "adapters_in_flight", "distribution") if key in row)
            profiled(tag, lambda prof, case=case: prof is not None and case.profile(prof))
            extra = {"loads": case.loads, "caches": "cold" if args.cold else "preloaded"} if chosen else {}
            emit({**row, **case.result(), **extra, "interleaved": True}, chosen)

    if args.interleave:
        unfit = [m for m in args.modes if m not in ("base", "manylora")]
        largest = max(args.adapters_in_flight, default=0)
        if unfit or largest > min(args.gpu_slots, args.host_slots):
            p.error(
                f"--interleave: only base and manylora, every pool resident (modes {unfit}, largest pool {largest})"
            )

    peft_mixed = None
    for round_ in range(args.rounds):
        context["round"] = round_
        first = round_ == 0
        if args.interleave:
            interleaved_round()
            continue
        if "base" in args.modes:
            emit(
                {
                    "mode": "base",
                    **profiled(
                        "base",
                        lambda prof: run_engine_mode(
                            engine, texts, schema, [""] * n_requests, args.batch, args.warmup, device, prof
                        ),
                    ),
                }
            )
        for k in args.adapters_in_flight:
            pool = names[:k]
            if len(pool) < k:
                print(f"skipping {k} adapters in flight: only {len(names)} adapters", file=sys.stderr)
                continue
            for dist in args.distributions:
                chosen = pick_adapters(pool, n_requests, dist, seed=k)
                if "manylora" in args.modes:
                    fill(pool)
                    r = profiled(
                        f"manylora {k} {dist}",
                        lambda prof: run_engine_mode(
                            engine, texts, schema, chosen, args.batch, args.warmup, device, prof
                        ),
                    )
                    emit(
                        {
                            "mode": "manylora",
                            "adapters_in_flight": k,
                            "distribution": dist,
                            **r,
                            "loads": dict(engine.store.loads),
                            "caches": "cold" if args.cold else "preloaded",
                        },
                        chosen,
                    )
                if (
                    first
                    and "hotswap" in args.modes
                    and dist == "uniform"
                    and (args.hotswap_at is None or k in args.hotswap_at)
                ):
                    server = HotSwapServer(args.checkpoint, args.adapters, 25, device, dtype)
                    r = run_hotswap_mode(server, texts, schema, chosen, args.hotswap_seconds, device)
                    emit({"mode": "hotswap", "adapters_in_flight": k, "distribution": dist, **r}, chosen)
                    del server
                if first and "peft-mixed" in args.modes and k > args.peft_mixed_max:
                    print(f"skipping peft-mixed at {k} adapters in flight: above --peft-mixed-max", file=sys.stderr)
                elif first and "peft-mixed" in args.modes:
                    if peft_mixed is None:  # one PeftModel for every pool: the pools are prefixes of names
                        fits = [n for n in args.adapters_in_flight if n <= min(args.peft_mixed_max, len(names))]
                        peft_mixed = PeftMixedServer(args.checkpoint, args.adapters, names[: max(fits)], device, dtype)
                    r = run_peft_mixed_mode(peft_mixed, texts, schema, chosen, args.batch, args.warmup, device)
                    emit({"mode": "peft-mixed", "adapters_in_flight": k, "distribution": dist, **r}, chosen)

    def same_k(mode, r):
        matches = [h for h in rows if h["mode"] == mode and h.get("adapters_in_flight") == r.get("adapters_in_flight")]
        same = [h for h in matches if h.get("distribution") == r.get("distribution")]
        return (same or matches or [None])[0]

    def base_of(r):  # the base row of the same round
        return next((b for b in rows if b["mode"] == "base" and b["round"] == r["round"]), None)

    print("\nround mode       adapters dist      req/s   x base  x hotswap  x peft-mixed  TFLOP/s  of GEMM")
    for r in rows:
        hot, mixed, base = same_k("hotswap", r), same_k("peft-mixed", r), base_of(r)
        ratio_base = r["req_per_s"] / base["req_per_s"] if base else float("nan")
        ratio_hot = r["req_per_s"] / hot["req_per_s"] if hot else float("nan")
        ratio_mixed = r["req_per_s"] / mixed["req_per_s"] if mixed else float("nan")
        print(
            f"{r['round']:5d} {r['mode']:10s} {r.get('adapters_in_flight', 0):8d} {r.get('distribution', '-'):8s} "
            f"{r['req_per_s']:8.1f} {ratio_base:8.2f} {ratio_hot:10.1f} {ratio_mixed:13.2f} "
            f"{r['achieved_tflops']:8.3g} {r['fraction_of_gemm_rate']:8.1%}"
        )
    if args.rounds > 1 or args.interleave:
        print("\nmanylora / base within each round, median over rounds:")
        for line in ratio_summary(rows):
            print(line)
    return 0


def ratio_summary(rows: list[dict]) -> list[str]:
    """Per manylora case: its req/s over base's in the same round (median over rounds), and for
    interleaved rows also the median over every timed batch of base's latency over the case's
    latency for the same batch of texts run moments apart (pairs, so that drift cancels)."""
    base = {r["round"]: r for r in rows if r["mode"] == "base"}
    cases: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["mode"] == "manylora" and r["round"] in base:
            cases.setdefault((r["adapters_in_flight"], r["distribution"]), []).append(r)
    lines = []
    for (k, dist), case_rows in sorted(cases.items()):
        ratios = [r["req_per_s"] / base[r["round"]]["req_per_s"] for r in case_rows]
        cpu = [r["cpu_ms_per_request"] / base[r["round"]]["cpu_ms_per_request"] for r in case_rows]
        line = (
            f"  {k:5d} {dist:8s} median {statistics.median(ratios):.3f}  rounds {[round(x, 3) for x in ratios]}"
            f"  (process CPU per request x base: median {statistics.median(cpu):.3f})"
        )
        pairs = [
            b / t
            for r in case_rows
            if r.get("interleaved")
            for b, t in zip(base[r["round"]]["batch_ms"], r["batch_ms"])
        ]
        if pairs:
            line += f"  paired batches: median {statistics.median(pairs):.3f} of {len(pairs)}"
        lines.append(line)
    return lines


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
