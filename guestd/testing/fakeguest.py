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


# ----------------------------------------------------------------------------- reply builders
# Well-formed replies a test starts from and then spoils.


def exec_reply(stdout: bytes = b"", stderr: bytes = b"", exit_code: int = 0) -> dict[str, Any]:
    return {
        "exit_code": exit_code,
        "signal": None,
        "timed_out": None,
        "stdout": stdout,
        "stderr": stderr,
        "stdout_bytes": len(stdout),
        "stderr_bytes": len(stderr),
        "stdout_dropped": 0,
        "stderr_dropped": 0,
        "duration_s": 0.01,
        "pid": 4242,
    }


def code_reply(**fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "context": "default",
        "status": "ok",
        "stdout": b"",
        "stderr": b"",
        "stdout_bytes": 0,
        "stderr_bytes": 0,
        "stdout_dropped": 0,
        "stderr_dropped": 0,
        "results": [],
        "results_dropped": 0,
        "stdin_exhausted": False,
        "execution_count": 1,
        "duration_s": 0.01,
    }
    body.update(fields)
    return body


def shell_reply(stdout: bytes = b"", cwd: str = "/w") -> dict[str, Any]:
    return {**exec_reply(stdout), "interrupted": False, "session_restarted": False, "cwd": cwd}


def info_reply(**fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "version": "0",
        "protocol_version": 1,
        "capabilities": [],
        "ops": [],
        "limits": {},
        "boot_id": "b",
        "pid": 1,
        "uptime_s": 1.0,
        "host_uptime_s": 1.0,
        "load": [0.0, 0.0, 0.0],
        "memory": {},
        "disk": {},
        "cpu_count": 1,
        "connections": 1,
        "hostname": "h",
        "snapshot": {"generation": 1},
        "workload_cgroup": "disabled",
        "spawn": "clone3",
        "runs_ended_at_start": 0,
    }
    body.update(fields)
    return body


def stat_reply(size: int) -> dict[str, Any]:
    return {"type": "file", "size": size, "mode": 0o644, "uid": 0, "gid": 0, "mtime_ns": 0}


def send_download(peer: RawPeer, rid: int, data: bytes, announced: int | None = None, window: int = 4 << 20) -> None:
    """Answer a file.download with ``data`` in 64 KiB events within the client's credit (reading
    its window frames), after a start event announcing ``announced`` (default: the true size)."""
    peer.send(Kind.EVENT, rid, {"ev": "start", "size": len(data) if announced is None else announced})
    credit = window
    for i in range(0, len(data), 65536):
        piece = data[i : i + 65536]
        while credit < len(piece):
            kind, wid, body = peer.recv()
            if kind == Kind.WINDOW and wid == rid:
                credit += int(body["bytes"])
            elif kind == Kind.CANCEL and wid == rid:
                peer.send(Kind.ERROR, rid, {"code": "cancelled", "message": "cancelled"})
                return
        peer.send(Kind.EVENT, rid, {"ev": "data", "data": piece})
        credit -= len(piece)
    peer.send(Kind.RESPONSE, rid, {"bytes": len(data), "size": len(data) if announced is None else announced})
