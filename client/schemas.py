"""GLiNER2 schemas → the SCHEMA tensor's JSON.

The convenience builders mirror ``GLiNER2.extract_entities`` & co. call for call and
use gliner2's own ``Schema`` builder, so the client builds exactly the schema GLiNER2
would. What travels is ``Schema.to_dict()``; the server rebuilds it with
``Schema.from_dict``. That trip is checked: a builder feature that does not survive it
(regex validators, unknown classification options, a structure declared twice) raises
``SchemaError`` instead of silently asking the server for something else.

gliner2 is imported on first use only: gliner2 2.1.0's package ``__init__`` pulls in
torch and transformers (api_client → inference.chunking → processing → models.base)
although the schema module itself is torch-free, which costs seconds. Plain dict or
JSON schemas never import it.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from .errors import SchemaError

# Keys that only GLiNER2's internal Schema.build() output has, never the
# Schema.from_dict input the server expects.
_BUILD_ONLY_KEYS = {"json_structures", "entity_descriptions", "relation_descriptions", "json_descriptions"}


def _gliner2_schema():
    from gliner2.inference import schema

    return schema


def create_schema():
    """A new, empty ``gliner2.Schema`` builder (what ``GLiNER2.create_schema()`` returns)."""
    return _gliner2_schema().Schema()


def entities_schema(entity_types):
    """The schema ``GLiNER2.extract_entities(text, entity_types)`` builds."""
    return create_schema().entities(entity_types)


def relations_schema(relation_types):
    """The schema ``GLiNER2.extract_relations(text, relation_types)`` builds."""
    return create_schema().relations(relation_types)


def classification_schema(tasks: dict):
    """The schema ``GLiNER2.classify_text(text, tasks)`` builds.

    ``tasks`` maps a task name to its labels (list, or label → description), or to a
    config dict with ``labels`` and ``Schema.classification`` options.
    """
    schema = create_schema()
    for name, config in tasks.items():
        if isinstance(config, dict) and "labels" in config:
            options = dict(config)
            labels = options.pop("labels")
            schema.classification(name, labels, **options)
        else:
            schema.classification(name, config)
    return schema


def json_schema(structures: dict):
    """The schema ``GLiNER2.extract_json(text, structures)`` builds on a span model.

    ``structures`` maps a structure name to field specs: ``"name"``,
    ``"name::str"``, ``"name::[a|b]"``, ``"name::[a|b]::list::description"``, or dicts
    with ``name``/``dtype``/``choices``/``description``. Structures are legacy
    (mode=None), as on gliner2-*-v1 span checkpoints, which have no record head.
    """
    schema = create_schema()
    for parent, fields in structures.items():
        builder = schema.structure(parent)
        for spec in fields:
            name, dtype, choices, description = parse_field_spec(spec)
            builder.field(name, dtype=dtype, choices=choices, description=description)
    return schema


def parse_field_spec(spec: str | dict) -> tuple[str, str, list[str] | None, str | None]:
    """``(name, dtype, choices, description)`` of one field spec, as GLiNER2 parses it."""
    if isinstance(spec, dict):
        return (
            spec.get("name", ""),
            spec.get("dtype", "list"),
            spec.get("choices"),
            spec.get("description"),
        )
    parts = spec.split("::")
    name, dtype, choices, description = parts[0], "list", None, None
    dtype_set = False
    for part in parts[1:]:
        if part in ("str", "list"):
            dtype, dtype_set = part, True
        elif part.startswith("[") and part.endswith("]"):
            choices = [choice.strip() for choice in part[1:-1].split("|")]
            if not dtype_set:
                dtype = "str"
        else:
            description = part
    return name, dtype, choices, description


def schema_to_dict(schema) -> dict[str, Any]:
    """``schema.to_dict()``, checked to rebuild into the same schema on the server.

    Accepts a ``gliner2.Schema`` or the ``StructureBuilder`` a ``.field()`` chain
    returns. Raises ``SchemaError`` when the rebuilt schema would differ in anything
    GLiNER2's extraction reads.
    """
    module = _gliner2_schema()
    if isinstance(schema, module.StructureBuilder):
        schema = schema.schema
    data = schema.to_dict()
    if not data:
        raise SchemaError("the schema has no task: add entities, classifications, relations or structures")
    try:
        rebuilt = module.Schema.from_dict(json.loads(json.dumps(data)))
    except ValueError as err:  # pydantic.ValidationError is a ValueError
        raise SchemaError(f"Schema.from_dict rejects this schema's to_dict(): {err}") from err
    for (part, original), (_, copy) in zip(_extraction_state(schema), _extraction_state(rebuilt), strict=True):
        if original != copy:
            raise SchemaError(_explain_mismatch(schema, part))
    return data


def encode_schema(schema) -> str:
    """The SCHEMA tensor's JSON text for a schema in any accepted form.

    - ``gliner2.Schema`` (or its ``StructureBuilder``): ``to_dict()``, round-trip checked.
    - ``dict``: a ``Schema.from_dict`` dict, sent as it is (the server validates it).
    - ``str``: JSON of such a dict, sent as it is once it parses to an object.
    """
    if isinstance(schema, str):
        try:
            data = json.loads(schema)
        except json.JSONDecodeError as err:
            raise SchemaError(f"schema is not valid JSON: {err}") from None
        _check_plain_dict(data)
        return schema
    if isinstance(schema, dict):
        _check_plain_dict(schema)
        try:
            return json.dumps(schema, ensure_ascii=False)
        except TypeError as err:
            raise SchemaError(f"schema dict is not JSON-serializable: {err}") from None
    if hasattr(schema, "to_dict"):
        return json.dumps(schema_to_dict(schema), ensure_ascii=False)
    raise SchemaError(f"schema must be a gliner2 Schema, a dict or a JSON string, got {type(schema).__name__}")


def _check_plain_dict(data: Any) -> None:
    if not isinstance(data, dict):
        raise SchemaError(f"schema JSON must be an object, got {type(data).__name__}")
    build_keys = _BUILD_ONLY_KEYS & set(data)
    if build_keys:
        raise SchemaError(
            f"schema has {sorted(build_keys)}: that is Schema.build() output, GLiNER2's internal "
            "form; send the Schema object itself or schema.to_dict()"
        )


def _extraction_state(schema) -> list[tuple[str, Any]]:
    """Everything GLiNER2's batch_extract reads from a Schema (see
    ``ExtractorRuntimeMixin._build_schema_dicts_and_metadata``), in comparable form.

    Order matters in the task dicts and order lists (it is prompt order); the metadata
    tables are lookups by name, so their own key order does not.
    """

    def lookup(table):
        return {name: _canonical(value) for name, value in table.items()}

    return [
        ("tasks", _canonical(schema.build())),
        ("field metadata", lookup(schema._field_metadata)),
        ("entity metadata", lookup(schema._entity_metadata)),
        ("relation metadata", lookup(schema._relation_metadata)),
        ("field order", lookup(schema._field_orders)),
        ("entity order", _canonical(schema._entity_order)),
        ("relation order", _canonical(schema._relation_order)),
        ("entity attribute groups", lookup(schema._entity_attribute_groups)),
        ("entity attribute prompt labels", lookup(schema._entity_attribute_prompt_labels)),
        ("entity attribute labels", _canonical(schema._entity_attribute_labels)),
    ]


def _canonical(value: Any) -> Any:
    """Order-sensitive, container-type-blind form of schema state."""
    if isinstance(value, dict):
        return [("dict", key, _canonical(item)) for key, item in value.items()]
    if isinstance(value, (list, tuple)):
        return [_canonical(item) for item in value]
    if isinstance(value, (set, frozenset)):
        return sorted(_canonical(item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__name__, _canonical(dataclasses.asdict(value)))
    return value


def _explain_mismatch(schema, part: str) -> str:
    metadata = list(schema._entity_metadata.items()) + list(schema._field_metadata.items())
    with_validators = [name for name, meta in metadata if meta.get("validators")]
    if with_validators:
        return (
            f"regex validators on {with_validators} cannot be sent: Schema.to_dict() drops them, "
            "so the server would extract without them. Filter the results client-side instead."
        )
    known = {
        "task",
        "labels",
        "multi_label",
        "cls_threshold",
        "top_k",
        "class_act",
        "prompt",
        "examples",
        "label_descriptions",
    }
    for config in schema.schema["classifications"]:
        extra = sorted(set(config) - known)
        if extra:
            return (
                f"classification {config['task']!r} has option(s) {extra} that GLiNER2's schema "
                "JSON does not carry (Schema.from_dict knows multi_label, cls_threshold, top_k, "
                "class_act, prompt, examples)"
            )
    return (
        f"this schema changes on the way to the server (Schema.to_dict() → Schema.from_dict() "
        f"alters its {part}); a task or field declared twice is the usual cause"
    )
