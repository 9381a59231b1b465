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


def open_regular(
    path: str | bytes, flags: int = os.O_RDONLY, mode: int = 0o644, dir_fd: int | None = None, shown: str = ""
) -> int:
    """Open a file the host expects to be a regular file, never blocking on what it really is.

    ``O_NONBLOCK`` first (a FIFO without a writer would block the open, one without a reader
    the writes), then ``fstat``: a directory answers ``is_a_directory``, a FIFO, socket or
    device ``not_a_file``; a regular file gets its normal blocking mode back."""
    shown = shown or os.fsdecode(path)
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a FIFO (or socket) opened for writing with no reader
            raise not_a_file(shown, "a FIFO or socket") from None
        raise
    try:
        info = os.fstat(fd)
        if st.S_ISDIR(info.st_mode):
            raise GuestdError(ErrorCode.IS_A_DIRECTORY, f"is a directory: {shown}", details={"path": shown})
        if not st.S_ISREG(info.st_mode):
            raise not_a_file(shown, describe_type(info.st_mode))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def not_a_file(path: str, what: str) -> GuestdError:
    return GuestdError(ErrorCode.NOT_A_FILE, f"not a regular file ({what}): {path}", details={"path": path})


# --------------------------------------------------------------------------- where writes act

AT_FDCWD = -100
PATH_MAX = 4096  # Linux's, counting the terminating NUL
_DIR_PATH = os.O_PATH | os.O_DIRECTORY
Owner = tuple[int, int] | None  # (uid, gid) for new files and directories; None: guestd's own


class Place:
    """Where a write acts: a kernel-resolved parent directory (an fd) and a name in it. Every
    call that acts is a ``*at`` call on that fd with that name, never a path again."""

    def __init__(self, dirfd: int, name: bytes, path: str, owner: Owner) -> None:
        self.dirfd = dirfd
        self.name = name
        self.path = path  # as the request gave it, for messages
        self.owner = owner  # who a new entry here belongs to (decided from dirfd)

    def close(self) -> None:
        if self.dirfd >= 0:
            os.close(self.dirfd)
            self.dirfd = -1

    def __enter__(self) -> Place:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FileSystem:
    """Resolves the places writes act on: under ``write_roots`` (each a directory fd, opened once)
    with ``RESOLVE_BENEATH``, so neither ``..`` nor a symlink leaves a root, or anywhere (the
    kernel's usual rules, without /proc magic links). New entries under the workspace belong to
    the workload user, decided from the resolved directory fd, not from a path string."""

    def __init__(self, write_roots: list[str] | None, workspace: str, ids: tuple[int, int] | None) -> None:
        self.roots: list[tuple[bytes, str]] | None = None
        if write_roots is not None:
            self.roots = []
            for root in write_roots:
                for spelling in {os.path.abspath(root), os.path.realpath(root)}:
                    self.roots.append((os.fsencode(spelling).rstrip(b"/") or b"/", root))
            self.roots.sort(key=lambda r: -len(r[0]))  # the longest (innermost) root first
        self._root_fds: dict[str, int] = {}
        self.workspace = os.fsencode(os.path.realpath(workspace)) if workspace and ids is not None else None
        self.ids = ids

    # -- resolution -----------------------------------------------------------------------
    def place(self, path: str, *, parents: bool = False) -> Place:
        """The parent of ``path``, resolved (and with ``parents``, created) by the kernel."""
        raw = os.fsencode(path)
        if b"\0" in raw:
            raise GuestdError(ErrorCode.BAD_REQUEST, "embedded null byte in path", details={"field": "path"})
        if len(raw) >= PATH_MAX:
            raise OSError(errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG), path)
        absolute = raw if raw.startswith(b"/") else os.fsencode(os.getcwd()).rstrip(b"/") + b"/" + raw
        stripped = absolute.rstrip(b"/")
        head, _, name = stripped.rpartition(b"/")
        if name in (b"", b".", b".."):
            raise GuestdError(
                ErrorCode.BAD_REQUEST, f"the path names no entry to act on: {path}", details={"path": path}
            )
        base, rel, resolve = self._base(head or b"/", path)
        try:
            dirfd = self._makedirs(base, rel, resolve) if parents else openat2(base, rel, _DIR_PATH, 0, resolve)
        except OSError as exc:
            if exc.errno == errno.EXDEV:
                raise outside_roots(path) from None
            raise
        return Place(dirfd, name, path, self.owner_in(dirfd))

    def _base(self, head: bytes, path: str) -> tuple[int, bytes, int]:
        """(directory fd, path relative to it, RESOLVE_* flags) for resolving ``head``."""
        if self.roots is None:
            return AT_FDCWD, head, RESOLVE_NO_MAGICLINKS
        for prefix, root in self.roots:
            if head == prefix or head.startswith(prefix + b"/") or prefix == b"/":
                rel = head[len(prefix) :].lstrip(b"/") or b"."
                return self._root_fd(root, path), rel, RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS
        raise outside_roots(path)

    def _root_fd(self, root: str, path: str) -> int:
        fd = self._root_fds.get(root)
        if fd is None:
            try:
                fd = os.open(root, _DIR_PATH | os.O_CLOEXEC)
            except OSError as exc:
                raise GuestdError.from_os_error(exc, policy="write_roots", path=path) from None
            fd = self._root_fds.setdefault(root, fd)  # two threads may race here: keep one
        return fd

    def _makedirs(self, base: int, rel: bytes, resolve: int) -> int:
        """Resolve ``rel`` under ``base``, making missing directories on the way: each with
        mkdirat in its kernel-resolved parent, then opened O_NOFOLLOW and given to its owner
        through that fd (a directory swapped for a symlink meanwhile is never followed)."""
        lead = b"/" if rel.startswith(b"/") else b""  # an absolute path stays absolute

        def joined(parts: list[bytes]) -> bytes:
            return lead + b"/".join(parts) if parts else (lead or b".")

        done: list[bytes] = []
        for part in [p for p in rel.split(b"/") if p not in (b"", b".")]:
            try:
                os.close(openat2(base, joined([*done, part]), _DIR_PATH, 0, resolve))
            except FileNotFoundError:
                parent = openat2(base, joined(done), _DIR_PATH, 0, resolve)
                try:
                    self._mkdir_owned(parent, part, 0o777, self.owner_in(parent))
                except FileExistsError:
                    pass  # made meanwhile by someone else: resolved again on the next step
                finally:
                    os.close(parent)
            done.append(part)
        return openat2(base, joined(done), _DIR_PATH, 0, resolve)

    @staticmethod
    def _mkdir_owned(parent: int, name: bytes, mode: int, owner: Owner) -> None:
        os.mkdir(name, mode, dir_fd=parent)
        if owner is None:
            return
        try:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
        except OSError:
            return  # swapped for something else already: not ours to give away
        try:
            info = os.fstat(fd)
            if info.st_uid == os.geteuid():  # the directory we made, not one put in its place
                os.fchown(fd, *owner)
        finally:
            os.close(fd)

    def mkdir(self, place: Place, mode: int) -> None:
        self._mkdir_owned(place.dirfd, place.name, mode, place.owner)

    def owner_in(self, dirfd: int) -> Owner:
        """The owner of new entries in the directory ``dirfd``: the workload user under the
        workspace, else None (guestd's). Read from the fd, so it is where the write acts."""
        if self.workspace is None:
            return None
        try:
            where = os.fsencode(os.readlink(f"/proc/self/fd/{dirfd}"))
        except OSError:
            return None
        ws = self.workspace
        return self.ids if where == ws or where.startswith(ws.rstrip(b"/") + b"/") else None

    def close(self) -> None:
        for fd in self._root_fds.values():
            os.close(fd)
        self._root_fds.clear()


def outside_roots(path: str) -> GuestdError:
    return GuestdError(
        ErrorCode.PERMISSION_DENIED,
        f"writing {path} is outside policy.write_roots",
        details={"policy": "write_roots", "path": path},
    )
