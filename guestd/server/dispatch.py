"""Op name -> handler. Each capability module registers its ops against the schema."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from guestd.wire.errors import ErrorCode, GuestdError
from guestd.wire.paths import path_from_wire
from guestd.wire.schema import OPS_BY_NAME, OpSpec

if TYPE_CHECKING:
    from guestd.server.connection import RequestContext

# Each handler takes its op's generated ``<Op>Args`` and returns its ``<Op>Reply``
# (guestd/wire/types.py, from the schema); here they meet as the maps the core checked.
Args = Any
Result = Mapping[str, Any]
Handler = Callable[["RequestContext", Any], Awaitable[Result]]
InlineHandler = Callable[[Any], Result]


@dataclass(frozen=True)
class Route:
    spec: OpSpec
    handler: Handler | None = None
    inline: InlineHandler | None = None  # cheap, non-blocking: answered inside data_received
    bulk_reply: bool = False  # the reply is built whole in memory (up to a limit): built a few at a time


class Dispatcher:
    def __init__(self) -> None:
        self.routes: dict[str, Route] = {}
        self.specs: dict[str, OpSpec] = {}  # the ops served: what the session core admits

    def add(
        self,
        op: str,
        handler: Handler | None = None,
        *,
        inline: InlineHandler | None = None,
        bulk_reply: bool = False,
    ) -> None:
        spec = OPS_BY_NAME[op]  # KeyError here is a programming error: ops must be in the schema
        if (handler is None) == (inline is None):
            raise ValueError("give exactly one of handler / inline")
        if handler is not None:
            handler = _with_os_paths(spec, handler)
        elif any(f.type.rstrip("?") == "path" for f in spec.args):
            raise ValueError(f"{op} takes paths: give it a handler, which gets them as os strs")
        self.routes[op] = Route(spec, handler, inline, bulk_reply)
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


def _with_os_paths(spec: OpSpec, handler: Handler) -> Handler:
    """Hand ``path`` arguments (str or bin on the wire) to the handler as os strs, so every
    op takes names that are not UTF-8 without converting them itself."""
    names = [f.name for f in spec.args if f.type.rstrip("?") == "path"]
    if not names:
        return handler

    async def call(ctx: RequestContext, args: Args) -> Result:
        converted = {n: path_from_wire(args[n]) for n in names if args.get(n) is not None}
        return await handler(ctx, {**args, **converted})

    return call
