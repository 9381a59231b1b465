"""Work starts a few handlers per loop iteration, so the control plane never waits behind it.

A ping is answered inside ``data_received``, so it waits for the loop iteration in progress to
end. Under a flood (64 clients looping ``exec``, more than the loop can serve) each iteration
ran every request that had arrived during the one before, and all of their later steps: the
iteration grew with the requests in flight (26-33 ms at 64 clients) and ping p99 with it. Here
at most :data:`STARTS_PER_ITERATION` handlers start per iteration; the rest wait their turn, so
an iteration holds a bounded batch of work whatever the number of clients, and the loop polls
its sockets between batches.

Turns go round robin across connections, in arrival order within each: a client that sends a
thousand requests at once waits behind itself, and another client's next request takes one of
the next iteration's turns, not the thousand-and-first. A request handed a turn resumes in the
next iteration: until it has, a new request waits for a turn too, rather than start ahead of it.

Every op is work unless its capability registered it as ``control`` (cheap and bounded whatever
the workload does: the snapshot ops, clock, metrics, signals and interrupts, the run, process,
shell and code tables) or inline (ping, info): those start at once. An op admitted while fewer
than the bound started in this iteration starts at once too, so an unloaded guestd pays one
counter and one ``call_soon`` per iteration.

Pacing bounds how many start, not how many run: a request that waits for another (a cell
queued behind a context's running one) never holds back a later one's start, so it cannot
deadlock.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Hashable, Mapping

from guestd.server.admission import Turn
from guestd.server.dispatch import Route

STARTS_PER_ITERATION = 8


class StartPacer(Turn):
    """The admission chain's ``pace`` step: :meth:`check` gives a work op's request the pacer
    as its gate, whose :meth:`wait` returns when the request may start. It is a
    :class:`~guestd.server.admission.Turn`: the chain's later checks (the snapshot gate) run
    when the turn comes, so a request that waited does not start inside a restore or a
    quiescing prepare that began meanwhile."""

    def __init__(self, routes: Mapping[str, Route], per_iteration: int = STARTS_PER_ITERATION) -> None:
        self.per_iteration = per_iteration
        self._routes = routes  # the dispatcher's: pace comes after the route, so the op's is there
        self._started = 0  # handlers that start in this iteration
        self._granted = 0  # turns handed out in this iteration: their handlers start in the next
        # The requests waiting, per source (connection) in arrival order; a source is here, and
        # in the ring, only while it has one waiting.
        self._waiting: dict[Hashable, deque[asyncio.Future[None]]] = {}
        self._ring: deque[Hashable] = deque()  # sources with requests waiting: the next turn's on the left
        # Turns handed out whose requests have not resumed yet (they do in the next iteration):
        # while there are any, a new request waits too, or it would start ahead of them.
        self._handed = 0
        self._armed = False  # a _next_iteration is scheduled

    def check(self, op: str) -> StartPacer | None:
        route = self._routes.get(op)
        return None if route is None or route.control else self

    async def wait(self, source: Hashable) -> None:
        if not self._ring and not self._handed and self._started < self.per_iteration:
            self._started += 1
            self._arm()
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._waiting.get(source)
        if queue is None:
            queue = self._waiting[source] = deque()
            self._ring.append(source)
        queue.append(turn)
        self._arm()
        try:
            await turn  # cancelled while waiting: the turn is skipped when it comes
        finally:
            if turn.done() and not turn.cancelled():  # handed a turn (cancelled or not since)
                self._handed -= 1

    def _arm(self) -> None:
        if not self._armed:
            self._armed = True
            # Runs in the next iteration, after the loop has polled its sockets (uvloop and
            # asyncio run only the callbacks that were ready when an iteration began).
            asyncio.get_running_loop().call_soon(self._next_iteration)

    def _next_iteration(self) -> None:
        self._armed = False
        # The tasks given a turn last time run now (each woken by its future's callback, ahead
        # of this one): they count against this iteration, with whatever starts at once in it.
        self._started = self._granted
        self._granted = 0
        while self._granted < self.per_iteration:
            turn = self._next_turn()
            if turn is None:
                break
            turn.set_result(None)
            self._granted += 1
            self._handed += 1
        if self._ring or self._started or self._granted:
            self._arm()

    def _next_turn(self) -> asyncio.Future[None] | None:
        """The oldest live turn of the next source in the ring (None: nothing waits). Turns of
        cancelled requests are dropped on the way, and so is a source left with none."""
        while self._ring:
            source = self._ring.popleft()
            queue = self._waiting[source]
            turn = None
            while queue and turn is None:
                candidate = queue.popleft()
                turn = None if candidate.done() else candidate
            if queue:
                self._ring.append(source)
            else:
                del self._waiting[source]
            if turn is not None:
                return turn
        return None
