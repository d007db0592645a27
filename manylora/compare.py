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
        differences = [
            d for i, (g, e) in enumerate(zip(got, expected)) for d in result_differences(g, e, atol, f"{path}[{i}]")
        ]
        return [] if differences and _ties_reordered(got, expected, atol) else differences
    return [] if got == expected else [f"{path}: {got!r} != {expected!r}"]


def _ties_reordered(got: list, expected: list, atol: float) -> bool:
    """Whether ``got`` is ``expected`` with items of equal confidence (within ``atol``) in another
    order. GLiNER2 lists spans by confidence, so two whose confidences differ by less than the
    scores' tolerance may come in either order when the float rounding differs (another batch
    shape, another kernel): the same tolerance the scores have, applied to their order. Items
    are matched within each run of consecutive expected items whose confidences are that close."""
    if not all(isinstance(e, dict) and isinstance(e.get("confidence"), (int, float)) for e in expected):
        return False
    start = 0
    while start < len(expected):
        end = start + 1
        while end < len(expected) and abs(expected[end]["confidence"] - expected[end - 1]["confidence"]) <= atol:
            end += 1
        pool = list(got[start:end])
        for item in expected[start:end]:
            match = next((k for k, g in enumerate(pool) if not result_differences(g, item, atol)), None)
            if match is None:
                return False
            pool.pop(match)
        start = end
    return True
