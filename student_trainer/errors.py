"""Errors a training job sees from the teacher, one class per gRPC status family.

Each message is the teacher's own, which says what to change.
"""

from __future__ import annotations

import grpc


class TeacherError(RuntimeError):
    """Base class; `code` is the gRPC status code (None for data-plane errors)."""

    code: grpc.StatusCode | None = None

    def __init__(self, message: str, code: grpc.StatusCode | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code


class InvalidRequest(TeacherError, ValueError):
    """INVALID_ARGUMENT: the batch or the join request is malformed."""


class Incompatible(TeacherError):
    """FAILED_PRECONDITION: this student cannot be served by this teacher as configured."""


class SessionNotFound(TeacherError):
    """NOT_FOUND: the session is unknown or has ended (expired lease, teacher restart)."""


class LimitExceeded(TeacherError):
    """RESOURCE_EXHAUSTED: a limit of the teacher (the message names its flag)."""


class TeacherUnavailable(TeacherError, ConnectionError):
    """UNAVAILABLE / DEADLINE_EXCEEDED: the teacher cannot be reached or is shutting down."""


class AuthenticationFailed(TeacherError):
    """UNAUTHENTICATED: a missing or wrong --auth-token."""


class PermissionRefused(TeacherError):
    """PERMISSION_DENIED: a job token used for another job, or a call without its session's secret."""


class TransferFailed(TeacherError):
    """The data plane failed: a receive timed out or the session group broke."""


class OutOfStep(TransferFailed):
    """A batch's header on the data plane named another batch (or other token ids) than the
    one its receives were posted for: nothing received was used. The session is given up
    like a broken group: joined again and its undelivered batches sent again, or failed."""


class BatchFailed(TeacherError):
    """The teacher accepted the batch but could not compute or send it (its reason is in the
    message). Final for that batch alone: it is not sent again, and the session goes on."""


class BatchNotServed(TeacherError):
    """One batch ended every session it was sent to, up to the client's max_resubmits: the message
    says why each ended. The client goes on with other batches."""


_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.FAILED_PRECONDITION: Incompatible,
    grpc.StatusCode.NOT_FOUND: SessionNotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: LimitExceeded,
    grpc.StatusCode.UNAVAILABLE: TeacherUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: TeacherUnavailable,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationFailed,
    grpc.StatusCode.PERMISSION_DENIED: PermissionRefused,
}


def from_status(code: grpc.StatusCode, details: str, what: str) -> TeacherError:
    cls = _BY_CODE.get(code, TeacherError)
    return cls(f"{what}: {details} [{code.name}]", code)


def from_rpc_error(error: grpc.RpcError, what: str) -> TeacherError:
    return from_status(error.code(), error.details(), what)


# The teacher went away, or forgot this session (a restarted teacher knows none): joining
# again may work. Everything else is an answer to what was asked, and asking again the
# same way would get the same answer.
_GONE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND})


def teacher_gone(error: BaseException) -> bool:
    """True when `error` means the teacher (or this session on it) is gone, not that it refused.

    UNAVAILABLE (unreachable, restarting, shutting down), NOT_FOUND (the session is unknown:
    a restarted teacher, an expired lease) and a broken data plane qualify; INVALID_ARGUMENT,
    FAILED_PRECONDITION, RESOURCE_EXHAUSTED, UNAUTHENTICATED and PERMISSION_DENIED do not.
    """
    if isinstance(error, TransferFailed):
        return True
    return isinstance(error, TeacherError) and error.code in _GONE_CODES
