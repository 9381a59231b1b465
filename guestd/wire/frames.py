"""Sans-I/O framing: bytes in, frames out; frames in, bytes out.

A frame is a 12-byte header followed by a payload that is one msgpack map::

    0      2        3       4            8            12
    +------+--------+-------+------------+------------+----------------+
    | "GD" | ver=1  | kind  | length u32 | id u32     | payload ...    |
    +------+--------+-------+------------+------------+----------------+

All integers are big-endian. ``length`` counts payload bytes only. The header
carries ``id`` so that an oversize frame can be answered (and its body skipped)
without decoding anything the limit says we must not buffer.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import msgpack

MAGIC = b"GD"
FRAME_VERSION = 1
HEADER = struct.Struct(">2sBBII")
HEADER_SIZE = HEADER.size  # 12
MAX_ID = 0xFFFFFFFF

# Defaults that both sides may lower in the handshake, never raise past.
DEFAULT_MAX_FRAME = 4 * 1024 * 1024


class Kind(IntEnum):
    HELLO = 1  # handshake, both directions, id 0
    REQUEST = 2  # client -> server: {"op", "args"}
    RESPONSE = 3  # server -> client: final success of request ``id``
    ERROR = 4  # server -> client: final failure of request ``id`` (id 0: connection-level)
    EVENT = 5  # server -> client: non-final stream item of request ``id``
    INPUT = 6  # client -> server: data / eof / signal for in-flight request ``id``
    WINDOW = 7  # either way: grant more stream credit (bytes) for request ``id``
    CANCEL = 8  # client -> server: cancel in-flight request ``id``


KNOWN_KINDS = frozenset(int(k) for k in Kind)


class FramingError(Exception):
    """The byte stream is not a guestd frame stream; the connection cannot continue."""


@dataclass(frozen=True, slots=True)
class Frame:
    kind: int
    id: int
    payload: bytes


@dataclass(frozen=True, slots=True)
class OversizeFrame:
    """A frame whose declared length exceeds the limit; its body is being skipped."""

    kind: int
    id: int
    length: int


def pack_body(body: dict[str, Any]) -> bytes:
    return msgpack.packb(body, use_bin_type=True)  # type: ignore[no-any-return]


def encode_frame(kind: int, req_id: int, body: dict[str, Any]) -> bytes:
    payload = pack_body(body)
    return HEADER.pack(MAGIC, FRAME_VERSION, kind, len(payload), req_id) + payload


def encode_data_frame(kind: int, req_id: int, fields: dict[str, Any], data: bytes) -> tuple[bytes, bytes]:
    """Encode ``{**fields, "data": data}`` as (head, data) without copying ``data``.

    The two parts concatenated are byte-for-byte what :func:`encode_frame` produces
    for the same map (msgpack bin is a length header followed by the raw bytes), so
    bulk data goes to the socket straight from the buffer it was read into.
    """
    n = len(fields) + 1
    if n > 15:
        raise ValueError("too many fields for a data frame")
    body_head = bytearray([0x80 | n])
    for k, v in fields.items():
        body_head += msgpack.packb(k) + msgpack.packb(v, use_bin_type=True)
    body_head += b"\xa4data"
    dl = len(data)
    if dl < 256:
        body_head += bytes([0xC4, dl])
    elif dl < 65536:
        body_head += b"\xc5" + dl.to_bytes(2, "big")
    else:
        body_head += b"\xc6" + dl.to_bytes(4, "big")
    head = HEADER.pack(MAGIC, FRAME_VERSION, kind, len(body_head) + dl, req_id) + bytes(body_head)
    return head, data


def encode_raw(kind: int, req_id: int, payload: bytes) -> bytes:
    return HEADER.pack(MAGIC, FRAME_VERSION, kind, len(payload), req_id) + payload


class FrameDecoder:
    """Incremental decoder. ``feed`` bytes, then drain ``next_frame`` until None.

    Memory is bounded by ``max_frame`` plus one read: an oversize frame is
    reported once as :class:`OversizeFrame` and its body is discarded as it
    arrives, never buffered.
    """

    __slots__ = ("_buf", "_pos", "_skip", "max_frame")

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()
        self._pos = 0
        self._skip = 0

    @property
    def buffered(self) -> int:
        return len(self._buf) - self._pos

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if self._skip:
            n = min(self._skip, len(data))
            self._skip -= n
            data = data[n:]
            if not data:
                return
        if self._pos and self._pos == len(self._buf):
            self._buf.clear()
            self._pos = 0
        self._buf += data

    def reset(self) -> None:
        """Forget any partial frame (used when a serial peer reconnects)."""
        self._buf = bytearray()
        self._pos = 0
        self._skip = 0

    def next_frame(self) -> Frame | OversizeFrame | None:
        buf = self._buf
        pos = self._pos
        avail = len(buf) - pos
        if avail < HEADER_SIZE:
            self._compact()
            return None
        magic, version, kind, length, req_id = HEADER.unpack_from(buf, pos)
        if magic != MAGIC:
            raise FramingError(f"bad frame magic {bytes(magic)!r}")
        if version != FRAME_VERSION:
            raise FramingError(f"unsupported frame version {version}")
        if length > self.max_frame:
            body_here = min(length, avail - HEADER_SIZE)
            self._pos = pos + HEADER_SIZE + body_here
            self._skip = length - body_here
            self._compact()
            return OversizeFrame(kind, req_id, length)
        end = pos + HEADER_SIZE + length
        if len(buf) < end:
            self._compact()
            return None
        with memoryview(buf) as view:  # one copy, not two (slice, then bytes)
            payload = bytes(view[pos + HEADER_SIZE : end])
        self._pos = end
        return Frame(kind, req_id, payload)

    def _compact(self) -> None:
        # Drop consumed bytes once they dominate, so the buffer stays near one frame.
        if self._pos and self._pos >= len(self._buf) // 2:
            del self._buf[: self._pos]
            self._pos = 0

    def resync(self) -> int:
        """Drop bytes up to the next plausible header (serial links only). Returns bytes dropped."""
        idx = self._buf.find(MAGIC + bytes([FRAME_VERSION]), self._pos + 1)
        if idx < 0:
            # Keep a possible partial magic at the very end.
            keep = min(2, len(self._buf) - self._pos)
            dropped = len(self._buf) - self._pos - keep
            del self._buf[: len(self._buf) - keep]
            self._pos = 0
            return dropped
        dropped = idx - self._pos
        del self._buf[:idx]
        self._pos = 0
        return dropped
