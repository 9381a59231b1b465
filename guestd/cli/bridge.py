"""This terminal bridged to one in the guest (``exec --pty``, ``shell run --pty``): raw mode while
the bridge is open, keystrokes and window-size changes forwarded, and the terminal's modes put
back however it ends (the tty settings, and the screen modes the remote program may have left on).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import termios
import tty
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

from guestd.cli import terminal

DEFAULT_SIZE = os.terminal_size((80, 24))  # stdout is not a terminal, or one that reports no size


def local_size() -> os.terminal_size:
    """This terminal's size for the remote one; 24x80 for what it does not report (a pipe, or a
    terminal that says 0x0: some CI runners, emacs shells, docker wrappers), as ssh does."""
    if not sys.stdout.isatty():
        return DEFAULT_SIZE
    try:
        size = os.get_terminal_size(sys.stdout.fileno())
    except OSError:
        return DEFAULT_SIZE
    return os.terminal_size((size.columns or DEFAULT_SIZE.columns, size.lines or DEFAULT_SIZE.lines))


class TerminalBridge:
    """Call :meth:`open` around the loop that writes the remote output to :attr:`out`.

    ``on_input`` gets each read from stdin (``b""`` once, at its end); ``on_resize`` the new
    size. Both hand their requests to :meth:`spawn`, whose tasks are cancelled at close."""

    def __init__(self, raw: bool) -> None:
        self.loop = asyncio.get_running_loop()
        self.fd = sys.stdin.fileno()
        self.interactive = os.isatty(self.fd)  # typed keys, not a pipe or file
        self.out = terminal.stdout(raw, pty=True)
        self._pending: list[asyncio.Task[Any]] = []

    def spawn(self, request: Coroutine[Any, Any, Any]) -> None:
        task = self.loop.create_task(request)
        task.add_done_callback(_typed_after_the_end)
        self._pending.append(task)

    @contextlib.contextmanager
    def open(
        self, on_input: Callable[[bytes], None], on_resize: Callable[[os.terminal_size], None]
    ) -> Iterator[terminal.StreamOut]:
        def on_readable() -> None:
            data = os.read(self.fd, 4096)
            if not data:
                self.loop.remove_reader(self.fd)
            on_input(data)

        saved = termios.tcgetattr(self.fd) if self.interactive else None
        follows_size = self.interactive and sys.stdout.isatty()
        pollable = True
        try:
            if self.interactive:
                tty.setraw(self.fd)
            if follows_size:
                self.loop.add_signal_handler(signal.SIGWINCH, lambda: on_resize(local_size()))
            try:
                self.loop.add_reader(self.fd, on_readable)
            except OSError:  # epoll refuses plain files and /dev/null: nothing to forward then
                pollable = False
            yield self.out
        finally:
            self.out.close()
            if pollable:
                self.loop.remove_reader(self.fd)
            if follows_size:
                self.loop.remove_signal_handler(signal.SIGWINCH)
            if sys.stdout.isatty():
                sys.stdout.buffer.write(terminal.RESET_MODES)
                sys.stdout.flush()
            if saved is not None:
                termios.tcsetattr(self.fd, termios.TCSADRAIN, saved)
            for task in self._pending:
                task.cancel()


def _typed_after_the_end(task: asyncio.Task[Any]) -> None:
    """Keys typed after the command ended (write_stdin's BrokenPipeError) are dropped, as a
    terminal drops them; any other failure still surfaces when the task is collected."""
    if task.cancelled():
        return
    exc = task.exception()  # retrieved: asyncio no longer reports it by itself
    if exc is not None and not isinstance(exc, BrokenPipeError):
        task.get_loop().call_exception_handler({"message": "sending input failed", "exception": exc, "task": task})
