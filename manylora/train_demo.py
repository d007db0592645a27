"""Train the tiny demo checkpoint and its demo adapters on labelled text made from the lexicon.

    python -m manylora.demo --size tiny --train --out models/demo-tiny      # calls train_base
    python -m manylora.lora.demo_adapters --checkpoint models/demo-tiny --out models/demo-tiny-adapters

Data. The demo texts (manylora.demo) are filled from data/lexicon.json's templates; this
module fills the same templates, plus data/demo_tasks.json's training-only templates (other
sentence shapes: "{person} runs {org} from {city}, {country}."), and remembers which slot
produced which characters, so every generated text comes with its answers:

- entities: slot values under GLiNER2 labels (``ENTITY_LABELS``): person, company or
  organization, location, date ("{month} {year}" is one date), money, percentage, job
  title; for the adapters product, event and issue (the lexicon's policy topics);
- relations: data/demo_tasks.json gives each template's relations as slot pairs; the base
  model learns works_for, located_in, founded and acquired;
- sentiment: the same file labels each template positive, negative or neutral; every
  sentence of a text carries the text's sentiment (a sparse cue never got learned in the
  time budget).

Half of the people, organisations and places (``Recipe.novel_names``) are made-up names
(random syllables, with "New "/"San " prefixes or company suffixes), so the model learns the
contexts, not only the lexicon's names: GLiNER2 lower-cases every word, so context is the
only cue for a name it has not seen. Each record asks for the labels present
in the text (85% each) and up to three absent ones, sometimes with label descriptions; for
the relations of the text and sometimes one it does not hold (GLiNER2 has no count 0 in
training: that relation gets one instance without gold spans); for its sentiment (90%).

Training uses GLiNER2's own training path: records in GLiNER2's training format
(``InputExample.to_dict``), batched by ``SchemaTransformer.collate_fn_train`` (GLiNER2's
label and task shuffling and label dropping; its synthetic "entity 1"/"label 1" renaming off)
and scored by the model's ``forward``: span BCE with negative masking, count cross-entropy
and classification BCE (the last weighted by ``Recipe.cls_weight``). Fresh examples every
step, batches grouped by length, AdamW with linear warm-up and decay, gradient clipping,
dropout off. ``_binding_init`` starts the encoder where schema markers already read their
label word; without it a 2-layer model from DeBERTa's init learns labels slowly and its
classifier collapses to the label prior.

Cost and quality (tiny, one core, ``Recipe()``): about 115 CPU seconds. On 40 held-out texts
(seed 10000): person, company, location and date precision and recall 0.94-1.0, money
1.0/0.69; with made-up names only (``novel=1.0``) location and date 0.93-0.98, person
0.73/0.73, company 0.92/0.63; sentiment accuracy 1.0; relations recall 0.35, precision 0.23
(it also pairs people and companies the templates do not call related).

Determinism: one thread, ``torch.use_deterministic_algorithms``, torch and ``random``
(GLiNER2's processor shuffles with it) seeded, and restored afterwards. Two builds on one
machine give byte-identical files; another library version may differ, and so may another CPU
unless the vector kernels are pinned (``pin_cpu_kernels``, which the CLIs and the test suite
call): on an AVX-512 host (session 17) the unpinned build missed the quality bars above
(person recall 0.78, the products-events adapter's precision 0.52) that AVX2 builds pass.

Adapters (``ADAPTER_TASKS``) are LoRA fine-tunes with PEFT of the trained checkpoint (rank 16,
every encoder and head linear layer, 300 steps, about 35 CPU seconds each) on labels the
base model never learned: ``products-events`` (product, event) and ``issues`` (issue). The
base labels, relations and sentiment come along now and then, so they are kept. On 40
held-out texts: product, event and issue precision and recall 0.9-1.0.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import re
import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

from manylora.demo import DATA_DIR, _lexicon, _SentenceFiller

# The x86 vector kernels the demo trains with, so that hosts with and without AVX-512 build the
# same model: torch's own kernels (ATEN_CPU_CAPABILITY) and MKL's (MKL_CBWR, MKL's conditional
# numerical reproducibility), each read once, before the first op that uses them.
PINNED_CPU_KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2"}


def pin_cpu_kernels() -> dict[str, str]:
    """Pin PINNED_CPU_KERNELS in this process's environment (unless already set) on an x86 CPU
    with AVX2, and return what is in force; {} elsewhere. Call it before torch runs any op: the
    demo CLIs (``python -m manylora.demo``, ``manylora.lora.demo_adapters``) and the test suite's
    conftest do. Training results otherwise follow the CPU (see the module docstring)."""
    import os
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return {}
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    if " avx2" not in flags:
        return {}
    for key, value in PINNED_CPU_KERNELS.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in PINNED_CPU_KERNELS}


TASKS_FILE = DATA_DIR / "demo_tasks.json"

# template slot -> entity kind
SLOT_KINDS = {
    "person": "person",
    "first": "person",
    "org": "organization",
    "city": "city",
    "country": "country",
    "region": "region",
    "street": "street",
    "date": "date",
    "month": "date",
    "weekday": "date",
    "year": "date",
    "money": "money",
    "pct": "percentage",
    "role": "job title",
    "email": "email",
    "phone": "phone",
    "time": "time",
    "product": "product",
    "event": "event",
    "topic": "issue",
}

# GLiNER2 entity label -> the kinds it covers, and a description sometimes given with it
ENTITY_LABELS = {
    "person": ({"person"}, "names of people"),
    "company": ({"organization"}, "companies, institutions and public bodies"),
    "organization": ({"organization"}, "companies, institutions and public bodies"),
    "location": ({"city", "country", "region", "street"}, "cities, countries, regions and streets"),
    "date": ({"date"}, "dates, days, months and years"),
    "money": ({"money"}, "amounts of money"),
    "percentage": ({"percentage"}, "percentages"),
    "job title": ({"job title"}, "roles and job titles"),
    "product": ({"product"}, "products, devices and services"),
    "event": ({"event"}, "named events, meetings and competitions"),
    "issue": ({"issue"}, "policy issues and subjects of public concern"),
}
# labels that mean the same here: an example asks for at most one of each group
SYNONYMS = (("company", "organization"),)

CLS_PRIOR_LOGIT = -0.9  # classification logits start at the label prior (about 1 label in 3 is true)
# share of texts asked for their topics: off, the tiny model learns sentiment in its budget, not both
TOPIC_SHARE = 0.0
SENTIMENTS = ["positive", "negative", "neutral"]
TOPICS = ["business", "politics", "sports", "science", "health", "culture"]


@dataclass(frozen=True)
class Task:
    """What one model or adapter is trained to answer."""

    name: str
    entities: tuple  # entity labels it learns
    relations: tuple = ()
    classifications: bool = False  # sentiment and topic
    focus: str = ""  # "relations", or slots ("product|event"): texts that start with such a template...
    focus_share: float = 0.5  # ...make up this share
    keep: tuple = ()  # labels the model already knows, asked alongside (so they are not forgotten)
    relation_share: float = 0.8  # share of texts with relations that are asked for them
    cls_share: float = 0.6  # share of texts asked for their sentiment (with classifications)


BASE_TASK = Task(
    "base",
    entities=("person", "company", "organization", "location", "date", "money", "percentage", "job title"),
    relations=("works_for", "located_in", "founded", "acquired"),
    classifications=True,
    cls_share=0.9,  # sentiment is learned last: at 0.6 it was still half learned after 800 steps in 1 of 4 runs
    focus="relations",
    focus_share=0.35,
)
# Adapters learn new labels; the base model's relations, sentiment and a few labels come along
# now and then, so that they are not forgotten.
_KEEP = {
    "keep": ("person", "company", "location", "date"),
    "relations": BASE_TASK.relations,
    "relation_share": 0.3,
    "classifications": True,
    "cls_share": 0.3,
}
ADAPTER_TASKS = {
    "products-events": Task("products-events", entities=("product", "event"), focus="product|event", **_KEEP),
    "issues": Task("issues", entities=("issue",), focus="topic", **_KEEP),
}


@dataclass(frozen=True)
class Recipe:
    """How the base demo model is trained (recorded in the checkpoint's manifest).

    Measured (tiny, seed 0, one core): about 115 CPU seconds; on 40 held-out texts person,
    company, location and date precision and recall 0.94-1.0, sentiment accuracy 1.0.
    """

    steps: int = 800
    batch_size: int = 8  # small batches, more updates: the same compute learns more in 800 steps than in 400 x 16
    lr: float = 5e-3  # encoder
    head_lr: float = 1e-3  # span, classification and count heads: faster, and they collapse to priors
    warmup: float = 0.05
    weight_decay: float = 0.01
    max_sentences: int = 2  # per text
    cls_weight: float = 5.0  # classification has one loss term per label, spans one per span and label
    binding: bool = True  # _binding_init before training
    novel_names: float = 0.5  # share of made-up names of people, organisations and places


@dataclass(frozen=True)
class AdapterRecipe:
    """How a demo adapter is trained: a LoRA fine-tune of every encoder and head linear layer."""

    rank: int = 16
    alpha: float = 32.0
    targets: tuple = ("encoder", "all_task_heads")
    steps: int = 300  # at rank 8 / 200 steps product and event were still confused on some base checkpoints
    batch_size: int = 8
    lr: float = 1e-2
    warmup: float = 0.05
    weight_decay: float = 0.0
    max_sentences: int = 2
    cls_weight: float = 1.0
    novel_names: float = 0.3


@lru_cache(maxsize=1)
def _annotations() -> dict[str, dict[str, Any]]:
    """Every training template's labels: the lexicon's templates, then the training-only ones."""
    with open(TASKS_FILE, encoding="utf-8") as f:
        tasks = json.load(f)
    return {**tasks["templates"], **tasks.get("training_templates", {})}


@lru_cache(maxsize=1)
def _templates() -> tuple[str, ...]:
    """The templates texts are made from: lexicon.json's (the demo texts') and demo_tasks.json's
    training-only ones (other sentence shapes, so the model learns more than the demo texts' phrasing)."""
    extra = [t for t in _annotations() if t not in _lexicon()["templates"]]
    return tuple(_lexicon()["templates"]) + tuple(extra)


def data_fingerprint() -> str:
    """sha256 of what the training data and loop are made from: the lexicon, the task labels and this module."""
    digest = hashlib.sha256()
    for path in (DATA_DIR / "lexicon.json", TASKS_FILE, Path(__file__)):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


# ---------------------------------------------------------------------------
# Labelled texts
# ---------------------------------------------------------------------------


@dataclass
class Sentence:
    text: str
    slots: list  # (slot name, start, end)
    template: str


@dataclass
class Example:
    """One generated text and everything it says, in lexicon terms."""

    text: str
    mentions: list = field(default_factory=list)  # (kind, surface text)
    relations: list = field(default_factory=list)  # (relation, head text, tail text)
    sentiment: str = "neutral"
    topics: list = field(default_factory=list)

    def spans(self, *kinds: str) -> list[str]:
        """Surface texts of ``kinds`` in order of appearance, without repeats."""
        seen = []
        for kind, text in self.mentions:
            if kind in kinds and text not in seen:
                seen.append(text)
        return seen


_ONSETS = "b c d f g h j k l m n p r s t v w y z br ch cl dr fr gr kr pl sh st tr th".split()
_VOWELS = "a e i o u a e i o ai ea ee ie oo ou".split()
_CODAS = ["", "", "", "n", "r", "l", "s", "m", "k", "t", "ck", "ng", "rd", "nt", "x"]
_ORG_SUFFIXES = (
    "", "", "", "", "", "", " Group", " Systems", " Labs", " Inc.", " Holdings", " Bank", " Motors", " Partners", " Media",
    " Energy", " Foods", " Airlines", " Technologies", " & Co.", " Ltd", " Pharma", " Capital",
)  # fmt: skip
_PLACE_PREFIXES = ("", "", "", "", "New ", "San ", "Los ", "Port ", "St. ", "North ", "Lake ")


class _LabelledFiller(_SentenceFiller):
    """Fills templates and records each slot's characters. With probability ``novel``, a
    person, organisation, city or country is a made-up name (syllables) instead of a
    lexicon entry, so the model learns the contexts too, not only the lexicon's names."""

    _SLOT = re.compile(r"\{(\w+)\}")

    def __init__(self, rng: random.Random, novel: float = 0.0):
        super().__init__(rng)
        self.novel = novel

    def _word(self) -> str:
        r = self.rng
        syllables = r.choices((1, 2, 3), weights=(4, 5, 1))[0]
        return "".join(r.choice(_ONSETS) + r.choice(_VOWELS) + r.choice(_CODAS) for _ in range(syllables)).capitalize()

    def slot(self, name: str) -> str:
        if self.novel and name in ("person", "first", "org", "city", "country") and self.rng.random() < self.novel:
            r = self.rng
            if name == "first":
                return self._word()
            if name == "person":
                if r.random() < 0.1:
                    return f"{r.choice(['Dr.', 'Ms.', 'Mr.', 'Prof.'])} {self._word()} {self._word()}"
                return f"{self._word()} {self._word()}"
            if name == "org":
                return (self._word() + (" " + self._word() if r.random() < 0.2 else "")) + r.choice(_ORG_SUFFIXES)
            return r.choice(_PLACE_PREFIXES) + self._word()
        return super().slot(name)

    def labelled(self, template: str) -> Sentence:
        out, slots, pos = "", [], 0
        for m in self._SLOT.finditer(template):
            out += template[pos : m.start()]
            value = self.slot(m.group(1))
            slots.append((m.group(1), len(out), len(out) + len(value)))
            out += value
            pos = m.end()
        out += template[pos:]
        out = out[0].upper() + out[1:]
        style = self.rng.random()
        if style < 0.05 and len(out.upper()) == len(out):
            out = out.upper()
        elif style < 0.09 and len(out.lower()) == len(out):
            out = out.lower()
        elif style < 0.12:
            prefix = self.rng.choice(["BREAKING: ", "UPDATE - ", "Note: ", "EXCLUSIVE: "])
            out = prefix + out
            slots = [(name, s + len(prefix), e + len(prefix)) for name, s, e in slots]
        return Sentence(out, slots, template)


def _merge_dates(slots: list, text: str) -> list:
    """'{month} {year}' is one date."""
    merged = []
    for slot in slots:
        if merged and merged[-1][0] == "month" and slot[0] == "year" and text[merged[-1][2] : slot[1]] == " ":
            merged[-1] = ("month", merged[-1][1], slot[2])
        else:
            merged.append(slot)
    return merged


def _example(sentences: list[Sentence]) -> Example:
    text, mentions, relations = "", [], []
    sentiments, topics = set(), []
    notes = _annotations()
    for sentence in sentences:
        offset = len(text) + (1 if text else 0)
        text = f"{text} {sentence.text}" if text else sentence.text
        slots = _merge_dates(sentence.slots, sentence.text)
        by_name: dict[str, list[str]] = {}
        for name, start, end in slots:
            surface = text[offset + start : offset + end]
            by_name.setdefault(name, []).append(surface)
            if name in SLOT_KINDS:
                mentions.append((SLOT_KINDS[name], surface))
        note = notes[sentence.template]
        for relation, head, tail in note.get("relations", []):

            def value(ref):
                name, _, n = ref.partition("#")
                return by_name[name][int(n or 1) - 1]

            relations.append((relation, value(head), value(tail)))
        if note["sentiment"] != "neutral":
            sentiments.add(note["sentiment"])
        if note.get("topic") and note["topic"] not in topics:
            topics.append(note["topic"])
    assert len(sentiments) <= 1, sentiments
    return Example(text, mentions, relations, sentiments.pop() if sentiments else "neutral", topics)


def _templates_by(rule) -> list[str]:
    return [t for t in _templates() if rule(t, _annotations()[t])]


def examples(
    n: int, seed: int, focus: str = "", max_sentences: int = 3, focus_share: float = 0.5, novel: float = 0.0
) -> Iterator[Example]:
    """``n`` labelled texts of 1..max_sentences sentences; deterministic for a seed.

    A text draws a sentiment, then sentences that all carry it; with ``focus`` ("relations":
    one relation type, then a template that has it; or slot names joined by "|"),
    ``focus_share`` of the texts start with such a template instead (and take its sentiment).
    ``novel``: the share of made-up names (``_LabelledFiller``).
    """
    rng = random.Random(f"manylora-train-demo-{seed}")
    filler = _LabelledFiller(rng, novel)
    pools = {s: _templates_by(lambda t, a, s=s: a["sentiment"] == s) for s in SENTIMENTS}
    if focus == "relations":  # per relation: founded and acquired have one template each, works_for six
        names = sorted({r[0] for a in _annotations().values() for r in a.get("relations", [])})
        focused = [_templates_by(lambda t, a, n=n: any(r[0] == n for r in a.get("relations", []))) for n in names]
    else:
        slots = focus.split("|") if focus else []
        focused = [_templates_by(lambda t, a: any("{" + name + "}" in t for name in slots))] if slots else []
    for _ in range(n):
        sentiment = rng.choice(SENTIMENTS)
        count = rng.randint(1, max_sentences)
        if focused and rng.random() < focus_share:
            first = rng.choice(rng.choice(focused))
        else:
            first = rng.choice(pools[sentiment])
        mood = _annotations()[first]["sentiment"]
        rest = pools[mood]  # every sentence of a text carries its sentiment: a denser signal
        templates = [first] + [rng.choice(rest) for _ in range(count - 1)]
        rng.shuffle(templates)
        yield _example([filler.labelled(t) for t in templates])


def _record(example: Example, task: Task, rng: random.Random) -> dict[str, Any]:
    """The GLiNER2 training record for ``example`` (``InputExample.to_dict``'s format)."""
    labels = list(task.entities)
    for a, b in SYNONYMS:  # ask for one name of a kind, not both
        if a in labels and b in labels:
            labels.remove(rng.choice([a, b]))
    kinds = {kind for kind, _ in example.mentions}
    present = [label for label in labels if ENTITY_LABELS[label][0] & kinds]
    absent = [label for label in labels if label not in present]
    if task.name in ADAPTER_TASKS:  # few new labels: ask them all, so every text contrasts them
        asked = list(labels)
    else:
        asked = [label for label in present if rng.random() < 0.85] or present[:1]
        asked += rng.sample(absent, rng.randint(0 if asked else 1, min(3, len(absent))))
    rng.shuffle(asked)
    for label in task.keep:
        if rng.random() < 0.5 and not any(label in pair and other in pair for pair in SYNONYMS for other in asked):
            asked.append(label)
    entities = {}
    for label in asked:
        kinds = ENTITY_LABELS[label][0]
        entities[label] = [text for kind, text in example.mentions if kind in kinds]
        entities[label] = list(dict.fromkeys(entities[label]))
    record: dict[str, Any] = {"entities": entities}
    if rng.random() < 0.15:
        record["entity_descriptions"] = {label: ENTITY_LABELS[label][1] for label in asked}
    relations = [
        {name: {"head": head, "tail": tail}} for name, head, tail in example.relations if name in task.relations
    ]
    absent = [name for name in task.relations if name not in {r for r, _, _ in example.relations}]
    # relations the text does not hold: one instance with no gold spans (GLiNER2 trains no count 0);
    # beside true ones they teach which relation a pair is in, alone that none is there
    if relations:
        relations += [{name: {"head": "", "tail": ""}} for name in absent if rng.random() < 0.35]
    elif absent and rng.random() < 0.15:
        relations.append({rng.choice(absent): {"head": "", "tail": ""}})
    if relations and rng.random() < task.relation_share:
        record["relations"] = relations
    if task.classifications:
        classifications = []
        if rng.random() < task.cls_share:
            classifications.append({"task": "sentiment", "labels": list(SENTIMENTS), "true_label": [example.sentiment]})
        if TOPIC_SHARE and example.topics and rng.random() < TOPIC_SHARE:
            classifications.append(
                {"task": "topic", "labels": list(TOPICS), "true_label": list(example.topics), "multi_label": True}
            )
        if classifications:
            record["classifications"] = classifications
    return record


def records(task: Task, n: int, seed: int, max_sentences: int = 3, novel: float = 0.0) -> list[tuple[str, dict]]:
    rng = random.Random(f"manylora-train-demo-records-{task.name}-{seed}")
    texts = examples(n, seed, task.focus, max_sentences, task.focus_share, novel)
    return [(e.text, _record(e, task, rng)) for e in texts]


# ---------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def deterministic(seed: int):
    """One thread, deterministic algorithms, seeded torch and ``random``; restored on exit."""
    import torch

    threads, algorithms = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    state, torch_state = random.getstate(), torch.get_rng_state()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(algorithms)
        random.setstate(state)
        torch.set_rng_state(torch_state)


@contextlib.contextmanager
def _training_mode(model, processor):
    """Dropout off, GLiNER2's synthetic-label augmentation off, train mode; restored on exit."""
    import torch
    from gliner2.processor import SamplingConfig

    dropouts = [(m, m.p) for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    sampling = processor.sampling_config
    for module, _ in dropouts:
        module.p = 0.0
    processor.sampling_config = SamplingConfig(
        synthetic_entity_label_prob=0.0, synthetic_label_prob=0.0, remove_classification_label_prob=0.0
    )
    model.train()
    try:
        yield
    finally:
        for module, p in dropouts:
            module.p = p
        processor.sampling_config = sampling
        processor.change_mode(False)
        model.eval()


def _input_tokens(record: tuple, tokenize) -> int:
    """About how many subword tokens GLiNER2's input for ``record`` takes (prompt and text)."""
    text, schema = record

    def n(words: str) -> int:
        return len(tokenize(words.lower()))

    size = n(text) + 6 + sum(1 + n(label) for label in schema.get("entities", {}))
    size += sum(1 + n(f"{label}: {d}") for label, d in schema.get("entity_descriptions", {}).items())
    size += sum(10 + n(name) for relation in schema.get("relations", []) for name in relation)
    return size + sum(
        6 + n(c["task"]) + sum(1 + n(label) for label in c["labels"]) for c in schema.get("classifications", [])
    )


def _length_grouped(data: list, batch_size: int, seed: int, tokenize, window: int = 50) -> list:
    """Batches of similar length (less padding), in a seeded order, as GLiNER2's trainer groups them."""
    rng = random.Random(f"manylora-train-demo-batches-{seed}")
    out = []
    for start in range(0, len(data), window * batch_size):
        chunk = sorted(data[start : start + window * batch_size], key=lambda r: _input_tokens(r, tokenize))
        batches = [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
        rng.shuffle(batches)
        out += [record for batch in batches for record in batch]
    return out


def _binding_init(model, seed: int, strength: float = 7.0, heads: tuple = (0, 1), qk_gain: float = 1.0) -> None:
    """Start the encoder where GLiNER2's markers already read their label.

    A schema marker ([E], [L], [R], [C]) means what the word after it says. From DeBERTa's
    default init (N(0, 0.02): attention all but uniform, and tiny next to the residual) a
    2-layer model takes hundreds of steps to learn that, and the classification head
    collapses to the label prior first. So: query and key projections get N(0, qk_gain²/fan_in)
    (attention depends on content from the start), value and output projections
    N(0, 1/fan_in) (attention moves real signal), and in layer 0 ``heads`` attend to the next
    token (a query bias that meets the key of relative position -1: DeBERTa's c2p term).
    The classifier's output bias starts at the label prior.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    encoder = model.encoder.encoder
    attention = encoder.layer[0].attention.self
    size = attention.attention_head_size
    with torch.no_grad():
        for layer in encoder.layer:
            for linear in (layer.attention.self.query_proj, layer.attention.self.key_proj):
                linear.weight.normal_(0.0, qk_gain * linear.weight.shape[1] ** -0.5, generator=generator)
        # relative position q - k = -1 (the next token) sits at row att_span - 1 of c2p's table
        next_token = encoder.LayerNorm(encoder.rel_embeddings.weight)[attention.pos_ebd_size - 1]
        direction = torch.zeros(attention.num_attention_heads * size)
        for head in heads:
            v = torch.randn(size, generator=generator)
            direction[head * size : (head + 1) * size] = v / v.norm()
        attention.query_proj.bias += strength * direction
        attention.key_proj.weight += strength * torch.outer(direction, next_token) / next_token.dot(next_token)
        for layer in encoder.layer:
            for linear in (layer.attention.self.value_proj, layer.attention.output.dense):
                linear.weight.normal_(0.0, linear.weight.shape[1] ** -0.5, generator=generator)
        # so that the first steps do not learn the prior by flattening every [L] marker to one vector
        model.classifier[-1].bias.fill_(CLS_PRIOR_LOGIT)


def _fit(model, processor, groups: list, task: Task, recipe, seed: int, log=None) -> float:
    """GLiNER2's loss over fresh generated batches; returns the mean loss of the last 10% of steps.

    ``groups``: AdamW parameter groups, each with its lr. The loss is the model's own
    (``forward`` on ``collate_fn_train``'s batch), its classification part weighted by
    ``recipe.cls_weight``, averaged over the batch.
    """
    import torch

    params = [p for group in groups for p in group["params"]]
    optimizer = torch.optim.AdamW(groups, weight_decay=recipe.weight_decay)
    steps, size = recipe.steps, recipe.batch_size
    warm = max(1, int(steps * recipe.warmup))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / warm if s < warm else max(0.05, (steps - s) / max(1, steps - warm))
    )
    data = records(task, steps * size, seed, recipe.max_sentences, recipe.novel_names)
    data = _length_grouped(data, size, seed, processor.tokenizer.tokenize)
    tail, cpu = [], time.process_time()
    with _training_mode(model, processor):
        for step in range(steps):
            batch = data[step * size : (step + 1) * size]
            out = model(processor.collate_fn_train(batch))
            loss = (out["structure_loss"] + out["count_loss"] + recipe.cls_weight * out["classification_loss"]) / size
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            if step >= steps - max(1, steps // 10):
                tail.append(loss.item())
            if log and (step % 50 == 0 or step == steps - 1):
                log(
                    f"{task.name}: step {step + 1}/{steps}, loss {loss.item():.3f}, {time.process_time() - cpu:.0f} CPU s"
                )
    return round(sum(tail) / len(tail), 3)


def train_base(model, recipe: Recipe = Recipe(), seed: int = 0, log=None) -> dict[str, Any]:
    """Train every parameter of a freshly made GLiNER2 ``model`` on BASE_TASK, in place.

    Returns what the manifest records: the recipe, the data fingerprint, the final loss.
    """
    with deterministic(seed):
        if recipe.binding:
            _binding_init(model, seed)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for n, p in named if n.startswith("encoder.")], "lr": recipe.lr},
            {"params": [p for n, p in named if not n.startswith("encoder.")], "lr": recipe.head_lr},
        ]
        final_loss = _fit(model, model.processor, groups, BASE_TASK, recipe, seed, log)
    return {"recipe": asdict(recipe), "data": data_fingerprint(), "final_loss": final_loss}


def train_adapter(
    checkpoint: Path, out: Path, name: str, recipe: AdapterRecipe = AdapterRecipe(), seed: int = 0, log=None
) -> dict[str, Any]:
    """A LoRA fine-tune with PEFT of ``checkpoint`` on ADAPTER_TASKS[name], written by PEFT to ``out``.

    Only the LoRA factors train (PEFT freezes the rest); ``out`` is replaced atomically.
    """
    import shutil

    from gliner2 import GLiNER2
    from gliner2.training.lora_targets import _resolve_targets
    from peft import LoraConfig, get_peft_model

    task = ADAPTER_TASKS[name]
    with deterministic(seed):
        model = GLiNER2.from_pretrained(str(checkpoint))
        config = LoraConfig(
            r=recipe.rank,
            lora_alpha=recipe.alpha,
            target_modules=_resolve_targets(model, list(recipe.targets)),
            lora_dropout=0.0,
            bias="none",
        )
        peft_model = get_peft_model(model, config)
        groups = [{"params": [p for p in peft_model.parameters() if p.requires_grad], "lr": recipe.lr}]
        final_loss = _fit(peft_model, model.processor, groups, task, recipe, seed, log)
    out = Path(out)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    peft_model.save_pretrained(str(tmp))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return {"recipe": asdict(recipe), "task": asdict(task), "seed": seed, "final_loss": final_loss}


# ---------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------


def entity_scores(
    model, labels: list[str], n: int = 40, seed: int = 10_000, focus: str = "", novel: float = 0.0
) -> dict[str, dict]:
    """Precision and recall per entity label over ``n`` held-out texts (exact surface match).

    ``novel``: the share of made-up people, organisation and place names (1.0: none of the lexicon's)."""
    from gliner2 import Schema

    held_out = list(examples(n, seed, focus, novel=novel))
    schema = Schema.from_dict({"entities": labels})
    results = model.batch_extract([e.text for e in held_out], schema, batch_size=8)
    scores = {}
    for label in labels:
        kinds = ENTITY_LABELS[label][0]
        tp = fp = fn = 0
        for example, result in zip(held_out, results):
            gold = {t.lower() for k, t in example.mentions if k in kinds}
            got = {t.lower() for t in result["entities"][label]}
            tp, fp, fn = tp + len(gold & got), fp + len(got - gold), fn + len(gold - got)
        scores[label] = {"precision": round(tp / max(1, tp + fp), 3), "recall": round(tp / max(1, tp + fn), 3)}
    return scores


def task_scores(model, n: int = 40, seed: int = 10_000) -> dict[str, float]:
    """Relation recall/precision, sentiment and topic accuracy over ``n`` held-out texts."""
    from gliner2 import Schema

    held_out = list(examples(n, seed))
    texts = [e.text for e in held_out]
    relations = model.batch_extract(texts, Schema.from_dict({"relations": list(BASE_TASK.relations)}), batch_size=8)
    tp = fp = fn = 0
    for example, result in zip(held_out, relations):
        gold = {(r, h.lower(), t.lower()) for r, h, t in example.relations}
        got = set()
        for name, pairs in result["relation_extraction"].items():
            for pair in pairs:
                head, tail = pair if isinstance(pair, (tuple, list)) else (pair["head"], pair["tail"])
                got.add((name, str(head).lower(), str(tail).lower()))
        tp, fp, fn = tp + len(gold & got), fp + len(got - gold), fn + len(gold - got)
    cls = Schema.from_dict(
        {
            "classifications": [
                {"task": "sentiment", "labels": SENTIMENTS},
                {"task": "topic", "labels": TOPICS, "multi_label": True},
            ]
        }
    )
    answers = model.batch_extract(texts, cls, batch_size=8)
    sentiment = sum(a["sentiment"] == e.sentiment for a, e in zip(answers, held_out)) / n
    topic_hits = [set(a["topic"]) == set(e.topics) for a, e in zip(answers, held_out) if e.topics]
    return {
        "relation_precision": round(tp / max(1, tp + fp), 3),
        "relation_recall": round(tp / max(1, tp + fn), 3),
        "sentiment_accuracy": round(sentiment, 3),
        "topic_exact": round(sum(topic_hits) / max(1, len(topic_hits)), 3),
    }
