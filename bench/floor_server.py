"""The floor: the least a Python uvloop + msgpack daemon can do on this machine.

Length-prefixed msgpack over a Unix socket, no validation, no concurrency control.
Ops: ping -> {}; sink n -> reads n raw bytes then replies; source n -> writes n raw bytes;
exec argv -> {exit_code, stdout, stderr}: the least an exec through a server can do here
(posix_spawn on the loop, as vfork, with two pipes; the exit seen through a pidfd; each pipe
read once, after the exit, so only for commands whose output fits a pipe's buffer, such as
`true`; no user, cgroup, limits, timeouts or checks), so the bench can say
how much of guestd's exec time is the architecture (a round trip across CPUs to a server
that spawns) and how much is guestd's own.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import cast

import msgpack
import uvloop


class Floor(asyncio.Protocol):
    def __init__(self) -> None:
        self.buf = bytearray()
        self.sink_left = 0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its API.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        if self.sink_left:
            take = min(self.sink_left, len(data))
            self.sink_left -= take
            data = data[take:]
            if not self.sink_left:
                self._reply({"ok": True})
        self.buf += data
        while len(self.buf) >= 4:
            n = int.from_bytes(self.buf[:4], "big")
            if len(self.buf) < 4 + n:
                return
            req = msgpack.unpackb(bytes(self.buf[4 : 4 + n]))
            del self.buf[: 4 + n]
            op = req["op"]
            if op == "ping":
                self._reply({"id": req.get("id")})
            elif op == "sink":
                take = min(req["n"], len(self.buf))
                del self.buf[:take]
                self.sink_left = req["n"] - take
                if not self.sink_left:
                    self._reply({"ok": True})
            elif op == "exec":
                self._exec(req["argv"])
            elif op == "source":
                chunk = b"\0" * (1 << 20)
                left = req["n"]
                while left:
                    k = min(left, len(chunk))
                    self.transport.write(chunk[:k])
                    left -= k

    def _exec(self, argv: list[str]) -> None:
        loop = asyncio.get_running_loop()
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        dup2 = os.POSIX_SPAWN_DUP2
        pid = os.posix_spawnp(argv[0], argv, os.environ, file_actions=[(dup2, out_w, 1), (dup2, err_w, 2)])
        os.close(out_w)
        os.close(err_w)
        pidfd = os.pidfd_open(pid)

        def exited() -> None:
            loop.remove_reader(pidfd)
            os.close(pidfd)
            _, status = os.waitpid(pid, 0)
            outputs = []
            for fd in (out_r, err_r):
                outputs.append(os.read(fd, 1 << 16))
                os.close(fd)
            self._reply({"exit_code": os.waitstatus_to_exitcode(status), "stdout": outputs[0], "stderr": outputs[1]})

        loop.add_reader(pidfd, exited)

    def _reply(self, obj: object) -> None:
        assert self.transport is not None
        body = msgpack.packb(obj)
        self.transport.write(len(body).to_bytes(4, "big") + body)


async def main(path: str) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_unix_server(Floor, path)
    os.write(1, b"ready\n")
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    uvloop.run(main(sys.argv[1]))
