"""``file.glob`` and ``file.grep`` (issue 18).

Both walk the tree as ripgrep does (``guestd.files.walk``: through fds, symlinks never
followed, ``.git`` left out, overrides before ``.gitignore`` before hidden names), so the
pure-Python engine and rg give the same files.

Where grep runs rg, and as whom. rg opens paths by name while it walks; a workload that swaps
a directory for a symlink mid-walk could point it elsewhere. So rg runs only where that gains
the workload nothing: as the workload user (guestd is root and ``policy.workload_user`` is set:
rg then reads only what the workload could read itself), or where guestd is not root at all
(the workload then runs as guestd's own user). Otherwise (root, no workload user) ``auto``
picks the Python engine, which reads every file through fds opened ``O_NOFOLLOW`` and checked
to be regular before a read (a FIFO or device is never opened). rg starts in the directory
guestd resolved (its cwd is that fd), so the root itself is never re-resolved by name.

Bounds: ``max_matches`` lines, each line's data at most ``MAX_LINE_BYTES``, ``timeout_s`` (rg
is killed), one rg JSON record at most ``MAX_RG_RECORD`` bytes, 256 events or 50 ms per step.
"""

from __future__ import annotations

import base64
import heapq
import json
import os
import re
import select
import shutil
import stat as st
import subprocess
import threading
import time
from collections import deque
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field

from guestd.files.fs import FileSystem, reopen_regular
from guestd.files.ignore import glob_regex
from guestd.files.walk import Filter, Walk
from guestd.wire.errors import ErrorCode, GuestdError

MAX_LINE_BYTES = 4096  # of one line, in a grep event
MAX_RG_RECORD = 16 * 1024 * 1024  # one JSON line of rg's output (a match in a huge line)
BLOCK = 64 * 1024  # the Python engine reads this much at a time (and looks for NUL in it)
MAX_CARRY = 1024 * 1024  # a line longer than this is searched in pieces
STEP_EVENTS = 256
STEP_S = 0.05
RG_STDERR = 64 * 1024


# --------------------------------------------------------------------------- glob


def glob(
    fsys: FileSystem, path: str, pattern: str, gitignore: bool, hidden: bool, max_results: int, timeout_s: float
) -> dict[str, object]:
    rule = glob_regex(pattern, anchored=True)
    fd = fsys.open_dir(path)
    try:
        walk = Walk(fd, Filter(gitignore=gitignore, hidden=hidden, skip_git=gitignore))
        walk.deadline = time.monotonic() + timeout_s
        total = 0

        def matching() -> Iterator[bytes]:
            nonlocal total
            for e in walk.entries():
                if rule.match(e.rel):
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


@dataclass
class GrepQuery:
    pattern: str
    literal: bool = False
    ignore_case: bool = False
    globs: list[str] = field(default_factory=list)
    context: int = 0
    gitignore: bool = True
    hidden: bool = False

    def regex(self) -> re.Pattern[bytes]:
        raw = re.escape(self.pattern.encode()) if self.literal else self.pattern.encode()
        try:
            return re.compile(raw, re.MULTILINE | (re.IGNORECASE if self.ignore_case else 0))
        except re.error as exc:
            raise GuestdError(ErrorCode.BAD_REQUEST, f"bad regex: {exc}", details={"field": "pattern"}) from None


# A step's events: (kind, path bytes, line, data, truncated), or None as a heartbeat.
Hit = tuple[str, bytes, int, bytes, bool]


def _cut(line: bytes) -> tuple[bytes, bool]:
    if len(line) > MAX_LINE_BYTES:
        return line[:MAX_LINE_BYTES], True
    return line, False


def python_grep(root_fd: int, single: bytes | None, q: GrepQuery, deadline: float) -> Generator[Hit | None, None, None]:
    """The pure-Python engine: every file met by the walk (or the one file ``single`` in
    ``root_fd``), read in blocks through an fd checked to be a regular file."""
    regex = q.regex()
    if single is not None:
        yield from _grep_file(root_fd, single, single, regex, q.context)
        return
    walk = Walk(root_fd, Filter(globs=q.globs, gitignore=q.gitignore, hidden=q.hidden, skip_git=True))
    walk.deadline = deadline
    for e in walk.entries():
        if e.is_file:
            yield from _grep_file(e.dirfd, e.name, e.rel, regex, q.context)
            yield None


def _grep_file(dirfd: int, name: bytes, rel: bytes, regex: re.Pattern[bytes], context: int) -> Iterator[Hit | None]:
    try:
        pathfd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
    except OSError:
        return
    try:
        fd = reopen_regular(pathfd, os.O_RDONLY | os.O_NONBLOCK, os.fsdecode(rel))
    except (OSError, GuestdError):
        return  # swapped for a symlink, FIFO or device since the walk saw it: never opened
    finally:
        os.close(pathfd)
    try:
        yield from _grep_fd(fd, rel, regex, context)
    finally:
        os.close(fd)


def _grep_fd(fd: int, rel: bytes, regex: re.Pattern[bytes], context: int) -> Iterator[Hit | None]:
    """Lines of ``fd`` that ``regex`` matches (each line searched on its own, without its
    newline, as rg does), with ``context`` lines around them. A regex search over the block
    finds the next candidate line quickly; the candidate line is then checked alone."""
    before: deque[tuple[int, bytes]] = deque(maxlen=context or 1)
    after = 0  # context lines still owed after the last match
    last_sent = 0
    lineno = 0
    carry = b""
    search = regex.search
    while True:
        try:
            block = os.read(fd, BLOCK)
        except OSError:
            return
        if b"\0" in block:
            return  # binary: this block is not searched and the file stops here (as rg's reader does)
        eof = not block
        buf = carry + block
        if eof and not buf:
            return
        end = len(buf) if eof else buf.rfind(b"\n") + 1
        if end <= 0:
            if len(buf) <= MAX_CARRY:
                carry = buf
                continue
            end = len(buf)  # a huge line without a newline: searched in pieces
        carry = buf[end:]
        pos = 0
        while pos < end:
            if not after:
                m = search(buf, pos, end)
                target = end if m is None else buf.rfind(b"\n", pos, m.start()) + 1
                if target > pos:  # lines with no match and owed no context: counted, kept for context
                    seg = buf[pos:target]
                    if context:
                        lines = seg.split(b"\n")
                        if seg.endswith(b"\n"):
                            lines.pop()
                        keep = lines[-context:]
                        first = lineno + len(lines) - len(keep)
                        before.extend((first + i + 1, text) for i, text in enumerate(keep))
                        lineno += len(lines)
                    else:
                        lineno += seg.count(b"\n") + (0 if seg.endswith(b"\n") else 1)
                    pos = target
                if m is None:
                    break
            nl = buf.find(b"\n", pos, end)
            line_end = end if nl < 0 else nl + 1
            line = buf[pos:line_end]
            lineno += 1
            body = line[:-1] if line.endswith(b"\n") else line
            if search(body):
                if context:
                    for n, text in before:
                        if n > last_sent:
                            data, cut = _cut(text + b"\n")
                            yield ("context", rel, n, data, cut)
                    before.clear()
                data, cut = _cut(line)
                yield ("match", rel, lineno, data, cut)
                last_sent = lineno
                after = context
            elif after:
                data, cut = _cut(line)
                yield ("context", rel, lineno, data, cut)
                last_sent = lineno
                after -= 1
            elif context:
                before.append((lineno, body))
            pos = line_end
        if eof:
            return
        yield None  # a heartbeat per block: a huge file without matches still lets a step end


def rg_path() -> str | None:
    return shutil.which("rg")


class Stepper:
    """Drives a search generator from I/O threads, one step at a time, and closes it (and
    what it holds) once, after any step in progress: a cancelled request never closes a
    generator another thread is running."""

    def __init__(self, gen: Generator[Hit | None, None, None], fd: int) -> None:
        self.gen = gen
        self.fd = fd
        self.lock = threading.Lock()
        self.closed = False

    def step(self) -> list[Hit] | None:
        """Up to STEP_EVENTS hits, or what came within STEP_S; None at the end."""
        with self.lock:
            if self.closed:
                return None
            out: list[Hit] = []
            until = time.monotonic() + STEP_S
            for hit in self.gen:
                if hit is not None:
                    out.append(hit)
                if len(out) >= STEP_EVENTS or time.monotonic() > until:
                    return out
            return out or None

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            try:
                self.gen.close()
            finally:
                os.close(self.fd)


def rg_command(rg: str, q: GrepQuery, target: str) -> list[str]:
    cmd = [
        rg,
        "--json",
        "--no-config",
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


def _json_bytes(obj: dict[str, object]) -> bytes:
    text = obj.get("text")
    if isinstance(text, str):
        return text.encode("utf-8", "surrogateescape")
    raw = obj.get("bytes")
    return base64.b64decode(raw) if isinstance(raw, str) else b""


def rg_grep(
    rg: str, root_fd: int, single: bytes | None, q: GrepQuery, deadline: float, ids: tuple[int, int] | None
) -> Generator[Hit | None, None, None]:
    """ripgrep's matches, started in the directory ``root_fd`` (its cwd is that fd), as the
    workload user when ``ids`` is given."""
    target = os.fsdecode(single) if single is not None else "."
    proc = subprocess.Popen(  # the argv is ours; the pattern is one argument after --regexp
        rg_command(rg, q, target),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=f"/proc/self/fd/{root_fd}",
        pass_fds=(root_fd,),
        start_new_session=True,
        user=None if ids is None else ids[0],
        group=None if ids is None else ids[1],
        extra_groups=None if ids is None else [],
    )
    assert proc.stdout is not None and proc.stderr is not None
    out = proc.stdout.fileno()
    err = proc.stderr.fileno()
    os.set_blocking(out, False)
    os.set_blocking(err, False)
    pending = b""
    stderr = b""
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            ready, _, _ = select.select([out, err], [], [], min(left, STEP_S))
            if not ready:
                yield None
                continue
            if err in ready:
                try:
                    chunk = os.read(err, 65536)
                except BlockingIOError:
                    chunk = b""
                if chunk:
                    stderr = (stderr + chunk)[-RG_STDERR:]
            if out not in ready:
                continue
            try:
                chunk = os.read(out, 1 << 20)
            except BlockingIOError:
                continue
            if not chunk:
                break
            pending += chunk
            lines = pending.split(b"\n")
            pending = lines.pop()
            if len(pending) > MAX_RG_RECORD:
                pending = b""  # one absurd record: dropped (its line is longer than 16 MiB)
            for raw in lines:
                hit = _rg_record(raw, single)
                if hit is not None:
                    yield hit
            yield None
        code = proc.wait()
        if code == 2 and not stderr.strip() == b"":
            raise GuestdError(
                ErrorCode.BAD_REQUEST,
                "rg: " + stderr.decode("utf-8", "replace").strip()[-500:],
                details={"field": "pattern"},
            )
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def _rg_record(raw: bytes, single: bytes | None) -> Hit | None:
    if not raw.startswith(b'{"type":"match"') and not raw.startswith(b'{"type":"context"'):
        return None
    try:
        rec = json.loads(raw)
    except ValueError:
        return None
    data = rec.get("data", {})
    path = _json_bytes(data.get("path", {}))
    if path.startswith(b"./"):
        path = path[2:]
    line = _json_bytes(data.get("lines", {}))
    text, cut = _cut(line)
    number = data.get("line_number")
    if not isinstance(number, int) or not text:
        return None
    return (rec["type"], path, number, text, cut)


def open_target(fsys: FileSystem, path: str) -> tuple[int, bytes | None]:
    """(a directory fd to search in, the file's name when ``path`` is a file)."""
    info, _ = fsys.stat(path, True)
    if st.S_ISDIR(info.st_mode):
        return fsys.open_dir(path), None
    absolute = os.path.abspath(path)
    head, name = os.path.split(absolute)
    return fsys.open_dir(head or "/"), os.fsencode(name)
