"""``spill: true``: a run's full stdout/stderr also go to files, so that the bytes dropped
from the reply can be read later (``file.read`` at the offsets the reply gives).

The files live in guestd's own spill directory (``<runtime_dir>/spill``: owned by guestd,
mode 0700, on a path of root-owned directories): the workload can neither read them nor
plant, swap or redirect anything there. Each file is created ``O_EXCL|O_NOFOLLOW`` under the
directory's fd with a name of 96 random bits. Bounds: ``limits.max_spill_bytes`` per stream;
the file system keeps ``SPILL_RESERVE`` free (min(64 MiB, 10% of its size)), checked before
every write; at most ``MAX_PENDING`` bytes wait for the disk (writes run in guestd's I/O
threads, never on the event loop); the directory holds at most ``limits.max_spill_total``
bytes (oldest files removed first when a spill starts) and files older than
``processes.retention_s`` are removed, except files still being written (a background
process's, which may be quiet for longer than that) and those a kept background process's
record names (they go with it: process.forget or its retention); those count towards the
total all the same. A spill that hits a bound stops
there: the file holds the stream's first ``bytes`` bytes and ``stopped`` says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from guestd.config import Config
    from guestd.wire.types import SpillInfoRecord, SpillInfoStopped

SPILL_RESERVE_MAX = 64 * 1024 * 1024
MAX_PENDING = 16 * 1024 * 1024
MAX_FILES_SWEPT = 10_000
WRITE_SLICE = 1024 * 1024  # bytes written per turn under _disk_lock
_disk_lock = threading.Lock()  # the free-space check and the write it allows: one spill at a time
_writing: set[str] = set()  # names of spill files still open for writing: never swept
_held: set[str] = set()  # names a background process's record gives: swept only with it (forget, retention)


class SpillHost(Protocol):
    """What spilling needs of the daemon (``guestd.services.Services`` is one)."""

    @property
    def config(self) -> Config: ...

    def runtime_dir(self) -> str: ...

    async def run_in_io(self, fn: Callable[..., Any], *args: Any) -> Any: ...

    async def acquire_in_io(self, fn: Callable[..., Any], release: Callable[[Any], None], *args: Any) -> Any: ...


def spill_dir(services: SpillHost) -> int:
    """The spill directory's fd (O_PATH-free: a real directory fd), made 0700 if missing;
    refused unless it is a directory owned by guestd's uid with no group/other access."""
    base = services.runtime_dir()
    d = os.path.join(base, "spill")
    with contextlib.suppress(FileExistsError):
        os.mkdir(d, 0o700)
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        os.close(fd)
        raise PermissionError(f"{d} is not guestd's private directory")
    return fd


def sweep(dirfd: int, retention_s: float, max_total: int) -> None:
    """Remove spill files past their retention, then the oldest until under ``max_total``.
    Files still being written or named by a kept background process count towards the total
    but stay: a record never names a file that is gone, nor ``bytes`` a file that shrank."""
    now = time.time()
    files: list[tuple[float, int, str]] = []
    kept = 0
    for i, name in enumerate(os.listdir(dirfd)):
        if i >= MAX_FILES_SWEPT:
            break
        with contextlib.suppress(OSError):
            st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
            if name in _writing or name in _held:
                kept += st.st_size
            elif now - st.st_mtime > retention_s:
                os.unlink(name, dir_fd=dirfd)
            else:
                files.append((st.st_mtime, st.st_size, name))
    total = kept + sum(size for _, size, _ in files)
    for _, size, name in sorted(files):
        if total < max_total:
            break
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=dirfd)
        total -= size


class Spill:
    """One stream's spill file; ``write`` from the event loop, the disk work in I/O threads."""

    def __init__(self, services: SpillHost, path: str, fd: int, cap: int) -> None:
        self.services = services
        self.path = path
        self._fd: int | None = fd
        self.cap = cap
        self.accepted = 0  # bytes taken for the file (written or pending)
        self.written = 0
        self.stopped: SpillInfoStopped | None = None
        self._pending: list[bytes] = []
        self._pending_bytes = 0  # accepted, not yet on disk: in _pending or being written
        self._flusher: asyncio.Task[None] | None = None
        self.given_away = False  # a detached command's: the process table writes and closes it now
        st = os.fstatvfs(fd)
        self._reserve = min(SPILL_RESERVE_MAX, st.f_blocks * st.f_frsize // 10)
        _writing.add(os.path.basename(path))

    def hold(self) -> None:
        """A background process's record names this file: the sweep leaves it (and counts it)
        until ``let_go`` (process.forget or retention, which remove it themselves)."""
        _held.add(os.path.basename(self.path))

    def let_go(self) -> None:
        _held.discard(os.path.basename(self.path))

    def info(self) -> SpillInfoRecord:
        """The spill_info record as it stands: the bytes on disk so far."""
        return {"path": self.path, "bytes": self.written, "stopped": self.stopped}

    def write(self, data: bytes) -> None:
        if self.stopped is not None or not data or self._fd is None:  # stopped, or closed
            return
        if self.accepted + len(data) > self.cap:
            data = data[: self.cap - self.accepted]
            self.stopped = "cap"
        if self._pending_bytes + len(data) > MAX_PENDING:
            self.stopped = "behind"  # the disk is slower than the command: stop, never buffer more
            return
        if data:
            self.accepted += len(data)
            self._pending.append(bytes(data))
            self._pending_bytes += len(data)
            if self._flusher is None or self._flusher.done():
                self._flusher = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        while self._pending and self._fd is not None:
            chunk = b"".join(self._pending)
            self._pending = []
            # ``_pending_bytes`` still counts the chunk: it waits for the disk until written.
            n, failed = await self.services.run_in_io(self._write_chunk, self._fd, chunk)
            self._pending_bytes -= len(chunk)
            if failed:
                self.stopped = "io_error"
            self.written += n
            if n < len(chunk):
                self.stopped = self.stopped or "disk_full"
                self._pending = []
                self._pending_bytes = 0
                return

    def _write_chunk(self, fd: int, chunk: bytes) -> tuple[int, bool]:
        """In an I/O thread: as much of ``chunk`` as keeps the reserve free; the bytes written
        and whether a write failed (those before the failure are on disk and counted).

        The room is counted in whole blocks (a write that ends inside a block takes all of it)
        with one block to spare (an extent or indirect block the file may need), and the check
        and the write go together under ``_disk_lock``: two spills (a run's stdout and stderr,
        or concurrent runs) never both take the same free space. At most ``WRITE_SLICE`` bytes
        are written per turn, so one spill does not hold the others up for long."""
        view = memoryview(chunk)
        done = 0
        try:
            while done < len(view):
                with _disk_lock:
                    st = os.fstatvfs(fd)
                    reserve_blocks = -(-self._reserve // st.f_frsize) + 1
                    room = max(0, (st.f_bavail - reserve_blocks) * st.f_frsize)
                    piece = view[done : done + min(room, WRITE_SLICE)]
                    if not piece:
                        break
                    while piece:
                        n = os.write(fd, piece)
                        done += n
                        piece = piece[n:]
        except OSError:
            return done, True
        return done, False

    async def close(self) -> SpillInfoRecord:
        """Everything accepted is on disk (or the reason it is not); the spill_info record.
        Cancelled while a write is in flight, the file still closes: once that write is done
        (its thread holds the fd number, so it is never closed under it)."""
        flusher = self._flusher
        if flusher is not None and not flusher.done():
            try:
                with contextlib.suppress(Exception):
                    await asyncio.shield(flusher)
            except asyncio.CancelledError:
                flusher.add_done_callback(lambda _: self._close_file())
                raise
        self._close_file()
        return self.info()

    def _close_file(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
        _writing.discard(os.path.basename(self.path))


async def open_spills(services: SpillHost, prefix: str) -> tuple[Spill, Spill]:
    """A stdout and a stderr spill for one run (``unavailable`` when the directory is not usable)."""
    from guestd.wire.errors import ErrorCode, GuestdError

    limits = services.config.limits

    def prepare() -> tuple[int, list[tuple[str, int]]]:
        dirfd = spill_dir(services)
        try:
            sweep(dirfd, services.config.process_retention_s, limits.max_spill_total)
            out = []
            tag = os.urandom(12).hex()
            for name in ("stdout", "stderr"):
                fname = f"{prefix}-{tag}.{name}"
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                out.append((fname, os.open(fname, flags, 0o600, dir_fd=dirfd)))
            return dirfd, out
        except BaseException:
            os.close(dirfd)
            raise

    def release(made: tuple[int, list[tuple[str, int]]]) -> None:
        """The run went away while ``prepare`` ran: its fds are nobody's."""
        for fd in (made[0], *(fd for _, fd in made[1])):
            os.close(fd)

    try:
        dirfd, files = await services.acquire_in_io(prepare, release)
    except OSError as e:
        raise GuestdError(ErrorCode.UNAVAILABLE, f"spill directory: {e}", details={"field": "spill"}) from None
    os.close(dirfd)
    d = os.path.join(services.runtime_dir(), "spill")
    out, err = (Spill(services, os.path.join(d, n), fd, limits.max_spill_bytes) for n, fd in files)
    return out, err


async def finish(reply: Any, spills: tuple[Spill, Spill] | None) -> Any:
    """``reply`` with ``stdout_spill`` / ``stderr_spill`` (every accepted byte on disk first).
    Files given away with a detached command go on growing: the reply has them as they stand."""
    if spills is not None:
        try:
            for key, spill in zip(("stdout_spill", "stderr_spill"), spills, strict=True):
                reply[key] = spill.info() if spill.given_away else await spill.close()
        except BaseException:
            abandon(spills)  # cancelled: the file not reached yet closes all the same
            raise
    return reply


def abandon(spills: tuple[Spill, Spill] | None) -> None:
    """The run failed or was cancelled: close the files once their pending writes are done
    (not those given away with a detached command)."""
    if spills is None:
        return
    for s in spills:
        if s.given_away:
            continue
        task = asyncio.ensure_future(s.close())
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
