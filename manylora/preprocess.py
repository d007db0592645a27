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
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate, chain, repeat
from typing import Sequence

import numpy as np
import torch
from gliner2.processing.word_splitter import WhitespaceTokenSplitter
from gliner2.processor import PreprocessedBatch, TransformedRecord

PROBE_TEXT = "probe."
WORD_CACHE_SIZE = 1 << 18

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
        self._word_ids = lru_cache(maxsize=WORD_CACHE_SIZE)(self._word_ids_uncached)
        self._ascii_fast_path = type(processor.word_splitter) is WhitespaceTokenSplitter
        # ("text", index, num_schemas) tuples are immutable: share them between records
        self._slot_runs: dict[tuple[int, int], list] = {}
        self._stand_in: dict[str, str] = {}  # non-ASCII character -> its stand-in ("" = none)
        self._elements = _pattern_elements() if self._ascii_fast_path else []

    def _text_slots(self, first: int, schemas: int, count: int) -> list:
        """The mapped-index tuples ("text", first + k, schemas) for k < count (a shared list's slice)."""
        run = self._slot_runs.get((first, schemas))
        if run is None or len(run) < count:
            if len(self._slot_runs) > 4096:
                self._slot_runs.clear()
            run = self._slot_runs[first, schemas] = [("text", first + k, schemas) for k in range(max(count, 512))]
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
            spans = [m.span() for m in _ASCII_WORDS.finditer(lowered)]
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
            stand_in = self._stand_in.get(c)
            if stand_in is None:
                stand_in = self._stand_in[c] = self._find_stand_in(c)
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
        if pieces is None:
            pieces = p._tokenize_cached(word)
        return tuple(p.tokenizer.convert_tokens_to_ids(pieces))

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

    def record(self, text: str, part: SchemaPart) -> TransformedRecord:
        """The record GLiNER2's ``transform_record(text, schema)`` would build."""
        p = self.processor
        text = p._normalize_text(text)
        words, starts, ends = self._split(text)
        text_tokens = list(part.prefix) + words
        ids = list(map(self._word_ids, text_tokens))
        lengths = list(map(len, ids))
        offset = len(part.input_ids)
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
        """GLiNER2's ``processor._pad_batch(records)``, field for field (tests compare them)."""
        if not records:
            return self.processor._pad_batch(list(records))
        rows = len(records)
        lengths = [len(r.input_ids) for r in records]
        input_ids = np.zeros((rows, max(lengths)), dtype=np.int64)
        for i, r in enumerate(records):
            input_ids[i, : lengths[i]] = r.input_ids
        attention_mask = (np.arange(input_ids.shape[1])[None, :] < np.asarray(lengths)[:, None]).astype(np.int64)
        word_counts = [len(r.text_word_first_positions) for r in records]
        word_indices = np.zeros((rows, max(word_counts)), dtype=np.int64)
        for i, r in enumerate(records):
            word_indices[i, : word_counts[i]] = r.text_word_first_positions
        word_mask = np.arange(word_indices.shape[1])[None, :] < np.asarray(word_counts)[:, None]
        routes = {}  # per schema (records of one schema share its lists): (query, classification) routes
        for r in records:
            key = (id(r.schema_special_positions), id(r.task_types))
            if key not in routes:
                query, cls = [], []
                for group, positions in enumerate(r.schema_special_positions):
                    pairs = [(position, group) for position in positions[1:]]
                    (cls if r.task_types[group] == "classifications" else query).extend(pairs)
                routes[key] = (query, cls)
        per_record = [routes[(id(r.schema_special_positions), id(r.task_types))] for r in records]

        def pad_routes(which: int):
            width = max((len(rs[which]) for rs in per_record), default=0)
            indices = np.zeros((rows, width), dtype=np.int64)
            groups = np.zeros((rows, width), dtype=np.int64)
            counts = np.zeros(rows, dtype=np.int64)
            for i, rs in enumerate(per_record):
                pairs = rs[which]
                if pairs:
                    indices[i, : len(pairs)] = [p for p, _ in pairs]
                    groups[i, : len(pairs)] = [g for _, g in pairs]
                    counts[i] = len(pairs)
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
