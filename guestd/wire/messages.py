"""Message bodies on top of frames: decode a payload into a validated map.

Shared by the daemon and the client. Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgpack

from guestd.wire.errors import ErrorCode, GuestdError, too_large


def decode_body(payload: bytes | memoryview) -> dict[str, Any]:
    """Decode one frame payload; anything but a msgpack map with str keys is bad_request.

    A str that is not valid UTF-8 is bad_request with ``details.reason`` = ``invalid_utf8`` and
    ``details.field`` naming where it is (PROTOCOL.md 2.3)."""
    try:
        body = msgpack.unpackb(payload, raw=False, use_list=True, strict_map_key=True)
    except UnicodeDecodeError:
        raise invalid_utf8(payload) from None
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


def invalid_utf8(payload: bytes | memoryview) -> GuestdError:
    """The bad_request for a payload holding a str that is not UTF-8, naming the first such
    value (or, for a key, the map that holds it) the way other errors name fields:
    ``args.files[0].path``. One more decode with the bad bytes escaped, then one walk in order
    of at most UTF8_WALK_BUDGET keys and values, in memory bounded by the nesting depth."""
    details: dict[str, Any] = {"reason": "invalid_utf8"}
    try:
        body = msgpack.unpackb(payload, raw=False, use_list=True, strict_map_key=True, unicode_errors="surrogateescape")
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, RecursionError):
        body = None  # broken in another way too: where the bad str is cannot be said
    where = _first_escaped(body)
    if not where:
        return GuestdError(ErrorCode.BAD_REQUEST, "a str is not valid UTF-8", details=details)
    details["field"] = field_name(where)
    return GuestdError(
        ErrorCode.BAD_REQUEST, f"field {details['field']!r} holds a str that is not valid UTF-8", details=details
    )


def field_name(path: list[str | int]) -> str:
    """``["args", "files", 0, "path"]`` -> ``args.files[0].path``."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def _escaped(text: str) -> bool:
    # Only surrogateescape puts lone surrogates into a decoded str: strict UTF-8 refuses them.
    return any("\udc80" <= ch <= "\udcff" for ch in text)


# The walk looks at this many keys and values at most (a few ms on the event loop); a bad str
# past them is reported without a field. A real request is far smaller.
UTF8_WALK_BUDGET = 100_000

# A path in the payload as a linked list (parent, part), and the walk as a stack of
# iterators: memory is the depth, not the width (a list of 4 million nils nested 1,000 deep
# cost 16 bytes x width x depth with copied paths and every element pushed at once).
_Where = tuple["_Where", "str | int"] | None


def _children(value: dict[Any, Any] | list[Any]) -> Iterator[tuple[Any, Any, bool]]:
    """(part, value, whether it is a key) in order: a map's key before its value."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield key, key, True
            yield key, item, False
    else:
        yield from ((i, item, False) for i, item in enumerate(value))


def _first_escaped(root: Any) -> list[str | int]:
    """Where the first escaped str is, keys and values in order; [] when nowhere (or the root)
    or not within UTF8_WALK_BUDGET steps. A bad key is reported as the map holding it."""
    if not isinstance(root, dict | list):
        return []
    stack: list[tuple[Iterator[tuple[Any, Any, bool]], _Where]] = [(_children(root), None)]
    for _ in range(UTF8_WALK_BUDGET):
        if not stack:
            break
        items, where = stack[-1]
        step = next(items, None)
        if step is None:
            stack.pop()
            continue
        part, value, is_key = step
        if isinstance(value, str):
            if _escaped(value):
                return _unlink(where if is_key else (where, part))
        elif not is_key and isinstance(value, dict | list):
            stack.append((_children(value), (where, part)))
    return []


def _unlink(where: _Where) -> list[str | int]:
    parts: list[str | int] = []
    while where is not None:
        where, part = where
        parts.append(part)
    return parts[::-1]


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


# What one decoded object costs at least in CPython beyond its content bytes (an empty dict is
# 64 bytes, a float 24, a 2-character str 51, plus the 8-byte slot its container keeps for it).
# msgpack packs most of these into one byte: a 4 MiB frame of empty maps decodes to ~293 MiB.
OBJECT_COST = 64
MAX_DEPTH = 64  # nesting beyond this is refused: deep values break json.dumps and recursive walks

# Bytes that follow a msgpack type byte of fixed size (nil, bools, numbers, fixext).
_FIXED_TAIL = {
    0xC0: 0, 0xC2: 0, 0xC3: 0, 0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8,
    0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8, 0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17,
}  # fmt: skip
# Type bytes whose content length follows in 1, 2 or 4 bytes (str, bin, ext; ext adds its type byte).
_SIZED = {0xD9: 1, 0xDA: 2, 0xDB: 4, 0xC4: 1, 0xC5: 2, 0xC6: 4, 0xC7: 1, 0xC8: 2, 0xC9: 4}
# Array and map headers with a 2- or 4-byte count, and how many objects each counted item is.
_COUNTED = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}


# The longest payload bounded_by_length scans: it looks at every byte (~1 us per KiB), where the
# walk steps over a str or bin whole, so a reply carrying data (file.read's 256 KiB: 370 us
# scanned, 2 us walked) is walked.
LENGTH_BOUND_MAX = 4096
# Every byte except those that can open a map or an array (fixmap, fixarray, map/array 16 and 32).
_NOT_CONTAINER_HEADERS = bytes(b for b in range(256) if not (0x80 <= b <= 0x9F or 0xDC <= b <= 0xDF))


def bounded_by_length(payload: bytes | memoryview, limit: int) -> bool:
    """True when ``payload`` is too short to decode to more than ``limit`` bytes or to nest
    beyond ``MAX_DEPTH``, so :func:`decoded_size`'s walk (~0.1 us per object, in Python) can be
    skipped for a frame whose size nobody needs (a reply). Every object takes a byte of the
    frame and every content byte is a byte of it, so decoding costs at most ``OBJECT_COST``
    per byte, plus the list an array16/32 header sizes from its count (at most the payload's
    length); every level of nesting needs a map or array header, and each header is one of
    the bytes counted here (bytes inside strings or numbers count too: a looser bound, or the
    walk). Sound for any payload, valid msgpack or not; False past ``LENGTH_BOUND_MAX`` bytes."""
    n = len(payload)
    if n > LENGTH_BOUND_MAX or n * OBJECT_COST > limit:
        return False
    headers = bytes(payload).translate(None, _NOT_CONTAINER_HEADERS)
    if len(headers) > MAX_DEPTH:
        return False
    # An array16/32 header may size its list up to the payload's length before any item.
    return n * (OBJECT_COST + 8 * (headers.count(0xDC) + headers.count(0xDD))) <= limit


def decoded_size(payload: bytes | memoryview, limit: int) -> int:
    """An upper-bound estimate of the memory decoding ``payload`` takes (``OBJECT_COST`` per object,
    the bytes of every str, bin and ext, and the slots of each list sized from an array16/32
    header's count), measured by walking its headers without building
    anything; raises ``too_large`` as soon as it passes ``limit`` (so the walk costs at most
    ``limit / OBJECT_COST`` steps, ~0.1 us each), ``bad_request`` when it nests beyond ``MAX_DEPTH``.

    A payload that is not valid msgpack is measured as far as it goes: :func:`decode_body` then
    refuses it."""
    n = len(payload)
    i = 0
    cost = 0
    left = 1  # objects still to read in the innermost open container (the top level: one)
    stack: list[int] = []  # the same count for each enclosing container
    while True:
        while not left and stack:
            left = stack.pop()
        if not left or i >= n:
            break
        left -= 1
        b = payload[i]
        i += 1
        cost += OBJECT_COST
        if cost > limit:
            raise too_large("decoded_size", cost, f"a frame that decodes to more than {limit} bytes")
        if b < 0x80 or b >= 0xE0:
            continue  # fixint
        if b < 0xA0:
            items = (b & 0x0F) * (2 if b < 0x90 else 1)  # fixmap, fixarray
        elif b < 0xC0:
            size = b & 0x1F  # fixstr
            cost += min(size, n - i)  # a str cut short is refused, not built
            i += size
            continue
        elif b in _FIXED_TAIL:
            i += _FIXED_TAIL[b]
            continue
        elif b in _SIZED:
            width = _SIZED[b]
            size = int.from_bytes(payload[i : i + width], "big")
            i += width + (1 if b >= 0xC7 and b <= 0xC9 else 0)
            cost += min(size, max(0, n - i))  # only what the payload holds: a claim past its end is refused, not built
            i += size
            continue
        elif b in _COUNTED:
            width, per = _COUNTED[b]
            items = int.from_bytes(payload[i : i + width], "big") * per
            i += width
            if per == 1:
                # msgpack sizes a list from its header before reading a single item (up to
                # max_array_len, which decode_body leaves at the payload's length): a truncated
                # payload of nested array32 headers held MBs for its few KiB (a helper's review).
                cost += 8 * min(items, n)
        else:
            break  # 0xC1 is never used: let the decoder refuse the payload
        if items:
            stack.append(left)
            left = items
            if len(stack) > MAX_DEPTH:
                raise GuestdError(
                    ErrorCode.BAD_REQUEST, f"payload nests deeper than {MAX_DEPTH}", details={"limit": "depth"}
                )
    if cost > limit:  # the last object's content or list slots, added after its check above
        raise too_large("decoded_size", cost, f"a frame that decodes to more than {limit} bytes")
    return cost
