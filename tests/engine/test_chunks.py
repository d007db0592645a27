"""How the engine cuts a dynamic batch: token budget, length, and one failing request alone."""

import dataclasses
import json

from manylora.engine import INTERNAL, Request, RequestError

SCHEMA = json.dumps({"entities": ["person", "location"]})


def test_a_long_text_gets_its_own_chunk(tiny_engine):
    short = [tiny_engine.prepare(i, Request(f"Ada Lovelace met Bob number {i} in Paris.", SCHEMA)) for i in range(6)]
    long = tiny_engine.prepare(6, Request(" ".join(["Ada went to Paris."] * 60), SCHEMA))
    # few rows: padding them all to the long one costs less than another chunk
    assert [len(c) for c in tiny_engine._budget_chunks(short + [long])] == [7]
    many = short * 43  # 258 short rows: padding them to the long one would cost more than a chunk
    chunks = tiny_engine._budget_chunks(many + [long])
    assert [len(c) for c in chunks] == [258, 1] and chunks[1][0] is long


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
