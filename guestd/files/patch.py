"""``file.apply_patch``: a unified diff across files, all or nothing (issue 18).

Every file is read through the file-system layer (``edit.read_at``: a regular file at a name
resolved under the write roots, never a symlink's target), every hunk is placed on the bytes in
memory, and only when every hunk of every file fits is anything written: each new content goes
to its temp file (``AtomicFile``), then all are renamed into place, then deletions are done.
A hunk fits at its stated line (shifted by the hunks before it) or, failing that, where its
old lines occur exactly once after the previous hunk; otherwise it is reported
(``conflict``, ``details.hunks``: file, hunk number, line, reason) and nothing changes.
Names are relative to the patch's directory: absolute names and ``..`` are ``bad_request``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from guestd.files.edit import MAX_EDIT_BYTES, read_at, same_file
from guestd.files.fs import FileSystem, Place
from guestd.files.handlers import AtomicFile
from guestd.wire.errors import ErrorCode, GuestdError, too_large

if TYPE_CHECKING:
    from guestd.wire.types import PatchedFileRecord

MAX_PATCH_FILES = 256  # files one patch may touch (each holds two fds until the commit)
MAX_REPORTED = 100  # failed hunks listed in the conflict's details
_HUNK = re.compile(rb"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


@dataclass
class Hunk:
    old_start: int
    new_start: int
    old: list[bytes] = field(default_factory=list)  # lines with their newlines
    new: list[bytes] = field(default_factory=list)


@dataclass
class FilePatch:
    old_name: bytes | None  # None: /dev/null (a new file)
    new_name: bytes | None  # None: /dev/null (a deleted file)
    hunks: list[Hunk] = field(default_factory=list)

    @property
    def creates(self) -> bool:
        """From /dev/null, or (diff -N) every hunk adds to an empty file: ``-0,0``."""
        return self.old_name is None or all(h.old_start == 0 and not h.old for h in self.hunks)

    @property
    def deletes(self) -> bool:
        """To /dev/null, or (diff -N) every hunk leaves an empty file: ``+0,0``."""
        return self.new_name is None or all(h.new_start == 0 and not h.new for h in self.hunks)


def _bad(message: str) -> GuestdError:
    return GuestdError(ErrorCode.BAD_REQUEST, message, details={"field": "patch"})


def _name(raw: bytes, strip: int) -> bytes | None:
    raw = raw.split(b"\t")[0].rstrip(b"\r")
    if raw == b"/dev/null":
        return None
    if raw.startswith(b'"'):
        raise _bad(f"quoted file names are not supported: {raw!r}")
    parts = [p for p in raw.split(b"/") if p]
    if raw.startswith(b"/") and strip == 0:
        raise _bad(f"absolute file name in the patch: {raw!r}")
    parts = parts[strip:]
    if not parts or b".." in parts:
        raise _bad(f"file name {raw!r} leaves the patch's directory or is empty after strip {strip}")
    return b"/".join(p for p in parts if p != b".")


def parse(patch: bytes, strip: int) -> list[FilePatch]:
    files: list[FilePatch] = []
    lines = patch.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith(b"--- ") and i + 1 < len(lines) and lines[i + 1].startswith(b"+++ "):
            old = _name(line[4:].rstrip(b"\n"), strip)
            new = _name(lines[i + 1][4:].rstrip(b"\n"), strip)
            if old is None and new is None:
                raise _bad("a file patch from /dev/null to /dev/null")
            files.append(FilePatch(old, new))
            i += 2
            continue
        m = _HUNK.match(line)
        if m:
            if not files:
                raise _bad("a hunk before any file header")
            old_len = int(m.group(2)) if m.group(2) is not None else 1
            new_len = int(m.group(4)) if m.group(4) is not None else 1
            hunk = Hunk(int(m.group(1)), int(m.group(3)))
            i += 1
            seen_old = seen_new = 0
            last = b""  # the tag of the previous line, for a "\ No newline at end of file"
            while i < len(lines) and (seen_old < old_len or seen_new < new_len or lines[i].startswith(b"\\")):
                body = lines[i]
                tag, text = body[:1], body[1:]
                i += 1
                if tag == b"\\":  # the line before has no newline
                    sides = {b" ": (hunk.old, hunk.new), b"-": (hunk.old,), b"+": (hunk.new,)}.get(last, ())
                    for side in sides:
                        side[-1] = side[-1].removesuffix(b"\n").removesuffix(b"\r")
                    continue
                if body in (b"\n", b"\r\n"):  # an empty context line whose space was stripped
                    tag, text = b" ", body
                if tag == b" ":
                    hunk.old.append(text)
                    hunk.new.append(text)
                    seen_old += 1
                    seen_new += 1
                elif tag == b"-":
                    hunk.old.append(text)
                    seen_old += 1
                elif tag == b"+":
                    hunk.new.append(text)
                    seen_new += 1
                else:
                    raise _bad(f"unexpected line in a hunk: {body[:80]!r}")
                last = tag
            if seen_old != old_len or seen_new != new_len:
                raise _bad(f"hunk at -{hunk.old_start} is shorter than its header says")
            files[-1].hunks.append(hunk)
            continue
        i += 1
    if not files:
        raise _bad("no file patches found (expected --- / +++ headers)")
    if len(files) > MAX_PATCH_FILES:
        raise GuestdError(
            ErrorCode.LIMIT,
            f"the patch touches more than {MAX_PATCH_FILES} files",
            details={"limit": "max_patch_files", "value": MAX_PATCH_FILES},
        )
    return files


def _find(lines: list[bytes], old: list[bytes], want: int, after: int) -> tuple[int | None, str]:
    n = len(old)
    if 0 <= want <= len(lines) - n and lines[want : want + n] == old and want >= after:
        return want, ""
    hits = [k for k in range(after, len(lines) - n + 1) if lines[k : k + n] == old]
    if len(hits) == 1:
        return hits[0], ""
    return None, "context_mismatch" if not hits else "ambiguous"


def apply(fsys: FileSystem, base: str, patch: bytes, strip: int) -> list[PatchedFileRecord]:
    files = parse(patch, strip)
    plans: list[tuple[FilePatch, Place, bytes | None, os.stat_result | None]] = []
    failed: list[dict[str, object]] = []
    try:
        for fp in files:
            name = fp.new_name if fp.new_name is not None else fp.old_name
            assert name is not None
            place = fsys.place(os.path.join(base, os.fsdecode(name)), parents=fp.creates)
            try:
                if fp.creates:
                    old, info = b"", None
                    try:
                        os.stat(place.name, dir_fd=place.dirfd, follow_symlinks=False)
                        raise GuestdError(
                            ErrorCode.EXISTS,
                            f"the patch creates {place.path}, which exists",
                            details={"path": place.path},
                        )
                    except FileNotFoundError:
                        pass
                else:
                    old, info = read_at(place)
            except BaseException:
                place.close()
                raise
            lines = old.splitlines(keepends=True)
            delta = 0
            after = 0
            for k, h in enumerate(fp.hunks, 1):
                want = (h.old_start - 1 if h.old else h.old_start) + delta
                at, why = _find(lines, h.old, max(0, want), after)
                if at is None:
                    if len(failed) < MAX_REPORTED:
                        failed.append({"path": os.fsdecode(name), "hunk": k, "line": h.old_start, "reason": why})
                    continue
                lines[at : at + len(h.old)] = h.new
                delta += len(h.new) - len(h.old)
                after = at + len(h.new)
            new = None if fp.deletes and not any(lines) else b"".join(lines)
            if new is not None and len(new) > MAX_EDIT_BYTES:
                place.close()
                raise too_large("max_edit_bytes", len(new), f"the patch makes {place.path} too large")
            plans.append((fp, place, new, info))
        if failed:
            raise GuestdError(
                ErrorCode.CONFLICT,
                f"{len(failed)} hunk(s) do not apply; nothing was changed",
                details={"reason": "hunks_failed", "hunks": failed},
            )
        return _write(fsys, plans)
    finally:
        for _, place, _, _ in plans:
            place.close()


def _write(
    fsys: FileSystem, plans: list[tuple[FilePatch, Place, bytes | None, os.stat_result | None]]
) -> list[PatchedFileRecord]:
    prepared: list[tuple[AtomicFile, os.stat_result | None]] = []
    deletes: list[tuple[Place, os.stat_result]] = []
    out: list[PatchedFileRecord] = []
    try:
        for fp, place, new, info in plans:
            name = fp.new_name if fp.new_name is not None else fp.old_name
            assert name is not None
            if new is None:
                assert info is not None
                deletes.append((place, info))
                out.append({"path": os.fsdecode(name), "action": "delete", "hunks": len(fp.hunks)})
                continue
            dup = Place(os.dup(place.dirfd), place.name, place.path, place.owner)
            f = AtomicFile(dup, "overwrite" if info is not None else "create", None, fsys.pending)
            prepared.append((f, info))
            f.write(new)
            if info is None:
                out.append({"path": os.fsdecode(name), "action": "create", "hunks": len(fp.hunks)})
            else:
                out.append({"path": os.fsdecode(name), "action": "modify", "hunks": len(fp.hunks)})
        for f, info in prepared:  # changed since it was read: conflict, before anything moves
            if info is not None:
                now = os.stat(f.place.name, dir_fd=f.place.dirfd, follow_symlinks=False)
                if not same_file(now, info):
                    raise GuestdError(
                        ErrorCode.CONFLICT,
                        f"{f.path} changed while the patch was applied; nothing was changed",
                        details={"path": f.path, "reason": "changed_during_edit"},
                    )
        while prepared:
            prepared[0][0].commit()
            prepared.pop(0)
        for place, _ in deletes:
            os.unlink(place.name, dir_fd=place.dirfd)
        return out
    finally:
        for f, _ in prepared:
            f.abort()
