"""Structural comparison of GLiNER2 results: same structure and labels, scores within a tolerance.

Used by the fidelity tests and by the benchmark harness to check answers against GLiNER2.
"""

from __future__ import annotations

import math
from typing import Any


def result_differences(got: Any, expected: Any, atol: float = 1e-4, path: str = "$") -> list[str]:
    """Every place where ``got`` and ``expected`` differ (empty list = equal)."""
    if isinstance(expected, bool) or expected is None or isinstance(expected, str):
        return [] if got == expected and type(got) is type(expected) else [f"{path}: {got!r} != {expected!r}"]
    if isinstance(expected, (int, float)):
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            return [f"{path}: {got!r} is not a number like {expected!r}"]
        if math.isclose(float(got), float(expected), rel_tol=0.0, abs_tol=atol):
            return []
        return [f"{path}: {got!r} != {expected!r} (tolerance {atol})"]
    if isinstance(expected, dict):
        if not isinstance(got, dict):
            return [f"{path}: {type(got).__name__} is not a dict"]
        if list(got) != list(expected):
            return [f"{path}: keys {list(got)} != {list(expected)}"]
        return [d for k in expected for d in result_differences(got[k], expected[k], atol, f"{path}.{k}")]
    if isinstance(expected, (list, tuple)):
        if not isinstance(got, (list, tuple)):
            return [f"{path}: {type(got).__name__} is not a list"]
        if len(got) != len(expected):
            return [f"{path}: {len(got)} items != {len(expected)}: {got!r} vs {expected!r}"]
        return [
            d for i, (g, e) in enumerate(zip(got, expected)) for d in result_differences(g, e, atol, f"{path}[{i}]")
        ]
    return [] if got == expected else [f"{path}: {got!r} != {expected!r}"]
