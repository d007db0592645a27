"""Adapter-cache metrics on Triton's Prometheus endpoint (pb_utils custom metric families).

Published from the engine's own counters, so the engine stays free of pb_utils: after every
execute() where execute() runs the batch, and by the overlapped GPU stage's GPU thread at most
every ``metrics_interval`` seconds (a parameter, 0.25 s), after the answers of the calls it covers
(each metric update is a message to the Triton process: ~1.5-2 ms a publish, H200 session 18).
Every metric carries ``model`` and ``instance`` labels (each Triton model instance keeps its
own adapter cache). Families:

    manylora_adapter_cache_total{tier, event}      counter: hit / miss / evict per tier (host, gpu)
    manylora_adapters_resident{tier}               gauge
    manylora_adapters_loading                      gauge: disk -> host loads queued or running
    manylora_adapter_host_bytes                    gauge: host memory of the host tier's adapters
    manylora_adapter_load_seconds{stage}           histogram: disk_to_host, host_to_gpu
    manylora_batch_adapters                        histogram: distinct adapters per dynamic batch
    manylora_batch_waves                           histogram: GPU-slot waves per dynamic batch
    manylora_core_call_rows                        histogram: rows per GPU-stage engine call (merged batches)
    manylora_core_call_seconds                     histogram: such a call's start to its answers' delivery
    manylora_core_queue_seconds                    histogram: a GPU-stage request's wait before its call starts
    manylora_cuda_graph_captures_total             counter: CUDA graphs captured (at load and on first use; encoder and heads)
    manylora_cuda_graph_capture_seconds_total      counter: seconds those captures took in the GPU thread
    manylora_core_phase_seconds_total{phase}       counter: seconds of the GPU stage's steps and threads

The core_call and core_queue families (and the thread phases of core_phase) are the
overlapped GPU stage's (``core_overlap: on``): where a request's time goes between Triton's
queue and its answer. With ``chunk_pipeline`` a call's answers are
delivered once the next call's first forward is queued (or at once when nothing waits), so a
call's seconds include that step of the next call.

The graph counters tell whether a phase of a benchmark paid for captures on first use (each
~50-100 ms in the GPU thread, session 12): with the 65,536-token cap the shapes of moderate and
heavy load are captured while they are served. They stay 0 without CUDA graphs (CPU).

The phase counter splits the GPU stage's time (``Engine.phase_seconds``): ``prepare`` (rows'
records), ``forward`` / ``heads`` / ``finish`` (each chunk's steps A, B, C: host work and the
waits for the GPU inside them), ``publish`` (these metrics), ``idle`` (the GPU thread waiting
for a batch), ``parse`` (``execute`` checking a batch, in Triton's thread), ``answer_pack`` /
``answer_send`` (the answer thread building the responses / sending them), and the two threads' CPU seconds (``gpu_thread_cpu``,
``answer_thread_cpu``; CUDA's spin-waits count as CPU). Divided by the calls' count, they say
where a call's wall time goes (``perf/bench_server.py`` prints that).
"""

from __future__ import annotations

LOAD_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
ADAPTER_BUCKETS = [0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
WAVE_BUCKETS = [1, 2, 3, 4, 8, 16, 32]
ROW_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
CALL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]
TIERS, EVENTS = ("host", "gpu"), ("hit", "miss", "evict")


def graph_kinds(engine) -> list:
    """The engine's CUDA graph sets with ``stats``: the encoder's and the heads'
    (``lora.head_graphs``), published as one counter; those that are off are left out."""
    kinds = [getattr(engine, "graphs", None), getattr(getattr(engine, "heads", None), "graphs", None)]
    return [g for g in kinds if g is not None]


class AdapterMetrics:
    def __init__(self, pb_utils, labels: dict[str, str]):
        family = pb_utils.MetricFamily
        cache = family("manylora_adapter_cache_total", "Adapter cache events per tier", family.COUNTER)
        resident = family("manylora_adapters_resident", "Adapters resident per tier", family.GAUGE)
        loading = family("manylora_adapters_loading", "Adapter loads from disk queued or running", family.GAUGE)
        host_bytes = family("manylora_adapter_host_bytes", "Host memory of the adapters in host memory", family.GAUGE)
        loads = family("manylora_adapter_load_seconds", "Adapter load latency per stage", family.HISTOGRAM)
        batch_adapters = family("manylora_batch_adapters", "Distinct adapters per dynamic batch", family.HISTOGRAM)
        batch_waves = family("manylora_batch_waves", "GPU-slot waves per dynamic batch", family.HISTOGRAM)
        call_rows = family("manylora_core_call_rows", "Rows per GPU-stage engine call", family.HISTOGRAM)
        call_seconds = family("manylora_core_call_seconds", "Wall time of a GPU-stage engine call", family.HISTOGRAM)
        queue_seconds = family(
            "manylora_core_queue_seconds", "A GPU-stage request's wait before its engine call", family.HISTOGRAM
        )
        captures = family("manylora_cuda_graph_captures_total", "CUDA graphs captured", family.COUNTER)
        capture_seconds = family(
            "manylora_cuda_graph_capture_seconds_total", "Seconds of CUDA graph captures", family.COUNTER
        )
        phases = family("manylora_core_phase_seconds_total", "Seconds of the GPU stage's steps", family.COUNTER)
        self._labels = dict(labels)
        self.cache = {(e, t): cache.Metric(labels={**labels, "tier": t, "event": e}) for e in EVENTS for t in TIERS}
        self.resident = {t: resident.Metric(labels={**labels, "tier": t}) for t in TIERS}
        self.loading = loading.Metric(labels=dict(labels))
        self.host_bytes = host_bytes.Metric(labels=dict(labels))
        self.loads = {
            s: loads.Metric(labels={**labels, "stage": s}, buckets=LOAD_BUCKETS)
            for s in ("disk_to_host", "host_to_gpu")
        }
        self.batch_adapters = batch_adapters.Metric(labels=dict(labels), buckets=ADAPTER_BUCKETS)
        self.batch_waves = batch_waves.Metric(labels=dict(labels), buckets=WAVE_BUCKETS)
        self.call_rows = call_rows.Metric(labels=dict(labels), buckets=ROW_BUCKETS)
        self.call_seconds = call_seconds.Metric(labels=dict(labels), buckets=CALL_BUCKETS)
        self.queue_seconds = queue_seconds.Metric(labels=dict(labels), buckets=CALL_BUCKETS)
        self.captures = captures.Metric(labels=dict(labels))
        self.capture_seconds = capture_seconds.Metric(labels=dict(labels))
        self._phase_family = phases
        self.phases: dict = {}  # phase -> metric, made when the phase is first seen
        self._published: dict = {}
        # families must outlive their metrics: assigned last, so they are also released last
        self._families = (
            cache,
            resident,
            loading,
            host_bytes,
            loads,
            batch_adapters,
            batch_waves,
            call_rows,
            call_seconds,
            queue_seconds,
            captures,
            capture_seconds,
            phases,
        )

    def restart_counts(self, keep=()) -> None:
        """The engine's counters start from 0 again (a new ``core_process`` worker): later totals
        are added to the published ones, not taken as their new values. ``keep``: the counters
        (``("phase", name)`` keys) that did not restart (the stub's own phases)."""
        self._published = {key: total for key, total in self._published.items() if key in keep}

    def close(self) -> None:
        """Release the metrics, then their families (Triton's required order)."""
        self.cache = self.resident = self.loading = self.host_bytes = None
        self.loads = self.batch_adapters = self.batch_waves = None
        self.call_rows = self.call_seconds = self.queue_seconds = None
        self.captures = self.capture_seconds = None
        self.phases = {}
        self._phase_family = self._families = None

    def publish(self, engine) -> None:
        store = engine.store
        counters = [(key, metric, store.events[key]) for key, metric in self.cache.items()]
        kinds = graph_kinds(engine)
        if kinds:
            counters.append(("captures", self.captures, sum(g.stats["captures"] for g in kinds)))
            counters.append(("capture_seconds", self.capture_seconds, sum(g.stats["capture_seconds"] for g in kinds)))
        for phase, total in list(getattr(engine, "phase_seconds", {}).items()):
            if phase not in self.phases:
                self.phases[phase] = self._phase_family.Metric(labels={**self._labels, "phase": phase})
            counters.append((("phase", phase), self.phases[phase], total))
        for key, metric, total in counters:
            delta = total - self._published.get(key, 0)
            if delta:
                metric.increment(delta)
                self._published[key] = total
        for tier, names in store.resident().items():
            self.resident[tier].set(len(names))
        self.loading.set(len(store.loading()))
        self.host_bytes.set(store.host_bytes)
        for stage, seconds in store.drain_load_seconds().items():
            for value in seconds:
                self.loads[stage].observe(value)
        while engine.batch_stats:
            adapters, waves = engine.batch_stats.popleft()
            self.batch_adapters.observe(adapters)
            self.batch_waves.observe(waves)
        calls = engine.call_stats
        while calls:
            rows, seconds, waits = calls.popleft()
            self.call_rows.observe(rows)
            self.call_seconds.observe(seconds)
            for wait in waits:
                self.queue_seconds.observe(wait)
