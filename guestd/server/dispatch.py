"""Op name -> handler. Each capability module registers its ops against the schema."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from guestd.wire.errors import ErrorCode, GuestdError
from guestd.wire.schema import OPS_BY_NAME, OpSpec

if TYPE_CHECKING:
    from guestd.server.connection import RequestContext

Args = dict[str, Any]
Result = dict[str, Any]
Handler = Callable[["RequestContext", Args], Awaitable[Result]]
InlineHandler = Callable[[Args], Result]


@dataclass(frozen=True)
class Route:
    spec: OpSpec
    handler: Handler | None = None
    inline: InlineHandler | None = None  # cheap, non-blocking: answered inside data_received


class Dispatcher:
    def __init__(self) -> None:
        self.routes: dict[str, Route] = {}
        self.specs: dict[str, OpSpec] = {}  # the ops served: what the session core admits

    def add(self, op: str, handler: Handler | None = None, *, inline: InlineHandler | None = None) -> None:
        spec = OPS_BY_NAME[op]  # KeyError here is a programming error: ops must be in the schema
        if (handler is None) == (inline is None):
            raise ValueError("give exactly one of handler / inline")
        self.routes[op] = Route(spec, handler, inline)
        self.specs[op] = spec

    def lookup(self, op: str) -> Route:
        route = self.routes.get(op)
        if route is None:
            raise GuestdError(ErrorCode.UNKNOWN_OP, f"unknown op {op!r}", details={"op": op})
        return route

    def capabilities(self) -> list[str]:
        return sorted({r.spec.capability for r in self.routes.values()})

    def ops(self) -> list[str]:
        return sorted(self.routes)
