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
# Long messages (a 60 KB unknown schema key echoed back) came back over gRPC as
# RESOURCE_EXHAUSTED "Stream removed" instead of their own code: every message is capped.
MAX_MESSAGE_CHARS = 1000


def cap_message(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``message`` cut to at most ``limit`` characters, saying how much was cut."""
    message = str(message)
    if len(message) <= limit:
        return message
    tail = f"... (cut; {len(message)} characters in all)"
    return message[: limit - len(tail)] + tail


class RequestError(Exception):
    """A per-request failure with the Triton error code it maps to."""

    def __init__(self, code: str, message: str):
        message = cap_message(message)
        super().__init__(message)
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return f"RequestError({self.code}, {self.message!r})"
