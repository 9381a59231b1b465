"""Sections of bench/RESULTS.md that a bench other than bench/run.py owns.

A section is the text between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->``. Its bench replaces
it in place (``write_section``); bench/run.py, which writes the rest of the file anew, carries every
such section of the old file over (``carry_sections``), so that no bench's run erases another's.
"""

from __future__ import annotations

import os
import re

_SECTION = re.compile(r"<!-- ([\w.-]+):begin -->.*?<!-- \1:end -->\n?", re.DOTALL)


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def replace_section(old: str, name: str, section: str) -> str:
    """``old`` with its section ``name`` replaced by ``section`` (which carries its markers), or
    with ``section`` appended when there is none."""
    begin, end = markers(name)
    if begin in old and end in old:
        head, rest = old.split(begin, 1)
        tail = rest.split(end, 1)[1].lstrip("\n")
        return head + section.rstrip("\n") + "\n" + ("\n" + tail if tail else "")
    return old.rstrip("\n") + "\n\n" + section.rstrip("\n") + "\n"


def carry_sections(old: str, new: str) -> str:
    """``new`` with every section of ``old`` that ``new`` lacks appended, as it was."""
    for m in _SECTION.finditer(old):
        if markers(m.group(1))[0] not in new:
            new = new.rstrip("\n") + "\n\n" + m.group(0).rstrip("\n") + "\n"
    return new


def write_section(path: str, name: str, section: str) -> None:
    """Replace (or append) the section ``name`` of the file at ``path``, atomically."""
    try:
        with open(path) as f:
            old = f.read()
    except OSError:
        old = "# guestd benchmark results\n"
    tmp = f"{path}.{name}-tmp"
    with open(tmp, "w") as f:
        f.write(replace_section(old, name, section))
    os.replace(tmp, path)
