"""How directories join a watched tree: each opened from the root with ``openat2``
(``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS``, so a directory swapped for a symlink is never watched
in its place) and its children ``O_NOFOLLOW`` from its fd, watched, and listed within a budget of
entries; directories that appear later are queued (deduplicated, at most ``MAX_SCANS``) and
scanned between two reads of the kernel's queue.
"""

from __future__ import annotations

import ctypes
import errno
import os

from guestd.files.resolver import RESOLVE_BENEATH, RESOLVE_NO_MAGICLINKS, RESOLVE_NO_SYMLINKS, openat2
from guestd.files.walk import DIR_FLAGS, MAX_DEPTH
from guestd.files.watchtree import (
    MASK,
    MAX_NAMES_BYTES,
    NAME_COST,
    NAMES,
    TEMP_NAME,
    WATCHES,
    Node,
    Sink,
    WatchedTree,
    libc,
    subtree,
)

MAX_WATCHES = 65_536  # directories watched by all of guestd's watchers together; more: overflow
MAX_SCANS = 4096  # directories waiting for their scan; more: overflow for them
_RESOLVE = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS


class Scanner(WatchedTree):
    """A watched tree that scans: the directories below ``root_fd`` (owned) watched and listed."""

    def __init__(self, root_fd: int, ifd: int, sink: Sink) -> None:
        super().__init__(ifd, sink)
        self.root_fd = root_fd  # owned
        # Directories waiting for their scan: (parent wd, name) -> (parent, name, seq, tries).
        self.scans: dict[tuple[int, bytes], tuple[Node, bytes, int, int]] = {}
        self.scan_seq = 0
        self.known = False  # set by _watch: that directory was followed already (or back from limbo)

    def _watch(self, fd: int, parent: Node | None, name: bytes) -> Node | None:
        """The node of the directory open at ``fd`` (``parent``'s child ``name``); None when
        it cannot be watched (a bound: said as overflow)."""
        wd = libc.inotify_add_watch(self.ifd, f"/proc/self/fd/{fd}".encode(), MASK)
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
                for n in subtree(limbo_root):
                    del self.limbo_of[n.wd]
                    self.nodes[n.wd] = n
                self._attach(limbo_root, parent, name)
                self.known = True
                return limbo_root
            self._evict(root_wd)  # changed meanwhile (or only a part came back): walked anew
            wd = libc.inotify_add_watch(self.ifd, f"/proc/self/fd/{fd}".encode(), MASK)
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
            libc.inotify_rm_watch(self.ifd, wd)
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
                    wd = libc.inotify_add_watch(self.ifd, f"/proc/self/fd/{pfd}".encode(), MASK)
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
                    if TEMP_NAME.match(name):
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
