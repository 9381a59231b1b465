"""A shell command's text, against a real guestd with real bash: bash runs the text the client
sent, all of it or nothing, and in pty mode as in the plain mode (guestd's wrapper around it
is not the command's to bend). The script builder itself: tests/test_shell_script.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from guestd.client import Client, GuestdError


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
