"""Property-based fuzzing of the wire contract: decoding arbitrary input arrays and checking
arbitrary SCHEMA texts raise ``ValueError`` (the server's INVALID_ARG) and nothing else."""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from manylora.client import protocol
from manylora.client.protocol import MAX_SCHEMA_DEPTH, MAX_SCHEMA_LABELS, Request, schema_limit_problem

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = st.one_of(
    st.binary(max_size=40),
    st.text(max_size=40),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.complex_numbers(max_magnitude=1e6),
)
shapes = st.sampled_from([(), (0,), (1,), (1, 1), (2, 1), (1, 2), (1, 1, 1), (3,)])
dtypes = st.sampled_from([np.object_, np.float32, np.float64, np.int32, np.int64, np.uint8, np.bool_, np.complex64])


@st.composite
def arrays(draw):
    """A numpy array of any dtype and small shape, filled with whatever fits the dtype."""
    dtype, shape = draw(dtypes), draw(shapes)
    size = int(np.prod(shape)) if shape else 1
    values = draw(st.lists(scalars, min_size=size, max_size=size))
    array = np.empty(shape, dtype=np.object_)
    for index, value in zip(np.ndindex(shape), values):
        array[index] = value
    if dtype is np.object_:
        return array
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # out-of-range casts: whatever numpy makes of them
            return array.astype(dtype)
    except (TypeError, ValueError, OverflowError):
        return np.zeros(shape, dtype=dtype)


good_arrays = st.builds(
    lambda text, schema, adapter, threshold, confidence, spans: Request(
        text, schema, adapter, threshold, confidence, spans
    ).to_arrays(),
    st.text(max_size=30),
    st.sampled_from(['{"entities": ["person"]}', "{}", "not json", ""]),
    st.text(max_size=10),
    st.floats(0, 1),
    st.booleans(),
    st.booleans(),
)
input_names = st.sampled_from([spec.name for spec in protocol.INPUTS] + ["EXTRA", "text", ""])


@FUZZ
@given(
    base=good_arrays,
    changes=st.dictionaries(input_names, st.one_of(st.none(), arrays()), max_size=4),
    drop=st.sets(st.sampled_from([spec.name for spec in protocol.INPUTS])),
)
def test_from_arrays_raises_only_value_error(base, changes, drop):
    mapping = {name: array for name, array in {**base, **changes}.items() if name not in drop}
    try:
        request = Request.from_arrays(mapping)
    except ValueError:
        return
    assert Request.from_arrays(request.to_arrays()) == request  # what decodes, round-trips
    assert math.isfinite(request.threshold) and request.threshold == float(np.float32(request.threshold))


@FUZZ
@given(mapping=st.dictionaries(st.one_of(st.text(max_size=12), st.integers(), st.none()), st.none() | arrays()))
def test_from_arrays_of_any_mapping_raises_only_value_error(mapping):
    try:
        Request.from_arrays(mapping)
    except ValueError:
        pass


@FUZZ
@given(
    text=st.one_of(st.text(), st.binary(), st.none(), st.integers()),
    schema=st.one_of(st.text(), st.none(), st.dictionaries(st.text(), st.text())),
    adapter=st.one_of(st.text(), st.none(), st.binary()),
    threshold=st.one_of(st.floats(), st.integers(-5, 5), st.text(), st.none(), st.booleans()),
    flag=st.one_of(st.booleans(), st.integers(), st.none(), st.text()),
)
def test_request_construction_raises_only_value_error(text, schema, adapter, threshold, flag):
    try:
        Request(text, schema, adapter, threshold, flag, flag)
    except ValueError:
        pass


json_values = st.recursive(
    st.none() | st.booleans() | st.floats(allow_nan=False) | st.integers() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5),
    max_leaves=60,
)
schema_words = st.sampled_from(["entities", "relations", "classifications", "structures", "entity_attributes"])
schema_like = st.dictionaries(
    schema_words,
    st.one_of(
        st.lists(st.text(max_size=6), max_size=300),
        st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=300),
        st.lists(st.fixed_dictionaries({"task": st.text(max_size=4), "labels": st.lists(st.text(max_size=4))})),
        st.dictionaries(
            st.text(max_size=4),
            st.fixed_dictionaries({"fields": st.lists(st.fixed_dictionaries({"choices": st.lists(st.text())}))}),
        ),
        json_values,
    ),
)


def _depth(value) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


@FUZZ
@given(document=st.one_of(json_values, schema_like))
def test_schema_limits_of_any_json_document(document):
    schema = json.dumps(document)
    problem = schema_limit_problem(schema)
    if len(schema) > protocol.MAX_SCHEMA_CHARS:
        assert "characters" in problem
    elif _depth(document) > MAX_SCHEMA_DEPTH:
        assert "nested" in problem
    elif problem is not None:
        assert f"above the limit of {MAX_SCHEMA_LABELS}" in problem
    try:
        Request("text", schema)
    except ValueError as exc:
        assert str(exc) == problem
    else:
        assert problem is None


@FUZZ
@given(text=st.text(alphabet=st.sampled_from('[]{}"\\:,0a '), max_size=2000) | st.text(max_size=200))
@example("[" * 100_000)
@example('"' + "[" * 100 + '"')
@example("[" * (MAX_SCHEMA_DEPTH + 1) + "1" + "]" * (MAX_SCHEMA_DEPTH + 1))
def test_schema_limits_of_any_text_never_raise(text):
    problem = schema_limit_problem(text)
    assert problem is None or problem.startswith("SCHEMA ")
    try:
        json.loads(text)
    except RecursionError:
        assert problem is not None, "a text too deep for Python's own parser is refused"
    except ValueError:
        pass
