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
from typing import TYPE_CHECKING

from guestd.client._blocking import SyncExpectBase
from guestd.client.expect import ExpectEOF

if TYPE_CHECKING:
    from guestd.client.results import ShellResult

__all__ = ["ExpectEOF", "SyncExpect"]


class SyncExpect(SyncExpectBase):
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
