"""The change feed, bounded against the workload: ``file.watch`` streams, ``file.changes`` and
exec's ``report_changes`` from one inotify watcher of a tree.

A :class:`Watcher` runs on a thread of its own. It watches every directory of the tree as a
:class:`Node` (its watch descriptor, parent and name: never a stored path, so a directory moved
within the tree is one re-parenting however much lies below it; inotify watches follow the inode).
Directories that appear (made, or moved in from outside) are scanned lazily: queued, deduplicated
and scanned between two reads of the kernel's queue, each scan with a budget of entries, so a
workload renaming a huge directory back and forth costs one scan per batch, not one per rename.
Each directory is opened from the root with ``openat2`` ``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS``
(a directory swapped for a symlink is never watched in its place), its children ``O_NOFOLLOW``
from its fd.

Changes are handed on as they come, in batches of at most ``BATCH_BYTES``, never held until the
kernel's queue is empty. Every bound is said, never silent: the kernel's ``IN_Q_OVERFLOW``, a scan
past its budget or depth, more than ``MAX_WATCHES`` directories (all watchers of guestd together)
or the kernel's ``max_user_watches``, a consumer's backlog past its bound in bytes (the
``Handoff`` and ``Journal`` of :mod:`guestd.files.journal`), and a watcher thread that died are
``overflow`` (or, for a ``file.watch``, a typed error ending it): the caller rescans. Names in
each watched directory are kept (``MAX_NAMES_BYTES`` for all watchers) so that a rename over an
existing name (``git``'s ``HEAD.lock`` -> ``HEAD``) is a modification, not a creation. guestd's
own temporary names (``file.write``'s ``O_TMPFILE`` inode, named ``#<inode>`` by the kernel, and
its named temp files) are never reported.

The tree and its bounds are :mod:`guestd.files.watchtree`, the scans :mod:`guestd.files.watchscan`;
here the thread that reads the kernel's events and what each event does to the tree.
"""

from __future__ import annotations

import array
import ctypes
import fcntl
import logging
import os
import select
import struct
import termios
import threading
import time
from collections import deque
from collections.abc import Callable

from guestd.files.watchscan import Scanner
from guestd.files.watchtree import (
    IN_CLOEXEC,
    IN_CREATE,
    IN_DELETE,
    IN_IGNORED,
    IN_ISDIR,
    IN_MOVED_FROM,
    IN_MOVED_TO,
    IN_NONBLOCK,
    IN_Q_OVERFLOW,
    LIMBO_S,
    MODIFIED,
    NAMES,
    WATCHES,
    Change,
    Node,
    Sink,
    change_cost,
    libc,
    ours,
)

__all__ = ["Change", "Sink", "Watcher", "change_cost"]

log = logging.getLogger("guestd.watch")

START_BUDGET = 2_000_000  # entries the first scan of a tree looks at; past it the watch is incomplete
SCAN_BUDGET = 100_000  # entries one scan of a directory that appeared looks at; past it: overflow for it
BATCH_SCAN_BUDGET = 100_000  # entries scanned between two reads of the kernel's queue (more waits)
MAX_SCAN_TRIES = 8  # a scan whose parent's path is stale (a move not read yet) is tried again
READ_SIZE = 64 << 10  # bytes of events read at once (at most 4,096 events: one batch)
DUTY = 0.5  # of one CPU that busy watchers (all together) use at most

_EVENT = struct.Struct("iIII")
BUSY = threading.Lock()  # one watcher works at a time


class Watcher(Scanner):
    """One inotify instance following a tree on a thread of its own, handing ``Change`` batches
    to ``sink`` (on that thread); ``on_end`` is told if the thread dies of an error."""

    def __init__(self, root_fd: int, sink: Sink, on_end: Callable[[BaseException], object] | None = None) -> None:
        ifd = libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if ifd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), "inotify_init1")
        super().__init__(root_fd, ifd, sink)
        self.on_end = on_end  # called (on the thread) when the thread dies of an error
        # (cookie, node) of a directory moved away, until the other half of the move.
        self.moved_from: tuple[int, Node] | None = None
        # (wd, name, the directory node it attached or None) of the last event when it moved
        # something in: renameat2(RENAME_EXCHANGE)'s second half, a move out of that name, follows.
        self.last_moved_to: tuple[int, bytes, Node | None] | None = None
        # The watched directory a directory moved in over, kept (watches and all) for one event: an
        # exchange moves it out of that name again; anything else drops it (an empty directory the
        # move replaced).
        self.displaced: Node | None = None
        self.consumed = 0  # bytes of events read from the kernel
        # Syncs being served: (bytes to read, scans to end, done).
        self.waiting: list[tuple[int, int, threading.Event]] = []
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        # The fds have one owner: the thread once started (it closes them however it ends),
        # else stop(). Waking and closing take this lock, so a wake never writes to a number
        # the thread has just closed (by then it may name another connection's socket).
        self._fd_lock = threading.Lock()
        self.syncs: deque[threading.Event] = deque()
        self.stopping = False
        self.thread: threading.Thread | None = None
        self.ready = threading.Event()
        self.error: BaseException | None = None

    @property
    def alive(self) -> bool:
        """Started, and its thread still reads the kernel's events."""
        return self.thread is not None and self.thread.is_alive() and self.error is None and not self.stopping

    # -- the thread ---------------------------------------------------------------------
    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="guestd-watch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        died: BaseException | None = None
        try:
            try:
                self._scan(None, b"", report=False, budget=START_BUDGET)
                self._flush()
            except BaseException as exc:  # reported to whoever waits for ready
                self.error = exc
                return  # the fds are closed below, by this thread: their owner
            finally:
                self.ready.set()
            self._loop()
        except BaseException as exc:
            if not self.stopping:
                # Never silent: the feed's users are told (file.watch ends with an error, the
                # journal reports overflow), and the log says why.
                self.error = died = exc
                log.error("the watcher of a tree ended: %r", exc, exc_info=exc)
        finally:
            self._close()
            if died is not None and self.on_end is not None:
                try:
                    self.on_end(died)
                except BaseException as exc:  # the loop is gone: nobody to tell
                    log.debug("a watcher's end was not delivered: %r", exc)

    def _loop(self) -> None:
        # poll, not select: guestd raises its fd limit, and select() fails for fds >= 1024.
        poller = select.poll()
        poller.register(self.ifd, select.POLLIN)
        poller.register(self.wake_r, select.POLLIN)
        while not self.stopping:
            with BUSY:
                started = time.thread_time()
                busy = self._step()
                if busy:
                    # A storm of events: all watchers together use at most DUTY of one CPU
                    # (the lock is held while this one rests), the rest waits in the kernel's
                    # bounded queue (its overflow is said). The event loop has the GIL meanwhile.
                    time.sleep((time.thread_time() - started) * (1 - DUTY) / DUTY)
            if not busy:
                # Nothing read and nothing to scan: until events or a wake (or limbo's end).
                poller.poll(LIMBO_S * 1000 if self.limbo else None)
                try:
                    os.read(self.wake_r, 4096)
                except BlockingIOError:
                    pass

    def _step(self) -> bool:
        """Read one batch of events, handle them, run the scans they queued (within a budget)
        and hand the changes on; True when there may be more to do at once."""
        while self.syncs:
            # What the kernel holds now is read before anything queued later: this sync is
            # done once that many more bytes are read (and the scans they queue are done).
            self.waiting.append((self.consumed + self._queued(), -1, self.syncs.popleft()))
        try:
            data = os.read(self.ifd, READ_SIZE)
        except BlockingIOError:
            data = b""
        self.consumed += len(data)
        pos = 0
        while pos + _EVENT.size <= len(data):
            wd, mask, cookie, length = _EVENT.unpack_from(data, pos)
            name = data[pos + _EVENT.size : pos + _EVENT.size + length].rstrip(b"\0")
            pos += _EVENT.size + length
            self._event(wd, mask, cookie, name)
            self._tick()
        if not data and self.moved_from is not None:
            self._moved_out()  # the queue is empty: its other half is not coming
        if self.limbo:
            self._evict_old()
        spent = 0
        while self.scans and spent < BATCH_SCAN_BUDGET:
            key = next(iter(self.scans))
            parent, name, _seq, tries = self.scans.pop(key)
            if self.nodes.get(parent.wd) is not parent:
                continue  # its directory is gone or moved away: so is this one
            looked = self._scan(parent, name, report=True, budget=SCAN_BUDGET)
            if looked < 0:  # the parent's path names another directory: a move not read yet?
                if tries + 1 < MAX_SCAN_TRIES and self._queued() > 0:
                    self.scan_seq += 1
                    self.scans[key] = (parent, name, self.scan_seq, tries + 1)
                    break  # read the events that explain it first, then try again
                self._lost(self._join(parent, name))  # none to read: this view of the tree is lost
                continue
            spent += max(looked, 1)
        self._flush()
        self._release_syncs(bool(data))
        return bool(data) or bool(self.scans)

    def _queued(self) -> int:
        buf = array.array("i", [0])
        try:
            fcntl.ioctl(self.ifd, termios.FIONREAD, buf)
        except OSError:
            return 0
        return buf[0]

    def _release_syncs(self, read_some: bool) -> None:
        if not self.waiting:
            return
        first_scan = min((seq for _, _, seq, _ in self.scans.values()), default=self.scan_seq + 1)
        still: list[tuple[int, int, threading.Event]] = []
        for want_bytes, want_scan, done in self.waiting:
            if want_scan < 0 and (self.consumed >= want_bytes or not read_some):
                want_scan = self.scan_seq  # the events are read: now the scans they queued
            if want_scan >= 0 and first_scan > want_scan:
                done.set()
            else:
                still.append((want_bytes, want_scan, done))
        self.waiting = still

    # -- events -------------------------------------------------------------------------
    def _event(self, wd: int, mask: int, cookie: int, name: bytes) -> None:
        moved_to_just_before, self.last_moved_to = self.last_moved_to, None
        displaced, self.displaced = self.displaced, None
        exchange_half = (
            bool(mask & IN_MOVED_FROM) and moved_to_just_before is not None and moved_to_just_before[:2] == (wd, name)
        )
        if displaced is not None and not exchange_half:
            if self.nodes.get(displaced.wd) is displaced:
                self._drop(displaced)  # the empty directory the move replaced
            displaced = None
        if mask & IN_Q_OVERFLOW:
            self._emit("overflow", b"", False)
            for root_wd, (node, since, _changed) in self.limbo.items():
                self.limbo[root_wd] = (node, since, True)  # its events may be among those lost
            return
        if self.moved_from is not None and not (mask & IN_MOVED_TO and cookie == self.moved_from[0]):
            self._moved_out()  # the other half of a move is the very next event, or none is coming
        if mask & IN_IGNORED:
            gone = self.nodes.get(wd)
            if gone is not None:
                self._drop(gone, remove_watches=False)  # removed (and its watch with it)
            else:
                self._in_limbo(wd, mask)
            return
        parent = self.nodes.get(wd)
        if parent is None:
            self._in_limbo(wd, mask)
            return
        if not name or ours(name, mask, parent.names):
            return
        path = self._join(parent, name)
        is_dir = bool(mask & IN_ISDIR)
        child = parent.children.get(name) if parent.children else None
        if mask & IN_MOVED_TO and is_dir and self.moved_from is not None:
            moved = self.moved_from[1]
            self.moved_from = None
            if self.nodes.get(moved.wd) is moved and not self._inside(parent, moved):
                self._remember(parent, name)
                replaced = parent.children.get(name) if parent.children else None
                if replaced is not None and replaced is not moved and parent.children is not None:
                    del parent.children[name]  # not dropped yet: an exchange moves it out next
                    self.displaced = replaced
                    # The name held a directory: it went first (with a later move out of the name
                    # in the same window the name nets to deleted, not to nothing).
                    self._emit("deleted", path, True)
                self._attach(moved, parent, name)
                self.last_moved_to = (wd, name, moved)
                # Its watches moved with it: one change at each end, whatever it holds (a
                # rename storm of a huge directory costs nothing per entry).
                self._emit("created", path, True)
                return
            if self.nodes.get(moved.wd) is moved:
                self._drop(moved)
        if mask & (IN_CREATE | IN_MOVED_TO):
            if mask & IN_MOVED_TO:
                self.last_moved_to = (wd, name, None)
            existed = self._remember(parent, name)
            self._emit("modified" if existed and not is_dir else "created", path, is_dir)
            if is_dir:
                self._queue_scan(parent, name)
        elif mask & (IN_DELETE | IN_MOVED_FROM):
            if exchange_half and self._holds(parent, name):
                # renameat2(RENAME_EXCHANGE) (file.apply_patch's commit; any workload may call it)
                # moves one entry onto the name and the name's old entry away in one step: a move
                # in then a move out of the same name. The name still exists: its change was said
                # on the way in. A directory leaving is the one that was there before (not the
                # one just moved in): its watches follow it to the other name (the next event).
                # The directory that just moved in leaving again is no exchange but a rename back
                # and forth (a storm, whose name may exist again by the time this is read): it is
                # a plain move out, below, never a rescan of what moves in next.
                # A directory not followed yet (its scan still queued, as after a tree.upload
                # read in the same batch as its replace) leaves nothing to follow either.
                assert moved_to_just_before is not None
                leaving = displaced if displaced is not None else child
                if not is_dir or leaving is None:
                    return
                if leaving is not moved_to_just_before[2]:
                    self.moved_from = (cookie, leaving)
                    return
            if displaced is not None and self.nodes.get(displaced.wd) is displaced:
                self._drop(displaced)  # the name is gone already (read late): not followed, as before
            self._forget(parent, name)
            self._emit("deleted", path, is_dir)
            if child is not None:
                if mask & IN_MOVED_FROM:
                    self.moved_from = (cookie, child)  # in again under another name, or out of the tree
                else:
                    self._drop(child, remove_watches=False)
        elif mask & MODIFIED and not is_dir:
            self._emit("modified", path, False)

    def _moved_out(self) -> None:
        """The directory moved away has left the tree (its other half is not coming): into limbo."""
        assert self.moved_from is not None
        node = self.moved_from[1]
        self.moved_from = None
        self._to_limbo(node)

    # -- syncs and the end ----------------------------------------------------------------
    def sync(self, timeout: float = 10.0) -> bool:
        """Until every event queued in the kernel now has reached the sink, with the scans
        it asked for (blocking); False when the watcher has ended or the timeout passed."""
        done = threading.Event()
        self.syncs.append(done)
        if not self._wake():
            return False
        return done.wait(timeout) and self.alive

    def _wake(self) -> bool:
        """Wake the thread; False when its fds are closed (it has ended)."""
        with self._fd_lock:
            if self.wake_w < 0:
                return False
            try:
                os.write(self.wake_w, b"x")
            except BlockingIOError:
                pass  # the pipe is full: the thread has wakes enough to read
            return True

    def stop(self) -> None:
        self.stopping = True
        self._wake()
        if self.thread is None:  # never started: nobody else closes them
            self._close()

    def _close(self) -> None:
        with self._fd_lock:
            for fd in (self.ifd, self.wake_r, self.wake_w, self.root_fd):
                if fd >= 0:
                    try:
                        os.close(fd)
                    except OSError:
                        pass  # closed all the same (EINTR, EIO): the number is free
            self.ifd = self.wake_r = self.wake_w = self.root_fd = -1
        # What this watcher held of the shared bounds goes back.
        WATCHES.give(len(self.nodes) + len(self.limbo_of))
        self.nodes, self.limbo, self.limbo_of = {}, {}, {}
        NAMES.give(self.names_bytes)
        self.names_bytes = 0
        while self.syncs:
            self.syncs.popleft().set()
        for _, _, done in self.waiting:
            done.set()
        self.waiting = []
