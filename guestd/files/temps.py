"""guestd's temporary names beside what it writes, and the records that let the next guestd remove
the ones a killed guestd left behind."""

from __future__ import annotations

import os
import stat as st
from collections.abc import Callable

from guestd.files.resolver import AT_FDCWD, RESOLVE_NO_MAGICLINKS, RESOLVE_NO_SYMLINKS, openat2

TEMP_MARK = b".guestd-tmp-"
TREE_TEMP_MARK = b".guestd-tree-"  # a tree upload's staging directory: "." + name + mark + 12 hex digits
_DIR_PATH = os.O_PATH | os.O_DIRECTORY


class PendingTemps:
    """Named temp files of writes in progress, for file systems without ``O_TMPFILE`` (FUSE,
    NFS, vfat): each is recorded under the runtime dir before it is made and forgotten when
    its write commits or aborts, so a guestd killed mid-write has them removed by the next
    guestd that starts. Records live in a directory per guestd pid: a second guestd sharing
    the runtime dir leaves a live one's alone."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.mine = os.path.join(directory, str(os.getpid()))

    def record(self, dirfd: int, temp_name: bytes) -> str:
        """Record ``temp_name`` in the directory open at ``dirfd``: its path as the kernel resolved
        it (no symlinks in it) and its identity (device, inode), which the cleanup checks."""
        where = os.fsencode(os.readlink(f"/proc/self/fd/{dirfd}"))
        entry = where + b"\0" + temp_name + b"\0" + _dir_identity(dirfd)
        os.makedirs(self.mine, mode=0o700, exist_ok=True)
        record = os.path.join(self.mine, temp_name.hex()[-24:])
        fd = os.open(record, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, entry)
        finally:
            os.close(fd)
        return record

    @staticmethod
    def forget(record: str) -> None:
        try:
            os.unlink(record)
        except FileNotFoundError:
            pass

    def remove_left_behind(self, running: Callable[[int], bool]) -> int:
        """Remove the temp files recorded by guestds that are gone; returns how many."""
        removed = 0
        try:
            owners = os.listdir(self.directory)
        except FileNotFoundError:
            return 0
        for owner in owners:
            if not owner.isdigit() or int(owner) == os.getpid() or running(int(owner)):
                continue
            folder = os.path.join(self.directory, owner)
            for entry in os.listdir(folder):
                record = os.path.join(folder, entry)
                with open(record, "rb") as f:
                    where, _, rest = f.read().partition(b"\0")
                name, _, identity = rest.partition(b"\0")
                removed += _remove_temp(where, name, identity)
                os.unlink(record)
            os.rmdir(folder)
        return removed


def _dir_identity(dirfd: int) -> bytes:
    """``b"DEV:INODE"`` of the directory open at ``dirfd``, as a temp-name record keeps it."""
    dir_st = os.fstat(dirfd)
    return f"{dir_st.st_dev}:{dir_st.st_ino}".encode()


def _remove_temp(where: bytes, name: bytes, identity: bytes = b"") -> int:
    """Unlink the temp file ``name`` in the directory ``where`` if it is still one of ours:
    a regular file with our mark, in the very directory guestd wrote in. The recorded path
    had no symlink in it (the kernel's name for the directory), so one found now is the
    workload's and is refused (RESOLVE_NO_SYMLINKS), and the directory must be the recorded
    inode: one the workload moved away and replaced (by another directory, or a link to a
    directory it cannot write) is left alone. The name is unlinked in that fd."""
    if TEMP_MARK not in name or b"/" in name:
        return 0
    try:
        dirfd = openat2(AT_FDCWD, where, _DIR_PATH, 0, RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)
    except OSError:
        return 0
    try:
        if identity and _dir_identity(dirfd) != identity:  # records of an older guestd have none
            return 0
        if not st.S_ISREG(os.stat(name, dir_fd=dirfd, follow_symlinks=False).st_mode):
            return 0
        os.unlink(name, dir_fd=dirfd)
        return 1
    except OSError:
        return 0
    finally:
        os.close(dirfd)
