"""guestctl's terminal bridges (``exec --pty``, ``shell run --pty``) driven from a real local
terminal: guestctl runs on a pty that is its controlling terminal, as in a person's shell, so
raw mode, typed ^C, window-size changes and the modes put back at the end are all real."""

from __future__ import annotations

import termios

import pytest

from guestd.testing import Guestd
from tests.terminal import LocalTerminal

# Prints its terminal's size, then each line typed and the size again; "ready> " (printed by
# bash's read itself) says it waits for a line: a ^C typed before, while bash waits for a stty
# that has already exited, is lost (as in any terminal: CI saw guestctl wait on, read blocked).
SIZE_LOOP = 'stty size; while read -r -p "ready> " line; do echo "got:$line"; stty size; done'


def see_size_reach_the_command(term: LocalTerminal, size: bytes) -> None:
    """The resize travels on its own request: type lines until the command prints ``size``."""
    for attempt in range(50):
        mark = len(term.shown)
        term.type(f"probe{attempt}\r".encode())
        seen = term.wait_for(rb"got:probe\d+\r\n(\d+ \d+)\r\nready> ", mark)
        if seen.group(1) == size:
            return
    pytest.fail(f"the resize never reached the command: {bytes(term.shown)!r}")


def test_shell_run_pty_from_a_terminal_follows_its_size_and_turns_ctrl_c_into_int(guestd: Guestd) -> None:
    """Typed lines reach the command, a local resize reaches its terminal (SIGWINCH, new size),
    typed ^C interrupts only the command (the session goes on), and the local terminal's modes
    are as before once guestctl returns."""
    session = guestd.guestctl("shell", "new").stdout.decode().strip()
    term = LocalTerminal(guestd.guestctl_argv("shell", "run", session, SIZE_LOOP, "--pty"), rows=30, cols=100)
    try:
        term.wait_for(rb"30 100\r\nready> ")
        assert termios.tcgetattr(term.slave)[3] & termios.ECHO == 0  # raw: the remote side echoes
        term.type(b"ada\r")
        after = term.wait_for(rb"got:ada\r\n").end()
        term.wait_for(rb"30 100\r\nready> ", after)
        term.resize(40, 120)
        see_size_reach_the_command(term, b"40 120")
        term.type(b"\x03")
        assert term.exit_code() == 130
        assert termios.tcgetattr(term.slave) == term.modes_before
    finally:
        term.close()
    r = guestd.guestctl("shell", "run", session, "echo still-here")
    assert (r.returncode, r.stdout) == (0, b"still-here\n")
    assert guestd.guestctl("shell", "rm", session).returncode == 0


def test_exec_pty_from_a_terminal_starts_at_its_size_and_puts_its_modes_back(guestd: Guestd) -> None:
    """exec --pty: the remote terminal starts at the local size and follows a resize; what is
    typed (^C included, as a byte: the remote terminal raises the signal) goes through."""
    term = LocalTerminal(guestd.guestctl_argv("exec", "--pty", "--", "bash", "-c", SIZE_LOOP), rows=33, cols=90)
    try:
        term.wait_for(rb"33 90\r\nready> ")
        term.type(b"hello\r")
        term.wait_for(rb"got:hello\r\n33 90\r\nready> ")
        term.resize(35, 91)
        see_size_reach_the_command(term, b"35 91")
        term.type(b"\x03")  # a byte like any other: the remote terminal raises SIGINT itself
        assert term.exit_code() == 130
        assert termios.tcgetattr(term.slave) == term.modes_before
    finally:
        term.close()
