"""The Triton tensor contract of the ``gliner2`` model, defined once.

Both sides import this module: the client encodes requests with it and the server
(model.py / the engine's serving layer) decodes them with it, so tensor names,
dtypes and defaults cannot drift apart. It depends on numpy only, because the
Triton Python backend stub imports it.

Every request carries one item. The model has ``max_batch_size > 0``, so each
tensor of a request has shape ``[1, 1]``: the batch dimension, then the ``dims: [1]``
of config.pbtxt. BYTES tensors hold UTF-8 encoded ``bytes``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

MODEL_NAME = "gliner2"

TEXT = "TEXT"
SCHEMA = "SCHEMA"
ADAPTER_ID = "ADAPTER_ID"
THRESHOLD = "THRESHOLD"
INCLUDE_CONFIDENCE = "INCLUDE_CONFIDENCE"
INCLUDE_SPANS = "INCLUDE_SPANS"
RESULT = "RESULT"

BASE_ADAPTER = ""  # ADAPTER_ID value meaning "no adapter, base weights only"
DEFAULT_THRESHOLD = 0.5

ITEM_SHAPE = (1, 1)  # [batch of one request, dims [1]]


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

    def __post_init__(self):
        for name, value in (("text", self.text), ("schema", self.schema), ("adapter", self.adapter)):
            if not isinstance(value, str):
                raise ValueError(f"{name} must be a str, got {type(value).__name__}")
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
        threshold = float(threshold)
        if not (math.isfinite(threshold) and 0.0 <= threshold <= 1.0):
            raise ValueError(f"threshold must be within [0, 1], got {threshold}")
        # The wire carries FP32: hold exactly the value the server will see.
        object.__setattr__(self, "threshold", float(np.float32(threshold)))

    def to_arrays(self) -> dict:
        """All six input tensors, each shaped ``[1, 1]``.

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
        }

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray | None]) -> Request:
        """Decode one request's input tensors (absent optional inputs: missing or None).

        Raises ``ValueError`` naming the offending tensor.
        """
        unknown = set(arrays) - {spec.name for spec in INPUTS}
        if unknown:
            raise ValueError(f"unknown input tensor(s): {sorted(unknown)}")
        values = {}
        for spec in INPUTS:
            array = arrays.get(spec.name)
            if array is None:
                if not spec.optional:
                    raise ValueError(f"input {spec.name} is required")
                values[spec.name] = spec.default
                continue
            array = np.asarray(array)
            if array.size != 1:
                raise ValueError(f"input {spec.name} must hold one element, got shape {array.shape}")
            value = array.reshape(-1)[0]
            if spec.triton_dtype == "BYTES":
                values[spec.name] = _decode_utf8(spec.name, value)
            elif spec.triton_dtype == "FP32":
                values[spec.name] = float(value)
            else:
                values[spec.name] = bool(value)
        return cls(
            text=values[TEXT],
            schema=values[SCHEMA],
            adapter=values[ADAPTER_ID],
            threshold=values[THRESHOLD],
            include_confidence=values[INCLUDE_CONFIDENCE],
            include_spans=values[INCLUDE_SPANS],
        )


def result_array(result: Any) -> np.ndarray:
    """The RESULT tensor (``[1, 1]`` BYTES) for one GLiNER2 result."""
    return _bytes_array(json.dumps(result, ensure_ascii=False))


def parse_result(array: np.ndarray) -> Any:
    """The GLiNER2 result carried by one response's RESULT tensor."""
    array = np.asarray(array)
    if array.size != 1:
        raise ValueError(f"output {RESULT} must hold one element, got shape {array.shape}")
    return json.loads(_decode_utf8(RESULT, array.reshape(-1)[0]))


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
