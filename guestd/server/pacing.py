"""Work starts a few at a time per loop iteration, so the control plane never waits behind it.

A ping is answered inside ``data_received``, so it waits for the loop iteration in progress to
end. Under a flood (64 clients looping ``exec``, more than the loop can serve) each iteration
ran every request that had arrived during the one before, and all of their later steps: the
iteration grew with the requests in flight (26-33 ms at 64 clients) and ping p99 with it. Here
the handlers of workload ops (exec, files, code, process, shell, port) start at most
:data:`STARTS_PER_ITERATION` per iteration, in arrival order across connections; the rest wait
their turn, so an iteration holds a bounded batch of work whatever the number of clients, and
the loop polls its sockets between batches. Control ops (ping, info, snapshot, clock, metrics)
are not paced. An op admitted while fewer than that many started in this iteration starts at
once: an unloaded guestd pays one counter and one ``call_soon`` per iteration.

Pacing bounds how many start, not how many run: a request that waits for another (a cell
queued behind a context's running one) never holds back a later one's start, so it cannot
deadlock.
"""

from __future__ import annotations

import asyncio
from collections import deque

from guestd.server.admission import Turn
from guestd.wire.schema import OPS_BY_NAME

STARTS_PER_ITERATION = 8
# Capabilities whose ops run work the workload's data decides the cost of; the rest are control.
PACED_CAPABILITIES = frozenset({"exec", "files", "code", "process", "shell", "port"})
PACED_OPS = frozenset(spec.name for spec in OPS_BY_NAME.values() if spec.capability in PACED_CAPABILITIES)


class StartPacer(Turn):
    """The admission chain's ``pace`` step: :meth:`check` gives a paced op's request itself
    as its gate, whose :meth:`wait` returns when the request may start. It is a
    :class:`~guestd.server.admission.Turn`: the chain's later checks (the snapshot gate) run
    when the turn comes, so a request that waited does not start inside a restore or a
    quiescing prepare that began meanwhile."""

    def __init__(self, per_iteration: int = STARTS_PER_ITERATION) -> None:
        self.per_iteration = per_iteration
        self._started = 0  # starts in this iteration
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._armed = False  # a _next_iteration is scheduled

    def check(self, op: str) -> StartPacer | None:
        return self if op in PACED_OPS else None

    async def wait(self) -> None:
        if not self._waiting and self._started < self.per_iteration:
            self._started += 1
            self._arm()
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(turn)
        self._arm()
        await turn  # cancelled while waiting: the turn is skipped when it comes

    def _arm(self) -> None:
        if not self._armed:
            self._armed = True
            # Runs in the next iteration, after the loop has polled its sockets (uvloop and
            # asyncio run only the callbacks that were ready when an iteration began).
            asyncio.get_running_loop().call_soon(self._next_iteration)

    def _next_iteration(self) -> None:
        self._armed = False
        self._started = 0
        while self._waiting and self._started < self.per_iteration:
            turn = self._waiting.popleft()
            if not turn.done():  # a cancelled request's turn goes to the next
                turn.set_result(None)
                self._started += 1
        if self._waiting or self._started:
            self._arm()
