"""The subprocess spawn fallback places a run's extra fds as the clone3 spawn does.

CI's flake "bash did not start within 30 s" (tests/test_runs.py, spawn fallback set, loaded
machine): when the session's status socket was already fd 63 in guestd (bash's CTL_FD), the
fallback's ``dup2(63, 63)`` left guestd's O_CLOEXEC on it, exec closed it, bash's marker went
nowhere ("63: Bad file descriptor") and start waited its 30 s. Under load guestd held more fds
at that moment, so the number came up. The native spawn copies every source above every
target first; now the fallback does too. And a bash that cannot report now fails at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from guestd.children.launch import popen_fallback
from guestd.client import Client
from guestd.shells.control import StatusChannel, socket_pair
from guestd.shells.script import CTL_FD
from guestd.testing.local import start_guestd


def _run_fallback(shell: str, extra: list[tuple[int, int]]) -> subprocess.Popen[bytes]:
    """``bash -c shell`` (dash knows fds 0-9 only) through the fallback spawn, with ``extra`` (source, target) fds."""
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        return popen_fallback(
            ["/bin/bash", "-c", shell], None, None, [(null, 0), (null, 1), (null, 2), *extra], None, False, None
        )
    finally:
        os.close(null)


def _read_all(fd: int) -> bytes:
    out = b""
    while chunk := os.read(fd, 4096):
        out += chunk
    return out


def test_an_extra_fd_already_on_its_target_number_stays_open_across_exec() -> None:
    """{N: N}: the fd guestd holds (O_CLOEXEC, as all of guestd's) is the child's fd N after exec."""
    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        n = w  # the source is already on its number: dup2(n, n) alone would change nothing
        child = _run_fallback(f"echo ok >&{n}", [(n, n)])
        os.close(w)
        w = -1
        assert _read_all(r) == b"ok\n"
        assert child.wait() == 0
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


def test_extra_fds_that_are_each_others_targets_are_both_placed() -> None:
    """(a -> b, b -> a): each source is read before either number is overwritten."""
    ra, wa = os.pipe2(os.O_CLOEXEC)
    rb, wb = os.pipe2(os.O_CLOEXEC)
    try:
        child = _run_fallback(f"echo to-a >&{wb}; echo to-b >&{wa}", [(wa, wb), (wb, wa)])
        os.close(wa)
        os.close(wb)
        assert _read_all(ra) == b"to-a\n"
        assert _read_all(rb) == b"to-b\n"
        assert child.wait() == 0
    finally:
        os.close(ra)
        os.close(rb)


def _free_fds(pid: int, below: int) -> list[int]:
    taken = {int(n) for n in os.listdir(f"/proc/{pid}/fd")}
    return [n for n in range(below) if n not in taken]


@contextlib.contextmanager
def _guestd_fds_filled_to(g: Any, clients: list[Client], second_free: int) -> Iterator[None]:
    """Open connections to ``g`` until its second-lowest free fd is ``second_free``: the next
    socketpair guestd makes has its second end (bash's) on that number."""
    for _ in range(second_free + 8):
        free = _free_fds(g.pid, second_free + 1)
        if len(free) == 2 and free[1] == second_free:
            break
        if len(free) < 2:
            pytest.fail(f"guestd's fds cannot be lined up: free below {second_free + 1}: {free}")
        before = len(free)
        clients.append(g.client())
        for _ in range(1000):  # accepted: one more fd in guestd
            if len(_free_fds(g.pid, second_free + 1)) < before:
                break
            os.sched_yield()
    else:
        pytest.fail(f"guestd's fds cannot be lined up: {_free_fds(g.pid, second_free + 1)}")
    try:
        yield
    finally:
        for c in clients:
            c.close()


def test_a_session_whose_status_socket_is_fd_63_in_guestd_starts_with_the_fallback_spawn(tmp_path: Any) -> None:
    """The CI flake, made to happen: guestd's end for bash is fd 63 (CTL_FD) when the session
    starts. Before the fix, shell.create failed after 30 s ("bash did not start")."""
    g = start_guestd(str(tmp_path), env={"GUESTD_NATIVE_SPAWN": "0"})
    try:
        with g.client() as c:
            c.exec(["true"])  # whatever guestd opens for its first run is open now
            with _guestd_fds_filled_to(g, [], CTL_FD):
                sid = c.shell_create().id
            assert c.shell_run(sid, "echo ready").stdout == b"ready\n"
    finally:
        g.stop()


def test_the_status_channel_says_when_bashs_end_is_gone() -> None:
    """Every copy of bash's end closed (it never had it, or it ended): no marker can come,
    and the channel says so at once (a session's start fails then, not after 30 s)."""

    async def go() -> None:
        ours, theirs = socket_pair()
        channel = StatusChannel(ours, os.getpid())
        channel.expect()
        theirs.close()
        await asyncio.wait_for(channel.writer_gone, 60)
        assert not channel.marker.done()
        channel.close()

    asyncio.run(go())


def test_status_bytes_from_another_process_are_dropped_counted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    """Not bash's pid (SCM_CREDENTIALS): dropped and counted, and logged once."""

    async def go() -> None:
        ours, theirs = socket_pair()
        channel = StatusChannel(ours, os.getpid())
        channel.expect()
        with theirs:
            for _ in range(2):
                other = subprocess.run(
                    [sys.executable, "-c", f"import os; os.write({theirs.fileno()}, b'forged')"],
                    pass_fds=(theirs.fileno(),),
                    check=False,
                )
                assert other.returncode == 0
        await asyncio.wait_for(channel.writer_gone, 60)
        assert channel.forged_bytes == 12 and not channel.marker.done()
        channel.close()

    with caplog.at_level(logging.WARNING, logger="guestd.shells"):
        asyncio.run(go())
    assert len([r for r in caplog.records if "not bash" in r.getMessage()]) == 1
