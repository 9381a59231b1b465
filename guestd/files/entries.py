"""The file ops that are one call each, blocking (run in the daemon's I/O threads): ranged reads,
stat, list, mkdir, remove (a tree without following anything), rename; and the mapping of OS
failures to typed errors."""

from __future__ import annotations

import errno
import heapq
import os
import stat as st
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from guestd.files.fs import FileSystem, Place, entry_type, rename_noreplace
from guestd.wire.errors import ErrorCode, GuestdError, too_large
from guestd.wire.paths import path_to_wire

if TYPE_CHECKING:  # the generated message types: annotations only, never imported at run time
    from guestd.wire.types import (
        DirEntryRecord,
        FileListReply,
        FileMkdirReply,
        FileReadReply,
        FileRemoveReply,
        FileRenameReply,
        FileStatReply,
    )


def os_call(fn: Any, *args: Any) -> Any:
    """Run fn, mapping OS failures to typed errors (runs in an I/O thread)."""
    try:
        return fn(*args)
    except GuestdError:
        raise
    except OSError as exc:
        raise GuestdError.from_os_error(exc) from None
    except ValueError as exc:  # NUL in a path, for example
        raise GuestdError(ErrorCode.BAD_REQUEST, str(exc)) from None


def read_range(fsys: FileSystem, path: str, offset: int, length: int | None, max_read: int) -> FileReadReply:
    fd = fsys.open_file(path)  # a FIFO the workload planted must not hold an I/O thread
    try:
        size = os.fstat(fd).st_size
        if size == 0 and length is None:
            # /proc, /sys and the like report size 0: read to EOF, bounded by max_read.
            data = _read_to_eof(fd, offset, max_read + 1)
            if len(data) > max_read:
                raise too_large("max_read", len(data), f"more than max_read {max_read} bytes; use file.download")
            return {"data": data, "size": offset + len(data), "eof": True}
        want = max(0, size - offset) if length is None else length
        if want > max_read:
            raise too_large("max_read", want, f"read of {want} bytes exceeds max_read {max_read}; use file.download")
        data = os.pread(fd, want, offset) if want else b""
        return {"data": data, "size": size, "eof": offset + len(data) >= size}
    finally:
        os.close(fd)


def _read_to_eof(fd: int, offset: int, limit: int) -> bytes:
    if offset:
        os.lseek(fd, offset, os.SEEK_SET)
    out = bytearray()
    while len(out) < limit:
        try:
            chunk = os.read(fd, min(65536, limit - len(out)))
        except BlockingIOError:
            break  # a kernel stream (/proc/kmsg) with nothing more now: reads never wait for data
        if not chunk:
            break
        out += chunk
    return bytes(out)


def stat_path(fsys: FileSystem, path: str, follow: bool) -> FileStatReply:
    s, target = fsys.stat(path, follow)
    out: FileStatReply = {
        "type": entry_type(s.st_mode),
        "size": s.st_size,
        "mode": st.S_IMODE(s.st_mode),
        "uid": s.st_uid,
        "gid": s.st_gid,
        "mtime_ns": s.st_mtime_ns,
        "target": None,
    }
    if target is not None:
        out["target"] = path_to_wire(target)
    return out


def list_dir(fsys: FileSystem, path: str, cap: int) -> FileListReply:
    """The first ``cap`` entries in order of their names as bytes, and how many there are.

    Every name is read (the order is the names', not the directory's), but only ``cap``
    are kept: a bounded heap, so a huge directory costs a scan, not memory."""
    total = 0

    def counted(it: Iterator[os.DirEntry[str]]) -> Iterator[os.DirEntry[str]]:
        nonlocal total
        for e in it:
            total += 1
            yield e

    dirfd = fsys.open_dir(path)
    try:
        with os.scandir(dirfd) as it:  # names relative to the fd; stat below is fstatat on it
            scanned = counted(it)
            first = heapq.nsmallest(cap, scanned, key=lambda e: os.fsencode(e.name))
            for _ in scanned:  # nsmallest(0, ...) returns before the end: count the rest
                pass
            entries = _records(first)
    finally:
        os.close(dirfd)
    return {"entries": entries, "total": total, "truncated": total > cap}


def _records(first: list[os.DirEntry[str]]) -> list[DirEntryRecord]:
    entries: list[DirEntryRecord] = []
    for e in first:
        try:
            s = e.stat(follow_symlinks=False)
        except OSError:
            continue  # vanished between listing and stat
        entries.append(
            {
                "name": path_to_wire(e.name),
                "type": entry_type(s.st_mode),
                "size": s.st_size,
                "mode": st.S_IMODE(s.st_mode),
                "mtime_ns": s.st_mtime_ns,
            }
        )
    return entries


def make_dir(fsys: FileSystem, path: str, parents: bool, perm: int) -> FileMkdirReply:
    with fsys.place(path, parents=parents) as place:
        try:
            fsys.mkdir(place, perm)
        except FileExistsError:
            if parents and _is_dir_at(place):
                return {"created": False}
            raise
    return {"created": True}


def _is_dir_at(place: Place) -> bool:
    try:
        return st.S_ISDIR(os.stat(place.name, dir_fd=place.dirfd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def remove_path(fsys: FileSystem, path: str, recursive: bool) -> FileRemoveReply:
    with fsys.place(path) as place:
        s = os.stat(place.name, dir_fd=place.dirfd, follow_symlinks=False)
        if st.S_ISDIR(s.st_mode):
            if not recursive:
                os.rmdir(place.name, dir_fd=place.dirfd)
                return {"removed": 1}
            return {"removed": remove_tree(place.dirfd, place.name, path)}
        os.unlink(place.name, dir_fd=place.dirfd)
        return {"removed": 1}


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def remove_tree(parent: int, name: bytes, shown: str) -> int:
    """Remove the directory tree ``name`` in ``parent`` at any depth; returns the entries removed,
    itself included.

    Iterative (shutil.rmtree and os.walk recurse, and a workload can nest directories
    deeper than Python's recursion limit) and holding one directory fd at a time (a
    deep tree would otherwise exhaust fds). Every step is relative to that fd and never
    follows a symlink; climbing back up through ".." is checked against the device and
    inode recorded on the way down, so a directory moved mid-walk stops the removal
    with EBUSY instead of leading it elsewhere.
    """
    removed = 0
    fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    trail: list[tuple[str, int, int]] = []  # (name in parent, parent's st_dev, parent's st_ino)
    try:
        while True:
            unlinked, child = _unlink_files_find_dir(fd)
            removed += unlinked
            if child is None:
                if not trail:
                    break
                sub, dev, ino = trail.pop()
                up = os.open("..", _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = up
                here = os.fstat(fd)
                if (here.st_dev, here.st_ino) != (dev, ino):
                    raise OSError(errno.EBUSY, "directory tree changed during removal", shown)
                os.rmdir(sub, dir_fd=fd)
                removed += 1
                continue
            here = os.fstat(fd)
            sub_fd = os.open(child, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = sub_fd
            trail.append((child, here.st_dev, here.st_ino))
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent)
    return removed + 1


def _unlink_files_find_dir(fd: int) -> tuple[int, str | None]:
    """Unlink non-directories in ``fd`` until a subdirectory turns up: (unlinked, its name or None)."""
    unlinked = 0
    with os.scandir(fd) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                return unlinked, entry.name
            os.unlink(entry.name, dir_fd=fd)
            unlinked += 1
    return unlinked, None


def rename_path(fsys: FileSystem, src: str, dst: str, overwrite: bool) -> FileRenameReply:
    with fsys.place(src, field="src") as a, fsys.place(dst, field="dst") as b:
        moved = fsys.check_move(a, b)
        if overwrite:
            os.rename(a.name, b.name, src_dir_fd=a.dirfd, dst_dir_fd=b.dirfd)
        else:
            rename_noreplace(a, b)
        if moved is not None:
            fsys.verify_moved(a, b, moved)
    return {}
