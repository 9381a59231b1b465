"""Drive an interactive command in a shell session: type, wait for a pattern or the end.

``Expect.start`` runs a command with ``shell.run`` ``pty: true`` (in the session's own state:
functions, aliases, unexported variables) and reads its terminal output in a task of its own
into a bounded buffer. ``expect`` waits for a regular expression (or the end of the command)
up to a deadline and consumes the output up to the match; ``send`` types, ``interrupt`` is
Ctrl-C for the program in the foreground, ``wait`` returns the command's result::

    async with Expect.start(client, sid, "git add -p") as e:
        await e.expect(rb"\\(1/1\\) Stage this hunk .*\\? ", timeout=10)
        await e.send(b"y\\n")
        r = await e.wait(timeout=10)

A terminal writes ``\\r\\n`` for a newline and echoes what is typed: patterns see that.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from types import TracebackType
from typing import TYPE_CHECKING

from guestd.client.streaming import DERIVED
from guestd.wire.errors import ErrorCode, GuestdError

if TYPE_CHECKING:
    from guestd.client.aio import AsyncClient
    from guestd.client.results import ShellResult
    from guestd.client.streaming import RunDeadline
    from guestd.client.streams import ShellStream

MAX_BUFFER = 1024 * 1024  # unconsumed output kept; older bytes are dropped (counted)
SEARCH_OVERLAP = 64 * 1024  # how far back in output already searched a match may start


class ExpectEOF(GuestdError):
    """The command ended (its output did) before the pattern appeared."""


class Expect:
    def __init__(
        self,
        stream: ShellStream,
        max_buffer: int = MAX_BUFFER,
        *,
        client: AsyncClient | None = None,
        session: str = "",
    ) -> None:
        self.stream = stream
        self._client = client  # resize is an op on the session, not on the stream
        self.session = session
        self.buffer = bytearray()  # output not consumed by a match yet
        self.before = b""  # what came before the last match
        self.dropped = 0  # bytes dropped from the front of the buffer (over max_buffer)
        self.ended = False
        self._max = max_buffer
        self._more = asyncio.Event()
        self._reader = asyncio.ensure_future(self._read())

    @classmethod
    def start(
        cls,
        client: AsyncClient,
        session: str,
        command: str,
        *,
        timeout_s: float | None = None,
        idle_timeout_s: float | None = None,
        deadline: RunDeadline = DERIVED,
        max_buffer: int = MAX_BUFFER,
        rows: int | None = None,
        cols: int | None = None,
    ) -> Expect:
        """Run ``command`` with ``shell.run`` ``pty: true`` in session ``session``; ``rows`` x
        ``cols``: the terminal's size (guestd's default 24 x 80)."""
        stream = client.shell_stream(
            session,
            command,
            pty=True,
            timeout_s=timeout_s,
            idle_timeout_s=idle_timeout_s,
            rows=rows,
            cols=cols,
            deadline=deadline,
        )
        return cls(stream, max_buffer, client=client, session=session)

    async def _read(self) -> None:
        try:
            async for _name, data in self.stream:
                self.buffer += data
                over = len(self.buffer) - self._max
                if over > 0:
                    del self.buffer[:over]
                    self.dropped += over
                self._more.set()
        finally:
            self.ended = True
            self._more.set()

    async def send(self, data: bytes | str) -> None:
        await self.stream.write_stdin(data.encode() if isinstance(data, str) else data)

    async def sendline(self, text: bytes | str = b"") -> None:
        await self.send((text.encode() if isinstance(text, str) else text) + b"\n")

    async def interrupt(self) -> None:
        """Ctrl-C: SIGINT to the command's process group (the session's bash is not in it)."""
        await self.stream.signal("INT")

    async def resize(self, rows: int, cols: int) -> None:
        """Resize the terminal; the program gets SIGWINCH."""
        if self._client is None:
            raise GuestdError(ErrorCode.BAD_REQUEST, "resize: this Expect was made without its client and session")
        await self._client.shell_resize(self.session, rows, cols)

    async def send_eof(self) -> None:
        await self.stream.close_stdin()

    async def expect(self, pattern: bytes | str | re.Pattern[bytes], timeout: float) -> re.Match[bytes]:
        """Wait up to ``timeout`` s for ``pattern`` in the output not consumed yet; the output up
        to the match's end is consumed (what came before it is :attr:`before`). Raises a
        ``timeout`` GuestdError, or :class:`ExpectEOF` when the command ended first. The whole
        buffer is searched once; then each new output with the ``SEARCH_OVERLAP`` (64 KiB)
        before it, so a match may start at most that far back in output searched before."""
        rx = (
            pattern
            if isinstance(pattern, re.Pattern)
            else re.compile(pattern.encode() if isinstance(pattern, str) else pattern)
        )
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        # Each wake searches the new output and SEARCH_OVERLAP bytes before it, not the whole
        # buffer again: a guest trickling output into a large buffer costs what it sends.
        searched, dropped = 0, self.dropped
        while True:
            self._more.clear()
            searched, dropped = max(0, searched - (self.dropped - dropped)), self.dropped
            start = max(0, searched - SEARCH_OVERLAP)
            if rx.search(self.buffer, start) is not None:
                data = bytes(self.buffer)  # the match must outlive the buffer's consumed bytes
                m = rx.search(data, start)
                assert m is not None
                self.before = data[: m.start()]
                del self.buffer[: m.end()]
                return m
            searched = len(self.buffer)
            if self.ended:
                self._reader_error()
                raise ExpectEOF(ErrorCode.NOT_FOUND, f"the command ended before {rx.pattern!r} appeared")
            left = end - loop.time()
            if left <= 0:
                tail = bytes(self.buffer[-200:])
                raise GuestdError(
                    ErrorCode.TIMEOUT, f"{rx.pattern!r} not seen within {timeout} s; last output {tail!r}"
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._more.wait(), left)

    async def wait(self, timeout: float) -> ShellResult:
        """The command's result once it has ended (its output read to the end), within ``timeout`` s."""
        try:
            await asyncio.wait_for(asyncio.shield(self._reader), timeout)
        except TimeoutError:
            raise GuestdError(ErrorCode.TIMEOUT, f"the command did not end within {timeout} s") from None
        return await self.stream.result()

    def _reader_error(self) -> None:
        if self._reader.done() and not self._reader.cancelled():
            exc = self._reader.exception()
            if exc is not None:
                raise exc

    async def close(self) -> None:
        """Stop reading; a command still running is cancelled (the session interrupts it)."""
        if not self._reader.done():
            await self.stream.cancel()
            self._reader.cancel()
        with contextlib.suppress(BaseException):
            await self._reader

    async def __aenter__(self) -> Expect:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
