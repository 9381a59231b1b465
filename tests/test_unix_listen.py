"""A guestd's Unix socket path (issue 30, item 8): a second guestd started on a path a live
guestd serves refuses and exits nonzero (it took the path over and, on exit, removed it,
leaving the first unreachable); a stale socket file is replaced; on exit a guestd removes the
path only when it is still its own socket."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import pytest

from guestd.testing import Guestd, scratch_guestd
from guestd.testing.local import REPO, start_guestd


@pytest.fixture
def first() -> Iterator[Guestd]:
    with scratch_guestd("guestd-listen-", "--code-pool", "0") as g:
        yield g


def _second_guestd(path: str, workdir: str) -> tuple[int, str]:
    """A second guestd on ``path``: (exit status, stderr) once it ended without serving. One
    that says it is ready took the path over: it is killed and the test fails."""
    r, w = os.pipe()
    argv = [sys.executable, "-m", "guestd", "--ready-fd", str(w), "--listen", f"unix:{path}"]
    with open(f"{workdir}/second.log", "wb") as log:
        proc = subprocess.Popen(
            [*argv, "--runtime-dir", f"{workdir}/rt2", "--code-pool", "0"],
            env={**os.environ, "PYTHONPATH": REPO},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            pass_fds=(w,),
        )
    os.close(w)
    with os.fdopen(r, "rb") as ready:
        line = ready.readline()  # "ready" once it serves; EOF when it exits first
    if line:
        proc.kill()
        proc.wait()
        pytest.fail(f"a second guestd took over {path}")
    status = proc.wait()
    with open(f"{workdir}/second.log") as f:
        return status, f.read()


def test_a_second_guestd_refuses_a_path_a_live_guestd_serves(first: Guestd) -> None:
    before = os.lstat(first.sock_path)
    status, stderr = _second_guestd(first.sock_path, first.workdir)
    assert status != 0, stderr
    assert f"unix:{first.sock_path}" in stderr and "refusing to take it over" in stderr, stderr
    now = os.lstat(first.sock_path)
    assert (now.st_dev, now.st_ino) == (before.st_dev, before.st_ino), "the path was replaced"
    with first.client() as c:
        c.ping()  # the first guestd is still reachable at its path
    assert first.alive()


def test_a_stale_socket_file_is_replaced() -> None:
    with tempfile.TemporaryDirectory(prefix="guestd-listen-") as d:
        path = f"{d}/guestd.sock"
        stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stale.bind(path)  # a socket file nobody listens on: a guestd that was killed
        stale.close()
        g = start_guestd(d, "--runtime-dir", f"{d}/rt", "--code-pool", "0")
        try:
            with g.client() as c:
                c.ping()
        finally:
            g.stop()
        assert not os.path.exists(path), "a guestd removes its own socket on exit"


def test_on_exit_a_guestd_leaves_a_path_that_is_no_longer_its_socket(first: Guestd) -> None:
    os.unlink(first.sock_path)  # someone else took the path since (a newer server)
    newer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        newer.bind(first.sock_path)
        newer.listen(1)
        theirs = os.lstat(first.sock_path)
        first.stop()
        assert first.proc.returncode == 0, first.log()
        now = os.lstat(first.sock_path)  # FileNotFoundError: the exiting guestd removed theirs
        assert (now.st_dev, now.st_ino) == (theirs.st_dev, theirs.st_ino)
    finally:
        newer.close()
