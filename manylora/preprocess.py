"""Request -> GLiNER2 record, with everything that depends only on the schema computed once.

GLiNER2's ``processor.transform_record(text, schema)`` rebuilds the schema's prompt tokens,
deep-copies the schema twice and tokenizes every schema element on every call. A serving
workload repeats a few schemas over many texts, so ``RecordBuilder`` splits the work:

* per schema (cached by its JSON text): GLiNER2's own ``transform_record`` on a probe text
  gives the schema tokens, task types, inference labels, the classification prefix and the
  token ids of everything up to and including ``[SEP_TEXT]``;
* per request: GLiNER2's word splitting on the text (an equivalent, faster pattern for
  ASCII text; other text runs through it on a same-length proxy of stand-in characters),
  then each word's subword ids from a bounded per-word cache;
* per batch: ``pad_batch`` builds the ``PreprocessedBatch`` GLiNER2's ``_pad_batch``
  builds, with numpy rows instead of a tensor per record and field, and the schema
  routes once per schema.

The result is field for field the record GLiNER2 builds (tests compare them on varied
texts and schemas), so GLiNER2's own batching and decoding run on it unchanged.

Memory is bounded whatever clients send: every cache here (and GLiNER2's own per-token cache,
which ``RecordBuilder`` replaces on its processor) is a ``BoundedCache``, bounded in entries
and in the bytes it holds (the ``*_CACHE_*`` constants below); a word longer than
``MAX_CACHED_WORD_CHARS`` is never cached, and ``record(text, part, limit)`` caches nothing
for a request it refuses (``TokenLimitExceeded``).
"""

from __future__ import annotations

import contextlib
import copy
import re
import sys
import threading
from dataclasses import dataclass, fields, is_dataclass
from itertools import accumulate, chain, repeat
from typing import Any, Callable, Hashable, Optional, Sequence

import numpy as np
import torch
from gliner2.processing.word_splitter import WhitespaceTokenSplitter
from gliner2.processor import PreprocessedBatch, TransformedRecord

PROBE_TEXT = "probe."

# Cache bounds, per RecordBuilder (one per model instance: each CPU front and each GPU stage).
# Entries are counted by what they hold (sys.getsizeof of key, value and the value's items,
# plus DICT_ENTRY_BYTES for the dict slot); worst case for the words, tokens, slots and
# stand-ins together: 64 + 8 + 16 + 4 = 92 MiB per instance, whatever the traffic (with
# pre.SCHEMA_CACHE_BYTES: 156 MiB).
# A word (or schema token) longer than this is tokenized every time and never cached: words
# of natural text are a few to twenty characters (the demo texts' longest: a 29-character e-mail
# address; URLs are words too, and one over 64 characters is simply tokenized again), while one
# distinct huge "word" (a 131,072-character text without spaces: 115,000 tokens) held 5 MB
# per request in the caches before, kept after its INVALID_ARG.
MAX_CACHED_WORD_CHARS = 64
# Words -> subword ids. 2^18 entries: the vocabulary of a long-running mixed workload (the
# demo's 2,000 texts have 7,600 distinct words); a typical entry (a word of 4-12 characters,
# 1-3 ids) is 230-300 bytes, so 2^18 of them fit the byte bound and it binds only when
# clients send long words (64 MiB holds 28,000 words of 64 characters at one id a character).
WORD_CACHE_SIZE = 1 << 18
WORD_CACHE_BYTES = 64 << 20
# GLiNER2's own token -> pieces cache (processor._tokenize_cached, a 50,000-entry LRU without
# a byte bound): with the words cached here it sees only schema tokens when a schema is first
# parsed (labels, one token per task's joined descriptions), a few dozen per schema.
TOKEN_CACHE_SIZE = 1 << 14
TOKEN_CACHE_BYTES = 8 << 20
# ("text", index, num_schemas) runs, one per (first text index, schema count): one per
# distinct schema length in use; a run of n slots is about 100 n bytes (4096 slots: 400 KB).
SLOT_RUN_CACHE_SIZE = 4096
SLOT_RUN_CACHE_BYTES = 16 << 20
# Non-ASCII character -> stand-in: a text brings only its distinct characters; 2^15 covers
# every letter of the scripts in use (CJK included) at about 130 bytes each (4 MiB).
STAND_IN_CACHE_SIZE = 1 << 15
STAND_IN_CACHE_BYTES = 4 << 20
# A dict slot (hash, key, value; a third of the table kept free), counted for every entry.
DICT_ENTRY_BYTES = 96
INT_BYTES = sys.getsizeof(1 << 20)  # token ids above 256 are int objects of their own


class TokenLimitExceeded(Exception):
    """``RecordBuilder.record``: the text and schema are ``tokens`` tokens, above the limit given."""

    def __init__(self, tokens: int):
        super().__init__(tokens)
        self.tokens = tokens


class BoundedCache:
    """A map bounded in entries (``max_entries``) and in bytes (``max_bytes``, as ``size(key,
    value)`` estimates them), evicting the least recently used entries by generations.

    Entries live in two dicts, ``fresh`` and ``old``. A hit in ``old`` moves the entry to
    ``fresh``; when ``fresh`` holds half of either bound, ``old`` is dropped and ``fresh``
    becomes ``old``. An entry used at least once per half-cache of insertions therefore stays
    and one unused for longer goes: LRU at the granularity of half the cache, with lookups at
    plain-dict speed (the per-word hot path maps ``cache.fresh.get`` over a text's words, and
    asks ``get`` only for what that misses). An entry over ``max_item_bytes`` (default: a
    sixteenth of ``max_bytes``) is never stored. Writes take a lock; reads need none.
    """

    def __init__(
        self,
        max_entries: int,
        max_bytes: int,
        size: Callable[[Any, Any], int],
        max_item_bytes: Optional[int] = None,
    ):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.max_item_bytes = min(max_bytes // 16 if max_item_bytes is None else max_item_bytes, max_bytes // 2)
        self._size = size
        self._lock = threading.Lock()
        self.fresh: dict = {}
        self.old: dict = {}
        self._fresh_bytes = self._old_bytes = 0

    def __len__(self) -> int:
        return len(self.fresh) + len(self.old)

    @property
    def bytes(self) -> int:
        """The bytes held now, as counted (never above ``max_bytes``)."""
        return self._fresh_bytes + self._old_bytes

    def get(self, key: Hashable, default=None):
        value = self.fresh.get(key)
        if value is not None:
            return value
        if key in self.old:
            with self._lock:
                value = self.old.pop(key, None)
                if value is not None:
                    nbytes = self._size(key, value)
                    self._old_bytes -= nbytes
                    self._insert(key, value, nbytes)
                    return value
        return default

    def put(self, key: Hashable, value) -> bool:
        """Store ``value`` (not None) unless it is too large alone; True if stored."""
        nbytes = self._size(key, value)
        if nbytes > self.max_item_bytes:
            return False
        with self._lock:
            if key in self.old:
                self._old_bytes -= self._size(key, self.old.pop(key))
            if key in self.fresh:
                self._fresh_bytes -= self._size(key, self.fresh.pop(key))
            self._insert(key, value, nbytes)
        return True

    def _insert(self, key, value, nbytes: int) -> None:  # under the lock
        if len(self.fresh) >= self.max_entries // 2 or self._fresh_bytes + nbytes > self.max_bytes // 2:
            self.old, self._old_bytes = self.fresh, self._fresh_bytes
            self.fresh, self._fresh_bytes = {}, 0
        self.fresh[key] = value
        self._fresh_bytes += nbytes

    def clear(self) -> None:
        with self._lock:
            self.fresh, self.old = {}, {}
            self._fresh_bytes = self._old_bytes = 0


def deep_sizeof(obj) -> int:
    """Bytes of ``obj`` and of everything it holds (containers, dataclass fields), each object
    counted once: what a cache entry keeps alive, as ``sys.getsizeof`` measures it."""
    seen: set = set()
    total = 0
    stack = [obj]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        total += str_bytes(item) if isinstance(item, str) else sys.getsizeof(item)
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
        elif is_dataclass(item) and not isinstance(item, type):
            stack.extend(getattr(item, f.name) for f in fields(item))
    return total


def str_bytes(s: str) -> int:
    """sys.getsizeof of a str, as a function of its content alone: a non-ASCII str grows
    once its UTF-8 form is cached in it (the tokenizer asks for it), so it is counted with
    room for that (4 bytes a character each way, at most), and its count never changes."""
    return sys.getsizeof(s) if s.isascii() else 81 + 8 * len(s)


def _word_entry_size(word: str, ids: tuple) -> int:
    return str_bytes(word) + sys.getsizeof(ids) + INT_BYTES * len(ids) + DICT_ENTRY_BYTES


def _pieces_entry_size(token: str, pieces: list) -> int:
    return str_bytes(token) + sys.getsizeof(pieces) + sum(map(str_bytes, pieces)) + DICT_ENTRY_BYTES


def _slot_run_size(key: tuple, run: list) -> int:
    return sys.getsizeof(run) + len(run) * (sys.getsizeof(("text", 0, 0)) + INT_BYTES) + 200 + DICT_ENTRY_BYTES


def _stand_in_size(c: str, stand_in: str) -> int:
    return str_bytes(c) + DICT_ENTRY_BYTES  # stand-ins are shared one-character strings


# Words the tokenizers backend's ``encode`` must split exactly as ``tokenizer.tokenize`` does
# before ``word_tokenizer`` lets it stand in: cases, digits, amounts, compounds, accents, dotted
# capitals, CJK, an emoji, a zero-width space, GLiNER2's markers, a word past the caches' length.
_PROBE_WORDS = (
    "word", "Word", "2026", "3.5", "$4,372", "e-mail", "a.b@example.com", "ü", "ünïcödé", "İstanbul",
    "東京", "😀", "\u200b", "[SEP_TEXT]", "[E]", "[e]", "(", "|", "x" * 70,
)  # fmt: skip


def word_tokenizer(tokenizer) -> Callable[[str], list]:
    """``tokenizer.tokenize`` for one word, through the tokenizers backend's ``encode`` where
    that gives the same pieces.

    transformers' ``tokenize`` builds a one-item batch for the backend's ``encode_batch``
    (validation, settings, a ``BatchEncoding``): 30.1 us a new word against 8.1 us for this
    on the 2-core CPU host (``perf/bench_host_steps.py``, 4,000 random words, the demo
    tokenizer, transformers 5.24). A front tokenizes the words its word cache has not seen:
    ~0.65 a row in a steady stream of demo texts, ~4 a row while its cache is new (each front
    has its own).
    ``tokenize`` runs ``encode_batch`` with the backend's truncation and padding off and its
    ``encode_special_tokens`` set to ``split_special_tokens``; ``encode`` is used only while the
    backend is in that state, and only if it split every probe word as ``tokenize`` did.
    Otherwise (a slow tokenizer, another version's rules) this is ``tokenize`` itself."""
    tokenize = tokenizer.tokenize
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not callable(getattr(backend, "encode", None)):
        return tokenize
    split = bool(getattr(tokenizer, "split_special_tokens", False))
    encode = backend.encode

    def pieces(word: str) -> list:
        if backend.truncation is not None or backend.padding is not None:
            return tokenize(word)
        if getattr(backend, "encode_special_tokens", split) != split:
            return tokenize(word)
        return encode(word, add_special_tokens=False).tokens

    try:  # the backend itself, not ``pieces``: that would compare tokenize with itself in another state
        same = all(encode(w, add_special_tokens=False).tokens == tokenize(w) for w in _PROBE_WORDS)
    except Exception:  # a backend without these attributes or this signature
        same = False
    return pieces if same else tokenize


class TokenCache:
    """GLiNER2's ``processor._tokenize_cached`` (token -> subword pieces), bounded in bytes as
    well as entries; tokens over ``MAX_CACHED_WORD_CHARS`` are tokenized and not kept.
    ``uncached``: the tokenizer's own function, for callers that cache the result themselves.
    Inside ``deferred()`` new pieces are collected instead of cached, for ``keep`` to cache
    once the caller knows they are worth it (a schema is parsed before it can be refused)."""

    def __init__(self, tokenize: Callable[[str], list]):
        self.uncached = tokenize
        self.cache = BoundedCache(TOKEN_CACHE_SIZE, TOKEN_CACHE_BYTES, _pieces_entry_size)
        self._pending: Optional[dict] = None

    def __call__(self, token: str) -> list:
        pieces = self.cache.get(token)
        if pieces is None:
            pending = self._pending
            pieces = pending.get(token) if pending is not None else None
            if pieces is None:
                pieces = self.uncached(token)
                if len(token) <= MAX_CACHED_WORD_CHARS:
                    if pending is not None:
                        pending[token] = pieces
                    else:
                        self.cache.put(token, pieces)
        return pieces

    @contextlib.contextmanager
    def deferred(self):
        """Collect new entries in the dict yielded rather than cache them. Not nested; two
        threads parsing at once may cache or drop each other's entries (answers are the same)."""
        pending = self._pending = {}
        try:
            yield pending
        finally:
            self._pending = None

    def keep(self, pending: dict) -> None:
        for token, pieces in pending.items():
            self.cache.put(token, pieces)


# GLiNER2's whitespace splitter, specialised to ASCII text. Its word class is \w plus every
# Unicode combining mark plus ZWNJ/ZWJ; none of those extras is ASCII, so on ASCII input
# the class is exactly \w, and every other part of the pattern (same alternatives, same
# order, same flags) matches the same characters. Six times faster, because the full
# class is huge; tests check equality with GLiNER2's splitter (hypothesis over ASCII).
_ASCII_WORDS = re.compile(
    r"(?:https?://[^\s]+|www\.[^\s]+)"  # URLs
    r"|[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,}"  # e-mail addresses
    r"|@[a-z0-9_]+"  # handles
    r"|\w+(?:[-_]\w+)*"  # words, hyphen/underscore compounds
    r"|\S",  # any other single non-space character
    re.IGNORECASE,
)
# The same pattern without the alternatives a text cannot match: without "@" neither e-mail
# addresses nor handles, without "http" or "www." no URLs. Dropping an alternative that never
# matches changes no match. Measured (demo texts of 60-120 words, a 2-core CPU host): the
# full pattern takes 89.5 us a text, the word alternatives alone 41.4.
_ASCII_NO_AT = re.compile(r"(?:https?://[^\s]+|www\.[^\s]+)|\w+(?:[-_]\w+)*|\S", re.IGNORECASE)
_ASCII_PLAIN = re.compile(r"\w+(?:[-_]\w+)*|\S", re.IGNORECASE)


def _ascii_pattern(lowered: str) -> re.Pattern:
    """The cheapest of the three patterns that splits ``lowered`` as ``_ASCII_WORDS`` does."""
    if "@" in lowered:
        return _ASCII_WORDS
    return _ASCII_NO_AT if ("http" in lowered or "www." in lowered) else _ASCII_PLAIN


# Non-ASCII text runs through the same fast pattern on a proxy text of equal length: each
# non-ASCII character is replaced by an ASCII or Latin-1 stand-in that every element of
# GLiNER2's pattern (matched case-insensitively, one character at a time) accepts or
# refuses exactly as it does the character itself. The regex engine then takes the same
# path through both texts, so the word spans are the same; the words are cut from the
# original text. A character without such a stand-in sends its text to GLiNER2's splitter.
def _pattern_elements():
    from gliner2.processing.word_splitter import _WORD

    literals = [re.escape(c) for c in "htps:/w.@"]
    classes = [r"[^\s]", r"[a-z0-9._%+-]", r"[a-z0-9.-]", r"[a-z]", r"[a-z0-9_]", _WORD, r"[-_]", r"\S"]
    return [re.compile(e, re.IGNORECASE) for e in literals + classes]


_STAND_INS = " \u00e9\u00a7" + "abcdefghijklmnopqrstuvwxyz"  # space, a non-ASCII word letter, a symbol, letters


@dataclass(frozen=True)
class SchemaPart:
    schema: dict  # the schema as GLiNER2 keeps it on the record (choices preserved)
    prefix: tuple  # classification prefix words GLiNER2 puts before the text words
    input_ids: tuple  # subword ids up to and including [SEP_TEXT]
    mapped_indices: tuple
    first_text_index: int  # index of the first text token in GLiNER2's combined token list
    num_schemas: int
    schema_tokens_list: list
    structure_labels: list
    task_types: list
    schema_special_positions: list


class RecordBuilder:
    def __init__(self, processor):
        self.processor = processor
        # GLiNER2's token cache has no byte bound: the processor gets a bounded one (the same
        # answers: both cache the tokenizer's deterministic tokenize); a test's stand-in stays inside
        tokenize = getattr(processor, "_tokenize_cached", None)
        if tokenize is not None and not isinstance(tokenize, TokenCache):
            inner = getattr(tokenize, "__wrapped__", tokenize)
            if inner == getattr(getattr(processor, "tokenizer", None), "tokenize", None):  # GLiNER2's own
                inner = word_tokenizer(processor.tokenizer)
            processor._tokenize_cached = TokenCache(inner)
        self.word_cache = BoundedCache(WORD_CACHE_SIZE, WORD_CACHE_BYTES, _word_entry_size)
        self._ascii_fast_path = type(processor.word_splitter) is WhitespaceTokenSplitter
        # ("text", index, num_schemas) tuples are immutable: share them between records
        self.slot_runs = BoundedCache(SLOT_RUN_CACHE_SIZE, SLOT_RUN_CACHE_BYTES, _slot_run_size)
        # non-ASCII character -> its stand-in ("" = none)
        self.stand_ins = BoundedCache(STAND_IN_CACHE_SIZE, STAND_IN_CACHE_BYTES, _stand_in_size)
        self._elements = _pattern_elements() if self._ascii_fast_path else []

    def caches(self) -> dict[str, BoundedCache]:
        """Every cache this builder fills, by name (GLiNER2's token cache as "tokens")."""
        found = {"words": self.word_cache, "slot_runs": self.slot_runs, "stand_ins": self.stand_ins}
        tokenize = getattr(self.processor, "_tokenize_cached", None)
        if isinstance(tokenize, TokenCache):
            found["tokens"] = tokenize.cache
        return found

    def _text_slots(self, first: int, schemas: int, count: int) -> list:
        """The mapped-index tuples ("text", first + k, schemas) for k < count (a shared list's slice)."""
        run = self.slot_runs.get((first, schemas))
        if run is None or len(run) < count:
            run = [("text", first + k, schemas) for k in range(max(count, 512))]
            self.slot_runs.put((first, schemas), run)
        return run[:count]

    def words(self, text: str):
        """(lower-cased word, start, end) as GLiNER2's word splitter yields them."""
        words, starts, ends = self._split(text)
        return list(zip(words, starts, ends))

    def _split(self, text: str) -> tuple[list, list, list]:
        """Words (lower-cased), their start and end offsets, as three lists."""
        if self._ascii_fast_path and text.isascii():
            # ASCII lower-casing keeps every offset and no pattern class depends on case
            lowered = text.lower()
            spans = [m.span() for m in _ascii_pattern(lowered).finditer(lowered)]
            return [lowered[a:b] for a, b in spans], [a for a, _ in spans], [b for _, b in spans]
        proxy = self._proxy(text) if self._ascii_fast_path else None
        if proxy is not None:
            spans = [m.span() for m in _ASCII_WORDS.finditer(proxy)]
            return [text[a:b].lower() for a, b in spans], [a for a, _ in spans], [b for _, b in spans]
        triples = list(self.processor.word_splitter(text, lower=True))
        return [w for w, _, _ in triples], [a for _, a, _ in triples], [b for _, _, b in triples]

    def _proxy(self, text: str):
        """``text`` with every non-ASCII character replaced by its stand-in, or None."""
        table = {}
        for c in set(text):
            if c.isascii():
                continue
            stand_in = self.stand_ins.get(c)
            if stand_in is None:
                stand_in = self._find_stand_in(c)
                self.stand_ins.put(c, stand_in)
            if not stand_in:
                return None
            table[ord(c)] = stand_in
        return text.translate(table)

    def _find_stand_in(self, c: str) -> str:
        accepts = [e.fullmatch(c) is not None for e in self._elements]
        for candidate in _STAND_INS:
            if [e.fullmatch(candidate) is not None for e in self._elements] == accepts:
                return candidate
        return ""

    def _word_ids_uncached(self, word: str) -> tuple:
        p = self.processor
        pieces = p._token_cache.get(word)
        if pieces is None:  # the word cache keeps the ids: GLiNER2's token cache need not keep the pieces
            tokenize = p._tokenize_cached
            pieces = getattr(tokenize, "uncached", tokenize)(word)
        return tuple(p.tokenizer.convert_tokens_to_ids(pieces))

    def word_ids(self, words: list) -> tuple[list, Optional[dict]]:
        """Each word's subword ids, and the ids computed here for words the cache missed (to
        be kept with ``keep_words`` once the request is accepted; None if nothing missed)."""
        ids = list(map(self.word_cache.fresh.get, words))
        if None not in ids:
            return ids, None
        computed: dict = {}
        cache = self.word_cache
        for k, word in enumerate(words):
            if ids[k] is None:
                found = cache.get(word)
                if found is None:
                    found = computed.get(word)
                    if found is None:
                        found = computed[word] = self._word_ids_uncached(word)
                ids[k] = found
        return ids, computed

    def keep_words(self, computed: Optional[dict]) -> None:
        """Cache the ids ``word_ids`` computed (words over MAX_CACHED_WORD_CHARS excepted)."""
        if computed:
            put = self.word_cache.put
            for word, ids in computed.items():
                if len(word) <= MAX_CACHED_WORD_CHARS:
                    put(word, ids)

    def schema_part(self, schema_dict: dict) -> SchemaPart:
        """The schema-dependent half of a record (callers cache it per schema)."""
        probe = self.processor.transform_record(PROBE_TEXT, schema_dict)
        probe_words = len(list(self.processor.word_splitter(PROBE_TEXT, lower=True)))
        prefix = tuple(probe.text_tokens[: len(probe.text_tokens) - probe_words])
        sep = next(i for i, (kind, _, _) in enumerate(probe.mapped_indices) if kind == "sep")
        return SchemaPart(
            schema=probe.schema,
            prefix=prefix,
            input_ids=tuple(probe.input_ids[: sep + 1]),
            mapped_indices=tuple(probe.mapped_indices[: sep + 1]),
            first_text_index=probe.mapped_indices[sep][1] + 1,
            num_schemas=len(probe.schema_tokens_list),
            schema_tokens_list=probe.schema_tokens_list,
            structure_labels=probe.structure_labels,
            task_types=probe.task_types,
            schema_special_positions=probe.schema_special_positions,
        )

    def record(self, text: str, part: SchemaPart, limit: Optional[int] = None, max_len: int = 0) -> TransformedRecord:
        """The record GLiNER2's ``transform_record(text, schema, max_len)`` would build (``max_len``
        0: None, every word). ``limit``: raise TokenLimitExceeded, caching nothing, if it would
        hold more tokens than that."""
        p = self.processor
        text = p._normalize_text(text)
        words, starts, ends = self._split(text)
        if max_len and len(words) > max_len:  # GLiNER2 cuts the text's word tokens, the text stays whole
            words, starts, ends = words[:max_len], starts[:max_len], ends[:max_len]
        text_tokens = list(part.prefix) + words
        ids, computed = self.word_ids(text_tokens)
        lengths = list(map(len, ids))
        offset = len(part.input_ids)
        if limit is not None and offset + sum(lengths) > limit:
            raise TokenLimitExceeded(offset + sum(lengths))
        self.keep_words(computed)
        first_positions = [offset + before for before in accumulate(lengths, initial=0)][:-1]
        input_ids = list(part.input_ids)
        input_ids.extend(chain.from_iterable(ids))
        slots = self._text_slots(part.first_text_index, part.num_schemas, len(text_tokens))
        mapped = list(part.mapped_indices)
        if lengths.count(1) == len(lengths):  # every word is one subword
            mapped.extend(slots)
        else:
            mapped.extend(chain.from_iterable(repeat(slot, n) for slot, n in zip(slots, lengths)))
        return TransformedRecord(
            input_ids=input_ids,
            mapped_indices=mapped,
            schema_tokens_list=part.schema_tokens_list,
            text_tokens=text_tokens,
            structure_labels=part.structure_labels,
            task_types=part.task_types,
            start_token_idx=starts,
            end_token_idx=ends,
            text=text,
            # one schema object per record: decoding may key on it (and must not share mutations)
            schema=copy.copy(part.schema),
            text_word_first_positions=first_positions,
            schema_special_positions=part.schema_special_positions,
        )

    def pad_batch(self, records: Sequence[TransformedRecord]) -> PreprocessedBatch:
        """GLiNER2's ``processor._pad_batch(records)``, field for field (tests compare them).

        No Python loop over rows for the token and word arrays: each is one ``fromiter`` of
        all rows and one masked assignment; the schema routes are assigned once per distinct
        schema. Measured (perf/bench_host_steps.py, 1,024 GPU-stage rows, a 2-core CPU host,
        medians of 3 alternating runs): 14.8 -> 3.1 us per row, with the parse's array rows."""
        if not records:
            return self.processor._pad_batch(list(records))
        rows = len(records)
        lengths = [len(r.input_ids) for r in records]
        input_ids, token_mask = _pad_rows([r.input_ids for r in records], lengths)
        attention_mask = token_mask.astype(np.int64)
        word_counts = [len(r.text_word_first_positions) for r in records]
        word_indices, word_mask = _pad_rows([r.text_word_first_positions for r in records], word_counts)
        routes: dict = {}  # per schema (records of one schema share its lists): routes and its rows
        for i, r in enumerate(records):
            key = (id(r.schema_special_positions), id(r.task_types))
            entry = routes.get(key)
            if entry is None:
                query, cls = [], []
                for group, positions in enumerate(r.schema_special_positions):
                    pairs = [(position, group) for position in positions[1:]]
                    (cls if r.task_types[group] == "classifications" else query).extend(pairs)
                entry = routes[key] = (query, cls, [])
            entry[2].append(i)

        def pad_routes(which: int):
            width = max((len(entry[which]) for entry in routes.values()), default=0)
            indices = np.zeros((rows, width), dtype=np.int64)
            groups = np.zeros((rows, width), dtype=np.int64)
            counts = np.zeros(rows, dtype=np.int64)
            for entry in routes.values():
                pairs, members = entry[which], entry[2]
                if pairs:
                    indices[members, : len(pairs)] = [p for p, _ in pairs]
                    groups[members, : len(pairs)] = [g for _, g in pairs]
                    counts[members] = len(pairs)
            mask = np.arange(width)[None, :] < counts[:, None]
            return torch.from_numpy(indices), torch.from_numpy(mask), torch.from_numpy(groups)

        query_indices, query_mask, query_groups = pad_routes(0)
        cls_indices, cls_mask, cls_groups = pad_routes(1)
        return PreprocessedBatch(
            input_ids=torch.from_numpy(input_ids),
            attention_mask=torch.from_numpy(attention_mask),
            mapped_indices=[r.mapped_indices for r in records],
            schema_counts=[r.num_schemas for r in records],
            original_lengths=lengths,
            structure_labels=[r.structure_labels for r in records],
            task_types=[r.task_types for r in records],
            text_tokens=[r.text_tokens for r in records],
            schema_tokens_list=[r.schema_tokens_list for r in records],
            start_mappings=[r.start_token_idx for r in records],
            end_mappings=[r.end_token_idx for r in records],
            original_texts=[r.text for r in records],
            original_schemas=[r.schema for r in records],
            text_word_indices=torch.from_numpy(word_indices),
            text_word_mask=torch.from_numpy(word_mask),
            text_word_counts=word_counts,
            schema_special_indices=[r.schema_special_positions for r in records],
            query_marker_indices=query_indices,
            query_marker_mask=query_mask,
            query_group_index=query_groups,
            cls_marker_indices=cls_indices,
            cls_marker_mask=cls_mask,
            cls_group_index=cls_groups,
        )


def _pad_rows(values: Sequence[Sequence[int]], lengths: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ints (lists, or numpy arrays as the GPU stage's parse gives them) -> ([rows,
    longest] int64 zero-padded, its bool mask of real entries), with one masked assignment."""
    counts = np.asarray(lengths, dtype=np.int64)
    mask = np.arange(max(lengths))[None, :] < counts[:, None]
    out = np.zeros(mask.shape, dtype=np.int64)
    if isinstance(values[0], np.ndarray):
        out[mask] = np.concatenate(values)
    else:
        out[mask] = np.fromiter(chain.from_iterable(values), dtype=np.int64, count=int(counts.sum()))
    return out, mask
