"""``openat2``: the kernel's path resolver with rules, and a walk that keeps its rules on kernels
without it.

``RESOLVE_BENEATH``: nothing may leave the directory fd, neither ``..`` nor a symlink;
``RESOLVE_NO_MAGICLINKS``: no /proc/*/fd jumps. Python has no binding for it, so it is called
through ``syscall``; kernels before 5.6 get a walk that opens one component at a time with
``O_NOFOLLOW`` and follows symlinks itself under the same rules.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat as st
import struct

RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_IN_ROOT = 0x10

_SYS_OPENAT2 = 437  # the same number on every architecture (the generic syscall table)
_MAX_SYMLINKS = 40  # as the kernel's MAXSYMLINKS
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
AT_FDCWD = -100  # a *at call's dirfd for the working directory
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
    here = os.dup(dirfd) if dirfd != AT_FDCWD else os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
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
                if resolve & RESOLVE_NO_SYMLINKS or (resolve & RESOLVE_NO_MAGICLINKS and _in_proc_below_top(here)):
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


def _in_proc_below_top(dirfd: int) -> bool:
    """Is ``dirfd`` a procfs directory other than /proc itself? Every symlink there is a magic
    link (fd/N, cwd, root, exe, ns/*, map_files/*); the only ordinary ones (self, thread-self,
    mounts, net) sit in /proc's top directory. The walk's stand-in for RESOLVE_NO_MAGICLINKS."""
    try:
        proc = os.stat("/proc")
    except OSError:
        return False
    here = os.fstat(dirfd)
    return here.st_dev == proc.st_dev and here.st_ino != proc.st_ino
