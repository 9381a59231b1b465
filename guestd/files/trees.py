"""``tree.upload``: a tar stream extracted into a private staging directory beside the target,
then committed in one rename.

Extraction is guestd's own, over the file-system layer: ``tarread`` parses the stream (a
file's data goes from the received frames straight to its fd); every entry is created with
``*at`` calls in a directory fd resolved with ``openat2`` (``RESOLVE_BENEATH |
RESOLVE_NO_SYMLINKS``) below ``tree`` in a private directory that guestd made beside the target
(``.<name>.guestd-tree-<random>``, mode 0700 and guestd's, held by its fd: the workload owns the
target's directory, so it may rename the private directory or put another at its name, but it can
neither enter it nor change its entries, and the commit, the exchange and the removals all go
through that fd, never its name). Refused with ``bad_request``
and ``details.entry``: absolute names, ``..``, a symlink whose target is absolute or climbs
out of the tree, hard links, devices, FIFOs, and any path through a symlink. A symlink's
target must stay in the tree both read as text and resolved through the links the archive
itself made (``Links`` of :mod:`guestd.files.tarlinks`: once every entry is in, each target is
resolved over a trie of the archive's links, a name that is no link counting as a directory whether it exists or not, so
``a/b/c/up -> ../..`` then ``a/b/c/esc -> up/../../../..`` is refused whatever the order of
the two); a chain of more than 40 links, a loop, or a target of 4096 bytes or more is refused
too. What waits for the end (directories' modes and mtimes, the links) is bounded in bytes
(``MAX_TREE_REMEMBERED``), and tarfile's own list of the members read is dropped as it grows. On success
``tree`` gets its final mode and owner and is renamed from the private directory's fd into place
(``RENAME_NOREPLACE``; with ``replace``, exchanged with the old tree, which then lies at ``tree``
and is removed); on any failure ``tree`` is removed. The private directory is removed last, only
while its name still holds its inode: nothing half-extracted is left at or beside the target.
Modes lose setuid and setgid. New entries get the workspace ownership rule of the target's
directory.

The way back out (``tree.download``) is :mod:`guestd.files.archive`.
"""

from __future__ import annotations

import errno
import os
import queue
import stat as st
import tarfile
from collections.abc import Callable

from guestd.files import tarread
from guestd.files.entries import remove_tree
from guestd.files.fs import PATH_MAX, FileSystem, Owner, Place, rename_noreplace
from guestd.files.resolver import RESOLVE_BENEATH, RESOLVE_NO_MAGICLINKS, RESOLVE_NO_SYMLINKS, openat2
from guestd.files.tarlinks import Links, entry_parts, link_stays_inside, refused
from guestd.files.temps import TREE_TEMP_MARK
from guestd.wire.errors import ErrorCode, GuestdError

MAX_TREE_ENTRIES = 1_000_000  # entries one archive may hold
# What the extraction remembers until the end, in bytes of guestd's memory (counted as measured:
# a directory entry's mode and mtime, set last, about 170 bytes and its path; a link, checked once
# all are in, about 350 bytes per name on its path and its target): about 190,000 links or 330,000
# directories; beyond, the upload is refused (limit max_tree_remembered).
MAX_TREE_REMEMBERED = 64 * 1024 * 1024
_DIR_COST = 200
_LINK_NODE_COST = 350
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_RESOLVE = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS
_RENAME_EXCHANGE = 2
_STAGED = b"tree"  # the tree's name in the private staging directory while it fills
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


# --------------------------------------------------------------------------- input bridge


class Feed:
    """The tar stream as the frames' data came, fed by the event loop, taken in order by the
    extracting thread (:meth:`next_chunk`). ``ack(n)`` (called on the loop) grants credit as
    bytes are consumed, so what waits here is bounded by the request's credit. A piece counts
    as consumed when the next one is asked for; grants go in batches of ``ACK_EVERY`` bytes,
    and all that was consumed is granted before waiting for more (so the client is never left
    without credit while guestd waits): one grant per tarfile read (10 KiB) was a WINDOW frame
    and a wake of the loop each, 11,000 for a 110 MB tree, and the client's frames shrank to
    those grants."""

    _ABORT = object()
    ACK_EVERY = 256 * 1024

    def __init__(self, ack: Callable[[int], object]) -> None:
        self.q: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.eof = False
        self.ack = ack
        self.unacked = 0
        self.held = 0  # the piece handed out last, consumed when the next is asked for

    def feed(self, data: bytes) -> None:
        self.q.put(data)

    def finish(self) -> None:
        self.q.put(None)

    def abort(self) -> None:
        self.q.put(self._ABORT)

    def _grant(self) -> None:
        if self.unacked:
            self.ack(self.unacked)
            self.unacked = 0

    def next_chunk(self) -> bytes | None:
        """The next piece of the stream (blocks until it comes), None after eof."""
        self.unacked += self.held
        self.held = 0
        if self.eof:
            self._grant()
            return None
        if self.unacked >= self.ACK_EVERY or self.q.empty():
            self._grant()  # about to wait, or a batch is full: the client may send that much more
        item = self.q.get()
        if item is self._ABORT:
            raise GuestdError(ErrorCode.CANCELLED, "the upload was aborted")
        if item is None:
            self.eof = True
            self._grant()
            return None
        assert isinstance(item, bytes)
        self.held = len(item)
        return item


# --------------------------------------------------------------------------- extraction


class Extractor:
    def __init__(self, place: Place, owner: Owner) -> None:
        self.place = place
        self.owner = owner if os.geteuid() == 0 else None
        self.tmp = b"." + place.name[:100] + TREE_TEMP_MARK + os.urandom(6).hex().encode()
        self.private = -1  # the fd of the private directory made at self.tmp
        self.staged = False  # _STAGED in it is the tree this extractor made (or the old one, exchanged)
        self.root = -1
        self.entries = 0
        self.bytes = 0
        self.dirs: list[tuple[str, int, int]] = []  # (relative path, mode, mtime_ns) set at the end
        self.remembered = 0  # bytes, against MAX_TREE_REMEMBERED
        self.root_meta: tuple[int, int] | None = None  # the "." entry's mode and mtime_ns
        self.cached: tuple[str, int] | None = None  # the last parent directory: (rel, fd)
        self.links = Links()
        self.umask = _umask()

    def run(self, source: tarread.Source, replace: bool) -> tuple[int, int]:
        self._make_private()
        try:
            os.mkdir(_STAGED, 0o700, dir_fd=self.private)
            self.staged = True
            self.root = os.open(_STAGED, _DIR, dir_fd=self.private)
            reader = tarread.Reader(source)
            previous = ""
            while (m := reader.next_member(previous)) is not None:
                self.entries += 1
                if self.entries > MAX_TREE_ENTRIES:
                    raise GuestdError(
                        ErrorCode.LIMIT,
                        f"the archive has more than {MAX_TREE_ENTRIES} entries",
                        details={"limit": "max_tree_entries", "value": MAX_TREE_ENTRIES},
                    )
                self._entry(reader, m)
                previous = m.name
            self.links.check()
            self._finish_dirs()
            self._commit(replace)
            return self.entries, self.bytes
        except BaseException:
            self._remove_staged()
            raise
        finally:
            if self.cached is not None:
                os.close(self.cached[1])
                self.cached = None
            if self.root >= 0:
                os.close(self.root)
                self.root = -1
            self._remove_private()

    def _make_private(self) -> None:
        """Make the private directory and hold its fd. Between the mkdir and the open the
        workload may put another directory at the name: the one opened must be guestd's and
        closed to everyone else (a directory the workload made could have its entries changed
        under the extraction); otherwise the upload is refused."""
        os.mkdir(self.tmp, 0o700, dir_fd=self.place.dirfd)
        self.private = os.open(self.tmp, _DIR, dir_fd=self.place.dirfd)
        info = os.fstat(self.private)
        if info.st_uid != os.geteuid() or info.st_mode & 0o077:
            os.close(self.private)
            self.private = -1
            raise OSError(errno.EBUSY, "the staging directory was replaced while it was made", self.place.path)

    def _parent(self, parts: list[str], name: str) -> int:
        """The fd of the directory an entry goes in (borrowed: the extractor keeps the last one
        open, as entries come directory by directory), missing ones made (0700) on the way: one
        component at a time, ``O_NOFOLLOW``, so a path through a symlink (one the archive
        itself made) is refused, never followed."""
        rel = "/".join(parts[:-1])
        if self.cached is not None and self.cached[0] == rel:
            return self.cached[1]
        fd = os.dup(self.root)
        try:
            for comp in parts[:-1]:
                try:
                    sub = os.open(comp, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                except FileNotFoundError:
                    os.mkdir(comp, 0o700, dir_fd=fd)
                    self._own_at(fd, comp)
                    sub = os.open(comp, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise refused(name, "through_link", "its path goes through a symlink or a file") from None
                    raise
                os.close(fd)
                fd = sub
        except BaseException:
            os.close(fd)
            raise
        if self.cached is not None:
            os.close(self.cached[1])
        self.cached = (rel, fd)
        return fd

    def _entry(self, reader: tarread.Reader, m: tarread.Member) -> None:
        name = m.name
        parts = entry_parts(name)
        mode = m.mode & 0o1777
        kind = m.kind
        is_dir, is_link = kind == tarfile.DIRTYPE, kind == tarfile.SYMTYPE
        if not parts:
            if not is_dir:
                raise refused(name, "root", "the archive's root is not a directory")
            self.root_meta = (mode, m.mtime_ns)
            return
        if kind == tarfile.LNKTYPE:
            raise refused(name, "hard_link", "hard links are not extracted")
        if kind in (tarfile.CHRTYPE, tarfile.BLKTYPE):
            raise refused(name, "device", "device files are not extracted")
        if kind == tarfile.FIFOTYPE:
            raise refused(name, "fifo", "FIFOs are not extracted")
        if not (is_dir or is_link or m.is_regular):
            raise refused(name, "type", "an entry of an unknown type")
        if is_link and len(os.fsencode(m.linkname)) >= PATH_MAX:
            raise refused(name, "link_long", f"symlink target of {len(os.fsencode(m.linkname))} bytes")
        if is_link and not link_stays_inside(parts, m.linkname):
            raise refused(name, "link_out", f"symlink to {m.linkname!r} points out of the tree")
        parent = self._parent(parts, name)
        last = parts[-1]
        mtime_ns = (m.mtime_ns, m.mtime_ns)
        if is_dir:
            try:
                os.mkdir(last, 0o700, dir_fd=parent)
                self._own_at(parent, last)
            except FileExistsError:
                if not st.S_ISDIR(os.stat(last, dir_fd=parent, follow_symlinks=False).st_mode):
                    raise refused(name, "duplicate", "a directory over a file of the same name") from None
            rel = "/".join(parts)
            self._remember(_DIR_COST + len(rel))
            self.dirs.append((rel, mode, m.mtime_ns))
            return
        if is_link:
            try:
                os.symlink(m.linkname, last, dir_fd=parent)
            except FileExistsError:  # a later entry of the same name replaces an earlier one
                self._clear(parent, parts, name)
                os.symlink(m.linkname, last, dir_fd=parent)
            self._remember(_LINK_NODE_COST * self.links.add(parts, m.linkname) + len(m.linkname))
            if self.owner is not None:
                os.chown(last, *self.owner, dir_fd=parent, follow_symlinks=False)
            os.utime(last, ns=mtime_ns, dir_fd=parent, follow_symlinks=False)
            return
        # Made with its mode where the umask keeps all of it (no one else can enter the private
        # directory while it fills): an fchmod less per file.
        made_with_mode = not mode & (self.umask | 0o7000)
        create_mode = mode if made_with_mode else 0o600
        try:
            fd = os.open(last, _CREATE, create_mode, dir_fd=parent)
        except FileExistsError:  # a later entry of the same name replaces an earlier one
            self._clear(parent, parts, name)
            fd = os.open(last, _CREATE, create_mode, dir_fd=parent)
        try:
            reader.finish_data(m.size, reader.copy(m.size, lambda view: os.write(fd, view)), name)
            self.bytes += m.size
            if self.owner is not None:
                os.fchown(fd, *self.owner)
            if not made_with_mode:
                os.fchmod(fd, mode)
            os.utime(fd, ns=mtime_ns)
        finally:
            os.close(fd)

    def _remember(self, nbytes: int) -> None:
        self.remembered += nbytes
        if self.remembered > MAX_TREE_REMEMBERED:
            raise GuestdError(
                ErrorCode.LIMIT,
                f"the archive has more directories and symlinks than guestd keeps in mind"
                f" ({MAX_TREE_REMEMBERED >> 20} MiB: about 190,000 links or 330,000 directories)",
                details={"limit": "max_tree_remembered", "value": MAX_TREE_REMEMBERED},
            )

    def _own_at(self, parent: int, last: str) -> None:
        if self.owner is not None:
            os.chown(last, *self.owner, dir_fd=parent, follow_symlinks=False)

    def _clear(self, parent: int, parts: list[str], name: str) -> None:
        """Make room for a later entry of the same name as an earlier file or link (as tar
        does); a directory there is refused."""
        last = parts[-1]
        info = os.stat(last, dir_fd=parent, follow_symlinks=False)
        if st.S_ISDIR(info.st_mode):
            raise refused(name, "duplicate", "a file over a directory of the same name")
        os.unlink(last, dir_fd=parent)
        if st.S_ISLNK(info.st_mode):
            self.links.remove(parts)

    def _finish_dirs(self) -> None:
        """Modes and mtimes of directories, deepest first (creating entries changes mtimes)."""
        for rel, mode, mtime in sorted(self.dirs, key=lambda d: -d[0].count("/")):
            try:
                fd = openat2(self.root, rel, _DIR, 0, _RESOLVE)
            except OSError:
                continue
            try:
                os.fchmod(fd, mode)
                os.utime(fd, ns=(mtime, mtime))
            finally:
                os.close(fd)

    def _commit(self, replace: bool) -> None:
        """``tree`` into place, renamed from the private directory's fd: whatever the workload
        did to the private directory's name, what is committed is the tree guestd extracted."""
        mode, mtime = self.root_meta or (0o755, None)
        # Moving a directory to another parent writes its "..": without CAP_DAC_OVERRIDE that
        # needs write permission on it, so a read-only mode is set once it is in place.
        late_mode = os.geteuid() != 0 and not mode & st.S_IWUSR
        os.fchmod(self.root, mode | st.S_IWUSR if late_mode else mode)
        if self.owner is not None:
            os.fchown(self.root, *self.owner)
        if mtime is not None:
            os.utime(self.root, ns=(mtime, mtime))
        staged = Place(self.private, _STAGED, self.place.path, None)
        try:
            rename_noreplace(staged, self.place)
            self.staged = False
            if late_mode:
                os.fchmod(self.root, mode)
            return
        except FileExistsError:
            if not replace:
                raise
        except OSError as exc:
            if exc.errno != errno.EEXIST or not replace:
                raise
        old = os.stat(self.place.name, dir_fd=self.place.dirfd, follow_symlinks=False)
        if not st.S_ISDIR(old.st_mode):
            raise GuestdError(
                ErrorCode.NOT_A_DIRECTORY,
                f"{self.place.path} exists and is not a directory",
                details={"path": self.place.path},
            )
        _exchange(self.private, _STAGED, self.place.dirfd, self.place.name, self.place.path)
        if late_mode:
            os.fchmod(self.root, mode)
        # whatever was at the target now sits at tree in the private directory: removed there
        # (run's finally then removes the private directory)
        self._remove_staged(raising=True)

    def _remove_staged(self, raising: bool = False) -> None:
        """Remove what lies at ``tree`` in the private directory (the half-extracted tree, or
        the old one after an exchange) without following anything; only this extractor's
        entries are there (the workload cannot change the private directory's entries)."""
        if not self.staged:
            return
        try:
            if st.S_ISDIR(os.stat(_STAGED, dir_fd=self.private, follow_symlinks=False).st_mode):
                remove_tree(self.private, _STAGED, self.place.path)
            else:  # the workload put a file at the target between the stat and the exchange
                os.unlink(_STAGED, dir_fd=self.private)
            self.staged = False
        except OSError:
            if raising:
                raise

    def _remove_private(self) -> None:
        """rmdir the private directory if its name still holds it (the workload may have
        renamed it and put another directory there: that one is left alone, and guestd's,
        empty, stays at the name the workload gave it). Then close its fd."""
        if self.private < 0:
            return
        try:
            here = os.stat(self.tmp, dir_fd=self.place.dirfd, follow_symlinks=False)
            mine = os.fstat(self.private)
            if (here.st_dev, here.st_ino) == (mine.st_dev, mine.st_ino):
                os.rmdir(self.tmp, dir_fd=self.place.dirfd)  # only ever an empty directory
        except OSError:
            pass
        finally:
            os.close(self.private)
            self.private = -1


def _umask() -> int:
    """The process's umask, read without setting it (os.umask sets it for every thread at once);
    all bits (every mode then gets its fchmod) where /proc does not say."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o777


def _exchange(src_dir: int, src: bytes, dst_dir: int, dst: bytes, shown: str) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.renameat2(src_dir, src, dst_dir, dst, _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), shown)


def extract(fsys: FileSystem, path: str, parents: bool, replace: bool, source: tarread.Source) -> tuple[int, int]:
    with fsys.place(path, parents=parents) as place:
        return Extractor(place, place.owner).run(source, replace)
