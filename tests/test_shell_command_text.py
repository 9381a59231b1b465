"""A shell command's text, against a real guestd with real bash: bash runs the text the client
sent, all of it or nothing, and in pty mode as in the plain mode (guestd's wrapper around it
is not the command's to bend). The script builder itself: tests/test_shell_script.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from guestd.client import AsyncClient, Client, GuestdError, ShellResult
from guestd.client.expect import Expect
from guestd.testing import Guestd


def test_a_command_with_a_nul_byte_is_refused_and_nothing_runs(client: Client, tmp_path: Path) -> None:
    """bash cannot hold a NUL: guestd ran the text up to it (``touch ran`` below), silently,
    and reported success for a command it had cut."""
    sid = client.shell_create(cwd=str(tmp_path)).id
    try:
        for command, syntax in (("touch ran\0; echo rest", False), ("\0", False), ("touch ran\0 x", True)):
            with pytest.raises(GuestdError) as ei:
                client.shell_run(sid, command, check_syntax=syntax, timeout_s=10)
            assert (ei.value.code, ei.value.details.get("field")) == ("bad_request", "command"), ei.value
        assert not (tmp_path / "ran").exists()
        assert client.shell_run(sid, "echo fine", timeout_s=10).stdout == b"fine\n"
    finally:
        client.shell_close(sid)


async def _on_a_terminal(c: AsyncClient, sid: str, command: str) -> tuple[bytes, ShellResult]:
    async with Expect.start(c, sid, command, timeout_s=20) as e:
        result = await e.wait(timeout=30)
        return bytes(e.buffer), result


# Text that runs in the plain mode (and with bash -c) but could not end guestd's `{ ... }`
# around a pty command: status 2 and not a byte on the terminal, the syntax error included.
PTY_TEXT = [
    ("cat <<EOF\nhello", b"hello\r\n", 0),  # a heredoc ended by the end of the text
    ("echo trailing \\", b"trailing \\\r\n", 0),
    ("echo one\n}; echo two", b"one\r\n", 2),  # a syntax error after what ran
    ("echo (", b"syntax error", 2),
]


def test_a_pty_command_runs_as_the_same_text_runs_without_one(guestd: Guestd, tmp_path: Path) -> None:
    async def go() -> None:
        c = await AsyncClient.connect(guestd.address)
        sid = (await c.shell_create(cwd=str(tmp_path))).id
        try:
            for command, shown, status in PTY_TEXT:
                plain = await c.shell_run(sid, command, timeout_s=20)
                assert plain.exit_code == status, (command, plain)
                seen, r = await _on_a_terminal(c, sid, command)
                assert (shown in seen, r.exit_code, r.timed_out) == (True, status, None), (command, seen, r)
            # guestd's own words in the wrapper are not the session's aliases
            await c.shell_run(sid, "alias builtin=echo exec=echo; unset TERM", timeout_s=20)
            seen, r = await _on_a_terminal(c, sid, 'echo "[$TERM]"; [ -t 1 ] && echo on-a-tty')
            assert (seen, r.exit_code) == (b"[xterm-256color]\r\non-a-tty\r\n", 0)
            assert (await c.shell_run(sid, "echo after", timeout_s=20)).stdout == b"after\n"
        finally:
            await c.shell_close(sid)
            await c.close()

    asyncio.run(go())
