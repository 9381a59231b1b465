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
"""

from __future__ import annotations

import array
import ctypes
import errno
import fcntl
import logging
import os
import re
import select
import struct
import termios
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from guestd.files.resolver import RESOLVE_BENEATH, RESOLVE_NO_MAGICLINKS, RESOLVE_NO_SYMLINKS, openat2
from guestd.files.temps import TEMP_MARK, TREE_TEMP_MARK
from guestd.files.walk import DIR_FLAGS, MAX_DEPTH

log = logging.getLogger("guestd.watch")


IN_MODIFY = 0x2
IN_ATTRIB = 0x4
IN_CLOSE_WRITE = 0x8
IN_MOVED_FROM = 0x40
IN_MOVED_TO = 0x80
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x01000000
IN_ISDIR = 0x40000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
MASK = IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_ONLYDIR
MODIFIED = IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE

MAX_WATCHES = 65_536  # directories watched by all of guestd's watchers together; more: overflow
MAX_NAMES_BYTES = 16 << 20  # names remembered (all watchers) to tell a replacement from a creation
START_BUDGET = 2_000_000  # entries the first scan of a tree looks at; past it the watch is incomplete
SCAN_BUDGET = 100_000  # entries one scan of a directory that appeared looks at; past it: overflow for it
BATCH_SCAN_BUDGET = 100_000  # entries scanned between two reads of the kernel's queue (more waits)
MAX_SCANS = 4096  # directories waiting for their scan; more: overflow for them
MAX_SCAN_TRIES = 8  # a scan whose parent's path is stale (a move not read yet) is tried again
MAX_LIMBO = 16  # directories moved out of the tree whose watches are kept in case they come back
LIMBO_S = 2.0  # ... for at most this long
READ_SIZE = 64 << 10  # bytes of events read at once (at most 4,096 events: one batch)
BATCH_BYTES = 256 << 10  # changes handed to the sink at once
DUTY = 0.5  # of one CPU that busy watchers (all together) use at most
YIELD_S = 0.001  # work between two offers of the GIL
CHANGE_COST = 160  # bytes a change held as a tuple costs besides its path (a tuple, a bytes header)
NAME_COST = 80  # bytes a remembered name costs besides itself (set slot, bytes header)

_EVENT = struct.Struct("iIII")
_RESOLVE = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS
# file.write's temp names (guestd.files.atomic.AtomicFile): an O_TMPFILE inode, which the
# kernel names "#<inode number>" in its events though no such name ever exists, and the named
# temp file "." + name + TEMP_MARK + 12 hex digits (an overwrite's link, or where O_TMPFILE is missing);
# tree.upload's private staging directory "." + name + TREE_TEMP_MARK + 12 hex digits, never
# scanned or watched; its "tree" is moved to the target when whole (a move in: reported as the
# target created, its content listed).
_TMPFILE_NAME = re.compile(rb"#[0-9]+\Z")
_TEMP_NAME = re.compile(
    rb"\..*(?:" + re.escape(TEMP_MARK) + b"|" + re.escape(TREE_TEMP_MARK) + rb")[0-9a-f]{12}\Z", re.DOTALL
)
_libc = ctypes.CDLL(None, use_errno=True)

Change = tuple[str, bytes, bool]  # (created | modified | deleted | overflow, path, is_dir)
Sink = Callable[[list[Change]], object]


def change_cost(path: bytes) -> int:
    return CHANGE_COST + len(path)


class _Budget:
    """A count shared by every watcher of this guestd (watched directories, remembered bytes)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.used = 0

    def take(self, n: int, limit: int) -> bool:
        with self.lock:
            if self.used + n > limit:
                return False
            self.used += n
            return True

    def give(self, n: int) -> None:
        with self.lock:
            self.used -= n


WATCHES = _Budget()
NAMES = _Budget()
BUSY = threading.Lock()  # one watcher works at a time


@dataclass(eq=False, slots=True)
class Node:
    """A watched directory: ``parent`` None for the root of the tree."""

    wd: int
    parent: Node | None
    name: bytes
    children: dict[bytes, Node] | None = None  # watched subdirectories by name
    names: set[bytes] | None = None  # every name in it; None: not known (a bound)
    names_cost: int = 0
    path: bytes = b""  # cached; valid while path_gen is the watcher's gen
    path_gen: int = -1


def _subtree(node: Node) -> list[Node]:
    """``node`` and every node below it."""
    out = [node]
    i = 0
    while i < len(out):
        children = out[i].children
        if children:
            out.extend(children.values())
        i += 1
    return out


def _ours(name: bytes, mask: int, names: set[bytes] | None) -> bool:
    """An event about one of guestd's own temporary names (never a change of the tree)."""
    if _TEMP_NAME.match(name):
        return True
    # An O_TMPFILE inode's events name "#<inode>": a name the directory does not hold.
    return bool(mask & MODIFIED) and (names is None or name not in names) and _TMPFILE_NAME.match(name) is not None


class Watcher:
    """One inotify instance following a tree on a thread of its own, handing ``Change`` batches
    to ``sink`` (on that thread); ``on_end`` is told if the thread dies of an error."""

    def __init__(self, root_fd: int, sink: Sink, on_end: Callable[[BaseException], object] | None = None) -> None:
        self.root_fd = root_fd  # owned
        self.sink = sink
        self.on_end = on_end  # called (on the thread) when the thread dies of an error
        self.ifd = _libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if self.ifd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), "inotify_init1")
        self.nodes: dict[int, Node] = {}  # wd -> node
        self.gen = 0  # bumped when a directory moves: cached paths are recomputed
        self.names_bytes = 0  # this watcher's part of NAMES
        # Directories waiting for their scan: (parent wd, name) -> (parent, name, seq, tries).
        self.scans: dict[tuple[int, bytes], tuple[Node, bytes, int, int]] = {}
        self.scan_seq = 0
        # (cookie, node) of a directory moved away, until the other half of the move.
        self.moved_from: tuple[int, Node] | None = None
        # (wd, name, the directory node it attached or None) of the last event when it moved
        # something in: renameat2(RENAME_EXCHANGE)'s second half, a move out of that name, follows.
        self.last_moved_to: tuple[int, bytes, Node | None] | None = None
        # The watched directory a directory moved in over, kept (watches and all) for one event: an
        # exchange moves it out of that name again; anything else drops it (an empty directory the
        # move replaced).
        self.displaced: Node | None = None
        self.batch: list[Change] = []
        self.batch_bytes = 0
        self.consumed = 0  # bytes of events read from the kernel
        # Syncs being served: (bytes to read, scans to end, done).
        self.waiting: list[tuple[int, int, threading.Event]] = []
        # Directories moved out of the tree, still watched a while: root wd -> (node, since,
        # changed meanwhile); and every wd of theirs -> its root's wd.
        self.limbo: dict[int, tuple[Node, float, bool]] = {}
        self.limbo_of: dict[int, int] = {}
        self.known = False  # set by _watch: that directory was followed already (or back from limbo)
        self.ticks = 0
        self.yielded = 0.0  # when _tick last let the GIL go
        self.incomplete = False  # some directory of the tree is not watched (a bound was reached)
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

    def _tick(self) -> None:
        """Every ``YIELD_S`` of work, let the event loop take the GIL if it waits for it (a ping
        answers within about a millisecond, not at CPython's next 5 ms switch interval)."""
        self.ticks += 1
        if self.ticks % 64 == 0:
            now = time.monotonic()
            if now - self.yielded >= YIELD_S:
                time.sleep(0)
                self.yielded = time.monotonic()

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
        if not name or _ours(name, mask, parent.names):
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

    def _holds(self, parent: Node, name: bytes) -> bool:
        """Whether ``name`` exists in the watched directory ``parent`` now."""
        try:
            pfd = openat2(self.root_fd, self._path(parent) or b".", DIR_FLAGS, 0, _RESOLVE)
        except OSError:
            return False
        try:
            os.stat(name, dir_fd=pfd, follow_symlinks=False)
            return True
        except OSError:
            return False
        finally:
            os.close(pfd)

    def _moved_out(self) -> None:
        """The directory moved away has left the tree. Its watches are kept a while (limbo):
        if it comes back unchanged (a workload moving a huge directory out and in again) it
        is put back as it was, not walked again; any event in it meanwhile marks it changed."""
        assert self.moved_from is not None
        node = self.moved_from[1]
        self.moved_from = None
        if self.nodes.get(node.wd) is not node:
            return
        parent = node.parent
        if parent is not None and parent.children and parent.children.get(node.name) is node:
            del parent.children[node.name]
        node.parent = None
        for n in _subtree(node):
            del self.nodes[n.wd]
            self.limbo_of[n.wd] = node.wd
        self.limbo[node.wd] = (node, time.monotonic(), False)
        while len(self.limbo) > MAX_LIMBO:
            self._evict(next(iter(self.limbo)))

    def _evict(self, root_wd: int) -> None:
        """Stop watching a directory in limbo for good."""
        node, _since, _changed = self.limbo.pop(root_wd)
        for n in _subtree(node):
            if self.limbo_of.pop(n.wd, None) is not None:
                WATCHES.give(1)
                _libc.inotify_rm_watch(self.ifd, n.wd)
            self._set_names(n, None)
        node.children = None

    def _evict_old(self) -> None:
        now = time.monotonic()
        for root_wd, (_node, since, _changed) in list(self.limbo.items()):
            if now - since > LIMBO_S:
                self._evict(root_wd)

    def _in_limbo(self, wd: int, mask: int) -> None:
        """An event in a directory in limbo: it changed while out of the tree."""
        root_wd = self.limbo_of.get(wd)
        if root_wd is None:
            return
        node, since, _changed = self.limbo[root_wd]
        self.limbo[root_wd] = (node, since, True)
        if mask & IN_IGNORED:  # that directory is gone: its watch with it
            self.limbo_of.pop(wd, None)
            WATCHES.give(1)

    # -- the tree -------------------------------------------------------------------------
    def _join(self, parent: Node, name: bytes) -> bytes:
        base = self._path(parent)
        return base + b"/" + name if base else name

    def _path(self, node: Node) -> bytes:
        if node.path_gen == self.gen:
            return node.path
        parts: list[bytes] = []
        n: Node | None = node
        while n is not None and n.parent is not None:
            parts.append(n.name)
            n = n.parent
        node.path = b"/".join(reversed(parts))
        node.path_gen = self.gen
        return node.path

    @staticmethod
    def _inside(node: Node, top: Node) -> bool:
        """``node`` is ``top`` or below it (moving ``top`` there would make a cycle)."""
        n: Node | None = node
        while n is not None:
            if n is top:
                return True
            n = n.parent
        return False

    def _attach(self, node: Node, parent: Node, name: bytes) -> None:
        """``node`` is now ``parent``'s child ``name`` (a directory moved within the tree)."""
        old_parent = node.parent
        if old_parent is not None and old_parent.children and old_parent.children.get(node.name) is node:
            del old_parent.children[node.name]
        node.parent, node.name = parent, name
        if parent.children is None:
            parent.children = {}
        replaced = parent.children.get(name)
        if replaced is not None and replaced is not node:
            self._drop(replaced)  # an empty directory the move replaced
        parent.children[name] = node
        self.gen += 1

    def _drop(self, node: Node, remove_watches: bool = True) -> None:
        """Stop following ``node`` and everything below it (gone, or moved out of the tree)."""
        parent = node.parent
        if parent is not None and parent.children and parent.children.get(node.name) is node:
            del parent.children[node.name]
        stack = [node]
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
                n.children = None
            if self.nodes.get(n.wd) is n:
                del self.nodes[n.wd]
                WATCHES.give(1)
                if remove_watches:
                    _libc.inotify_rm_watch(self.ifd, n.wd)
            self._set_names(n, None)

    def _remember(self, parent: Node, name: bytes) -> bool:
        """Add ``name`` to what ``parent`` holds; whether it was there already."""
        names = parent.names
        if names is None:
            return False
        if name in names:
            return True
        cost = len(name) + NAME_COST
        if NAMES.take(cost, MAX_NAMES_BYTES):
            names.add(name)
            parent.names_cost += cost
            self.names_bytes += cost
        else:
            self._set_names(parent, None)  # no room: this directory's names are not known
        return False

    def _forget(self, parent: Node, name: bytes) -> None:
        if parent.names is not None and name in parent.names:
            parent.names.discard(name)
            cost = len(name) + NAME_COST
            parent.names_cost -= cost
            self.names_bytes -= cost
            NAMES.give(cost)

    def _set_names(self, node: Node, names: set[bytes] | None, cost: int = 0) -> None:
        """Replace ``node``'s names (``cost`` already taken from NAMES)."""
        if node.names_cost:
            NAMES.give(node.names_cost)
            self.names_bytes -= node.names_cost
        node.names, node.names_cost = names, cost
        self.names_bytes += cost

    def _watch(self, fd: int, parent: Node | None, name: bytes) -> Node | None:
        """The node of the directory open at ``fd`` (``parent``'s child ``name``); None when
        it cannot be watched (a bound: said as overflow)."""
        wd = _libc.inotify_add_watch(self.ifd, f"/proc/self/fd/{fd}".encode(), MASK)
        if wd < 0:
            err = ctypes.get_errno()
            if err == errno.ENOSPC:  # fs.inotify.max_user_watches
                self._lost(self._join(parent, name) if parent else b"")
                return None
            if err in (errno.ENOENT, errno.ENOTDIR):
                return None  # removed meanwhile
            raise OSError(err, os.strerror(err), "inotify_add_watch")
        root_wd = self.limbo_of.get(wd)
        if root_wd is not None:
            limbo_root, _since, changed = self.limbo[root_wd]
            if root_wd == wd and not changed and parent is not None and not self._inside(parent, limbo_root):
                # Back unchanged: put back with everything below, nothing walked again.
                del self.limbo[root_wd]
                for n in _subtree(limbo_root):
                    del self.limbo_of[n.wd]
                    self.nodes[n.wd] = n
                self._attach(limbo_root, parent, name)
                self.known = True
                return limbo_root
            self._evict(root_wd)  # changed meanwhile (or only a part came back): walked anew
            wd = _libc.inotify_add_watch(self.ifd, f"/proc/self/fd/{fd}".encode(), MASK)
            if wd < 0:
                return None
        node = self.nodes.get(wd)
        if node is not None:  # watched already (the same inode): where it is now
            if parent is not None and (node.parent is not parent or node.name != name):
                if self._inside(parent, node):
                    return None  # our view of the tree is behind: the moves' events will say
                self._attach(node, parent, name)
            self.known = True
            return node
        if not WATCHES.take(1, MAX_WATCHES):
            _libc.inotify_rm_watch(self.ifd, wd)
            self._lost(self._join(parent, name) if parent else b"")
            return None
        node = Node(wd, parent, name)
        self.nodes[wd] = node
        if parent is not None:
            if parent.children is None:
                parent.children = {}
            replaced = parent.children.get(name)
            if replaced is not None:
                self._drop(replaced)
            parent.children[name] = node
        return node

    def _queue_scan(self, parent: Node, name: bytes) -> None:
        key = (parent.wd, name)
        if key in self.scans:
            return  # once is enough: the scan sees the directory as it is then
        if len(self.scans) >= MAX_SCANS:
            self._lost(self._join(parent, name))
            return
        self.scan_seq += 1
        self.scans[key] = (parent, name, self.scan_seq, 0)

    def _lost(self, path: bytes) -> None:
        """Part of the tree below ``path`` is not watched (a bound): overflow, for good."""
        self.incomplete = True
        self._emit("overflow", path, True)

    def _scan(self, parent: Node | None, name: bytes, *, report: bool, budget: int) -> int:
        """Watch the directory ``name`` of ``parent`` (the root: None) and every directory below
        it, depth first, at most ``budget`` entries looked at; with ``report`` what is found is
        reported as created (it appeared before its directory was watched). Returns the entries
        looked at, -1 when ``parent``'s path names another directory now (a move not yet read)."""
        try:
            if parent is None:
                top = openat2(self.root_fd, b".", DIR_FLAGS, 0, _RESOLVE)
            else:
                pfd = openat2(self.root_fd, self._path(parent) or b".", DIR_FLAGS, 0, _RESOLVE)
                try:
                    wd = _libc.inotify_add_watch(self.ifd, f"/proc/self/fd/{pfd}".encode(), MASK)
                    if wd != parent.wd:
                        return -1
                    top = os.open(name, DIR_FLAGS, dir_fd=pfd)
                finally:
                    os.close(pfd)
        except OSError as exc:
            self._not_entered(exc, self._join(parent, name) if parent is not None else b"")
            return 0
        looked = 0
        base = self._join(parent, name) if parent is not None else b""
        # (fd, node, its path, subdirectory names still to enter): one fd per level
        stack: list[tuple[int, Node, bytes, list[bytes]]] = []
        fd, at_parent, at_name, at_path = top, parent, name, base
        try:
            while True:
                if fd >= 0:
                    self.known = False
                    node = self._watch(fd, at_parent, at_name)
                    if node is not None and self.known:
                        # Followed already (a queued scan that a move overtook, or back from
                        # limbo as it was): its changes were and are reported, nothing to list.
                        os.close(fd)
                    elif node is not None:
                        subdirs, looked = self._list(fd, node, at_path, report, looked, budget)
                        if looked > budget:
                            os.close(fd)
                            self._lost(at_path)  # past the budget: what is below is not followed
                            return looked
                        if len(stack) >= MAX_DEPTH and subdirs:
                            self._lost(at_path)
                            subdirs = []
                        stack.append((fd, node, at_path, subdirs))
                    else:
                        os.close(fd)
                    fd = -1
                if not stack:
                    return looked
                dfd, dnode, dpath, todo = stack[-1]
                if not todo:
                    stack.pop()
                    os.close(dfd)
                    continue
                at_name = todo.pop()
                at_parent, at_path = dnode, dpath + b"/" + at_name if dpath else at_name
                try:
                    fd = os.open(at_name, DIR_FLAGS, dir_fd=dfd)
                except OSError as exc:
                    self._not_entered(exc, at_path)
                    fd = -1
        finally:
            for dfd, _, _, _ in stack:
                os.close(dfd)

    def _not_entered(self, exc: OSError, path: bytes) -> None:
        """A directory that could not be opened: gone, or a symlink or a file now (its own
        events say so), or not readable by guestd or past its fds: then it is not followed,
        and that is said."""
        if exc.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            self._lost(path)

    def _list(
        self, fd: int, node: Node, path: bytes, report: bool, looked: int, budget: int
    ) -> tuple[list[bytes], int]:
        """Read ``node``'s names (open at ``fd``): its subdirectories, the entries looked at."""
        subdirs: list[bytes] = []
        names: set[bytes] | None = set()
        cost = 0
        try:
            with os.scandir(fd) as it:
                for e in it:
                    looked += 1
                    self._tick()
                    if looked > budget:
                        names = None  # cut short: not known
                        break
                    name = os.fsencode(e.name)
                    try:
                        is_dir = e.is_dir(follow_symlinks=False)
                    except OSError:
                        continue
                    if _TEMP_NAME.match(name):
                        continue
                    if names is not None:
                        names.add(name)
                        cost += len(name) + NAME_COST
                    if is_dir:
                        subdirs.append(name)
                    if report:
                        self._emit("created", path + b"/" + name if path else name, is_dir)
        except OSError:
            names = None
            self._lost(path)  # could not be read to its end: what it holds may not be followed
        if names is not None and not NAMES.take(cost, MAX_NAMES_BYTES):
            names, cost = None, 0
        self._set_names(node, names, cost if names is not None else 0)
        return subdirs, looked

    # -- handing on -------------------------------------------------------------------------
    def _emit(self, kind: str, path: bytes, is_dir: bool) -> None:
        self.batch.append((kind, path, is_dir))
        self.batch_bytes += change_cost(path)
        if self.batch_bytes >= BATCH_BYTES:
            self._flush()

    def _flush(self) -> None:
        if self.batch:
            batch, self.batch, self.batch_bytes = self.batch, [], 0
            self.sink(batch)

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
