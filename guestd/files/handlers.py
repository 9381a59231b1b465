"""files capability: read, write (atomic), upload/download streams, stat, list, mkdir, remove, rename.

All blocking file-system calls run in the daemon's I/O thread pool, so a slow
or stuck disk can delay file ops but never ping or exec.

Paths arrive as os strs (the dispatcher converts the wire's str-or-bin form, see
guestd.wire.paths); names that go back out pass through ``path_to_wire``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar, cast

from guestd.children.cgroups import guestd_running
from guestd.files.atomic import AtomicFile, open_atomic, write_whole
from guestd.files.entries import list_dir, make_dir, os_call, read_range, remove_path, rename_path, stat_path
from guestd.files.fs import FileSystem
from guestd.files.temps import PendingTemps
from guestd.services import add_ops, op
from guestd.wire.errors import ErrorCode, GuestdError

if TYPE_CHECKING:  # the generated message types: annotations only, never imported at run time
    from guestd.services import Request, Services
    from guestd.wire.types import (
        FileDownloadArgs,
        FileDownloadReply,
        FileListArgs,
        FileListReply,
        FileMkdirArgs,
        FileMkdirReply,
        FileReadArgs,
        FileReadReply,
        FileRemoveArgs,
        FileRemoveReply,
        FileRenameArgs,
        FileRenameReply,
        FileStatArgs,
        FileStatReply,
        FileUploadArgs,
        FileUploadReply,
        FileWriteArgs,
        FileWriteReply,
    )

log = logging.getLogger("guestd.files")

T = TypeVar("T")


class FilesCapability:
    """The files capability's ops on its one ``FileSystem`` (confined to the policy's roots,
    writes as the workload user); the workspace ops share it (guestd/files/workspace.py)."""

    def __init__(self, services: Services) -> None:
        self.services = services
        self.limits = services.config.limits
        policy = services.config.policy
        self.ids: tuple[int, int] | None
        try:
            self.ids = policy.workload_ids()
        except GuestdError:  # a missing workload user: exec and friends report it on use
            self.ids = None
        self.pending = PendingTemps(os.path.join(services.runtime_dir(), "pending-writes"))
        self.fsys = FileSystem(
            write_roots=policy.write_roots,
            read_roots=policy.read_roots,
            workspace=services.config.workspace or "",
            ids=self.ids,
            pending=self.pending,
        )

    async def _io(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in an I/O thread, OS failures mapped to typed errors."""
        return cast(T, await self.services.run_in_io(os_call, fn, *args))

    def remove_temps_left_behind(self) -> None:
        """At start: the temp files of writes a previous guestd did not finish."""
        removed = self.pending.remove_left_behind(guestd_running)
        if removed:
            log.warning("removed %d temp files of writes a previous guestd did not finish", removed)

    @op("file.read", bulk_reply=True)
    async def op_read(self, ctx: Request, a: FileReadArgs) -> FileReadReply:
        return await self._io(read_range, self.fsys, a["path"], a["offset"], a["length"], self.limits.max_read)

    @op("file.write")
    async def op_write(self, ctx: Request, a: FileWriteArgs) -> FileWriteReply:
        # snapshot.prepare waits for these, until the thread is done
        return await self.services.writes.landing(
            self._io(write_whole, self.fsys, a["path"], a["data"], a["flag"], a["perm"], a["parents"])
        )

    @op("file.stat")
    async def op_stat(self, ctx: Request, a: FileStatArgs) -> FileStatReply:
        return await self._io(stat_path, self.fsys, a["path"], a["follow"])

    @op("file.list")
    async def op_list(self, ctx: Request, a: FileListArgs) -> FileListReply:
        cap = a["max_entries"] if a["max_entries"] is not None else self.limits.max_list_entries
        return await self._io(list_dir, self.fsys, a["path"], cap)

    @op("file.mkdir")
    async def op_mkdir(self, ctx: Request, a: FileMkdirArgs) -> FileMkdirReply:
        return await self._io(make_dir, self.fsys, a["path"], a["parents"], a["perm"])

    @op("file.remove")
    async def op_remove(self, ctx: Request, a: FileRemoveArgs) -> FileRemoveReply:
        return await self._io(remove_path, self.fsys, a["path"], a["recursive"])

    @op("file.rename")
    async def op_rename(self, ctx: Request, a: FileRenameArgs) -> FileRenameReply:
        return await self._io(rename_path, self.fsys, a["src"], a["dst"], a["overwrite"])

    @op("file.upload")
    async def op_upload(self, ctx: Request, a: FileUploadArgs) -> FileUploadReply:
        self.services.writes.started()
        try:
            return await self._receive_upload(ctx, a)
        finally:
            self.services.writes.finished()

    async def _receive_upload(self, ctx: Request, a: FileUploadArgs) -> FileUploadReply:
        """The upload's stream into a temp file, put in place at eof (counted as a write in flight
        by ``op_upload``)."""
        f: AtomicFile = await self.services.acquire_in_io(
            os_call, AtomicFile.abort, open_atomic, self.fsys, a["path"], a["flag"], a["perm"], a["parents"]
        )
        # Receiving overlaps writing: while the I/O thread writes one batch, the loop takes in
        # the next, and a batch is every chunk that arrived meanwhile (one thread hop for all of
        # them). A batch's credit goes back as soon as it is written (not when the next input
        # comes: a batch may hold the whole window), so what guestd holds in memory stays
        # within the stream window as before.
        writing: asyncio.Future[None] | None = None
        received = 0
        try:
            eof = False
            while not eof:
                taking = asyncio.ensure_future(_take_input(ctx))
                try:
                    # A batch that fails (a full disk) gives no credit back, so the client may
                    # send nothing more: its error must end the upload now, not at the next input.
                    while writing is not None and not taking.done():
                        either: set[asyncio.Future[Any]] = {taking, writing}
                        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
                        if writing.done():
                            writing.result()
                            writing = None
                    batch, eof = await taking
                finally:
                    taking.cancel()  # only ever waiting on the queue's first get: nothing is lost
                for data in batch:
                    received += len(data)
                    if a["size"] is not None and received > a["size"]:
                        raise GuestdError(
                            ErrorCode.BAD_REQUEST,
                            f"more data than the declared size {a['size']}",
                            details={"field": "size"},
                        )
                if writing is not None:
                    await writing  # batches are written one at a time, in order
                    writing = None
                if batch:
                    writing = asyncio.ensure_future(self._io(_write_batch, f, batch))
                    writing.add_done_callback(partial(_ack_when_written, ctx, sum(len(d) for d in batch)))
            if writing is not None:
                await writing
                writing = None
            # Past eof the upload commits: a cancel arriving now must not answer "cancelled"
            # for a file that is then in place, so the reply reports what really happened.
            ctx.commit()
            if a["size"] is not None and f.size != a["size"]:
                raise GuestdError(
                    ErrorCode.BAD_REQUEST,
                    f"upload ended at {f.size} bytes, declared {a['size']}; old file kept",
                    details={"field": "size"},
                )
            size = await self._io(f.commit)
            return {"size": size}
        except BaseException:
            f.abort()  # close + unlink of our own temp file: quick, and must happen even on cancel
            raise

    @op("file.download")
    async def op_download(self, ctx: Request, a: FileDownloadArgs) -> FileDownloadReply:
        chunk = a["chunk"] or self.limits.max_chunk
        fd: int = await self.services.acquire_in_io(os_call, os.close, self.fsys.open_file, a["path"])
        try:
            size = os.fstat(fd).st_size
            end = size if a["length"] is None else min(size, a["offset"] + a["length"])
            pos = a["offset"]
            await ctx.send_event({"ev": "start", "size": size})
            sent = 0
            while pos < end:
                want = min(chunk, end - pos)
                # From the page cache on the loop when it is there (no thread hop per chunk);
                # from the disk in an I/O thread otherwise, so a slow disk never stalls ping.
                data: bytes | bytearray | None = _read_cached(fd, want, pos)
                if data is None:
                    data = await self._io(os.pread, fd, want, pos)
                if not data:
                    break  # file shrank while we read it
                await ctx.send_data_event({"ev": "data"}, data)
                pos += len(data)
                sent += len(data)
            return {"bytes": sent, "size": size}
        finally:
            os.close(fd)


def register(services: Services) -> None:
    files = FilesCapability(services)
    services.on_start.append(files.remove_temps_left_behind)
    add_ops(services.ops, files)
    register_workspace(services, files.fsys, files.ids)  # trees, search, edit, watch (guestd/files/workspace.py)


_RWF_NOWAIT: int | None = getattr(os, "RWF_NOWAIT", None)


def _read_cached(fd: int, n: int, offset: int) -> bytearray | None:
    """Up to ``n`` bytes at ``offset`` if the page cache holds them, without ever waiting for
    the disk (preadv2 RWF_NOWAIT); None when that would wait, or the file system cannot say
    (then the caller reads in an I/O thread, which also raises any real error, typed)."""
    if _RWF_NOWAIT is None:
        return None
    buf = bytearray(n)
    try:
        got = os.preadv(fd, [buf], offset, _RWF_NOWAIT)
    except OSError:  # EAGAIN: not cached; EOPNOTSUPP: a file system without it; others: see above
        return None
    if got == 0:
        return None  # end of file (it shrank): the I/O thread's read says so
    del buf[got:]  # a short read: the rest was not cached (or the file ends there)
    return buf  # sent as it is: the transport takes any buffer without copying it


async def _take_input(ctx: Request) -> tuple[list[bytes], bool]:
    """The next upload input and every one already queued behind it: (their data, eof seen)."""
    queue = ctx.input
    batch: list[bytes] = []
    body = await queue.get()
    while True:
        data = body.get("data")
        if isinstance(data, bytes) and data:
            batch.append(data)
        if body.get("eof"):
            return batch, True
        if queue.empty():
            return batch, False
        body = queue.get_nowait()


def _write_batch(f: AtomicFile, batch: list[bytes]) -> None:
    for data in batch:
        f.write_streaming(data)


def _ack_when_written(ctx: Request, nbytes: int, written: asyncio.Future[None]) -> None:
    """Give back a written batch's credit. A failed batch gives none: the handler meets its
    error at its next await (or, cancelled meanwhile, nobody does; reading it here keeps
    asyncio from logging it as never retrieved)."""
    if not written.cancelled() and written.exception() is None:
        ctx.ack_input(nbytes)


def register_workspace(services: Services, fsys: FileSystem, ids: tuple[int, int] | None) -> None:
    from guestd.files import workspace  # it builds on this module

    workspace.register_workspace(services, fsys, ids)
