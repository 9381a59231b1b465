"""A guestd on a small file system of its own, and the probes the tests that use it read:
guestd runs in a private mount namespace (``unshare -m --propagation private``) with its
runtime directory on a tmpfs or a loop-mounted ext4 mounted only there, so nothing stays
mounted on this machine once guestd ends; ``frozen`` makes that file system's writes block for
real (fsfreeze). The tests reach it through ``/proc/<guestd pid>/root``."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

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

needs_freeze = pytest.mark.skipif(  # a loop-mounted ext4 (tmpfs cannot be frozen)
    any(shutil.which(tool) is None for tool in ("fsfreeze", "mkfs.ext4", "nsenter"))
    or not os.path.exists("/dev/loop-control"),
    reason="needs fsfreeze, mkfs.ext4, nsenter and loop devices (/dev/loop-control)",
)
MIB = 1024 * 1024


@contextmanager
def frozen(g: Guestd, rt_inside: str) -> Iterator[None]:
    """The file system at ``rt_inside`` (a path in guestd's mount namespace) frozen
    (``fsfreeze -f``: writes block) for the block's duration; thawed in every case."""
    ns = ["nsenter", "-t", str(g.pid), "-m", "fsfreeze"]
    subprocess.run([*ns, "-f", rt_inside], check=True, capture_output=True)
    try:
        yield
    finally:
        subprocess.run([*ns, "-u", rt_inside], check=True, capture_output=True)


async def until(cond: object, polls: int = 1200) -> None:
    """Poll ``cond()`` every 25 ms until it holds (bounded: 1200 looks, then fail)."""
    for _ in range(polls):
        if cond():  # type: ignore[operator]
            return
        await asyncio.sleep(0.025)
    raise AssertionError(f"never happened: {cond}")


def io_thread_blocked(pid: int) -> bool:
    """One of guestd's threads (the event loop's is the main one: an I/O thread) sleeps in the
    kernel uninterruptibly (state D): file-system work waiting on the frozen file system."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        if tid == str(pid):
            continue
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if stat[stat.rindex(")") + 2 :].startswith("D"):
            return True
    return False


@contextmanager
def private_fs_guestd(fs: str, size_mib: int, config: str = "") -> Iterator[tuple[Guestd, str, str]]:
    """A guestd whose runtime directory is a ``size_mib`` MiB tmpfs or ext4 (``fs``) mounted in
    a private mount namespace of guestd's own; yields ``(guestd, runtime dir as seen from
    here through /proc/<pid>/root, runtime dir as guestd sees it)``."""
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
        yield g, f"/proc/{g.pid}/root{rt}", rt
    finally:
        g.stop()
        shutil.rmtree(top, ignore_errors=True)


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def settled(count: Callable[[], int], want: int, polls: int = 200) -> int:
    """``count()`` once it is back to ``want``, or as it stands after ``polls`` looks 50 ms apart."""
    for _ in range(polls):
        n = count()
        if n <= want:
            return n
        time.sleep(0.05)
    return count()


def assert_fds_back_to(pid: int, want: int) -> None:
    """guestd's fd count settles back to ``want``; else what its fds name is the message."""
    assert settled_fd_count(pid, want) == want, " ".join(fd_targets(pid))


def settled_fd_count(pid: int, want: int, polls: int = 200) -> int:
    """guestd's fd count once it is back to ``want`` (a closed connection's fd goes when
    guestd reads its EOF)."""
    return settled(lambda: fd_count(pid), want, polls)


def fd_targets(pid: int) -> list[str]:
    """What guestd's fds name (for a failure's message)."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.append(f"{fd}->{os.readlink(f'/proc/{pid}/fd/{fd}')}")
        except OSError:
            pass
    return out
