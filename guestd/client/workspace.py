"""Workspace methods of the client: trees in and out, search, edit, patch, and the
change feed. A mixin of :class:`~guestd.client.AsyncClient` (over its ``_conn``), with a
blocking twin in :mod:`guestd.client.workspace_sync`.

What a guest can make this client hold is bounded: grep lines and watched paths arrive as data
under the credit this client grants as it reads; a downloaded tree goes to a local temp file
(at most ``max_bytes``) and is extracted with tarfile's ``data`` filter (no absolute names, no
``..``, no links out, no devices), so a hostile guest cannot write outside ``dst``.
"""

from __future__ import annotations

import asyncio
import io
import os
import queue
import stat
import tarfile
import tempfile
import threading
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, Literal, cast, overload

from guestd.client.connection import Call, ClientConnection, GuestProtocolError
from guestd.client.params import DEFAULT_DEADLINE, TRANSFER_DEADLINE, Progress, present
from guestd.client.replies import PatchedFile
from guestd.files import tarhead
from guestd.wire.paths import WirePath, path_to_wire

if TYPE_CHECKING:
    from guestd.files.ignore import Overrides
    from guestd.wire.types import ChangeReportRecord, FileApplyPatchReply

SEARCH_MARGIN = 30.0  # on top of a search's timeout_s: the trip there and back
TREE_CHUNK = 1024 * 1024
TREE_MEMORY_CAP = 256 * 1024 * 1024  # an in-memory tree download without max_bytes
GrepEngine = Literal["auto", "rg"]  # both ripgrep: the Python engine was removed (a hostile pattern froze it)


@dataclass(frozen=True)
class View:
    kind: str  # "file" or "dir"
    content: str
    start_line: int | None
    end_line: int | None
    total_lines: int | None
    truncated: bool


@dataclass(frozen=True)
class EditResult:
    size: int
    snippet: str
    start_line: int
    undo_depth: int


@dataclass(frozen=True)
class GlobResult:
    paths: list[WirePath]
    total: int
    truncated: bool
    bound: str | None


@dataclass(frozen=True)
class GrepLine:
    kind: str  # "match" or "context"
    path: WirePath
    line: int
    text: bytes  # the line and a newline; at most 4096 bytes
    truncated: bool  # the line was longer: text is its start (a match anywhere in it is reported)


@dataclass(frozen=True)
class GrepResult:
    lines: list[GrepLine]
    matches: int
    files: int
    truncated: bool
    timed_out: bool
    engine: str


@dataclass(frozen=True)
class TreeUpload:
    entries: int
    bytes: int


@dataclass(frozen=True)
class Change:
    kind: str  # created, modified, deleted; or "overflow" (path empty): changes were lost
    path: bytes
    is_dir: bool


@dataclass(frozen=True)
class Changes:
    cursor: int
    created: list[WirePath]
    modified: list[WirePath]
    deleted: list[WirePath]
    total: int
    truncated: bool
    overflow: bool

    @classmethod
    def from_body(cls, cursor: int, r: ChangeReportRecord) -> Changes:
        return cls(cursor, r["created"], r["modified"], r["deleted"], r["total"], r["truncated"], r["overflow"])


def _edit(body: dict[str, Any]) -> EditResult:
    return EditResult(body["size"], body["snippet"], body["start_line"], body["undo_depth"])


class Watch:
    """An async iterator of :class:`Change` from ``file.watch``; ``await w.close()`` ends it."""

    def __init__(self, conn: ClientConnection, call: Call) -> None:
        self._conn = conn
        self._call = call
        self.ready = False
        self.closed = False

    def __aiter__(self) -> AsyncIterator[Change]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[Change]:
        while True:
            ev = await self._call.next_event(None)
            if ev is None:
                if self.closed:  # closed by us (another task): the iteration just ends
                    return
                await self._call.future
                return
            kind = ev.get("ev")
            if kind == "ready":
                self.ready = True
                continue
            if kind == "overflow":
                yield Change("overflow", b"", False)
                continue
            data = ev.get("data")
            if not isinstance(data, bytes):
                raise GuestProtocolError("file.watch change event without its path")
            yield Change(str(ev.get("kind")), data, bool(ev.get("dir")))

    async def wait_ready(self, timeout: float = 30.0) -> None:
        """Until the guest reports the watch set up (changes before it are not seen)."""
        while not self.ready:
            ev = await self._call.next_event(timeout)
            if ev is None:
                await self._call.future
                raise GuestProtocolError("file.watch ended before it was ready")
            if ev.get("ev") != "ready":
                raise GuestProtocolError("file.watch sent a change before ready")
            self.ready = True

    async def close(self) -> None:
        """End the watch in the guest; an ``async for`` over it (in another task) ends too."""
        self.closed = True
        if not self._call.future.done():
            self._call.cancel()
        self._conn._forget(self._call)


def _tar_producer(
    src: str,
    chunks: queue.Queue[bytes | BaseException | None],
    stop: threading.Event,
    exclude: list[str] | None = None,
) -> None:
    """A pax tar of the local directory ``src`` into ``chunks`` (pieces of ``TREE_CHUNK``),
    without what ``exclude`` matches (read as :meth:`WorkspaceAPI.download_tree` reads it in
    the guest: the same matcher, so a glob means the same both ways; an excluded directory is
    not entered). Headers are made by hand (tarfile's ``add`` cost more than the guest's
    extraction); names in byte order, a directory before what it holds, as tar writes them."""

    def emit(piece: bytearray) -> None:
        if stop.is_set():
            raise InterruptedError("upload stopped")
        chunks.put(bytes(piece))

    try:
        overrides = _excluding(exclude) if exclude else None
        out = tarhead.Pieces(TREE_CHUNK, emit)
        root = os.open(src, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            info = os.fstat(root)
            out.put(_local_header(b".", info, tarhead.DIRECTORY))  # src's own mode and mtime
            _tar_local_tree(root, b"", out, overrides)
        finally:
            os.close(root)
        out.finish()
        chunks.put(None)
    except BaseException as exc:
        chunks.put(exc)


def _local_header(rel: bytes, info: os.stat_result, kind: bytes, size: int = 0, link: bytes = b"") -> bytes:
    return tarhead.header(rel, stat.S_IMODE(info.st_mode), info.st_uid, info.st_gid, size, info.st_mtime_ns, kind, link)


_LOCAL_SPECIAL = {stat.S_IFIFO: b"6", stat.S_IFCHR: b"3", stat.S_IFBLK: b"4"}  # the guest refuses each by name


def _tar_local_tree(dirfd: int, here: bytes, out: tarhead.Pieces, overrides: Overrides | None) -> None:
    """The entries below the directory ``dirfd`` (``here`` in the archive) into ``out``.
    Symlinks are archived as links, never followed; a file with several names in the tree is
    archived under each (the guest takes no hard links); sockets are left out, as tar does."""
    stack: list[tuple[int, bytes, list[bytes]]] = [
        (dirfd, here, sorted(map(os.fsencode, os.listdir(dirfd)), reverse=True))
    ]
    try:
        while stack:
            fd, here, todo = stack[-1]
            if not todo:
                stack.pop()
                if fd != dirfd:
                    os.close(fd)
                continue
            name = todo.pop()
            rel = here + b"/" + name if here else name
            info = os.stat(name, dir_fd=fd, follow_symlinks=False)
            kind = stat.S_IFMT(info.st_mode)
            if overrides is not None and overrides.decide(rel, kind == stat.S_IFDIR) == "skip":
                continue
            if kind == stat.S_IFREG:
                file = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                try:
                    info = os.fstat(file)  # the size at open is what the header says
                    out.put(_local_header(rel, info, tarhead.REGULAR, info.st_size))
                    out.file(file, info.st_size)
                finally:
                    os.close(file)
            elif kind == stat.S_IFDIR:
                out.put(_local_header(rel, info, tarhead.DIRECTORY))
                sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                try:
                    names = _names_to_visit(sub)
                except BaseException:
                    os.close(sub)
                    raise
                stack.append((sub, rel, names))
            elif kind == stat.S_IFLNK:
                out.put(_local_header(rel, info, tarhead.SYMLINK, link=os.readlink(name, dir_fd=fd)))
            elif kind in _LOCAL_SPECIAL:
                out.put(_local_header(rel, info, _LOCAL_SPECIAL[kind]))
    finally:
        for fd, _, _ in stack:
            if fd != dirfd:
                os.close(fd)


def _names_to_visit(dirfd: int) -> list[bytes]:
    """The names in ``dirfd``, sorted so that pop() gives them in byte order."""
    return sorted(map(os.fsencode, os.listdir(dirfd)), reverse=True)


def _excluding(exclude: list[str]) -> Overrides:
    """The matcher of tree.download's ``exclude`` globs (the guest's: pure Python, no I/O):
    ``decide(rel, is_dir) == "skip"`` leaves an entry out, and a directory's contents."""
    from guestd.files.ignore import Overrides

    return Overrides(["!" + g for g in exclude])


class WorkspaceAPI:
    """:class:`~guestd.client.AsyncClient`'s workspace methods (a mixin over its ``_conn``)."""

    _conn: ClientConnection

    # -- edit ---------------------------------------------------------------------------
    async def view(
        self,
        path: WirePath,
        *,
        start_line: int | None = None,
        end_line: int | None = None,
        deadline: float | None = DEFAULT_DEADLINE,
    ) -> View:
        """A file's lines numbered like ``cat -n`` (a range with ``start_line``/``end_line``),
        or a directory listed two levels deep."""
        args = present(path=path_to_wire(path), start_line=start_line, end_line=end_line)
        b = await self._conn.request("file.view", args, deadline)
        return View(
            b["kind"], b["content"], b.get("start_line"), b.get("end_line"), b.get("total_lines"), b["truncated"]
        )

    async def str_replace(
        self, path: WirePath, old: str, new: str, *, deadline: float | None = DEFAULT_DEADLINE
    ) -> EditResult:
        """Replace the one occurrence of ``old``; none or several are a ``conflict`` error with
        ``details.matches`` and ``details.lines``."""
        args = {"path": path_to_wire(path), "old": old, "new": new}
        return _edit(await self._conn.request("file.str_replace", args, deadline))

    async def insert(
        self, path: WirePath, line: int, text: str, *, deadline: float | None = DEFAULT_DEADLINE
    ) -> EditResult:
        """Insert ``text`` as whole lines after ``line`` (0: at the top)."""
        args = {"path": path_to_wire(path), "line": line, "text": text}
        return _edit(await self._conn.request("file.insert", args, deadline))

    async def replace_lines(
        self,
        path: WirePath,
        start_line: int,
        end_line: int,
        text: str,
        *,
        deadline: float | None = DEFAULT_DEADLINE,
    ) -> EditResult:
        args = {"path": path_to_wire(path), "start_line": start_line, "end_line": end_line, "text": text}
        return _edit(await self._conn.request("file.replace_lines", args, deadline))

    async def undo(self, path: WirePath, *, deadline: float | None = DEFAULT_DEADLINE) -> EditResult:
        """Revert this file's last edit, byte for byte."""
        return _edit(await self._conn.request("file.undo", {"path": path_to_wire(path)}, deadline))

    async def apply_patch(
        self,
        path: WirePath,
        patch: bytes | str,
        *,
        strip: int | None = None,
        deadline: float | None = DEFAULT_DEADLINE,
    ) -> list[PatchedFile]:
        """Apply a unified diff under ``path``, all or nothing (a ``conflict`` error lists the
        hunks that did not apply in ``details.hunks``). Returns the files changed."""
        if isinstance(patch, str):
            patch = patch.encode()
        args = present(path=path_to_wire(path), patch=patch, strip=strip)
        body: FileApplyPatchReply = cast(
            "FileApplyPatchReply", await self._conn.request("file.apply_patch", args, deadline)
        )
        return [PatchedFile.from_wire(f) for f in body["files"]]

    # -- search -------------------------------------------------------------------------
    async def glob(
        self,
        path: WirePath,
        pattern: str,
        *,
        gitignore: bool | None = None,
        hidden: bool | None = None,
        max_results: int | None = None,
        timeout_s: float | None = None,
        deadline: float | None = None,
    ) -> GlobResult:
        """Paths under ``path`` that ``pattern`` matches, sorted by bytes (``max_results`` of
        ``total``). ``pattern`` is one glob read as :meth:`grep`'s ``globs`` are (ripgrep's
        ``--glob``): without a ``/`` it matches a name at any depth (``*.py``), with one it is
        anchored to ``path`` (``src/*.py``; ``/*.py`` for the top only; ``**/`` crosses
        directories); a trailing ``/`` matches directories only."""
        args = present(
            path=path_to_wire(path),
            pattern=pattern,
            gitignore=gitignore,
            hidden=hidden,
            max_results=max_results,
            timeout_s=timeout_s,
        )
        b = await self._conn.request("file.glob", args, _search_deadline(timeout_s, deadline))
        return GlobResult(b["paths"], b["total"], b["truncated"], b.get("bound"))

    async def grep(
        self,
        path: WirePath,
        pattern: str,
        *,
        literal: bool | None = None,
        ignore_case: bool | None = None,
        globs: list[str] | None = None,
        context: int | None = None,
        max_matches: int | None = None,
        gitignore: bool | None = None,
        hidden: bool | None = None,
        engine: GrepEngine | None = None,
        timeout_s: float | None = None,
        deadline: float | None = None,
    ) -> GrepResult:
        """Matching lines (and ``context`` lines around them) under ``path``, found by ripgrep in the
        guest (its regex syntax; a line longer than 4096 bytes comes cut, with ``truncated``)."""
        args = present(
            path=path_to_wire(path),
            pattern=pattern,
            literal=literal,
            ignore_case=ignore_case,
            globs=globs,
            context=context,
            max_matches=max_matches,
            gitignore=gitignore,
            hidden=hidden,
            engine=engine,
            timeout_s=timeout_s,
        )
        wait = _search_deadline(timeout_s, deadline)
        call = self._conn.start("file.grep", args)
        lines: list[GrepLine] = []
        try:
            async with asyncio.timeout(wait):
                while True:
                    ev = await call.next_event(None)
                    if ev is None:
                        break
                    data = ev.get("data")
                    if not isinstance(data, bytes):
                        raise GuestProtocolError("file.grep line event without its line")
                    lines.append(GrepLine(ev["ev"], ev["path"], ev["line"], data, bool(ev.get("truncated"))))
                b = await self._conn.wait(call, None)
        except BaseException:
            self._conn._forget(call)
            raise
        return GrepResult(lines, b["matches"], b["files"], b["truncated"], b["timed_out"], b["engine"])

    # -- trees --------------------------------------------------------------------------
    async def write_files(
        self,
        files: Mapping[WirePath, bytes | str],
        *,
        parents: bool | None = None,
        deadline: float | None = DEFAULT_DEADLINE,
    ) -> int:
        """Write several files in one request (all prepared before any is renamed into place)."""
        items = [{"path": path_to_wire(p), "data": d.encode() if isinstance(d, str) else d} for p, d in files.items()]
        args = present(files=items, parents=parents)
        return int((await self._conn.request("file.write_many", args, deadline))["written"])

    async def upload_tree(
        self,
        src: str | bytes,
        dst: WirePath,
        *,
        replace: bool | None = None,
        parents: bool | None = None,
        exclude: list[str] | None = None,
        progress: Progress | None = None,
        deadline: float | None = None,
        progress_timeout: float | None = DEFAULT_DEADLINE,
    ) -> TreeUpload:
        """Upload the local directory ``src`` (or ``src`` bytes holding a tar archive) as the new
        guest directory ``dst``, which appears whole or not at all. ``exclude``: globs left out
        (with everything below a directory that matches), as :meth:`download_tree` reads them;
        not for an archive given as bytes."""
        if exclude and isinstance(src, bytes):
            raise ValueError("upload_tree: exclude applies to a local directory, not to an archive's bytes")
        call = self._conn.start("tree.upload", present(path=path_to_wire(dst), replace=replace, parents=parents))
        loop = asyncio.get_running_loop()
        chunks: queue.Queue[bytes | BaseException | None] = queue.Queue(maxsize=8)
        stop = threading.Event()
        if isinstance(src, bytes):
            data_iter: Any = (src[i : i + TREE_CHUNK] for i in range(0, len(src), TREE_CHUNK))
        else:
            data_iter = None
            threading.Thread(target=_tar_producer, args=(src, chunks, stop, exclude), daemon=True).start()
        try:
            async with asyncio.timeout(TRANSFER_DEADLINE if deadline is None else deadline):
                while True:
                    if data_iter is not None:
                        item: bytes | BaseException | None = next(data_iter, None)
                    else:
                        item = await loop.run_in_executor(None, chunks.get)
                    if isinstance(item, BaseException):
                        raise item
                    if item is None:
                        break
                    await call.send_input({"data": item}, progress_timeout)
                    if progress is not None:
                        progress(len(item))
                await call.send_input({"eof": True}, progress_timeout)
                b = await self._conn.wait(call, progress_timeout)
        except BaseException:
            stop.set()
            while not chunks.empty():  # the producer may wait to put: let it see the stop
                chunks.get_nowait()
            self._conn._forget(call)
            raise
        return TreeUpload(b["entries"], b["bytes"])

    @overload
    async def download_tree(
        self,
        src: WirePath,
        dst: None = None,
        *,
        include: list[str] | None = None,
        exclude: list[str] | None = None,
        gitignore: bool | None = None,
        max_bytes: int | None = None,
        chunk: int | None = None,
        progress: Progress | None = None,
        deadline: float | None = None,
        progress_timeout: float | None = DEFAULT_DEADLINE,
    ) -> bytes: ...

    @overload
    async def download_tree(
        self,
        src: WirePath,
        dst: str,
        *,
        include: list[str] | None = None,
        exclude: list[str] | None = None,
        gitignore: bool | None = None,
        max_bytes: int | None = None,
        chunk: int | None = None,
        progress: Progress | None = None,
        deadline: float | None = None,
        progress_timeout: float | None = DEFAULT_DEADLINE,
    ) -> int: ...

    async def download_tree(
        self,
        src: WirePath,
        dst: str | None = None,
        *,
        include: list[str] | None = None,
        exclude: list[str] | None = None,
        gitignore: bool | None = None,
        max_bytes: int | None = None,
        chunk: int | None = None,
        progress: Progress | None = None,
        deadline: float | None = None,
        progress_timeout: float | None = DEFAULT_DEADLINE,
    ) -> bytes | int:
        """The guest directory ``src`` as a tar archive: extracted into the new local directory
        ``dst`` (returns the archive's size), or returned as bytes (at most ``max_bytes``,
        default 256 MiB). ``chunk`` bounds each data event (default: the guest's max_chunk)."""
        cap = max_bytes if max_bytes is not None else (TREE_MEMORY_CAP if dst is None else None)
        args = present(path=path_to_wire(src), include=include, exclude=exclude, gitignore=gitignore, chunk=chunk)
        call = self._conn.start("tree.download", args)
        # In memory: one BytesIO, whose getvalue() hands its buffer over without a copy; a list of
        # pieces joined at the end held the archive twice and faulted in twice its pages (the join
        # was a sixth of the client's CPU for a 120 MB tree; a growing bytearray copied it over and over).
        spool: io.BytesIO | IO[bytes] = (
            tempfile.TemporaryFile() if dst is not None else io.BytesIO()  # noqa: SIM115 - closed below
        )
        got = 0
        try:
            async with asyncio.timeout(TRANSFER_DEADLINE if deadline is None else deadline):
                while True:
                    ev = await call.next_event(progress_timeout)
                    if ev is None:
                        break
                    data = ev.get("data")
                    if not isinstance(data, bytes):
                        continue
                    got += len(data)
                    if cap is not None and got > cap:
                        raise GuestProtocolError(f"tree.download: more than {cap} bytes")
                    spool.write(data)
                    if progress is not None:
                        progress(len(data))
                b = await self._conn.wait(call, progress_timeout)
            if b["bytes"] != got:
                raise GuestProtocolError(f"tree.download: guest reports {b['bytes']} bytes, received {got}")
            if isinstance(spool, io.BytesIO):
                return spool.getvalue()
            assert dst is not None
            spool.seek(0)
            await asyncio.get_running_loop().run_in_executor(None, _extract_local, spool, dst)
            return got
        except BaseException:
            self._conn._forget(call)
            raise
        finally:
            spool.close()

    # -- change feed --------------------------------------------------------------------
    def watch(
        self,
        path: WirePath,
        *,
        include: list[str] | None = None,
        exclude: list[str] | None = None,
        latency_s: float | None = None,
    ) -> Watch:
        """Changes under ``path`` as they happen: ``async for change in client.watch(p)``;
        ``await w.wait_ready()`` first to know from when changes are seen."""
        args = present(path=path_to_wire(path), include=include, exclude=exclude, latency_s=latency_s)
        return Watch(self._conn, self._conn.start("file.watch", args))

    async def changes(self, cursor: int | None = None, *, deadline: float | None = DEFAULT_DEADLINE) -> Changes:
        """What changed in the workspace since ``cursor`` (None: just the current cursor)."""
        b = await self._conn.request("file.changes", present(cursor=cursor), deadline)
        return Changes.from_body(b["cursor"], b["changes"])


def _search_deadline(timeout_s: float | None, deadline: float | None) -> float:
    if deadline is not None:
        return deadline
    return (30.0 if timeout_s is None else timeout_s) + SEARCH_MARGIN


def _extract_local(spool: Any, dst: str) -> None:
    """Extract a guest's archive on this host: a new directory, tarfile's ``data`` filter."""
    os.makedirs(dst, exist_ok=False)
    with tarfile.open(fileobj=spool, mode="r:") as tar:
        members = tar.getmembers()
        tar.extractall(dst, members=members, filter="data")
    # The data filter leaves directories at the default mode: give them the archive's (its
    # other checks, names and links inside dst, have passed), deepest first.
    for m in sorted((m for m in members if m.isdir()), key=lambda m: -m.name.count("/")):
        path = os.path.join(dst, m.name)
        if os.path.isdir(path) and not os.path.islink(path):
            os.chmod(path, m.mode & 0o777)
            os.utime(path, (m.mtime, m.mtime))
