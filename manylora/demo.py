"""Offline demo GLiNER2 checkpoints, demo texts and demo schemas.

    python -m manylora.demo --size tiny|base --out DIR [--seed N] [--force]
    python -m manylora.demo --size tiny --train --out DIR [--replace-outdated]   # make demo / make serve

A demo checkpoint is laid out like ``fastino/gliner2-base-v1`` (config.json with
model_type "extractor", architecture "span", max_width 8, counting_layer "count_lstm",
token_pooling "first"; encoder_config/config.json, a DeBERTa-v3 DebertaV2Config;
model.safetensors; tokenizer.json + tokenizer_config.json) plus ``manylora_demo.json``
(size, seed, calibration constants). It is built with GLiNER2's own classes and written
by GLiNER2's own ``save_pretrained``, so ``GLiNER2.from_pretrained(dir)`` loads it with
no network. Nothing is downloaded:

- Tokenizer: a sentencepiece unigram model (3,000 pieces, [PAD]=0 [CLS]=1 [SEP]=2 [UNK]=3
  [MASK]=4, like DeBERTa-v3) trained at build time, single-threaded, on data/corpus.txt
  (news-like text from this module's generator; data/make_corpus.py rewrites it), wrapped
  as transformers' DebertaV2Tokenizer. That is the class GLiNER2's loader gives back from
  tokenizer.json, and it tokenizes identically after the reload. GLiNER2's
  SchemaTransformer adds its 10 special tokens; the encoder vocabulary already counts them.
- Sizes: ``tiny`` (hidden 64, 2 layers, 4 heads, FFN 128; ~2 MB, builds in about a second
  after imports) for tests; ``base`` (DeBERTa-v3-base geometry: 768, 12, 12, 3072;
  ~470 MB: the small vocabulary leaves out most of the real 98M-parameter embedding).
  Both use DeBERTa-v3's options: relative attention only, 256 position buckets, shared
  attention keys, p2c+c2p, layer-normed relative embeddings.
- Weights: every tensor is drawn from its own generator seeded by (seed, tensor name);
  two builds on one machine give byte-identical files.
- Trained (``--train``, what ``make demo`` and ``make serve`` serve): the same model, from
  GLiNER2's own initialisation, trained with GLiNER2's loss on generated, labelled news
  text (manylora.train_demo: people, companies, places, dates, money, job titles,
  relations, sentiment), about two minutes on one core, deterministic; no calibration. The
  manifest records the recipe and the data fingerprint under "training".
  The test suite's fidelity checks use the calibrated random checkpoint; the trained one is
  for answers that mean something.

Calibration (docs/architecture.md, "Demo checkpoints"). With random weights about half of all spans pass 0.5
and every label gets the same spans, so decoding would dominate any benchmark, and
scores saturate at 0 or 1. The builder runs GLiNER2 once over 8 fixed demo texts with a
calibration schema (8 entity labels, 3 relations, a 5-field structure, a classification),
captures the head inputs through hooks, and sets:

- encoder init gains (``ENCODER_GAINS``) that keep a random 12-layer stack from
  collapsing all tokens onto one vector, so [E]/[C]/[R] markers differ by label;
- count_pred's last layer: logits centered per count, spread 0.7, plus a prior that makes
  2 (sometimes 1, 3 or 4) the predicted count;
- classifier's last layer: label logits with mean -1.5 and spread 1.5;
- queries (count_embed projector's last layer): the mean directions shared by every
  query of one task kind and instance step are projected out, and queries are centered;
- span reps (span_rep out_project's last layer): centered over the spans of the texts;
- both scaled so one label's span logits have spread 2.0 over a text; channel 0 of both
  layers has zero weights and biases 1 and -offset, so every span score gets the constant
  -offset (about -5.7 tiny, -6.2 base), chosen so 2.5 spans per entity label pass 0.5
  before overlap removal.

Measured with GLiNER2.extract on demo_texts(32, seed=99, 75..95 words, mean 85) and the
entity demo schemas (5, 5 and 3 labels; the last sets person's threshold to 0.4):

    checkpoint   spans per label   labels with none   span confidence min/median/max
    tiny seed 0  3.5 / 3.1 / 3.6   22% / 24% / 11%    0.50 / 0.70-0.75 / 1.00
    tiny seed 1  1.4 / 1.2 / 1.4   51% / 53% / 47%    0.50 / 0.67-0.71 / 0.999
    tiny seed 2  1.8 / 2.6 / 1.7   41% / 25% / 32%    0.50 / 0.66-0.71 / 0.999
    base seed 0  2.4 / 2.8 / 2.4   16% /  9% /  8%    0.50 / 0.68-0.70 / 0.99

Fewer than 0.5% of confidences exceed 0.999. Single-label classification spreads over
all labels (confidence median ~0.65); multi-label topic (6 labels, cls_threshold 0.4)
returns 1.5-2.5 labels per text; structures get 2-3 instances, relations 0.8-1.4 pairs each.

GLiNER2 behaviours worth knowing (2.1.0): ``extract`` reads a plain dict as its internal
*built* schema, so pass ``Schema.from_dict(d)``; a text without an end mark gets "."
appended, and a span may end on that "." (its end offset is then past the text); a
relation given with a description is keyed "name: description" in the result (plus an
empty "name" entry); choice fields are scored on the choice words prepended to the text.
"""

from __future__ import annotations

import io
import json
import random
import re
import shutil
import sys
import tempfile
import zlib
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).resolve().parent / "data"


# ---------------------------------------------------------------------------
# Demo texts
# ---------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _lexicon() -> dict[str, list[str]]:
    with open(DATA_DIR / "lexicon.json", encoding="utf-8") as f:
        return json.load(f)


class _SentenceFiller:
    """Fills the lexicon's templates; every choice comes from one seeded RNG."""

    _SLOT = re.compile(r"\{(\w+)\}")

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.lex = _lexicon()

    def pick(self, key: str) -> str:
        return self.rng.choice(self.lex[key])

    def person(self) -> str:
        first, last = self.pick("first_names"), self.pick("last_names")
        style = self.rng.random()
        if style < 0.12:
            return f"{self.rng.choice(['Dr.', 'Ms.', 'Mr.', 'Prof.'])} {first} {last}"
        if style < 0.20:
            return f"{first[0]}. {last}"
        return f"{first} {last}"

    def date(self) -> str:
        r = self.rng
        day, month, year = r.randint(1, 28), r.randrange(12), r.randint(1998, 2027)
        name = self.lex["months"][month]
        return r.choice(
            [
                f"{day} {name} {year}",
                f"{name} {day}, {year}",
                f"{year}-{month + 1:02d}-{day:02d}",
                f"{name} {day}",
                f"{day}/{month + 1}/{year}",
            ]
        )

    def money(self) -> str:
        r = self.rng
        amount = r.choice([f"{r.randint(2, 950)}", f"{r.randint(1, 99)}.{r.randint(1, 9)}"])
        return r.choice(
            [
                f"${amount} million",
                f"€{amount} billion",
                f"£{amount}m",
                f"{amount} million euros",
                f"${r.randint(1, 999)},{r.randint(0, 999):03d}",
                f"{r.randint(2, 90)} billion yen",
                f"US${amount}bn",
            ]
        )

    def number(self) -> str:
        r = self.rng
        return r.choice(
            [
                str(r.randint(2, 99)),
                str(r.randint(100, 999)),
                f"{r.randint(1, 99)},{r.randint(0, 999):03d}",
                r.choice(["two", "three", "four", "five", "six", "ten", "a dozen", "several hundred"]),
            ]
        )

    _LISTS = {  # template slot -> lexicon list
        "org": "organizations",
        "city": "cities",
        "country": "countries",
        "region": "regions",
        "street": "streets",
        "month": "months",
        "weekday": "weekdays",
        "role": "roles",
        "product": "products",
        "event": "events",
        "topic": "topics",
        "noun": "nouns",
        "adj": "adjectives",
        "verb": "verbs_past",
        "adv": "adverbs",
        "first": "first_names",
    }

    def slot(self, name: str) -> str:
        r = self.rng
        if name in self._LISTS:
            return self.pick(self._LISTS[name])
        if name == "person":
            return self.person()
        if name == "date":
            return self.date()
        if name == "money":
            return self.money()
        if name == "num":
            return self.number()
        if name == "year":
            return str(r.randint(1990, 2027))
        if name == "pct":
            value = r.choice([str(r.randint(1, 60)), f"{r.randint(0, 19)}.{r.randint(1, 9)}"])
            return r.choice([f"{value}%", f"{value} per cent", f"{value} percent"])
        if name == "age":
            return str(r.randint(19, 88))
        if name == "temp":
            return str(r.randint(-25, 46))
        if name == "score":
            return f"{r.randint(1, 5)}-{r.randint(0, 3)}"
        if name == "time":
            return r.choice(
                [
                    f"{r.randint(1, 12)}:{r.choice(['00', '15', '30', '45'])} {r.choice(['a.m.', 'p.m.'])}",
                    f"{r.randint(0, 23):02d}:{r.randint(0, 59):02d}",
                    "noon",
                    "midnight",
                ]
            )
        if name == "time_score":
            return f"{r.randint(2, 3)}:{r.randint(0, 59):02d}:{r.randint(0, 59):02d}"
        if name == "email":
            first = self.pick("first_names").lower()
            last = re.sub(r"[^a-z]", "", self.pick("last_names").lower())
            return f"{first}.{last}@{self.pick('domains')}"
        if name == "phone":
            return f"+{r.randint(1, 99)} {r.randint(10, 99)} {r.randint(1000, 9999)} {r.randint(1000, 9999)}"
        if name == "version":
            return f"{r.randint(1, 9)}.{r.randint(0, 20)}.{r.randint(0, 9)}"
        if name == "ordinal":
            n = r.randint(2, 40)
            suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
            return f"{n}{suffix}"
        raise KeyError(f"unknown template slot {name!r}")

    def sentence(self) -> str:
        template = self.pick("templates")
        text = self._SLOT.sub(lambda m: self.slot(m.group(1)), template)
        text = text[0].upper() + text[1:]
        style = self.rng.random()
        if style < 0.05:
            return text.upper()
        if style < 0.09:
            return text.lower()
        if style < 0.12:
            return self.rng.choice(["BREAKING: ", "UPDATE - ", "Note: ", "EXCLUSIVE: "]) + text
        return text


def demo_texts(n: int, seed: int = 0, min_words: int = 60, max_words: int = 120) -> list[str]:
    """``n`` news-like English texts of ``min_words``..``max_words`` whitespace words.

    Deterministic for a given seed. Texts carry names, organisations, places, dates,
    amounts, quotes and punctuation; some sentences are upper- or lower-cased, and some
    texts stop without a final end mark (GLiNER2 then appends one itself).
    """
    if not 1 <= min_words <= max_words:
        raise ValueError(f"need 1 <= min_words <= max_words, got {min_words}, {max_words}")
    rng = random.Random(f"manylora-demo-texts-{seed}")
    filler = _SentenceFiller(rng)
    texts = []
    for _ in range(n):
        target = rng.randint(min_words, max_words)
        words: list[str] = []
        while len(words) < target:
            sentence = filler.sentence().split()
            if len(words) + len(sentence) > max_words and len(words) >= min_words:
                break
            words.extend(sentence)
        if len(words) > max_words or rng.random() < 0.15:
            words = words[:target]
        text = " ".join(words)
        if rng.random() < 0.15:
            text = text.rstrip(".!?")
        texts.append(text)
    return texts


# ---------------------------------------------------------------------------
# Demo schemas
# ---------------------------------------------------------------------------


def demo_schemas() -> list[dict[str, Any]]:
    """Schemas in GLiNER2's JSON vocabulary, one of each shape the server must answer.

    Each dict is what ``gliner2.Schema.from_dict`` accepts (and what a client sends as
    SCHEMA). Pass ``Schema.from_dict(d)`` to ``GLiNER2.extract``: a raw dict given to
    ``extract`` is read as GLiNER2's internal built form, not as this vocabulary.
    The first is the workload the calibration targets: five entity labels.
    """
    corporate_event = {
        "fields": [
            {"name": "company", "dtype": "str"},
            {
                "name": "event_type",
                "dtype": "str",
                "choices": ["acquisition", "lawsuit", "product launch", "earnings", "layoffs"],
            },
            {"name": "people", "dtype": "list", "description": "people named in the event"},
            {"name": "amount", "dtype": "str", "description": "sum of money involved"},
            {"name": "date"},
        ]
    }
    return [
        {"entities": ["person", "organization", "location", "date", "money"]},
        {
            "entities": {
                "person": "names of people",
                "company": "companies, institutions and public bodies",
                "city": "cities and towns",
                "product": "products, devices and services",
                "quantity": "amounts of money, percentages and counts",
            }
        },
        {
            "entities": {
                "person": {"description": "full names of people", "threshold": 0.4},
                "date": {"dtype": "str"},
                "email": "email addresses",
            }
        },
        {"classifications": [{"task": "sentiment", "labels": ["positive", "negative", "neutral"]}]},
        {
            "classifications": [
                {
                    "task": "topic",
                    "labels": ["business", "politics", "sports", "science", "health", "culture"],
                    "multi_label": True,
                    "cls_threshold": 0.4,
                }
            ]
        },
        {
            "classifications": [
                {
                    "task": "urgency",
                    "labels": {
                        "high": "needs action today",
                        "medium": "needs action this week",
                        "low": "for information only",
                    },
                }
            ]
        },
        {"relations": ["works_for", "located_in", "founded"]},
        {
            "relations": {
                "acquired": "a company that bought another company",
                "headquartered_in": "a company and the city of its main office",
            }
        },
        {"structures": {"corporate_event": corporate_event}},
        {
            "structures": {
                "person_profile": {
                    "fields": [
                        {"name": "name", "dtype": "str"},
                        {"name": "role", "dtype": "str"},
                        {"name": "employer", "dtype": "str"},
                        {
                            "name": "topics",
                            "dtype": "list",
                            "choices": ["finance", "technology", "health", "sport", "law"],
                        },
                    ]
                }
            }
        },
        {
            "entities": ["person", "organization", "location"],
            "classifications": [
                {"task": "sentiment", "labels": ["positive", "negative", "neutral"]},
                {
                    "task": "topic",
                    "labels": ["business", "politics", "sports", "science"],
                    "multi_label": True,
                    "cls_threshold": 0.5,
                },
            ],
            "relations": ["works_for", "located_in"],
            "structures": {"corporate_event": corporate_event},
        },
    ]


# ---------------------------------------------------------------------------
# Demo checkpoints
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class DemoSize:
    """Backbone geometry of one demo size (the DeBERTa-v3 options are shared)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int


SIZES = {
    "tiny": DemoSize(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128),
    "base": DemoSize(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
}

MANIFEST = "manylora_demo.json"
CHECKPOINT_FILES = (
    "config.json",
    "encoder_config/config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    MANIFEST,
)
TOKENIZER_VOCAB = 3000

# Encoder init: N(0, gain / sqrt(fan_in)) per group. Sharp attention (qk) and small
# residual updates (v, ffn) keep a random 12-layer post-LN stack from collapsing every
# token onto one vector, while [E]/[L] markers still pick up their label's words.
ENCODER_GAINS = {"qk": 3.0, "v": 0.3, "ffn": 0.5}

# Head calibration targets (see the module docstring).
CAL_SCHEMA = {
    "entities": ["person", "company", "city", "date", "amount", "product", "event", "job title"],
    "relations": ["works_for", "located_in", "acquired"],
    "structures": {
        "deal": {
            "fields": [
                {"name": "buyer", "dtype": "str"},
                {"name": "seller", "dtype": "str"},
                {"name": "price", "dtype": "str"},
                {"name": "advisers", "dtype": "list"},
                {"name": "date", "dtype": "str"},
            ]
        }
    },
    "classifications": [
        {"task": "topic", "labels": ["business", "politics", "sports", "science", "health", "culture"]}
    ],
}
CAL_INSTANCES = 4  # instance steps seen while calibrating (predicted counts are mostly 1-4)
SPAN_LOGIT_STD = 2.0  # spread of one label's span logits over a text
SPANS_PER_QUERY = 2.5  # spans per entity label above 0.5 before overlap removal
COUNT_LOGIT_STD = 0.7
COUNT_PRIOR = (-4.0, 0.5, 2.0, 1.7, 0.3, -1.0, -2.0)  # counts 0..6; higher counts get -3
CLS_LOGIT_STD = 1.5
CLS_OFFSET = -1.5


def _encoder_config(size: DemoSize, vocab_size: int):
    from transformers import DebertaV2Config

    return DebertaV2Config(
        vocab_size=vocab_size,
        hidden_size=size.hidden_size,
        num_hidden_layers=size.num_hidden_layers,
        num_attention_heads=size.num_attention_heads,
        intermediate_size=size.intermediate_size,
        hidden_act="gelu",
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        max_position_embeddings=512,
        type_vocab_size=0,
        initializer_range=0.02,
        layer_norm_eps=1e-7,
        relative_attention=True,
        max_relative_positions=-1,
        position_buckets=256,
        norm_rel_ebd="layer_norm",
        share_att_key=True,
        pos_att_type=["p2c", "c2p"],
        position_biased_input=False,
        pad_token_id=0,
    )


def _train_tokenizer():
    """A DeBERTa-v3-style sentencepiece unigram tokenizer, trained on data/corpus.txt.

    Trained single-threaded with fixed options, so every build yields the same vocabulary.
    Wrapped as transformers' DebertaV2Tokenizer (tokenizers backend): that is the class
    GLiNER2's loader gives back from the saved tokenizer.json.
    """
    import sentencepiece as spm
    from transformers import DebertaV2Tokenizer

    lines = [line for line in (DATA_DIR / "corpus.txt").read_text(encoding="utf-8").splitlines() if line]
    lines += [line.lower() for line in lines]  # GLiNER2 lower-cases text words
    model = io.BytesIO()
    spm.set_random_generator_seed(0)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        model_type="unigram",
        vocab_size=TOKENIZER_VOCAB,
        character_coverage=1.0,
        num_threads=1,
        shuffle_input_sentence=False,
        normalization_rule_name="identity",
        pad_id=0,
        bos_id=1,
        eos_id=2,
        unk_id=3,
        pad_piece="[PAD]",
        bos_piece="[CLS]",
        eos_piece="[SEP]",
        unk_piece="[UNK]",
        control_symbols=["[MASK]"],
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    vocab = [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]
    return DebertaV2Tokenizer(vocab=vocab, unk_id=sp.unk_id())


def _encoder_group(name: str) -> str:
    if "query_proj" in name or "key_proj" in name:
        return "qk"
    if "value_proj" in name or "attention.output" in name:
        return "v"
    return "ffn"


def _init_weights(model, seed: int) -> None:
    """Redraw every tensor from its own generator, seeded by (seed, tensor name).

    Encoder: embeddings N(0, 0.02), linears N(0, gain/sqrt(fan_in)) per ENCODER_GAINS,
    zero biases, unit LayerNorms. Heads: torch's defaults for their layer types
    (uniform +-1/sqrt(fan_in), GRU +-1/sqrt(hidden), N(0, 1) count embeddings).
    """
    import torch

    heads = tuple(f"{name}." for name in model.task_module_names())
    tensors = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, tensor in sorted(tensors.items()):
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            if "LayerNorm" in name:
                tensor.fill_(1.0 if name.endswith("weight") else 0.0)
            elif not name.startswith(heads):
                if name.endswith("bias"):
                    tensor.zero_()
                elif "embeddings" in name:
                    tensor.normal_(0.0, 0.02, generator=g)
                else:
                    gain = ENCODER_GAINS[_encoder_group(name)]
                    tensor.normal_(0.0, gain / tensor.shape[-1] ** 0.5, generator=g)
            elif name.endswith("pos_embedding.weight"):
                tensor.normal_(0.0, 1.0, generator=g)
            else:
                weight = tensors.get(name.rsplit(".", 1)[0] + ".weight", tensor)
                fan_in = weight.shape[-1] if weight.dim() > 1 else model.hidden_size
                tensor.uniform_(-(fan_in**-0.5), fan_in**-0.5, generator=g)


def _rounded(x: float) -> float:
    """Calibration constants keep 4 significant digits: float noise between machines
    or thread counts then rarely changes a byte of the checkpoint."""
    return float(f"{float(x):.4g}")


def _calibrate_heads(model) -> dict[str, Any]:
    """Set the demo heads' scales and biases from one GLiNER2 pass over fixed demo texts.

    Returns the chosen constants (they go into the manifest).
    """
    import torch
    from gliner2 import Schema

    texts = demo_texts(8, seed=1234, min_words=75, max_words=95)
    schema = Schema.from_dict(CAL_SCHEMA)
    marker = model.span_rep.span_rep_layer
    span_last, query_last = marker.out_project[3], model.count_embed.projector[2]
    count_last, cls_last = model.count_pred[2], model.classifier[2]
    captured: dict[str, list] = {"count": [], "cls": [], "instances": [], "tokens": []}

    def keep(key, use_output=False):
        return lambda module, args, out: captured[key].append(out if use_output else args[0])

    hooks = [
        model.count_pred.register_forward_hook(keep("count")),
        model.classifier.register_forward_hook(keep("cls")),
        model.count_embed.register_forward_hook(keep("instances", use_output=True)),
    ]
    score_spans = model.compute_span_scores_batched

    def capture_spans(tokens, queries, **kwargs):
        captured["tokens"] += tokens
        return score_spans(tokens, queries, **kwargs)

    model.compute_span_scores_batched = capture_spans
    try:
        with torch.no_grad():
            # Channel 0 of span reps and queries carries only a bias: the score offset.
            span_last.weight[0] = 0.0
            query_last.weight[0] = 0.0
            span_last.bias[0] = 1.0
            query_last.bias[0] = -1e4  # nothing decodes during the capture pass
            count_last.bias.fill_(0.0)
            count_last.bias[CAL_INSTANCES] = 1e4  # every span task runs CAL_INSTANCES instances
            model.batch_extract(texts, schema, batch_size=len(texts))
    finally:
        del model.compute_span_scores_batched
        for hook in hooks:
            hook.remove()

    with torch.no_grad():
        # Count head: per-count logits centered over the texts, spread COUNT_LOGIT_STD,
        # plus a prior that makes 2-3 instances the usual answer.
        count_last.bias.zero_()
        raw = model.count_pred(torch.cat(captured["count"]))
        count_scale = _rounded(COUNT_LOGIT_STD / raw.std(dim=0).mean())
        count_last.weight.mul_(count_scale)
        prior = torch.full_like(count_last.bias, -3.0)
        prior[: len(COUNT_PRIOR)] = torch.tensor(COUNT_PRIOR)
        count_last.bias.copy_(prior - raw.mean(dim=0) * count_scale)

        # Classifier: label logits with mean CLS_OFFSET and spread CLS_LOGIT_STD.
        raw = model.classifier(torch.cat(captured["cls"])).squeeze(-1) - cls_last.bias
        cls_scale = _rounded(CLS_LOGIT_STD / raw.std())
        cls_last.weight.mul_(cls_scale)
        cls_last.bias.fill_(_rounded(CLS_OFFSET - raw.mean() * cls_scale))

        # Queries: a random net puts most of a query's energy in what every query of one
        # task kind ([E] entity, [R] relation, [C] field) at one instance step shares.
        # Project those mean directions out of the query projector, so scores follow the
        # label words and the text. CAL_SCHEMA gives each task kind its own field count.
        tasks = len(captured["instances"]) // len(texts)
        groups: dict[tuple[int, int], list] = {}
        for instances in captured["instances"]:
            for step, fields in enumerate(instances):
                groups.setdefault((len(fields), step), []).append(fields)
        means = torch.stack([torch.cat(fields).mean(dim=0) for fields in groups.values()])
        u, sv, _ = torch.linalg.svd((means - means.mean(dim=0)).T, full_matrices=False)
        shared = u[:, sv > 1e-3 * sv[0]]  # [H, k] orthonormal
        query_last.weight.sub_(shared @ (shared.T @ query_last.weight))
        query_last.bias.sub_(shared @ (shared.T @ query_last.bias))

        # The queries GLiNER2 scores: instance 0 of an entity task, every instance of the rest.
        entity_fields = len(CAL_SCHEMA["entities"])
        scored = []  # (sample, is_entity_task, queries)
        for call, instances in enumerate(captured["instances"]):
            is_entity = instances.shape[1] == entity_fields
            queries = instances[:1] if is_entity else instances
            queries = queries.reshape(-1, queries.shape[-1])
            scored.append((call // tasks, is_entity, queries - (queries @ shared) @ shared.T))

        # Span scores: center span reps and queries, scale to SPAN_LOGIT_STD, then shift
        # so that SPANS_PER_QUERY spans per entity label pass 0.5 before overlap removal.
        reps = []
        for tokens in captured["tokens"]:
            n = len(tokens)
            starts = torch.arange(n).repeat_interleave(marker.max_width)
            ends = starts + torch.arange(marker.max_width).repeat(n)
            span_idx = torch.stack([starts, ends.clamp(max=n - 1)], dim=-1)[None]
            reps.append(marker(tokens[None], span_idx).reshape(n * marker.max_width, -1)[ends < n])
        span_center = torch.cat(reps).mean(dim=0)
        query_center = torch.cat([queries for _, _, queries in scored]).mean(dim=0)
        span_center[0] = query_center[0] = 0.0
        logits = [
            (is_entity, (queries - query_center)[:, 1:] @ (reps[sample] - span_center)[:, 1:].T)
            for sample, is_entity, queries in scored
        ]
        spread = torch.cat([x.std(dim=1) for _, x in logits]).mean()
        span_scale = _rounded((SPAN_LOGIT_STD / spread) ** 0.5)
        entity_logits = torch.cat([x.flatten() for is_entity, x in logits if is_entity]) * span_scale**2
        spans_per_label = sum(len(r) for r in reps) / len(reps)
        offset = _rounded(torch.quantile(entity_logits, 1.0 - SPANS_PER_QUERY / spans_per_label))
        for layer, center in ((span_last, span_center), (query_last, query_center)):
            layer.bias.sub_(center)
            layer.weight.mul_(span_scale)
            layer.bias.mul_(span_scale)
        span_last.bias[0] = 1.0
        query_last.bias[0] = -offset
    return {
        "count_scale": count_scale,
        "classifier_scale": cls_scale,
        "span_scale": span_scale,
        "span_offset": offset,
        "query_directions_removed": shared.shape[1],
    }


def _build_model(size: str, seed: int, train=None, log=None):
    """The demo model and its manifest: calibrated random weights, or trained with ``train``
    (a manylora.train_demo.Recipe) from GLiNER2's own initialisation."""
    import torch
    from gliner2 import ExtractorConfig, GLiNER2
    from gliner2.processor import SchemaTransformer

    tokenizer = _train_tokenizer()
    tokenizer_vocab = len(tokenizer)
    # The encoder vocabulary already counts GLiNER2's 10 special tokens, which
    # SchemaTransformer adds to the tokenizer; resize_token_embeddings is then a no-op.
    encoder_config = _encoder_config(SIZES[size], len(tokenizer) + len(SchemaTransformer.SPECIAL_TOKENS))
    config = ExtractorConfig(
        model_name=f"manylora-demo/deberta-v3-{size}",
        max_width=8,
        counting_layer="count_lstm",
        token_pooling="first",
    )
    torch.manual_seed(seed)
    model = GLiNER2(config, encoder_config=encoder_config, tokenizer=tokenizer)
    manifest = {
        "builder": "manylora.demo",
        "size": size,
        "seed": seed,
        "geometry": asdict(SIZES[size]),
        "tokenizer_vocab": tokenizer_vocab,
    }
    if train is None:
        _init_weights(model, seed)
        manifest["encoder_gains"] = ENCODER_GAINS
        manifest["calibration"] = _calibrate_heads(model)
    else:
        from manylora.train_demo import train_base

        manifest["training"] = train_base(model, train, seed=seed, log=log)
    return model, manifest


def _read_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest of a complete demo checkpoint at ``path``, else None."""
    if not all((path / name).is_file() for name in CHECKPOINT_FILES):
        return None
    try:
        return json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except ValueError:
        return None


def _training_key(train) -> dict[str, Any] | None:
    """What a trained checkpoint's manifest must record to count as built by ``train``."""
    if train is None:
        return None
    from manylora.train_demo import data_fingerprint

    return {"recipe": asdict(train), "data": data_fingerprint()}


def is_demo_checkpoint(path, size: str = "tiny", seed: int = 0, train=None) -> bool:
    """Whether ``path`` holds a complete demo checkpoint built with these settings."""
    manifest = _read_manifest(Path(path))
    if manifest is None or manifest.get("size") != size or manifest.get("seed") != seed:
        return False
    training, key = manifest.get("training"), _training_key(train)
    if key is None:
        return training is None
    return training is not None and all(training.get(k) == v for k, v in key.items())


def build_demo_checkpoint(
    out_dir,
    size: str = "tiny",
    seed: int = 0,
    force: bool = False,
    train=None,
    replace_outdated: bool = False,
    log=None,
) -> Path:
    """Build a demo GLiNER2 checkpoint at ``out_dir`` and return its path.

    ``train``: None for calibrated random weights (the test suite's checkpoint), else a
    ``manylora.train_demo.Recipe`` (``True``: the default one): the model is trained on
    generated, labelled news text (manylora.train_demo; about two minutes for tiny on one
    core). ``log`` gets training progress lines.

    Idempotent: a complete checkpoint of the same size, seed and training (recipe and data)
    already there is returned as it is. Anything else already at ``out_dir`` raises
    FileExistsError, unless ``force``, or ``replace_outdated`` and it is a checkpoint this
    builder made with other settings. The checkpoint is written to a sibling temp dir and
    renamed into place.
    """
    if size not in SIZES:
        raise ValueError(f"unknown demo size {size!r}; choose from {sorted(SIZES)}")
    if train is True:
        from manylora.train_demo import Recipe

        train = Recipe()
    train = train or None
    out_dir = Path(out_dir)

    def matches() -> bool:
        return is_demo_checkpoint(out_dir, size, seed, train)

    if out_dir.exists() and not force:
        if matches():
            return out_dir
        manifest = _read_manifest(out_dir)
        if not (replace_outdated and manifest is not None and manifest.get("builder") == "manylora.demo"):
            kind = "trained " if train else ""
            raise FileExistsError(
                f"{out_dir} exists and is not a complete {kind}{size} demo checkpoint "
                f"(seed {seed}); pass force=True to replace it"
            )
        force = True
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        model, manifest = _build_model(size, seed, train, log)
        model.save_pretrained(str(tmp))
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        for path in (tmp, tmp / "encoder_config"):
            path.chmod(0o755)
        for path in tmp.rglob("*.*"):
            path.chmod(0o644)
        if force and out_dir.exists():
            old = tmp.with_name(tmp.name + ".old")
            out_dir.rename(old)
            shutil.rmtree(old)
        try:
            tmp.rename(out_dir)
        except OSError:
            if not matches():  # lost the race to an identical concurrent build: fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


# ---------------------------------------------------------------------------
# Demo adapters
# ---------------------------------------------------------------------------
# Reserved for demo LoRA adapters over these checkpoints (a separate issue; PEFT-made
# adapters currently live in manylora.lora.demo_adapters).


def main(argv: list[str] | None = None) -> None:
    import argparse

    from manylora.train_demo import pin_cpu_kernels

    pin_cpu_kernels()  # before any torch op: the trained demo is the same on any x86 host

    parser = argparse.ArgumentParser(prog="python -m manylora.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--out", required=True, type=Path, help="checkpoint directory to create")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="replace whatever is at --out")
    parser.add_argument(
        "--train",
        action="store_true",
        help="train the model on generated news text (manylora.train_demo) instead of calibrated random weights",
    )
    parser.add_argument("--steps", type=int, help="with --train: training steps (default: the recipe's)")
    parser.add_argument(
        "--replace-outdated",
        action="store_true",
        help="replace a demo checkpoint at --out that this builder made with other settings (nothing else)",
    )
    args = parser.parse_args(argv)
    train = None
    if args.train:
        from manylora.train_demo import Recipe

        train = Recipe() if args.steps is None else Recipe(steps=args.steps)
    elif args.steps is not None:
        parser.error("--steps needs --train")
    try:
        path = build_demo_checkpoint(
            args.out,
            size=args.size,
            seed=args.seed,
            force=args.force,
            train=train,
            replace_outdated=args.replace_outdated,
            log=lambda line: print(line, file=sys.stderr, flush=True),
        )
    except FileExistsError as error:
        parser.error(str(error))
    print(path.resolve())


if __name__ == "__main__":
    main()
