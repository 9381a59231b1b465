"""The change feed (issue 18): ``file.watch`` streams, ``file.changes`` and exec's
``report_changes`` from one inotify watcher of a tree.

A :class:`Watcher` runs on a thread of its own: it watches every directory of the tree (each
added through ``/proc/self/fd/N`` of a directory fd opened from the root with ``openat2``
``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS``, so a directory swapped for a symlink is never
watched in its place), follows new directories (scanned when they appear: what was made in them
before the watch is reported as created), drops the watches of directories moved away, and
hands batches of ``(kind, path, is_dir)`` to a sink; the kernel's queue overflow
(``IN_Q_OVERFLOW``), more than ``MAX_WATCHES`` directories, or a sink that cannot keep up are
reported as ``overflow``, never dropped in silence. Names in each watched directory are kept
(at most ``MAX_NAMES`` in all) so that a rename over an existing name (``git``'s
``HEAD.lock`` -> ``HEAD``) is a modification, not a creation.
"""

from __future__ import annotations

import ctypes
import errno
import os
import select
import struct
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from guestd.files.fs import RESOLVE_BENEATH, RESOLVE_NO_MAGICLINKS, RESOLVE_NO_SYMLINKS, openat2
from guestd.files.walk import DIR_FLAGS, Filter, Walk

if TYPE_CHECKING:
    from guestd.wire.types import ChangeReportRecord

IN_ACCESS = 0x1
IN_MODIFY = 0x2
IN_ATTRIB = 0x4
IN_CLOSE_WRITE = 0x8
IN_MOVED_FROM = 0x40
IN_MOVED_TO = 0x80
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x01000000
IN_ISDIR = 0x40000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
MASK = IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_ONLYDIR

MAX_WATCHES = 65_536  # directories one watcher follows; more is an overflow
MAX_NAMES = 1_000_000  # names remembered to tell a replacement from a creation
MAX_JOURNAL = 100_000  # changes the workspace journal keeps
MAX_REPORT = 1000  # paths per list in a change report
_EVENT = struct.Struct("iIII")
_RESOLVE = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS
_libc = ctypes.CDLL(None, use_errno=True)

Change = tuple[str, bytes, bool]  # (created | modified | deleted | overflow, path, is_dir)
Sink = Callable[[list[Change]], object]


class Watcher:
    def __init__(self, root_fd: int, sink: Sink) -> None:
        self.root_fd = root_fd  # owned
        self.sink = sink
        self.ifd = _libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if self.ifd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), "inotify_init1")
        self.paths: dict[int, bytes] = {}  # wd -> directory path relative to the root (b"" the root)
        self.names: dict[int, set[bytes]] = {}
        self.name_count = 0
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

    # -- set up -----------------------------------------------------------------------
    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="guestd-watch", daemon=True)
        self.thread.start()

    def _add(self, rel: bytes, out: list[Change] | None) -> None:
        """Watch the directory ``rel`` and everything below it; with ``out``, what is found is
        reported as created (it appeared before its directory was watched)."""
        try:
            fd = openat2(self.root_fd, rel or b".", DIR_FLAGS, 0, _RESOLVE)
        except OSError:
            return  # gone, or a symlink now: nothing to watch
        try:
            self._watch(fd, rel)
            walk = Walk(fd, Filter(hidden=True, skip_git=False), max_entries=MAX_WATCHES * 4)
            for e in walk.entries():
                path = rel + b"/" + e.rel if rel else e.rel
                if out is not None:
                    out.append(("created", path, e.is_dir))
                if e.is_dir:
                    try:
                        sub = os.open(e.name, DIR_FLAGS, dir_fd=e.dirfd)
                    except OSError:
                        continue
                    try:
                        self._watch(sub, path)
                    finally:
                        os.close(sub)
        finally:
            os.close(fd)

    def _watch(self, fd: int, rel: bytes) -> None:
        if len(self.paths) >= MAX_WATCHES:
            self.sink([("overflow", rel, True)])
            return
        wd = _libc.inotify_add_watch(self.ifd, f"/proc/self/fd/{fd}".encode(), MASK)
        if wd < 0:
            if ctypes.get_errno() == errno.ENOSPC:  # fs.inotify.max_user_watches
                self.sink([("overflow", rel, True)])
            return
        self.paths[wd] = rel
        if self.name_count < MAX_NAMES:
            try:
                with os.scandir(fd) as it:
                    names = {os.fsencode(e.name) for e in it}
            except OSError:
                names = set()
            old = self.names.get(wd)
            self.name_count += len(names) - (len(old) if old else 0)
            self.names[wd] = names

    def _unwatch_below(self, rel: bytes) -> None:
        for wd, path in list(self.paths.items()):
            if path == rel or path.startswith(rel + b"/"):
                _libc.inotify_rm_watch(self.ifd, wd)
                del self.paths[wd]
                self.name_count -= len(self.names.pop(wd, ()))

    # -- the thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            try:
                self._add(b"", None)
            except BaseException as exc:  # reported to whoever waits for ready
                self.error = exc
                return  # the fds are closed below, by this thread: their owner
            finally:
                self.ready.set()
            while not self.stopping:
                select.select([self.ifd, self.wake_r], [], [])
                try:
                    os.read(self.wake_r, 4096)
                except BlockingIOError:
                    pass
                self._drain()
                while self.syncs:
                    self.syncs.popleft().set()
        finally:
            self._close()

    def _drain(self) -> None:
        out: list[Change] = []
        while True:
            try:
                data = os.read(self.ifd, 256 * 1024)
            except BlockingIOError:
                break
            except OSError:
                break
            pos = 0
            while pos + _EVENT.size <= len(data):
                wd, mask, _cookie, length = _EVENT.unpack_from(data, pos)
                name = data[pos + _EVENT.size : pos + _EVENT.size + length].rstrip(b"\0")
                pos += _EVENT.size + length
                self._event(wd, mask, name, out)
        if out:
            self.sink(out)

    def _event(self, wd: int, mask: int, name: bytes, out: list[Change]) -> None:
        if mask & IN_Q_OVERFLOW:
            out.append(("overflow", b"", False))
            return
        if mask & IN_IGNORED:
            self.paths.pop(wd, None)
            self.name_count -= len(self.names.pop(wd, ()))
            return
        base = self.paths.get(wd)
        if base is None or not name:
            return
        path = base + b"/" + name if base else name
        is_dir = bool(mask & IN_ISDIR)
        names = self.names.get(wd)
        if mask & (IN_CREATE | IN_MOVED_TO):
            existed = names is not None and name in names
            if names is not None and not existed:
                names.add(name)
                self.name_count += 1
            out.append(("modified" if existed and not is_dir else "created", path, is_dir))
            if is_dir:
                self._add(path, out)
        elif mask & (IN_DELETE | IN_MOVED_FROM):
            if names is not None and name in names:
                names.discard(name)
                self.name_count -= 1
            out.append(("deleted", path, is_dir))
            if is_dir:
                self._unwatch_below(path)
        elif mask & (IN_MODIFY | IN_CLOSE_WRITE | IN_ATTRIB) and not is_dir:
            out.append(("modified", path, is_dir))

    def sync(self, timeout: float = 10.0) -> bool:
        """Until every event queued in the kernel now has reached the sink (blocking); False
        at once when the watcher has ended."""
        done = threading.Event()
        self.syncs.append(done)
        if not self._wake():
            return False
        return done.wait(timeout)

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
        while self.syncs:
            self.syncs.popleft().set()


# --------------------------------------------------------------------------- coalescing


def merge(first: str, last: str) -> str | None:
    """The net effect of a path's changes from ``first`` to ``last`` (None: no effect)."""
    if first == "created":
        return None if last == "deleted" else "created"
    if last == "deleted":
        return "deleted"
    return "modified"


class Journal:
    """The workspace's change journal: numbered changes, the last ``MAX_JOURNAL`` kept."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entries: deque[tuple[int, Change]] = deque(maxlen=MAX_JOURNAL)
        self.seq = 0
        self.overflow_at = -1  # the seq of the last kernel overflow
        self.watcher: Watcher | None = None

    def add(self, changes: list[Change]) -> None:
        with self.lock:
            for c in changes:
                self.seq += 1
                if c[0] == "overflow":
                    self.overflow_at = self.seq
                self.entries.append((self.seq, c))

    def cursor(self) -> int:
        with self.lock:
            return self.seq

    def report(self, cursor: int) -> ChangeReportRecord:
        with self.lock:
            lost = bool(self.entries) and self.entries[0][0] > cursor + 1
            overflow = lost or self.overflow_at > cursor
            state: dict[bytes, tuple[str, str]] = {}
            for seq, (kind, path, _is_dir) in self.entries:
                if seq <= cursor or kind == "overflow":
                    continue
                first = state.get(path)
                state[path] = (first[0] if first else kind, kind)
        lists: dict[str, list[bytes]] = {"created": [], "modified": [], "deleted": []}
        for path, (first_kind, last_kind) in state.items():
            net = merge(first_kind, last_kind)
            if net is not None:
                lists[net].append(path)
        from guestd.wire.paths import path_to_wire

        total = sum(len(v) for v in lists.values())
        return {
            "created": [path_to_wire(os.fsdecode(p)) for p in sorted(lists["created"])[:MAX_REPORT]],
            "modified": [path_to_wire(os.fsdecode(p)) for p in sorted(lists["modified"])[:MAX_REPORT]],
            "deleted": [path_to_wire(os.fsdecode(p)) for p in sorted(lists["deleted"])[:MAX_REPORT]],
            "total": total,
            "truncated": any(len(v) > MAX_REPORT for v in lists.values()),
            "overflow": overflow,
        }
