"""RecordBuilder builds, field for field, the record GLiNER2's transform_record builds."""

from __future__ import annotations

import dataclasses

import pytest

from manylora.demo import demo_schemas, demo_texts
from manylora.preprocess import RecordBuilder

TEXTS = demo_texts(30, seed=31) + [
    "x",
    "No end mark here",
    "Ends with a question?",
    "Ünïcödé wörds — and (brackets) | pipes, commas",
    "email me at a.b@example.com or see https://example.com/x?y=1 @handle",
    "İstanbul İİ",
    "\u200bzero\u200dwidth",
    "   spaced   out   ",
    "(",
    "[E] [SEP_TEXT] fake specials in text.",
    "",  # empty and whitespace-only texts are served: GLiNER2 makes them "." (and " ." ...)
    " ",
    "\n\t",
    "\u3000\u2003",
]


def _fields(record):
    return {f.name: getattr(record, f.name) for f in dataclasses.fields(record) if f.init}


def _own_processor(model):
    """A shallow copy of the model's processor for a RecordBuilder, which puts its bounded
    token cache (new words through the tokenizers backend) on the processor it is given: the
    reference's own processor keeps GLiNER2's tokenization for the tests after this one."""
    import copy

    return copy.copy(model.processor)


@pytest.mark.parametrize("schema_index", range(len(demo_schemas())))
def test_records_equal_gliner2(reference_model, schema_index):
    from gliner2.inference.schema import Schema

    processor = reference_model.processor
    builder = RecordBuilder(_own_processor(reference_model))
    schema = Schema.from_dict(demo_schemas()[schema_index]).build()
    part = builder.schema_part(schema)
    for text in TEXTS:
        expected = _fields(processor.transform_record(text, schema))
        got = _fields(builder.record(text, part))
        assert got == expected, text


def test_pad_batch_equals_gliner2(reference_model):
    """One batch mixing every demo schema (classification routes included) and all texts."""
    import torch
    from gliner2.inference.schema import Schema

    processor = reference_model.processor
    builder = RecordBuilder(_own_processor(reference_model))
    parts = [builder.schema_part(Schema.from_dict(d).build()) for d in demo_schemas()]
    records = [builder.record(text, parts[i % len(parts)]) for i, text in enumerate(TEXTS * 2)]
    import numpy as np

    # the GPU stage's records hold numpy views of the request's arrays instead of lists
    as_arrays = [
        dataclasses.replace(
            r,
            input_ids=np.asarray(r.input_ids, dtype=np.int64),
            text_word_first_positions=np.asarray(r.text_word_first_positions, dtype=np.int64),
        )
        for r in records
    ]
    for subset, arrays in ((records, as_arrays), (records[:1], as_arrays[:1]), (records[5:9], as_arrays[5:9])):
        expected = processor._pad_batch(list(subset))
        for got in (builder.pad_batch(subset), builder.pad_batch(arrays)):
            for field in dataclasses.fields(expected):
                want, have = getattr(expected, field.name), getattr(got, field.name)
                if isinstance(want, torch.Tensor):
                    assert have.dtype == want.dtype and torch.equal(have, want), field.name
                else:
                    assert have == want, field.name


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

ASCII_PIECE_LIST = [
    "word",
    "Word",
    "a-b",
    "a_b",
    "x--y",
    "-",
    "_",
    "http://a.b/c?d=e",
    "https://x.y",
    "www.site.org/p",
    "a.b@c.de",
    "me@x.io",
    "@hand_le",
    "@",
    ".",
    ",",
    "(",
    ")",
    "|",
    "'",
    '"',
    "3.14",
    "1,000",
    "\x1c",
    "\x1f",
    "\t",
    "\n",
    " ",
    "  ",
    "\x0b",
    "e.g.",
    "U.S.A.",
    "co-op_x",
    "$5",
    "100%",
    "a+b@c.com",
    "WWW.X.COM",
]
ASCII_PIECES = st.sampled_from(ASCII_PIECE_LIST)


@settings(max_examples=300, deadline=None)
@given(st.lists(ASCII_PIECES, max_size=40).map("".join) | st.text(st.characters(max_codepoint=127), max_size=80))
def test_ascii_fast_path_splits_like_gliner2(text):
    from gliner2.processing.word_splitter import WhitespaceTokenSplitter

    class Processor:  # only what RecordBuilder.words reads
        word_splitter = WhitespaceTokenSplitter()

    assert RecordBuilder(Processor()).words(text) == list(WhitespaceTokenSplitter()(text, lower=True))


@pytest.mark.parametrize(
    "text",
    [
        "Plain words, a-b_c compounds and 3.14 numbers.",  # no "@", no URL: the word alternatives only
        "See www.Site.org/x and HTTPS://a.b/c?d=e, then x--y.",  # URLs, no "@"
        "Mail a.b@c.de or @hand_le at http://x.io (me@x.io).",  # "@": the full pattern
        "An @ alone, and an e-mail-like a@b without a domain.",
    ],
)
def test_ascii_pattern_choice_splits_like_gliner2(text):
    """The fast path picks a pattern without the alternatives the text cannot match (no "@":
    no e-mail or handle; no "http"/"www.": no URL); each choice splits as GLiNER2 does."""
    from gliner2.processing.word_splitter import WhitespaceTokenSplitter

    class Processor:  # only what RecordBuilder.words reads
        word_splitter = WhitespaceTokenSplitter()

    assert RecordBuilder(Processor()).words(text) == list(WhitespaceTokenSplitter()(text, lower=True))


# characters where a stand-in could go wrong: case folds onto the pattern's ASCII letters
# (long s, Kelvin sign, dotted and dotless i), combining marks, joiners, non-ASCII spaces,
# digits and symbols, scripts without case, astral characters
TRICKY = "ſKİıßéÉ\u0301\u0308\u200c\u200d\u200b\u00a0\u2003\u3000—–“”’«»§°٣४日本語한😀\U0001d400"
UNICODE_PIECES = st.sampled_from([*ASCII_PIECE_LIST, *TRICKY, "httpſ://x.org", "josé@x.com", "@ſam"])


@settings(max_examples=300, deadline=None)
@given(
    st.lists(UNICODE_PIECES, max_size=40).map("".join)
    | st.text(st.characters(blacklist_categories=("Cs",)), max_size=60)
    | st.text(st.sampled_from(TRICKY + "ab1 .@-_/:htpsw"), max_size=60)
)
def test_non_ascii_fast_path_splits_like_gliner2(text):
    """Non-ASCII text through stand-in characters splits exactly as GLiNER2's splitter does."""
    from gliner2.processing.word_splitter import WhitespaceTokenSplitter

    class Processor:  # only what RecordBuilder.words reads
        word_splitter = WhitespaceTokenSplitter()

    assert RecordBuilder(Processor()).words(text) == list(WhitespaceTokenSplitter()(text, lower=True))


def test_stand_ins_cover_common_non_ascii_text():
    """Accented letters, typographic punctuation and other scripts take the fast path."""
    from gliner2.processing.word_splitter import WhitespaceTokenSplitter

    class Processor:
        word_splitter = WhitespaceTokenSplitter()

    builder = RecordBuilder(Processor())
    for text in ("Café déjà vu — “quoted” ’s", "İstanbul ſtraße K", "naïve co\u0301operate", "٣٤ 日本語 😀 x"):
        assert builder._proxy(text) is not None, text
        assert len(builder._proxy(text)) == len(text)


def test_stand_ins_across_unicode():
    """Every 97th code point (a sweep of all of them passed once, outside the suite): a stand-in exists, and
    probes that put the character in every part of the pattern split like GLiNER2."""
    import sys

    from gliner2.processing.word_splitter import WhitespaceTokenSplitter

    class Processor:
        word_splitter = WhitespaceTokenSplitter()

    builder, reference = RecordBuilder(Processor()), WhitespaceTokenSplitter()
    for cp in range(0x80, sys.maxunicode + 1, 97):
        if 0xD800 <= cp <= 0xDFFF:
            continue
        c = chr(cp)
        probe = f"a{c}b {c} {c}x@y.com ww{c}.q http{c}://z s{c} @{c}a x-{c}_y {c}{c}"
        assert builder._proxy(probe) is not None, hex(cp)
        assert builder.words(probe) == list(reference(probe, lower=True)), hex(cp)


def test_words_without_subwords_keep_their_slots(reference_model, monkeypatch):
    """A word the tokenizer maps to no pieces (GLiNER2 keeps a placeholder position for it)
    next to a two-piece word: the same record as GLiNER2's, not the one-piece shortcut's."""
    from gliner2.inference.schema import Schema

    processor = reference_model.processor
    tokenize = processor._tokenize_cached
    monkeypatch.setattr(processor, "_tokenize_cached", lambda word: [] if word == "\x00" else tokenize(word))
    builder = RecordBuilder(processor)
    schema = Schema.from_dict(demo_schemas()[0]).build()
    part = builder.schema_part(schema)
    for text in ("a \x00 b.", "\x00 xyzzyqqqkw.", "one \x00 two \x00\x00 three"):
        assert _fields(builder.record(text, part)) == _fields(processor.transform_record(text, schema)), repr(text)


def test_schema_with_a_huge_integer_is_invalid_arg_not_internal(tiny_engine):
    """json.loads raises a plain ValueError for integers over Python's 4,300-digit limit:
    the request is refused as bad input, not failed as INTERNAL."""
    import pytest

    from manylora.engine import Request, RequestError

    schema = '{"entities": ["person"], "x": ' + "9" * 5000 + "}"
    with pytest.raises(RequestError) as info:
        tiny_engine.prepare(0, Request("Tim Cook runs Apple.", schema))
    assert info.value.code == "INVALID_ARG" and "not valid JSON" in info.value.message


def test_a_fronts_skeleton_prepares_and_decodes_like_the_loaded_model(tiny_checkpoint, reference_model):
    """A CPU front loads GLiNER2 on the meta device (no weights): its records, decoding
    metadata and thresholds are those of the loaded model, and so is the architecture that
    PostDecoder.from_model reads (it refuses boundary checkpoints). The e2e tests run such fronts."""
    import copy
    import json

    from manylora.client.protocol import Request

    from manylora.engine import load_gliner2_skeleton
    from manylora.pre import Preprocessor

    skeleton = load_gliner2_skeleton(tiny_checkpoint)
    assert {p.device.type for p in skeleton.parameters()} == {"meta"}
    assert getattr(skeleton, "architecture", "span") == getattr(reference_model, "architecture", "span")
    reference = copy.copy(reference_model)
    reference.processor = _own_processor(reference_model)
    fronts = Preprocessor(skeleton, 512), Preprocessor(reference, 512)
    for k, text in enumerate(TEXTS):
        request = Request(text, json.dumps(demo_schemas()[k % len(demo_schemas())]), threshold=0.3 + 0.01 * k)
        got, expected = (front.prepare(k, request) for front in fronts)
        assert _fields(got.record) == _fields(expected.record), text
        assert (got.metadata, got.num_tokens, got.t_min) == (expected.metadata, expected.num_tokens, expected.t_min)


@settings(max_examples=300, deadline=None)
@given(word=st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=24))
def test_backend_word_pieces_equal_tokenize(reference_model, word):
    """The front's tokenization of a new word (the backend's ``encode``) against transformers'
    ``tokenize``, which GLiNER2 calls: any characters, spaces and GLiNER2's markers included."""
    from manylora.preprocess import word_tokenizer

    tokenizer = reference_model.processor.tokenizer
    pieces = word_tokenizer(tokenizer)
    assert pieces != tokenizer.tokenize  # the backend path is the one under test
    assert pieces(word) == tokenizer.tokenize(word)


def test_backend_word_pieces_defer_to_tokenize_when_truncating(reference_model):
    """With the backend's truncation set (tokenize turns it off for its call), the pieces are
    tokenize's: the whole word, not one piece."""
    from manylora.preprocess import word_tokenizer

    tokenizer = reference_model.processor.tokenizer
    pieces = word_tokenizer(tokenizer)
    whole = tokenizer.tokenize("ünïcödéwörds")
    assert len(whole) > 1
    tokenizer._tokenizer.enable_truncation(1)
    try:
        assert pieces("ünïcödéwörds") == whole
    finally:
        tokenizer._tokenizer.no_truncation()


def test_word_pieces_fall_back_to_tokenize_when_a_probe_differs():
    """A backend that splits some probe word otherwise is not used at all."""
    from types import SimpleNamespace

    from manylora.preprocess import word_tokenizer

    class Tokenizer:
        split_special_tokens = False

        def __init__(self):
            encode = lambda word, add_special_tokens: SimpleNamespace(tokens=list(word))  # noqa: E731
            self._tokenizer = SimpleNamespace(truncation=None, padding=None, encode_special_tokens=False, encode=encode)

        def tokenize(self, word):
            return list(word) if word != "東京" else ["東", "##京"]

    tokenizer = Tokenizer()
    assert word_tokenizer(tokenizer) == tokenizer.tokenize


def test_the_record_builder_tokenizes_new_words_through_the_backend(reference_model):
    from manylora.preprocess import RecordBuilder

    processor = _own_processor(reference_model)
    RecordBuilder(processor)
    assert processor._tokenize_cached.uncached != processor.tokenizer.tokenize
    assert processor._tokenize_cached.uncached("qzxv2026") == processor.tokenizer.tokenize("qzxv2026")
