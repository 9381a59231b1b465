"""snapshot capability: prepare, resume, restore (see guestd.snapshot)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the generated message types: annotations only, never imported at run time
    from guestd.server.connection import RequestContext
    from guestd.server.daemon import Daemon
    from guestd.wire.types import (
        SnapshotPrepareArgs,
        SnapshotPrepareReply,
        SnapshotRestoreArgs,
        SnapshotRestoreReply,
        SnapshotResumeArgs,
        SnapshotResumeReply,
    )

# Ops that never wait behind a quiesce (health checks and the snapshot ops themselves).
UNGATED_WHEN_QUIESCED = frozenset({"ping", "info", "snapshot.prepare", "snapshot.resume", "snapshot.restore"})


def register(daemon: Daemon) -> None:
    state = daemon.snapshot

    async def op_prepare(ctx: RequestContext, a: SnapshotPrepareArgs) -> SnapshotPrepareReply:
        return await state.prepare(a["quiesce"], a["timeout_s"])

    async def op_resume(ctx: RequestContext, a: SnapshotResumeArgs) -> SnapshotResumeReply:
        state.resume()
        return {}

    async def op_restore(ctx: RequestContext, a: SnapshotRestoreArgs) -> SnapshotRestoreReply:
        return await state.restore(a, ctx.conn)

    daemon.dispatcher.add("snapshot.prepare", op_prepare)
    daemon.dispatcher.add("snapshot.resume", op_resume)
    daemon.dispatcher.add("snapshot.restore", op_restore)
