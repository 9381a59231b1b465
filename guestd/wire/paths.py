"""Paths and file names on the wire: lossless in both directions.

Linux names are bytes, and not every name is valid UTF-8 (b"bad\\xff" is a legal file
name). msgpack str must be UTF-8, so the protocol has a ``path`` type: a str when the
name is valid UTF-8, a bin (the raw bytes) otherwise. Receivers accept either form in
every path field.

Inside guestd a path is an "os str": what ``os.fsdecode`` makes of the bytes (a name
that is not UTF-8 carries surrogate escapes), which every ``os`` call turns back into
the same bytes. The two functions here are the only crossings between the forms.
"""

from __future__ import annotations

import os

WirePath = str | bytes


def path_from_wire(value: WirePath) -> str:
    """A path field of a request (str or bin) as the os str that names the same bytes."""
    return os.fsdecode(value) if isinstance(value, bytes) else value


def path_to_wire(path: WirePath) -> WirePath:
    """A path for a reply or request: str when its bytes are valid UTF-8, else the bytes.

    Accepts os strs (surrogate escapes from ``os.listdir``, ``os.fsdecode``, sys.argv) and bytes.
    """
    if isinstance(path, str):
        try:
            path.encode("utf-8")  # strict: fails exactly on surrogate escapes
            return path
        except UnicodeEncodeError:
            path = os.fsencode(path)
    try:
        return path.decode("utf-8")
    except UnicodeDecodeError:
        return path


def printable_path(path: WirePath) -> str:
    """A path for human-readable text: bytes that are not UTF-8 shown as ``\\xff`` escapes."""
    raw = os.fsencode(path)
    return raw.decode("utf-8", "backslashreplace")
