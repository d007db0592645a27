"""Client errors: one type for a failed item, one for a schema the server can't be sent."""

from __future__ import annotations

from tritonclient.utils import InferenceServerException

# gRPC status names that differ from Triton's own error code names.
_GRPC_TO_TRITON = {"INVALID_ARGUMENT": "INVALID_ARG", "UNIMPLEMENTED": "UNSUPPORTED"}
# Triton's HTTP frontend answers an error with one of these statuses
# (http_server.cc, HttpCodeFromError); 400 also covers UNKNOWN, ALREADY_EXISTS and
# CANCELLED, which this model does not raise.
_HTTP_TO_TRITON = {
    "400": "INVALID_ARG",
    "404": "NOT_FOUND",
    "500": "INTERNAL",
    "501": "UNSUPPORTED",
    "503": "UNAVAILABLE",
}


class SchemaError(ValueError):
    """A schema that cannot travel to the server as GLiNER2 schema JSON.

    Raised before anything is sent, e.g. for builder features that
    ``Schema.to_dict()`` drops (regex validators) or a schema with no task.
    """


class ManyLoRAError(Exception):
    """One item failed.

    Attributes:
        message: The server's (or the client's) message.
        code: Triton error code name: ``INVALID_ARG``, ``NOT_FOUND`` (unknown
            adapter), ``UNAVAILABLE``, ``RESOURCE_EXHAUSTED``, ``INTERNAL``,
            ``DEADLINE_EXCEEDED``, ``UNKNOWN``, ...
        status: The raw status tritonclient reported (``"StatusCode.NOT_FOUND"``
            over gRPC, ``"404"`` over HTTP); None for errors raised in the client.
        index: Position of the item in its batch or input file; None for single calls.
    """

    def __init__(
        self,
        message: str,
        code: str = "UNKNOWN",
        status: str | None = None,
        index: int | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.code = code
        self.status = status
        self.index = index

    def __str__(self) -> str:
        where = f"item {self.index}: " if self.index is not None else ""
        return f"[{self.code}] {where}{self.message}"

    def __repr__(self) -> str:
        return f"ManyLoRAError({self.message!r}, code={self.code!r}, status={self.status!r}, index={self.index!r})"

    def to_json(self) -> dict:
        return {"code": self.code, "message": self.message}


def code_from_status(status: str | None) -> str:
    """Triton error code name for a tritonclient status string (gRPC or HTTP)."""
    if not status:
        return "UNKNOWN"
    if status.startswith("StatusCode."):
        name = status[len("StatusCode.") :]
        return _GRPC_TO_TRITON.get(name, name)
    return _HTTP_TO_TRITON.get(status, "UNKNOWN")


def error_from_exception(exc: BaseException, index: int | None = None) -> ManyLoRAError:
    """Wrap whatever a tritonclient call raised as a ManyLoRAError (cause kept)."""
    if isinstance(exc, ManyLoRAError):
        error = ManyLoRAError(exc.message, exc.code, exc.status, exc.index)
    elif isinstance(exc, InferenceServerException):
        status = exc.status()
        error = ManyLoRAError(str(exc.message()), code_from_status(status), status)
    elif isinstance(exc, TimeoutError):  # before OSError, its base class
        error = ManyLoRAError(f"request timed out: {exc}", "DEADLINE_EXCEEDED")
    elif isinstance(exc, OSError):  # connection refused/reset, DNS failure
        error = ManyLoRAError(f"cannot reach the server: {exc}", "UNAVAILABLE")
    else:
        error = ManyLoRAError(f"{type(exc).__name__}: {exc}", "UNKNOWN")
    if index is not None:
        error.index = index
    error.__cause__ = exc
    return error
