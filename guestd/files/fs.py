"""The file-system layer under every file op (issue 15, being built): paths are resolved by the
kernel in the call that acts, relative to a directory fd, and nothing the workload planted
(a FIFO, a socket, a device where a file is expected) can block an I/O thread.

``openat2`` is the kernel's resolver with rules (``RESOLVE_BENEATH``: nothing may leave the
directory fd, neither ``..`` nor a symlink; ``RESOLVE_NO_MAGICLINKS``: no /proc/*/fd jumps).
Python has no binding for it, so it is called through ``syscall``; kernels before 5.6 get a
walk that opens one component at a time with ``O_NOFOLLOW`` and follows symlinks itself under
the same rules.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat as st
import struct

from guestd.wire.errors import ErrorCode, GuestdError

RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_IN_ROOT = 0x10

_SYS_OPENAT2 = 437  # the same number on every architecture (the generic syscall table)
_MAX_SYMLINKS = 40  # as the kernel's MAXSYMLINKS
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_have_openat2: bool | None = None  # learned on first use


def openat2(dirfd: int, path: str | bytes, flags: int, mode: int = 0, resolve: int = 0) -> int:
    """``openat2(2)``: open ``path`` relative to ``dirfd`` under the ``RESOLVE_*`` rules.

    Raises OSError (EXDEV when the path would leave a ``RESOLVE_BENEATH`` root, ELOOP for a
    symlink that ``RESOLVE_NO_SYMLINKS`` or ``O_NOFOLLOW`` refuses)."""
    global _have_openat2
    raw = os.fsencode(path)
    if b"\0" in raw:
        raise ValueError("embedded null byte")
    if _have_openat2 is not False:
        how = ctypes.create_string_buffer(struct.pack("QQQ", flags | os.O_CLOEXEC, mode, resolve), 24)
        fd = _libc.syscall(_SYS_OPENAT2, dirfd, raw, how, 24)
        if fd >= 0:
            _have_openat2 = True
            return int(fd)
        err = ctypes.get_errno()
        if err != errno.ENOSYS:
            raise OSError(err, os.strerror(err), os.fsdecode(raw))
        _have_openat2 = False
    return _walk(dirfd, raw, flags | os.O_CLOEXEC, mode, resolve)


def _walk(dirfd: int, path: bytes, flags: int, mode: int, resolve: int) -> int:
    """openat2's rules one component at a time, for kernels without it. Symlinks are read and
    followed here (each hop counted), ``..`` never climbs above ``dirfd`` under BENEATH."""
    beneath = bool(resolve & (RESOLVE_BENEATH | RESOLVE_IN_ROOT))
    if beneath and path.startswith(b"/"):
        if resolve & RESOLVE_IN_ROOT:
            path = path.lstrip(b"/")
        else:
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), os.fsdecode(path))
    stack: list[int] = []  # directory fds from dirfd down to where we are
    here = os.dup(dirfd) if dirfd != -100 else os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    if path.startswith(b"/"):
        os.close(here)
        here = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    parts = [p for p in path.split(b"/") if p not in (b"", b".")]
    hops = 0
    try:
        while parts:
            name = parts.pop(0)
            if name == b"..":
                if stack:
                    os.close(here)
                    here = stack.pop()
                elif beneath:
                    raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), os.fsdecode(path))
                else:
                    up = os.open(b"..", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=here)
                    os.close(here)
                    here = up
                continue
            last = not parts
            try:
                s = os.stat(name, dir_fd=here, follow_symlinks=False)
            except FileNotFoundError:
                if last and flags & os.O_CREAT:
                    fd = os.open(name, flags | os.O_NOFOLLOW, mode, dir_fd=here)
                    return fd
                raise
            if st.S_ISLNK(s.st_mode) and not (last and flags & os.O_NOFOLLOW):
                if resolve & RESOLVE_NO_SYMLINKS:
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), os.fsdecode(path))
                hops += 1
                if hops > _MAX_SYMLINKS:
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), os.fsdecode(path))
                target = os.readlink(name, dir_fd=here)
                target_b = os.fsencode(target)
                if target_b.startswith(b"/"):
                    if resolve & RESOLVE_BENEATH:
                        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), os.fsdecode(path))
                    # IN_ROOT: absolute targets start again at the root; otherwise at "/"
                    while stack:
                        os.close(here)
                        here = stack.pop()
                    if not resolve & RESOLVE_IN_ROOT:
                        os.close(here)
                        here = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
                parts = [p for p in target_b.split(b"/") if p not in (b"", b".")] + parts
                continue
            if last:
                return os.open(name, flags | os.O_NOFOLLOW, mode, dir_fd=here)
            sub = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=here)
            stack.append(here)
            here = sub
        return os.open(".", flags, mode, dir_fd=here)  # the path named dirfd itself
    finally:
        os.close(here)
        for fd in stack:
            os.close(fd)


def describe_type(mode: int) -> str:
    for test, name in (
        (st.S_ISFIFO, "a FIFO"),
        (st.S_ISSOCK, "a socket"),
        (st.S_ISCHR, "a character device"),
        (st.S_ISBLK, "a block device"),
        (st.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str, flags: int = os.O_RDONLY, mode: int = 0o644) -> int:
    """Open a file the host expects to be a regular file, never blocking on what it really is.

    ``O_NONBLOCK`` first (a FIFO without a writer would block the open, one without a reader
    the writes), then ``fstat``: a directory answers ``is_a_directory``, a FIFO, socket or
    device ``not_a_file``; a regular file gets its normal blocking mode back."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a FIFO (or socket) opened for writing with no reader
            raise not_a_file(path, "a FIFO or socket") from None
        raise
    try:
        info = os.fstat(fd)
        if st.S_ISDIR(info.st_mode):
            raise GuestdError(ErrorCode.IS_A_DIRECTORY, f"is a directory: {path}", details={"path": path})
        if not st.S_ISREG(info.st_mode):
            raise not_a_file(path, describe_type(info.st_mode))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def not_a_file(path: str, what: str) -> GuestdError:
    return GuestdError(ErrorCode.NOT_A_FILE, f"not a regular file ({what}): {path}", details={"path": path})
