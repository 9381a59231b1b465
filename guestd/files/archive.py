"""``tree.download``: a pax tar of a directory tree, made in pieces on a thread of its own.

Names that are not UTF-8 are kept as bytes (``hdrcharset=BINARY``); files are read through fds
checked to be regular (a FIFO is never opened), symlinks archived as links, never followed, and
FIFOs, sockets and devices left out (counted in ``skipped``).

The walk describes each entry through an ``O_PATH | O_NOFOLLOW`` fd (its ``fstat`` is the
entry's lstat), kept for a regular file, which is then reopened for reading through
``/proc/self/fd`` (a directory fd held open, so only the fd's number is looked up): a file's
name is looked up once, where an ``lstat`` by the walk and an ``O_PATH`` open by the archive
looked it up twice (with the full ``/proc/self/fd/N`` path, the lstat and the reopen were a
third of the archive's thread).
"""

from __future__ import annotations

import asyncio
import os
import queue
import stat as st
import threading
from collections.abc import Callable

from guestd.files import tarhead
from guestd.files.entries import os_call
from guestd.files.fs import FileSystem
from guestd.files.walk import Filter, Walk

# Reopening an O_PATH fd through /proc/self/fd: O_NOFOLLOW would refuse the magic link itself
# (the inode is resolved already); O_NONBLOCK so that no open waits.
_READ_REGULAR = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_PATH = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
_FD_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


class _Closed(Exception):
    """The download ended (closed) while its archive was being made."""


class Archive:
    """A pax tar of the tree below ``root_fd``, made in pieces of ``chunk`` bytes.

    A thread of its own makes the pieces one ahead of :meth:`step` (a queue of one), so the
    next piece is filled while the loop sends the last one and the client reads it: made on
    demand, the two waited for each other (the send's drain lasts until the client has read
    most of the piece). Headers are made by hand (``tarhead``) and file data is read straight
    into the piece (``tarhead.Pieces``), so a stream holds at most four pieces (one sent, one
    ready, one filling, and a spare one the transport may still be writing from, filled again
    once it is done) and nothing else."""

    def __init__(self, root_fd: int, flt: Filter, chunk: int) -> None:
        self.root_fd = root_fd
        self.walk = Walk(root_fd, flt, lstat=self._describe)
        # the O_PATH fd of the regular file the walk described last, its directory fd and name
        self.held: tuple[int, int, bytes] | None = None
        self.chunk = chunk
        self.entries = 0
        self.skipped = 0
        self.ready: queue.Queue[bytearray | BaseException | None] = queue.Queue(maxsize=1)
        self.closed = threading.Event()
        self.ended = False  # step() has handed out the end (or an error)
        self.wake: Callable[[], object] | None = None  # called from the thread when a piece is ready
        self.arrived: asyncio.Event | None = None  # next_piece's: set (on the loop) by wake
        self.thread = threading.Thread(target=self._produce, name="guestd-tree-download", daemon=True)
        self.thread.start()

    def step(self, block: bool = True) -> bytearray | None:
        """The next piece (blocks until it is made; ``block`` False: queue.Empty when none is
        ready yet), None at the end; the walk's error if any."""
        if self.ended or self.closed.is_set():
            return None
        item = self.ready.get(block)
        if item is None or isinstance(item, BaseException):
            self.ended = True
            if item is not None:
                raise item
        return item

    async def next_piece(self) -> bytearray | None:
        """:meth:`step` on the event loop: the archive's thread wakes the loop when a piece is
        ready, so no I/O thread is held waiting while the piece is made (each step held one for
        as long as a piece took, and a thread hop more per piece)."""
        if self.arrived is None:
            loop = asyncio.get_running_loop()
            arrived = self.arrived = asyncio.Event()
            self.wake = lambda: loop.call_soon_threadsafe(arrived.set)
        while True:
            try:
                return self.step(block=False)
            except queue.Empty:
                pass
            self.arrived.clear()  # set on the loop only, so a piece put before this is seen below
            try:
                return self.step(block=False)
            except queue.Empty:
                await self.arrived.wait()

    def close(self) -> None:
        """Stop the thread and wait for it (it has closed every fd when this returns). The walk
        is stopped first: a costly .gitignore or a huge tree lets go within milliseconds."""
        self.walk.stop()
        self.closed.set()
        while True:  # a thread waiting to hand over a piece gets the room and sees the stop
            try:
                self.ready.get_nowait()
            except queue.Empty:
                break
        try:
            self.ready.put_nowait(None)  # a step() waiting meanwhile ends
        except queue.Full:
            pass
        self._wake()
        self.thread.join()

    def _wake(self) -> None:
        wake = self.wake
        if wake is not None:
            try:
                wake()
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

    def _produce(self) -> None:
        try:
            try:
                os_call(self._make, tarhead.Pieces(self.chunk, self._hand))  # OS errors typed
            finally:
                os.close(self.root_fd)  # before the end is handed over: the reply finds no fd left
            self._hand(None)
        except _Closed:
            pass
        except BaseException as exc:
            try:
                self._hand(exc)
            except _Closed:
                pass

    def _hand(self, item: bytearray | BaseException | None) -> None:
        """Into the queue of one; raises _Closed once closed (checked while waiting for room)."""
        while not self.closed.is_set():
            try:
                self.ready.put(item, timeout=0.05)
            except queue.Full:
                continue
            self._wake()
            return
        raise _Closed

    def _describe(self, name: bytes, dirfd: int) -> os.stat_result:
        """The walk's lstat of an entry: ``fstat`` of an ``O_PATH | O_NOFOLLOW`` fd (a symlink's
        describes the link), the fd kept in ``held`` when the entry is a regular file."""
        self._let_go()
        pathfd = os.open(name, _PATH, dir_fd=dirfd)
        try:
            info = os.fstat(pathfd)
        except BaseException:
            os.close(pathfd)
            raise
        if st.S_ISREG(info.st_mode):
            self.held = (pathfd, dirfd, name)
        else:
            os.close(pathfd)
        return info

    def _let_go(self) -> None:
        if self.held is not None:
            os.close(self.held[0])
            self.held = None

    def _make(self, out: tarhead.Pieces) -> None:
        """The archive into ``out``: the walk's entries in its order, then the end blocks."""
        entries = self.walk.entries()
        fds = os.open("/proc/self/fd", _FD_DIR)
        try:
            for e in entries:
                info = e.info
                mode = info.st_mode
                if st.S_ISREG(mode):
                    fd = self._open_held(fds, e.dirfd, e.name)
                    if fd < 0:
                        self.skipped += 1
                        continue
                    try:  # info is the fstat of the inode opened: its size is what the header says
                        self.entries += 1
                        out.put(self._header(e.rel, info, tarhead.REGULAR, info.st_size))
                        out.file(fd, info.st_size)
                    finally:
                        os.close(fd)
                elif st.S_ISDIR(mode):
                    self.entries += 1
                    out.put(self._header(e.rel, info, tarhead.DIRECTORY))
                elif st.S_ISLNK(mode):
                    try:
                        target = os.readlink(e.name, dir_fd=e.dirfd)
                    except OSError:
                        self.skipped += 1
                        continue
                    self.entries += 1
                    out.put(self._header(e.rel, info, tarhead.SYMLINK, link=target))
                else:
                    self.skipped += 1  # FIFO, socket, device: never opened
            out.finish()
        finally:
            entries.close()  # the walk's directory fds
            self._let_go()
            os.close(fds)

    @staticmethod
    def _header(rel: bytes, info: os.stat_result, kind: bytes, size: int = 0, link: bytes = b"") -> bytes:
        return tarhead.header(
            rel, st.S_IMODE(info.st_mode), info.st_uid, info.st_gid, size, info.st_mtime_ns, kind, link
        )

    def _open_held(self, fds: int, dirfd: int, name: bytes) -> int:
        """A read fd of the regular file the walk described last (``name`` in ``dirfd``), or -1
        (skipped): its ``O_PATH`` fd, checked regular, reopened through ``fds`` (the
        ``/proc/self/fd`` directory), so a symlink is never followed and a FIFO or device
        never opened (as ``reopen_regular``)."""
        held, self.held = self.held, None
        if held is None or held[1:] != (dirfd, name):
            if held is not None:
                os.close(held[0])
            return -1  # not what the walk described last: never the case, the walk yields it at once
        pathfd = held[0]
        try:
            return os.open(str(pathfd), _READ_REGULAR, dir_fd=fds)
        except OSError:
            return -1
        finally:
            os.close(pathfd)


def open_archive(fsys: FileSystem, path: str, flt: Filter, chunk: int) -> Archive:
    fd = fsys.open_dir(path)
    return Archive(fd, flt, chunk)
