"""A real local terminal for guestctl: guestctl runs on a pty that is its controlling terminal,
as in a person's shell, so raw mode, typed keys, window-size changes and the modes put back at
the end are all real (used by the terminal, live and habits tests of the CLI)."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import termios
import time

import pytest

from guestd.testing import REPO

WAIT_S = 30.0


class LocalTerminal:
    """guestctl on a pty of its own: type into it, read what it shows, resize it."""

    def __init__(self, argv: list[str], rows: int, cols: int) -> None:
        self.master, slave = pty.openpty()
        self.resize(rows, cols)
        self.modes_before = termios.tcgetattr(slave)
        self.slave = slave  # kept open: the modes are read back from it at the end
        self.proc = subprocess.Popen(
            argv,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env={**os.environ, "PYTHONPATH": REPO},
            start_new_session=True,
            # The pty becomes guestctl's controlling terminal: SIGWINCH reaches it on a resize.
            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
        )
        self.shown = bytearray()

    def resize(self, rows: int, cols: int) -> None:
        fcntl.ioctl(self.master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    def type(self, keys: bytes) -> None:
        os.write(self.master, keys)

    def wait_for(self, pattern: bytes, start: int = 0) -> re.Match[bytes]:
        """The first match of ``pattern`` in what was shown from ``start`` (bounded wait)."""
        deadline = time.monotonic() + WAIT_S
        while (found := re.compile(pattern).search(self.shown, start)) is None:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.master], [], [], max(left, 0))
            if not ready:
                pytest.fail(f"{pattern!r} not shown within {WAIT_S} s: {bytes(self.shown)!r}")
            try:
                chunk = os.read(self.master, 65536)
            except OSError:  # EIO: guestctl has exited and closed its side
                pytest.fail(f"{pattern!r} not shown before guestctl ended: {bytes(self.shown)!r}")
            self.shown += chunk
        return found

    def exit_code(self) -> int:
        try:
            return self.proc.wait(timeout=WAIT_S)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)
        os.close(self.slave)
