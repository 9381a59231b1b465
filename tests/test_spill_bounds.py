"""spill: true against its bounds on real, small file systems: the free-space reserve
(``disk_full``), the disk falling behind (``behind``, a frozen ext4), and the races around
the spill directory (concurrent spills and the reserve, forget while reading, the sweep).

Each guestd here runs in a private mount namespace of its own (``unshare -m --propagation
private``) with its runtime directory on a small tmpfs or a loop-mounted ext4 mounted only
there: nothing stays mounted on this machine once guestd ends. The test reaches the file
system through ``/proc/<guestd pid>/root``."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from guestd.client.aio import AsyncClient
from guestd.spill import SPILL_RESERVE_MAX
from guestd.testing import Guestd, start_guestd


def _can_mount() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", "/mnt"],
        capture_output=True,
        check=False,
    )
    return probe.returncode == 0


needs_mounts = pytest.mark.skipif(not _can_mount(), reason="needs root and mount namespaces (unshare -m)")

MIB = 1024 * 1024


@contextmanager
def private_fs_guestd(fs: str, size_mib: int, config: str = "") -> Iterator[tuple[Guestd, str]]:
    """A guestd whose runtime directory is a ``size_mib`` MiB tmpfs or ext4 (``fs``) mounted in
    a private mount namespace of guestd's own; yields ``(guestd, runtime dir as seen from
    here through /proc/<pid>/root)``."""
    top = tempfile.mkdtemp(prefix="guestd-spillfs-")
    rt = f"{top}/rt"
    os.mkdir(rt, 0o700)
    if fs == "tmpfs":
        mount = f'mount -t tmpfs -o size={size_mib}m,mode=0700 tmpfs "$0"'
    else:
        img = f"{top}/fs.img"
        with open(img, "wb") as f:
            f.truncate(size_mib * MIB)
        subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", img], check=True, capture_output=True)
        mount = f'mount -o loop {img} "$0" && chmod 0700 "$0"'
    wrapper = ["unshare", "-m", "--propagation", "private", "sh", "-c", mount + ' && exec "$@"', rt]
    args = ["--runtime-dir", rt]
    if config:
        with open(f"{top}/guestd.toml", "w") as f:
            f.write(config)
        args += ["--config", f"{top}/guestd.toml"]
    g = start_guestd(top, *args, wrapper=wrapper)
    try:
        yield g, f"/proc/{g.pid}/root{rt}"
    finally:
        g.stop()
        shutil.rmtree(top, ignore_errors=True)


def reserve_of(path: str) -> int:
    st = os.statvfs(path)
    return min(SPILL_RESERVE_MAX, st.f_blocks * st.f_frsize // 10)


def free_of(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def numbers(n: int) -> bytes:
    """What ``seq 1 n`` prints."""
    return "".join(f"{i}\n" for i in range(1, n + 1)).encode()


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def settled_fd_count(pid: int, want: int, polls: int = 200) -> int:
    """guestd's fd count once it is back to ``want`` (a closed connection's fd goes when
    guestd reads its EOF), or as it stands after ``polls`` looks 50 ms apart."""
    import time

    for _ in range(polls):
        n = fd_count(pid)
        if n <= want:
            return n
        time.sleep(0.05)
    return fd_count(pid)


def warm_up(g: Guestd) -> int:
    """One exec with spill (the I/O threads and what a first run opens exist from now on);
    guestd's fd count after it."""
    with g.client() as c:
        c.exec("true", spill=True)
    return settled_fd_count(g.pid, 0, polls=10)


@needs_mounts
def test_the_free_space_reserve_stops_a_spill_as_disk_full() -> None:
    """A 24 MiB tmpfs under the spill directory and a command printing ~39 MB: the spill stops
    with disk_full, the file holds exactly the stream's first ``bytes`` bytes, the file system
    keeps its reserve (min(64 MiB, 10% of its size)) free, and guestd goes on answering (an
    exec, and a spill that finds no room stops at byte 0)."""
    full = numbers(5_000_000)
    with private_fs_guestd("tmpfs", 24) as (g, rt):

        async def go() -> None:
            async with await AsyncClient.connect(g.address) as c:
                r = await c.exec("seq 1 5000000", max_output=1000, spill=True)
                assert r.exit_code == 0 and r.stdout_bytes == len(full)
                spill = r.stdout_spill
                assert spill is not None and spill["stopped"] == "disk_full", spill
                here = rt + "/spill/" + os.path.basename(spill["path"])
                size = os.path.getsize(here)
                assert spill["bytes"] == size and 0 < size < len(full)
                with open(here, "rb") as f:
                    assert f.read() == full[:size]
                assert free_of(rt) >= reserve_of(rt), (free_of(rt), reserve_of(rt))
                # Healthy: a plain exec, and a spill with no room left stops at once.
                assert (await c.exec("echo still-here")).stdout == b"still-here\n"
                again = await c.exec("seq 1 100000", max_output=100, spill=True)
                assert again.stdout_spill is not None and again.stdout_spill["stopped"] == "disk_full"
                assert again.stdout_spill["bytes"] == 0
                assert free_of(rt) >= reserve_of(rt)

        asyncio.run(go())
        assert g.alive() and "Traceback" not in g.log(), g.log()


@needs_mounts
def test_concurrent_spills_share_the_free_space_without_eating_the_reserve() -> None:
    """Six runs spill at once (stdout and stderr each) onto a 32 MiB tmpfs, more than it holds:
    every file holds exactly a prefix of its stream with ``bytes`` its size, and together they
    leave the reserve free. Before, each I/O thread checked the free space and then wrote its
    chunk: two writers both took the same room, and the reserve was eaten (or a write failed
    with ENOSPC part-way and ``bytes`` left out what it had written)."""
    n = 1_200_000
    full = numbers(n)
    gen = f"seq 1 {n} & seq 1 {n} >&2; wait"
    with private_fs_guestd("tmpfs", 32) as (g, rt):
        fds_before = warm_up(g)

        async def go() -> None:
            async with await AsyncClient.connect(g.address) as c:
                runs = await asyncio.gather(*(c.exec(gen, max_output=100, spill=True) for _ in range(6)))
                stopped = []
                for r in runs:
                    for spill in (r.stdout_spill, r.stderr_spill):
                        assert spill is not None
                        here = rt + "/spill/" + os.path.basename(spill["path"])
                        with open(here, "rb") as f:
                            data = f.read()
                        assert spill["bytes"] == len(data) and data == full[: len(data)], spill
                        stopped.append(spill["stopped"])
                assert "disk_full" in stopped and set(stopped) <= {None, "disk_full"}, stopped
                assert free_of(rt) >= reserve_of(rt), (free_of(rt), reserve_of(rt))
                assert (await c.exec("echo ok")).stdout == b"ok\n"

        asyncio.run(go())
        assert settled_fd_count(g.pid, fds_before) == fds_before
        assert g.alive() and "Traceback" not in g.log(), g.log()
