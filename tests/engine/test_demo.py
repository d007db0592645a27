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


# -- the trained demo (make demo / make serve) --------------------------------------------
# Sentences made from the lexicon's templates by hand: not generated texts the training saw.
OKAFOR = (
    "Dr. Amara Okafor, the chief executive of Helios Robotics, said on Tuesday that the company "
    "would open a new office in Lisbon."
)
MOREAU = "On 12 March 2024, Lucas Moreau flew from Paris to Berlin to attend the climate summit."
NOWAK = "In 2015, Sofia Nowak founded Kestrel Ventures in a small garage in Nairobi."
VEGA = "Cobalt Motors has launched the Vega smartwatch, which goes on sale in Japan on 3 May 2026."
LOPEZ = "According to Wei Lopez, housing prices remains the biggest concern for voters in Spain."
SENTIMENT = {"classifications": [{"task": "sentiment", "labels": ["positive", "negative", "neutral"]}]}


@pytest.fixture(scope="module")
def trained(trained_checkpoint):
    from gliner2 import GLiNER2

    return GLiNER2.from_pretrained(str(trained_checkpoint)).eval()


@pytest.fixture(scope="module")
def with_adapter(trained_checkpoint, trained_adapters):
    """GLiNER2 + PEFT with one trained adapter: the reference the engine must match."""
    from gliner2 import GLiNER2
    from peft import PeftModel

    models = {}
    for name, folder in trained_adapters.items():
        model = GLiNER2.from_pretrained(str(trained_checkpoint))
        PeftModel.from_pretrained(model, str(folder))
        models[name] = model.eval()
    return models


def _extract(model, text, schema):
    from gliner2 import Schema

    return model.extract(text, Schema.from_dict(schema))


def test_trained_checkpoint_is_a_small_gliner2_checkpoint(trained_checkpoint, trained):
    from manylora.train_demo import Recipe

    for name in demo.CHECKPOINT_FILES:
        assert (trained_checkpoint / name).is_file(), name
    config = _read_json(trained_checkpoint / "config.json")
    assert (config["model_type"], config["max_width"], config["counting_layer"]) == ("extractor", 8, "count_lstm")
    assert _deberta_v3_options(_read_json(trained_checkpoint / "encoder_config" / "config.json"))
    manifest = _read_json(trained_checkpoint / demo.MANIFEST)
    assert manifest["training"]["recipe"]["steps"] == Recipe().steps and "calibration" not in manifest
    assert demo.is_demo_checkpoint(trained_checkpoint, "tiny", 0, Recipe())
    assert not demo.is_demo_checkpoint(trained_checkpoint, "tiny", 0)  # not the calibrated random one
    assert sum(p.stat().st_size for p in trained_checkpoint.rglob("*") if p.is_file()) < 5_000_000
    assert len(trained.processor.tokenizer) == trained.encoder.config.vocab_size


def test_trained_demo_finds_the_entities_of_held_out_sentences(trained):
    labels = ["person", "company", "location", "date"]
    assert _extract(trained, OKAFOR, {"entities": labels})["entities"] == {
        "person": ["Dr. Amara Okafor"],
        "company": ["Helios Robotics"],
        "location": ["Lisbon"],
        "date": ["Tuesday"],
    }
    found = _extract(trained, MOREAU, {"entities": labels})["entities"]
    assert found["person"] == ["Lucas Moreau"] and found["company"] == []
    assert sorted(found["location"]) == ["Berlin", "Paris"] and found["date"] == ["12 March 2024"]
    found = _extract(trained, VEGA, {"entities": {"company": "companies", "location": "places", "date": "dates"}})
    assert found["entities"] == {"company": ["Cobalt Motors"], "location": ["Japan"], "date": ["3 May 2026"]}
    assert _extract(trained, NOWAK, {"entities": labels})["entities"] == {
        "person": ["Sofia Nowak"],
        "company": ["Kestrel Ventures"],
        "location": ["Nairobi"],
        "date": ["2015"],
    }


def test_the_suite_trains_with_pinned_cpu_kernels():
    """conftest pins the vector kernels before torch runs an op (manylora.train_demo.pin_cpu_kernels):
    torch and MKL then compute with AVX2 on any x86 host that has it, AVX-512 ones included."""
    import os

    import torch

    from manylora.train_demo import PINNED_CPU_KERNELS, pin_cpu_kernels

    pinned = pin_cpu_kernels()
    if not pinned:
        pytest.skip("not an x86 host with AVX2")
    if pinned != PINNED_CPU_KERNELS:
        pytest.skip(f"the environment pins other kernels: {pinned}")
    assert os.environ["MKL_CBWR"] == "AVX2" and torch.backends.cpu.get_cpu_capability() == "AVX2"


def test_trained_demo_scores_well_on_generated_held_out_texts(trained, model):
    """Held-out generated texts (another seed than training's): the lexicon's names, then made-up
    names only (what the model can only find from the context); the calibrated random checkpoint
    (``model``) fails the same bar."""
    from manylora.train_demo import entity_scores, task_scores

    labels = ["person", "organization", "company", "location", "date", "money"]
    scores = entity_scores(trained, labels)
    for label in ("person", "organization", "company", "location", "date"):
        assert min(scores[label].values()) >= 0.85, (label, scores)
    assert scores["money"]["precision"] >= 0.8 and scores["money"]["recall"] >= 0.5, scores
    novel = entity_scores(trained, labels, novel=1.0)
    for label in ("location", "date"):
        assert min(novel[label].values()) >= 0.85, (label, novel)
    assert min(novel["person"].values()) >= 0.6, novel
    assert novel["company"]["precision"] >= 0.8 and novel["company"]["recall"] >= 0.5, novel
    tasks = task_scores(trained)
    assert tasks["sentiment_accuracy"] >= 0.85, tasks
    assert tasks["relation_recall"] >= 0.25, tasks

    untrained = entity_scores(model, labels)
    assert all(untrained[label]["precision"] < 0.5 for label in ("person", "company", "location")), untrained


def test_trained_demo_extracts_relations_and_classifies(trained):
    relations = _extract(trained, OKAFOR, {"relations": ["works_for", "located_in"]})["relation_extraction"]
    assert ("Dr. Amara Okafor", "Helios Robotics") in relations["works_for"]
    assert ("Helios Robotics", "Lisbon") in relations["located_in"]
    relations = _extract(trained, NOWAK, {"relations": ["located_in"]})["relation_extraction"]
    assert relations["located_in"] == [("Kestrel Ventures", "Nairobi")]
    for text, label in (
        ("Shares of Crescent Bank fell 4.2% in early trading in Tokyo after the merger was delayed.", "negative"),
        (
            "Helios Robotics reported revenue of $12 million for the third quarter, up 8% from a year earlier.",
            "positive",
        ),
        ("A spokesperson for Orion Logistics declined to comment on the report.", "neutral"),
    ):
        assert _extract(trained, text, SENTIMENT)["sentiment"] == label, text


def test_each_trained_adapter_changes_the_answer_as_trained(trained, with_adapter):
    from manylora.train_demo import entity_scores

    products = {"entities": ["company", "date", "product", "event"]}
    base, adapted = (_extract(m, VEGA, products)["entities"] for m in (trained, with_adapter["products-events"]))
    assert "the Vega smartwatch" not in base["product"] and "the Vega smartwatch" in adapted["product"]
    assert adapted["company"] == base["company"] == ["Cobalt Motors"]
    base, adapted = (_extract(m, MOREAU, products)["entities"] for m in (trained, with_adapter["products-events"]))
    assert "the climate summit" not in base["event"] and "the climate summit" in adapted["event"]

    issues = {"entities": ["person", "location", "issue"]}
    base, adapted = (_extract(m, LOPEZ, issues)["entities"] for m in (trained, with_adapter["issues"]))
    assert base == {"person": ["Wei Lopez"], "location": ["Spain"], "issue": []}
    assert "housing prices" in adapted["issue"] and adapted["location"] == ["Spain"]

    for name, labels, focus in (
        ("products-events", ["product", "event"], "product|event"),
        ("issues", ["issue"], "topic"),
    ):
        before = entity_scores(trained, labels, focus=focus)
        after = entity_scores(with_adapter[name], labels, focus=focus)
        for label in labels:
            assert before[label]["recall"] <= 0.2 and min(after[label].values()) >= 0.75, (name, before, after)


def test_the_engine_answers_what_gliner2_and_peft_answer_with_the_trained_adapters(
    trained_checkpoint, trained_adapters, trained, with_adapter
):
    from gliner2 import Schema

    from manylora.compare import result_differences
    from manylora.config import EngineConfig
    from manylora.engine import Engine, Request

    root = next(iter(trained_adapters.values())).parent
    engine = Engine(EngineConfig.from_parameters({"checkpoint": str(trained_checkpoint), "adapter_dir": str(root)}))
    schemas = [
        {"entities": ["person", "company", "location", "date", "product", "event", "issue"]},
        {"relations": ["works_for", "located_in", "founded"], **SENTIMENT},
    ]
    texts = [OKAFOR, MOREAU, NOWAK, VEGA, LOPEZ]
    requests = [
        Request(text, json.dumps(schema), adapter=adapter, include_confidence=True)
        for adapter in ["", *trained_adapters]
        for text in texts
        for schema in schemas
    ]
    got = engine.run(requests)
    failures, changed = [], set()
    for request, answer in zip(requests, got):
        model = with_adapter[request.adapter] if request.adapter else trained
        (expected,) = model.batch_extract([request.text], Schema.from_json(request.schema), include_confidence=True)
        diffs = result_differences(answer, expected, atol=1e-4)
        if diffs:
            failures.append(f"adapter={request.adapter or 'base'} text={request.text[:40]!r}: {diffs[:2]}")
        if request.adapter:
            (base,) = trained.batch_extract([request.text], Schema.from_json(request.schema), include_confidence=True)
            if result_differences(answer, base, atol=1e-4):
                changed.add(request.adapter)
    assert not failures, "\n".join(failures[:10])
    assert changed == set(trained_adapters)


def test_trained_builds_are_deterministic(tmp_path):
    """Two short trainings (same recipe, same seed) give the same bytes; so do two adapter fine-tunes."""
    from manylora.lora.demo_adapters import build_trained_adapters
    from manylora.train_demo import AdapterRecipe, Recipe

    recipe, adapter_recipe = Recipe(steps=4), AdapterRecipe(steps=3)
    first, second = (demo.build_demo_checkpoint(tmp_path / name, train=recipe) for name in ("a", "b"))
    for name in demo.CHECKPOINT_FILES:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    assert (first / "model.safetensors").read_bytes() != (
        demo.build_demo_checkpoint(tmp_path / "c", train=Recipe(steps=5)) / "model.safetensors"
    ).read_bytes()
    adapters = [
        build_trained_adapters(first, tmp_path / f"adapters-{i}", recipe=adapter_recipe, workers=1) for i in (1, 2)
    ]
    for name in adapters[0]:
        one, two = (a[name] / "adapter_model.safetensors" for a in adapters)
        assert one.read_bytes() == two.read_bytes(), name
        config = _read_json(adapters[0][name] / "adapter_config.json")  # PEFT's set, saved in a fixed order
        assert config["target_modules"] == sorted(config["target_modules"]) and len(config["target_modules"]) > 2
    index = _read_json(tmp_path / "adapters-1" / "demo_adapters.json")
    stamp = (adapters[0]["issues"] / "adapter_model.safetensors").stat().st_mtime_ns
    build_trained_adapters(first, tmp_path / "adapters-1", recipe=adapter_recipe)  # current: kept as it is
    assert (adapters[0]["issues"] / "adapter_model.safetensors").stat().st_mtime_ns == stamp
    assert index["issues"]["entities"] == ["issue"] and index["issues"]["recipe"]["steps"] == 3


def test_trained_build_replaces_only_an_outdated_demo_checkpoint(tiny_checkpoint, tmp_path, capsys):
    import shutil

    from manylora.train_demo import Recipe

    target = tmp_path / "demo-tiny"
    shutil.copytree(tiny_checkpoint, target)  # an earlier build: calibrated random weights
    with pytest.raises(FileExistsError):
        demo.build_demo_checkpoint(target, train=Recipe(steps=2))
    demo.main(["--size", "tiny", "--train", "--steps", "2", "--replace-outdated", "--out", str(target)])
    assert capsys.readouterr().out.strip() == str(target.resolve())
    assert _read_json(target / demo.MANIFEST)["training"]["recipe"]["steps"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo-tiny"]  # no temp dirs left behind

    other = tmp_path / "not-a-demo"
    other.mkdir()
    (other / "config.json").write_text("{}")
    with pytest.raises(FileExistsError):
        demo.build_demo_checkpoint(other, train=Recipe(steps=2), replace_outdated=True)
    with pytest.raises(SystemExit):
        demo.main(["--size", "tiny", "--steps", "2", "--out", str(tmp_path / "x")])  # --steps needs --train
