"""Where a patch's hunks go: each at its stated line or, failing that, at the one place after the
previous hunk where its old lines occur, within one scan budget for the whole patch.

Placement scans forward with ``bytes.count`` and ``bytes.find`` (C loops, linear worst case:
CPython's two-way search) in windows of ``_WINDOW`` bytes, looks for a hunk's old lines only at
line starts (the needle is a newline and the old lines) and for at most two places; every byte
looked at, counting lines included, is charged to one budget (``MAX_PLACEMENT_SCAN`` bytes per
patch), and a hunk that would pass it fails with reason ``search_budget``.
"""

from __future__ import annotations

from guestd.files.patchparse import Hunk

MAX_PLACEMENT_SCAN = 256 * 1024 * 1024  # bytes looked at to place the hunks of one patch
_NEWLINE = 0x0A
_WINDOW = 1 << 20  # bytes one find or count looks at (about 1 ms holding the GIL)


class _OutOfBudget(Exception):
    pass


class Scan:
    """Bytes looked at while placing hunks, charged to one budget for the whole patch. Scans go
    in windows of about ``_WINDOW`` bytes: ``bytes.find`` and ``count`` hold the GIL, and a
    16 MiB scan in one call would hold it (and every other request) for 15-60 ms."""

    def __init__(self, budget: int) -> None:
        self.left = budget

    def take(self, nbytes: int) -> None:
        if nbytes > self.left:
            self.left = 0
            raise _OutOfBudget
        self.left -= nbytes

    def find(self, data: bytes, needle: bytes, start: int) -> int:
        """``data.find(needle, start)`` within what is left of the budget."""
        end = min(len(data), start + self.left + len(needle))
        step = max(_WINDOW, len(needle))  # windows overlap by len(needle) - 1: no match is cut
        pos = start
        while True:
            stop = min(end, pos + step + len(needle) - 1)
            at = data.find(needle, pos, stop)
            if at >= 0 or stop >= end:
                break
            pos += step
        self.left -= min(self.left, (end if at < 0 else at + len(needle)) - start)
        if at < 0 and end < len(data):
            raise _OutOfBudget
        return at

    def newlines(self, data: bytes, start: int, stop: int) -> int:
        self.take(stop - start)
        return sum(data.count(b"\n", pos, min(stop, pos + _WINDOW)) for pos in range(start, stop, _WINDOW))


def _line_offset(data: bytes, off: int, count: int, scan: Scan) -> int | None:
    """The offset of the line ``count`` lines after the line starting at ``off``, or None past
    the end (``len(data)`` is the place after the last line). A few lines on: one ``find`` each;
    further: newlines counted in doubling windows, then the window halved down to the line."""
    end = len(data)
    if count <= 16:
        for _ in range(count):
            if off >= end:
                return None
            nl = scan.find(data, b"\n", off)
            off = end if nl < 0 else nl + 1
        return off
    lo, need, step = off, count, 64
    while True:
        hi = min(end, lo + step)
        found = scan.newlines(data, lo, hi)
        if found >= need:
            break
        need -= found
        if hi >= end:  # out of newlines: a last line without one is one more line
            return end if need == 1 and off < end and not data.endswith(b"\n") else None
        lo, step = hi, min(step * 2, _WINDOW)
    while hi - lo > 1:  # [lo, hi) holds the need-th newline from lo
        mid = (lo + hi) // 2
        found = scan.newlines(data, lo, mid)
        if found >= need:
            hi = mid
        else:
            need -= found
            lo = mid
    return hi


def _fits(data: bytes, hunk: Hunk, off: int, scan: Scan) -> bool:
    scan.take(len(hunk.old))
    if not data.startswith(hunk.old, off):
        return False
    # old lines whose last has no newline end the file
    return not hunk.old or hunk.old.endswith(b"\n") or off + len(hunk.old) == len(data)


def _search(data: bytes, hunk: Hunk, after_line: int, after_off: int, scan: Scan) -> tuple[int, int] | str:
    """(line, offset) of the one place at or after the previous hunk's end where the hunk's old
    lines are, or why there is none. Only line starts count: the needle is a newline and the
    old lines (the first line of the range is checked on its own), and at most two are found."""
    old = hunk.old
    if not old:  # an insertion fits between any two lines: the end is the only single place
        return (after_line, after_off) if after_off == len(data) else "ambiguous"
    if not old.endswith(b"\n"):  # its last line has no newline: it can only end the file
        at = len(data) - len(old)
        scan.take(len(old))
        if at >= after_off and (at == 0 or data[at - 1] == _NEWLINE) and data.endswith(old):
            return after_line + scan.newlines(data, after_off, at), at
        return "context_mismatch"
    hits: list[int] = []
    scan.take(len(old))
    if data.startswith(old, after_off):
        hits.append(after_off)
    needle = b"\n" + old
    pos = after_off
    while len(hits) < 2:
        nl = scan.find(data, needle, pos)
        if nl < 0:
            break
        hits.append(nl + 1)
        pos = nl + 1
    if not hits:
        return "context_mismatch"
    if len(hits) > 1:
        return "ambiguous"
    return after_line + scan.newlines(data, after_off, hits[0]), hits[0]


def apply_hunks(data: bytes, hunks: list[Hunk], scan: Scan) -> tuple[bytes, list[tuple[int, str]]]:
    """``data`` with the hunks placed in order (none before the end of the one before), and
    the hunks that did not fit: (index, reason)."""
    view = memoryview(data)
    pieces: list[bytes | memoryview] = []
    failed: list[tuple[int, str]] = []
    after_line = after_off = 0  # where the previous hunk's old lines end
    far_line = far_off = 0  # the furthest line whose offset is known (lines are found going forward)
    for index, hunk in enumerate(hunks):
        at: tuple[int, int] | str | None = None
        try:
            want = max(0, hunk.old_start - 1 if hunk.old_lines else hunk.old_start)
            if want >= after_line:
                base_line, base_off = (far_line, far_off) if after_line <= far_line <= want else (after_line, after_off)
                off = _line_offset(data, base_off, want - base_line, scan)
                if off is not None:
                    far_line, far_off = want, off
                    if _fits(data, hunk, off, scan):
                        at = (want, off)
            if at is None:
                at = _search(data, hunk, after_line, after_off, scan)
        except _OutOfBudget:
            at = "search_budget"
        if isinstance(at, str):
            failed.append((index, at))
            continue
        line, off = at
        pieces.append(view[after_off:off])
        pieces.append(hunk.new)
        after_line, after_off = line + hunk.old_lines, off + len(hunk.old)
    pieces.append(view[after_off:])
    return b"".join(pieces), failed
