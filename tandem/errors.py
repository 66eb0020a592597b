"""Typed errors of the domain; one interceptor (tandem.grpc_server) maps them to gRPC codes.

Domain code raises these and never imports grpc: the mapping lives in one place.
"""


class TandemError(Exception):
    """Base class; `code` names a grpc.StatusCode member."""

    code = "INTERNAL"


class InvalidArgument(TandemError):
    """The request is malformed; the message names the field."""

    code = "INVALID_ARGUMENT"


class ResourceExhausted(TandemError):
    """Overload or capacity: KV pages, sequence slots, queue length. `retry_after_ms`: when a
    retry may succeed (a full queue drains), sent as gRPC's retry pushback; None: no hint."""

    code = "RESOURCE_EXHAUSTED"

    def __init__(self, message: str, retry_after_ms: int | None = None):
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class NotFound(TandemError):
    """An unknown sequence id or other named object."""

    code = "NOT_FOUND"


class FailedPrecondition(TandemError):
    """The operation does not fit the current state (a sequence id already in use)."""

    code = "FAILED_PRECONDITION"


class Unavailable(TandemError):
    """A model service the request depends on is down."""

    code = "UNAVAILABLE"
