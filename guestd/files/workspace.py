"""The workspace ops, as methods of ``Workspace``: trees, search, edit, patch, watch and the
change feed, all on the files capability's one ``FileSystem`` (``register_workspace`` is called
by ``guestd.files.handlers.register``)."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

from guestd.files import archive, patch, search, trees
from guestd.files.atomic import write_many
from guestd.files.edit import Editor
from guestd.files.entries import os_call
from guestd.files.fs import FileSystem
from guestd.files.ignore import Overrides
from guestd.files.journal import Handoff, WorkspaceChanges, merge
from guestd.files.walk import Filter
from guestd.files.watch import Watcher, change_cost
from guestd.services import add_ops, op
from guestd.wire.errors import ErrorCode, GuestdError
from guestd.wire.paths import path_from_wire

if TYPE_CHECKING:
    from guestd.services import Request, Services
    from guestd.wire.types import (
        FileApplyPatchArgs,
        FileApplyPatchReply,
        FileChangesArgs,
        FileChangesReply,
        FileGlobArgs,
        FileGlobReply,
        FileGrepArgs,
        FileGrepReply,
        FileInsertArgs,
        FileInsertReply,
        FileReplaceLinesArgs,
        FileReplaceLinesReply,
        FileStrReplaceArgs,
        FileStrReplaceReply,
        FileUndoArgs,
        FileUndoReply,
        FileViewArgs,
        FileViewReply,
        FileWatchArgs,
        FileWatchReply,
        FileWriteManyArgs,
        FileWriteManyReply,
        TreeDownloadArgs,
        TreeDownloadReply,
        TreeUploadArgs,
        TreeUploadReply,
    )

T = TypeVar("T")
MAX_WATCH_PENDING = 10_000  # changed paths a watch holds while its client reads no more: then overflow
MAX_WATCH_PENDING_BYTES = 4 << 20  # ... and their bytes (paths are up to 4 KiB each)
OVERFLOW_EVERY_S = 1.0  # overflow events of one watch at most this often (they take no credit)


class Workspace:
    """The workspace ops on the files capability's one ``FileSystem``: edit, search, trees,
    watch and the change feed (``services.changes``)."""

    def __init__(self, services: Services, fsys: FileSystem, ids: tuple[int, int] | None) -> None:
        self.services = services
        self.fsys = fsys
        self.editor = Editor(fsys)
        self._closing: set[asyncio.Future[Any]] = set()  # closes that run after their request ended
        self.rg_user = search.search_user(ids)  # grep's rg: nobody where the workload user would be root
        self.changes = WorkspaceChanges(services, self.start_watcher)

    def _close_later(self, close: Callable[[], None]) -> None:
        """``close`` in an I/O thread, not awaited (it waits for a step still running there)."""
        fut = asyncio.ensure_future(self.services.run_in_io(close))
        self._closing.add(fut)
        fut.add_done_callback(self._closing.discard)

    async def _io(self, fn: Callable[..., T], *args: Any) -> T:
        return cast(T, await self.services.run_in_io(os_call, fn, *args))

    async def _edit(self, fn: Callable[..., T], *args: Any) -> T:
        return await self.services.writes.landing(self._io(fn, *args))  # snapshot.prepare waits for these

    # -- edit ---------------------------------------------------------------------------
    @op("file.view")
    async def op_view(self, ctx: Request, a: FileViewArgs) -> FileViewReply:
        return await self._io(self.editor.view, a["path"], a["start_line"], a["end_line"])

    @op("file.str_replace")
    async def op_str_replace(self, ctx: Request, a: FileStrReplaceArgs) -> FileStrReplaceReply:
        return await self._edit(self.editor.str_replace, a["path"], a["old"], a["new"])

    @op("file.insert")
    async def op_insert(self, ctx: Request, a: FileInsertArgs) -> FileInsertReply:
        return await self._edit(self.editor.insert, a["path"], a["line"], a["text"])

    @op("file.replace_lines")
    async def op_replace_lines(self, ctx: Request, a: FileReplaceLinesArgs) -> FileReplaceLinesReply:
        return await self._edit(self.editor.replace_lines, a["path"], a["start_line"], a["end_line"], a["text"])

    @op("file.undo")
    async def op_undo(self, ctx: Request, a: FileUndoArgs) -> FileUndoReply:
        return await self._edit(self.editor.undo, a["path"])

    @op("file.apply_patch")
    async def op_apply_patch(self, ctx: Request, a: FileApplyPatchArgs) -> FileApplyPatchReply:
        return {"files": await self._edit(patch.apply, self.fsys, a["path"], a["patch"], a["strip"])}

    # -- search -------------------------------------------------------------------------
    @op("file.glob")
    async def op_glob(self, ctx: Request, a: FileGlobArgs) -> FileGlobReply:
        reply = await self._io(
            search.glob,
            self.fsys,
            a["path"],
            a["pattern"],
            a["gitignore"],
            a["hidden"],
            a["max_results"],
            a["timeout_s"],
        )
        return cast("FileGlobReply", reply)

    @op("file.grep")
    async def op_grep(self, ctx: Request, a: FileGrepArgs) -> FileGrepReply:
        rg = search.rg_path()
        if rg is None:
            raise GuestdError(
                ErrorCode.UNAVAILABLE,
                "grep needs ripgrep (rg) in the guest: install the ripgrep package (guestd-bake does)",
                details={"reason": "no_rg"},
            )
        q = search.GrepQuery(
            a["pattern"], a["literal"], a["ignore_case"], list(a["globs"]), a["context"], a["gitignore"], a["hidden"]
        )
        deadline = asyncio.get_running_loop().time() + a["timeout_s"]
        root_fd, single = await self.services.acquire_in_io(
            os_call, lambda r: os.close(r[0]), search.open_target, self.fsys, a["path"]
        )
        try:
            outcome = await search.run_rg(
                ctx, self.services.children, rg, q, root_fd, single, self.rg_user, a["max_matches"], deadline
            )
        finally:
            os.close(root_fd)
        return {
            "matches": outcome.matches,
            "files": outcome.files,
            "truncated": outcome.truncated,
            "timed_out": outcome.timed_out,
            "engine": "rg",
        }

    # -- trees ----------------------------------------------------------------------------
    @op("file.write_many")
    async def op_write_many(self, ctx: Request, a: FileWriteManyArgs) -> FileWriteManyReply:
        items = [(path_from_wire(i["path"]), i["data"], i["perm"]) for i in a["files"]]
        written, nbytes = await self._edit(write_many, self.fsys, items, a["parents"])
        return {"written": written, "bytes": nbytes}

    @op("tree.upload")
    async def op_tree_upload(self, ctx: Request, a: TreeUploadArgs) -> TreeUploadReply:
        """The tar stream extracted by a thread of its own as its data comes, in place at eof."""
        self.services.writes.started()
        loop = asyncio.get_running_loop()
        feed = trees.Feed(lambda n: loop.call_soon_threadsafe(ctx.ack_input, n))
        done: asyncio.Future[tuple[int, int]] = loop.create_future()

        def settle(result: tuple[int, int] | None, err: BaseException | None) -> None:
            if done.done():
                return
            if err is not None:
                done.set_exception(err)
            else:
                assert result is not None
                done.set_result(result)

        def work() -> None:
            # A thread of its own, not an I/O thread: it waits for the stream as long as it lasts.
            try:
                result = os_call(trees.extract, self.fsys, a["path"], a["parents"], a["replace"], feed)
                loop.call_soon_threadsafe(settle, result, None)
            except BaseException as exc:
                loop.call_soon_threadsafe(settle, None, exc)

        threading.Thread(target=work, name="guestd-tree-upload", daemon=True).start()
        try:
            while not done.done():
                get: asyncio.Future[Any] = asyncio.ensure_future(ctx.input.get())
                await asyncio.wait([get, done], return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    break
                body = get.result()
                data = body.get("data")
                if isinstance(data, bytes) and data:
                    feed.feed(data)
                if body.get("eof"):
                    feed.finish()
                    ctx.commit()  # past eof the tree goes into place: the reply says what happened
                    break
            entries, nbytes = await done
            return {"entries": entries, "bytes": nbytes}
        except BaseException:
            feed.abort()  # the extracting thread stops and removes its temp directory
            raise
        finally:
            self.services.writes.finished()

    @op("tree.download")
    async def op_tree_download(self, ctx: Request, a: TreeDownloadArgs) -> TreeDownloadReply:
        """The tree under ``path`` as a tar stream, made by the archive's thread a piece ahead."""
        chunk = a["chunk"] or self.services.config.limits.max_chunk
        flt = Filter(globs=[*a["include"], *("!" + g for g in a["exclude"])], gitignore=a["gitignore"], skip_git=False)
        arch: archive.Archive = await self.services.acquire_in_io(
            os_call, archive.Archive.close, archive.open_archive, self.fsys, a["path"], flt, chunk
        )
        sent = 0
        try:
            while True:
                data = await arch.next_piece()
                if data is None:
                    break
                await ctx.send_data_event({"ev": "data"}, data)
                sent += len(data)
        finally:
            self._close_later(arch.close)
        return {"entries": arch.entries, "bytes": sent, "skipped": arch.skipped}

    # -- change feed ----------------------------------------------------------------------
    async def start_watcher(
        self, path: str, sink: Callable[[list[Any]], object], on_end: Callable[[BaseException], object] | None = None
    ) -> Watcher:
        """A watcher of ``path`` whose first scan is done (file.watch's and the change feed's)."""
        root_fd: int = await self.services.acquire_in_io(os_call, os.close, self.fsys.open_dir, path)
        try:
            watcher = Watcher(root_fd, sink, on_end)
        except BaseException:
            os.close(root_fd)  # no inotify instance (fs.inotify.max_user_instances)
            raise
        watcher.start()
        try:
            await self._io(watcher.ready.wait)
        except BaseException:
            # Cancelled while the first scan runs (or waits for an I/O thread): nobody would
            # ever stop the watcher, its thread and its four fds. Its thread closes them.
            watcher.stop()
            raise
        if watcher.error is not None:
            watcher.stop()
            raise watcher.error
        return watcher

    @op("file.watch")
    async def op_watch(self, ctx: Request, a: FileWatchArgs) -> FileWatchReply:
        """Change events under ``path`` until the request ends (file.watch never answers)."""
        flt = Overrides([*a["include"], *("!" + g for g in a["exclude"])])
        pending: dict[bytes, tuple[str, str, bool]] = {}  # path -> (first kind, last kind, is_dir)
        pending_bytes = 0
        overflow = False
        loop = asyncio.get_running_loop()
        said_overflow = -OVERFLOW_EVERY_S  # when the last overflow event was sent (loop time)
        deferred = False  # a wake is set for an overflow event not sent yet
        wake = asyncio.Event()
        # The watcher's thread hands changes over a bounded backlog (a slow loop or client
        # costs an overflow, never memory); only this loop touches pending.
        handoff = Handoff(loop, wake.set, keep=lambda path, is_dir: flt.decide(path, is_dir) != "skip")
        watcher = await self.start_watcher(a["path"], handoff.put, handoff.end)
        sent = 0
        try:
            await ctx.send_event({"ev": "ready"})
            while ctx.active:
                await wake.wait()
                wake.clear()
                if a["latency_s"]:
                    await asyncio.sleep(a["latency_s"])  # the coalescing window
                changes, lost, ended = handoff.take()
                overflow = overflow or lost
                for i, (kind, path, is_dir) in enumerate(changes):
                    if i % 512 == 511:
                        await asyncio.sleep(0)  # a 4 MiB backlog is taken in steps: pings go between
                    if kind == "overflow":
                        overflow = True
                    else:
                        seen = pending.get(path)
                        if seen is not None:
                            pending[path] = (seen[0], kind, is_dir)
                        elif len(pending) >= MAX_WATCH_PENDING or pending_bytes >= MAX_WATCH_PENDING_BYTES:
                            overflow = True
                        else:
                            pending[path] = (kind, kind, is_dir)
                            pending_bytes += change_cost(path)
                if overflow:
                    # Overflow events take no credit: at most one a second (a client that does
                    # not read holds a bounded count of them), the next one deferred, never lost.
                    wait = said_overflow + OVERFLOW_EVERY_S - loop.time()
                    if wait <= 0:
                        await ctx.send_event({"ev": "overflow"})
                        said_overflow = loop.time()
                        overflow = deferred = False
                        sent += 1
                    elif not deferred:
                        deferred = True
                        loop.call_later(wait, wake.set)
                while pending:
                    path = next(iter(pending))
                    first, last, is_dir = pending.pop(path)
                    pending_bytes -= change_cost(path)
                    net = merge(first, last)
                    if net is None:
                        continue  # made and removed within the window: no effect to report
                    fields = {"ev": "change", "kind": net, "dir": is_dir}
                    await ctx.wait_room(fields, len(path))
                    if not ctx.active:
                        break
                    ctx.push_data(fields, path)
                    sent += 1
                    if sent % 64 == 0:
                        await asyncio.sleep(0)  # thousands of events in a row: pings go between
                if ended is not None and not pending:
                    raise GuestdError(
                        ErrorCode.UNAVAILABLE,
                        f"the watcher ended: {ended!r}",
                        details={"reason": "watcher_ended"},
                    )
            # The loop ends only once the request has: a cancel (or the connection's end) answered
            # it already. file.watch never answers (schema final: error_only), so this is dropped.
            return {}
        finally:
            watcher.stop()

    @op("file.changes")
    async def op_changes(self, ctx: Request, a: FileChangesArgs) -> FileChangesReply:
        """What changed since ``cursor`` and a new cursor; no cursor: a first one."""
        if a["cursor"] is None:
            cursor = await self.changes.begin()
            return {"cursor": cursor, "changes": empty_report()}
        report = await self.changes.report(a["cursor"])
        return {"cursor": await self.changes.begin(), "changes": report}


def register_workspace(services: Services, fsys: FileSystem, ids: tuple[int, int] | None) -> None:
    ws = Workspace(services, fsys, ids)
    services.changes = ws.changes
    add_ops(services.ops, ws)


def empty_report() -> Any:
    return {"created": [], "modified": [], "deleted": [], "total": 0, "truncated": False, "overflow": False}
