"""The blocking client's expect helper: :class:`guestd.client.expect.Expect`, each call run on
the :class:`~guestd.client.sync.Client`'s loop (the reader task lives there too)::

    with SyncExpect.start(client, sid, "python3 -q") as e:
        e.expect(rb">>> ", timeout=10)
        e.sendline("6 * 7")
        e.expect(rb"42", timeout=10)
        e.sendline("exit()")
        r = e.wait(timeout=10)
"""

from __future__ import annotations

import re
from types import TracebackType
from typing import TYPE_CHECKING

from guestd.client.expect import MAX_BUFFER, Expect, ExpectEOF
from guestd.client.streaming import DERIVED

if TYPE_CHECKING:
    from guestd.client.results import ShellResult
    from guestd.client.streaming import RunDeadline
    from guestd.client.sync import Client

__all__ = ["ExpectEOF", "SyncExpect"]


class SyncExpect:
    def __init__(self, client: Client, expect: Expect) -> None:
        self._client = client
        self.aio = expect  # the async helper this one drives

    @classmethod
    def start(
        cls,
        client: Client,
        session: str,
        command: str,
        *,
        timeout_s: float | None = None,
        idle_timeout_s: float | None = None,
        deadline: RunDeadline = DERIVED,
        max_buffer: int = MAX_BUFFER,
        rows: int | None = None,
        cols: int | None = None,
    ) -> SyncExpect:
        """Run ``command`` with ``shell.run`` ``pty: true`` in session ``session`` (see :meth:`Expect.start`)."""

        async def make() -> Expect:  # on the client's loop: the reader task is created there
            return Expect.start(
                client.aio,
                session,
                command,
                timeout_s=timeout_s,
                idle_timeout_s=idle_timeout_s,
                deadline=deadline,
                max_buffer=max_buffer,
                rows=rows,
                cols=cols,
            )

        return cls(client, client._run(make()))

    @property
    def before(self) -> bytes:
        """What came before the last match."""
        return self.aio.before

    @property
    def buffer(self) -> bytes:
        """Output not consumed by a match yet."""
        return bytes(self.aio.buffer)

    @property
    def dropped(self) -> int:
        """Bytes dropped from the front of the buffer (over its bound)."""
        return self.aio.dropped

    def send(self, data: bytes | str) -> None:
        """Type ``data`` into the terminal."""
        self._client._run(self.aio.send(data))

    def sendline(self, text: bytes | str = b"") -> None:
        """Type ``text`` and a newline."""
        self._client._run(self.aio.sendline(text))

    def interrupt(self) -> None:
        """Ctrl-C for the program in the foreground."""
        self._client._run(self.aio.interrupt())

    def resize(self, rows: int, cols: int) -> None:
        """Resize the terminal; the program gets SIGWINCH."""
        self._client._run(self.aio.resize(rows, cols))

    def send_eof(self) -> None:
        """^D: the end of input for a read at the start of a line."""
        self._client._run(self.aio.send_eof())

    def expect(self, pattern: bytes | str | re.Pattern[bytes], timeout: float) -> re.Match[bytes]:
        """Block up to ``timeout`` s for ``pattern`` (see :meth:`Expect.expect`)."""
        return self._client._run(self.aio.expect(pattern, timeout))

    def wait(self, timeout: float) -> ShellResult:
        """The command's result once it has ended, within ``timeout`` s."""
        return self._client._run(self.aio.wait(timeout))

    def close(self) -> None:
        """Stop reading; a command still running is interrupted (as :meth:`Expect.close`)."""
        self._client._run(self.aio.close())

    def __enter__(self) -> SyncExpect:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
