"""Kept runs from the client: start a ``shell.run`` / ``code.run`` that outlives the
connection, then fetch its result by id (``run.get``, ``run.wait``, ``run.list``).

``AsyncClient.shell_run(..., keep=True)`` and ``code_run(..., keep=True)`` wait for the
result as usual (it carries ``run_id``); :func:`start_kept` returns the run id as soon as the
guest has kept the run and lets the request go (the run goes on)::

    rid = await start_kept(client, "code.run", {"code": "import time; time.sleep(3); 42"})
    ...  # disconnect, reconnect
    rec = await client2.run_wait(rid, timeout_s=30)
    print(result_of(rec).text)  # '42'

or hold it: ``async with client2.kept_run(rid) as run: print((await run.result(timeout_s=30)).text)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from guestd.client.replies import RunInfo
from guestd.client.results import result_of
from guestd.wire.errors import ErrorCode, GuestdError

if TYPE_CHECKING:
    from guestd.client.aio import AsyncClient

# result_of (a kept run's result typed) lives in results.py, below the handles that use it.
__all__ = ["result_of", "run_cancel", "run_get", "run_list", "run_wait", "start_kept"]


async def start_kept(client: AsyncClient, op: str, args: dict[str, Any], timeout: float = 30.0) -> str:
    """Start ``op`` (shell.run or code.run) with ``keep: true``; its run id once the guest has
    kept it (the request is then let go: the run does not depend on it)."""
    conn = client._conn
    call = conn.start(op, {**args, "keep": True})
    try:
        ev = await call.next_event(timeout)
        if ev is None or ev.get("ev") != "kept" or not isinstance(ev.get("run_id"), str):
            await conn.wait(call, timeout)  # the error that ended it, if that is what happened
            raise GuestdError(ErrorCode.INTERNAL, f"{op}: the guest did not keep the run")
        return str(ev["run_id"])
    finally:
        conn._forget(call)


async def run_get(client: AsyncClient, run_id: str, *, deadline: float | None = 30.0) -> RunInfo:
    return await client.run_get(run_id, deadline=deadline)


async def run_wait(client: AsyncClient, run_id: str, *, timeout_s: float | None = None) -> RunInfo:
    """The run once it has ended, or as it is after ``timeout_s`` (``state`` running)."""
    return await client.run_wait(run_id, timeout_s=timeout_s)


async def run_cancel(client: AsyncClient, run_id: str, *, timeout_s: float | None = None) -> RunInfo:
    """Interrupt a running kept run; the run once it has ended (failed, error cancelled)."""
    return await client.run_cancel(run_id, timeout_s=timeout_s)


async def run_list(client: AsyncClient, *, deadline: float | None = 30.0) -> list[RunInfo]:
    return await client.run_list(deadline=deadline)
