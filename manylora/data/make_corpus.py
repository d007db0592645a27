"""Regenerate corpus.txt, the text the demo tokenizer is trained on.

    .venv/bin/python manylora/data/make_corpus.py

corpus.txt is committed and read at every checkpoint build, so editing the text
generator in manylora.demo changes demo texts but never silently changes the tokenizer;
rerun this script (and expect new checkpoint bytes) only on purpose.
Output: 380 news-like texts from manylora.demo's generator (a seed no test uses), then
one line per demo schema with its labels, descriptions and field names.
"""

from pathlib import Path

from manylora.demo import CAL_SCHEMA, demo_schemas, demo_texts

CORPUS = Path(__file__).resolve().parent / "corpus.txt"


def _strings(value):
    if isinstance(value, str):
        yield value.replace("_", " ")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(key)
            yield from _strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)


def main() -> None:
    lines = demo_texts(380, seed=777, min_words=40, max_words=160)
    lines += [" ".join(_strings(schema)) for schema in [*demo_schemas(), CAL_SCHEMA]]
    CORPUS.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {CORPUS} ({CORPUS.stat().st_size} bytes, {len(lines)} lines)")


if __name__ == "__main__":
    main()
