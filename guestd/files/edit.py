"""Editor ops: ``file.view``, ``file.str_replace``, ``file.insert``,
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

Memory (a 16 MiB file of newlines once cost 665 MiB per view, a Python int per line):
the ops hold file-sized buffers and a view's worth of lines, never an object per line of the
file. Lines are found by counting newlines over the bytes (``nth_newline``). A view streams
the file in ``READ_CHUNK`` pieces, keeping the ``MAX_VIEW_BYTES`` from its first line. An edit
holds the old and the new bytes (at most ``MAX_EDIT_BYTES`` each, one edit at a time: the lock).
The history keeps at most ``UNDO_DEPTH`` versions per file, each the bytes before one edit (so at
most ``MAX_EDIT_BYTES``), and at most ``UNDO_BYTES`` of them over at most ``UNDO_FILES`` files.
"""

from __future__ import annotations

import codecs
import hashlib
import os
import stat as st
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from guestd.files.atomic import AtomicFile
from guestd.files.fs import FileSystem, Place, reopen_regular
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
READ_CHUNK = 1 << 20  # bytes a view reads at a time
COUNT_BLOCK = 1 << 16  # bytes whose newlines nth_newline counts in one call

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
        # One read of the size fstat gave (plus one byte to see growth): the file's bytes in
        # one buffer, not pieces and their join (twice the size at the peak).
        data = os.read(fd, info.st_size + 1)
        chunks = [data]
        got = len(data)
        while got <= limit:  # grown since the fstat, or a short read
            chunk = os.read(fd, min(1 << 20, limit + 1 - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        if got > limit:
            raise too_large("max_edit_bytes", got, f"{place.path} is larger than {limit} bytes")
        return (data if len(chunks) == 1 else b"".join(chunks)), info
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


def count_lines(data: bytes) -> int:
    """Lines in ``data``: a final newline starts no new line."""
    if not data:
        return 0
    return data.count(b"\n") + (0 if data.endswith(b"\n") else 1)


def nth_newline(data: bytes, n: int, block: int = COUNT_BLOCK) -> int:
    """Index of the ``n``-th newline (``n`` >= 1) in ``data``, -1 if it has fewer. Newlines are
    counted a block at a time and the block holding it halved down: C-speed passes over the
    bytes, no object per line."""
    lo, end = 0, len(data)
    while True:
        if lo >= end:
            return -1
        hi = min(lo + block, end)
        found = data.count(b"\n", lo, hi)
        if found >= n:
            break
        n -= found
        lo = hi
    while hi - lo > 64:
        mid = (lo + hi) // 2
        found = data.count(b"\n", lo, mid)
        if found >= n:
            hi = mid
        else:
            n -= found
            lo = mid
    at = lo - 1
    for _ in range(n):
        at = data.find(b"\n", at + 1, hi)
    return at


def line_offset(data: bytes, line: int) -> int:
    """Where line ``line`` (1-based, at most the file's lines) starts in ``data``."""
    return 0 if line <= 1 else nth_newline(data, line - 1) + 1


def numbered(data: bytes, at: int, first: int, last: int, budget: int, complete: bool = True) -> tuple[str, int, bool]:
    """Lines ``first``..``last`` (1-based, inclusive; line ``first`` starts at ``data[at]``) as
    ``cat -n`` text, at most ``budget`` bytes of it; returns (text, the last line included,
    whether that line was cut). ``complete``: ``data`` runs to the end of the file (else a
    line running past its end is not all there). A first line longer than ``budget`` is shown
    cut to its first ``budget`` bytes (a 16 MiB line is not a 16 MiB reply); a later line
    that does not fit ends the text."""
    out: list[str] = []
    used = 0
    shown = first - 1
    for n in range(first, last + 1):
        if at >= len(data):
            break  # the file changed between counting and reading (a view)
        newline = data.find(b"\n", at)
        end = newline if newline >= 0 else len(data)
        if end - at >= budget or (newline < 0 and not complete):
            if out:
                break  # more than what is left of the budget
            cut = codecs.getincrementaldecoder("utf-8")("replace").decode(data[at : at + budget])
            return f"{n:6d}\t{cut}\n", n, True
        text = f"{n:6d}\t" + data[at:end].decode("utf-8", "replace") + "\n"
        cost = len(text.encode())
        if used + cost > budget and out:
            break
        out.append(text)
        used += cost
        shown = n
        at = end + 1
    return "".join(out), shown, False


def snippet(data: bytes, first: int, last: int) -> tuple[str, int]:
    """The changed lines ``first``..``last`` of the new content with context, numbered."""
    total = count_lines(data)
    if not total:
        return "", 1
    a = max(1, first - SNIPPET_LINES)
    b = min(total, max(first, last) + SNIPPET_LINES)
    if a > b:
        return "", a
    text, _, _ = numbered(data, line_offset(data, a), a, b, MAX_VIEW_BYTES)
    return text, a


def view_scan(fd: int, first: int, keep: int = MAX_VIEW_BYTES, chunk_size: int = READ_CHUNK) -> tuple[int, bytes, bool]:
    """One pass over a file for a view, ``chunk_size`` bytes at a time (at most
    ``MAX_EDIT_BYTES`` + 1 of them): its line count, the ``keep`` bytes from the start of line
    ``first`` (all a view of a ``keep``-byte budget can show), and whether those run to the end
    of the file."""
    newlines = offset = 0
    last_byte = b""
    window = bytearray()
    window_at = -1  # file offset where line ``first`` starts, once known
    while offset <= MAX_EDIT_BYTES:
        chunk = os.pread(fd, min(chunk_size, MAX_EDIT_BYTES + 1 - offset), offset)
        if not chunk:
            break
        if window_at < 0:
            need = first - 1 - newlines  # newlines before line ``first`` still to pass
            newline = nth_newline(chunk, need) if need else -1
            if not need or newline >= 0:
                window_at = offset + newline + 1
        if window_at >= 0 and len(window) < keep:
            start = max(0, window_at - offset)
            window += chunk[start : start + keep - len(window)]
        newlines += chunk.count(b"\n")
        last_byte = chunk[-1:]
        offset += len(chunk)
    total = newlines + (1 if offset and last_byte != b"\n" else 0)
    return total, bytes(window), window_at >= 0 and window_at + len(window) == offset


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
        first = start_line or 1
        fd = self.fsys.open_file(path)
        try:
            size = os.fstat(fd).st_size
            if size > MAX_EDIT_BYTES:
                raise too_large("max_edit_bytes", size, f"{path} is larger than {MAX_EDIT_BYTES} bytes")
            total, window, complete = view_scan(fd, first)
        finally:
            os.close(fd)
        last = total if end_line is None else min(end_line, total)
        if total and (first > total or last < first):
            raise GuestdError(
                ErrorCode.BAD_REQUEST,
                f"lines {first}:{last} are outside the file's {total} lines",
                details={"field": "start_line", "total_lines": total},
            )
        text, shown, cut = numbered(window, 0, first, last, MAX_VIEW_BYTES, complete) if total else ("", 0, False)
        return {
            "kind": "file",
            "content": text,
            "start_line": first if total else 0,
            "end_line": shown,
            "total_lines": total,
            "truncated": shown < last or cut,
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
            matches = data.count(needle)  # non-overlapping, as the replace would find them
            if matches != 1:
                lines: list[int] = []  # of the first MAX_MATCH_LINES, counted on from one to the next
                line, counted_to = 1, 0
                at = data.find(needle)
                while at >= 0 and len(lines) < MAX_MATCH_LINES:
                    line += data.count(b"\n", counted_to, at)
                    counted_to = at
                    lines.append(line)
                    at = data.find(needle, at + len(needle))
                reason = "no_match" if not matches else "multiple_matches"
                what = "does not occur" if not matches else f"occurs {matches} times (lines {lines})"
                raise GuestdError(
                    ErrorCode.CONFLICT,
                    f"the old text {what} in {path}; it must occur exactly once",
                    details={"path": path, "reason": reason, "matches": matches, "lines": lines},
                )
            at = data.find(needle)
            first = data.count(b"\n", 0, at) + 1
            return _spliced(data, at, at + len(needle), repl), first, first + repl.count(b"\n")

        return self._edit(path, change)

    def insert(self, path: str, line: int, text: str) -> FileEditReply:
        body = whole_lines(text.encode())

        def change(data: bytes) -> tuple[bytes, int, int]:
            total = count_lines(data)
            if line > total:
                raise _outside(path, "line", line, total)
            if line == total:
                ending = b"" if not data or data.endswith(b"\n") else b"\n"
                return b"".join((data, ending, body)), line + 1, line + max(1, body.count(b"\n"))
            at = line_offset(data, line + 1)
            return _spliced(data, at, at, body), line + 1, line + max(1, body.count(b"\n"))

        return self._edit(path, change)

    def replace_lines(self, path: str, start_line: int, end_line: int, text: str) -> FileEditReply:
        body = whole_lines(text.encode())

        def change(data: bytes) -> tuple[bytes, int, int]:
            total = count_lines(data)
            if start_line > total or end_line < start_line or end_line > total:
                raise _outside(path, "end_line" if start_line <= total else "start_line", end_line, total)
            a = line_offset(data, start_line)
            b = line_offset(data, end_line + 1) if end_line < total else len(data)
            # the last line had no newline: neither has its replacement
            last_unterminated = b == len(data) and not data.endswith(b"\n") and body != b""
            body_here = body[:-1] if last_unterminated else body
            return _spliced(data, a, b, body_here), start_line, start_line + max(0, body.count(b"\n") - 1)

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


def _spliced(data: bytes, start: int, end: int, insert: bytes) -> bytes:
    """``data`` with ``data[start:end]`` replaced by ``insert``, built in one allocation (a
    chain of slices and + holds up to three file-sized copies at once)."""
    with memoryview(data) as view:
        return b"".join((view[:start], insert, view[end:]))


def _changed_lines(a: bytes, b: bytes) -> tuple[int, int]:
    """First and last line of ``b`` that differ from ``a`` (for an undo's snippet)."""
    i = _common_prefix(a, b)
    j = _common_suffix(a, b, min(len(a), len(b)) - i)
    first = b.count(b"\n", 0, i) + 1
    last = max(first, b.count(b"\n", 0, max(i, len(b) - j)) + 1)
    return first, last


def _common_prefix(a: bytes, b: bytes) -> int:
    """Length of the longest common prefix: compared a block at a time, then halved within the
    first block that differs (slices of at most a block, never of the whole file)."""
    n = min(len(a), len(b))
    lo = 0
    while lo < n:
        hi = min(lo + COUNT_BLOCK, n)
        if a[lo:hi] != b[lo:hi]:
            while hi - lo > 1:  # a[:lo] == b[:lo], a[lo:hi] != b[lo:hi]
                mid = (lo + hi) // 2
                if a[lo:mid] == b[lo:mid]:
                    lo = mid
                else:
                    hi = mid
            return lo
        lo = hi
    return n


def _common_suffix(a: bytes, b: bytes, limit: int) -> int:
    """Length of the longest common suffix, at most ``limit`` (as :func:`_common_prefix`)."""
    la, lb = len(a), len(b)
    lo = 0
    while lo < limit:
        hi = min(lo + COUNT_BLOCK, limit)
        if a[la - hi : la - lo] != b[lb - hi : lb - lo]:
            while hi - lo > 1:  # the last lo bytes agree, the last hi do not
                mid = (lo + hi) // 2
                if a[la - mid : la - lo] == b[lb - mid : lb - lo]:
                    lo = mid
                else:
                    hi = mid
            return lo
        lo = hi
    return limit


def _outside(path: str, field: str, value: int, total: int) -> GuestdError:
    return GuestdError(
        ErrorCode.BAD_REQUEST,
        f"{field} {value} is outside {path}'s {total} lines",
        details={"field": field, "total_lines": total},
    )
