"""Output shaping for models (exec / shell.run ``strip_ansi``, ``collapse_cr``).

Applied to the bytes a reply returns, never to what is counted: ``*_bytes`` and
``*_dropped`` stay exact on the raw stream, spill files and rings hold raw bytes. The kept
head and tail are shaped apart (the gap between them stays where it was, ``gap_at`` is its
offset in the shaped bytes); an escape sequence or a line cut by the gap is shaped as far
as it is there.

The workload writes these bytes, so shaping is linear in them and holds O(window) Python
objects whatever their shape (the old ``collapse_cr`` rebuilt the whole line for
every ``\\r`` segment, 22-29 s for one 1 MiB line of redraws). ``capture.shaped_fields``
runs it off the event loop when there is more than a little of it.
"""

from __future__ import annotations

import re

# CSI (colours, cursor moves, erase), OSC (titles, hyperlinks: up to BEL or ST), charset
# designations, and the other two-byte escapes. Every match starts at an ESC and an attempt
# reads only up to the next byte outside its classes, never past another ESC but an OSC's
# terminator: attempts read disjoint runs, so a sub is linear in the bytes. The runs are
# possessive (*+): a CSI's classes are disjoint, so giving bytes back can never make a match,
# and not trying saves the backtracking (an unterminated 1 MiB CSI: 42 ms -> 2 ms).
ANSI = re.compile(
    rb"\x1b\[[0-?]*+[ -/]*+[@-~]"
    rb"|\x1b\][^\x07\x1b]*+(?:\x07|\x1b\\)?"
    rb"|\x1b[()*+][0-9A-Za-z]"
    rb"|\x1b[@-Z\\-_=>78]"
)

# Lines are taken in blocks of about this many bytes: one split of a block bounds the
# Python objects held at a time (a longer line is a block of its own).
BLOCK = 1 << 16
# A line with up to this many \r is redrawn segment by segment, one with more by
# _redrawn_long (fewer steps, each dearer).
FEW_REDRAWS = 64
# strip_ansi substitutes in pieces of about this size, so a thread doing it lets go of the
# GIL between pieces (one re.sub holds it throughout: about 30 ms a MiB).
ANSI_PIECE = 1 << 16
# Every byte but \r as "a": a run of n "a"s in a line's mask is a segment at least n long.
_MASK = bytes(b if b == 13 else 97 for b in range(256))


def collapse_cr(data: bytes, block: int = BLOCK) -> bytes:
    """Each line as a terminal would leave it after its ``\\r`` redraws: what follows a
    carriage return overwrites the line from column 0 (``10%\\r20%\\r30%`` is ``30%``); a
    ``\\r`` right before ``\\n`` (a terminal's line end) is dropped.

    Linear in the bytes: blocks without a ``\\r`` are copied as they are, each line with one
    is rebuilt in time linear in its length (:func:`_redrawn`)."""
    if b"\r" not in data:
        return data
    # A \r right before \n overwrites nothing: dropping it first keeps CRLF output (one
    # \r per line) off the per-line path.
    data = data.replace(b"\r\n", b"\n")
    if b"\r" not in data:
        return data
    out = []
    start = 0
    while start < len(data):
        stop = data.find(b"\n", start + block) + 1 or len(data)  # a block ends after a \n
        piece = data[start:stop]
        if b"\r" in piece:
            lines = piece.split(b"\n")
            piece = b"\n".join([_redrawn(line) if b"\r" in line else line for line in lines])
        out.append(piece)
        start = stop
    return b"".join(out)


def _redrawn(line: bytes) -> bytes:
    """A line (no ``\\n`` in it) after its redraws.

    Column ``c`` shows the last segment longer than ``c``. Going back from the last segment,
    only a segment wider than every later one shows anything (its columns from the widest
    later width to its own), so the line is those pieces in that order."""
    if line.count(b"\r") > FEW_REDRAWS:
        return _redrawn_long(line)
    segments = line.split(b"\r")
    shown = segments[-1]
    for segment in reversed(segments):
        if len(segment) > len(shown):
            shown += segment[len(shown) :]
    return shown


def _redrawn_long(line: bytes) -> bytes:
    """:func:`_redrawn` without a step per segment: the segments that show anything have
    widths adding up to at most the line's length, so there are at most sqrt(2 x length) of
    them. Each is found in the line's mask, reversed, by a forward ``bytes.find`` of one
    "a" more than the width shown so far: the first hit starts at the next segment (going
    back) that is wider, since no narrower one holds the run. A forward find is linear
    (CPython's two-way search); an ``rfind`` of a long needle is not (measured: 0.4 ms
    against 3.7 s for a 50,000-byte needle over 1 MiB)."""
    backwards = line.translate(_MASK)[::-1]
    size = len(line)
    find = backwards.find
    cr = find(b"\r")
    covered = size if cr < 0 else cr  # the last segment shows whole
    pieces = [line[size - covered :]]
    while cr >= 0:
        hit = find(b"a" * (covered + 1), cr + 1)
        if hit < 0:
            break
        cr = find(b"\r", hit)
        width = (size if cr < 0 else cr) - hit
        start = size - hit - width  # where that segment starts in the line
        pieces.append(line[start + covered : start + width])
        covered = width
    return b"".join(pieces)


def strip_ansi(data: bytes, piece: int = ANSI_PIECE) -> bytes:
    """``data`` without its escape sequences (:data:`ANSI`), substituted a piece at a time,
    each cut where no sequence spans the cut (:func:`_ansi_cut`), so the pieces' matches are
    the whole's."""
    if b"\x1b" not in data:
        return data
    out = []
    start = 0
    while start < len(data):
        stop = _ansi_cut(data, start, piece)
        out.append(ANSI.sub(b"", data[start:stop]))
        start = stop
    return b"".join(out)


def _ansi_cut(data: bytes, start: int, piece: int) -> int:
    """An ESC at least ``piece`` bytes after ``start`` that no sequence runs across (or the
    end). A sequence holds an ESC after its first byte only as an OSC's ``ESC \\``
    terminator, so an ESC not followed by ``\\`` is such a cut, and so is one that is but
    closes no OSC: the last ESC before it (no BEL between) does not open one. At most two
    tries: past an OSC's terminator, the next ESC is preceded by that terminator's ESC."""
    cut = data.find(b"\x1b", start + max(1, piece))  # past start: every piece holds a byte
    while cut >= 0 and data[cut + 1 : cut + 2] == b"\\":
        opener = data.rfind(b"\x1b", start, cut)
        if opener < 0 or data[opener + 1 : opener + 2] != b"]" or data.find(b"\x07", opener, cut) >= 0:
            break
        cut = data.find(b"\x1b", cut + 1)
    return cut if cut >= 0 else len(data)


def shape(data: bytes, strip: bool, cr: bool) -> bytes:
    if strip:
        data = strip_ansi(data)
    if cr:
        data = collapse_cr(data)
    return data
