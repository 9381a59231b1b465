"""asyncio client: typed calls for every op, shaped like the sandbox SDKs agents use."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from guestd.client.address import open_socket, parse_address
from guestd.client.connection import DEFAULT_WINDOW, Call, ClientConnection, GuestProtocolError
from guestd.client.results import CodeResult, DirEntry, DirListing, ExecResult, FileStat, Info, ShellResult
from guestd.wire.errors import ErrorCode, GuestdError
from guestd.wire.frames import DEFAULT_MAX_FRAME
from guestd.wire.paths import WirePath, path_to_wire

DEFAULT_TIMEOUT = 300.0  # any request without its own deadline
EXEC_MARGIN = 30.0  # on top of an exec's own timeout + kill grace
UPLOAD_CHUNK = 1024 * 1024

Progress = Callable[[int], None]


def present(**fields: Any) -> dict[str, Any]:
    """Request args without the fields left at None (the guest applies its defaults)."""
    return {k: v for k, v in fields.items() if v is not None}


class ExecStream:
    """A streaming exec: iterate ``(stream, bytes)`` pairs, then await :meth:`result`."""

    def __init__(self, client: AsyncClient, call: Call, timeout: float | None) -> None:
        self._client = client
        self._call = call
        self._timeout = timeout
        self.pid: int | None = None

    def __aiter__(self) -> AsyncIterator[tuple[str, bytes]]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[tuple[str, bytes]]:
        loop = asyncio.get_running_loop()
        deadline = None if self._timeout is None else loop.time() + self._timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - loop.time())
            try:
                ev = await asyncio.wait_for(self._call.next_event(), left)
            except TimeoutError:
                self._client._conn._forget(self._call)
                raise GuestdError(ErrorCode.TIMEOUT, "exec stream: no result before the client deadline") from None
            if ev is None:
                return
            kind = ev.get("ev")
            if kind == "started" and isinstance(ev.get("pid"), int):
                self.pid = ev["pid"]
            elif kind in ("stdout", "stderr") and isinstance(ev.get("data"), bytes):
                yield kind, ev["data"]

    async def write_stdin(self, data: bytes) -> None:
        for i in range(0, len(data), UPLOAD_CHUNK):
            part = data[i : i + UPLOAD_CHUNK]
            await self._call.send_input({"data": part})

    async def close_stdin(self) -> None:
        await self._call.send_input({"eof": True})

    async def signal(self, sig: str | int) -> None:
        await self._call.send_input({"signal": str(sig)})

    async def cancel(self) -> None:
        self._call.cancel()

    async def result(self) -> ExecResult:
        return ExecResult.from_body(await self._client._conn.wait(self._call, self._timeout))


class CodeStream:
    """A streaming code run: iterate events as they arrive, then await :meth:`result`.

    Events are ``("stdout"|"stderr", bytes)``, ``("result"|"display", bundle)`` and
    ``("error", {"ename", "evalue", "traceback"})``.
    """

    def __init__(self, client: AsyncClient, call: Call, timeout: float | None) -> None:
        self._client = client
        self._call = call
        self._timeout = timeout

    def __aiter__(self) -> AsyncIterator[tuple[str, Any]]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[tuple[str, Any]]:
        while True:
            ev = await self._call.next_event(self._timeout)
            if ev is None:
                return
            kind = ev.get("ev")
            if kind in ("stdout", "stderr") and isinstance(ev.get("data"), bytes):
                yield kind, ev["data"]
            elif kind in ("result", "display") and isinstance(ev.get("bundle"), dict):
                yield kind, ev["bundle"]
            elif kind == "error":
                yield kind, {k: ev.get(k) for k in ("ename", "evalue", "traceback")}

    async def result(self) -> CodeResult:
        return CodeResult.from_body(await self._client._conn.wait(self._call, self._timeout))


class Attach:
    """Output of a background process from given offsets: iterate ``(stream, offset, data)``.

    A ``("lost", offset, b"")`` item says bytes before ``offset`` were overwritten in the
    ring (``lost_bytes`` keeps the count). After the loop, :meth:`result` gives the exit
    status and the offsets to reattach from.
    """

    def __init__(self, client: AsyncClient, call: Call, timeout: float | None) -> None:
        self._client = client
        self._call = call
        self._timeout = timeout
        self.lost_bytes = {"stdout": 0, "stderr": 0}

    def __aiter__(self) -> AsyncIterator[tuple[str, int, bytes]]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[tuple[str, int, bytes]]:
        while True:
            ev = await self._call.next_event(self._timeout)
            if ev is None:
                return
            kind = ev.get("ev")
            offset = ev.get("offset")
            if not isinstance(offset, int):
                continue
            if kind in ("stdout", "stderr") and isinstance(ev.get("data"), bytes):
                yield kind, offset, ev["data"]
            elif kind == "lost" and ev.get("stream") in self.lost_bytes and isinstance(ev.get("bytes"), int):
                self.lost_bytes[ev["stream"]] += ev["bytes"]
                yield "lost", offset, b""

    async def result(self) -> dict[str, Any]:
        return await self._client._conn.wait(self._call, self._timeout)

    def cancel(self) -> None:
        self._client._conn._forget(self._call)


class AsyncClient:
    """Connect with ``await AsyncClient.connect("unix:/run/guestd.sock")``."""

    def __init__(self, conn: ClientConnection, address: str) -> None:
        self._conn = conn
        self.address = address

    @classmethod
    async def connect(
        cls,
        address: str,
        *,
        timeout: float = 10.0,
        token: str | None = None,
        max_frame: int = DEFAULT_MAX_FRAME,
        stream_window: int = DEFAULT_WINDOW,
    ) -> AsyncClient:
        sock = await open_socket(parse_address(address), timeout)
        conn = await ClientConnection.open(
            sock, timeout=timeout, token=token, max_frame=max_frame, stream_window=stream_window
        )
        return cls(conn, address)

    @classmethod
    async def from_socket(cls, sock: socket.socket, *, timeout: float = 10.0, token: str | None = None) -> AsyncClient:
        """Speak the protocol over an already connected stream socket (e.g. a serial bridge)."""
        sock.setblocking(False)
        return cls(await ClientConnection.open(sock, timeout=timeout, token=token), f"socket:{sock.fileno()}")

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        self._conn.close()

    @property
    def server_hello(self) -> dict[str, Any]:
        assert self._conn.hello is not None
        return self._conn.hello

    @property
    def limits(self) -> dict[str, Any]:
        limits: dict[str, Any] = self.server_hello["limits"]
        return limits

    async def call(
        self, op: str, args: dict[str, Any] | None = None, *, timeout: float | None = DEFAULT_TIMEOUT
    ) -> dict[str, Any]:
        """Send any op (including ones this client version has no method for)."""
        return await self._conn.request(op, args or {}, timeout)

    # -- system ---------------------------------------------------------------------------
    async def ping(self, *, timeout: float = 10.0) -> int:
        return int((await self._conn.request("ping", {}, timeout))["t_ns"])

    async def info(self, *, timeout: float = 10.0) -> Info:
        b = await self._conn.request("info", {}, timeout)
        return Info(b["version"], b["protocol_version"], b["capabilities"], b["boot_id"], b["uptime_s"], b)

    # -- exec -------------------------------------------------------------------------------
    @staticmethod
    def _exec_args(
        cmd: list[str] | str,
        *,
        cwd: WirePath | None,
        env: dict[str, str] | None,
        replace_env: bool,
        stdin: bytes | None,
        timeout: float | None,
        idle_timeout: float | None,
        max_output: int | None,
        head_tail: bool,
        kill_grace: float | None,
        stream: bool,
        stdin_stream: bool = False,
    ) -> dict[str, Any]:
        args: dict[str, Any] = {"shell": cmd} if isinstance(cmd, str) else {"argv": list(cmd)}
        if cwd is not None:
            args["cwd"] = path_to_wire(cwd)
        if env is not None:
            args["env"] = env
        if replace_env:
            args["env_mode"] = "replace"
        if stdin is not None:
            args["stdin"] = stdin
        if timeout is not None:
            args["timeout_s"] = float(timeout)
        if idle_timeout is not None:
            args["idle_timeout_s"] = float(idle_timeout)
        if max_output is not None:
            args["max_output"] = max_output
        if head_tail:
            args["capture"] = "head_tail"
        if kill_grace is not None:
            args["kill_grace_s"] = float(kill_grace)
        if stream:
            args["stream"] = True
        if stdin_stream:
            args["stdin_stream"] = True
        return args

    @staticmethod
    def _exec_deadline(
        timeout: float | None, idle_timeout: float | None, kill_grace: float | None, client_timeout: float | None
    ) -> float | None:
        if client_timeout is not None:
            return client_timeout
        if timeout is None:
            return None if idle_timeout is not None else DEFAULT_TIMEOUT * 12
        return timeout + (kill_grace if kill_grace is not None else 2.0) + EXEC_MARGIN

    async def exec(
        self,
        cmd: list[str] | str,
        *,
        cwd: WirePath | None = None,
        env: dict[str, str] | None = None,
        replace_env: bool = False,
        stdin: bytes | None = None,
        timeout: float | None = None,
        idle_timeout: float | None = None,
        max_output: int | None = None,
        head_tail: bool = False,
        kill_grace: float | None = None,
        client_timeout: float | None = None,
    ) -> ExecResult:
        """Run ``cmd`` (argv list, or a string for ``/bin/sh -c``) to completion.

        ``timeout``/``idle_timeout`` are enforced in the guest and end the whole
        process tree. Without a guest timeout the client still gives up after
        ``client_timeout`` (default: one hour) and cancels the command.
        """
        args = self._exec_args(
            cmd,
            cwd=cwd,
            env=env,
            replace_env=replace_env,
            stdin=stdin,
            timeout=timeout,
            idle_timeout=idle_timeout,
            max_output=max_output,
            head_tail=head_tail,
            kill_grace=kill_grace,
            stream=False,
        )
        deadline = self._exec_deadline(timeout, idle_timeout, kill_grace, client_timeout)
        return ExecResult.from_body(await self._conn.request("exec", args, deadline))

    def exec_stream(
        self,
        cmd: list[str] | str,
        *,
        cwd: WirePath | None = None,
        env: dict[str, str] | None = None,
        stdin: bytes | None = None,
        stdin_stream: bool = False,
        timeout: float | None = None,
        idle_timeout: float | None = None,
        kill_grace: float | None = None,
        client_timeout: float | None = None,
    ) -> ExecStream:
        args = self._exec_args(
            cmd,
            cwd=cwd,
            env=env,
            replace_env=False,
            stdin=stdin,
            timeout=timeout,
            idle_timeout=idle_timeout,
            max_output=None,
            head_tail=False,
            kill_grace=kill_grace,
            stream=True,
            stdin_stream=stdin_stream,
        )
        call = self._conn.start("exec", args)
        return ExecStream(self, call, self._exec_deadline(timeout, idle_timeout, kill_grace, client_timeout))

    # -- files ----------------------------------------------------------------------------
    async def read_file(
        self, path: WirePath, *, offset: int = 0, length: int | None = None, timeout: float = DEFAULT_TIMEOUT
    ) -> bytes:
        args: dict[str, Any] = {"path": path_to_wire(path), "offset": offset}
        if length is not None:
            args["length"] = length
        data: bytes = (await self._conn.request("file.read", args, timeout))["data"]
        if length is not None and len(data) > length:
            raise GuestProtocolError("file.read returned more bytes than asked")
        return data

    async def write_file(
        self,
        path: WirePath,
        data: bytes | str,
        *,
        flag: str = "overwrite",
        perm: int | None = None,
        parents: bool = False,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> int:
        if isinstance(data, str):
            data = data.encode()
        args: dict[str, Any] = {"path": path_to_wire(path), "data": data, "flag": flag, "parents": parents}
        if perm is not None:
            args["perm"] = perm
        return int((await self._conn.request("file.write", args, timeout))["size"])

    async def upload(
        self,
        src: str | bytes,
        dst: WirePath,
        *,
        perm: int | None = None,
        parents: bool = False,
        exclusive: bool = False,
        progress: Progress | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> int:
        """Stream a local file (path) or bytes to the guest path ``dst`` atomically. ``timeout`` bounds
        each chunk's wait."""
        if isinstance(src, bytes):
            size = len(src)
            chunks: Any = (src[i : i + UPLOAD_CHUNK] for i in range(0, size, UPLOAD_CHUNK))
            f = None
        else:
            f = open(src, "rb")  # noqa: SIM115 - closed in finally
            size = os.fstat(f.fileno()).st_size
            reader = f
            chunks = iter(lambda: reader.read(UPLOAD_CHUNK), b"")
        args: dict[str, Any] = {
            "path": path_to_wire(dst),
            "parents": parents,
            "size": size,
            "flag": "create" if exclusive else "overwrite",
        }
        if perm is not None:
            args["perm"] = perm
        call = self._conn.start("file.upload", args)
        try:
            sent = 0
            for chunk in chunks:
                await call.send_input({"data": chunk}, timeout)
                sent += len(chunk)
                if progress is not None:
                    progress(len(chunk))
            await call.send_input({"eof": True})
            result = await self._conn.wait(call, timeout)
        except BaseException:
            self._conn._forget(call)
            raise
        finally:
            if f is not None:
                f.close()
        if result["size"] != sent:
            raise GuestProtocolError(f"upload: guest reports {result['size']} bytes, sent {sent}")
        return sent

    async def download(
        self,
        src: WirePath,
        dst: str | None = None,
        *,
        offset: int = 0,
        length: int | None = None,
        max_bytes: int | None = None,
        progress: Progress | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        sink: Callable[[bytes], object] | None = None,
    ) -> bytes | int:
        """Stream ``src`` to a local path or ``sink`` (returns bytes written) or into memory (returns bytes).

        In-memory downloads are capped by ``max_bytes`` (default 256 MiB) so a
        hostile guest cannot exhaust host memory. ``timeout`` bounds each wait.
        """
        to_memory = dst is None and sink is None
        cap = max_bytes if max_bytes is not None else (256 * 1024 * 1024 if to_memory else None)
        args: dict[str, Any] = {"path": path_to_wire(src), "offset": offset}
        if length is not None:
            args["length"] = length
        call = self._conn.start("file.download", args)
        part = dst + ".part" if dst is not None else None
        out = open(part, "wb") if part is not None else None  # noqa: SIM115
        buf = bytearray()
        got = 0
        expected: int | None = None
        try:
            while True:
                ev = await call.next_event(timeout)
                if ev is None:
                    break
                if ev.get("ev") == "start" and isinstance(ev.get("size"), int):
                    expected = max(0, ev["size"] - offset)
                    if length is not None:
                        expected = min(expected, length)
                    continue
                data = ev.get("data")
                if not isinstance(data, bytes):
                    continue
                got += len(data)
                if (expected is not None and got > expected) or (cap is not None and got > cap):
                    raise GuestProtocolError(f"download: guest sent {got} bytes, more than expected/allowed")
                if out is not None:
                    out.write(data)
                elif sink is not None:
                    sink(data)
                else:
                    buf += data
                if progress is not None:
                    progress(len(data))
            result = await self._conn.wait(call, timeout)
            if result["bytes"] != got:
                raise GuestProtocolError(f"download: guest reports {result['bytes']} bytes, received {got}")
            if out is not None:
                out.close()
                assert part is not None and dst is not None
                os.replace(part, dst)
                out = None
                return got
            return bytes(buf) if to_memory else got
        except BaseException:
            self._conn._forget(call)
            if out is not None:
                out.close()
                assert part is not None
                os.unlink(part)
                out = None
            raise

    async def stat(self, path: WirePath, *, follow: bool = True, timeout: float = DEFAULT_TIMEOUT) -> FileStat:
        args = {"path": path_to_wire(path), "follow": follow}
        return FileStat.from_body(await self._conn.request("file.stat", args, timeout))

    async def exists(self, path: WirePath) -> bool:
        try:
            await self.stat(path, follow=False)
            return True
        except GuestdError as e:
            if e.code == ErrorCode.NOT_FOUND.value:
                return False
            raise

    async def listdir(
        self, path: WirePath, *, max_entries: int | None = None, timeout: float = DEFAULT_TIMEOUT
    ) -> DirListing:
        """The first entries in order of their names as bytes. A name is a str, or bytes when it
        is not UTF-8 (pass it back as it is to name that entry)."""
        args: dict[str, Any] = {"path": path_to_wire(path)}
        if max_entries is not None:
            args["max_entries"] = max_entries
        b = await self._conn.request("file.list", args, timeout)
        entries = b["entries"]
        if not isinstance(entries, list):
            raise GuestProtocolError("file.list: entries is not a list")
        out = []
        for e in entries:
            try:
                name = e["name"]
                if not isinstance(name, (str, bytes)):
                    raise TypeError("name")
                out.append(DirEntry(name, str(e["type"]), int(e["size"]), int(e["mode"]), int(e["mtime_ns"])))
            except (KeyError, TypeError, ValueError):
                raise GuestProtocolError("file.list: malformed entry") from None
        return DirListing(out, bool(b["truncated"]), int(b["total"]))

    async def mkdir(
        self, path: WirePath, *, parents: bool = True, perm: int = 0o755, timeout: float = DEFAULT_TIMEOUT
    ) -> bool:
        args = {"path": path_to_wire(path), "parents": parents, "perm": perm}
        return bool((await self._conn.request("file.mkdir", args, timeout))["created"])

    async def remove(self, path: WirePath, *, recursive: bool = False, timeout: float = DEFAULT_TIMEOUT) -> int:
        args = {"path": path_to_wire(path), "recursive": recursive}
        return int((await self._conn.request("file.remove", args, timeout))["removed"])

    async def rename(
        self, src: WirePath, dst: WirePath, *, overwrite: bool = True, timeout: float = DEFAULT_TIMEOUT
    ) -> None:
        args = {"src": path_to_wire(src), "dst": path_to_wire(dst), "overwrite": overwrite}
        await self._conn.request("file.rename", args, timeout)

    # -- code contexts --------------------------------------------------------------------
    async def code_create(
        self,
        *,
        cwd: WirePath | None = None,
        env: dict[str, str] | None = None,
        name: str | None = None,
        timeout: float = 120.0,
    ) -> dict[str, Any]:
        """Create a Python context (returns ``{"id", "name", "pid", "pooled", "existing"}``)."""
        wire_cwd = None if cwd is None else path_to_wire(cwd)
        return await self._conn.request("code.create", present(cwd=wire_cwd, env=env, name=name), timeout)

    async def code_run(
        self,
        code: str,
        *,
        context: str | None = None,
        timeout: float | None = None,
        interrupt_grace: float | None = None,
        input_lines: list[str] | None = None,
        strip_ansi: bool = False,
        max_output: int | None = None,
        client_timeout: float | None = None,
    ) -> CodeResult:
        """Run a cell; without ``context`` the daemon's "default" context (made on first use)."""
        args: dict[str, Any] = {"code": code, "strip_ansi": strip_ansi}
        if context is not None:
            args["context"] = context
        if timeout is not None:
            args["timeout_s"] = float(timeout)
        if interrupt_grace is not None:
            args["interrupt_grace_s"] = float(interrupt_grace)
        if input_lines is not None:
            args["input_lines"] = input_lines
        if max_output is not None:
            args["max_output"] = max_output
        if client_timeout is None:
            # A kernel start (default context), the run, an interrupt grace and a restart.
            client_timeout = (
                (timeout + (interrupt_grace or 2.0) + 120.0) if timeout is not None else DEFAULT_TIMEOUT * 12
            )
        return CodeResult.from_body(await self._conn.request("code.run", args, client_timeout))

    def code_run_stream(
        self,
        code: str,
        *,
        context: str | None = None,
        timeout: float | None = None,
        strip_ansi: bool = False,
        client_timeout: float | None = None,
    ) -> CodeStream:
        """Like :meth:`code_run`, delivering output and rich results as they arrive."""
        args: dict[str, Any] = {"code": code, "strip_ansi": strip_ansi, "stream": True}
        if context is not None:
            args["context"] = context
        if timeout is not None:
            args["timeout_s"] = float(timeout)
        if client_timeout is None:
            client_timeout = (timeout + 122.0) if timeout is not None else DEFAULT_TIMEOUT * 12
        return CodeStream(self, self._conn.start("code.run", args), client_timeout)

    async def code_interrupt(self, context: str, *, timeout: float = 30.0) -> None:
        await self._conn.request("code.interrupt", {"context": context}, timeout)

    async def code_restart(self, context: str, *, timeout: float = 120.0) -> int:
        return int((await self._conn.request("code.restart", {"context": context}, timeout))["pid"])

    async def code_close(self, context: str, *, timeout: float = 30.0) -> None:
        await self._conn.request("code.close", {"context": context}, timeout)

    async def code_list(self, *, timeout: float = 30.0) -> list[dict[str, Any]]:
        contexts = (await self._conn.request("code.list", {}, timeout))["contexts"]
        return [c for c in contexts if isinstance(c, dict)] if isinstance(contexts, list) else []

    # -- background processes ---------------------------------------------------------------
    async def process_start(
        self,
        cmd: list[str] | str,
        *,
        cwd: WirePath | None = None,
        env: dict[str, str] | None = None,
        stdin: bool = False,
        pty: bool = False,
        rows: int = 24,
        cols: int = 80,
        ring_bytes: int | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> dict[str, Any]:
        """Start a detached process; returns ``{"id", "pid"}`` at once."""
        args: dict[str, Any] = {"shell": cmd} if isinstance(cmd, str) else {"argv": list(cmd)}
        args.update({"stdin": stdin, "pty": pty, "rows": rows, "cols": cols})
        if cwd is not None:
            args["cwd"] = path_to_wire(cwd)
        if env is not None:
            args["env"] = env
        if ring_bytes is not None:
            args["ring_bytes"] = ring_bytes
        return await self._conn.request("process.start", args, timeout)

    async def process_list(self, *, timeout: float = DEFAULT_TIMEOUT) -> list[dict[str, Any]]:
        procs = (await self._conn.request("process.list", {}, timeout))["processes"]
        return [p for p in procs if isinstance(p, dict)] if isinstance(procs, list) else []

    def attach(
        self,
        pid_id: str,
        *,
        stdout_from: int = 0,
        stderr_from: int = 0,
        follow: bool = True,
        timeout: float | None = None,
    ) -> Attach:
        """Stream output from the given offsets (``timeout`` bounds each wait for the next event)."""
        args = {"id": pid_id, "stdout_from": stdout_from, "stderr_from": stderr_from, "follow": follow}
        return Attach(self, self._conn.start("process.attach", args), timeout)

    async def process_wait(self, pid_id: str, timeout: float | None = None) -> dict[str, Any]:
        args: dict[str, Any] = {"id": pid_id}
        if timeout is not None:
            args["timeout_s"] = float(timeout)
        client_timeout = None if timeout is None else timeout + EXEC_MARGIN
        return await self._conn.request("process.wait", args, client_timeout)

    async def process_signal(self, pid_id: str, sig: str | int = "TERM", *, timeout: float = 30.0) -> None:
        await self._conn.request("process.signal", {"id": pid_id, "signal": str(sig)}, timeout)

    async def process_write(self, pid_id: str, data: bytes | str, *, timeout: float = 60.0) -> int:
        raw = data.encode() if isinstance(data, str) else data
        return int((await self._conn.request("process.write", {"id": pid_id, "data": raw}, timeout))["written"])

    async def process_close_stdin(self, pid_id: str, *, timeout: float = 30.0) -> None:
        await self._conn.request("process.close_stdin", {"id": pid_id}, timeout)

    async def process_resize(self, pid_id: str, rows: int, cols: int, *, timeout: float = 30.0) -> None:
        await self._conn.request("process.resize", {"id": pid_id, "rows": rows, "cols": cols}, timeout)

    async def process_forget(self, pid_id: str, *, timeout: float = 30.0) -> None:
        await self._conn.request("process.forget", {"id": pid_id}, timeout)

    # -- shell sessions -----------------------------------------------------------------------
    async def shell_create(
        self,
        *,
        cwd: WirePath | None = None,
        env: dict[str, str] | None = None,
        name: str | None = None,
        timeout: float = 60.0,
    ) -> dict[str, Any]:
        wire_cwd = None if cwd is None else path_to_wire(cwd)
        return await self._conn.request("shell.create", present(cwd=wire_cwd, env=env, name=name), timeout)

    async def shell_run(
        self,
        session: str,
        command: str,
        *,
        input: bytes | None = None,
        timeout: float | None = None,
        idle_timeout: float | None = None,
        max_output: int | None = None,
        head_tail: bool = False,
        client_timeout: float | None = None,
    ) -> ShellResult:
        """Run a command in a persistent bash session (cd, variables, venvs persist)."""
        args: dict[str, Any] = {"id": session, "command": command}
        if input is not None:
            args["input"] = input
        if timeout is not None:
            args["timeout_s"] = float(timeout)
        if idle_timeout is not None:
            args["idle_timeout_s"] = float(idle_timeout)
        if max_output is not None:
            args["max_output"] = max_output
        if head_tail:
            args["capture"] = "head_tail"
        if client_timeout is None:
            client_timeout = self._exec_deadline(timeout, idle_timeout, 5.0, None)
        return ShellResult.from_body(await self._conn.request("shell.run", args, client_timeout))

    async def shell_list(self, *, timeout: float = 30.0) -> list[dict[str, Any]]:
        sessions = (await self._conn.request("shell.list", {}, timeout))["sessions"]
        return [s for s in sessions if isinstance(s, dict)] if isinstance(sessions, list) else []

    async def shell_close(self, session: str, *, timeout: float = 30.0) -> None:
        await self._conn.request("shell.close", {"id": session}, timeout)

    # -- snapshots ----------------------------------------------------------------------------
    async def snapshot_prepare(self, *, quiesce: bool = False, timeout: float = 120.0) -> dict[str, Any]:
        """Call before pausing/snapshotting the VM."""
        return await self._conn.request("snapshot.prepare", {"quiesce": quiesce, "timeout_s": timeout / 2}, timeout)

    async def snapshot_resume(self, *, timeout: float = 30.0) -> None:
        await self._conn.request("snapshot.resume", {}, timeout)

    async def restore(
        self,
        *,
        generation: int | None = None,
        nonce: str | None = None,
        time_ns: int | None = None,
        entropy: bytes | None = None,
        sandbox_id: str | None = None,
        hostname: str | None = None,
        env: dict[str, str] | None = None,
        token: str | None = None,
        timeout: float = 120.0,
    ) -> dict[str, Any]:
        """Call first thing after every restore/clone. Defaults: the next generation, a fresh
        nonce, this host's clock and 64 bytes from os.urandom."""
        if generation is None:
            generation = int((await self.info()).raw["snapshot"]["generation"]) + 1
        identity: dict[str, Any] = {}
        for key, value in (("sandbox_id", sandbox_id), ("hostname", hostname), ("env", env), ("token", token)):
            if value is not None:
                identity[key] = value
        args: dict[str, Any] = {
            "generation": generation,
            "nonce": nonce or os.urandom(16).hex(),
            "time_ns": time_ns if time_ns is not None else time.time_ns(),
            "entropy": entropy if entropy is not None else os.urandom(64),
        }
        if identity:
            args["identity"] = identity
        return await self._conn.request("snapshot.restore", args, timeout)
