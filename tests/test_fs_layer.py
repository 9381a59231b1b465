"""The file-system layer (guestd/files/fs.py) on the real kernel, and what a planted FIFO,
socket or device does to file ops of a real guestd (issue 15, defect 5)."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import socket
import stat
import subprocess
import threading
from collections.abc import Callable

import pytest

from guestd.client import Client, GuestdError
from guestd.files import fs, resolver
from guestd.testing import Guestd

Resolver = Callable[[int, bytes, int, int, int], int]
RESOLVERS: dict[str, Resolver] = {
    "openat2": lambda d, p, f, m, r: resolver.openat2(d, p, f, m, r),
    "walk": lambda d, p, f, m, r: resolver._walk(d, p, f | os.O_CLOEXEC, m, r),  # kernels before 5.6
}


@pytest.fixture
def tree(tmp_path: object) -> str:
    """root/{a/b/file, up -> .., out -> /etc, rel -> a/b, loop -> loop}"""
    root = os.path.join(str(tmp_path), "root")
    os.makedirs(os.path.join(root, "a", "b"))
    with open(os.path.join(root, "a", "b", "file"), "w") as f:
        f.write("inside")
    os.symlink("..", os.path.join(root, "up"))
    os.symlink("/etc", os.path.join(root, "out"))
    os.symlink("a/b", os.path.join(root, "rel"))
    os.symlink("loop", os.path.join(root, "loop"))
    return root


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 100)
    finally:
        os.close(fd)


@pytest.mark.parametrize("how", list(RESOLVERS))
def test_beneath_keeps_every_path_inside_its_directory(tree: str, how: str) -> None:
    resolve = RESOLVERS[how]
    root = os.open(tree, os.O_PATH | os.O_DIRECTORY)
    try:
        assert _read(resolve(root, b"a/b/file", os.O_RDONLY, 0, resolver.RESOLVE_BENEATH)) == b"inside"
        assert _read(resolve(root, b"rel/file", os.O_RDONLY, 0, resolver.RESOLVE_BENEATH)) == b"inside"
        assert _read(resolve(root, b"a/../a/b/file", os.O_RDONLY, 0, resolver.RESOLVE_BENEATH)) == b"inside"
        for escape in (b"../x", b"a/../../x", b"up/x", b"out/passwd", b"/etc/passwd"):
            with pytest.raises(OSError) as ei:
                resolve(root, escape, os.O_RDONLY, 0, resolver.RESOLVE_BENEATH)
            assert ei.value.errno == errno.EXDEV, escape
        with pytest.raises(OSError) as ei:
            resolve(root, b"loop", os.O_RDONLY, 0, resolver.RESOLVE_BENEATH)
        assert ei.value.errno == errno.ELOOP
        with pytest.raises(OSError) as ei:
            resolve(root, b"rel/file", os.O_RDONLY, 0, resolver.RESOLVE_BENEATH | resolver.RESOLVE_NO_SYMLINKS)
        assert ei.value.errno == errno.ELOOP
        with pytest.raises(OSError) as ei:  # O_NOFOLLOW on the last component
            resolve(root, b"rel", os.O_RDONLY | os.O_NOFOLLOW, 0, resolver.RESOLVE_BENEATH)
        assert ei.value.errno == errno.ELOOP
        # Without BENEATH the kernel's usual rules: the symlink out is followed.
        assert _read(resolve(root, b"out/hostname", os.O_RDONLY, 0, 0)) == open("/etc/hostname", "rb").read()[:100]
        new = resolve(root, b"a/new", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, resolver.RESOLVE_BENEATH)
        os.close(new)
        assert os.path.isfile(os.path.join(tree, "a", "new"))
    finally:
        os.close(root)


def test_deep_and_long_paths_are_typed(tree: str) -> None:
    root = os.open(tree, os.O_PATH | os.O_DIRECTORY)
    try:
        with pytest.raises(OSError) as ei:
            resolver.openat2(root, b"x/" * 3000 + b"f", os.O_RDONLY, 0, resolver.RESOLVE_BENEATH)
        assert ei.value.errno == errno.ENAMETOOLONG
        with pytest.raises(ValueError):
            resolver.openat2(root, b"a\0b", os.O_RDONLY)
    finally:
        os.close(root)


def test_only_regular_files_are_opened_for_io(tmp_path: object) -> None:
    """Reads (through the layer) and appends (in a resolved directory) check the type on an
    O_PATH fd first: a FIFO, socket or device answers at once without being opened."""
    fifo = os.path.join(str(tmp_path), "fifo")
    os.mkfifo(fifo)
    sock_path = os.path.join(str(tmp_path), "sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(sock_path)
    layer = fs.FileSystem()
    dirfd = os.open(str(tmp_path), os.O_PATH | os.O_DIRECTORY)
    try:
        for path in (fifo, sock_path, "/dev/null"):
            with pytest.raises(GuestdError) as ei:
                layer.open_file(path)
            assert ei.value.code == "not_a_file", ei.value
        for name in (b"fifo", b"sock"):
            with pytest.raises(GuestdError) as ei:
                fs.open_to_write_in_place(name, os.O_WRONLY | os.O_APPEND, dirfd, name.decode())
            assert ei.value.code == "not_a_file", ei.value
        with pytest.raises(GuestdError) as ei:
            layer.open_file(str(tmp_path))
        assert ei.value.code == "is_a_directory"
        regular = os.path.join(str(tmp_path), "f")
        with open(regular, "w") as f:
            f.write("x")
        os.symlink("f", os.path.join(str(tmp_path), "lnk"))
        fd = layer.open_file(os.path.join(str(tmp_path), "lnk"))  # a read follows a symlink
        assert os.read(fd, 10) == b"x"
        os.close(fd)
        with pytest.raises(OSError) as oi:  # an append in a resolved directory does not
            fs.open_to_write_in_place(b"lnk", os.O_WRONLY | os.O_APPEND, dirfd, "lnk")
        assert oi.value.errno == errno.ELOOP
    finally:
        os.close(dirfd)
        srv.close()


def test_planted_fifos_wedge_no_file_op(client: Client, guestd: Guestd, tmp_path: object) -> None:
    """Eight FIFOs where the host expects files: reads, downloads and appends answer at once,
    and every other file op still works (before: each one held an I/O thread for good)."""
    d = str(tmp_path)
    fifos = []
    for i in range(8):
        p = os.path.join(d, f"fifo{i}")
        os.mkfifo(p)
        fifos.append(p)
    for p in fifos:
        with pytest.raises(GuestdError) as ei:
            client.read_file(p, deadline=5)
        assert ei.value.code == "not_a_file"
        with pytest.raises(GuestdError) as ei:
            client.write_file(p, b"x", flag="append", deadline=5)
        assert ei.value.code == "not_a_file"
        with pytest.raises(GuestdError) as ei:
            client.download(p, os.path.join(d, "out"), deadline=5)
        assert ei.value.code == "not_a_file"
    assert client.stat(fifos[0], deadline=5).type == "fifo"
    client.write_file(os.path.join(d, "ok"), b"fine", deadline=5)
    assert client.read_file(os.path.join(d, "ok"), deadline=5) == b"fine"
    assert {e.name for e in client.listdir(d, deadline=5).entries} >= {"fifo0", "ok"}
    assert all(stat.S_ISFIFO(os.stat(p).st_mode) for p in fifos)  # nothing replaced them


def test_a_planted_fifo_does_not_hold_up_shutdown(fresh_guestd: Callable[..., Guestd], tmp_path: object) -> None:
    g = fresh_guestd()
    fifo = os.path.join(str(tmp_path), "fifo")
    os.mkfifo(fifo)
    with g.client() as c:
        hung = threading.Thread(target=lambda: _swallow(lambda: c.read_file(fifo, deadline=3)), daemon=True)
        hung.start()
        hung.join(10)
    os.kill(g.pid, signal.SIGTERM)
    g.proc.wait(10)
    assert g.proc.returncode == 0


def _swallow(fn: Callable[[], object]) -> None:
    try:
        fn()
    except GuestdError:
        pass


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("bindfs") is None, reason="needs root and bindfs (FUSE)")
def test_a_file_op_stuck_in_the_kernel_does_not_hold_up_shutdown(
    fresh_guestd: Callable[..., Guestd], tmp_path: object
) -> None:
    """A file system that stops answering (here a FUSE server that is stopped) holds the I/O
    thread that touched it in the kernel, where nothing can interrupt it: guestd still exits on
    SIGTERM, within its grace, instead of waiting for that thread forever."""
    backing, mnt = os.path.join(str(tmp_path), "backing"), os.path.join(str(tmp_path), "mnt")
    os.mkdir(backing)
    os.mkdir(mnt)
    with open(os.path.join(backing, "f"), "w") as f:
        f.write("x")
    subprocess.run(["bindfs", backing, mnt], check=True)
    server = _fuse_server_pid(mnt)
    g = fresh_guestd()
    try:
        with g.client() as c:
            assert c.read_file(f"{mnt}/f") == b"x"
            os.kill(server, signal.SIGSTOP)
            with pytest.raises(GuestdError) as ei:
                c.read_file(f"{mnt}/f", deadline=1)
            assert ei.value.code == "timeout"
            assert c.ping() >= 0  # the rest of guestd is unaffected
        os.kill(g.pid, signal.SIGTERM)
        try:
            g.proc.wait(20)
        except subprocess.TimeoutExpired:
            pytest.fail("guestd is still waiting for an I/O thread stuck in a hung file system")
        assert g.proc.returncode == 0
    finally:
        os.kill(server, signal.SIGCONT)
        subprocess.run(["umount", mnt], check=False)


def _fuse_server_pid(mountpoint: str) -> int:
    """The bindfs process serving ``mountpoint`` (found by its command line)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv and os.path.basename(argv[0]) == b"bindfs" and os.fsencode(mountpoint) in argv:
            return int(pid)
    raise AssertionError(f"no bindfs process serves {mountpoint}")


def _plant(kind: str, path: str) -> object:
    if kind == "fifo":
        os.mkfifo(path)
        return None
    if kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(path)
        return s  # kept open (and listening) for the test's length
    os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # a /dev/null of our own
    return None


@pytest.mark.parametrize("kind", ["fifo", "socket", "chardev"])
def test_every_file_op_on_a_special_file_answers_typed_and_at_once(client: Client, tmp_path: object, kind: str) -> None:
    if kind == "chardev" and os.geteuid() != 0:
        pytest.skip("mknod of a device needs root")
    d = str(tmp_path)
    path = os.path.join(d, kind)
    keep = _plant(kind, path)
    try:
        ops: list[Callable[[], object]] = [
            lambda: client.read_file(path, deadline=5),
            lambda: client.download(path, deadline=5),
            lambda: client.write_file(path, b"x", flag="append", deadline=5),
        ]
        for op in ops:
            with pytest.raises(GuestdError) as ei:
                op()
            assert ei.value.code == "not_a_file", ei.value
        assert client.stat(path, deadline=5).type == {"fifo": "fifo", "socket": "socket", "chardev": "char"}[kind]
        with pytest.raises(GuestdError) as ei:
            client.listdir(path, deadline=5)
        assert ei.value.code == "not_a_directory"
        with pytest.raises(GuestdError) as ei:
            client.mkdir(path, deadline=5)
        assert ei.value.code == "exists"
        with pytest.raises(GuestdError) as ei:
            client.write_file(path, b"x", flag="create", deadline=5)
        assert ei.value.code == "exists"
        client.rename(path, path + ".moved", deadline=5)  # moved as an entry, never opened
        client.rename(path + ".moved", path, deadline=5)
        client.upload(b"replaced", path, deadline=5)  # an overwrite replaces the entry itself
        assert stat.S_ISREG(os.lstat(path).st_mode) and client.read_file(path, deadline=5) == b"replaced"
        client.remove(path, deadline=5)
        assert not os.path.lexists(path)
    finally:
        if isinstance(keep, socket.socket):
            keep.close()


def test_symlink_loops_deep_chains_and_long_paths_are_typed_on_the_wire(client: Client, tmp_path: object) -> None:
    d = str(tmp_path)
    os.symlink("b", f"{d}/a")
    os.symlink("a", f"{d}/b")
    for i in range(45):  # deeper than the kernel's 40 hops
        os.symlink(f"c{i + 1}", f"{d}/c{i}")
    with open(f"{d}/c45", "w") as f:
        f.write("end")
    long = d + "/" + "x/" * 2100 + "f"
    for path, eno in ((f"{d}/a", errno.ELOOP), (f"{d}/c0", errno.ELOOP), (long, errno.ENAMETOOLONG)):
        ops: list[Callable[[str], object]] = [
            lambda p: client.read_file(p, deadline=5),
            lambda p: client.download(p, deadline=5),
            lambda p: client.stat(p, follow=True, deadline=5),
            lambda p: client.listdir(p, deadline=5),
            lambda p: client.write_file(p + "/f", b"x", deadline=5),
            lambda p: client.mkdir(p + "/m", parents=True, deadline=5),
        ]
        for op in ops:
            with pytest.raises(GuestdError) as ei:
                op(path)
            assert ei.value.code == "bad_request" and ei.value.errno == eno, (path[:60], ei.value)
    assert client.read_file(f"{d}/c5") == b"end"  # 40 hops are fine
