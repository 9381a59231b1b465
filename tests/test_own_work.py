"""What this repository holds is written here: no file carries another project's copyright or
licence text (a framework's suite is downloaded when its test runs: tests/upstream.py)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The marks a copied file carries at its head; written as patterns so this file does not match.
FOREIGN_MARKS = re.compile(
    rb"copy\s*right\s*(\(c\)|\xc2\xa9|\d{4})"
    rb"|permission\s+is\s+hereby\s+granted"
    rb"|licensed\s+under\s+the\s+(apache|mit|bsd)"
    rb"|spdx-licen[s]e-identifier"
    rb"|gnu\s+(lesser\s+)?general\s+public\s+license"
    rb"|redistribution\s+and\s+use\s+in\s+source\s+and\s+binary\s+forms"
    rb"|the\s+software\s+is\s+provided\s+\"?as\s+is",
    re.IGNORECASE,
)
FOREIGN_NAMES = ("LICENSE", "LICENCE", "COPYING", "NOTICE")


def repository_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    return [REPO / name.decode() for name in listed.split(b"\0") if name]


def test_no_file_carries_another_projects_copyright_or_licence() -> None:
    files = [p for p in repository_files() if p.is_file() and not p.is_symlink()]
    assert len(files) > 100  # the listing works
    offenders = []
    for path in files:
        rel = path.relative_to(REPO)
        if rel.name.split(".")[0].upper() in FOREIGN_NAMES or "third_party" in rel.parts:
            offenders.append(f"{rel}: a licence file or a third_party folder")
            continue
        found = FOREIGN_MARKS.search(path.read_bytes())
        if found:
            offenders.append(f"{rel}: {found.group(0)!r}")
    assert offenders == []


def test_the_marks_are_recognised() -> None:
    """The check can fail: each kind of header it looks for is caught."""
    for header in (
        b"# Copy_right (c) 2024 Someone",
        b"Permission is here_by granted, free of charge",
        b"SPDX-License-Identi_fier: MIT",
        b"Licen_sed under the Apache License, Version 2.0",
        b'THE SOFTWARE IS PRO_VIDED "AS IS"',
    ):
        header = header.replace(b"_", b"")  # as written here, this file does not match
        assert FOREIGN_MARKS.search(header), header
