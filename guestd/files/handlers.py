"""files capability: read, write (atomic), upload/download streams, stat, list, mkdir, remove, rename.

All blocking file-system calls run in the daemon's I/O thread pool, so a slow
or stuck disk can delay file ops but never ping or exec.

Paths arrive as os strs (the dispatcher converts the wire's str-or-bin form, see
guestd.wire.paths); names that go back out pass through ``path_to_wire``.
"""

from __future__ import annotations

import ctypes
import errno
import heapq
import os
import stat as st
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar, cast

from guestd.files.fs import open_regular
from guestd.wire.errors import ErrorCode, GuestdError, too_large
from guestd.wire.paths import path_to_wire

if TYPE_CHECKING:  # the generated message types: annotations only, never imported at run time
    from guestd.services import Request, Services
    from guestd.wire.types import (
        DirEntryRecord,
        DirEntryType,
        FileDownloadArgs,
        FileDownloadReply,
        FileListArgs,
        FileListReply,
        FileMkdirArgs,
        FileMkdirReply,
        FileReadArgs,
        FileReadReply,
        FileRemoveArgs,
        FileRemoveReply,
        FileRenameArgs,
        FileRenameReply,
        FileStatArgs,
        FileStatReply,
        FileUploadArgs,
        FileUploadReply,
        FileWriteArgs,
        FileWriteReply,
    )

DEFAULT_PERM = 0o644
TMP_MARK = ".guestd-tmp-"
PATH_MAX = 4096  # Linux's, counting the terminating NUL
Owner = tuple[int, int] | None  # (uid, gid) for new files and directories; None: guestd's own


class WorkspaceOwner:
    """Who new files and directories belong to: under the workspace, the workload user (when one
    is configured and guestd is root), so what the host writes there the workload can change;
    elsewhere guestd's own (root's), so the workload cannot rewrite files the host put in /etc
    or /usr. Replaced files always keep their owner. Called in an I/O thread (realpath)."""

    def __init__(self, workspace: str, ids: tuple[int, int] | None) -> None:
        self.root = os.path.realpath(workspace) if workspace and ids is not None else None
        self.ids = ids

    def __call__(self, path: str) -> Owner:
        if self.root is None:
            return None
        real = os.path.realpath(path)
        return self.ids if real == self.root or real.startswith(self.root.rstrip("/") + "/") else None


def makedirs_owned(path: str, owner: Owner, mode: int = 0o777) -> bool:
    """``os.makedirs(path, exist_ok=True)`` that gives each directory it creates to ``owner``.
    True when ``path`` itself was created. Iterative, so any depth the kernel accepts works
    (a path longer than PATH_MAX fails with ENAMETOOLONG)."""
    path = os.path.abspath(path)
    if len(os.fsencode(path)) >= PATH_MAX:  # before any mkdir: no half-made tree is left behind
        raise OSError(errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG), path)
    missing: list[str] = []  # deepest first
    at = path
    while not os.path.isdir(at):
        missing.append(at)
        parent = os.path.dirname(at)
        if parent == at:
            break
        at = parent
    created = False
    for d in reversed(missing):
        try:
            os.mkdir(d, mode)
        except FileExistsError:
            if os.path.isdir(d):
                continue  # someone else made it meanwhile
            raise
        if owner is not None:
            os.chown(d, *owner)
        created = d == path
    return created


def _type_name(mode: int) -> DirEntryType:
    kinds: tuple[tuple[Callable[[int], bool], DirEntryType], ...] = (
        (st.S_ISREG, "file"),
        (st.S_ISDIR, "dir"),
        (st.S_ISLNK, "symlink"),
        (st.S_ISFIFO, "fifo"),
        (st.S_ISSOCK, "socket"),
        (st.S_ISCHR, "char"),
        (st.S_ISBLK, "block"),
    )
    for test, name in kinds:
        if test(mode):
            return name
    return "other"


T = TypeVar("T")


def _os_call(fn: Any, *args: Any) -> Any:
    """Run fn, mapping OS failures to typed errors (runs in an I/O thread)."""
    try:
        return fn(*args)
    except GuestdError:
        raise
    except OSError as exc:
        raise GuestdError.from_os_error(exc) from None
    except ValueError as exc:  # NUL in a path, for example
        raise GuestdError(ErrorCode.BAD_REQUEST, str(exc)) from None


# --------------------------------------------------------------------------- blocking helpers


def read_range(path: str, offset: int, length: int | None, max_read: int) -> FileReadReply:
    fd = open_regular(path)  # a FIFO the workload planted must not hold an I/O thread
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
        chunk = os.read(fd, min(65536, limit - len(out)))
        if not chunk:
            break
        out += chunk
    return bytes(out)


class AtomicFile:
    """A temp file beside the target, renamed over it only when complete.

    Readers see the old file or the new one, never a mix; a failure at any point
    leaves the old file as it was and removes the temp file.
    """

    def __init__(self, path: str, flag: str, perm: int | None, parents: bool, new_owner: Owner = None) -> None:
        self.path = os.path.abspath(path)
        self.flag = flag
        self.dir = os.path.dirname(self.path)
        if parents:
            makedirs_owned(self.dir, new_owner)
        mode = DEFAULT_PERM if perm is None else perm
        self.owner: Owner = new_owner  # a new file's; a replaced file keeps its old owner
        try:
            old = os.stat(self.path)
        except FileNotFoundError:
            old = None
        if old is not None:
            if st.S_ISDIR(old.st_mode):
                raise GuestdError(ErrorCode.IS_A_DIRECTORY, f"is a directory: {path}", details={"path": path})
            if flag == "create":
                raise GuestdError(ErrorCode.EXISTS, f"already exists: {path}", details={"path": path})
            if perm is None:
                mode = st.S_IMODE(old.st_mode)  # an overwrite keeps the file's permissions
            self.owner = (old.st_uid, old.st_gid)
        self.mode = mode
        name = os.path.basename(self.path)
        self.tmp = os.path.join(self.dir, f".{name[:200]}{TMP_MARK}{os.urandom(6).hex()}")
        self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        self.size = 0
        # Writes run in I/O threads; abort runs on the loop when a request is cancelled,
        # possibly while a write is queued. Closing the fd then would let that write land
        # in whatever file reuses the fd number next (another upload's). The lock orders
        # them: a write in progress finishes first, a queued one finds the fd gone.
        self._fd_lock = threading.Lock()
        self.committed = False

    def write(self, data: bytes) -> None:
        with self._fd_lock:
            if self.fd < 0:
                raise GuestdError(ErrorCode.CANCELLED, "the upload was aborted", details={"path": self.path})
            view = memoryview(data)
            while view:
                n = os.write(self.fd, view)
                view = view[n:]
            self.size += len(data)

    def commit(self) -> int:
        with self._fd_lock:
            return self._commit_locked()

    def _commit_locked(self) -> int:
        if self.fd < 0:
            raise GuestdError(ErrorCode.CANCELLED, "the upload was aborted", details={"path": self.path})
        os.fchmod(self.fd, self.mode)
        if self.owner is not None and os.geteuid() == 0:
            os.fchown(self.fd, *self.owner)
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = -1
        if self.flag == "create":
            os.link(self.tmp, self.path)  # fails with EEXIST if someone raced us: no clobber
            os.unlink(self.tmp)
        else:
            os.rename(self.tmp, self.path)
        self.committed = True
        _fsync_dir(self.dir)
        return self.size

    def abort(self) -> None:
        """Close and remove the temp file. Never blocks the caller: while a write or the
        commit runs in an I/O thread, the abort waits for it on a thread of its own."""
        if self._fd_lock.acquire(blocking=False):
            self._abort_locked()
        else:
            threading.Thread(target=self._abort_when_free, name="guestd-abort", daemon=True).start()

    def _abort_when_free(self) -> None:
        self._fd_lock.acquire()
        self._abort_locked()

    def _abort_locked(self) -> None:
        try:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1
            if not self.committed:
                try:
                    os.unlink(self.tmp)
                except OSError:
                    pass
        finally:
            self._fd_lock.release()


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_whole(
    path: str, data: bytes, flag: str, perm: int | None, parents: bool, new_owner: Owner = None
) -> FileWriteReply:
    if flag == "append":
        if parents:
            makedirs_owned(os.path.dirname(os.path.abspath(path)), new_owner)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC
        try:  # new (then it gets new_owner) or existing (it keeps its owner)?
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, DEFAULT_PERM if perm is None else perm)
            created = True
        except FileExistsError:
            fd = open_regular(path, flags)  # never a FIFO's writer, waiting for a reader
            created = False
        try:
            if created and new_owner is not None:
                os.fchown(fd, *new_owner)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
            return {"size": os.fstat(fd).st_size}
        finally:
            os.close(fd)
    f = AtomicFile(path, flag, perm, parents, new_owner)
    try:
        f.write(data)
        return {"size": f.commit()}
    except BaseException:
        f.abort()
        raise


def stat_path(path: str, follow: bool) -> FileStatReply:
    s = os.stat(path) if follow else os.lstat(path)
    out: FileStatReply = {
        "type": _type_name(s.st_mode),
        "size": s.st_size,
        "mode": st.S_IMODE(s.st_mode),
        "uid": s.st_uid,
        "gid": s.st_gid,
        "mtime_ns": s.st_mtime_ns,
        "target": None,
    }
    if st.S_ISLNK(s.st_mode):
        out["target"] = path_to_wire(os.readlink(path))
    return out


def list_dir(path: str, cap: int) -> FileListReply:
    """The first ``cap`` entries in order of their names as bytes, and how many there are.

    Every name is read (the order is the names', not the directory's), but only ``cap``
    are kept: a bounded heap, so a huge directory costs a scan, not memory."""
    total = 0

    def counted(it: Iterator[os.DirEntry[bytes]]) -> Iterator[os.DirEntry[bytes]]:
        nonlocal total
        for e in it:
            total += 1
            yield e

    with os.scandir(os.fsencode(path)) as it:
        scanned = counted(it)
        first = heapq.nsmallest(cap, scanned, key=lambda e: e.name)
        for _ in scanned:  # nsmallest(0, ...) returns before the end: count the rest
            pass
    entries: list[DirEntryRecord] = []
    for e in first:
        try:
            s = e.stat(follow_symlinks=False)
        except OSError:
            continue  # vanished between listing and stat
        entries.append(
            {
                "name": path_to_wire(e.name),
                "type": _type_name(s.st_mode),
                "size": s.st_size,
                "mode": st.S_IMODE(s.st_mode),
                "mtime_ns": s.st_mtime_ns,
            }
        )
    return {"entries": entries, "total": total, "truncated": total > cap}


def make_dir(path: str, parents: bool, perm: int, new_owner: Owner = None) -> FileMkdirReply:
    if parents:
        if os.path.isdir(path):
            return {"created": False}
        makedirs_owned(os.path.dirname(os.path.abspath(path)), new_owner)
    try:
        os.mkdir(path, perm)
    except FileExistsError:
        if parents and os.path.isdir(path):
            return {"created": False}
        raise
    if new_owner is not None:
        os.chown(path, *new_owner)
    return {"created": True}


def remove_path(path: str, recursive: bool) -> FileRemoveReply:
    s = os.lstat(path)
    if st.S_ISDIR(s.st_mode):
        if not recursive:
            os.rmdir(path)
            return {"removed": 1}
        return {"removed": remove_tree(path)}
    os.unlink(path)
    return {"removed": 1}


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def remove_tree(path: str) -> int:
    """Remove a directory tree of any depth; returns the entries removed, itself included.

    Iterative (shutil.rmtree and os.walk recurse, and a workload can nest directories
    deeper than Python's recursion limit) and holding one directory fd at a time (a
    deep tree would otherwise exhaust fds). Every step is relative to that fd and never
    follows a symlink; climbing back up through ".." is checked against the device and
    inode recorded on the way down, so a directory moved mid-walk stops the removal
    with EBUSY instead of leading it elsewhere.
    """
    removed = 0
    fd = os.open(path, _DIR_FLAGS)
    trail: list[tuple[str, int, int]] = []  # (name in parent, parent's st_dev, parent's st_ino)
    try:
        while True:
            unlinked, child = _unlink_files_find_dir(fd)
            removed += unlinked
            if child is None:
                if not trail:
                    break
                name, dev, ino = trail.pop()
                parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = parent
                here = os.fstat(fd)
                if (here.st_dev, here.st_ino) != (dev, ino):
                    raise OSError(errno.EBUSY, "directory tree changed during removal", path)
                os.rmdir(name, dir_fd=fd)
                removed += 1
                continue
            here = os.fstat(fd)
            sub = os.open(child, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = sub
            trail.append((child, here.st_dev, here.st_ino))
    finally:
        os.close(fd)
    os.rmdir(path)
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


_AT_FDCWD = -100
_RENAME_NOREPLACE = 1


def _rename_noreplace(src: str, dst: str) -> None:
    """renameat2(RENAME_NOREPLACE): atomic, never clobbers. Falls back where unsupported."""
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is not None:
        if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.ENOSYS, errno.EINVAL):
            raise OSError(err, os.strerror(err), dst if err == errno.EEXIST else src)
    if os.path.lexists(dst):  # best effort on filesystems without RENAME_NOREPLACE
        raise OSError(errno.EEXIST, os.strerror(errno.EEXIST), dst)
    os.rename(src, dst)


def rename_path(src: str, dst: str, overwrite: bool) -> FileRenameReply:
    if "\0" in src or "\0" in dst:
        raise ValueError("embedded null byte")
    if overwrite:
        os.rename(src, dst)
    else:
        _rename_noreplace(src, dst)
    return {}


# --------------------------------------------------------------------------- registration


def open_atomic(path: str, flag: str, perm: int | None, parents: bool, owner: WorkspaceOwner) -> AtomicFile:
    return AtomicFile(path, flag, perm, parents, owner(path))


def register(services: Services) -> None:
    limits = services.config.limits
    policy = services.config.policy

    async def io(fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in an I/O thread, OS failures mapped to typed errors."""
        return cast(T, await services.run_in_io(_os_call, fn, *args))

    try:
        ids = policy.workload_ids()
    except GuestdError:  # a missing workload user: exec and friends report it on use
        ids = None
    owner = WorkspaceOwner(services.config.workspace or "", ids)

    async def op_read(ctx: Request, a: FileReadArgs) -> FileReadReply:
        return await io(read_range, a["path"], a["offset"], a["length"], limits.max_read)

    async def op_write(ctx: Request, a: FileWriteArgs) -> FileWriteReply:
        policy.check_write(a["path"])
        services.writes.started()  # snapshot.prepare waits for these
        try:
            return await io(
                lambda: write_whole(a["path"], a["data"], a["flag"], a["perm"], a["parents"], owner(a["path"])),
            )
        finally:
            services.writes.finished()

    async def op_stat(ctx: Request, a: FileStatArgs) -> FileStatReply:
        return await io(stat_path, a["path"], a["follow"])

    async def op_list(ctx: Request, a: FileListArgs) -> FileListReply:
        cap = a["max_entries"] if a["max_entries"] is not None else limits.max_list_entries
        return await io(list_dir, a["path"], cap)

    async def op_mkdir(ctx: Request, a: FileMkdirArgs) -> FileMkdirReply:
        policy.check_write(a["path"])
        return await io(lambda: make_dir(a["path"], a["parents"], a["perm"], owner(a["path"])))

    async def op_remove(ctx: Request, a: FileRemoveArgs) -> FileRemoveReply:
        policy.check_write(a["path"])
        return await io(remove_path, a["path"], a["recursive"])

    async def op_rename(ctx: Request, a: FileRenameArgs) -> FileRenameReply:
        policy.check_write(a["src"])
        policy.check_write(a["dst"])
        return await io(rename_path, a["src"], a["dst"], a["overwrite"])

    async def op_upload(ctx: Request, a: FileUploadArgs) -> FileUploadReply:
        services.writes.started()
        try:
            return await _upload(ctx, a)
        finally:
            services.writes.finished()

    async def _upload(ctx: Request, a: FileUploadArgs) -> FileUploadReply:
        policy.check_write(a["path"])
        f: AtomicFile = await services.acquire_in_io(
            _os_call, AtomicFile.abort, open_atomic, a["path"], a["flag"], a["perm"], a["parents"], owner
        )
        try:
            while True:
                body = await ctx.input.get()
                data = body.get("data")
                if isinstance(data, bytes) and data:
                    if a["size"] is not None and f.size + len(data) > a["size"]:
                        raise GuestdError(
                            ErrorCode.BAD_REQUEST,
                            f"more data than the declared size {a['size']}",
                            details={"field": "size"},
                        )
                    await io(f.write, data)
                    ctx.ack_input(len(data))
                if body.get("eof"):
                    break
            # Past eof the upload commits: a cancel arriving now must not answer "cancelled"
            # for a file that is then in place, so the reply reports what really happened.
            ctx.commit()
            if a["size"] is not None and f.size != a["size"]:
                raise GuestdError(
                    ErrorCode.BAD_REQUEST,
                    f"upload ended at {f.size} bytes, declared {a['size']}; old file kept",
                    details={"field": "size"},
                )
            size = await io(f.commit)
            return {"size": size}
        except BaseException:
            f.abort()  # close + unlink of our own temp file: quick, and must happen even on cancel
            raise

    async def op_download(ctx: Request, a: FileDownloadArgs) -> FileDownloadReply:
        chunk = a["chunk"] or limits.max_chunk
        fd: int = await services.acquire_in_io(_os_call, os.close, _open_for_download, a["path"])
        try:
            size = os.fstat(fd).st_size
            end = size if a["length"] is None else min(size, a["offset"] + a["length"])
            pos = a["offset"]
            await ctx.send_event({"ev": "start", "size": size})
            sent = 0
            while pos < end:
                data: bytes = await io(os.pread, fd, min(chunk, end - pos), pos)
                if not data:
                    break  # file shrank while we read it
                await ctx.send_data_event({"ev": "data"}, data)
                pos += len(data)
                sent += len(data)
            return {"bytes": sent, "size": size}
        finally:
            os.close(fd)

    for name, fn in (
        ("file.read", op_read),
        ("file.write", op_write),
        ("file.upload", op_upload),
        ("file.download", op_download),
        ("file.stat", op_stat),
        ("file.list", op_list),
        ("file.mkdir", op_mkdir),
        ("file.remove", op_remove),
        ("file.rename", op_rename),
    ):
        services.ops.add(name, fn, bulk_reply=name == "file.read")


def _open_for_download(path: str) -> int:
    return open_regular(path)
