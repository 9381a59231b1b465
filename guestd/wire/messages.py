"""Message bodies on top of frames: decode a payload into a validated map.

Shared by the daemon and the client. Nothing here does I/O.
"""

from __future__ import annotations

from typing import Any

import msgpack

from guestd.wire.errors import ErrorCode, GuestdError


def decode_body(payload: bytes) -> dict[str, Any]:
    """Decode one frame payload; anything but a msgpack map with str keys is bad_request."""
    try:
        body = msgpack.unpackb(payload, raw=False, use_list=True, strict_map_key=True)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise GuestdError(ErrorCode.BAD_REQUEST, f"payload is not valid msgpack: {exc}") from None
    except RecursionError:
        raise GuestdError(ErrorCode.BAD_REQUEST, "payload nests too deeply") from None
    if not isinstance(body, dict):
        raise GuestdError(ErrorCode.BAD_REQUEST, f"payload must be a msgpack map, got {type(body).__name__}")
    for key in body:
        if not isinstance(key, str):
            raise GuestdError(ErrorCode.BAD_REQUEST, "payload map keys must be strings")
    return body


def request_body(op: str, args: dict[str, Any] | None) -> dict[str, Any]:
    return {"op": op, "args": args or {}}


def split_request(body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    op = body.get("op")
    if not isinstance(op, str):
        raise GuestdError(ErrorCode.BAD_REQUEST, "request needs a string 'op'", details={"field": "op"})
    args = body.get("args", {})
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise GuestdError(ErrorCode.BAD_REQUEST, "request 'args' must be a map", details={"field": "args"})
    return op, args
