"""``file.apply_patch``: a unified diff across files, all or nothing (issues 18 and 29).

Three phases; nothing the workload can see changes before the third.

1. Parse and validate the whole patch (``parse``, ``plan`` of :mod:`guestd.files.patchparse`).
   A name the patch gives more than once is one file whose sections apply in order, each to the
   result of the one before; a sequence that cannot be (a file created twice, deleted twice,
   changed after its deletion) is ``bad_request`` naming the file.
2. Stage (``_Stager``). Every file is read through the file-system layer (``edit.read_at``: a
   regular file at a name resolved under the write roots, never a symlink's target) and its
   hunks are placed on the bytes in memory (:mod:`guestd.files.patchplace`). A hunk fits at its
   stated line or, failing that, where its old lines occur exactly once after the previous hunk;
   otherwise it is reported (``conflict``, ``details.hunks``: file, hunk number, line, reason)
   and nothing changes. Each new content is written to a temp file beside its target
   (``.NAME.guestd-tmp-*``, recorded first so that the next guestd removes it if this one dies);
   missing parents of a new file are made now and removed again if the patch fails.
3. Commit with rollback (``_Commit``). In patch order: a modified file is exchanged with its
   temp file (``RENAME_EXCHANGE``, one atomic step: the old inode stays under the temp name), a
   new file is renamed into place (``RENAME_NOREPLACE``), a deleted file is renamed aside. A
   step that fails, or that displaces a file other than the one read (``changed_during_edit``),
   undoes the steps before it in reverse: every file is back as it was, the same inode at the
   same name. Only when every step is done are the old inodes unlinked. Residual: guestd killed
   between two steps leaves the earlier files new and the later ones old (the names holding the
   old inodes are temp names, removed by the next guestd's cleanup).

Names are relative to the patch's directory: absolute names and ``..`` are ``bad_request``, and
errors name the file as the patch does.

Bounds (the patch, at most max_frame bytes, comes from the host; the files come from the
workload). Parsing is one pass over the bytes with ``find`` and slices, no regex; a hunk
header's numbers have at most 9 digits; at most 256 file sections. Placement scans forward with
``bytes.count`` and ``bytes.find`` (C loops, linear worst case: CPython's two-way search), looks
for a hunk's old lines only at line starts (the needle is a newline and the old lines) and for
at most two places; every byte looked at, counting lines included, is charged to one budget of
``MAX_PLACEMENT_SCAN`` bytes per patch, and a hunk that would pass it fails with reason
``search_budget`` (so a hostile patch of many hunks that each miss their line costs at most the
budget, about 0.5-1 s of scanning). Memory: the patch, its hunks (about its size), and one
file's old and new bytes at a time (``max_edit_bytes`` each).
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat as st
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from guestd.files.atomic import DEFAULT_PERM, fsync_dirfd
from guestd.files.edit import MAX_EDIT_BYTES, read_at, same_file
from guestd.files.fs import FileSystem, Place, rename_noreplace
from guestd.files.patchparse import Target, bad_patch, check_sequence, parse, plan
from guestd.files.patchplace import MAX_PLACEMENT_SCAN, Scan, apply_hunks
from guestd.files.temps import TEMP_MARK, PendingTemps
from guestd.wire.errors import ErrorCode, GuestdError, too_large

if TYPE_CHECKING:
    from guestd.wire.types import PatchedFileRecord

__all__ = ["MAX_PLACEMENT_SCAN", "apply"]

MAX_REPORTED = 100  # failed hunks listed in the conflict's details
Action = Literal["modify", "create", "delete"]


# --------------------------------------------------------------------------- commit with rollback

_libc = ctypes.CDLL(None, use_errno=True)
_RENAME_EXCHANGE = 2


def _exchange(dirfd: int, a: bytes, b: bytes) -> bool:
    """renameat2(RENAME_EXCHANGE) of two names in ``dirfd``; False where the file system (or
    libc) cannot, OSError for any other failure."""
    fn = getattr(_libc, "renameat2", None)
    if fn is None:
        return False
    if fn(dirfd, a, dirfd, b, _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err))


def _named(exc: OSError, name: bytes) -> GuestdError:
    """An OS failure as a typed error naming the file as the patch does (not an fd's path)."""
    shown = os.fsdecode(name)
    return GuestdError.from_os_error(OSError(exc.errno, exc.strerror, shown), path=shown)


def _temp_name(place: Place) -> bytes:
    return b"." + place.name[:200] + TEMP_MARK + os.urandom(6).hex().encode()


@dataclass(slots=True)
class _Staged:
    name: bytes  # as the patch names it, for messages
    place: Place  # the target's directory (fd, owned) and name in it
    action: Action
    read: os.stat_result | None  # the file the new content was made from (modify, delete)
    temp: bytes = b""  # the new content's name beside the target, while it is there
    inode: tuple[int, int] | None = None  # (st_dev, st_ino) of the new content
    old_at: bytes = b""  # where the displaced old file is, once the step is done
    done: bool = False
    kept: bool = False  # the rollback could not put the old file back: it stays at old_at
    # temp name -> its cleanup record, forgotten at the end unless the name could not be removed
    records: dict[bytes, str] = field(default_factory=dict)


class _Commit:
    """The staged files, their commit in order, and the undoing of it."""

    def __init__(self, fsys: FileSystem) -> None:
        self.fsys = fsys
        self.staged: list[_Staged] = []
        self.made: list[str] = []  # directories made for new files, outermost first
        self.finished = False

    # -- staging ------------------------------------------------------------------------
    def _record(self, s: _Staged, temp: bytes) -> None:
        """Record a temp name before it exists: a guestd killed now has it removed by the next."""
        if self.fsys.pending is not None:
            s.records[temp] = self.fsys.pending.record(s.place.dirfd, temp)

    def stage_write(self, s: _Staged, content: bytes, mode: int, owner: tuple[int, int] | None) -> None:
        """The new content in a temp file beside the target, complete and synced."""
        self.staged.append(s)
        d = s.place.dirfd
        temp = _temp_name(s.place)
        self._record(s, temp)
        try:
            fd = os.open(".", os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o600, dir_fd=d)
            anonymous = True
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(temp, flags, 0o600, dir_fd=d)
            s.temp = temp
            anonymous = False
        try:
            view = memoryview(content)
            while view:
                view = view[os.write(fd, view) :]
            if owner is not None and os.geteuid() == 0:
                os.fchown(fd, *owner)  # before the mode: a chown clears setuid and setgid
            os.fchmod(fd, mode)
            os.fsync(fd)
            if anonymous:
                os.link(f"/proc/self/fd/{fd}", temp, dst_dir_fd=d, follow_symlinks=True)
                s.temp = temp
            info = os.fstat(fd)
            s.inode = (info.st_dev, info.st_ino)
        finally:
            os.close(fd)

    def stage_delete(self, s: _Staged) -> None:
        self.staged.append(s)

    def make_parents(self, base: str, name: bytes) -> Place:
        """The place of a new file whose directory is missing: each missing directory made
        (owned as the file-system layer decides) and remembered, to be removed on failure."""
        parts = name.split(b"/")
        for depth in range(1, len(parts)):
            path = os.path.join(base, os.fsdecode(b"/".join(parts[:depth])))
            with self.fsys.place(path) as parent:
                try:
                    self.fsys.mkdir(parent, 0o777)
                except FileExistsError:
                    continue
            self.made.append(path)
        return self.fsys.place(os.path.join(base, os.fsdecode(name)), field="patch")

    # -- commit -------------------------------------------------------------------------
    def commit(self) -> None:
        """Every staged step in order; on a failure the steps done are undone in reverse and
        the error raised (naming any old file that could not be put back, and where it is)."""
        for s in self.staged:
            try:
                self._step(s)
            except (OSError, GuestdError) as exc:
                err = exc if isinstance(exc, GuestdError) else _named(exc, s.name)
                kept = self._rollback()
                if kept:
                    raise GuestdError(
                        err.code,
                        err.message + "; not restored: " + ", ".join(k["path"] for k in kept),
                        errno=err.errno,
                        details={**err.details, "not_restored": kept},
                    ) from None
                raise err from None
        self._finish()

    def _step(self, s: _Staged) -> None:
        d, target = s.place.dirfd, s.place.name
        if s.action == "create":
            try:
                rename_noreplace(Place(d, s.temp, s.place.path, None), s.place)
            except FileExistsError:
                raise GuestdError(
                    ErrorCode.EXISTS,
                    f"the patch creates {os.fsdecode(s.name)}, which was created meanwhile",
                    details={"path": os.fsdecode(s.name)},
                ) from None
            s.temp, s.done = b"", True
            return
        if s.action == "modify" and _exchange(d, s.temp, target):
            s.old_at, s.temp, s.done = s.temp, b"", True
        else:  # a deletion; or a modification where the file system cannot exchange
            aside = _temp_name(s.place)
            self._record(s, aside)
            rename_noreplace(Place(d, target, s.place.path, None), Place(d, aside, s.place.path, None))
            s.old_at, s.done = aside, True
            if s.action == "modify":  # the name is missing for this instant only
                rename_noreplace(Place(d, s.temp, s.place.path, None), s.place)
                s.temp = b""
        assert s.read is not None
        now = os.stat(s.old_at, dir_fd=d, follow_symlinks=False)
        if not same_file(now, s.read):
            raise GuestdError(
                ErrorCode.CONFLICT,
                f"{os.fsdecode(s.name)} changed while the patch was applied; nothing was changed",
                details={"path": os.fsdecode(s.name), "reason": "changed_during_edit"},
            )

    def _rollback(self) -> list[dict[str, str]]:
        """Undo the steps done, last first; returns the old files left at a temp name."""
        kept: list[dict[str, str]] = []
        for s in reversed(self.staged):
            if not s.done:
                continue
            d, target = s.place.dirfd, s.place.name
            try:
                if s.action == "create":
                    now = os.stat(target, dir_fd=d, follow_symlinks=False)
                    if (now.st_dev, now.st_ino) == s.inode:
                        os.unlink(target, dir_fd=d)
                elif s.action == "modify":  # the old inode back over the new one
                    os.rename(s.old_at, target, src_dir_fd=d, dst_dir_fd=d)
                else:
                    rename_noreplace(Place(d, s.old_at, s.place.path, None), s.place)
                s.old_at, s.done = b"", False
            except OSError:
                if s.old_at:
                    s.kept = True
                    kept.append({"path": os.fsdecode(s.name), "kept_at": os.fsdecode(s.old_at)})
        return kept

    def _finish(self) -> None:
        """Every step done: the old inodes go, the directories are synced."""
        self.finished = True
        synced: set[tuple[int, int]] = set()
        for s in self.staged:
            d = s.place.dirfd
            if s.old_at:
                try:
                    os.unlink(s.old_at, dir_fd=d)
                except FileNotFoundError:
                    pass
                except OSError:
                    s.records.pop(s.old_at, None)  # stays recorded: the next guestd removes it
                s.old_at = b""
            where = os.fstat(d)
            if (where.st_dev, where.st_ino) not in synced:
                synced.add((where.st_dev, where.st_ino))
                fsync_dirfd(d)

    def close(self) -> None:
        """What is left of a patch that did not commit goes (temp files, directories made,
        but never an old file a rollback could not restore); fds are closed. A temp name that
        cannot be removed stays recorded, for the next guestd's cleanup."""
        for s in self.staged:
            for name in (s.temp, b"" if s.kept else s.old_at):
                if name:
                    try:
                        os.unlink(name, dir_fd=s.place.dirfd)
                    except FileNotFoundError:
                        pass
                    except OSError:
                        s.records.pop(name, None)  # stays recorded: the next guestd removes it
            for record in s.records.values():  # the names are gone (or kept on purpose)
                PendingTemps.forget(record)
            s.place.close()
        if not self.finished:
            for path in reversed(self.made):  # only while empty: never what the workload put there
                try:
                    with self.fsys.place(path) as place:
                        os.rmdir(place.name, dir_fd=place.dirfd)
                except (OSError, GuestdError):
                    pass


# --------------------------------------------------------------------------- apply


def apply(fsys: FileSystem, base: str, patch: bytes, strip: int) -> list[PatchedFileRecord]:
    targets = plan(parse(patch, strip))
    stager = _Stager(fsys, base)
    try:
        out: list[PatchedFileRecord] = []
        for target in targets:
            try:
                action = stager.stage(target)
            except OSError as exc:
                raise _named(exc, target.name) from None
            if action is not None:
                hunks = sum(len(s.hunks) for s in target.sections)
                out.append({"path": os.fsdecode(target.name), "action": action, "hunks": hunks})
        if stager.failures:
            raise GuestdError(
                ErrorCode.CONFLICT,
                f"{stager.failures} hunk(s) do not apply; nothing was changed",
                details={"reason": "hunks_failed", "hunks": stager.failed},
            )
        stager.commit.commit()
        return out
    finally:
        stager.commit.close()


class _Stager:
    """Each file read, its sections applied in memory and, while no hunk has failed, staged."""

    def __init__(self, fsys: FileSystem, base: str) -> None:
        self.fsys = fsys
        self.base = base
        self.scan = Scan(MAX_PLACEMENT_SCAN)
        self.commit = _Commit(fsys)
        self.failures = 0
        self.failed: list[dict[str, object]] = []  # the first MAX_REPORTED
        self.seen: dict[tuple[int, int, bytes], bytes] = {}  # (directory, name) -> the patch's name

    def _fail(self, shown: str, number: int, line: int, reason: str) -> None:
        self.failures += 1
        if len(self.failed) < MAX_REPORTED:
            self.failed.append({"path": shown, "hunk": number, "line": line, "reason": reason})

    def stage(self, target: Target) -> Action | None:
        """The action the patch takes on ``target`` (None: nothing, created and deleted again)."""
        shown = os.fsdecode(target.name)
        place: Place | None
        try:
            place = self.fsys.place(os.path.join(self.base, shown), field="patch")
        except FileNotFoundError:
            if target.existed:
                raise
            place = None  # a new file in a directory that is missing: made when it is staged
        try:
            data, read = b"", None
            if place is not None:
                place.path = shown
                self._check_new_name(target, place)
                if target.existed:
                    data, read = read_at(place)
            present = target.existed
            number = 0  # hunks of this file in the sections before, for the report
            for i, section in enumerate(target.sections):
                if i:
                    check_sequence(target.name, section, present, target.sections[i - 1])
                new, bad = apply_hunks(data if present else b"", section.hunks, self.scan)
                for index, reason in bad:
                    self._fail(shown, number + index + 1, section.hunks[index].old_start, reason)
                if bad:
                    return None
                if section.deletes and not new:
                    present, data = False, b""
                elif section.new_name is None:  # to /dev/null, but lines the patch does not know remain
                    last = section.hunks[-1]
                    self._fail(shown, number + len(section.hunks), last.old_start, "not_empty")
                    return None
                else:
                    present, data = True, new
                if len(data) > MAX_EDIT_BYTES:
                    raise too_large("max_edit_bytes", len(data), f"the patch makes {shown} too large")
                number += len(section.hunks)
            if not target.existed and not present:
                return None
            action: Action = "delete" if not present else "modify" if target.existed else "create"
            if self.failures:
                return action  # not staged: the patch fails anyway
            if place is None:
                place = self.commit.make_parents(self.base, target.name)
                place.path = shown
            s = _Staged(target.name, place, action, read)
            place = None  # the staged file owns it now
            if action == "delete":
                self.commit.stage_delete(s)
            else:
                mode, owner = DEFAULT_PERM, s.place.owner
                if read is not None:  # a replaced file keeps its mode and owner
                    mode, owner = st.S_IMODE(read.st_mode), (read.st_uid, read.st_gid)
                self.commit.stage_write(s, data, mode, owner)
            return action
        finally:
            if place is not None:
                place.close()

    def _check_new_name(self, target: Target, place: Place) -> None:
        """Two names of the patch for one file are refused; a file to create must not exist."""
        shown = os.fsdecode(target.name)
        where = os.fstat(place.dirfd)
        key = (where.st_dev, where.st_ino, place.name)
        if key in self.seen:
            raise bad_patch(f"{os.fsdecode(self.seen[key])} and {shown} in the patch are the same file", target.name)
        self.seen[key] = target.name
        if target.existed:
            return
        try:
            os.stat(place.name, dir_fd=place.dirfd, follow_symlinks=False)
        except FileNotFoundError:
            return
        raise GuestdError(ErrorCode.EXISTS, f"the patch creates {shown}, which exists", details={"path": shown})
