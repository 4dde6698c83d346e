"""Errors: every failed call raises a KvcmError subclass named after its gRPC status code.

    try:
        client.release(ns, pin_id)
    except kvcm.NotFound:
        ...                     # e.g. the manager restarted and forgot the pin

`code` is the grpc.StatusCode and `message` the manager's text, which names the offending
field for INVALID_ARGUMENT. InvalidArgument is also a ValueError (bad options raise it too).
"""

from __future__ import annotations

from typing import Dict, Optional, Type

import grpc


class KvcmError(Exception):
    """A kvcm call failed with `code` (grpc.StatusCode) and `message`."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, code: Optional[grpc.StatusCode] = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


class Cancelled(KvcmError):
    code = grpc.StatusCode.CANCELLED


class Unknown(KvcmError):
    code = grpc.StatusCode.UNKNOWN


class InvalidArgument(KvcmError, ValueError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class DeadlineExceeded(KvcmError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFound(KvcmError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(KvcmError):
    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(KvcmError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(KvcmError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(KvcmError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(KvcmError):
    code = grpc.StatusCode.ABORTED


class OutOfRange(KvcmError):
    code = grpc.StatusCode.OUT_OF_RANGE


class Unimplemented(KvcmError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Internal(KvcmError):
    code = grpc.StatusCode.INTERNAL


class Unavailable(KvcmError):
    code = grpc.StatusCode.UNAVAILABLE


class DataLoss(KvcmError):
    code = grpc.StatusCode.DATA_LOSS


class Unauthenticated(KvcmError):
    code = grpc.StatusCode.UNAUTHENTICATED


_BY_CODE: Dict[grpc.StatusCode, Type[KvcmError]] = {
    cls.code: cls
    for cls in (
        Cancelled,
        Unknown,
        InvalidArgument,
        DeadlineExceeded,
        NotFound,
        AlreadyExists,
        PermissionDenied,
        ResourceExhausted,
        FailedPrecondition,
        Aborted,
        OutOfRange,
        Unimplemented,
        Internal,
        Unavailable,
        DataLoss,
        Unauthenticated,
    )
}


def error_for(code: grpc.StatusCode, message: str) -> KvcmError:
    """The KvcmError subclass of `code` carrying `message`."""
    return _BY_CODE.get(code, KvcmError)(message, code)
