"""The client sends exactly the schema GLiNER2's own methods build.

"Exactly" is checked where it matters: the SCHEMA JSON, rebuilt by the server with
``Schema.from_json``, must give GLiNER2's ``batch_extract`` the same schema dicts and
metadata as the Schema that ``GLiNER2.extract_entities`` & co. build themselves.
"""

from __future__ import annotations

import json

import pytest
from gliner2 import RegexValidator
from gliner2.inference.runtime import ExtractorRuntimeMixin
from gliner2.inference.schema import AttributeGroup, Schema
from manylora.client import schemas
from manylora.client.errors import SchemaError


class _GLiNER2Methods(ExtractorRuntimeMixin):
    """GLiNER2's public runtime without a model: its schema builders are model-free."""


gliner2 = _GLiNER2Methods()


def what_gliner2_reads(schema: Schema):
    """The schema dict and metadata GLiNER2's batch_extract derives from a Schema.

    The schema dict is compared as JSON text, so its order (the prompt's order) counts;
    the metadata are lookup tables, compared as dicts.
    """
    (schema_dict,), (metadata,) = gliner2._build_schema_dicts_and_metadata([schema])
    return json.dumps(schema_dict), json.loads(json.dumps(metadata, default=_jsonable))


def _jsonable(value):
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, AttributeGroup):
        return vars(value)
    raise TypeError(type(value))


def served(schema_json: str) -> Schema:
    """What the server rebuilds from the SCHEMA tensor."""
    return Schema.from_json(schema_json)


ENTITY_TYPES = [
    ["person", "company"],
    "person",
    {"person": "a human being", "company": "an organisation"},
    {"person": {"description": "a human", "dtype": "str", "threshold": 0.7}, "date": {}},
]
TASKS = [
    {"sentiment": ["positive", "negative", "neutral"]},
    {"sentiment": {"positive": "good vibes", "negative": "bad vibes"}},
    {
        "topic": {
            "labels": ["sport", "politics", "tech"],
            "multi_label": True,
            "cls_threshold": 0.3,
            "top_k": 2,
            "class_act": "sigmoid",
            "prompt": "what is it about",
            "examples": [["The match ended 2-1.", "sport"]],
        },
        "urgent": ["yes", "no"],
    },
]
RELATION_TYPES = [
    ["works_for", "born_in"],
    "works_for",
    {"works_for": "employment", "born_in": {"description": "birthplace", "threshold": 0.4}},
]
STRUCTURES = [
    {"product": ["name", "price::str", "color::[red|blue]", "tags::[a|b]::list", "note::str::free text"]},
    {
        "order": [{"name": "id", "dtype": "str"}, {"name": "kind", "choices": ["x", "y"], "description": "d"}],
        "buyer": ["name::str", "email"],
    },
]


@pytest.mark.parametrize("entity_types", ENTITY_TYPES)
def test_entities_schema_equals_gliner2s(entity_types):
    ours = schemas.encode_schema(schemas.entities_schema(entity_types))
    theirs = gliner2.create_schema().entities(entity_types)
    assert json.loads(ours) == theirs.to_dict()
    assert what_gliner2_reads(served(ours)) == what_gliner2_reads(theirs)


@pytest.mark.parametrize("tasks", TASKS)
def test_classification_schema_equals_gliner2s(tasks):
    ours = schemas.encode_schema(schemas.classification_schema(tasks))
    theirs = gliner2._classification_schema(tasks)
    assert json.loads(ours) == theirs.to_dict()
    assert what_gliner2_reads(served(ours)) == what_gliner2_reads(theirs)


@pytest.mark.parametrize("relation_types", RELATION_TYPES)
def test_relations_schema_equals_gliner2s(relation_types):
    ours = schemas.encode_schema(schemas.relations_schema(relation_types))
    theirs = gliner2.create_schema().relations(relation_types)
    assert json.loads(ours) == theirs.to_dict()
    assert what_gliner2_reads(served(ours)) == what_gliner2_reads(theirs)


@pytest.mark.parametrize("structures", STRUCTURES)
def test_json_schema_equals_gliner2s(structures):
    ours = schemas.encode_schema(schemas.json_schema(structures))
    theirs = gliner2._json_schema(structures)  # a span model: no record head, legacy structures
    assert json.loads(ours) == theirs.to_dict()
    assert what_gliner2_reads(served(ours)) == what_gliner2_reads(theirs)


@pytest.mark.parametrize(
    "spec",
    [
        "name",
        "name::str",
        "name::list",
        "c::[a|b]",
        "c::[a | b]::list",
        "c::list::[a|b]",
        "d::some words",
        "x::str::[p|q]::described",
        {"name": "n", "choices": ["a"]},
        {"name": "n"},
    ],
)
def test_field_specs_parse_like_gliner2(spec):
    assert schemas.parse_field_spec(spec) == gliner2._parse_field_spec(spec)


def test_a_full_builder_schema_round_trips():
    schema = (
        Schema()
        .entities({"drug": "a medication", "dose": {"dtype": "str", "threshold": 0.6}})
        .entity_attributes(
            {
                "route": AttributeGroup(labels=["oral", "iv"], applies_to=["drug"]),
                "negation": AttributeGroup(labels=["negated"], multi_label=True, threshold=0.6, qualify_labels=True),
            }
        )
        .classification("urgency", ["low", "high"], cls_threshold=0.4)
        .relations(["treats"], threshold=0.3)
        .structure("visit", mode="natural", anchor="date")
        .field("date", dtype="str", threshold=0.2, cardinality="required_one")
        .field("findings", description="what the doctor found", exclusive=True)
    )
    schema.structure("legacy").field("a", choices=["x", "y"])
    encoded = schemas.encode_schema(schema)
    assert what_gliner2_reads(served(encoded)) == what_gliner2_reads(schema)


def test_a_structure_builder_is_accepted_for_its_schema():
    builder = Schema().entities(["person"]).structure("s").field("a").field("b::str")
    assert json.loads(schemas.encode_schema(builder))["structures"]["s"]["fields"][0] == {"name": "a"}


def test_regex_validators_do_not_travel():
    schema = Schema().entities(["email"], validators=[RegexValidator(r"\S+@\S+")])
    with pytest.raises(SchemaError, match="validators on \\['email'\\]"):
        schemas.encode_schema(schema)
    field_schema = Schema().structure("s").field("mail", validators=[RegexValidator("@")]).schema
    with pytest.raises(SchemaError, match="validators"):
        schemas.encode_schema(field_schema)


def test_classification_options_outside_the_schema_json_are_refused():
    with pytest.raises(SchemaError, match="\\['temperature'\\]"):
        schemas.encode_schema(schemas.classification_schema({"t": {"labels": ["a", "b"], "temperature": 2}}))


def test_declaring_a_task_twice_is_refused():
    with pytest.raises(SchemaError, match="declared twice"):
        schemas.encode_schema(Schema().relations(["a"]).relations(["a"]))
    with pytest.raises(SchemaError, match="declared twice"):
        schemas.encode_schema(Schema().structure("s").field("a").structure("s").field("b"))


@pytest.mark.parametrize(
    "schema,message",
    [
        (Schema(), "no task"),
        (Schema().structure("empty").schema, "rejects"),
        (["person"], "must be a gliner2 Schema, a dict or a JSON string"),
        ("{not json", "not valid JSON"),
        ('["person"]', "must be an object"),
        (Schema().entities(["x"]).build(), "Schema.build\\(\\) output"),
        ({"entities": {1, 2}}, "not JSON-serializable"),
    ],
)
def test_unsendable_schemas_raise_schema_error(schema, message):
    with pytest.raises(SchemaError, match=message):
        schemas.encode_schema(schema)


def test_dicts_and_json_text_are_sent_as_given():
    data = {"entities": {"person": "a human"}, "relations": ["works_for"]}
    assert json.loads(schemas.encode_schema(data)) == data
    text = '{"entities": ["person"]}'
    assert schemas.encode_schema(text) == text


def test_non_ascii_stays_readable():
    assert "café" in schemas.encode_schema(schemas.entities_schema(["café"]))
