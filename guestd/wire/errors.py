"""Typed protocol errors: a stable code, a human message, optional errno and details."""

from __future__ import annotations

import errno as _errno
from enum import StrEnum
from typing import Any

from guestd.wire.paths import path_to_wire


class ErrorCode(StrEnum):
    """Stable error codes. New codes may be added in a minor revision; clients map
    unknown codes to ``internal`` semantics but keep the original string."""

    BAD_REQUEST = "bad_request"  # malformed body, wrong types, missing fields
    PROTOCOL_ERROR = "protocol_error"  # broken framing or message order; connection closes
    UNKNOWN_OP = "unknown_op"
    UNSUPPORTED_VERSION = "unsupported_version"
    NOT_FOUND = "not_found"
    PERMISSION_DENIED = "permission_denied"
    EXISTS = "exists"
    IS_A_DIRECTORY = "is_a_directory"
    NOT_A_DIRECTORY = "not_a_directory"
    NOT_A_FILE = "not_a_file"  # a FIFO, socket or device where a regular file is expected
    NOT_EMPTY = "not_empty"
    NO_SPACE = "no_space"
    READ_ONLY = "read_only"
    IO_ERROR = "io_error"
    TOO_LARGE = "too_large"
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"
    LIMIT = "limit"
    UNAVAILABLE = "unavailable"  # the target exists but cannot serve (a dead kernel)
    STALE = "stale"  # a restore for a generation that is not newer than the current one
    CONFLICT = "conflict"  # an edit that does not apply to the file as it is (details.reason)
    INTERNAL = "internal"


# errno -> code; anything else becomes io_error with the errno attached.
_ERRNO_CODES: dict[int, ErrorCode] = {
    _errno.ENOENT: ErrorCode.NOT_FOUND,
    _errno.EACCES: ErrorCode.PERMISSION_DENIED,
    _errno.EPERM: ErrorCode.PERMISSION_DENIED,
    _errno.EEXIST: ErrorCode.EXISTS,
    _errno.EISDIR: ErrorCode.IS_A_DIRECTORY,
    _errno.ENOTDIR: ErrorCode.NOT_A_DIRECTORY,
    _errno.ENOTEMPTY: ErrorCode.NOT_EMPTY,
    _errno.ENOSPC: ErrorCode.NO_SPACE,
    _errno.EDQUOT: ErrorCode.NO_SPACE,
    _errno.EROFS: ErrorCode.READ_ONLY,
    _errno.EFBIG: ErrorCode.TOO_LARGE,
    _errno.ENAMETOOLONG: ErrorCode.BAD_REQUEST,
    _errno.ELOOP: ErrorCode.BAD_REQUEST,
    _errno.EINVAL: ErrorCode.BAD_REQUEST,
    _errno.ENOEXEC: ErrorCode.PERMISSION_DENIED,
}


class GuestdError(Exception):
    """An error that travels on the wire as an ``error`` frame."""

    def __init__(
        self,
        code: ErrorCode | str,
        message: str,
        *,
        errno: int | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        message = _sendable_text(message)
        super().__init__(message)
        self.code = code.value if isinstance(code, ErrorCode) else str(code)
        self.message = message
        self.errno = errno
        self.details = {k: _sendable_detail(v) for k, v in (details or {}).items()}

    def to_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.errno is not None:
            body["errno"] = self.errno
        if self.details:
            body["details"] = self.details
        return body

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> GuestdError:
        code = body.get("code")
        message = body.get("message")
        err = body.get("errno")
        details = body.get("details")
        return cls(
            code if isinstance(code, str) else ErrorCode.INTERNAL,
            message if isinstance(message, str) else "",
            errno=err if isinstance(err, int) else None,
            details=details if isinstance(details, dict) else None,
        )

    @classmethod
    def from_os_error(cls, exc: OSError, **details: Any) -> GuestdError:
        code = _ERRNO_CODES.get(exc.errno or 0, ErrorCode.IO_ERROR)
        where = f": {exc.filename}" if exc.filename is not None else ""
        return cls(
            code,
            f"{exc.strerror or exc}{where}",
            errno=exc.errno,
            details={k: v for k, v in details.items() if v is not None},
        )

    def __repr__(self) -> str:
        return f"GuestdError({self.code!r}, {self.message!r}, errno={self.errno!r})"

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"


def _sendable_text(text: str) -> str:
    """``text`` as valid UTF-8 for msgpack str: an OS name that is not UTF-8 (surrogate
    escapes, as in an OSError's filename) is shown as ``\\xff`` escapes instead of
    making the error frame unencodable."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a lone surrogate that is no escaped byte
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _sendable_detail(value: Any) -> Any:
    """A path in details (an os str naming bytes that are not UTF-8) travels in its bin form."""
    if not isinstance(value, str):
        return value
    try:
        return path_to_wire(value)
    except UnicodeEncodeError:  # a lone surrogate that is no escaped byte: not a name
        return _sendable_text(value)


def limit_error(name: str, value: int | float, message: str) -> GuestdError:
    """A breach of a configured limit; ``details.limit`` names it."""
    return GuestdError(ErrorCode.LIMIT, message, details={"limit": name, "value": value})


def too_large(name: str, value: int, message: str) -> GuestdError:
    return GuestdError(ErrorCode.TOO_LARGE, message, details={"limit": name, "value": value})
