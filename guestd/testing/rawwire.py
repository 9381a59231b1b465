"""A blocking, deliberately dumb peer for speaking raw frames to a real guestd (and for playing a
fake guest to a real client)."""

from __future__ import annotations

import socket
from typing import Any

from guestd.wire.frames import HEADER, HEADER_SIZE, MAGIC, Frame, FrameDecoder, Kind, encode_frame
from guestd.wire.messages import decode_body


class RawPeer:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def send(self, kind: int, req_id: int, body: dict[str, Any]) -> None:
        self.sock.sendall(encode_frame(kind, req_id, body))

    def send_bytes(self, data: bytes) -> None:
        self.sock.sendall(data)

    def hello(self, versions: list[int] | None = None, **extra: Any) -> dict[str, Any]:
        self.send(Kind.HELLO, 0, {"versions": versions or [1], "client": "rawpeer", **extra})
        kind, _, body = self.recv()
        assert kind == Kind.HELLO, body
        return body

    def request(self, req_id: int, op: str, args: dict[str, Any] | None = None) -> None:
        self.send(Kind.REQUEST, req_id, {"op": op, "args": args or {}})

    def _read(self, n: int) -> bytes:
        while len(self.buf) < n:
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise EOFError("guestd closed the connection")
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def recv(self) -> tuple[int, int, dict[str, Any]]:
        magic, version, kind, length, req_id = HEADER.unpack(self._read(HEADER_SIZE))
        assert magic == MAGIC and version == 1
        return kind, req_id, decode_body(self._read(length))

    def recv_final(self, req_id: int) -> tuple[int, dict[str, Any]]:
        """Skip events and other ids until the final frame of ``req_id``."""
        while True:
            kind, rid, body = self.recv()
            if rid == req_id and kind in (Kind.RESPONSE, Kind.ERROR):
                return kind, body

    def recv_finals(self, req_ids: list[int]) -> dict[int, tuple[int, dict[str, Any]]]:
        """The final frames of all ``req_ids``, in whatever order they come (requests that run
        in parallel answer in any order; ``recv_final`` one by one would skip the others')."""
        wanted = set(req_ids)
        finals: dict[int, tuple[int, dict[str, Any]]] = {}
        while len(finals) < len(wanted):
            kind, rid, body = self.recv()
            if rid in wanted and kind in (Kind.RESPONSE, Kind.ERROR):
                finals[rid] = (kind, body)
        return finals

    def closed(self, timeout: float = 5.0) -> bool:
        """True when guestd closes the connection (after sending whatever it sends)."""
        self.sock.settimeout(timeout)
        try:
            while True:
                if not self.sock.recv(65536):
                    return True
        except TimeoutError:
            return False
        except ConnectionResetError:
            return True


class FrameCounter:
    """Reads every frame, checks its size against ``max_frame`` and its data against the
    credit it granted (strictly), and grants the credit back unless told not to."""

    def __init__(self, peer: RawPeer, max_frame: int, window: int, grant: bool = True) -> None:
        self.peer = peer
        self.max_frame = max_frame
        self.window = window
        self.grant = grant
        self.credit: dict[int, int] = {}
        self.largest = 0
        self.violations: list[str] = []

    def frame(self) -> tuple[int, int, dict[str, Any]]:
        _, _, kind, length, rid = HEADER.unpack(self.peer._read(HEADER_SIZE))
        self.largest = max(self.largest, length)
        if length > self.max_frame:
            self.violations.append(f"frame of {length} bytes > max_frame {self.max_frame}")
        body = decode_body(self.peer._read(length))
        data = body.get("data")
        if kind == Kind.EVENT and isinstance(data, bytes) and data:
            left = self.credit.setdefault(rid, self.window) - len(data)
            self.credit[rid] = left
            if left < 0:
                self.violations.append(f"id {rid}: {-left} bytes beyond the credit")
            if self.grant:
                self.credit[rid] += len(data)
                self.peer.send(Kind.WINDOW, rid, {"bytes": len(data)})
        return kind, rid, body

    def until_final(self, req_id: int) -> tuple[int, dict[str, Any], int]:
        """(final kind, final body, data bytes received) of ``req_id``."""
        got = 0
        while True:
            kind, rid, body = self.frame()
            if rid != req_id:
                continue
            if kind == Kind.EVENT and isinstance(body.get("data"), bytes):
                got += len(body["data"])
            if kind in (Kind.RESPONSE, Kind.ERROR):
                return kind, body, got


# What a fake guest answers to a client's hello.
FAKE_GUEST_HELLO: dict[str, Any] = {
    "version": 1,
    "server": "evil/1",
    "capabilities": [],
    "ops": [],
    "limits": {"max_frame": 4 * 1024 * 1024},
    "stream_window": 4 * 1024 * 1024,
    "max_frame": 4 * 1024 * 1024,
    "boot_id": "x",
    "session": "y",
}


class SinkTransport:
    """A transport for a server ``Connection`` driven in-process: it keeps what the connection
    writes in ``out`` and whether it was closed."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.closed = False

    def write(self, data: bytes) -> None:
        self.out += data

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def get_write_buffer_size(self) -> int:
        return 0

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def finals(self) -> dict[int, tuple[int, dict[str, Any]]]:
        """The final frames written so far: request id -> (kind, decoded body)."""
        decoder = FrameDecoder(1 << 30)
        decoder.feed(bytes(self.out))
        finals = {}
        while (frame := decoder.next_frame()) is not None:
            if isinstance(frame, Frame) and frame.kind in (Kind.RESPONSE, Kind.ERROR):
                finals[frame.id] = (frame.kind, decode_body(frame.payload))
        return finals
