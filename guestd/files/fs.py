"""The file-system layer under every file op: paths are resolved by the
kernel in the call that acts, relative to a directory fd, and nothing the workload planted
(a FIFO, a socket, a device where a file is expected) can block an I/O thread.

Paths are resolved with ``openat2`` (:mod:`guestd.files.resolver`); guestd's temp names and
their records are :mod:`guestd.files.temps`.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat as st
from collections.abc import Callable
from typing import TYPE_CHECKING

from guestd.files.resolver import (
    AT_FDCWD,
    RESOLVE_BENEATH,
    RESOLVE_NO_MAGICLINKS,
    RESOLVE_NO_SYMLINKS,
    openat2,
)
from guestd.files.temps import PendingTemps
from guestd.wire.errors import ErrorCode, GuestdError

if TYPE_CHECKING:  # the generated message types: annotations only, never imported at run time
    from guestd.wire.types import DirEntryType

_libc = ctypes.CDLL(None, use_errno=True)

# Each kind of entry: how its mode is told, its name on the wire (file.list, file.stat) and in
# a message.
ENTRY_KINDS: tuple[tuple[Callable[[int], bool], DirEntryType, str], ...] = (
    (st.S_ISREG, "file", "a regular file"),
    (st.S_ISDIR, "dir", "a directory"),
    (st.S_ISLNK, "symlink", "a symlink"),
    (st.S_ISFIFO, "fifo", "a FIFO"),
    (st.S_ISSOCK, "socket", "a socket"),
    (st.S_ISCHR, "char", "a character device"),
    (st.S_ISBLK, "block", "a block device"),
)


def entry_type(mode: int) -> DirEntryType:
    """The entry's type as the wire names it."""
    for test, name, _ in ENTRY_KINDS:
        if test(mode):
            return name
    return "other"


def describe_type(mode: int) -> str:
    """The entry's type as a message says it."""
    for test, _, described in ENTRY_KINDS:
        if test(mode):
            return described
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
