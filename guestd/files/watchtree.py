"""The tree a change feed follows: its directories as nodes (a watch descriptor, a parent and a
name, never a stored path), the names each holds, the directories moved out and kept a while
(limbo), the changes waiting to be handed on, and the bounds all of guestd's watchers share.

No thread and no reading here: the kernel's events come in through
:class:`~guestd.files.watch.Watcher`, new directories through
:class:`~guestd.files.watchscan.Scanner`.
"""

from __future__ import annotations

import ctypes
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from guestd.files.temps import TEMP_MARK, TREE_TEMP_MARK

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

MAX_NAMES_BYTES = 16 << 20  # names remembered (all watchers) to tell a replacement from a creation
MAX_LIMBO = 16  # directories moved out of the tree whose watches are kept in case they come back
LIMBO_S = 2.0  # ... for at most this long
BATCH_BYTES = 256 << 10  # changes handed to the sink at once
YIELD_S = 0.001  # work between two offers of the GIL
CHANGE_COST = 160  # bytes a change held as a tuple costs besides its path (a tuple, a bytes header)
NAME_COST = 80  # bytes a remembered name costs besides itself (set slot, bytes header)

# file.write's temp names (guestd.files.atomic.AtomicFile): an O_TMPFILE inode, which the
# kernel names "#<inode number>" in its events though no such name ever exists, and the named
# temp file "." + name + TEMP_MARK + 12 hex digits (an overwrite's link, or where O_TMPFILE is missing);
# tree.upload's private staging directory "." + name + TREE_TEMP_MARK + 12 hex digits, never
# scanned or watched; its "tree" is moved to the target when whole (a move in: reported as the
# target created, its content listed).
_TMPFILE_NAME = re.compile(rb"#[0-9]+\Z")
TEMP_NAME = re.compile(
    rb"\..*(?:" + re.escape(TEMP_MARK) + b"|" + re.escape(TREE_TEMP_MARK) + rb")[0-9a-f]{12}\Z", re.DOTALL
)
libc = ctypes.CDLL(None, use_errno=True)

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


def subtree(node: Node) -> list[Node]:
    """``node`` and every node below it."""
    out = [node]
    i = 0
    while i < len(out):
        children = out[i].children
        if children:
            out.extend(children.values())
        i += 1
    return out


def ours(name: bytes, mask: int, names: set[bytes] | None) -> bool:
    """An event about one of guestd's own temporary names (never a change of the tree)."""
    if TEMP_NAME.match(name):
        return True
    # An O_TMPFILE inode's events name "#<inode>": a name the directory does not hold.
    return bool(mask & MODIFIED) and (names is None or name not in names) and _TMPFILE_NAME.match(name) is not None


class WatchedTree:
    """One watcher's tree of nodes (by watch descriptor), its limbo and its batch of changes;
    ``ifd`` is the inotify instance the watches belong to."""

    def __init__(self, ifd: int, sink: Sink) -> None:
        self.ifd = ifd
        self.sink = sink
        self.nodes: dict[int, Node] = {}  # wd -> node
        self.gen = 0  # bumped when a directory moves: cached paths are recomputed
        self.names_bytes = 0  # this watcher's part of NAMES
        self.batch: list[Change] = []
        self.batch_bytes = 0
        # Directories moved out of the tree, still watched a while: root wd -> (node, since,
        # changed meanwhile); and every wd of theirs -> its root's wd.
        self.limbo: dict[int, tuple[Node, float, bool]] = {}
        self.limbo_of: dict[int, int] = {}
        self.ticks = 0
        self.yielded = 0.0  # when _tick last let the GIL go
        self.incomplete = False  # some directory of the tree is not watched (a bound was reached)

    def _tick(self) -> None:
        """Every ``YIELD_S`` of work, let the event loop take the GIL if it waits for it (a ping
        answers within about a millisecond, not at CPython's next 5 ms switch interval)."""
        self.ticks += 1
        if self.ticks % 64 == 0:
            now = time.monotonic()
            if now - self.yielded >= YIELD_S:
                time.sleep(0)
                self.yielded = time.monotonic()

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
                    libc.inotify_rm_watch(self.ifd, n.wd)
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

    # -- limbo ----------------------------------------------------------------------------
    def _to_limbo(self, node: Node) -> None:
        """The directory ``node`` moved away has left the tree. Its watches are kept a while
        (limbo): if it comes back unchanged (a workload moving a huge directory out and in
        again) it is put back as it was, not walked again; any event in it meanwhile marks it
        changed."""
        if self.nodes.get(node.wd) is not node:
            return
        parent = node.parent
        if parent is not None and parent.children and parent.children.get(node.name) is node:
            del parent.children[node.name]
        node.parent = None
        for n in subtree(node):
            del self.nodes[n.wd]
            self.limbo_of[n.wd] = node.wd
        self.limbo[node.wd] = (node, time.monotonic(), False)
        while len(self.limbo) > MAX_LIMBO:
            self._evict(next(iter(self.limbo)))

    def _evict(self, root_wd: int) -> None:
        """Stop watching a directory in limbo for good."""
        node, _since, _changed = self.limbo.pop(root_wd)
        for n in subtree(node):
            if self.limbo_of.pop(n.wd, None) is not None:
                WATCHES.give(1)
                libc.inotify_rm_watch(self.ifd, n.wd)
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

    # -- handing on -----------------------------------------------------------------------
    def _emit(self, kind: str, path: bytes, is_dir: bool) -> None:
        self.batch.append((kind, path, is_dir))
        self.batch_bytes += change_cost(path)
        if self.batch_bytes >= BATCH_BYTES:
            self._flush()

    def _flush(self) -> None:
        if self.batch:
            batch, self.batch, self.batch_bytes = self.batch, [], 0
            self.sink(batch)

    def _lost(self, path: bytes) -> None:
        """Part of the tree below ``path`` is not watched (a bound): overflow, for good."""
        self.incomplete = True
        self._emit("overflow", path, True)
