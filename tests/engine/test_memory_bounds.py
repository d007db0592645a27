"""Bounded memory of the CPU front and the GPU stage's record building (issue 17, item 4).

Every cache of ``Preprocessor`` / ``RecordBuilder`` is a ``BoundedCache``, bounded in entries
and in bytes; refused requests and oversize words leave nothing behind. Floods of distinct
large inputs (huge one-word texts, schemas over the token limit, texts of distinct words)
go through ``prepare`` and ``core_record``; the caches' byte accounting stays within its
bounds and the process's resident memory grows less than ``RSS_MARGIN``. Before the bounds,
the floods below grew the process by 127 MiB (huge words), 64 MiB (schemas over the limit
through ``prepare``) and 62 MiB (the same through ``core_record``); now by 0-8 MiB.
"""

from __future__ import annotations

import gc
import json
import os
import random
import string
import threading
import tracemalloc

import pytest
from manylora.client.protocol import Request

from manylora import pre as pre_module
from manylora import preprocess
from manylora.demo import demo_schemas, demo_texts
from manylora.errors import RequestError
from manylora.pre import Preprocessor
from manylora.preprocess import MAX_CACHED_WORD_CHARS, BoundedCache

LIMIT = 128  # max_request_tokens of these preprocessors: texts of 4,096 characters at most, cheap to tokenize
SCHEMA = json.dumps({"entities": ["person", "organization"]})
# Resident growth allowed over a flood whose inputs must leave nothing in the caches: the
# allocator's slack (arenas it keeps after freeing the last input; measured 5-10 MB).
RSS_MARGIN = 32 << 20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _word(rng: random.Random, n: int) -> str:
    return "".join(rng.choices(string.ascii_lowercase, k=n))


def _within_bounds(pre: Preprocessor) -> list[str]:
    problems = []
    for name, cache in pre.caches().items():
        if cache.bytes > cache.max_bytes or len(cache) > cache.max_entries:
            problems.append(
                f"{name}: {len(cache)} entries, {cache.bytes} bytes (bounds {cache.max_entries}, {cache.max_bytes})"
            )
        if cache.bytes != sum(cache._size(k, v) for d in (cache.fresh, cache.old) for k, v in d.items()):
            problems.append(f"{name}: byte count {cache.bytes} is not the sum of its entries")
    return problems


def _refused(pre: Preprocessor, request: Request) -> str:
    with pytest.raises(RequestError) as info:
        pre.prepare(0, request)
    assert info.value.code == "INVALID_ARG"
    return info.value.message


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    from gliner2 import GLiNER2

    return GLiNER2.from_pretrained(str(tiny_checkpoint))


@pytest.fixture
def small_bounds(monkeypatch):
    """Bounds small enough for a test to reach (read when a Preprocessor is built)."""
    monkeypatch.setattr(preprocess, "WORD_CACHE_SIZE", 4096)
    monkeypatch.setattr(preprocess, "WORD_CACHE_BYTES", 256 << 10)
    monkeypatch.setattr(preprocess, "TOKEN_CACHE_SIZE", 512)
    monkeypatch.setattr(preprocess, "TOKEN_CACHE_BYTES", 64 << 10)
    monkeypatch.setattr(preprocess, "SLOT_RUN_CACHE_SIZE", 64)
    monkeypatch.setattr(preprocess, "SLOT_RUN_CACHE_BYTES", 128 << 10)
    monkeypatch.setattr(preprocess, "STAND_IN_CACHE_SIZE", 256)
    monkeypatch.setattr(preprocess, "STAND_IN_CACHE_BYTES", 16 << 10)
    monkeypatch.setattr(pre_module, "SCHEMA_CACHE_SIZE", 64)
    monkeypatch.setattr(pre_module, "SCHEMA_CACHE_BYTES", 512 << 10)


# ------------------------------------------------------------------------ BoundedCache


def test_bounded_cache_keeps_both_bounds_and_the_recently_used():
    cache = BoundedCache(100, 10_000, lambda key, value: len(value))
    hot = "h" * 50
    cache.put("hot", hot)
    for i in range(5_000):
        assert cache.put(i, "x" * (i % 300))
        assert cache.get("hot") == hot, "read between every two insertions: never evicted"
        assert len(cache) <= 100 and cache.bytes <= 10_000
    assert cache.bytes == sum(len(v) for d in (cache.fresh, cache.old) for v in d.values())
    assert not cache.put("big", "x" * (10_000 // 16 + 1)) and cache.get("big") is None, "too large alone"
    assert cache.get(4_999) is not None and cache.get(0) is None, "the newest stay, the oldest go"
    cache.clear()
    assert len(cache) == 0 and cache.bytes == 0


def test_bounded_cache_promotes_old_entries_and_replaces_values():
    cache = BoundedCache(4, 1_000, lambda key, value: value)
    cache.put("a", 10)
    cache.put("b", 10)  # fresh is full (2 = half of 4): the next insertion rotates
    cache.put("c", 10)
    assert "a" in cache.old and cache.get("a") == 10 and "a" in cache.fresh, "a hit in old moves to fresh"
    cache.put("a", 30)
    assert cache.get("a") == 30 and cache.bytes == sum(cache.fresh.values()) + sum(cache.old.values())


def test_bounded_cache_accounting_under_threads():
    cache = BoundedCache(512, 50_000, lambda key, value: len(value))

    def hammer(seed):
        rng = random.Random(seed)
        for _ in range(5_000):
            key = rng.randrange(2_000)
            if cache.get(key) is None:
                cache.put(key, "v" * rng.randrange(1, 200))

    threads = [threading.Thread(target=hammer, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(cache) <= 512 and cache.bytes <= 50_000
    assert cache.bytes == sum(len(v) for d in (cache.fresh, cache.old) for v in d.values())


def test_deep_sizeof_counts_what_a_schema_entry_holds(model):
    """The schema cache's estimate of an entry is what tracemalloc sees parsing keep."""
    pre = Preprocessor(model, 4096)
    schema = json.dumps(demo_schemas()[1])
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        pre.parse_schema(schema)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    counted = pre.schema_cache.bytes
    assert 0.5 * held <= counted <= 2 * held, (counted, held)


def test_word_accounting_matches_what_the_cache_holds(model):
    """Counted bytes of cached words are within a factor of what they really keep alive."""
    pre = Preprocessor(model, 4096)
    rng = random.Random(5)
    texts = [" ".join(_word(rng, rng.randrange(3, 12)) for _ in range(50)) for _ in range(60)]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        records = [pre.prepare(i, Request(t, SCHEMA)) for i, t in enumerate(texts)]
        del records
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    words = pre.records.word_cache
    assert len(words) > 2_500
    counted = sum(c.bytes for c in pre.caches().values())
    assert 0.6 * held <= counted <= 2 * held, (counted, held)


# ------------------------------------------------------------------------ floods, real bounds


def test_floods_of_refused_and_oversize_inputs_leave_nothing(model):
    """Thousands of distinct large inputs, refused or with words too long to cache: the caches
    gain nothing from them and the process's resident memory stays flat."""
    pre = Preprocessor(model, LIMIT)
    rng = random.Random(17)
    for i, text in enumerate(demo_texts(20, seed=3) + ["Tim Cook runs Apple."]):  # the steady state: accepted rows
        pre.prepare(i, Request(" ".join(text.split()[:40]), SCHEMA))
    kept = {name: (len(c), c.bytes) for name, c in pre.caches().items()}
    gc.collect()
    rss = _rss()
    for i in range(1_000):
        # a huge one-word text: 3,400 tokens, refused (it held 150 KB in the caches each before)
        message = _refused(pre, Request(_word(rng, 4_000), SCHEMA))
        assert "above the limit of 128" in message
        # a distinct schema over the token limit with a short text (it held 75 KB each before)
        labels = [f"{_word(rng, 6)} {j}" + " word" * 8 for j in range(20)]
        _refused(pre, Request("Tim Cook runs Apple.", json.dumps({"entities": labels})))
        if i % 10 == 0:  # a text of 300 distinct words, refused: none of them is kept
            _refused(pre, Request(" ".join(_word(rng, 6) for _ in range(300)), SCHEMA))
            # accepted, with words over MAX_CACHED_WORD_CHARS: answered, the long words not kept
            long_words = " ".join("the" * 22 + _word(rng, 2 + j) for j in range(2))  # 66-67 characters
            assert pre.prepare(0, Request(f"Tim Cook {long_words} runs Apple.", SCHEMA)).num_tokens <= LIMIT
        if i % 100 == 0:
            assert _within_bounds(pre) == []
    gc.collect()
    grown = _rss() - rss
    after = {name: (len(c), c.bytes) for name, c in pre.caches().items()}
    assert after == kept, "no cache kept anything of the flood (GLiNER2's token cache included)"
    assert _within_bounds(pre) == []
    assert grown < RSS_MARGIN, f"resident memory grew {grown >> 20} MiB over the flood"


def test_core_record_with_schemas_over_the_limit_keeps_nothing(model):
    """The GPU stage parses SCHEMA texts the front sends (or any client of gliner2_core): one
    over the limit alone is never kept, a fitting one is kept within the bounds."""
    pre = Preprocessor(model, LIMIT)
    rng = random.Random(23)
    gc.collect()
    rss = _rss()
    for i in range(1_000):
        labels = [f"{_word(rng, 6)} {j}" + " word" * 8 for j in range(20)]
        over = json.dumps({"entities": labels})
        part, _ = pre.parse_schema(over)
        assert len(part.input_ids) > LIMIT
        ids = list(part.input_ids[:LIMIT])
        record, metadata = pre.core_record(ids, [len(ids) - 1], over)
        assert record.input_ids == ids and metadata is not None
    assert len(pre.schema_cache) == 0 and pre.schema_cache.bytes == 0
    gc.collect()
    assert _rss() - rss < RSS_MARGIN
    assert _within_bounds(pre) == []


# ------------------------------------------------------------------------ floods, small bounds


def test_distinct_accepted_words_and_schemas_stay_within_the_byte_bounds(model, small_bounds):
    """Accepted requests do fill the caches: with bounds a test can reach, thousands of distinct
    words, schemas and non-ASCII characters keep every cache within both bounds, and the words
    and schema in constant use stay cached (the hit rate of the normal case)."""
    pre = Preprocessor(model, LIMIT)
    assert pre.records.word_cache.max_bytes == 256 << 10 and pre.schema_cache.max_bytes == 512 << 10
    rng = random.Random(29)
    hot_text = "Tim Cook runs Apple in Cupertino."
    scripts = [chr(c) for c in range(0x4E00, 0x4E00 + 2_000)]  # CJK ideographs: distinct stand-in keys
    for i in range(1_500):
        text = " ".join(_word(rng, rng.randrange(2, 9)) for _ in range(6)) + " " + "".join(rng.sample(scripts, 4))
        schema = json.dumps({"entities": [_word(rng, 8), _word(rng, 12)] + [f"l{j}" for j in range(i % 7)]})
        assert pre.prepare(i, Request(text, schema)).num_tokens <= LIMIT
        pre.prepare(i, Request(hot_text, SCHEMA))
        ids = list(pre.parse_schema(schema)[0].input_ids) + [5, 6, 7]
        pre.core_record(ids, [len(ids) - 3], schema)
        if i % 50 == 0:
            assert _within_bounds(pre) == []
    assert _within_bounds(pre) == []
    caches = pre.caches()
    for name in ("words", "schemas", "stand_ins", "tokens"):
        cache = caches[name]
        assert len(cache) == cache.max_entries or cache.bytes > cache.max_bytes // 4, f"{name} was not filled"
    hot_words = [w for w, _, _ in pre.records.words(pre.processor._normalize_text(hot_text))]
    assert all(pre.records.word_cache.fresh.get(w) is not None for w in hot_words), "words in constant use stay"
    assert pre.schema_cache.fresh.get(SCHEMA) is not None, "the schema in constant use stays"


def test_hot_words_survive_a_flood_of_distinct_words(model, small_bounds):
    """Generational LRU: the words of the steady traffic stay cached while a flood of distinct
    words (accepted requests) churns through the rest of the cache."""
    pre = Preprocessor(model, LIMIT)
    rng = random.Random(31)
    steady = [" ".join(t.split()[:30]) for t in demo_texts(10, seed=9)]
    for i in range(600):
        pre.prepare(i, Request(steady[i % len(steady)], SCHEMA))
        pre.prepare(i, Request(" ".join(_word(rng, 6) for _ in range(12)), SCHEMA))
    words = pre.records.word_cache
    steady_words = {w for t in steady for w, _, _ in pre.records.words(t)}
    missing = [w for w in steady_words if words.fresh.get(w) is None and words.old.get(w) is None]
    assert missing == []
    assert words.bytes <= words.max_bytes


def test_over_long_words_are_never_cached(model):
    pre = Preprocessor(model, 4096)
    word = "x" * (MAX_CACHED_WORD_CHARS + 1)
    prepared = pre.prepare(0, Request(f"a {word} b", SCHEMA))
    assert word in prepared.record.text_tokens
    assert pre.records.word_cache.get(word) is None
    assert pre.records.word_cache.get("x" * MAX_CACHED_WORD_CHARS) is None
    pre.prepare(0, Request("x" * MAX_CACHED_WORD_CHARS, SCHEMA))
    assert pre.records.word_cache.get("x" * MAX_CACHED_WORD_CHARS) is not None, "up to the cap: cached"
    tokens = pre.processor._tokenize_cached
    assert isinstance(tokens, preprocess.TokenCache)
    assert tokens.cache.get(word) is None, "GLiNER2's token cache does not keep text words"


def test_records_with_bounded_caches_still_equal_gliner2(model):
    """The bounded caches change no record: refused first, accepted later, same record as GLiNER2's."""
    import dataclasses

    from gliner2.inference.schema import Schema

    pre = Preprocessor(model, 64)
    processor = model.processor
    schema = Schema.from_dict(demo_schemas()[0]).build()
    part = pre.records.schema_part(schema)
    text = demo_texts(1, seed=41)[0]
    with pytest.raises(preprocess.TokenLimitExceeded):
        pre.records.record(text * 4, part, limit=64)
    fields = [f.name for f in dataclasses.fields(processor.transform_record(text, schema)) if f.init]
    for _ in range(2):  # cold, then from the caches
        got, want = pre.records.record(text, part, limit=4096), processor.transform_record(text, schema)
        assert [getattr(got, f) for f in fields] == [getattr(want, f) for f in fields]
