"""A malicious guest for the host side's tests: a fake guestd on a Unix socket, scripted per test.

It answers the client's hello (``FAKE_GUEST_HELLO`` unless told otherwise) and hands each
connection, as a :class:`~guestd.testing.rawwire.RawPeer`, to the test's script. Every
connection gets the script (guestctl connects once per run; a test may run it several
times). :func:`answers` builds a script from a table of replies per op, for commands that
make several requests (``cp`` stats, then downloads; ``restore`` asks ``info`` first).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Mapping
from typing import Any

from guestd.testing.rawwire import FAKE_GUEST_HELLO, RawPeer
from guestd.wire.frames import Kind

Script = Callable[[RawPeer], None]
# An op's answer: a reply body, or a function that does whatever it likes with the request.
Answer = dict[str, Any] | Callable[[RawPeer, int, dict[str, Any]], None]


def next_request(peer: RawPeer) -> tuple[int, str, dict[str, Any]]:
    """(id, op, args) of the client's next request, skipping its windows, inputs and cancels."""
    while True:
        kind, rid, body = peer.recv()
        if kind == Kind.REQUEST:
            return rid, str(body.get("op")), dict(body.get("args") or {})


def answers(table: Mapping[str, Answer]) -> Script:
    """A script that answers each request from ``table`` (ops not in it: ``unknown_op``)."""

    def script(peer: RawPeer) -> None:
        while True:
            rid, op, args = next_request(peer)
            answer = table.get(op)
            if answer is None:
                peer.send(Kind.ERROR, rid, {"code": "unknown_op", "message": f"fake guest: no {op}"})
            elif callable(answer):
                answer(peer, rid, args)
            else:
                peer.send(Kind.RESPONSE, rid, answer)

    return script


class FakeGuest:
    """``FakeGuest(path, script).start()``; ``address`` to connect to; ``close()`` when done."""

    def __init__(self, path: str, script: Script, hello: dict[str, Any] | None = None) -> None:
        self.path = path
        self.address = f"unix:{path}"
        self.script = script
        self.hello = hello or FAKE_GUEST_HELLO
        self.connections = 0
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conns: list[socket.socket] = []
        self._closed = False

    def start(self) -> FakeGuest:
        self._server.bind(self.path)
        self._server.listen(16)
        threading.Thread(target=self._accept, name="fake-guest", daemon=True).start()
        return self

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            self._conns.append(conn)
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        peer = RawPeer(conn)
        try:
            peer.recv()  # the client's hello
            peer.send(Kind.HELLO, 0, self.hello)
            self.script(peer)
        except (OSError, EOFError):
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self._closed = True
        self._server.close()
        for conn in self._conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()
