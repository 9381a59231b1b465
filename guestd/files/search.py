"""``file.glob`` and ``file.grep`` (issues 18 and 29).

glob walks the tree as ripgrep does (``guestd.files.walk``: through fds, symlinks never
followed, ``.git`` left out, overrides before ``.gitignore`` before hidden names).

grep is ripgrep, in every deployment: one regex dialect (Rust's regex crate: linear time, no
look-around or backreferences; a pattern it refuses is ``bad_request``). The in-process Python
engine is gone: a pathological pattern froze guestd with the GIL held. rg runs as a
workload process through ``guestd.children``, so what a search costs (a regex over a huge
tree, a 200 MiB line held whole) is paid by the workload's cgroup: its memory limit ends rg,
never guestd. Without rg, grep is ``unavailable`` (install the ``ripgrep`` package;
guestd-bake puts it in the image).

As whom. rg opens paths by name while it walks; a workload that swaps a directory for a
symlink mid-walk could point it elsewhere. So rg never runs as root: as the workload user
(guestd is root and ``policy.workload_user`` is set: rg then reads only what the workload could
read itself), as guestd's own user where guestd is not root (the workload runs as that user
too), and as ``nobody`` where guestd is root without a workload user (``search_user``). rg
starts in the directory guestd resolved (its cwd is that fd), so the root itself is never
re-resolved by name.

Bounds: ``max_matches`` lines; each line's data at most ``MAX_LINE_BYTES`` (rg cuts longer
lines itself and they are reported with ``truncated``: never dropped); ``timeout_s`` and a
cancelled request kill rg; rg's output is read only as the client grants credit.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import os
import shutil
import stat as st
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from guestd.children import PIPE, Child, Children, KilledBy
from guestd.children.tree import read_chunk, wait_fd
from guestd.files.fs import FileSystem
from guestd.files.ignore import find_glob
from guestd.files.walk import Filter, Walk
from guestd.output.capture import OutputCapture
from guestd.output.pump import OutputPump
from guestd.wire.errors import ErrorCode, GuestdError
from guestd.wire.paths import path_to_wire

if TYPE_CHECKING:
    from guestd.services import Request

NOBODY = 65534


# --------------------------------------------------------------------------- glob


def glob(
    fsys: FileSystem, path: str, pattern: str, gitignore: bool, hidden: bool, max_results: int, timeout_s: float
) -> dict[str, object]:
    rule = find_glob(pattern)  # ripgrep's --glob meaning, as grep's globs (see ignore.find_glob)
    fd = fsys.open_dir(path)
    try:
        walk = Walk(fd, Filter(gitignore=gitignore, hidden=hidden, skip_git=gitignore))
        walk.deadline = time.monotonic() + timeout_s
        total = 0

        def matching() -> Iterator[bytes]:
            nonlocal total
            for e in walk.matching(rule):
                total += 1
                yield e.rel

        first = heapq.nsmallest(max_results, matching())
    finally:
        os.close(fd)
    from guestd.wire.paths import path_to_wire

    return {
        "paths": [path_to_wire(p) for p in first],
        "total": total,
        "truncated": total > max_results or walk.truncated is not None,
        "bound": walk.truncated,
    }


# --------------------------------------------------------------------------- grep

MAX_LINE_BYTES = 4096  # of one line, in a grep event (rg's --max-columns: longer lines come cut)
# rg's preview of a cut line counts characters, not bytes: up to 4 bytes each, and its marker.
OMITTED = b" [... omitted end of long line]"
MAX_TEXT_KEPT = 4 * MAX_LINE_BYTES + len(OMITTED)
MAX_RG_PATH = 1024 * 1024  # one path in rg's output (rg's own walk stays far below)
READ_SIZE = 256 * 1024
RG_STDERR = 64 * 1024
_STDERR_READ = 64 * 1024  # bytes of rg's stderr read at once
KILL_WAIT_S = 5.0  # a SIGKILLed rg is gone within milliseconds; bounded anyway


@dataclass
class GrepQuery:
    pattern: str
    literal: bool = False
    ignore_case: bool = False
    globs: list[str] = field(default_factory=list)
    context: int = 0
    gitignore: bool = True
    hidden: bool = False


# One line of rg's output: (kind "match" or "context", path bytes, line, data, cut).
Hit = tuple[str, bytes, int, bytes, bool]


def rg_path() -> str | None:
    return shutil.which("rg")


def search_user(workload_ids: tuple[int, int] | None) -> tuple[int, int] | None:
    """Whom rg runs as instead of the workload user: ``nobody`` when guestd is root and has no
    workload user (rg then reads what everyone may read, never as root), else None (the
    workload user, or guestd's own user when it is not root)."""
    if os.geteuid() != 0 or workload_ids is not None:
        return None
    import pwd

    try:
        pw = pwd.getpwnam("nobody")
        return pw.pw_uid, pw.pw_gid
    except KeyError:
        return NOBODY, NOBODY


def rg_command(rg: str, q: GrepQuery, target: str) -> list[str]:
    """rg's standard printer, not --json: ``PATH NUL LINE (: match | - context) TEXT NL`` with a
    line longer than MAX_LINE_BYTES cut by rg itself (``--max-columns-preview``), so what guestd
    reads per line is bounded whatever the file holds (--json ignores --max-columns and writes
    the whole line, its line number after it)."""
    cmd = [
        rg,
        "--no-config",
        "--null",
        "--with-filename",
        "--line-number",
        "--no-heading",
        "--color",
        "never",
        "--no-context-separator",
        "--field-match-separator",
        ":",
        "--field-context-separator",
        "-",
        "--max-columns",
        str(MAX_LINE_BYTES),
        "--max-columns-preview",
        "--no-ignore-global",
        "--no-ignore-exclude",
        "--no-ignore-parent",
        "--no-ignore-dot",
        "--no-require-git",
        "--no-messages",
        "--glob",
        "!.git",
    ]
    for g in q.globs:
        cmd += ["--glob", g]
    if q.context:
        cmd += ["--context", str(q.context)]
    if q.literal:
        cmd.append("--fixed-strings")
    if q.ignore_case:
        cmd.append("--ignore-case")
    if q.hidden:
        cmd.append("--hidden")
    if not q.gitignore:
        cmd.append("--no-ignore-vcs")
    return [*cmd, "--regexp", q.pattern, "--", target]


class RgOutputError(Exception):
    """rg's output did not have the shape rg_command asks for."""


_PATH, _NUMBER, _TEXT = 0, 1, 2
_NOTICES = (b": WARNING: stopped searching binary file after match (found ", b": binary file matches (found ")


class RgLines:
    """rg's standard output parsed as it arrives, in bounded memory (sans-I/O).

    A record is ``PATH NUL LINE SEP TEXT NL`` (SEP ``:`` for a match, ``-`` for context); a
    path may hold newlines, never a NUL, so a path ends at the NUL. rg also prints a binary-file
    notice, ``PATH: WARNING: stopped searching binary file ...)`` or ``PATH: binary file
    matches ...)``, with no NUL: it ends up in front of the next path, and is taken off there
    (its PATH is the file just reported, or the one file searched). A cut line (longer than
    MAX_LINE_BYTES, so longer than rg's --max-columns) is rg's preview plus OMITTED: it is
    reported cut; a line that merely ends with OMITTED is no longer than MAX_LINE_BYTES, so it
    is never mistaken for one. A workload can name a file like a notice followed by another
    name: with ``exists`` (is this path, as rg printed it, an entry of the searched tree?) a
    notice is taken off only when the path as printed is not itself an entry, so a reply never
    names a file that is not there."""

    def __init__(self, single: bytes | None, exists: Callable[[bytes], bool] | None = None) -> None:
        self.single = single
        self.exists = exists
        self.last_path = single or b""
        self.state = _PATH
        self.path = bytearray()
        self.number = bytearray()
        self.kind = ""
        self.text = bytearray()
        self.text_over = False  # more than MAX_TEXT_KEPT came: the rest was not kept

    def feed(self, data: bytes) -> list[Hit]:
        out: list[Hit] = []
        pos, n = 0, len(data)
        while pos < n:
            if self.state == _PATH and not self.path:
                end = self._whole_record(data, pos, out)
                if end >= 0:  # the common case: a record whole in this chunk, cut with find()
                    pos = end
                    continue
            if self.state == _PATH:
                end = data.find(b"\0", pos)
                self.path += data[pos : n if end < 0 else end]
                if len(self.path) > MAX_RG_PATH + 4096:
                    raise RgOutputError("a path longer than 1 MiB")
                if end < 0:
                    break
                pos = end + 1
                self.state = _NUMBER
            elif self.state == _NUMBER:
                byte = data[pos]
                pos += 1
                if 0x30 <= byte <= 0x39 and len(self.number) < 20:
                    self.number.append(byte)
                elif byte in b":-" and self.number:
                    self.kind = "match" if byte == 0x3A else "context"
                    self.state = _TEXT
                else:
                    raise RgOutputError("no line number after a path")
            else:
                end = data.find(b"\n", pos)
                piece = data[pos : n if end < 0 else end]
                room = MAX_TEXT_KEPT - len(self.text)
                if len(piece) > room:
                    piece, self.text_over = piece[:room], True
                self.text += piece
                if end < 0:
                    break
                pos = end + 1
                out.append(self._hit(bytes(self.path), int(self.number), self.kind, bytes(self.text), self.text_over))
                self.path.clear()
                self.number.clear()
                self.text.clear()
                self.text_over = False
                self.state = _PATH
        return out

    def _whole_record(self, data: bytes, pos: int, out: list[Hit]) -> int:
        """The record at ``pos`` when all of it is in ``data`` (its end), else -1."""
        nul = data.find(b"\0", pos)
        if nul < 0:
            return -1
        colon, dash = data.find(b":", nul + 1, nul + 22), data.find(b"-", nul + 1, nul + 22)
        sep = colon if dash < 0 or 0 <= colon < dash else dash
        end = data.find(b"\n", sep + 1) if sep > nul + 1 else -1
        number = data[nul + 1 : sep]
        if end < 0 or not number.isdigit() or nul - pos > MAX_RG_PATH:
            return -1  # partial, or not the usual shape: the byte-wise path decides
        text = data[sep + 1 : end]
        over = len(text) > MAX_TEXT_KEPT
        kind = "match" if sep == colon else "context"
        out.append(self._hit(data[pos:nul], int(number), kind, text[:MAX_TEXT_KEPT] if over else text, over))
        return end + 1

    def _hit(self, path: bytes, line: int, kind: str, text: bytes, cut: bool) -> Hit:
        if b": " in path:  # a binary-file notice starts "PATH: " (rare: no copy of the rest otherwise)
            path = self._without_notices(path)
        self.last_path = path
        if len(text) > MAX_LINE_BYTES and text.endswith(OMITTED):
            text, cut = text[: -len(OMITTED)], True  # rg cut it: longer than --max-columns
        text += b"\n"
        if len(text) > MAX_LINE_BYTES:
            text, cut = text[:MAX_LINE_BYTES], True
        if self.single is None and path.startswith(b"./"):
            path = path[2:]
        return (kind, path, line, text, cut)

    def _without_notices(self, path: bytes) -> bytes:
        starts = [known + notice for known in {self.last_path, self.single or b""} if known for notice in _NOTICES]
        stripped = True
        while stripped:  # each turn takes a whole notice off the front, or ends
            if self.exists is not None and any(path.startswith(start) for start in starts) and self.exists(path):
                return path  # a file the workload named like a notice: it is that file
            stripped = False
            for start in starts:
                end = path.find(b")\n", len(start)) if path.startswith(start) else -1
                if end >= 0:
                    path, stripped = path[end + 2 :], True
        return path


def _is_entry(root_fd: int, path: bytes) -> bool:
    """``path`` (as rg printed it, relative to its cwd) names an entry below ``root_fd``; only
    asked for a path that starts like a binary-file notice, which is rare."""
    try:
        os.stat(path, dir_fd=root_fd, follow_symlinks=False)
    except (OSError, ValueError):
        return False
    return True


@dataclass
class GrepOutcome:
    matches: int = 0
    files: int = 0
    truncated: bool = False  # max_matches reached
    timed_out: bool = False


async def run_rg(
    ctx: Request,
    children: Children,
    rg: str,
    q: GrepQuery,
    root_fd: int,
    single: bytes | None,
    user: tuple[int, int] | None,
    max_matches: int,
    deadline: float,
) -> GrepOutcome:
    """Run rg as a workload process (``guestd.children``: a run leaf under the workload's
    limits, the workload user, OOM score 0, the fd limit guestd was given, frozen with the
    workload) in the directory ``root_fd`` (its cwd is that fd, so the root is never
    re-resolved by name), and stream its lines to ``ctx`` under the request's credit: rg's
    output is read only as the client makes room, so rg waits on its pipe meanwhile. The
    pipes are read through the event loop (no select(): guestd's fds pass 1024). rg is
    killed at ``deadline``, after ``max_matches`` lines, or when the request is cancelled.
    ``user``: run as this (uid, gid) instead of the workload user."""
    loop = asyncio.get_running_loop()
    target = "." if single is None else os.fsdecode(single)
    try:
        child = await children.spawn(
            rg_command(rg, q, target),
            kind="grep",
            env={},
            # The same number in the child: the subprocess fallback changes directory before
            # it places extra fds, the native spawn after (and keeps only what it placed).
            cwd=f"/proc/self/fd/{root_fd}",
            stdout=PIPE,
            stderr=PIPE,
            extra_fds={root_fd: root_fd},
            user=user,
        )
    except GuestdError as exc:
        if exc.details.get("stage") != "cwd":
            raise
        raise GuestdError(  # the cwd is an fd: say what it stands for
            exc.code,
            f"rg (run as the workload user) cannot enter the directory searched: {exc.message.split(':')[0]}",
            errno=exc.errno,
            details={"stage": "cwd"},
        ) from None
    outcome = GrepOutcome()
    assert child.stdout is not None and child.stderr is not None
    out_fd = child.stdout
    # rg's stderr as every child's output is read: its last RG_STDERR bytes kept, for the error.
    stderr = OutputCapture(RG_STDERR)
    stderr_pump = OutputPump(read_size=_STDERR_READ, drain_reads=RG_STDERR // _STDERR_READ + 1)
    stderr_pump.route({2: stderr})
    stderr_pump.add("stderr", child.stderr, 2)
    child.watch()
    ended = False
    try:
        parser = RgLines(single, exists=functools.partial(_is_entry, root_fd))
        files: set[bytes] = set()
        try:
            async with asyncio.timeout_at(deadline):
                while not outcome.truncated:
                    data = await _read(loop, out_fd)
                    if not data:
                        break
                    for kind, rel, line, text, cut in parser.feed(data):
                        fields: dict[str, object] = {"ev": kind, "path": path_to_wire(rel), "line": line}
                        if cut:
                            fields["truncated"] = True
                        await ctx.wait_room(fields, len(text))
                        if not ctx.active:
                            raise asyncio.CancelledError
                        ctx.push_data(fields, text)
                        if kind == "match":
                            outcome.matches += 1
                            files.add(rel)
                            if outcome.matches >= max_matches:
                                outcome.truncated = True
                                break
                if not outcome.truncated:
                    await child.exited  # its output ended: it has, or is about to
                    ended = True
        except TimeoutError:
            outcome.timed_out = True
        except RgOutputError as exc:
            raise GuestdError(
                ErrorCode.IO_ERROR, f"could not read rg's output: {exc}", details={"stage": "rg"}
            ) from None
        outcome.files = len(files)
    finally:
        if ended:  # what rg wrote before it exited, whether or not the loop saw it yet
            stderr_pump.drain_now()
        stderr_pump.close()
        if not ended:
            reason: KilledBy = "timeout" if outcome.timed_out else "cancel"
            child.note_end(reason)
            child.kill_now()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(child.exited), KILL_WAIT_S)
        child.release()
    if ended:
        _check_exit(child, stderr.data())
    return outcome


async def _read(loop: asyncio.AbstractEventLoop, fd: int) -> bytes:
    """The next chunk of a non-blocking pipe, waiting on the event loop; b"" at its end."""
    while True:
        data = read_chunk(fd, READ_SIZE)
        if data is not None:
            return data
        await wait_fd(loop, fd)


def _check_exit(child: Child, stderr: bytes) -> None:
    """rg ended by itself: a typed error when it failed (exit 2 with a message: the pattern),
    or when something killed it (the workload's memory limit: rg holds a whole line)."""
    info = child.exit_info()
    if info["killed_by"] == "oom":
        raise GuestdError(
            ErrorCode.LIMIT,
            "rg was killed by the workload's memory limit (it holds a whole line in memory: a line too long?)",
            details={"stage": "rg", "killed_by": "oom", "limit": "workload.memory_max"},
        )
    if info["signal"] is not None:
        raise GuestdError(
            ErrorCode.UNAVAILABLE,
            f"rg was killed by signal {info['signal']}",
            details={"stage": "rg", "killed_by": info["killed_by"], "signal": info["signal"]},
        )
    message = stderr.decode("utf-8", "replace").strip()
    if info["exit_code"] == 2 and message:  # with --no-messages rg says only what stops it
        culprit = "globs" if "glob" in message else "pattern"
        raise GuestdError(ErrorCode.BAD_REQUEST, "rg: " + message[-500:], details={"field": culprit})


def open_target(fsys: FileSystem, path: str) -> tuple[int, bytes | None]:
    """(an O_PATH fd of the directory to search in, the file's name when ``path`` is a file).
    O_PATH: rg gets it as its cwd and could not list a directory through it."""
    info, _ = fsys.stat(path, True)
    if st.S_ISDIR(info.st_mode):
        fd, single = fsys.open_dir(path), None
    else:
        head, name = os.path.split(os.path.abspath(path))
        fd, single = fsys.open_dir(head or "/"), os.fsencode(name)
    try:
        return os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd), single
    finally:
        os.close(fd)
