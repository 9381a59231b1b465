"""snapshot handlers: prepare, resume, restore (engine: state.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the generated message types: annotations only, never imported at run time
    from guestd.services import Request, Services
    from guestd.wire.types import (
        ClockCheckArgs,
        ClockCheckReply,
        SnapshotPrepareArgs,
        SnapshotPrepareReply,
        SnapshotRestoreArgs,
        SnapshotRestoreReply,
        SnapshotResumeArgs,
        SnapshotResumeReply,
    )

from guestd.snapshot.state import SnapshotState


def register(services: Services) -> SnapshotState:
    """Registers the ops; the daemon keeps the state (it gates requests and reads hellos)."""
    state = SnapshotState(services)
    services.info.append(lambda: {"snapshot": state.describe()})

    async def op_prepare(ctx: Request, a: SnapshotPrepareArgs) -> SnapshotPrepareReply:
        return await state.prepare(a["quiesce"], a["timeout_s"], a["freeze"], a["fsfreeze"], a["freeze_max_s"])

    async def op_resume(ctx: Request, a: SnapshotResumeArgs) -> SnapshotResumeReply:
        await state.resume()
        return {}

    async def op_restore(ctx: Request, a: SnapshotRestoreArgs) -> SnapshotRestoreReply:
        return await state.restore(a, ctx.connection)

    async def op_clock_check(ctx: Request, a: ClockCheckArgs) -> ClockCheckReply:
        return state.check_clock(a["time_ns"])

    services.ops.add("snapshot.prepare", op_prepare)
    services.ops.add("clock.check", op_clock_check)
    services.ops.add("snapshot.resume", op_resume)
    services.ops.add("snapshot.restore", op_restore)
    return state
