"""How the engine cuts a dynamic batch: token budget, length, and one failing request alone."""

import json

from manylora.engine import INTERNAL, Request, RequestError

SCHEMA = json.dumps({"entities": ["person", "location"]})


def test_a_long_text_gets_its_own_chunk(tiny_engine):
    short = [tiny_engine.prepare(i, Request(f"Ada Lovelace met Bob number {i} in Paris.", SCHEMA)) for i in range(6)]
    long = tiny_engine.prepare(6, Request(" ".join(["Ada went to Paris."] * 60), SCHEMA))
    chunks = tiny_engine._budget_chunks(short + [long])
    assert [len(c) for c in chunks] == [6, 1]
    assert chunks[1][0] is long
    assert all(2 * max(c[0].num_tokens, 64) >= -(-c[-1].num_tokens // 16) * 16 for c in chunks)


def test_a_failing_prepare_fails_only_its_request(tiny_engine, monkeypatch):
    monkeypatch.setattr(tiny_engine, "prepare", _raising_prepare(tiny_engine.prepare))
    results = tiny_engine.run([Request("Ada met Bob.", SCHEMA), Request("kaboom", SCHEMA), Request("Bob.", SCHEMA)])
    assert isinstance(results[0], dict) and isinstance(results[2], dict)
    assert isinstance(results[1], RequestError) and results[1].code == INTERNAL
    assert "KeyError" in results[1].message


def _raising_prepare(prepare):
    def wrapped(index, request):
        if "boom" in request.text:
            raise KeyError("a bug in prepare")
        return prepare(index, request)

    return wrapped
