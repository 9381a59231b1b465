"""files capability: read, write (atomic), upload/download streams, stat, list, mkdir, remove, rename.

All blocking file-system calls run in the daemon's I/O thread pool, so a slow
or stuck disk can delay file ops but never ping or exec.

Paths arrive as os strs (the dispatcher converts the wire's str-or-bin form, see
guestd.wire.paths); names that go back out pass through ``path_to_wire``.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import heapq
import logging
import os
import stat as st
import threading
from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar, cast

from guestd.children.cgroups import guestd_running
from guestd.files.fs import (
    TEMP_MARK,
    FileSystem,
    Owner,
    PendingTemps,
    Place,
    open_to_write_in_place,
    rename_noreplace,
)
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
log = logging.getLogger("guestd.files")


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


class AtomicFile:
    """A temp file beside the target, renamed over it only when complete.

    Readers see the old file or the new one, never a mix; a failure at any point
    leaves the old file as it was and removes the temp file. Every step acts on the
    kernel-resolved parent directory's fd (``Place``), never on a path again.
    """

    def __init__(self, place: Place, flag: str, perm: int | None, pending: PendingTemps | None = None) -> None:
        self.place = place  # owned: closed with the file
        self.path = place.path
        self.pending = pending
        self.flag = flag
        mode = DEFAULT_PERM if perm is None else perm
        self.owner: Owner = place.owner  # a new file's; a replaced file keeps its old owner
        try:
            old = os.stat(place.name, dir_fd=place.dirfd, follow_symlinks=False)
        except FileNotFoundError:
            old = None
        if old is not None:
            if st.S_ISDIR(old.st_mode):
                raise GuestdError(ErrorCode.IS_A_DIRECTORY, f"is a directory: {self.path}", details={"path": self.path})
            if flag == "create":
                raise GuestdError(ErrorCode.EXISTS, f"already exists: {self.path}", details={"path": self.path})
            if st.S_ISREG(old.st_mode):  # a symlink or FIFO in its place is replaced, not kept
                if perm is None:
                    mode = st.S_IMODE(old.st_mode)  # an overwrite keeps the file's permissions
                self.owner = (old.st_uid, old.st_gid)
        self.mode = mode
        self.tmp = b"." + place.name[:200] + TEMP_MARK + os.urandom(6).hex().encode()
        self.record: str | None = None  # where a named temp file is recorded for cleanup
        try:
            # An inode without a name until the commit links it in: a guestd killed mid-write
            # (or a crash) leaves nothing behind, where a named temp file would stay forever.
            self.fd = os.open(".", os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o600, dir_fd=place.dirfd)
            self.anonymous = True
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
            # File systems without it (FUSE, NFS, vfat): a named temp file, recorded first so
            # that a guestd killed before the commit has it removed by its successor.
            self._record_temp_name()
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                self.fd = os.open(self.tmp, flags, 0o600, dir_fd=place.dirfd)
            except BaseException:
                self._forget_record()
                raise
            self.anonymous = False
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
        d = self.place.dirfd
        if self.anonymous:
            # linkat through /proc names the unnamed inode; "create" links it as the target
            # itself (EEXIST if someone raced us: no clobber), an overwrite under a temp name
            # that is renamed over the target at once.
            # The temp name exists only between the link and the rename, but a guestd killed
            # there would leave it: it is recorded first, like a named temp file.
            inode = f"/proc/self/fd/{self.fd}"
            if self.flag == "create":
                os.link(inode, self.place.name, dst_dir_fd=d, follow_symlinks=True)
            else:
                try:
                    self._record_temp_name()
                except OSError:
                    pass  # no record (runtime dir full?) only risks a name for that instant
                try:
                    os.link(inode, self.tmp, dst_dir_fd=d, follow_symlinks=True)
                    self._rename_temp_over_target()
                finally:
                    self._forget_record()
            os.close(self.fd)
            self.fd = -1
        else:
            os.close(self.fd)
            self.fd = -1
            if self.flag == "create":
                # linkat fails with EEXIST if someone raced us: no clobber
                os.link(self.tmp, self.place.name, src_dir_fd=d, dst_dir_fd=d, follow_symlinks=False)
                os.unlink(self.tmp, dir_fd=d)
            else:
                self._rename_temp_over_target()
            self._forget_record()
        self.committed = True
        _fsync_dirfd(d)
        self.place.close()
        return self.size

    def _rename_temp_over_target(self) -> None:
        """The named temp file replaces the target; if it cannot (the workload put a directory
        there meanwhile), the temp file goes and the error names the target."""
        d = self.place.dirfd
        try:
            os.rename(self.tmp, self.place.name, src_dir_fd=d, dst_dir_fd=d)
        except OSError as exc:
            try:
                os.unlink(self.tmp, dir_fd=d)
            except OSError:
                pass
            raise OSError(exc.errno, exc.strerror, self.path) from None

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
            if not self.committed and not self.anonymous and self.place.dirfd >= 0:
                try:
                    os.unlink(self.tmp, dir_fd=self.place.dirfd)
                except OSError:
                    pass
                self._forget_record()
            self.place.close()
        finally:
            self._fd_lock.release()

    def _record_temp_name(self) -> None:
        if self.pending is not None:
            self.record = self.pending.record(self.place, self.tmp)

    def _forget_record(self) -> None:
        if self.record is not None:
            PendingTemps.forget(self.record)
            self.record = None

    # -- streamed writes (file.upload) -------------------------------------------------------
    # Bytes written and not yet handed to the disk's writeback (see write_streaming).
    _not_written_back = 0

    def write_streaming(self, data: bytes) -> None:
        """``write``, and once WRITEBACK_STEP bytes are dirty, start the disk writing them back.

        The commit's fsync then waits for the last few MiB only instead of the whole file:
        measured here, a 64 MiB write + fsync took 31 ms, 21 ms with writeback started every
        4 MiB (fsync 20 -> 9 ms), and an upload overlaps the disk with receiving the rest.
        Durability is unchanged: the commit still fsyncs before the rename."""
        self.write(data)
        self._not_written_back += len(data)
        if self._not_written_back < WRITEBACK_STEP:
            return
        with self._fd_lock:
            if self.fd >= 0:
                _start_writeback(self.fd, self.size - self._not_written_back, self._not_written_back)
        self._not_written_back = 0


WRITEBACK_STEP = 4 * 1024 * 1024
_SYNC_FILE_RANGE_WRITE = 2
_sync_file_range: Any = None


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """sync_file_range(SYNC_FILE_RANGE_WRITE): queue the range's dirty pages for writeback without
    waiting for them. Only a head start for a later fsync, so any failure is ignored (the fsync
    reports real errors); where libc lacks the call it does nothing."""
    global _sync_file_range
    if _sync_file_range is None:
        fn: Any = getattr(ctypes.CDLL(None, use_errno=True), "sync_file_range", None)
        if fn is not None:
            fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
        _sync_file_range = fn or False
    if _sync_file_range:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)  # ctypes releases the GIL meanwhile


def _fsync_dirfd(dirfd: int) -> None:
    """fsync a directory held as an O_PATH fd (which fsync refuses): through a real open of it."""
    try:
        fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dirfd)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_whole(fsys: FileSystem, path: str, data: bytes, flag: str, perm: int | None, parents: bool) -> FileWriteReply:
    place = fsys.place(path, parents=parents)
    if flag == "append":
        with place:
            return _append(place, data, perm)
    try:
        f = AtomicFile(place, flag, perm, fsys.pending)
    except BaseException:
        place.close()
        raise
    try:
        f.write(data)
        return {"size": f.commit()}
    except BaseException:
        f.abort()
        raise


def _append(place: Place, data: bytes, perm: int | None) -> FileWriteReply:
    # O_NOFOLLOW: an append never follows a symlink the workload put in the target's place.
    flags = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
    try:  # new (then it gets the place's owner) or existing (it keeps its owner)?
        fd = os.open(
            place.name, flags | os.O_CREAT | os.O_EXCL, DEFAULT_PERM if perm is None else perm, dir_fd=place.dirfd
        )
        created = True
    except FileExistsError:
        fd = open_to_write_in_place(place.name, flags, place.dirfd, place.path)
        created = False
    try:
        if created and place.owner is not None:
            os.fchown(fd, *place.owner)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
        return {"size": os.fstat(fd).st_size}
    finally:
        os.close(fd)


def stat_path(fsys: FileSystem, path: str, follow: bool) -> FileStatReply:
    s, target = fsys.stat(path, follow)
    out: FileStatReply = {
        "type": _type_name(s.st_mode),
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
                "type": _type_name(s.st_mode),
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


# --------------------------------------------------------------------------- registration


def open_atomic(fsys: FileSystem, path: str, flag: str, perm: int | None, parents: bool) -> AtomicFile:
    place = fsys.place(path, parents=parents)
    try:
        return AtomicFile(place, flag, perm, fsys.pending)
    except BaseException:
        place.close()
        raise


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
    pending = PendingTemps(os.path.join(services.runtime_dir(), "pending-writes"))
    fsys = FileSystem(
        write_roots=policy.write_roots,
        read_roots=policy.read_roots,
        workspace=services.config.workspace or "",
        ids=ids,
        pending=pending,
    )

    def remove_temps_left_behind() -> None:
        removed = pending.remove_left_behind(guestd_running)
        if removed:
            log.warning("removed %d temp files of writes a previous guestd did not finish", removed)

    services.on_start.append(remove_temps_left_behind)

    async def op_read(ctx: Request, a: FileReadArgs) -> FileReadReply:
        return await io(read_range, fsys, a["path"], a["offset"], a["length"], limits.max_read)

    async def op_write(ctx: Request, a: FileWriteArgs) -> FileWriteReply:
        # snapshot.prepare waits for these, until the thread is done
        return await services.writes.landing(
            io(lambda: write_whole(fsys, a["path"], a["data"], a["flag"], a["perm"], a["parents"]))
        )

    async def op_stat(ctx: Request, a: FileStatArgs) -> FileStatReply:
        return await io(stat_path, fsys, a["path"], a["follow"])

    async def op_list(ctx: Request, a: FileListArgs) -> FileListReply:
        cap = a["max_entries"] if a["max_entries"] is not None else limits.max_list_entries
        return await io(list_dir, fsys, a["path"], cap)

    async def op_mkdir(ctx: Request, a: FileMkdirArgs) -> FileMkdirReply:
        return await io(make_dir, fsys, a["path"], a["parents"], a["perm"])

    async def op_remove(ctx: Request, a: FileRemoveArgs) -> FileRemoveReply:
        return await io(remove_path, fsys, a["path"], a["recursive"])

    async def op_rename(ctx: Request, a: FileRenameArgs) -> FileRenameReply:
        return await io(rename_path, fsys, a["src"], a["dst"], a["overwrite"])

    async def op_upload(ctx: Request, a: FileUploadArgs) -> FileUploadReply:
        services.writes.started()
        try:
            return await _upload(ctx, a)
        finally:
            services.writes.finished()

    async def _upload(ctx: Request, a: FileUploadArgs) -> FileUploadReply:
        f: AtomicFile = await services.acquire_in_io(
            _os_call, AtomicFile.abort, open_atomic, fsys, a["path"], a["flag"], a["perm"], a["parents"]
        )
        # Receiving overlaps writing: while the I/O thread writes one batch, the loop takes in
        # the next, and a batch is every chunk that arrived meanwhile (one thread hop for all of
        # them). A batch's credit goes back as soon as it is written (not when the next input
        # comes: a batch may hold the whole window), so what guestd holds in memory stays
        # within the stream window as before.
        writing: asyncio.Future[None] | None = None
        received = 0
        try:
            eof = False
            while not eof:
                taking = asyncio.ensure_future(_take_input(ctx))
                try:
                    # A batch that fails (a full disk) gives no credit back, so the client may
                    # send nothing more: its error must end the upload now, not at the next input.
                    while writing is not None and not taking.done():
                        either: set[asyncio.Future[Any]] = {taking, writing}
                        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
                        if writing.done():
                            writing.result()
                            writing = None
                    batch, eof = await taking
                finally:
                    taking.cancel()  # only ever waiting on the queue's first get: nothing is lost
                for data in batch:
                    received += len(data)
                    if a["size"] is not None and received > a["size"]:
                        raise GuestdError(
                            ErrorCode.BAD_REQUEST,
                            f"more data than the declared size {a['size']}",
                            details={"field": "size"},
                        )
                if writing is not None:
                    await writing  # batches are written one at a time, in order
                    writing = None
                if batch:
                    writing = asyncio.ensure_future(io(_write_batch, f, batch))
                    writing.add_done_callback(partial(_ack_when_written, ctx, sum(len(d) for d in batch)))
            if writing is not None:
                await writing
                writing = None
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
        fd: int = await services.acquire_in_io(_os_call, os.close, fsys.open_file, a["path"])
        try:
            size = os.fstat(fd).st_size
            end = size if a["length"] is None else min(size, a["offset"] + a["length"])
            pos = a["offset"]
            await ctx.send_event({"ev": "start", "size": size})
            sent = 0
            while pos < end:
                want = min(chunk, end - pos)
                # From the page cache on the loop when it is there (no thread hop per chunk);
                # from the disk in an I/O thread otherwise, so a slow disk never stalls ping.
                data: bytes | bytearray | None = _read_cached(fd, want, pos)
                if data is None:
                    data = await io(os.pread, fd, want, pos)
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
    register_workspace(services, fsys, ids)  # trees, search, edit, watch (guestd/files/workspace.py)


_RWF_NOWAIT: int | None = getattr(os, "RWF_NOWAIT", None)


def _read_cached(fd: int, n: int, offset: int) -> bytearray | None:
    """Up to ``n`` bytes at ``offset`` if the page cache holds them, without ever waiting for
    the disk (preadv2 RWF_NOWAIT); None when that would wait, or the file system cannot say
    (then the caller reads in an I/O thread, which also raises any real error, typed)."""
    if _RWF_NOWAIT is None:
        return None
    buf = bytearray(n)
    try:
        got = os.preadv(fd, [buf], offset, _RWF_NOWAIT)
    except OSError:  # EAGAIN: not cached; EOPNOTSUPP: a file system without it; others: see above
        return None
    if got == 0:
        return None  # end of file (it shrank): the I/O thread's read says so
    del buf[got:]  # a short read: the rest was not cached (or the file ends there)
    return buf  # sent as it is: the transport takes any buffer without copying it


async def _take_input(ctx: Request) -> tuple[list[bytes], bool]:
    """The next upload input and every one already queued behind it: (their data, eof seen)."""
    queue = ctx.input
    batch: list[bytes] = []
    body = await queue.get()
    while True:
        data = body.get("data")
        if isinstance(data, bytes) and data:
            batch.append(data)
        if body.get("eof"):
            return batch, True
        if queue.empty():
            return batch, False
        body = queue.get_nowait()


def _write_batch(f: AtomicFile, batch: list[bytes]) -> None:
    for data in batch:
        f.write_streaming(data)


def _ack_when_written(ctx: Request, nbytes: int, written: asyncio.Future[None]) -> None:
    """Give back a written batch's credit. A failed batch gives none: the handler meets its
    error at its next await (or, cancelled meanwhile, nobody does; reading it here keeps
    asyncio from logging it as never retrieved)."""
    if not written.cancelled() and written.exception() is None:
        ctx.ack_input(nbytes)


def register_workspace(services: Services, fsys: FileSystem, ids: tuple[int, int] | None) -> None:
    from guestd.files import workspace  # it builds on this module

    workspace.register_workspace(services, fsys, ids)
