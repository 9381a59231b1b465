"""Blocking client: the asyncio client driven on a private event-loop thread."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from guestd.client.aio import AsyncClient
from guestd.client.results import CodeResult, DirListing, ExecResult, FileStat, Info, ShellResult
from guestd.wire.paths import WirePath

T = TypeVar("T")


class Client:
    """``with Client("unix:/run/guestd.sock") as c: c.exec(["ls"])``"""

    def __init__(
        self, address: str, *, timeout: float = 10.0, token: str | None = None, sock: socket.socket | None = None
    ) -> None:
        """Connect to ``address``; or, with ``sock``, speak over an already connected stream socket
        (QEMU's chardev socket behind a virtio-serial port, for example)."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="guestd-client", daemon=True)
        self._thread.start()
        try:
            if sock is not None:
                self._aio: AsyncClient = self._run(AsyncClient.from_socket(sock, timeout=timeout, token=token))
            else:
                self._aio = self._run(AsyncClient.connect(address, timeout=timeout, token=token))
        except BaseException:
            self._stop()
            raise

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._run(self._aio.close())
        finally:
            self._stop()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def aio(self) -> AsyncClient:
        return self._aio

    def call(self, op: str, args: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
        return self._run(self._aio.call(op, args, **kw))

    def ping(self, **kw: Any) -> int:
        return self._run(self._aio.ping(**kw))

    def info(self, **kw: Any) -> Info:
        return self._run(self._aio.info(**kw))

    def exec(self, cmd: list[str] | str, **kw: Any) -> ExecResult:
        return self._run(self._aio.exec(cmd, **kw))

    def read_file(self, path: WirePath, **kw: Any) -> bytes:
        return self._run(self._aio.read_file(path, **kw))

    def write_file(self, path: WirePath, data: bytes | str, **kw: Any) -> int:
        return self._run(self._aio.write_file(path, data, **kw))

    def upload(self, src: str | bytes, dst: WirePath, **kw: Any) -> int:
        return self._run(self._aio.upload(src, dst, **kw))

    def download(self, src: WirePath, dst: str | None = None, **kw: Any) -> bytes | int:
        return self._run(self._aio.download(src, dst, **kw))

    def stat(self, path: WirePath, **kw: Any) -> FileStat:
        return self._run(self._aio.stat(path, **kw))

    def exists(self, path: WirePath) -> bool:
        return self._run(self._aio.exists(path))

    def listdir(self, path: WirePath, **kw: Any) -> DirListing:
        return self._run(self._aio.listdir(path, **kw))

    def mkdir(self, path: WirePath, **kw: Any) -> bool:
        return self._run(self._aio.mkdir(path, **kw))

    def remove(self, path: WirePath, **kw: Any) -> int:
        return self._run(self._aio.remove(path, **kw))

    def rename(self, src: WirePath, dst: WirePath, **kw: Any) -> None:
        self._run(self._aio.rename(src, dst, **kw))

    def code_create(self, **kw: Any) -> dict[str, Any]:
        return self._run(self._aio.code_create(**kw))

    def code_run(self, code: str, **kw: Any) -> CodeResult:
        return self._run(self._aio.code_run(code, **kw))

    def code_interrupt(self, context: str, **kw: Any) -> None:
        self._run(self._aio.code_interrupt(context, **kw))

    def code_restart(self, context: str, **kw: Any) -> int:
        return self._run(self._aio.code_restart(context, **kw))

    def code_close(self, context: str, **kw: Any) -> None:
        self._run(self._aio.code_close(context, **kw))

    def code_list(self, **kw: Any) -> list[dict[str, Any]]:
        return self._run(self._aio.code_list(**kw))

    def process_start(self, cmd: list[str] | str, **kw: Any) -> dict[str, Any]:
        return self._run(self._aio.process_start(cmd, **kw))

    def process_list(self, **kw: Any) -> list[dict[str, Any]]:
        return self._run(self._aio.process_list(**kw))

    def process_output(self, pid_id: str, **kw: Any) -> tuple[bytes, bytes, dict[str, Any]]:
        """Everything attach delivers (stdout, stderr, final status); follows until exit by default."""

        async def collect() -> tuple[bytes, bytes, dict[str, Any]]:
            a = self._aio.attach(pid_id, **kw)
            out = {"stdout": bytearray(), "stderr": bytearray()}
            async for name, _, data in a:
                if name in out:
                    out[name] += data
            return bytes(out["stdout"]), bytes(out["stderr"]), await a.result()

        return self._run(collect())

    def process_wait(self, pid_id: str, timeout: float | None = None) -> dict[str, Any]:
        return self._run(self._aio.process_wait(pid_id, timeout))

    def process_signal(self, pid_id: str, sig: str | int = "TERM") -> None:
        self._run(self._aio.process_signal(pid_id, sig))

    def process_write(self, pid_id: str, data: bytes | str) -> int:
        return self._run(self._aio.process_write(pid_id, data))

    def process_close_stdin(self, pid_id: str) -> None:
        self._run(self._aio.process_close_stdin(pid_id))

    def process_resize(self, pid_id: str, rows: int, cols: int) -> None:
        self._run(self._aio.process_resize(pid_id, rows, cols))

    def process_forget(self, pid_id: str) -> None:
        self._run(self._aio.process_forget(pid_id))

    def shell_create(self, **kw: Any) -> dict[str, Any]:
        return self._run(self._aio.shell_create(**kw))

    def shell_run(self, session: str, command: str, **kw: Any) -> ShellResult:
        return self._run(self._aio.shell_run(session, command, **kw))

    def shell_list(self, **kw: Any) -> list[dict[str, Any]]:
        return self._run(self._aio.shell_list(**kw))

    def shell_close(self, session: str, **kw: Any) -> None:
        self._run(self._aio.shell_close(session, **kw))

    def snapshot_prepare(self, **kw: Any) -> dict[str, Any]:
        return self._run(self._aio.snapshot_prepare(**kw))

    def snapshot_resume(self) -> None:
        self._run(self._aio.snapshot_resume())

    def restore(self, **kw: Any) -> dict[str, Any]:
        return self._run(self._aio.restore(**kw))
