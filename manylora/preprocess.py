"""Request -> GLiNER2 record, with everything that depends only on the schema computed once.

GLiNER2's ``processor.transform_record(text, schema)`` rebuilds the schema's prompt tokens,
deep-copies the schema twice and tokenizes every schema element on every call. A serving
workload repeats a few schemas over many texts, so ``RecordBuilder`` splits the work:

* per schema (cached by its JSON text): GLiNER2's own ``transform_record`` on a probe text
  gives the schema tokens, task types, inference labels, the classification prefix and the
  token ids of everything up to and including ``[SEP_TEXT]``;
* per request: GLiNER2's word splitting on the text (an equivalent, faster pattern for
  ASCII text), then each word's subword ids from a bounded per-word cache.

The result is field for field the record GLiNER2 builds (tests compare them on varied
texts and schemas), so GLiNER2's own batching and decoding run on it unchanged.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from functools import lru_cache

from gliner2.processing.word_splitter import WhitespaceTokenSplitter
from gliner2.processor import TransformedRecord

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

    def words(self, text: str):
        """(lower-cased word, start, end) as GLiNER2's word splitter yields them."""
        if self._ascii_fast_path and text.isascii():
            return [(m.group().lower(), m.start(), m.end()) for m in _ASCII_WORDS.finditer(text)]
        return self.processor.word_splitter(text, lower=True)

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
        words, starts, ends = [], [], []
        for token, start, end in self.words(text):
            words.append(token)
            starts.append(start)
            ends.append(end)
        text_tokens = list(part.prefix) + words
        input_ids = list(part.input_ids)
        mapped = list(part.mapped_indices)
        first_positions = []
        base = part.first_text_index
        for k, token in enumerate(text_tokens):
            ids = self._word_ids(token)
            first_positions.append(len(input_ids))
            input_ids.extend(ids)
            mapped.extend([("text", base + k, part.num_schemas)] * len(ids))
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
