"""The Triton tensor contract of the ``gliner2`` model, defined once.

Both sides import this module: the client encodes requests with it and the server
(model.py / the engine's serving layer) decodes them with it, so tensor names,
dtypes and defaults cannot drift apart. It depends on numpy only, because the
Triton Python backend stub imports it.

The model has ``max_batch_size > 0``, so each tensor of a request has shape ``[N, 1]``:
the batch dimension (N items), then the ``dims: [1]`` of config.pbtxt. The client sends one
item per request (``[1, 1]``: the dynamic batcher does the batching); the server also takes
N items in one request (``perf_analyzer -b N``, tritonclient with a batch) and answers them
in one RESULT of shape ``[N, 1]``, item by item. BYTES tensors hold UTF-8 encoded ``bytes``.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

MODEL_NAME = "gliner2"

TEXT = "TEXT"
SCHEMA = "SCHEMA"
ADAPTER_ID = "ADAPTER_ID"
THRESHOLD = "THRESHOLD"
INCLUDE_CONFIDENCE = "INCLUDE_CONFIDENCE"
INCLUDE_SPANS = "INCLUDE_SPANS"
MAX_LEN = "MAX_LEN"
RESULT = "RESULT"

BASE_ADAPTER = ""  # ADAPTER_ID value meaning "no adapter, base weights only"
# HTTP / gRPC header carrying the adapter id, for gateways that route each adapter to the
# replica where it is hot (deploy/k8s/router.yaml hashes on it); the server ignores it
ADAPTER_HEADER = "x-adapter-id"
DEFAULT_THRESHOLD = 0.5
MAX_LEN_LIMIT = 2**31 - 1  # INT32

ITEM_SHAPE = (1, 1)  # [batch of one request, dims [1]]

# Limits on SCHEMA, checked when a Request is built (client and server alike), before the
# server pays for parsing and tokenizing it. A schema's tokens also count against the
# server's max_request_tokens (4096 by default), so no useful schema comes near these.
MAX_SCHEMA_CHARS = 65_536
# entity and relation types, classification labels, structure fields and their choices,
# entity attribute labels, all tasks together. GLiNER2 decodes label by label in Python:
# on the tiny CPU demo one request with 256 labels takes 0.2 s, with 1,024 labels 5 s.
MAX_SCHEMA_LABELS = 256
MAX_SCHEMA_DEPTH = 32  # arrays and objects nested; GLiNER2's own vocabulary needs 6


@dataclass(frozen=True)
class TensorSpec:
    """One input or output tensor as config.pbtxt and the wire protocol name it."""

    name: str
    config_dtype: str  # data_type in config.pbtxt, e.g. "TYPE_STRING"
    triton_dtype: str  # datatype on the wire (tritonclient), e.g. "BYTES"
    numpy_dtype: type  # dtype of the numpy array on either side
    dims: tuple = (1,)  # per item, without the batch dimension
    optional: bool = False
    default: Any = None  # value the server assumes when an optional input is absent


INPUTS = (
    TensorSpec(TEXT, "TYPE_STRING", "BYTES", np.object_),
    TensorSpec(SCHEMA, "TYPE_STRING", "BYTES", np.object_),
    TensorSpec(ADAPTER_ID, "TYPE_STRING", "BYTES", np.object_, optional=True, default=BASE_ADAPTER),
    TensorSpec(THRESHOLD, "TYPE_FP32", "FP32", np.float32, optional=True, default=DEFAULT_THRESHOLD),
    TensorSpec(INCLUDE_CONFIDENCE, "TYPE_BOOL", "BOOL", np.bool_, optional=True, default=False),
    TensorSpec(INCLUDE_SPANS, "TYPE_BOOL", "BOOL", np.bool_, optional=True, default=False),
    # GLiNER2's max_len: at most this many word tokens of the text are read (0 = all); its
    # *_long methods pass chunk_size for every chunk
    TensorSpec(MAX_LEN, "TYPE_INT32", "INT32", np.int32, optional=True, default=0),
)
OUTPUTS = (TensorSpec(RESULT, "TYPE_STRING", "BYTES", np.object_),)

SPECS = {spec.name: spec for spec in INPUTS + OUTPUTS}


@dataclass(frozen=True)
class Request:
    """One inference item, validated, in the form both sides work with.

    ``schema`` is the JSON text of a GLiNER2 schema dict, the form
    ``gliner2.Schema.from_json`` accepts. Construction checks types and ranges and
    raises ``ValueError``; the server maps that to ``INVALID_ARG``.
    """

    text: str
    schema: str
    adapter: str = BASE_ADAPTER
    threshold: float = DEFAULT_THRESHOLD
    include_confidence: bool = False
    include_spans: bool = False
    max_len: int = 0  # GLiNER2's max_len (word tokens of the text read); 0 = None, every token

    def __post_init__(self):
        for name, value in (("text", self.text), ("schema", self.schema), ("adapter", self.adapter)):
            if not isinstance(value, str):
                raise ValueError(f"{name} must be a str, got {type(value).__name__}")
        problem = schema_limit_problem(self.schema)
        if problem is not None:
            raise ValueError(problem)
        for name, value in (
            ("include_confidence", self.include_confidence),
            ("include_spans", self.include_spans),
        ):
            if not isinstance(value, (bool, np.bool_)):
                raise ValueError(f"{name} must be a bool, got {type(value).__name__}")
            object.__setattr__(self, name, bool(value))
        threshold = self.threshold
        if isinstance(threshold, (bool, np.bool_)) or not isinstance(threshold, (int, float, np.floating, np.integer)):
            raise ValueError(f"threshold must be a number, got {type(threshold).__name__}")
        object.__setattr__(self, "threshold", wire_threshold(threshold))
        max_len = self.max_len
        if isinstance(max_len, (bool, np.bool_)) or not isinstance(max_len, (int, np.integer)):
            raise ValueError(f"max_len must be an integer, got {type(max_len).__name__}")
        if not 0 <= max_len <= MAX_LEN_LIMIT:
            raise ValueError(f"max_len must be within [0, {MAX_LEN_LIMIT}] (0: every word), got {max_len}")
        object.__setattr__(self, "max_len", int(max_len))

    def to_arrays(self) -> dict:
        """All seven input tensors, each shaped ``[1, 1]``.

        Optional inputs are always filled in: Triton's dynamic batcher only puts
        requests with the same set of inputs into one batch, so a client that left
        out defaults would split the batches.
        """
        return {
            TEXT: _bytes_array(self.text),
            SCHEMA: _bytes_array(self.schema),
            ADAPTER_ID: _bytes_array(self.adapter),
            THRESHOLD: np.full(ITEM_SHAPE, self.threshold, dtype=np.float32),
            INCLUDE_CONFIDENCE: np.full(ITEM_SHAPE, self.include_confidence, dtype=np.bool_),
            INCLUDE_SPANS: np.full(ITEM_SHAPE, self.include_spans, dtype=np.bool_),
            MAX_LEN: np.full(ITEM_SHAPE, self.max_len, dtype=np.int32),
        }

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray | None]) -> Request:
        """Decode one request's input tensors of one item (absent optional inputs: missing or None).

        Raises ``ValueError`` naming the offending tensor, and no other exception.
        """
        (request,) = requests_from_arrays(arrays, items=1)
        return request


def requests_from_arrays(arrays: Mapping[str, np.ndarray | None], items: Optional[int] = None) -> list[Request]:
    """Decode one Triton request's input tensors: a Request per item, in order.

    The items are TEXT's batch dimension (``items`` given: exactly that many). Every input
    present needs one value per item (shape ``[N, 1]``), as Triton itself requires of a
    model with ``max_batch_size > 0``: an optional input is absent (its default for every
    item) or holds N values, never one value for all. Raises ``ValueError`` naming the
    offending tensor (and, in a request of several items, the item), and no other exception.
    """
    unknown = set(arrays) - {spec.name for spec in INPUTS}
    if unknown:
        raise ValueError(f"unknown input tensor(s): {sorted(map(repr, unknown))}")
    count = items
    columns: dict[str, list] = {}
    for spec in INPUTS:
        array = arrays.get(spec.name)
        if array is None:
            if not spec.optional:
                raise ValueError(f"input {spec.name} is required")
            continue
        if not isinstance(array, np.ndarray):
            raise ValueError(f"input {spec.name} must be a numpy array, got {type(array).__name__}")
        if count is None:  # TEXT, the first input and a required one, sets the batch size
            count = array.shape[0] if array.ndim else 1
            if count == 0:
                raise ValueError(f"input {spec.name} holds no item, got shape {array.shape}")
        if array.size != count or (array.ndim and array.shape[0] != count):
            if items == 1:
                raise ValueError(f"input {spec.name} must hold one element, got shape {array.shape}")
            raise ValueError(
                f"input {spec.name} has shape {array.shape}, but the request has {count} items (TEXT): "
                f"every input present needs one value per item, shape [{count}, 1]"
            )
        if spec.triton_dtype == "FP32" and array.dtype.kind not in "fiu":
            raise ValueError(f"{spec.name} must be FP32, got {array.dtype}")
        if spec.triton_dtype == "BOOL" and array.dtype.kind != "b":
            raise ValueError(f"{spec.name} must be BOOL, got {array.dtype}")
        if spec.triton_dtype == "INT32" and array.dtype.kind not in "iu":
            raise ValueError(f"{spec.name} must be INT32, got {array.dtype}")
        columns[spec.name] = array.reshape(-1).tolist()
    requests = []
    for item in range(count or 0):
        try:
            values = {}
            for spec in INPUTS:
                column = columns.get(spec.name)
                if column is None:
                    values[spec.name] = spec.default
                elif spec.triton_dtype == "BYTES":
                    values[spec.name] = _decode_utf8(spec.name, column[item])
                elif spec.triton_dtype == "FP32":
                    values[spec.name] = float(column[item])
                elif spec.triton_dtype == "INT32":
                    values[spec.name] = int(column[item])
                else:
                    values[spec.name] = bool(column[item])
            requests.append(
                Request(
                    text=values[TEXT],
                    schema=values[SCHEMA],
                    adapter=values[ADAPTER_ID],
                    threshold=values[THRESHOLD],
                    include_confidence=values[INCLUDE_CONFIDENCE],
                    include_spans=values[INCLUDE_SPANS],
                    max_len=values[MAX_LEN],
                )
            )
        except ValueError as err:
            raise ValueError(item_message(str(err), item, count)) from None
    return requests


def item_message(message: str, item: int, items: int) -> str:
    """An error message of one item, naming the item in a request of several."""
    return message if items == 1 else f"item {item} (0-based) of {items}: {message}"


def wire_threshold(value) -> float:
    """``value`` as the FP32 THRESHOLD tensor carries it.

    Any threshold is taken, as GLiNER2 2.1.0 takes it: a span (or choice) passes where
    ``score >= threshold`` and every score is in [0, 1], so above 1 nothing passes and below 0
    acts as 0; NaN and +inf pass nothing and -inf acts as 0 (GLiNER2 does not fail on them
    either). FP32 makes finite values beyond its range (1e39) infinite, here as on the wire.
    """
    try:
        number = float(value)
    except OverflowError:  # an int beyond float's range
        number = math.inf if value > 0 else -math.inf
    with np.errstate(over="ignore"):
        return float(np.float32(number))  # the wire carries FP32: the value the server sees


def routing_headers(request: "Request") -> dict[str, str]:
    """Request headers for adapter-affinity routing: the adapter id, none for the base model."""
    return {ADAPTER_HEADER: request.adapter} if request.adapter else {}


def schema_limit_problem(schema: str) -> Optional[str]:
    """Why ``schema`` is over the limits (characters, nesting, labels), or None.

    Malformed JSON and wrong types are not reported here: the server's schema parser
    says what is wrong with those.
    """
    if len(schema) > MAX_SCHEMA_CHARS:
        return f"SCHEMA has {len(schema)} characters, above the limit of {MAX_SCHEMA_CHARS}"
    return _schema_shape_problem(schema)


@functools.lru_cache(maxsize=256)  # clients and servers see the same few schemas again and again
def _schema_shape_problem(schema: str) -> Optional[str]:
    too_deep = f"SCHEMA is nested more than {MAX_SCHEMA_DEPTH} levels deep"
    try:
        data = json.loads(schema)
    except RecursionError:
        return too_deep
    except ValueError:  # not JSON; a deep one must not reach a parser that recurses
        return too_deep if _bracket_depth(schema) > MAX_SCHEMA_DEPTH else None
    depth, stack = 0, [(data, 1)]  # levels of arrays and objects, as _bracket_depth counts them
    while stack:
        value, level = stack.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is not None:
            depth = max(depth, level)
            stack.extend((child, level + 1) for child in children)
    if depth > MAX_SCHEMA_DEPTH:
        return too_deep
    labels = _schema_labels(data)
    if labels > MAX_SCHEMA_LABELS:
        return f"SCHEMA has {labels} labels, above the limit of {MAX_SCHEMA_LABELS}"
    return None


def _schema_labels(data: Any) -> int:
    """Labels of a GLiNER2 schema dict; parts of the wrong type count nothing."""

    def size(value: Any) -> int:
        return len(value) if isinstance(value, (list, dict)) else 0

    def objects(value: Any) -> list:  # the JSON objects in a list, or among a dict's values
        values = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        return [v for v in values if isinstance(v, dict)]

    if not isinstance(data, dict):
        return 0
    labels = size(data.get("entities")) + size(data.get("relations"))
    labels += sum(size(task.get("labels")) for task in objects(data.get("classifications")))
    for structure in objects(data.get("structures")):
        fields = structure.get("fields")
        labels += size(fields) + sum(size(field.get("choices")) for field in objects(fields))
    labels += sum(size(group.get("labels")) for group in objects(data.get("entity_attributes")))
    return labels


def _bracket_depth(text: str) -> int:
    """Deepest nesting of [ and { outside JSON strings, for text that is not valid JSON."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth = max(depth - 1, 0)
    return deepest


def result_array(result: Any) -> np.ndarray:
    """The RESULT tensor (``[1, 1]`` BYTES) for one GLiNER2 result."""
    return _bytes_array(json.dumps(result, ensure_ascii=False))


def results_array(results: list) -> np.ndarray:
    """The RESULT tensor (``[N, 1]`` BYTES) of a request of N items: one GLiNER2 result each."""
    array = np.empty((len(results), 1), dtype=np.object_)
    for item, result in enumerate(results):
        array[item, 0] = json.dumps(result, ensure_ascii=False).encode("utf-8")
    return array


def parse_result(array: np.ndarray) -> Any:
    """The GLiNER2 result carried by one response's RESULT tensor."""
    array = np.asarray(array)
    if array.size != 1:
        raise ValueError(f"output {RESULT} must hold one element, got shape {array.shape}")
    return json.loads(_decode_utf8(RESULT, array.reshape(-1)[0]))


def parse_results(array: np.ndarray) -> list:
    """The GLiNER2 results of a request of several items, in order (RESULT ``[N, 1]``)."""
    return [json.loads(_decode_utf8(RESULT, value)) for value in np.asarray(array).reshape(-1)]


def _bytes_array(value: str) -> np.ndarray:
    array = np.empty(ITEM_SHAPE, dtype=np.object_)
    array[0, 0] = value.encode("utf-8")
    return array


def _decode_utf8(name: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, (bytes, np.bytes_)):
        raise ValueError(f"{name} must be BYTES, got {type(value).__name__}")
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{name} is not valid UTF-8: {err}") from None
