"""Typed errors raised inside the server; the gRPC edge turns each into its status code.

Each carries a message that says what the caller should change.
"""

from __future__ import annotations

import grpc

# The longest message a status carries, in bytes of UTF-8. grpc sends it percent-encoded in the
# trailers (up to 3 bytes each) and a client refuses trailers over 16 KiB: it would see
# RESOURCE_EXHAUSTED ("received metadata size exceeds hard limit") instead of the code and the
# message, and take it for a full teacher.
MAX_MESSAGE_BYTES = 4000


def bounded_message(text: str) -> str:
    """`text`, cut to MAX_MESSAGE_BYTES (saying how much was cut): a message that quotes what a
    caller sent (its shape, its layers) is as long as the caller made it."""
    encoded = text.encode()
    if len(encoded) <= MAX_MESSAGE_BYTES:
        return text
    kept = MAX_MESSAGE_BYTES - 100
    return f"{encoded[:kept].decode(errors='ignore')}... ({len(encoded) - kept} more bytes)"


class ServiceError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __str__(self) -> str:
        return bounded_message(super().__str__())


class InvalidArgument(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class ResourceExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


class Unauthenticated(ServiceError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(ServiceError):
    code = grpc.StatusCode.PERMISSION_DENIED
