"""The one per-request error type of every stage, with the Triton error code it maps to.

Codes are ``pb_utils.TritonError.<CODE>`` names. Triton has no RESOURCE_EXHAUSTED: running
out of memory is UNAVAILABLE (retry later, or smaller).
"""

from __future__ import annotations

INVALID_ARG = "INVALID_ARG"
NOT_FOUND = "NOT_FOUND"
UNAVAILABLE = "UNAVAILABLE"
INTERNAL = "INTERNAL"
CODES = (INVALID_ARG, NOT_FOUND, UNAVAILABLE, INTERNAL)


class RequestError(Exception):
    """A per-request failure with the Triton error code it maps to."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return f"RequestError({self.code}, {self.message!r})"
