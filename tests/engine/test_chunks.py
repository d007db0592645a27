"""How the engine cuts a dynamic batch: token budget, length, and one failing request alone."""

import dataclasses
import json

from manylora.engine import INTERNAL, Request, RequestError

SCHEMA = json.dumps({"entities": ["person", "location"]})


def test_a_long_text_gets_its_own_chunk(tiny_engine, monkeypatch):
    short = [tiny_engine.prepare(i, Request(f"Ada Lovelace met Bob number {i} in Paris.", SCHEMA)) for i in range(6)]
    long = tiny_engine.prepare(6, Request(" ".join(["Ada went to Paris."] * 60), SCHEMA))
    # 'auto' on the CPU: a chunk costs little (CHUNK_COST_TOKENS_AUTO), so the long text goes alone
    assert [len(c) for c in tiny_engine._budget_chunks(short + [long])] == [6, 1]
    # a GPU's chunk cost: few rows padded to the long one cost less than another chunk
    monkeypatch.setattr(tiny_engine, "config", dataclasses.replace(tiny_engine.config, chunk_cost_tokens=32768))
    assert [len(c) for c in tiny_engine._budget_chunks(short + [long])] == [7]
    many = short * 43  # 258 short rows: padding them to the long one would cost more than a chunk
    chunks = tiny_engine._budget_chunks(many + [long])
    assert [len(c) for c in chunks] == [258, 1] and chunks[1][0] is long


def test_a_lower_chunk_cost_cuts_the_same_rows_more_finely_with_less_padding(tiny_engine, monkeypatch):
    rows = [tiny_engine.prepare(i, Request(" ".join(["Ada went to Paris."] * (1 + i % 5)), SCHEMA)) for i in range(40)]

    def plan(cost: int) -> tuple[int, int]:  # (chunks, padded tokens)
        monkeypatch.setattr(tiny_engine, "config", dataclasses.replace(tiny_engine.config, chunk_cost_tokens=cost))
        chunks = tiny_engine._budget_chunks(rows)
        assert sorted(p.index for c in chunks for p in c) == list(range(40))  # every row once
        return len(chunks), sum(len(c) * -(-max(p.num_tokens for p in c) // 16) * 16 for c in chunks)

    (coarse, coarse_tokens), (fine, fine_tokens) = plan(32768), plan(16)
    assert coarse == 1 and fine > 1 and fine_tokens < coarse_tokens


def test_chunks_stay_within_the_token_budget(tiny_engine, monkeypatch):
    rows = [tiny_engine.prepare(i, Request(" ".join(["Ada went to Paris."] * (1 + i % 9)), SCHEMA)) for i in range(50)]
    monkeypatch.setattr(tiny_engine, "config", dataclasses.replace(tiny_engine.config, max_batch_tokens=640))
    chunks = tiny_engine._budget_chunks(rows)
    assert sorted(p.index for c in chunks for p in c) == list(range(50))  # every row once
    for chunk in chunks:
        assert len(chunk) * (-(-max(p.num_tokens for p in chunk) // 16) * 16) <= 640


def test_a_failing_prepare_fails_only_its_request(tiny_engine, monkeypatch):
    monkeypatch.setattr(tiny_engine, "prepare", _raising_prepare(tiny_engine.prepare))
    results = tiny_engine.run([Request("Ada met Bob.", SCHEMA), Request("kaboom", SCHEMA), Request("Bob.", SCHEMA)])
    assert isinstance(results[0], dict) and isinstance(results[2], dict)
    assert isinstance(results[1], RequestError) and results[1].code == INTERNAL
    assert "KeyError" in results[1].message


def _raising_prepare(prepare):
    def wrapped(index, request, *rest):
        if "boom" in request.text:
            raise KeyError("a bug in prepare")
        return prepare(index, request, *rest)

    return wrapped


def test_the_last_call_goes_first_when_this_call_may_wait_for_a_disk_load(tiny_checkpoint, demo_adapters, monkeypatch):
    """core_begin(items, between): `between` (the last call's delivery) runs once this call's
    first forward is queued, unless one of this call's adapters is not in host memory: a
    lookup may then wait for a disk load, so the finished answers go first."""
    from manylora.config import EngineConfig
    from manylora.engine import Engine

    root = next(iter(demo_adapters.values())).parent
    engine = Engine(EngineConfig.from_parameters({"checkpoint": str(tiny_checkpoint), "adapter_dir": str(root)}))
    events: list[str] = []
    real_forward = engine.forward
    monkeypatch.setattr(engine, "forward", lambda chunk: events.append("A") or real_forward(chunk))
    prepared = engine.prepare(0, Request("Ada Lovelace met Bob in Paris.", SCHEMA))
    item = (prepared.record.input_ids, prepared.record.text_word_first_positions, SCHEMA, "enc-r8", prepared.t_min)
    assert not engine.store.in_host(["enc-r8"])
    first = engine.core_begin([item], between=lambda: events.append("deliver"))
    assert events[:2] == ["deliver", "A"], events  # cold: delivered before the lookups
    (row,) = first()
    assert not isinstance(row, RequestError)
    events.clear()
    second = engine.core_begin([item], between=lambda: events.append("deliver"))
    assert events[:2] == ["A", "deliver"], events  # in host memory: after the first forward
    assert [type(r) for r in second()] == [type(row)]


def test_graph_shapes_keep_big_lengths_once_the_cap_is_raised():
    from manylora.graphs import MAX_GRAPH_TOKENS, graph_shape, length_bucket, row_bucket

    # the default cap: rows and lengths up to their buckets, nothing above the cap
    assert graph_shape(5, 144, MAX_GRAPH_TOKENS) == (6, 160)
    assert graph_shape(100, 208, MAX_GRAPH_TOKENS) is None  # 112 x 224 > 16,384
    assert graph_shape(3, 528, 1 << 20) is None  # above the longest length bucket
    for rows, length in ((1, 16), (12, 176), (64, 240), (80, 192)):
        assert graph_shape(rows, length, MAX_GRAPH_TOKENS) in (None, (row_bucket(rows), length_bucket(length)))
    # raised: shapes up to 16,384 padded tokens as before, larger ones at their own length
    assert graph_shape(5, 144, 65536) == (6, 160)
    assert graph_shape(301, 208, 65536) == (320, 208)
    assert graph_shape(203, 272, 65536) == (224, 272)
    assert graph_shape(330, 208, 65536) is None  # 352 x 208 > 65,536


def test_with_cuda_graphs_big_chunks_are_cut_at_full_row_buckets(tiny_engine, monkeypatch):
    """600 rows of one length, 180 fit the budget: four equal pieces of 150 would each be
    padded to a graph's 160 rows; pieces of 160, 160, 160 and 120 pad none but the last."""
    import types

    from manylora.graphs import graph_shape

    text = " ".join(["Ada went to Paris."] * 3)
    rows = [tiny_engine.prepare(i, Request(text, SCHEMA)) for i in range(600)]
    length = -(-rows[0].num_tokens // 16) * 16
    budget = 180 * length
    monkeypatch.setattr(tiny_engine, "config", dataclasses.replace(tiny_engine.config, max_batch_tokens=budget))
    assert [len(c) for c in tiny_engine._budget_chunks(rows)] == [150] * 4  # no graphs: equal pieces

    def padded_tokens(r, n):
        shape = graph_shape(r, n, budget)
        return r * n if shape is None else shape[0] * shape[1]

    monkeypatch.setattr(tiny_engine, "graphs", types.SimpleNamespace(padded_tokens=padded_tokens))
    chunks = tiny_engine._budget_chunks(rows)
    assert [len(c) for c in chunks] == [160, 160, 160, 120]
    assert sorted(p.index for c in chunks for p in c) == list(range(600))


def test_graph_buffers_hold_every_graph_shape():
    """padded_bound sizes the graphs' output and tile buffers: no shape graph_shape returns, for
    any rows and padded length the engine forms, holds more tokens; at the default cap it is the cap."""
    from manylora.graphs import MAX_GRAPH_TOKENS, ROW_BUCKETS, graph_shape, padded_bound

    assert padded_bound(MAX_GRAPH_TOKENS) == MAX_GRAPH_TOKENS
    for cap in (4096, MAX_GRAPH_TOKENS, 32768, 65536, 131072):
        for max_length in (256, 512):
            bound = padded_bound(cap, max_length)
            largest = 0
            for rows in range(1, ROW_BUCKETS[-1] + 1):
                for length in range(16, max_length + 1, 16):
                    shape = graph_shape(rows, length, cap, max_length)
                    if shape is not None:
                        assert shape[0] >= rows and shape[1] >= length
                        largest = max(largest, shape[0] * shape[1])
            assert largest <= bound, (cap, max_length, largest, bound)
            assert largest == bound or cap <= MAX_GRAPH_TOKENS, "the bound is tight above the default cap"
