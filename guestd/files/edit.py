"""Editor ops (issue 18): ``file.view``, ``file.str_replace``, ``file.insert``,
``file.replace_lines``, ``file.undo``, with the semantics agents know from editor tools.

Each edit reads the file through its kernel-resolved parent (``FileSystem.place``: the final
name is opened ``O_PATH | O_NOFOLLOW`` and only a regular file with one link is read, so a
symlink, FIFO or device planted there is refused without being opened), computes the new bytes,
and replaces the file atomically with ``AtomicFile`` (owner and mode kept). The file's identity
(device, inode, size, mtime) is checked again just before the commit: a file changed meanwhile
is a ``conflict``, not a lost update. Edits of one guestd are serialized by one lock.

Undo keeps, per file, the bytes before each edit (``UNDO_DEPTH`` edits, ``UNDO_BYTES`` over all
files, ``UNDO_FILES`` files, oldest forgotten first), keyed by the resolved directory and name.
An undo applies only over the exact bytes the edit left (a digest), so it never reverts someone
else's later change.
"""

from __future__ import annotations

import hashlib
import os
import stat as st
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from guestd.files.fs import FileSystem, Place, reopen_regular
from guestd.files.handlers import AtomicFile
from guestd.files.walk import Filter, Walk
from guestd.wire.errors import ErrorCode, GuestdError, too_large

if TYPE_CHECKING:
    from guestd.wire.types import FileStrReplaceReply as FileEditReply
    from guestd.wire.types import FileViewReply

MAX_EDIT_BYTES = 16 * 1024 * 1024  # largest file the editor ops read and rewrite
MAX_VIEW_BYTES = 256 * 1024  # content bytes one view returns
VIEW_DIR_ENTRIES = 2_000  # entries a directory view lists
SNIPPET_LINES = 4  # lines of context either side of a change in the reply
UNDO_DEPTH = 10
UNDO_BYTES = 64 * 1024 * 1024
UNDO_FILES = 512
MAX_MATCH_LINES = 100  # line numbers reported for a str_replace that matched more than once

# An edit: the old bytes -> (the new bytes, first and last changed line of the new bytes).
_Change = Callable[[bytes], tuple[bytes, int, int]]


@dataclass(frozen=True, slots=True)
class Version:
    before: bytes
    after_digest: bytes


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


class History:
    """Bounded per-file undo history (see the module doc)."""

    def __init__(self) -> None:
        self.files: OrderedDict[bytes, deque[Version]] = OrderedDict()
        self.bytes = 0

    def push(self, key: bytes, before: bytes, after: bytes) -> None:
        versions = self.files.pop(key, None) or deque()
        versions.append(Version(before, _digest(after)))
        self.bytes += len(before)
        while len(versions) > UNDO_DEPTH:
            self.bytes -= len(versions.popleft().before)
        self.files[key] = versions
        while self.files and (self.bytes > UNDO_BYTES or len(self.files) > UNDO_FILES):
            oldest_key = next(iter(self.files))
            oldest = self.files[oldest_key]
            self.bytes -= len(oldest.popleft().before)
            if not oldest:
                del self.files[oldest_key]

    def depth(self, key: bytes) -> int:
        return len(self.files.get(key, ()))

    def pop(self, key: bytes, current: bytes, shown: str) -> bytes:
        versions = self.files.get(key)
        if not versions:
            raise GuestdError(
                ErrorCode.CONFLICT,
                f"no edit of {shown} to undo",
                details={"path": shown, "reason": "no_history"},
            )
        if versions[-1].after_digest != _digest(current):
            raise GuestdError(
                ErrorCode.CONFLICT,
                f"{shown} changed since the last edit: undo would lose that change",
                details={"path": shown, "reason": "changed_since"},
            )
        version = versions.pop()
        self.bytes -= len(version.before)
        if not versions:
            del self.files[key]
        return version.before


def place_key(place: Place) -> bytes:
    """Where an edited file is, for its history: the resolved directory and the name."""
    return os.fsencode(os.readlink(f"/proc/self/fd/{place.dirfd}")) + b"/" + place.name


def read_at(place: Place, limit: int = MAX_EDIT_BYTES) -> tuple[bytes, os.stat_result]:
    """The regular file ``place`` names (never a symlink's target, never a FIFO or device)."""
    pathfd = os.open(place.name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=place.dirfd)
    try:
        fd = reopen_regular(pathfd, os.O_RDONLY | os.O_NONBLOCK, place.path)
    finally:
        os.close(pathfd)
    try:
        info = os.fstat(fd)
        if info.st_size > limit:
            raise too_large("max_edit_bytes", info.st_size, f"{place.path} is larger than {limit} bytes")
        chunks = []
        got = 0
        while got <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        if got > limit:
            raise too_large("max_edit_bytes", got, f"{place.path} is larger than {limit} bytes")
        return b"".join(chunks), info
    finally:
        os.close(fd)


def same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino, a.st_size, a.st_mtime_ns) == (b.st_dev, b.st_ino, b.st_size, b.st_mtime_ns)


def replace_at(fsys: FileSystem, place: Place, data: bytes, read: os.stat_result | None) -> None:
    """Replace the file at ``place`` with ``data`` atomically (owner and mode kept). ``read``:
    the stat of the file the new bytes were computed from (None: it must not exist yet); a file
    changed since is a ``conflict``. ``place`` is consumed."""
    f = AtomicFile(place, "overwrite" if read is not None else "create", None, fsys.pending)
    try:
        f.write(data)
        try:
            now: os.stat_result | None = os.stat(place.name, dir_fd=place.dirfd, follow_symlinks=False)
        except FileNotFoundError:
            now = None
        if (now is None) != (read is None) or (now is not None and read is not None and not same_file(now, read)):
            raise GuestdError(
                ErrorCode.CONFLICT,
                f"{place.path} changed while it was being edited",
                details={"path": place.path, "reason": "changed_during_edit"},
            )
        f.commit()
    except BaseException:
        f.abort()
        raise


# --------------------------------------------------------------------------- lines


def line_starts(data: bytes) -> list[int]:
    """Offsets where each line starts; a final newline starts no new line."""
    starts = [0]
    find = data.find
    pos = find(b"\n")
    while pos >= 0:
        starts.append(pos + 1)
        pos = find(b"\n", pos + 1)
    if starts[-1] == len(data) and len(starts) > 1:
        starts.pop()
    if not data:
        return []
    return starts


def numbered(data: bytes, starts: list[int], first: int, last: int, budget: int) -> tuple[str, int]:
    """Lines ``first``..``last`` (1-based, inclusive) as ``cat -n`` text, at most ``budget``
    bytes of it; returns (text, the last line included)."""
    out: list[str] = []
    used = 0
    shown = first - 1
    for n in range(first, last + 1):
        a = starts[n - 1]
        b = starts[n] if n < len(starts) else len(data)
        text = f"{n:6d}\t" + data[a:b].rstrip(b"\n").decode("utf-8", "replace") + "\n"
        cost = len(text.encode())
        if used + cost > budget and out:
            break
        out.append(text)
        used += cost
        shown = n
    return "".join(out), shown


def snippet(data: bytes, first: int, last: int) -> tuple[str, int]:
    """The changed lines ``first``..``last`` of the new content with context, numbered."""
    starts = line_starts(data)
    if not starts:
        return "", 1
    a = max(1, first - SNIPPET_LINES)
    b = min(len(starts), max(first, last) + SNIPPET_LINES)
    text, _ = numbered(data, starts, a, b, MAX_VIEW_BYTES)
    return text, a


def whole_lines(text: bytes) -> bytes:
    return text if not text or text.endswith(b"\n") else text + b"\n"


# --------------------------------------------------------------------------- ops


class Editor:
    def __init__(self, fsys: FileSystem) -> None:
        self.fsys = fsys
        self.history = History()
        self.lock = threading.Lock()

    def view(self, path: str, start_line: int | None, end_line: int | None) -> FileViewReply:
        info, _ = self.fsys.stat(path, True)
        if st.S_ISDIR(info.st_mode):
            return self._view_dir(path)
        fd = self.fsys.open_file(path)
        try:
            size = os.fstat(fd).st_size
            if size > MAX_EDIT_BYTES:
                raise too_large("max_edit_bytes", size, f"{path} is larger than {MAX_EDIT_BYTES} bytes")
            data = os.pread(fd, MAX_EDIT_BYTES + 1, 0)
        finally:
            os.close(fd)
        starts = line_starts(data)
        total = len(starts)
        first = start_line or 1
        last = total if end_line is None else min(end_line, total)
        if total and (first > total or last < first):
            raise GuestdError(
                ErrorCode.BAD_REQUEST,
                f"lines {first}:{last} are outside the file's {total} lines",
                details={"field": "start_line", "total_lines": total},
            )
        text, shown = numbered(data, starts, first, last, MAX_VIEW_BYTES) if total else ("", 0)
        return {
            "kind": "file",
            "content": text,
            "start_line": first if total else 0,
            "end_line": shown,
            "total_lines": total,
            "truncated": shown < last,
        }

    def _view_dir(self, path: str) -> FileViewReply:
        fd = self.fsys.open_dir(path)
        try:
            walk = Walk(fd, Filter(hidden=False), max_entries=VIEW_DIR_ENTRIES, max_depth=1)
            lines = [e.rel.decode("utf-8", "backslashreplace") + ("/" if e.is_dir else "") for e in walk.entries()]
        finally:
            os.close(fd)
        return {
            "kind": "dir",
            "content": "\n".join(lines) + ("\n" if lines else ""),
            "start_line": None,
            "end_line": None,
            "total_lines": None,
            "truncated": walk.truncated is not None,
        }

    def _edit(self, path: str, change: _Change) -> FileEditReply:
        with self.lock:
            place = self.fsys.place(path)
            try:
                key = place_key(place)
                old, info = read_at(place)
                new, first, last = change(old)
                if len(new) > MAX_EDIT_BYTES:
                    raise too_large(
                        "max_edit_bytes", len(new), f"the edit would make {path} larger than {MAX_EDIT_BYTES} bytes"
                    )
            except BaseException:
                place.close()
                raise
            replace_at(self.fsys, place, new, info)
            self.history.push(key, old, new)
            text, at = snippet(new, first, last)
            return {"size": len(new), "snippet": text, "start_line": at, "undo_depth": self.history.depth(key)}

    def str_replace(self, path: str, old: str, new: str) -> FileEditReply:
        needle, repl = old.encode(), new.encode()

        def change(data: bytes) -> tuple[bytes, int, int]:
            hits: list[int] = []
            pos = data.find(needle)
            while pos >= 0:
                hits.append(pos)
                pos = data.find(needle, pos + len(needle))
            if len(hits) != 1:
                lines = [data.count(b"\n", 0, h) + 1 for h in hits[:MAX_MATCH_LINES]]
                reason = "no_match" if not hits else "multiple_matches"
                what = "does not occur" if not hits else f"occurs {len(hits)} times (lines {lines})"
                raise GuestdError(
                    ErrorCode.CONFLICT,
                    f"the old text {what} in {path}; it must occur exactly once",
                    details={"path": path, "reason": reason, "matches": len(hits), "lines": lines},
                )
            at = hits[0]
            first = data.count(b"\n", 0, at) + 1
            return data[:at] + repl + data[at + len(needle) :], first, first + repl.count(b"\n")

        return self._edit(path, change)

    def insert(self, path: str, line: int, text: str) -> FileEditReply:
        body = whole_lines(text.encode())

        def change(data: bytes) -> tuple[bytes, int, int]:
            starts = line_starts(data)
            if line > len(starts):
                raise _outside(path, "line", line, len(starts))
            if line == len(starts):
                head = data if not data or data.endswith(b"\n") else data + b"\n"
                return head + body, line + 1, line + max(1, body.count(b"\n"))
            at = starts[line]
            return data[:at] + body + data[at:], line + 1, line + max(1, body.count(b"\n"))

        return self._edit(path, change)

    def replace_lines(self, path: str, start_line: int, end_line: int, text: str) -> FileEditReply:
        body = whole_lines(text.encode())

        def change(data: bytes) -> tuple[bytes, int, int]:
            starts = line_starts(data)
            if start_line > len(starts) or end_line < start_line or end_line > len(starts):
                raise _outside(path, "end_line" if start_line <= len(starts) else "start_line", end_line, len(starts))
            a = starts[start_line - 1]
            b = starts[end_line] if end_line < len(starts) else len(data)
            tail = data[b:]
            # the last line had no newline: neither has its replacement
            last_unterminated = b == len(data) and not data.endswith(b"\n") and body != b""
            body_here = body[:-1] if last_unterminated else body
            return data[:a] + body_here + tail, start_line, start_line + max(0, body.count(b"\n") - 1)

        return self._edit(path, change)

    def undo(self, path: str) -> FileEditReply:
        with self.lock:
            place = self.fsys.place(path)
            try:
                key = place_key(place)
                current, info = read_at(place)
                before = self.history.pop(key, current, path)
            except BaseException:
                place.close()
                raise
            try:
                replace_at(self.fsys, place, before, info)
            except BaseException:
                self.history.push(key, before, current)  # still undoable
                raise
            first, last = _changed_lines(current, before)
            text, at = snippet(before, first, last)
            return {"size": len(before), "snippet": text, "start_line": at, "undo_depth": self.history.depth(key)}


def _changed_lines(a: bytes, b: bytes) -> tuple[int, int]:
    """First and last line of ``b`` that differ from ``a`` (for an undo's snippet)."""
    n = min(len(a), len(b))
    i = _common(lambda k: a[:k] == b[:k], n)
    j = _common(lambda k: a[len(a) - k :] == b[len(b) - k :], n - i)
    first = b.count(b"\n", 0, i) + 1
    last = max(first, b.count(b"\n", 0, max(i, len(b) - j)) + 1)
    return first, last


def _common(equal: Callable[[int], bool], n: int) -> int:
    """The largest k <= n with equal(k), for a monotone ``equal`` (binary search on slices)."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if equal(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _outside(path: str, field: str, value: int, total: int) -> GuestdError:
    return GuestdError(
        ErrorCode.BAD_REQUEST,
        f"{field} {value} is outside {path}'s {total} lines",
        details={"field": field, "total_lines": total},
    )
