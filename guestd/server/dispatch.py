"""Op name -> handler. Each capability module registers its ops against the schema.

A capability may be declared instead of registered: its ops are served (the hello lists them,
the session core admits them) and the first request for one of them registers the capability
then. Start-up does not pay for importing capabilities nobody has used yet (start to
first reply, idle memory)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

from guestd.server.request import Handler
from guestd.wire.errors import ErrorCode, GuestdError
from guestd.wire.record import Record
from guestd.wire.schema import OPS_BY_NAME, OpSpec

Result = Mapping[str, Any]
InlineHandler = Callable[[Any], Result]


class Route(Record):  # not a frozen dataclass or NamedTuple: declared at every start (start to first reply)
    __slots__ = ("bulk_reply", "control", "handler", "inline", "spec")

    def __init__(
        self,
        spec: OpSpec,
        handler: Handler | None = None,
        inline: InlineHandler | None = None,
        bulk_reply: bool = False,
        control: bool = False,
    ) -> None:
        self.spec: Final = spec
        self.handler: Final = handler
        self.inline: Final = inline  # cheap, non-blocking: answered inside data_received
        self.bulk_reply: Final = bulk_reply  # the reply is built whole in memory (up to a limit): built a few at a time
        # cheap and bounded whatever the workload does: started at once, not in its turn (server.pacing)
        self.control: Final = control or inline is not None


class Dispatcher:
    def __init__(self) -> None:
        self.routes: dict[str, Route] = {}
        self.specs: dict[str, OpSpec] = {}  # the ops served: what the session core admits
        self._loaders: dict[str, Callable[[], None]] = {}  # op -> registers its declared capability
        self.on_change: list[Callable[[str], None]] = []  # called with an op registered again

    def declare(self, capability: str, load: Callable[[], None]) -> None:
        """Serve every schema op of ``capability``; ``load`` registers them on first use."""
        for spec in OPS_BY_NAME.values():
            if spec.capability == capability and spec.name not in self.routes:
                self.specs[spec.name] = spec
                self._loaders[spec.name] = load

    def load_before(self, op: str, load: Callable[[], None]) -> None:
        """Run ``load`` before ``op`` is served the first time (after its own capability's)."""
        own = self._loaders.get(op)

        def both() -> None:
            if own is not None:
                own()
            load()

        self._loaders[op] = both

    def declared(self) -> list[str]:
        """Ops declared and not registered yet."""
        return sorted(op for op in self._loaders if op not in self.routes)

    def add(
        self,
        op: str,
        handler: Handler | None = None,
        *,
        inline: InlineHandler | None = None,
        bulk_reply: bool = False,
        control: bool = False,
    ) -> None:
        spec = OPS_BY_NAME[op]  # KeyError here is a programming error: ops must be in the schema
        if (handler is None) == (inline is None):
            raise ValueError("give exactly one of handler / inline")
        if inline is not None and any(f.type.rstrip("?") == "path" for f in spec.args):
            # paths reach a handler as os strs (the admission chain's path step), never an inline op
            raise ValueError(f"{op} takes paths: give it a handler, which gets them as os strs")
        again = op in self.routes
        self.routes[op] = Route(spec, handler, inline, bulk_reply, control)
        self.specs[op] = spec
        if again:
            for changed in self.on_change:
                changed(op)

    def route(self, op: str) -> Route:
        """The op's route; a declared capability is registered at its first request."""
        load = self._loaders.get(op)
        if load is not None:
            load()  # when it fails, the next request for the op tries again
            del self._loaders[op]
        route = self.routes.get(op)
        if route is None:
            if op in self.specs:  # a programming error: the capability did not register its own op
                raise GuestdError(ErrorCode.INTERNAL, f"{op} was declared but not registered", details={"op": op})
            raise GuestdError(ErrorCode.UNKNOWN_OP, f"unknown op {op!r}", details={"op": op})
        return route

    def capabilities(self) -> list[str]:
        return sorted({spec.capability for spec in self.specs.values()})

    def ops(self) -> list[str]:
        return sorted(self.specs)
