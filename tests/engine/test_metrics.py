"""manylora.metrics.AdapterMetrics.publish against a stand-in for pb_utils' metric families:
each counter grows by what the engine counted since the last publish, never by its total again;
the CUDA graph counters follow the GPU stage's graph statistics and stay untouched without graphs."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

from manylora.metrics import AdapterMetrics


class _Metric:
    def __init__(self, labels, buckets=None):
        self.labels, self.value, self.observed = labels, 0.0, []

    def increment(self, delta):
        assert delta > 0, "a counter only grows"
        self.value += delta

    def set(self, value):
        self.value = value

    def observe(self, value):
        self.observed.append(value)


class _Family:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

    def __init__(self, name, description, kind):
        self.name, self.kind = name, kind

    def Metric(self, labels, buckets=None):  # noqa: N802 (pb_utils' name)
        return _Metric(labels, buckets)


def _engine(graph_stats=None):
    events = {(e, t): 0 for e in ("hit", "miss", "evict") for t in ("host", "gpu")}
    store = SimpleNamespace(
        events=events,
        resident=lambda: {"host": ["a"], "gpu": []},
        loading=lambda: [],
        host_bytes=0,
        drain_load_seconds=lambda: {},
    )
    graphs = None if graph_stats is None else SimpleNamespace(stats=graph_stats)
    return SimpleNamespace(store=store, batch_stats=deque(), call_stats=deque(), graphs=graphs)


def test_graph_captures_are_published_as_deltas():
    metrics = AdapterMetrics(SimpleNamespace(MetricFamily=_Family), {"model": "gliner2_core", "instance": "0"})
    stats = {"replays": 0, "captures": 104, "eager": 0, "capture_seconds": 7.5}
    engine = _engine(stats)
    metrics.publish(engine)
    assert (metrics.captures.value, metrics.capture_seconds.value) == (104, 7.5)
    stats.update(captures=110, capture_seconds=8.0)
    engine.store.events[("miss", "gpu")] = 3
    metrics.publish(engine)
    metrics.publish(engine)  # nothing new: nothing added
    assert (metrics.captures.value, metrics.capture_seconds.value) == (110, 8.0)
    assert metrics.cache[("miss", "gpu")].value == 3 and metrics.cache[("hit", "gpu")].value == 0


def test_the_heads_graphs_captures_join_the_encoder_graphs_in_one_counter():
    """cuda_graph_heads: the heads' graphs (lora.head_graphs) keep their own statistics; the
    published counters are the sum of both kinds, and of the heads' alone with the encoder's off."""
    metrics = AdapterMetrics(SimpleNamespace(MetricFamily=_Family), {"model": "gliner2_core", "instance": "0"})
    engine = _engine({"replays": 0, "captures": 104, "eager": 0, "capture_seconds": 7.5})
    heads = {"replays": 9, "captures": 6, "eager": 1, "capture_seconds": 0.5}
    engine.heads = SimpleNamespace(graphs=SimpleNamespace(stats=heads))
    metrics.publish(engine)
    assert (metrics.captures.value, metrics.capture_seconds.value) == (110, 8.0)
    heads.update(captures=9, capture_seconds=1.25)
    metrics.publish(engine)
    assert (metrics.captures.value, metrics.capture_seconds.value) == (113, 8.75)
    alone = AdapterMetrics(SimpleNamespace(MetricFamily=_Family), {"model": "gliner2_core", "instance": "1"})
    engine.graphs = None  # cuda_graphs off, cuda_graph_heads on
    alone.publish(engine)
    assert (alone.captures.value, alone.capture_seconds.value) == (9, 1.25)


def test_an_engine_without_graphs_publishes_its_cache_and_leaves_the_graph_counters():
    """On the CPU (no CUDA graphs) the engine has graphs None: publishing must still carry the
    cache counters, and graph counters once published are neither reset nor counted again."""
    metrics = AdapterMetrics(SimpleNamespace(MetricFamily=_Family), {"model": "gliner2_core", "instance": "0"})
    engine = _engine({"replays": 0, "captures": 3, "eager": 0, "capture_seconds": 0.25})
    metrics.publish(engine)
    engine.graphs = None
    engine.store.events[("hit", "host")] = 5
    metrics.publish(engine)
    metrics.publish(engine)
    assert (metrics.captures.value, metrics.capture_seconds.value) == (3, 0.25)
    assert metrics.cache[("hit", "host")].value == 5 and metrics.resident["host"].value == 1


def test_phase_seconds_are_published_per_phase_as_deltas():
    """Each of the GPU stage's phases gets its own labelled counter when first seen, and grows by
    what the phase added since the last publish."""
    metrics = AdapterMetrics(SimpleNamespace(MetricFamily=_Family), {"model": "gliner2_core", "instance": "0"})
    engine = _engine()
    engine.phase_seconds = {"prepare": 0.5, "forward": 0.0}
    metrics.publish(engine)
    engine.phase_seconds.update(forward=1.25, idle=2.0)  # a phase seen later gets its metric then
    metrics.publish(engine)
    metrics.publish(engine)
    values = {phase: metric.value for phase, metric in metrics.phases.items()}
    assert values == {"prepare": 0.5, "forward": 1.25, "idle": 2.0}
    assert metrics.phases["idle"].labels == {"model": "gliner2_core", "instance": "0", "phase": "idle"}


def test_a_new_core_process_worker_counts_from_zero_and_the_stubs_phases_go_on():
    """core_process: the stub publishes its worker's snapshots (core_process.EngineView). A new
    worker's counters start again from 0: they are added to what was published; the stub's own
    phases (parse, respond) did not restart and keep growing by their deltas."""
    from manylora.core_process import EngineView

    def view(hits: int, prepare: float, parse: float) -> EngineView:
        snapshot = {
            "events": [["hit", "host", hits]],
            "graphs": None,
            "phases": {"prepare": prepare},
            "resident": {"host": 1, "gpu": 0},
            "loading": 0,
            "host_bytes": 0,
            "loads": {},
            "batches": [],
            "calls": [[3, 0.5, [0.1]]],
        }
        return EngineView(snapshot, {"parse": parse})

    metrics = AdapterMetrics(SimpleNamespace(MetricFamily=_Family), {"model": "gliner2_core", "instance": "0"})
    metrics.publish(view(hits=10, prepare=4.0, parse=1.0))
    metrics.restart_counts(keep={("phase", "parse")})  # the worker died; its successor starts at 0
    metrics.publish(view(hits=2, prepare=0.5, parse=1.5))
    assert metrics.cache[("hit", "host")].value == 12
    assert {p: m.value for p, m in metrics.phases.items()} == {"prepare": 4.5, "parse": 1.5}
    assert metrics.call_rows.observed == [3, 3]
