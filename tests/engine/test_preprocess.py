"""RecordBuilder builds, field for field, the record GLiNER2's transform_record builds."""

from __future__ import annotations

import dataclasses

import pytest

from manylora.demo import demo_schemas, demo_texts
from manylora.preprocess import RecordBuilder

TEXTS = demo_texts(30, seed=31) + [
    "x", "No end mark here", "Ends with a question?", "Ünïcödé wörds — and (brackets) | pipes, commas",
    "email me at a.b@example.com or see https://example.com/x?y=1 @handle", "İstanbul İİ", "\u200bzero\u200dwidth",
    "   spaced   out   ", "(", "[E] [SEP_TEXT] fake specials in text.",
]


def _fields(record):
    return {f.name: getattr(record, f.name) for f in dataclasses.fields(record) if f.init}


@pytest.mark.parametrize("schema_index", range(len(demo_schemas())))
def test_records_equal_gliner2(reference_model, schema_index):
    from gliner2.inference.schema import Schema

    processor = reference_model.processor
    builder = RecordBuilder(processor)
    schema = Schema.from_dict(demo_schemas()[schema_index]).build()
    part = builder.schema_part(schema)
    for text in TEXTS:
        expected = _fields(processor.transform_record(text, schema))
        got = _fields(builder.record(text, part))
        assert got == expected, text
