"""Red-team pass on the issue-15 file-system layer (guestd/files): each test failed against the
tree it was written on (336ec67) and names the defect it found.

Real guestd processes as root; the workload is nobody (uid 65534), run with setpriv."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from guestd.client import GuestdError
from guestd.testing import Guestd

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="ownership and a workload user need root")
WORKLOAD_PYTHON = "/usr/bin/python3"
DROP = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", WORKLOAD_PYTHON, "-c"]


def as_workload(code: str, *args: str) -> None:
    subprocess.run([*DROP, code, *args], check=True)


@pytest.fixture
def top() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="guestd-redteam-fs-")
    os.chmod(d, 0o755)
    os.makedirs(f"{d}/ws")
    os.makedirs(f"{d}/outside")
    os.chown(f"{d}/ws", 65534, 65534)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def started(fresh_guestd: Callable[..., Guestd], top: str, config: str) -> Guestd:
    path = f"{top}/guestd.toml"
    with open(path, "w") as f:
        f.write(config)
    return fresh_guestd("--config", path)


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_a_failing_whole_file_write_leaves_no_fd_open(fresh_guestd: Callable[..., Guestd], top: str) -> None:
    """write_whole() opens the target's parent (FileSystem.place) and then builds an AtomicFile
    outside its try: when AtomicFile() refuses (exists for flag create, is_a_directory, an
    O_TMPFILE error) the parent's O_PATH fd is never closed. Was +1 fd per failing write
    (500 failing writes: 15 -> 515 fds)."""
    ws = f"{top}/ws"
    open(f"{ws}/exists", "w").close()
    os.mkdir(f"{ws}/adir")
    g = started(fresh_guestd, top, f'workspace = "{ws}"\n')
    with g.client() as c:
        c.ping()
        before = fds(g.pid)
        for _ in range(200):
            with pytest.raises(GuestdError):
                c.write_file(f"{ws}/exists", b"x", flag="create")
            with pytest.raises(GuestdError):
                c.write_file(f"{ws}/adir", b"x")
        assert fds(g.pid) - before < 5, f"{fds(g.pid) - before} fds leaked by 400 failing writes"


@root_only
def test_an_overwrite_whose_rename_fails_leaves_no_temp_file(fresh_guestd: Callable[..., Guestd], top: str) -> None:
    """The O_TMPFILE commit links the inode in under its temp name, then renames it over the
    target. If the rename fails (the workload made the target a directory while the upload
    streamed: EISDIR), abort() skips the unlink because the file was 'anonymous': the temp
    file, with the host's whole content, stays for good. Was: `.report.txt.guestd-tmp-*`,
    3 MiB, left in the directory (and the error names the temp file, not the target)."""
    ws = f"{top}/ws"
    g = started(fresh_guestd, top, f'workspace = "{ws}"\n[policy]\nworkload_user = "nobody"\n')
    calls = [0]

    def progress(_: int) -> None:
        calls[0] += 1
        if calls[0] == 1:
            time.sleep(0.5)  # guestd holds the temp file by now
            as_workload("import os, sys; os.mkdir(sys.argv[1])", f"{ws}/report.txt")

    with g.client() as c, pytest.raises(GuestdError):
        c.upload(b"A" * (3 << 20), f"{ws}/report.txt", progress=progress)
    left = [n for n in os.listdir(ws) if "guestd-tmp" in n]
    assert left == [], f"temp files left behind: {left}"


def test_a_read_of_a_blocking_regular_proc_file_does_not_wedge_file_ops(
    fresh_guestd: Callable[..., Guestd], top: str
) -> None:
    """reopen_regular only refuses non-regular files; /proc/kmsg is S_IFREG, size 0, and its read
    blocks until the kernel logs (each read also consumes the syslog queue). A workload symlink
    to it where the host reads a log holds an I/O thread for good; io_threads of them stop every
    file op (stat, read and write of ordinary files time out) while ping still answers.
    Was: 8 reads held, stat/read/write of a normal file: no reply within 5 s."""
    if not os.access("/proc/kmsg", os.R_OK):
        pytest.skip("needs /proc/kmsg readable (root)")
    ws = f"{top}/ws"
    with open(f"{ws}/ok.txt", "w") as f:
        f.write("fine")
    g = started(fresh_guestd, top, f'workspace = "{ws}"\nio_threads = 2\n')
    for i in range(2):
        os.symlink("/proc/kmsg", f"{ws}/out{i}.log")

    def reader(i: int) -> None:
        with g.client() as c:
            try:
                c.read_file(f"{ws}/out{i}.log", deadline=30)
            except GuestdError:
                pass

    threads = [threading.Thread(target=reader, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)  # before the fix they never came back (deadline 30 s)
    with g.client() as c:
        assert c.stat(f"{ws}/ok.txt", deadline=5).size == 4  # timed out: every I/O thread held
        assert c.read_file(f"{ws}/ok.txt", deadline=5) == b"fine"


def test_an_append_through_a_hard_link_stays_inside_write_roots(fresh_guestd: Callable[..., Guestd], top: str) -> None:
    """_append opens O_PATH|O_NOFOLLOW and checks S_ISREG only: a hard link inside the root to a
    file outside it is a regular file, and the host's append lands outside write_roots.
    (With fs.protected_hardlinks=0, the kernel default and what guestd-init leaves, the
    workload can link any file, e.g. /etc/shadow: redteam/hardlink_append.py case 2.)"""
    ws, out = f"{top}/ws", f"{top}/outside"
    with open(f"{out}/shared.log", "w") as f:
        f.write("outside\n")
    os.chown(f"{out}/shared.log", 65534, 65534)  # linkable by the workload under protected_hardlinks=1
    g = started(fresh_guestd, top, f'[policy]\nwrite_roots = ["{ws}"]\n')
    as_workload("import os, sys; os.link(sys.argv[1], sys.argv[2])", f"{out}/shared.log", f"{ws}/build.log")
    with g.client() as c:
        try:
            c.write_file(f"{ws}/build.log", b"host line\n", flag="append")
        except GuestdError:
            pass
    assert open(f"{out}/shared.log").read() == "outside\n", "the append changed a file outside write_roots"


def test_a_write_root_is_held_from_start_not_opened_when_first_used(
    fresh_guestd: Callable[..., Guestd], top: str
) -> None:
    """Roots._fd opens a root lazily, on the first write, following symlinks. A root the
    workload can rename (here ws/out, inside its workspace: a real directory when guestd
    started) is swapped for a symlink to a directory outside before the host's first write,
    and the write lands there. PROTOCOL.md 8: "each root is a directory fd opened once"; issue
    15: "write_roots become directory fds opened at start"."""
    ws, out = f"{top}/ws", f"{top}/outside"
    os.mkdir(f"{ws}/out")
    os.chown(f"{ws}/out", 65534, 65534)
    g = started(fresh_guestd, top, f'[policy]\nwrite_roots = ["{ws}/out"]\n')
    as_workload("import os, sys; os.rmdir(sys.argv[2]); os.symlink(sys.argv[1], sys.argv[2])", out, f"{ws}/out")
    with g.client() as c:
        try:
            c.write_file(f"{ws}/out/cron", b"* * * * * root sh /tmp/x\n")
        except GuestdError:
            pass
    assert os.listdir(out) == [], "a write landed in the directory the workload put in the root's place"


@root_only
def test_a_rename_does_not_carry_a_workload_owned_file_into_a_root_directory_outside(
    fresh_guestd: Callable[..., Guestd], top: str
) -> None:
    """The ownership rule covers what write/upload/mkdir create; file.rename moves the inode
    where the kernel resolves dst and keeps its owner. With ws/out -> a root-owned directory
    outside the workspace (no race), renaming ws/job.sh (the workload's, as everything the host
    writes in the workspace) to ws/out/job.sh leaves a workload-writable file in that root
    directory (think /etc/profile.d); the workload then rewrites it. Was: uid 65534."""
    ws, out = f"{top}/ws", f"{top}/outside"
    g = started(fresh_guestd, top, f'workspace = "{ws}"\n[policy]\nworkload_user = "nobody"\n')
    with g.client() as c:
        c.write_file(f"{ws}/job.sh", b"echo host\n")
        as_workload("import os, sys; os.symlink(sys.argv[1], sys.argv[2])", out, f"{ws}/out")
        try:
            c.rename(f"{ws}/job.sh", f"{ws}/out/job.sh")
        except GuestdError:
            pass
    if os.path.exists(f"{out}/job.sh"):
        assert os.stat(f"{out}/job.sh").st_uid == 0, "a workload-owned file now sits in a root directory outside"


def test_the_pre_openat2_walk_refuses_magic_links_too() -> None:
    """resolver._walk (kernels without openat2) ignores RESOLVE_NO_MAGICLINKS: /proc/<pid>/cwd and
    /proc/<pid>/root are read with readlink and followed as paths. openat2 refuses them (ELOOP)."""
    from guestd.files import fs, resolver

    d = tempfile.mkdtemp(prefix="guestd-redteam-walk-")
    saved = resolver._have_openat2
    try:
        with open(f"{d}/incwd", "w") as f:
            f.write("x")
        os.symlink(f"/proc/{os.getpid()}/root", f"{d}/root")
        resolver._have_openat2 = False
        with pytest.raises(OSError):
            os.close(fs.FileSystem().open_file(f"{d}/root{d}/incwd"))
    finally:
        resolver._have_openat2 = saved
        shutil.rmtree(d, ignore_errors=True)
