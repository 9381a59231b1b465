"""The admission chain: the ordered steps every request passes before its handler runs.

Cross-cutting rules (who may call an op, when a request must wait, how a handler is run) are
steps registered here instead of checks written inline in the connection, as envd's connect
interceptors are. The daemon registers the policy first; capabilities register their own (the
snapshot's gate, from ``guestd.snapshot.handlers.register``); the server's own come last (the
bulk-reply bound, path conversion). A step may:

- **check** each request by its op: raise a ``GuestdError`` to refuse it (the request gets that
  error and nothing else runs), or return a :class:`Gate` its handler waits for before it runs
  (None: no wait). A check runs before the route is resolved (``before_route``: a refused op
  registers no capability) or after it.
- **wrap** the handler of a route: called once per route (not per request), returning the
  handler as that step runs it. The first step wrapped is the outermost.

The route itself is the chain's fixed point: :meth:`AdmissionChain.admit` resolves it between the
two groups of checks (``Dispatcher.route``, which registers a declared capability at its first
request). Route and wrapped handler are kept per op, so a later request of the op costs the
checks' calls and one dict lookup (ping, exec: no more than the inline checks did).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Hashable, Mapping
from types import MappingProxyType
from typing import Any, Final, Protocol

from guestd.server.dispatch import Dispatcher, Route
from guestd.server.request import Handler, RequestContext
from guestd.wire.paths import path_from_wire
from guestd.wire.record import Record

BULK_REPLIES = 4  # replies held whole in memory (file.read, <= limits.max_read each) built at once per connection

ROUTE = "route"  # the name of the chain's fixed point in :meth:`AdmissionChain.names`

# What a wrapped handler returns when it has sent the reply itself (RequestContext.respond).
REPLIED: Mapping[str, Any] = MappingProxyType({})


class Gate(Protocol):
    """What a request waits for before its handler runs (an asyncio.Event is one)."""

    def wait(self) -> Awaitable[object]: ...


# Refuses a request (raises GuestdError) or returns what it must wait for (None: nothing): a
# gate, or a Turn (which is told where the request came from).
Check = Callable[[str], "Gate | Turn | None"]
# The handler of a route as the step runs it (the handler itself when the step does nothing to it).
Wrap = Callable[[Route, Handler], Handler]
HelloHook = Callable[[Mapping[str, Any]], None]

# What a request admitted gets: its route, its handler wrapped by every step, what it waits for.
Admitted = tuple[Route, Handler, Gate | None]


class Step(Record):  # not a frozen dataclass or NamedTuple: declared at every start (start to first reply)
    __slots__ = ("before_route", "check", "name", "wrap")

    def __init__(
        self, name: str, check: Check | None = None, wrap: Wrap | None = None, before_route: bool = False
    ) -> None:
        self.name: Final = name
        self.check: Final = check
        self.wrap: Final = wrap
        self.before_route: Final = before_route


class Turn(ABC):
    """A gate that hands out turns (guestd.server.pacing): the chain's checks after its step
    run when the request's turn comes, not at its arrival, so a request that waited for its
    turn still finds, say, the snapshot gate closed by a restore that began meanwhile.
    ``source`` is where the request came from (its connection), so turns can be shared out
    between sources rather than in arrival order alone."""

    @abstractmethod
    async def wait(self, source: Hashable) -> None: ...


class _Both:
    """Two gates, waited for in the chain's order."""

    __slots__ = ("first", "second")

    def __init__(self, first: Gate, second: Gate) -> None:
        self.first = first
        self.second = second

    async def wait(self) -> None:
        await self.first.wait()
        await self.second.wait()


class AdmissionChain:
    def __init__(self, dispatcher: Dispatcher) -> None:
        self._route = dispatcher.route
        dispatcher.on_change.append(self.forget)
        self._steps: list[Step] = []
        self._before: tuple[Check, ...] = ()  # checks before the route, in order
        self._after: tuple[Check, ...] = ()  # checks after it
        self._checks: tuple[Check, ...] = ()  # both, for a request whose route is known
        # op -> its route and wrapped handler: resolved once (Dispatcher.add calls forget() on a change)
        self._handlers: dict[str, tuple[Route, Handler]] = {}
        self.hello_hooks: list[HelloHook] = []

    # -- registration -------------------------------------------------------------------
    def add(
        self, name: str, *, check: Check | None = None, wrap: Wrap | None = None, before_route: bool = False
    ) -> None:
        """Append a step: after every step added before it, on its side of the route."""
        if any(step.name == name for step in self._steps) or name == ROUTE:
            raise ValueError(f"admission step {name!r} is already in the chain")
        if check is None and wrap is None:
            raise ValueError(f"admission step {name!r} neither checks nor wraps")
        self._steps.append(Step(name, check, wrap, before_route))
        self._rebuild()

    def remove(self, name: str) -> None:
        """Take a step out (a step whose work is done: the daemon's first-request notice)."""
        self._steps = [step for step in self._steps if step.name != name]
        self._rebuild()

    def add_hello_hook(self, hook: HelloHook) -> None:
        """Call ``hook`` with each hello accepted (after its token check passed and it was answered)."""
        self.hello_hooks.append(hook)

    def names(self) -> list[str]:
        """The chain's order, the route in its place."""
        before = [step.name for step in self._steps if step.before_route]
        return [*before, ROUTE, *(step.name for step in self._steps if not step.before_route)]

    def _rebuild(self) -> None:
        self._before = tuple(s.check for s in self._steps if s.before_route and s.check is not None)
        self._after = tuple(s.check for s in self._steps if not s.before_route and s.check is not None)
        self._checks = self._before + self._after
        self._handlers.clear()  # wrapped again at each op's next request

    # -- per request ----------------------------------------------------------------------
    def admit(self, op: str, source: Hashable) -> Admitted:
        """Run the checks in order; raises the GuestdError of the first that refuses.
        ``source``: the connection the request came on (a turn's queue is per source)."""
        routed = self._handlers.get(op)
        if routed is None:
            return self._admit_unrouted(op, source)
        # Routed before: the route is a dict entry now, so every check runs in one loop, in order.
        return routed[0], routed[1], _gate_of(self._checks, op, None, source)

    def _admit_unrouted(self, op: str, source: Hashable) -> Admitted:
        """An op's first request (or first since the chain or its route changed): the checks
        before the route, the route (a declared capability registers now), the checks after."""
        gate = _gate_of(self._before, op, None, source)
        route = self._route(op)  # raises for an op not served (and when its capability fails to register)
        routed = self._handlers[op] = (route, self._wrapped(route))
        return route, routed[1], _gate_of(self._after, op, gate, source)

    def forget(self, op: str) -> None:
        """``op``'s route changed (registered again): resolved and wrapped again at its next request."""
        self._handlers.pop(op, None)

    def hello(self, hello: Mapping[str, Any]) -> None:
        for hook in self.hello_hooks:
            hook(hello)

    def _wrapped(self, route: Route) -> Handler:
        handler = route.handler if route.handler is not None else _as_handler(route.inline)
        for step in reversed(self._steps):  # the first step added is the outermost
            if step.wrap is not None:
                handler = step.wrap(route, handler)
        return handler


def _gate_of(checks: tuple[Check, ...], op: str, gate: Gate | None, source: Hashable) -> Gate | None:
    for i, check in enumerate(checks):
        found = check(op)
        if found is None:
            continue
        if isinstance(found, Turn):  # the checks after it run when the turn comes
            found = _ThenChecks(found, checks[i + 1 :], op, source)
            return found if gate is None else _Both(gate, found)
        gate = found if gate is None else _Both(gate, found)
    return gate


class _ThenChecks:
    """A turn, then the chain's checks after it (which may refuse the request then)."""

    __slots__ = ("op", "rest", "source", "turn")

    def __init__(self, turn: Turn, rest: tuple[Check, ...], op: str, source: Hashable) -> None:
        self.turn = turn
        self.rest = rest
        self.op = op
        self.source = source

    async def wait(self) -> None:
        while True:
            await self.turn.wait(self.source)
            gate = _gate_of(self.rest, self.op, None, self.source)
            if gate is None:
                return
            # Closed meanwhile (a restore): wait, then take a turn again, so the requests it
            # held do not all start in the iteration it opens in.
            await gate.wait()


def _as_handler(inline: Any) -> Handler:
    """An inline op run as a task (it waits behind a gate)."""

    async def handler(ctx: RequestContext, args: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = inline(args)
        return result

    return handler


# -- the server's own steps ---------------------------------------------------------------------
def bound_bulk_replies(route: Route, handler: Handler) -> Handler:
    """A reply held in memory in full (``bulk_reply``: file.read): at most BULK_REPLIES are built
    at once per connection, and none while the client is not reading. The reply is sent before
    the slot is given back, so a built reply never waits outside the bound."""
    if not route.bulk_reply:
        return handler

    async def bounded(ctx: RequestContext, args: Any) -> Mapping[str, Any]:
        conn = ctx.conn
        slots = conn.step_state.get(bound_bulk_replies)
        if slots is None:
            slots = conn.step_state[bound_bulk_replies] = asyncio.Semaphore(BULK_REPLIES)
        async with slots:
            await conn.drain()
            result = await handler(ctx, args)
            ctx.respond(result)
        return REPLIED

    return bounded


def os_paths(route: Route, handler: Handler) -> Handler:
    """Hand ``path`` arguments (str or bin on the wire) to the handler as os strs, so every op
    takes names that are not UTF-8 without converting them itself."""
    names = [f.name for f in route.spec.args if f.type.rstrip("?") == "path"]
    if not names:
        return handler

    async def call(ctx: RequestContext, args: Any) -> Mapping[str, Any]:
        converted = {n: path_from_wire(args[n]) for n in names if args.get(n) is not None}
        return await handler(ctx, {**args, **converted})

    return call
