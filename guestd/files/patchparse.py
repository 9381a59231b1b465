"""The parser of ``file.apply_patch``: a unified diff read into file sections and their hunks in
one pass over the bytes (``find`` and slices, no regex; a hunk header's numbers at most 9 digits;
at most ``MAX_PATCH_FILES`` sections), then planned per file (``plan``): a name given more than
once is one file whose sections apply in order, and a sequence that cannot (a file created twice,
deleted twice, changed after its deletion) is ``bad_request`` naming the file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from guestd.wire.errors import ErrorCode, GuestdError

MAX_PATCH_FILES = 256  # file sections one patch may hold (each staged file holds a directory fd)
_MAX_DIGITS = 9  # a hunk header's numbers: a 16 MiB file has fewer lines than 10**9


@dataclass(frozen=True, slots=True)
class Hunk:
    old_start: int  # as the header says (1-based; 0 for an insertion at the top)
    new_start: int
    old: bytes  # the old lines joined, each with its newline (but a last one without)
    new: bytes
    old_lines: int
    new_lines: int


@dataclass(slots=True)
class Section:
    """One ``---``/``+++`` header and its hunks."""

    old_name: bytes | None  # None: /dev/null (a new file)
    new_name: bytes | None  # None: /dev/null (a deleted file)
    hunks: list[Hunk] = field(default_factory=list)

    @property
    def name(self) -> bytes:
        name = self.new_name if self.new_name is not None else self.old_name
        assert name is not None  # parse refuses /dev/null to /dev/null
        return name

    @property
    def creates(self) -> bool:
        """From /dev/null, or (diff -N) every hunk adds to an empty file: ``-0,0``."""
        return self.old_name is None or all(h.old_start == 0 and not h.old_lines for h in self.hunks)

    @property
    def deletes(self) -> bool:
        """To /dev/null, or (diff -N) every hunk leaves an empty file: ``+0,0``."""
        return self.new_name is None or all(h.new_start == 0 and not h.new_lines for h in self.hunks)


def bad_patch(message: str, path: bytes | None = None) -> GuestdError:
    details: dict[str, object] = {"field": "patch"}
    if path is not None:
        details["path"] = os.fsdecode(path)
    return GuestdError(ErrorCode.BAD_REQUEST, message, details=details)


def _line(patch: bytes, pos: int) -> tuple[bytes, int]:
    """The line starting at ``pos`` with its newline, and where the next one starts."""
    nl = patch.find(b"\n", pos)
    end = len(patch) if nl < 0 else nl + 1
    return patch[pos:end], end


def _name(raw: bytes, strip: int) -> bytes | None:
    raw = raw.rstrip(b"\n").split(b"\t")[0].rstrip(b"\r")
    if raw == b"/dev/null":
        return None
    if raw.startswith(b'"'):
        raise bad_patch(f"quoted file names are not supported: {raw[:200]!r}")
    parts = [p for p in raw.split(b"/") if p]
    if raw.startswith(b"/") and strip == 0:
        raise bad_patch(f"absolute file name in the patch: {raw[:200]!r}")
    parts = parts[strip:]
    if not parts or b".." in parts:
        raise bad_patch(f"file name {raw[:200]!r} leaves the patch's directory or is empty after strip {strip}")
    return b"/".join(p for p in parts if p != b".")


def _number(line: bytes, pos: int) -> tuple[int, int]:
    end = pos
    while end < len(line) and end - pos <= _MAX_DIGITS and 0x30 <= line[end] <= 0x39:
        end += 1
    if end == pos or end - pos > _MAX_DIGITS:
        raise bad_patch(f"malformed hunk header: {line[:80]!r}")
    return int(line[pos:end]), end


def _hunk_header(line: bytes) -> tuple[int, int, int, int]:
    """``@@ -a[,b] +c[,d] @@...`` read by hand (no regex, so no backtracking)."""
    old_start, pos = _number(line, 4)
    old_len = 1
    if line[pos : pos + 1] == b",":
        old_len, pos = _number(line, pos + 1)
    if line[pos : pos + 2] != b" +":
        raise bad_patch(f"malformed hunk header: {line[:80]!r}")
    new_start, pos = _number(line, pos + 2)
    new_len = 1
    if line[pos : pos + 1] == b",":
        new_len, pos = _number(line, pos + 1)
    if line[pos : pos + 3] != b" @@":
        raise bad_patch(f"malformed hunk header: {line[:80]!r}")
    return old_start, old_len, new_start, new_len


def _hunk(patch: bytes, header: bytes, pos: int) -> tuple[Hunk, int]:
    """The hunk whose header line is ``header``, its body starting at ``pos``; and where the
    patch goes on after it."""
    old_start, old_len, new_start, new_len = _hunk_header(header)
    old, new = bytearray(), bytearray()
    seen_old = seen_new = 0
    last = b""  # the tag of the previous line, for a "\ No newline at end of file"
    while pos < len(patch) and (seen_old < old_len or seen_new < new_len or patch[pos] == 0x5C):
        body, pos = _line(patch, pos)
        tag, text = body[:1], body[1:]
        if tag == b"\\":  # the line before has no newline
            sides = {b" ": (old, new), b"-": (old,), b"+": (new,)}.get(last, ())
            for side in sides:
                if side.endswith(b"\n"):
                    del side[-1]
                if side.endswith(b"\r"):
                    del side[-1]
            last = b""
            continue
        if body in (b"\n", b"\r\n"):  # an empty context line whose space was stripped
            tag, text = b" ", body
        if tag == b" ":
            old += text
            new += text
            seen_old += 1
            seen_new += 1
        elif tag == b"-":
            old += text
            seen_old += 1
        elif tag == b"+":
            new += text
            seen_new += 1
        else:
            raise bad_patch(f"unexpected line in a hunk: {body[:80]!r}")
        last = tag
    if seen_old != old_len or seen_new != new_len:
        raise bad_patch(f"the hunk at -{old_start} does not have the lines its header counts")
    return Hunk(old_start, new_start, bytes(old), bytes(new), old_len, new_len), pos


def parse(patch: bytes, strip: int) -> list[Section]:
    """The patch's file sections in order, every hunk read; one pass over the bytes."""
    sections: list[Section] = []
    pos = 0
    while pos < len(patch):
        line, after = _line(patch, pos)
        if line.startswith(b"--- ") and after < len(patch):
            second, rest = _line(patch, after)
            if second.startswith(b"+++ "):
                old, new = _name(line[4:], strip), _name(second[4:], strip)
                if old is None and new is None:
                    raise bad_patch("a file patch from /dev/null to /dev/null")
                if len(sections) == MAX_PATCH_FILES:
                    raise GuestdError(
                        ErrorCode.LIMIT,
                        f"the patch touches more than {MAX_PATCH_FILES} files",
                        details={"limit": "max_patch_files", "value": MAX_PATCH_FILES},
                    )
                sections.append(Section(old, new))
                pos = rest
                continue
        if line.startswith(b"@@ -"):
            if not sections:
                raise bad_patch("a hunk before any file header")
            hunk, pos = _hunk(patch, line, after)
            sections[-1].hunks.append(hunk)
            continue
        pos = after  # diff --git, index, mode lines, prose: not the patch's business
    if not sections:
        raise bad_patch("no file patches found (expected --- / +++ headers)")
    for section in sections:
        if not section.hunks:
            raise bad_patch(f"the patch names {os.fsdecode(section.name)} but has no hunk for it", section.name)
    return sections


@dataclass(slots=True)
class Target:
    """One file the patch changes: its sections in patch order."""

    name: bytes
    sections: list[Section]
    existed: bool  # the patch expects it to exist before (its first section creates nothing)


def check_sequence(name: bytes, section: Section, present: bool, previous: Section) -> None:
    """A later section for a file must fit what the earlier ones left: ``present`` or not."""
    shown = os.fsdecode(name)
    if section.creates and present:
        if previous.creates:
            raise bad_patch(f"the patch creates {shown} twice", name)
        raise bad_patch(f"the patch creates {shown}, which it changes in an earlier section", name)
    if not section.creates and not present:
        if section.deletes:
            raise bad_patch(f"the patch deletes {shown} twice", name)
        raise bad_patch(f"the patch changes {shown} after deleting it", name)


def plan(sections: list[Section]) -> list[Target]:
    """The files in order of first mention, their sections merged; a sequence that cannot
    apply is ``bad_request`` before any file is looked at."""
    targets: dict[bytes, Target] = {}
    present: dict[bytes, bool] = {}  # after the sections so far (a deletion assumed to empty it)
    for section in sections:
        name = section.name
        target = targets.get(name)
        if target is None:
            targets[name] = Target(name, [section], not section.creates)
        else:
            check_sequence(name, section, present[name], target.sections[-1])
            target.sections.append(section)
        present[name] = not section.deletes
    return list(targets.values())
