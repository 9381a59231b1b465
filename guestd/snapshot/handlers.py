"""snapshot handlers: prepare, resume, restore (engine: state.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from guestd.services import add_ops, op

if TYPE_CHECKING:  # the generated message types: annotations only, never imported at run time
    import asyncio

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


class Admission(Protocol):
    """Where the snapshot hooks into the server's admission of requests and hellos
    (guestd.server.admission.AdmissionChain is one)."""

    def add(self, name: str, *, check: Callable[[str], asyncio.Event | None]) -> None: ...

    def add_hello_hook(self, hook: Callable[[Mapping[str, Any]], None]) -> None: ...


class SnapshotOps:
    """The snapshot ops: thin methods over the snapshot state (engine: state.py)."""

    def __init__(self, state: SnapshotState) -> None:
        self.state = state

    @op("snapshot.prepare", control=True)
    async def op_prepare(self, ctx: Request, a: SnapshotPrepareArgs) -> SnapshotPrepareReply:
        return await self.state.prepare(a["quiesce"], a["timeout_s"], a["freeze"], a["fsfreeze"], a["freeze_max_s"])

    @op("snapshot.resume", control=True)
    async def op_resume(self, ctx: Request, a: SnapshotResumeArgs) -> SnapshotResumeReply:
        await self.state.resume()
        return {}

    @op("snapshot.restore", control=True)
    async def op_restore(self, ctx: Request, a: SnapshotRestoreArgs) -> SnapshotRestoreReply:
        return await self.state.restore(a, ctx.connection)

    @op("clock.check", control=True)
    async def op_clock_check(self, ctx: Request, a: ClockCheckArgs) -> ClockCheckReply:
        return self.state.check_clock(a["time_ns"])


def register(services: Services, admission: Admission) -> SnapshotState:
    """Registers the ops, the gate new requests wait at while a restore or a quiescing prepare
    is in progress, and the hello hook that notices a restore the host did not announce."""
    state = SnapshotState(services)
    services.info.append(lambda: {"snapshot": state.describe()})
    admission.add("snapshot", check=state.gate)
    admission.add_hello_hook(lambda hello: state.check_host_time(hello.get("time_ns")))
    ops = SnapshotOps(state)
    add_ops(services.ops, ops)
    return state
