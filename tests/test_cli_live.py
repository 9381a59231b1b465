"""guestctl exec / sh / shell run as people pipe and type into them (issues 30 and 31): output
live and whole in a pipe, local stdin streamed as it is read (500 MB with guestd's memory
bounded, typed lines echoed by cat one by one), cuts never silent, and every flag of
``exec --detach`` / ``exec --pty`` honoured or refused. guestctl runs as a real process
against a real guestd (the fake guest only where a guest must misbehave)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from guestd.testing import REPO, Guestd, StartGuestd
from guestd.testing.fakeguest import FakeGuest, answers, exec_reply
from guestd.testing.rawwire import RawPeer
from guestd.wire.frames import Kind
from tests.helpers import peak_rss
from tests.terminal import LocalTerminal

WAIT_S = 60.0
MiB = 1024 * 1024
ENV = {**os.environ, "PYTHONPATH": REPO}


def popen(argv: list[str], **kw: Any) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, env=ENV, **kw)


def read_until(fd: int, marker: bytes, got: bytearray) -> None:
    """Read ``fd`` into ``got`` until it holds ``marker`` (bounded wait)."""
    deadline = time.monotonic() + WAIT_S
    while marker not in got:
        ready, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0))
        if not ready:
            pytest.fail(f"{marker!r} not read within {WAIT_S} s: {bytes(got)!r}")
        chunk = os.read(fd, 65536)
        if not chunk:
            pytest.fail(f"{marker!r} not read before the end: {bytes(got)!r}")
        got += chunk


@pytest.fixture
def session(guestd: Guestd) -> Iterator[str]:
    sid = guestd.guestctl("shell", "new").stdout.decode().strip()
    yield sid
    guestd.guestctl("shell", "rm", sid)


# -- whole output in a pipe ---------------------------------------------------------------------
def test_sh_in_a_pipe_gets_the_whole_output(guestd: Guestd, session: str) -> None:
    """Was: the last 64 KiB only (10,923 of 100,000 lines), exit 0."""
    expected = "".join(f"{i}\n" for i in range(1, 1_000_001)).encode()
    for args in (
        ("sh", "seq 1 1000000"),
        ("exec", "--", "seq", "1", "1000000"),
        ("shell", "run", session, "seq 1 1000000"),
    ):
        r = guestd.guestctl(*args)
        assert (r.returncode, r.stderr) == (0, b""), (args, r.stderr)
        assert r.stdout == expected, (args, r.stdout.count(b"\n"))
    r = guestd.guestctl("sh", "--merge-stderr", "seq 1 100000 >&2; echo end")
    assert (r.returncode, r.stdout.count(b"\n"), r.stderr) == (0, 100001, b"")


def test_live_output_reaches_a_pipe_before_the_command_ends(guestd: Guestd, session: str, tmp_path: Path) -> None:
    """Was: nothing until the command ended."""
    for n, args in enumerate((["sh"], ["shell", "run", session])):
        release = tmp_path / f"release{n}"
        command = f"echo first; while [ ! -e {release} ]; do sleep 0.02; done; echo second >&2"
        proc = popen(guestd.guestctl_argv(*args, command), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            assert proc.stdout is not None
            got = bytearray()
            read_until(proc.stdout.fileno(), b"first\n", got)
            assert proc.poll() is None  # still waiting for the release: the line came live
            release.touch()
            rest, err = proc.communicate(timeout=WAIT_S)
            assert (proc.returncode, bytes(got) + rest, err) == (0, b"first\n", b"second\n")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_reader_that_goes_away_cancels_the_command_quietly(guestd: Guestd) -> None:
    """``| head``: exit 141 as SIGPIPE would, nothing on stderr, the command ends in the guest.
    Was: exit 1 with a Broken pipe error (and the command ran on until the connection closed)."""
    marker = "100000007"
    proc = popen(guestd.guestctl_argv("exec", "--", "seq", "1", marker), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    got = bytearray()
    read_until(proc.stdout.fileno(), b"1\n2\n", got)
    proc.stdout.close()
    assert proc.wait(timeout=WAIT_S) == 141
    assert proc.stderr.read() == b""
    deadline = time.monotonic() + WAIT_S
    while any(p.info["cmdline"] == ["seq", "1", marker] for p in psutil.process_iter(["cmdline"])):
        assert time.monotonic() < deadline, "the remote seq still runs"
        time.sleep(0.05)


def test_a_stream_shorter_than_the_guest_says_is_reported_and_fails(fake_guest: Any) -> None:
    """A guest whose stream ends before the bytes it counts: said on stderr, exit 1, never 0."""

    def exec_answer(peer: RawPeer, rid: int, args: dict[str, Any]) -> None:
        assert args.get("stream") is True
        peer.send(Kind.EVENT, rid, {"ev": "stdout", "data": b"abc"})
        peer.send(Kind.RESPONSE, rid, {**exec_reply(), "stdout_bytes": 10})

    g: FakeGuest = fake_guest(answers({"exec": exec_answer}))
    r = subprocess.run(
        [sys.executable, "-m", "guestd.cli", "--connect", g.address, "sh", "x"],
        capture_output=True,
        timeout=WAIT_S,
        env=ENV,
        stdin=subprocess.DEVNULL,
    )
    assert (r.returncode, r.stdout) == (1, b"abc")
    assert b"stdout cut: 7 of 10 bytes did not arrive" in r.stderr


# -- stdin streamed ---------------------------------------------------------------------------
def test_500_mb_through_exec_stdin_reach_sha256sum_with_guestd_memory_bounded(fresh_guestd: StartGuestd) -> None:
    """Was: stdin read whole and sent as one frame (above 4 MiB: too_large)."""
    g = fresh_guestd()
    assert g.guestctl("exec", "-i", "--", "sha256sum", stdin=b"warm").returncode == 0
    before = peak_rss(g.pid)
    block = bytearray(os.urandom(MiB))
    local = hashlib.sha256()
    proc = popen(
        g.guestctl_argv("exec", "-i", "--", "sha256sum"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdin is not None
    try:
        for i in range(500):
            block[:8] = i.to_bytes(8, "big")  # no two MiB alike
            local.update(block)
            proc.stdin.write(block)
        proc.stdin.close()
        proc.stdin = None  # closed: communicate only reads
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert (proc.returncode, err) == (0, b"")
    assert out.split()[0].decode() == local.hexdigest()
    growth = peak_rss(g.pid) - before
    assert growth < 64 * MiB, f"guestd's peak RSS grew {growth / MiB:.1f} MiB"


def test_stdin_above_one_frame_in_bounded_runs_and_sessions(guestd: Guestd, session: str) -> None:
    """-i streams in every mode: with --max-output and in a shell session too (was too_large)."""
    data = os.urandom(5 * MiB)
    r = guestd.guestctl("exec", "-i", "--max-output", "100", "--", "wc", "-c", stdin=data)
    assert (r.returncode, r.stdout.strip()) == (0, b"5242880"), r.stderr
    r = guestd.guestctl("shell", "run", "-i", session, "wc -c", stdin=data)
    assert (r.returncode, r.stdout.strip()) == (0, b"5242880"), r.stderr
    r = guestd.guestctl("--json", "shell", "run", "--stdin", session, "head -c 3", stdin=b"\xff" + data)
    # Not UTF-8: the exact bytes as {"base64"} (was: a lossy str with U+FFFD).
    expected = {"base64": base64.b64encode(b"\xff" + data[:2]).decode()}
    assert r.returncode == 0 and json.loads(r.stdout)["stdout"] == expected


def test_lines_typed_into_cat_come_back_one_by_one(guestd: Guestd) -> None:
    """Was: nothing before ^D (stdin was read to its end first)."""
    term = LocalTerminal(guestd.guestctl_argv("exec", "-i", "--", "cat"), rows=24, cols=80)
    try:
        term.type(b"hello\r")
        # the local terminal echoes the line, then cat writes it back
        after = term.wait_for(rb"hello\r\nhello\r\n").end()
        term.type(b"world\r")
        term.wait_for(rb"world\r\nworld\r\n", after)
        term.type(b"\x04")  # ^D: end of input, cat ends
        assert term.exit_code() == 0
    finally:
        term.close()
    term = LocalTerminal(guestd.guestctl_argv("exec", "-i", "--", "cat"), rows=24, cols=80)
    try:
        term.type(b"x\r")
        term.wait_for(rb"x\r\nx\r\n")
        term.type(b"\x03")  # ^C kills the command, not guestd
        assert term.exit_code() == 130
    finally:
        term.close()
    assert guestd.alive() and guestd.guestctl("ping").returncode == 0


# -- --pty and --detach: flags honoured or refused --------------------------------------------
def test_pty_timeouts_end_the_command(guestd: Guestd) -> None:
    """Was: --timeout ignored (``--pty --timeout 1 sleep 30`` ran 30 s). The bounded waits below
    are shorter than the commands: returning at all is the timeout's doing."""
    r = guestd.guestctl("exec", "--pty", "--timeout", "1", "--", "sleep", "30", timeout=25)
    assert r.returncode == 124 and b"wall timeout fired" in r.stderr
    r = guestd.guestctl(
        "exec", "--pty", "--idle-timeout", "1", "--", "sh", "-c", "trap '' TERM; echo hi; sleep 30", timeout=25
    )  # TERM ignored: KILL after the grace
    assert r.returncode == 124 and b"idle timeout fired" in r.stderr
    r = guestd.guestctl("exec", "--pty", "--timeout", "0.5", "--on-timeout", "detach", "--", "sleep", "30", timeout=25)
    assert r.returncode == 124 and b"goes on as process" in r.stderr
    process_id = r.stderr.split(b"goes on as process ")[1].split()[0].decode()
    assert guestd.guestctl("kill", process_id, "KILL").returncode == 0
    assert guestd.guestctl("wait", process_id).returncode == 137


def test_pty_under_a_terminal_of_0x0_runs_at_24x80(guestd: Guestd) -> None:
    """Was: ``field 'rows' must be >= 1``."""
    term = LocalTerminal(guestd.guestctl_argv("exec", "--pty", "--", "stty", "size"), rows=0, cols=0)
    try:
        term.wait_for(rb"24 80")
        assert term.exit_code() == 0
    finally:
        term.close()


def test_flags_that_cannot_apply_are_usage_errors(guestd: Guestd, session: str) -> None:
    for args in (
        ("exec", "--detach", "--timeout", "1", "--", "true"),
        ("exec", "--detach", "--idle-timeout", "1", "--", "true"),
        ("exec", "--detach", "--on-timeout", "detach", "--", "true"),
        ("exec", "--pty", "--max-output", "5", "--", "true"),
        ("exec", "--pty", "--spill", "--", "true"),
        ("shell", "run", "--pty", "--keep", session, "true"),
        ("exec",),
    ):
        r = guestd.guestctl(*args, timeout=WAIT_S)
        assert r.returncode == 2 and b"guestctl" in r.stderr, (args, r)
    r = guestd.guestctl("exec", "--detach", "--timeout", "1", "--", "true")
    assert b"--timeout cannot apply with --detach" in r.stderr


def test_detach_keeps_merge_stderr_max_output_and_pty(guestd: Guestd) -> None:
    """Was: --merge-stderr and --max-output dropped, and --detach --pty bridged the terminal."""
    r = guestd.guestctl(
        "exec", "--detach", "--merge-stderr", "--max-output", "10", "--", "sh", "-c", "echo 0123456789abc; echo err >&2"
    )
    process_id = r.stdout.decode().strip()
    assert r.returncode == 0 and guestd.guestctl("wait", process_id).returncode == 0
    r = guestd.guestctl("attach", process_id)
    assert (r.returncode, r.stdout) == (0, b"89abc\nerr\n")  # one stream, a ring of 10 bytes
    r = guestd.guestctl("exec", "--detach", "--pty", "--", "sh", "-c", "test -t 1 && echo on-a-tty")
    process_id = r.stdout.decode().strip()
    assert r.returncode == 0 and guestd.guestctl("wait", process_id).returncode == 0
    assert guestd.guestctl("attach", process_id).stdout == b"on-a-tty\r\n"
