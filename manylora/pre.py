"""Pre stage: one validated request -> GLiNER2's record for it, and what post needs to decode it.

Runs on the CPU. In the Triton pipeline it runs in the ``gliner2`` front instances (as many
as the host's cores allow, ``instance_group.count``); in-process (``Engine.run``, tests,
benchmarks) the engine calls it directly. Nothing here touches the GPU or the adapter store.

* the schema is parsed once per SCHEMA text (a cache bounded in entries and bytes,
  ``SCHEMA_CACHE_*``): GLiNER2's ``Schema`` for validation, GLiNER2's schema dict and
  decoding metadata, and the schema half of the record (``RecordBuilder.schema_part``);
* per request: limits, then the text half of the record (``RecordBuilder.record``). A request
  refused for its length leaves no words in the caches (its new words are kept only once it
  is accepted), and a schema that cannot fit ``max_request_tokens`` alone is never kept;
* ``t_min``: the lowest threshold any decoding of this row compares a score with, clamped
  into [0, 1] (``post.core_threshold``): the GPU stage sends back only scores at or above it.
  Post compares with the request's real threshold, as GLiNER2 does.

An empty or whitespace-only TEXT is served like any other: GLiNER2 2.1.0 extracts from it
(its processor makes an empty text ".", and appends "." to one without final punctuation),
so a low threshold finds spans on that "." and classifications score their labels.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Any, Optional

from manylora.client.protocol import Request
from manylora.errors import INVALID_ARG, RequestError
from manylora.preprocess import (
    DICT_ENTRY_BYTES,
    BoundedCache,
    RecordBuilder,
    SchemaPart,
    TokenCache,
    TokenLimitExceeded,
    deep_sizeof,
    str_bytes,
)

CHARS_PER_TOKEN_BOUND = 32  # a text this many characters per allowed token is refused untokenized
# SCHEMA text -> (schema part, metadata). A server sees a few schemas; 4096 leaves room for
# per-user ones. An entry is its SCHEMA text plus what parsing built (deep_sizeof): 5-25 KB
# for the demo schemas, at most ~1.2 MB (a 65,536-character schema of 4,096 tokens, the most
# max_request_tokens lets a kept schema have); 64 MiB holds the 4096 entries of typical
# schemas, and at least 50 of the largest (one entry is at most a sixteenth of the bound).
SCHEMA_CACHE_SIZE = 4096
SCHEMA_CACHE_BYTES = 64 << 20


@dataclass
class Prepared:
    """One request on its way through the stages (``index``: its place in the caller's batch)."""

    index: int
    request: Request
    record: Any  # gliner2.processor.TransformedRecord
    metadata: Optional[dict]  # GLiNER2's decoding metadata (None in the GPU stage: post keeps it)
    num_tokens: int
    adapter: Any = None  # manylora.lora.adapter.LoraAdapter, looked up by the GPU stage
    t_min: float = 0.5


class Preprocessor:
    """Validation and tokenization of GLiNER2 requests for one checkpoint's processor."""

    def __init__(self, model, max_request_tokens: int):
        self.model = model  # a GLiNER2 instance: its processor and schema builder are used
        self.processor = model.processor
        self.records = RecordBuilder(self.processor)
        self.max_request_tokens = max_request_tokens
        # values are (part, metadata, bytes counted for the entry)
        self.schema_cache = BoundedCache(SCHEMA_CACHE_SIZE, SCHEMA_CACHE_BYTES, lambda key, value: value[2])

    def caches(self) -> dict[str, BoundedCache]:
        """Every cache of this preprocessor (and of its record builder), by name."""
        return {"schemas": self.schema_cache, **self.records.caches()}

    def parse_schema(self, schema_json: str) -> tuple[SchemaPart, dict]:
        """(schema part of the record, GLiNER2's decoding metadata) for one SCHEMA text; raises
        RequestError. Cached unless the schema alone is above max_request_tokens (then no
        request with it can be served: a flood of such schemas leaves nothing behind, in this
        cache or in GLiNER2's token cache)."""
        hit = self.schema_cache.get(schema_json)
        if hit is not None:
            return hit[0], hit[1]
        tokens = self.processor._tokenize_cached  # GLiNER2's, bounded: keeps the new tokens only with the schema
        deferred = tokens.deferred() if isinstance(tokens, TokenCache) else contextlib.nullcontext({})
        with deferred as new_tokens:
            part, metadata = self._parse_schema_uncached(schema_json)
        if len(part.input_ids) <= self.max_request_tokens:
            nbytes = str_bytes(schema_json) + deep_sizeof((part, metadata)) + DICT_ENTRY_BYTES
            self.schema_cache.put(schema_json, (part, metadata, nbytes))
            if isinstance(tokens, TokenCache):
                tokens.keep(new_tokens)
        return part, metadata

    def _parse_schema_uncached(self, schema_json: str) -> tuple[SchemaPart, dict]:
        """(schema part of the record, GLiNER2's decoding metadata) for one SCHEMA text."""
        from gliner2.inference.schema import Schema
        from pydantic import ValidationError

        try:
            data = json.loads(schema_json)
        except (ValueError, RecursionError) as exc:  # ValueError: also integers over Python's digit limit
            raise RequestError(INVALID_ARG, f"SCHEMA is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise RequestError(INVALID_ARG, f"SCHEMA must be a JSON object, got {type(data).__name__}")
        try:
            schema = Schema.from_dict(data)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'schema'}: {e['msg']}" for e in exc.errors())
            raise RequestError(INVALID_ARG, f"SCHEMA is not a valid GLiNER2 schema: {problems}") from None
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
            raise RequestError(INVALID_ARG, f"SCHEMA is not a valid GLiNER2 schema: {exc}") from None
        (schema_dict,), (metadata,) = self.model._build_schema_dicts_and_metadata([schema])
        try:
            part = self.records.schema_part(schema_dict)
        except Exception as exc:  # gliner2 raises plain exceptions for schemas it cannot encode
            raise RequestError(INVALID_ARG, f"SCHEMA could not be encoded: {exc}") from None
        return part, metadata

    def check_text(self, text) -> None:
        if not isinstance(text, str):
            raise RequestError(INVALID_ARG, f"TEXT must be a str, got {type(text).__name__}")
        limit = self.max_request_tokens
        if len(text) > CHARS_PER_TOKEN_BOUND * limit:  # refuse before paying for tokenization
            raise RequestError(
                INVALID_ARG,
                f"TEXT has {len(text)} characters, far above the limit of "
                f"{limit} tokens (max_request_tokens); split it into chunks",
            )

    def prepare(self, index: int, request: Request, text_checked: bool = False) -> Prepared:
        """Validate and tokenize one request; raises RequestError. ``text_checked``: the
        caller ran ``check_text`` already (the engine does, before its adapter lookup)."""
        from manylora.post import core_threshold

        if not text_checked:
            self.check_text(request.text)
        part, metadata = self.parse_schema(request.schema)
        limit = self.max_request_tokens
        tokens = None
        try:
            record = self.records.record(request.text, part, limit, getattr(request, "max_len", 0))
        except TokenLimitExceeded as exc:
            tokens = exc.tokens  # raised below, outside this block: the error must not hold the
            # refused request's words and ids through its __context__'s traceback
        except Exception as exc:  # gliner2 raises plain exceptions for unencodable records
            raise RequestError(INVALID_ARG, f"text and schema could not be encoded: {exc}") from None
        if tokens is not None:
            raise RequestError(
                INVALID_ARG,
                f"text and schema are {tokens} tokens, above the limit of "
                f"{limit} (max_request_tokens); split the text into chunks",
            )
        t_min = core_threshold(request.threshold, metadata)  # the GPU stage takes T_MIN in [0, 1]
        return Prepared(index, request, record, metadata, len(record.input_ids), t_min=t_min)

    def core_record(self, input_ids, word_positions, schema_json: str):
        """(record, metadata) for the GPU stage, from what travels between the stages: token
        ids, each text word's first token position, and the SCHEMA text (parsed once, cached)."""
        from gliner2.processor import TransformedRecord

        part, metadata = self.parse_schema(schema_json)
        mapped: list = []
        if self.processor.token_pooling != "first":
            # mapped indices as RecordBuilder.record builds them: GLiNER2 pools by them unless
            # its token pooling is "first", which reads the word positions instead (measured:
            # building them was a third of the GPU stage's host time per row, H200 profile)
            mapped = list(part.mapped_indices)
            ends = list(word_positions[1:]) + [len(input_ids)]
            for k, (start, end) in enumerate(zip(word_positions, ends)):
                mapped.extend([("text", part.first_text_index + k, part.num_schemas)] * (end - start))
        record = TransformedRecord(
            input_ids=input_ids,
            mapped_indices=mapped,
            schema_tokens_list=part.schema_tokens_list,
            text_tokens=[],
            structure_labels=part.structure_labels,
            task_types=part.task_types,
            start_token_idx=[],
            end_token_idx=[],
            text="",
            schema=part.schema,
            text_word_first_positions=word_positions,
            schema_special_positions=part.schema_special_positions,
        )
        return record, metadata
