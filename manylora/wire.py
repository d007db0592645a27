"""What travels between the pipeline's Triton models: the rows of one front batch, packed,
and the GPU stage's compact answers (no pickle anywhere).

Front -> ``gliner2_core``: one BLS request per front batch, carrying all its rows. The
core's dynamic batcher packs several fronts' requests into one execute (``allow_ragged_batch``:
each request has its own row count and lengths), and the engine cuts the union by its token
budget. Per request, every tensor is [1, -1]:

    INPUT_IDS  INT32  token ids of every row, concatenated, unpadded
    ROW_TOKENS INT32  tokens per row
    WORD_POS   INT32  each text word's first token position (within its row), concatenated
    ROW_WORDS  INT32  words per row
    SCHEMA     BYTES  each row's SCHEMA text (the core caches the parsed schema part)
    ADAPTER_ID BYTES  each row's adapter id, empty = base
    T_MIN      FP32   each row's lowest decoding threshold, clamped into [0, 1] (post.core_threshold)

``gliner2_core`` -> front, per request: ``STATUS`` BYTES [1, rows] (empty, or
"CODE<TAB>message" for a row's own error) and ``COMPACT`` BYTES [1, 1]: ``post.pack_compact_rows``
of the rows (one ``pack_arrays`` buffer: per field of ``CompactRow.to_arrays()``, the rows' arrays
flattened and concatenated, with each row's shape beside them; ``_present`` marks failed rows).
"""

from __future__ import annotations

import json
import struct
from typing import Optional

import numpy as np

CORE_INPUTS = ("INPUT_IDS", "ROW_TOKENS", "WORD_POS", "ROW_WORDS", "SCHEMA", "ADAPTER_ID", "T_MIN")
CORE_OUTPUTS = ("STATUS", "COMPACT")
# dtypes a packed array may have: plain numbers only (a packed buffer is never unpickled)
_DTYPES = {np.dtype(t).str: np.dtype(t) for t in ("int8", "int16", "int32", "int64", "float16", "float32", "bool")}
_HEADER = struct.Struct("<I")
MAX_HEADER_BYTES = 1 << 16


def pack_arrays(arrays: dict[str, np.ndarray]) -> bytes:
    """One bytes object: a little-endian u32 header length, a JSON header (name -> dtype,
    shape), then every array's C-order bytes in header order."""
    header, parts = {}, []
    for name, array in arrays.items():
        array = np.ascontiguousarray(array)
        if array.dtype.str not in _DTYPES:
            raise TypeError(f"array {name!r} has dtype {array.dtype}, not a plain number type")
        header[name] = [array.dtype.str, list(array.shape)]
        parts.append(array.tobytes())
    head = json.dumps(header, separators=(",", ":")).encode()
    return _HEADER.pack(len(head)) + head + b"".join(parts)


def read_header(view: memoryview, limit: int = MAX_HEADER_BYTES, what: str = "packed arrays") -> tuple:
    """(the JSON header, the offset after it) of a buffer that starts with a u32 length and that
    header (``pack_arrays``, ``core_process.frame``); ValueError if malformed or above ``limit``."""
    if len(view) < _HEADER.size:
        raise ValueError(f"{what}: truncated header")
    (size,) = _HEADER.unpack_from(view)
    if size > limit or _HEADER.size + size > len(view):
        raise ValueError(f"{what}: bad header length")
    return json.loads(bytes(view[_HEADER.size : _HEADER.size + size])), _HEADER.size + size


def unpack_arrays(data: bytes) -> dict[str, np.ndarray]:
    """The arrays ``pack_arrays`` packed (read-only views of ``data``); ValueError if malformed."""
    view = memoryview(data)
    header, offset = read_header(view)
    out = {}
    for name, (dtype, shape) in header.items():
        if dtype not in _DTYPES or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"packed arrays: bad entry {name!r}")
        dt = _DTYPES[dtype]
        count = int(np.prod(shape, dtype=np.int64))
        end = offset + count * dt.itemsize
        if end > len(view):
            raise ValueError("packed arrays: truncated data")
        out[name] = np.frombuffer(view[offset:end], dtype=dt).reshape(shape)
        offset = end
    if offset != len(view):
        raise ValueError("packed arrays: trailing bytes")
    return out


def unpack_rows(data: bytes) -> list[Optional[dict[str, np.ndarray]]]:
    """The rows ``post.pack_compact_rows`` packed, as ``to_arrays()`` dicts in order (None for a
    failed row); ValueError if malformed."""
    packed = unpack_arrays(data)
    present = packed.get("_present")
    if present is None:
        raise ValueError("packed rows: no _present entry")
    names = [n for n in packed if n != "_present" and not n.endswith(".shape")]
    count = int(present.sum())
    per_name = {}
    for name in names:
        shapes = packed.get(f"{name}.shape")
        if shapes is None or shapes.shape[0] != count:
            raise ValueError(f"packed rows: bad shapes of {name!r}")
        sizes = np.prod(shapes, axis=1) if shapes.size else np.zeros(count, np.int64)
        ends = np.cumsum(sizes)
        if count and ends[-1] != packed[name].size:
            raise ValueError(f"packed rows: {name!r} does not hold its rows")
        flat = packed[name]
        per_name[name] = [flat[e - n : e].reshape(tuple(shape)) for e, n, shape in zip(ends, sizes, shapes.tolist())]
    out: list[Optional[dict[str, np.ndarray]]] = []
    k = 0
    for is_present in present.tolist():
        if is_present:
            out.append({name: per_name[name][k] for name in names})
            k += 1
        else:
            out.append(None)
    return out
