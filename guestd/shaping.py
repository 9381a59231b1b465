"""Output shaping for models (exec / shell.run ``strip_ansi``, ``collapse_cr``).

Applied to the bytes a reply returns, never to what is counted: ``*_bytes`` and
``*_dropped`` stay exact on the raw stream, spill files and rings hold raw bytes. The kept
head and tail are shaped apart (the gap between them stays where it was, ``gap_at`` is its
offset in the shaped bytes); an escape sequence or a line cut by the gap is shaped as far
as it is there.
"""

from __future__ import annotations

import re

# CSI (colours, cursor moves, erase), OSC (titles, hyperlinks: up to BEL or ST), charset
# designations, and the other two-byte escapes.
ANSI = re.compile(
    rb"\x1b\[[0-?]*[ -/]*[@-~]"
    rb"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?"
    rb"|\x1b[()*+][0-9A-Za-z]"
    rb"|\x1b[@-Z\\-_=>78]"
)


def collapse_cr(data: bytes) -> bytes:
    """Each line as a terminal would leave it after its ``\\r`` redraws: what follows a
    carriage return overwrites the line from column 0 (``10%\\r20%\\r30%`` is ``30%``); a
    ``\\r`` right before ``\\n`` (a terminal's line end) is dropped."""
    if b"\r" not in data:
        return data
    out = []
    for line in data.split(b"\n"):
        if b"\r" in line:
            parts = line.split(b"\r")
            shown = parts[0]
            for seg in parts[1:]:
                shown = seg + shown[len(seg) :]
            line = shown
        out.append(line)
    return b"\n".join(out)


def shape(data: bytes, strip_ansi: bool, cr: bool) -> bytes:
    if strip_ansi and b"\x1b" in data:
        data = ANSI.sub(b"", data)
    if cr:
        data = collapse_cr(data)
    return data
