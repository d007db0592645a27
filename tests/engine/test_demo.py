"""The demo checkpoint builder, demo texts and demo schemas (manylora.demo)."""

from __future__ import annotations

import json
import statistics

import pytest

from manylora import demo

ENTITY_SCHEMAS = [s for s in demo.demo_schemas() if set(s) == {"entities"}]


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    from gliner2 import GLiNER2

    return GLiNER2.from_pretrained(str(tiny_checkpoint)).eval()


@pytest.fixture(scope="module")
def texts():
    return demo.demo_texts(12, seed=99, min_words=75, max_words=95)  # ~85 words each


def _read_json(path):
    return json.loads(path.read_text(encoding="utf-8"))


# -- layout -------------------------------------------------------------------------------


def test_layout_matches_gliner2_base_v1(tiny_checkpoint):
    for name in demo.CHECKPOINT_FILES:
        assert (tiny_checkpoint / name).is_file(), name
    config = _read_json(tiny_checkpoint / "config.json")
    assert config["model_type"] == "extractor"
    assert config["architecture"] == "span"
    assert config["max_width"] == 8
    assert config["counting_layer"] == "count_lstm"
    assert config["token_pooling"] == "first"

    encoder = _read_json(tiny_checkpoint / "encoder_config" / "config.json")
    geometry = demo.SIZES["tiny"]
    assert encoder["model_type"] == "deberta-v2"
    assert (
        encoder["hidden_size"],
        encoder["num_hidden_layers"],
        encoder["num_attention_heads"],
        encoder["intermediate_size"],
    ) == (geometry.hidden_size, geometry.num_hidden_layers, geometry.num_attention_heads, geometry.intermediate_size)
    assert _deberta_v3_options(encoder)
    manifest = _read_json(tiny_checkpoint / demo.MANIFEST)
    # the encoder vocabulary counts GLiNER2's 10 special tokens on top of the trained pieces
    assert encoder["vocab_size"] == manifest["tokenizer_vocab"] + 10 == demo.TOKENIZER_VOCAB + 10


def _deberta_v3_options(encoder: dict) -> bool:
    expected = {
        "relative_attention": True,
        "position_buckets": 256,
        "max_relative_positions": -1,
        "pos_att_type": ["p2c", "c2p"],
        "share_att_key": True,
        "norm_rel_ebd": "layer_norm",
        "position_biased_input": False,
        "max_position_embeddings": 512,
        "type_vocab_size": 0,
    }
    return all(encoder[key] == value for key, value in expected.items())


def test_base_geometry_is_deberta_v3_base():
    encoder = demo._encoder_config(demo.SIZES["base"], vocab_size=demo.TOKENIZER_VOCAB + 10).to_dict()
    assert (
        encoder["hidden_size"],
        encoder["num_hidden_layers"],
        encoder["num_attention_heads"],
        encoder["intermediate_size"],
    ) == (768, 12, 12, 3072)
    assert _deberta_v3_options(encoder)


def test_state_dict_has_every_gliner2_module(tiny_checkpoint):
    from safetensors import safe_open

    with safe_open(str(tiny_checkpoint / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    for prefix in (
        "encoder.encoder.layer.1.attention.self.query_proj",
        "encoder.encoder.rel_embeddings",
        "span_rep.span_rep_layer.out_project.3",
        "classifier.2",
        "count_pred.2",
        "count_embed.gru.weight_ih_l0",
        "count_embed.projector.2",
    ):
        assert any(key.startswith(prefix) for key in keys), prefix


# -- loading and tokenizer ----------------------------------------------------------------


def test_loads_offline(tiny_checkpoint, monkeypatch):
    from gliner2 import GLiNER2

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    loaded = GLiNER2.from_pretrained(str(tiny_checkpoint))
    tokenizer = loaded.processor.tokenizer
    assert len(tokenizer) == loaded.encoder.config.vocab_size
    assert all(tokenizer.convert_tokens_to_ids(t) >= demo.TOKENIZER_VOCAB for t in loaded.processor.SPECIAL_TOKENS)


def test_tokenizer_reloads_identically(tiny_checkpoint, texts):
    from gliner2.models.base import load_extractor_tokenizer
    from transformers import DebertaV2Tokenizer

    fresh = demo._train_tokenizer()
    reloaded = load_extractor_tokenizer(str(tiny_checkpoint))
    assert isinstance(reloaded, DebertaV2Tokenizer)
    assert reloaded.convert_tokens_to_ids(["[PAD]", "[CLS]", "[SEP]", "[UNK]"]) == [0, 1, 2, 3]
    assert {k: v for k, v in reloaded.get_vocab().items() if v < len(fresh)} == fresh.get_vocab()
    words = " ".join(texts).split() + ["Zürich", "naïve", "東京", "e-mail", "  spaced  out ", ""]
    for word in words + [w.lower() for w in words]:  # GLiNER2 tokenizes each word on its own
        assert reloaded.tokenize(word) == fresh.tokenize(word), word
    assert reloaded(texts[0])["input_ids"] == fresh(texts[0])["input_ids"]


# -- calibration --------------------------------------------------------------------------


@pytest.mark.parametrize("schema", ENTITY_SCHEMAS, ids=lambda s: ",".join(s["entities"]))
def test_entity_spans_are_calibrated(model, texts, schema):
    from gliner2 import Schema

    results = model.batch_extract(
        texts, Schema.from_dict(schema), batch_size=8, include_confidence=True, include_spans=True
    )
    per_label, confidences = [], []
    for text, result in zip(texts, results):
        text = text if text.endswith((".", "!", "?")) else text + "."  # GLiNER2 adds the end mark
        assert list(result["entities"]) == list(schema["entities"])
        for value in result["entities"].values():
            spans = value if isinstance(value, list) else [value] if value else []
            per_label.append(len(spans))
            for span in spans:
                assert text[span["start"] : span["end"]] == span["text"]
                assert 0.39 <= span["confidence"] <= 1.0
                confidences.append(span["confidence"])
    assert 0.5 <= statistics.mean(per_label) <= 6.0
    # scores vary instead of saturating, so score comparisons in fidelity tests mean something
    assert sum(c > 0.999 for c in confidences) < 0.2 * len(confidences)
    assert statistics.pstdev(confidences) > 0.05
    assert len({round(c, 6) for c in confidences}) > 0.9 * len(confidences)


def test_classification_returns_labels(model, texts):
    from gliner2 import Schema

    single, multi = (
        {"classifications": [c]}
        for c in (
            {"task": "sentiment", "labels": ["positive", "negative", "neutral"]},
            {
                "task": "topic",
                "labels": ["business", "politics", "sports", "science"],
                "multi_label": True,
                "cls_threshold": 0.5,
            },
        )
    )
    chosen = set()
    for result in model.batch_extract(texts, Schema.from_dict(single), include_confidence=True):
        assert result["sentiment"]["label"] in single["classifications"][0]["labels"]
        chosen.add(result["sentiment"]["label"])
    assert len(chosen) >= 2
    sizes = []
    for result in model.batch_extract(texts, Schema.from_dict(multi), include_confidence=True):
        assert result["topic"] and all(
            item["label"] in multi["classifications"][0]["labels"] for item in result["topic"]
        )
        sizes.append(len(result["topic"]))
    assert 1.0 <= statistics.mean(sizes) < 4.0


def test_every_demo_schema_extracts_well_formed(model, texts):
    from gliner2 import Schema

    for schema in demo.demo_schemas():
        results = model.batch_extract(texts[:4], Schema.from_dict(schema), batch_size=4)
        for result in results:
            for label in schema.get("entities", {}):
                assert label in result["entities"]
            for task in schema.get("classifications", []):
                assert task["task"] in result
            for relation in schema.get("relations", {}):
                assert isinstance(result["relation_extraction"][relation], list)
            for name, structure in schema.get("structures", {}).items():
                instances = result[name]
                assert isinstance(instances, list) and len(instances) <= 6  # counts are calibrated to 2-3
                fields = [f["name"] for f in structure["fields"]]
                assert all(list(instance) == fields for instance in instances)


# -- determinism and idempotence ----------------------------------------------------------


def test_two_builds_are_byte_identical(tiny_checkpoint, tmp_path):
    again = demo.build_demo_checkpoint(tmp_path / "again", size="tiny")
    for name in demo.CHECKPOINT_FILES:
        assert (again / name).read_bytes() == (tiny_checkpoint / name).read_bytes(), name


def test_build_is_idempotent_and_force_replaces(tiny_checkpoint, tmp_path, capsys):
    stamp = (tiny_checkpoint / "model.safetensors").stat().st_mtime_ns
    assert demo.build_demo_checkpoint(tiny_checkpoint, size="tiny") == tiny_checkpoint
    demo.main(["--size", "tiny", "--out", str(tiny_checkpoint)])  # the CLI says where it is
    assert capsys.readouterr().out.strip() == str(tiny_checkpoint.resolve())
    assert (tiny_checkpoint / "model.safetensors").stat().st_mtime_ns == stamp
    with pytest.raises(FileExistsError):
        demo.build_demo_checkpoint(tiny_checkpoint, size="tiny", seed=1)
    with pytest.raises(ValueError):
        demo.build_demo_checkpoint(tmp_path / "x", size="huge")

    target = tmp_path / "replaced"
    target.mkdir()
    (target / "junk.txt").write_text("not a checkpoint")
    with pytest.raises(FileExistsError):
        demo.build_demo_checkpoint(target)
    demo.build_demo_checkpoint(target, size="tiny", seed=1, force=True)
    assert _read_json(target / demo.MANIFEST)["seed"] == 1
    assert not (target / "junk.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["replaced"]  # no temp dirs left behind
    assert (target / "model.safetensors").read_bytes() != (tiny_checkpoint / "model.safetensors").read_bytes()


# -- demo texts and schemas ---------------------------------------------------------------


def test_demo_texts_are_deterministic_and_varied():
    texts = demo.demo_texts(200, seed=3)
    assert texts == demo.demo_texts(200, seed=3)
    assert texts != demo.demo_texts(200, seed=4)
    assert len(set(texts)) == 200
    assert all(60 <= len(t.split()) <= 120 for t in texts)
    assert 0.05 < sum(not t.endswith((".", "!", "?")) for t in texts) / len(texts) < 0.6
    sentences = [s for t in texts for s in t.split(". ")]
    assert any(s.isupper() for s in sentences) and any(s.islower() for s in sentences)
    joined = " ".join(texts)
    for mark in (",", '"', "(", "%", "$", "@", "?"):
        assert mark in joined, mark
    assert all(5 <= len(t.split()) <= 8 for t in demo.demo_texts(20, min_words=5, max_words=8))
    with pytest.raises(ValueError):
        demo.demo_texts(1, min_words=10, max_words=5)


def test_demo_schemas_cover_the_schema_vocabulary():
    from gliner2 import Schema

    schemas = demo.demo_schemas()
    for schema in schemas:
        Schema.from_dict(schema).build()
    entities = [s["entities"] for s in schemas if "entities" in s]
    assert any(isinstance(e, list) for e in entities)
    assert any(isinstance(e, dict) and any(isinstance(v, str) for v in e.values()) for e in entities)
    assert any(isinstance(e, dict) and any(isinstance(v, dict) for v in e.values()) for e in entities)
    tasks = [c for s in schemas for c in s.get("classifications", [])]
    assert any(not c.get("multi_label") for c in tasks)
    assert any(c.get("multi_label") and "cls_threshold" in c for c in tasks)
    assert any(isinstance(c["labels"], dict) for c in tasks)
    relations = [s["relations"] for s in schemas if "relations" in s]
    assert any(isinstance(r, list) for r in relations) and any(isinstance(r, dict) for r in relations)
    fields = [f for s in schemas for st in s.get("structures", {}).values() for f in st["fields"]]
    assert any("choices" in f for f in fields)
    assert {f.get("dtype") for f in fields} >= {"str", "list"}
    assert any(len(s) >= 3 for s in schemas)  # a combination of sections
