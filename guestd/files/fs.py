"""The file-system layer under every file op: paths are resolved by the
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
from collections.abc import Callable

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


def describe_type(mode: int) -> str:
    for test, name in (
        (st.S_ISFIFO, "a FIFO"),
        (st.S_ISSOCK, "a socket"),
        (st.S_ISCHR, "a character device"),
        (st.S_ISBLK, "a block device"),
        (st.S_ISDIR, "a directory"),
        (st.S_ISLNK, "a symlink"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def reopen_regular(pathfd: int, flags: int, shown: str, *, single_link: bool = False) -> int:
    """Open for I/O the regular file that the ``O_PATH`` fd ``pathfd`` holds, or refuse.

    The type is checked on the inode already resolved, before anything is opened for I/O:
    a FIFO is never opened (which would block), a device never opened (which can act, like
    a watchdog or a tape), a directory is ``is_a_directory``, anything else ``not_a_file``.
    The reopen goes through /proc/self/fd, so it is that same inode, whatever happened to
    its name meanwhile."""
    info = os.fstat(pathfd)
    if st.S_ISDIR(info.st_mode):
        raise GuestdError(ErrorCode.IS_A_DIRECTORY, f"is a directory: {shown}", details={"path": shown})
    if st.S_ISLNK(info.st_mode):  # opened O_NOFOLLOW: the final component is a symlink
        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), shown)
    if not st.S_ISREG(info.st_mode):
        raise not_a_file(shown, describe_type(info.st_mode))
    if single_link and info.st_nlink > 1:
        # A hard link the workload made to a file elsewhere (outside the roots, or a root
        # file under fs.protected_hardlinks=0): writing in place would write that file.
        raise GuestdError(
            ErrorCode.PERMISSION_DENIED,
            f"{shown} has {info.st_nlink} hard links: written in place it would change the other names too",
            details={"path": shown, "reason": "hard_links"},
        )
    # O_NOFOLLOW would refuse the /proc link itself; the inode is resolved already.
    flags &= ~(os.O_NOFOLLOW | os.O_CREAT | os.O_EXCL)
    return os.open(f"/proc/self/fd/{pathfd}", flags | os.O_NOCTTY | os.O_CLOEXEC)


def open_to_write_in_place(name: str | bytes, flags: int, dir_fd: int, shown: str) -> int:
    """Open ``name`` in ``dir_fd`` to write it in place (an append): never following a final
    symlink, a regular file with no other hard link."""
    pathfd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        return reopen_regular(pathfd, flags, shown, single_link=True)
    finally:
        os.close(pathfd)


def not_a_file(path: str, what: str) -> GuestdError:
    return GuestdError(ErrorCode.NOT_A_FILE, f"not a regular file ({what}): {path}", details={"path": path})


# --------------------------------------------------------------------------- where ops act

AT_FDCWD = -100
PATH_MAX = 4096  # Linux's, counting the terminating NUL
_DIR_PATH = os.O_PATH | os.O_DIRECTORY
Owner = tuple[int, int] | None  # (uid, gid) for new files and directories; None: guestd's own


class Place:
    """Where an op acts: a kernel-resolved parent directory (an fd) and a name in it. Every
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


class Roots:
    """The directories a kind of access is confined to (``policy.write_roots``,
    ``policy.read_roots``), each an fd opened once and resolved beneath with
    ``RESOLVE_BENEATH``: neither ``..`` nor a symlink leaves it. None: no confinement
    (the kernel's usual rules, without /proc magic links)."""

    def __init__(self, roots: list[str] | None, policy: str, verb: str) -> None:
        self.policy = policy
        self.verb = verb
        self.prefixes: list[tuple[bytes, str]] | None = None
        if roots is not None:
            self.prefixes = []
            for root in roots:
                for spelling in {os.path.abspath(root), os.path.realpath(root)}:
                    self.prefixes.append((os.fsencode(spelling).rstrip(b"/") or b"/", root))
            self.prefixes.sort(key=lambda r: -len(r[0]))  # the longest (innermost) root first
        self._fds: dict[str, int] = {}
        for root in roots or []:
            # Opened now, at start, as the config names them: from here on a root is this
            # directory, whatever the workload later puts at its path.
            try:
                self._fds[root] = os.open(root, _DIR_PATH | os.O_CLOEXEC)
            except OSError:
                pass  # made later: opened on first use, without following any symlink

    def base(self, absolute: bytes, path: str) -> tuple[int, bytes, int]:
        """(directory fd, path relative to it, RESOLVE_* flags) to resolve ``absolute`` with."""
        if self.prefixes is None:
            return AT_FDCWD, absolute, RESOLVE_NO_MAGICLINKS
        for prefix, root in self.prefixes:
            if absolute == prefix or absolute.startswith(prefix + b"/") or prefix == b"/":
                rel = absolute[len(prefix) :].lstrip(b"/") or b"."
                return self._fd(root, path), rel, RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS
        raise self.refused(path)

    def _fd(self, root: str, path: str) -> int:
        fd = self._fds.get(root)
        if fd is None:
            try:  # a root missing at start: a symlink on its path now could be the workload's
                fd = openat2(AT_FDCWD, os.path.abspath(root), _DIR_PATH, 0, RESOLVE_NO_SYMLINKS)
            except OSError as exc:
                raise GuestdError.from_os_error(exc, policy=self.policy, path=path) from None
            fd = self._fds.setdefault(root, fd)  # two threads may race here: keep one
        return fd

    def refused(self, path: str) -> GuestdError:
        return GuestdError(
            ErrorCode.PERMISSION_DENIED,
            f"{self.verb} {path} is outside policy.{self.policy}",
            details={"policy": self.policy, "path": path},
        )

    def open(self, absolute: bytes, path: str, flags: int, mode: int = 0) -> int:
        """openat2 of ``absolute`` under these roots; leaving them is ``refused``."""
        base, rel, resolve = self.base(absolute, path)
        try:
            return openat2(base, rel, flags, mode, resolve)
        except OSError as exc:
            if exc.errno == errno.EXDEV:
                raise self.refused(path) from None
            raise

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def absolute_path(path: str) -> bytes:
    """``path`` as absolute bytes (relative paths start at guestd's working directory),
    refusing what no system call could take."""
    raw = os.fsencode(path)
    if b"\0" in raw:
        raise GuestdError(ErrorCode.BAD_REQUEST, "embedded null byte in path", details={"field": "path"})
    if len(raw) >= PATH_MAX:
        raise OSError(errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG), path)
    return raw if raw.startswith(b"/") else os.fsencode(os.getcwd()).rstrip(b"/") + b"/" + raw


def split_last(absolute: bytes) -> tuple[bytes, bytes]:
    """(parent, last name) of an absolute path; the name is empty, ``.`` or ``..`` where the
    path names no entry of its own (``/``, ``x/.``, ``x/..``)."""
    head, _, name = absolute.rstrip(b"/").rpartition(b"/")
    return head or b"/", name


class FileSystem:
    """The one file-system layer under every file op. Paths are resolved by the kernel, in
    the I/O thread that then acts, on directory fds: writes under ``write_roots``, reads under
    ``read_roots`` (see Roots). New entries under the workspace belong to the workload user,
    decided from the resolved directory fd, not from a path string."""

    def __init__(
        self,
        *,
        write_roots: list[str] | None = None,
        read_roots: list[str] | None = None,
        workspace: str = "",
        ids: tuple[int, int] | None = None,
        pending: PendingTemps | None = None,
    ) -> None:
        self.writes = Roots(write_roots, "write_roots", "writing")
        self.reads = Roots(read_roots, "read_roots", "reading")
        self.workspace = os.fsencode(os.path.realpath(workspace)) if workspace and ids is not None else None
        self.ids = ids
        self.pending = pending

    # -- writes ---------------------------------------------------------------------------
    def place(self, path: str, *, parents: bool = False, field: str = "path") -> Place:
        """The parent of ``path``, resolved (and with ``parents``, created) under the write roots.
        ``field`` is the argument ``path`` came from (``src``, ``dst``, ``files``, ``patch``): a
        path that names no entry is ``bad_request`` naming it (section 6), with the path."""
        head, name = split_last(absolute_path(path))
        if name in (b"", b".", b".."):
            raise GuestdError(
                ErrorCode.BAD_REQUEST,
                f"the path names no entry to act on: {path}",
                details={"field": field, "path": path},
            )
        if parents:
            base, rel, resolve = self.writes.base(head, path)
            try:
                dirfd = self._makedirs(base, rel, resolve)
            except OSError as exc:
                if exc.errno == errno.EXDEV:
                    raise self.writes.refused(path) from None
                raise
        else:
            dirfd = self.writes.open(head, path, _DIR_PATH)
        return Place(dirfd, name, path, self.owner_in(dirfd))

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

    def check_move(self, src: Place, dst: Place) -> os.stat_result | None:
        """A rename into a directory outside the workspace must not carry there anything the
        workload can change (a script for /etc/profile.d that it could then rewrite, or a
        directory it could plant files in): refused, ``permission_denied`` with details.reason
        ``workload_owned``; a copy (write or upload) is the way. Returns the entry checked,
        for verify_moved, or None where the rule does not apply (no workload user, or a
        destination in the workspace)."""
        if self.ids is None or dst.owner is not None:
            return None
        info = os.stat(src.name, dir_fd=src.dirfd, follow_symlinks=False)
        if self._workload_can_change(info) or (st.S_ISDIR(info.st_mode) and self._tree_has_changeable(src)):
            raise _move_refused(src, dst)
        return info

    def verify_moved(self, src: Place, dst: Place, checked: os.stat_result) -> None:
        """The workload may swap the source between check_move and the rename: what arrived
        must be the entry checked. Anything else is moved back out and the rename refused."""
        try:
            now = os.stat(dst.name, dir_fd=dst.dirfd, follow_symlinks=False)
        except FileNotFoundError:
            return  # moved on by someone else already: nothing is left where we put it
        if (now.st_dev, now.st_ino) == (checked.st_dev, checked.st_ino) and not self._workload_can_change(now):
            return
        back = Place(src.dirfd, src.name, src.path, None)
        try:
            rename_noreplace(dst, back)
        except OSError:  # the source's name is taken meanwhile: a name of guestd's beside it
            aside = Place(src.dirfd, b".guestd-refused-" + os.urandom(6).hex().encode(), src.path, None)
            rename_noreplace(dst, aside)
        raise _move_refused(src, dst)

    def _workload_can_change(self, info: os.stat_result) -> bool:
        assert self.ids is not None
        uid, gid = self.ids
        if info.st_uid == uid:
            return True
        if st.S_ISLNK(info.st_mode):
            return False  # a link's target is fixed; only its owner could replace it
        return bool(info.st_mode & 0o002) or (info.st_gid == gid and bool(info.st_mode & 0o020))

    def _tree_has_changeable(self, top: Place, limit: int = 10_000) -> bool:
        """Does the directory ``top`` hold anything the workload can change, at any depth?
        Walked through fds without following links; a tree of more than ``limit`` entries
        counts as yes (the rename is refused rather than the check left unfinished)."""
        seen = 0
        pending = [os.open(top.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=top.dirfd)]
        try:
            while pending:
                fd = pending.pop()
                try:
                    with os.scandir(fd) as entries:
                        for entry in entries:
                            seen += 1
                            info = entry.stat(follow_symlinks=False)
                            if seen > limit or self._workload_can_change(info):
                                return True
                            if st.S_ISDIR(info.st_mode):
                                flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
                                pending.append(os.open(entry.name, flags, dir_fd=fd))
                finally:
                    os.close(fd)
        finally:
            for fd in pending:
                os.close(fd)
        return False

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

    # -- reads ----------------------------------------------------------------------------
    def open_file(self, path: str) -> int:
        """A regular file opened for reading, non-blocking (symlinks followed, as the kernel
        resolves them under the read roots); a FIFO, socket or device is ``not_a_file`` without
        being opened."""
        pathfd = self.reads.open(absolute_path(path), path, os.O_PATH)
        try:
            # O_NONBLOCK: a regular file whose read waits for the kernel (/proc/kmsg, a tracing
            # pipe) answers at once instead of holding an I/O thread; files on disk ignore it.
            return reopen_regular(pathfd, os.O_RDONLY | os.O_NONBLOCK, path)
        finally:
            os.close(pathfd)

    def open_dir(self, path: str) -> int:
        """A directory opened for listing."""
        return self.reads.open(absolute_path(path), path, os.O_RDONLY | os.O_DIRECTORY)

    def stat(self, path: str, follow: bool) -> tuple[os.stat_result, bytes | None]:
        """(the entry's stat, a symlink's target) resolved under the read roots; without
        ``follow`` a final symlink is described, not followed."""
        absolute = absolute_path(path)
        head, name = split_last(absolute)
        if follow or name in (b"", b".", b".."):
            fd = self.reads.open(absolute, path, os.O_PATH)
            try:
                return os.fstat(fd), None
            finally:
                os.close(fd)
        dirfd = self.reads.open(head, path, _DIR_PATH)
        try:
            info = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
            target = os.readlink(name, dir_fd=dirfd) if st.S_ISLNK(info.st_mode) else None
            return info, target
        finally:
            os.close(dirfd)

    def close(self) -> None:
        self.writes.close()
        self.reads.close()


def _move_refused(src: Place, dst: Place) -> GuestdError:
    return GuestdError(
        ErrorCode.PERMISSION_DENIED,
        f"renaming {src.path} to {dst.path} would put what the workload can change outside the workspace;"
        " write a copy instead",
        details={"path": dst.path, "reason": "workload_owned"},
    )


_RENAME_NOREPLACE = 1


def rename_noreplace(src: Place, dst: Place) -> None:
    """renameat2(RENAME_NOREPLACE): atomic, never clobbers. Falls back where unsupported."""
    fn = getattr(_libc, "renameat2", None)
    if fn is not None:
        if fn(src.dirfd, src.name, dst.dirfd, dst.name, _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.ENOSYS, errno.EINVAL):
            raise OSError(err, os.strerror(err), dst.path if err == errno.EEXIST else src.path)
    try:  # best effort on file systems without RENAME_NOREPLACE
        os.stat(dst.name, dir_fd=dst.dirfd, follow_symlinks=False)
        raise OSError(errno.EEXIST, os.strerror(errno.EEXIST), dst.path)
    except FileNotFoundError:
        pass
    os.rename(src.name, dst.name, src_dir_fd=src.dirfd, dst_dir_fd=dst.dirfd)


class PendingTemps:
    """Named temp files of writes in progress, for file systems without ``O_TMPFILE`` (FUSE,
    NFS, vfat): each is recorded under the runtime dir before it is made and forgotten when
    its write commits or aborts, so a guestd killed mid-write has them removed by the next
    guestd that starts. Records live in a directory per guestd pid: a second guestd sharing
    the runtime dir leaves a live one's alone."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.mine = os.path.join(directory, str(os.getpid()))

    def record(self, place: Place, temp_name: bytes) -> str:
        """Record ``temp_name`` in ``place``'s directory: its path as the kernel resolved it (no
        symlinks in it) and its identity (device, inode), which the cleanup checks."""
        where = os.fsencode(os.readlink(f"/proc/self/fd/{place.dirfd}"))
        entry = where + b"\0" + temp_name + b"\0" + _dir_identity(place.dirfd)
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


TEMP_MARK = b".guestd-tmp-"
TREE_TEMP_MARK = b".guestd-tree-"  # a tree upload's staging directory: "." + name + mark + 12 hex digits
