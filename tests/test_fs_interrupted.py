"""Issue 15, defect 6: a guestd killed in the middle of writes and uploads leaves no temp file
once the next guestd has started (where the file system has O_TMPFILE, a temp name exists
only for the instant between an overwrite's link and its rename, recorded first), and the
target is always the complete old or the complete new content."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from guestd.client import AsyncClient
from guestd.testing import REPO, Guestd, start_guestd
from guestd.testing.rawwire import RawPeer
from guestd.wire.frames import Kind
from tests.helpers import KILLED_BETWEEN_LINK_AND_RENAME

OLD = b"old\n" * 1000
NEW = b"N" * (4 << 20)


async def _write_and_kill(g: Guestd, targets: list[str], delay: float, after_a_temp_name: bool = False) -> None:
    """Three writes at once on one connection; guestd is SIGKILLed ``delay`` seconds in (with
    ``after_a_temp_name``: seconds after a temp name shows beside the targets, so that on a
    loaded machine the kill still lands while a write is in progress)."""
    async with await AsyncClient.connect(g.address) as c:
        jobs = [
            asyncio.ensure_future(c.upload(NEW, targets[0], deadline=10)),
            asyncio.ensure_future(c.write_file(targets[1], NEW, deadline=10)),
            asyncio.ensure_future(c.write_file(targets[2], NEW, flag="create", deadline=10)),
        ]
        if after_a_temp_name:
            for _ in range(2000):  # bounded: about 10 s
                if _temp_names(os.path.dirname(targets[0])) or all(j.done() for j in jobs):
                    break
                await asyncio.sleep(0.005)
        await asyncio.sleep(delay)
        os.kill(g.pid, signal.SIGKILL)
        await asyncio.gather(*jobs, return_exceptions=True)  # they fail: guestd is gone


def _temp_names(directory: str) -> list[str]:
    return [n for n in os.listdir(directory) if not n.startswith("t")]


def _content(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_sigkill_during_writes_and_uploads_leaves_no_temp_file_and_a_whole_target() -> None:
    work = tempfile.mkdtemp(prefix="guestd-kill-")
    data = os.path.join(work, "data")
    os.mkdir(data)
    rng = random.Random(1415)
    try:
        for i in range(50):
            targets = [os.path.join(data, f"t{k}") for k in range(3)]
            for path in targets:
                with open(path, "wb") as out:
                    out.write(OLD)
            g = start_guestd(tempfile.mkdtemp(prefix="guestd-kill-run-", dir=work))
            asyncio.run(_write_and_kill(g, targets, rng.uniform(0.0, 0.08)))
            g.proc.wait(10)
            assert _content(targets[0]) in (OLD, NEW), f"round {i}: the upload's target is torn"
            assert _content(targets[1]) in (OLD, NEW), f"round {i}: the write's target is torn"
            assert _content(targets[2]) == OLD  # "create" on an existing file never replaces it
            # Under O_TMPFILE the only name a kill can leave is an overwrite's, between link and
            # rename (CI hit it once in about 200 rounds); the next guestd removes it.
            restarted = start_guestd(g.workdir)
            restarted.stop()
            assert _temp_names(data) == [], f"round {i}: temp files left"
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_a_guestd_killed_between_an_overwrites_link_and_rename_has_its_temp_name_removed(tmp_path: Path) -> None:
    """The one name an O_TMPFILE overwrite makes (linked, then renamed over the target) is
    recorded before the link, so the next guestd removes it. Before: left forever (CI, round 43)."""
    data, runtime = tmp_path / "data", tmp_path / "runtime"
    data.mkdir()
    target = data / "t0"
    target.write_bytes(OLD)
    child = subprocess.run(
        [sys.executable, "-c", KILLED_BETWEEN_LINK_AND_RENAME, str(target), str(runtime / "pending-writes")],
        env={**os.environ, "PYTHONPATH": REPO},
        capture_output=True,
        timeout=60,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()
    left = _temp_names(str(data))
    assert len(left) == 1 and ".guestd-tmp-" in left[0]  # the window is real
    assert target.read_bytes() == OLD
    (tmp_path / "run").mkdir()
    start_guestd(str(tmp_path / "run"), "--runtime-dir", str(runtime)).stop()
    assert _temp_names(str(data)) == []
    assert target.read_bytes() == OLD


def _tmpfile_unsupported(directory: str) -> bool:
    try:
        os.close(os.open(directory, os.O_TMPFILE | os.O_WRONLY, 0o600))
    except OSError:
        return True
    return False


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("bindfs") is None, reason="needs root and bindfs (FUSE)")
def test_named_temp_files_where_there_is_no_o_tmpfile_are_removed_by_the_next_guestd() -> None:
    """FUSE (bindfs here), NFS and vfat have no O_TMPFILE: writes there use a named temp file,
    recorded under the runtime dir first; a guestd SIGKILLed mid-write leaves it, and the next
    guestd to start removes it. A live guestd's temp files are never touched."""
    work = tempfile.mkdtemp(prefix="guestd-kill-fuse-")
    backing, data = os.path.join(work, "backing"), os.path.join(work, "data")
    os.mkdir(backing)
    os.mkdir(data)
    subprocess.run(["bindfs", backing, data], check=True)
    rng = random.Random(1516)
    left_then_removed = 0
    try:
        assert _tmpfile_unsupported(data), "bindfs grew O_TMPFILE: find another file system without it"
        runtime = os.path.join(work, "runtime")  # shared by every guestd of the test, as /run/guestd is
        for i in range(20):
            targets = [os.path.join(data, f"t{k}") for k in range(3)]
            for path in targets:
                with open(path, "wb") as out:
                    out.write(OLD)
            g = start_guestd(tempfile.mkdtemp(prefix="run-", dir=work), "--runtime-dir", runtime)
            asyncio.run(_write_and_kill(g, targets, rng.uniform(0.0, 0.02), after_a_temp_name=True))
            g.proc.wait(10)
            left = _temp_names(data)
            assert _content(targets[0]) in (OLD, NEW) and _content(targets[1]) in (OLD, NEW), f"round {i}: torn"
            assert _content(targets[2]) == OLD
            restarted = start_guestd(g.workdir, "--runtime-dir", runtime)
            try:
                assert _temp_names(data) == [], f"round {i}: {left} left, still there after a restart"
                left_then_removed += bool(left)
            finally:
                restarted.stop()
        assert left_then_removed >= 3, "the kills never caught a write in progress: the test tested nothing"
        assert os.listdir(runtime + "/pending-writes") == []
    finally:
        subprocess.run(["umount", data], check=False)
        shutil.rmtree(work, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("bindfs") is None, reason="needs root and bindfs (FUSE)")
def test_a_starting_guestd_leaves_a_live_guestds_temp_files_alone() -> None:
    work = tempfile.mkdtemp(prefix="guestd-live-fuse-")
    backing, data = os.path.join(work, "backing"), os.path.join(work, "data")
    os.mkdir(backing)
    os.mkdir(data)
    subprocess.run(["bindfs", backing, data], check=True)
    runtime = os.path.join(work, "runtime")
    try:
        first = start_guestd(tempfile.mkdtemp(prefix="run-", dir=work), "--runtime-dir", runtime)
        try:
            sock = socket.socket(socket.AF_UNIX)
            sock.connect(first.sock_path)
            peer = RawPeer(sock)
            peer.hello()
            peer.request(5, "file.upload", {"path": f"{data}/held"})
            peer.send(Kind.INPUT, 5, {"data": b"x" * 1000})  # and no eof: the write stays open
            for _ in range(500):
                if _temp_names(data):
                    break
                time.sleep(0.01)
            assert _temp_names(data), "the upload's temp file never appeared"
            os.mkdir(first.workdir + "-2")
            start_guestd(first.workdir + "-2", "--runtime-dir", runtime).stop()
            assert _temp_names(data), "a starting guestd removed a live guestd's temp file"
            peer.send(Kind.CANCEL, 5, {})
            assert peer.recv_final(5)[1]["code"] == "cancelled"
            sock.close()
        finally:
            first.stop()
        assert _temp_names(data) == []  # the aborted upload removed its own
    finally:
        subprocess.run(["umount", data], check=False)
        shutil.rmtree(work, ignore_errors=True)
