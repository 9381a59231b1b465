"""port handlers: port.connect / port.accept (relay streams), port.reverse, port.list,
port.watch and port.wait. Per connection, at most ``limits.max_port_streams`` relay streams
and ``limits.max_port_forwards`` reverse forwards are open; every one belongs to its request,
which the connection owns: a dropped connection resets them all."""

from __future__ import annotations

import asyncio
import errno
import itertools
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from guestd.ports.listeners import MAX_WANTED_PORTS, WAIT_INTERVALS_S, Listing, describe, probe, scan
from guestd.ports.relay import Relay, check_address, check_local, connect
from guestd.ports.reverse import Forward, reset
from guestd.services import add_ops, op
from guestd.wire.errors import ErrorCode, GuestdError, limit_error

WATCH_PACE = 10.0  # port.watch waits at least this many times as long as its last look took

if TYPE_CHECKING:
    from guestd.services import Request, Services
    from guestd.wire.types import (
        PortAcceptArgs,
        PortAcceptReply,
        PortConnectArgs,
        PortConnectReply,
        PortListArgs,
        PortListReply,
        PortReverseArgs,
        PortReverseReply,
        PortWaitArgs,
        PortWaitReply,
        PortWatchArgs,
        PortWatchReply,
    )


class PortsCapability:
    """The port ops, with what they count per connection: open relay streams and reverse
    forwards (the forwards by id, for port.accept)."""

    def __init__(self, services: Services) -> None:
        self.services = services
        self.limits = services.config.limits
        self.policy = services.config.ports
        self.streams: dict[object, int] = {}  # connection -> open relay streams
        self.forwards: dict[str, Forward] = {}
        self.forward_counts: dict[object, int] = {}  # connection -> open reverse forwards
        self.forward_ids = itertools.count(1)

    async def _relay(
        self, ctx: Request, chunk: int | None, open_socket: Callable[[Relay], Awaitable[None]]
    ) -> dict[str, Any]:
        """A relay stream of the request's connection (at most ``max_port_streams`` open), its
        socket opened by ``open_socket``; reset unless it ends cleanly."""
        owner = ctx.connection
        open_now = self.streams.get(owner, 0)
        if open_now >= self.limits.max_port_streams:
            raise _too_many(self.limits.max_port_streams, "max_port_streams")
        self.streams[owner] = open_now + 1
        r = Relay(ctx, min(chunk or self.limits.max_chunk, self.limits.max_chunk))
        ok = False
        try:
            await open_socket(r)
            result = await r.run()
            ok = True
            return result
        finally:
            r.close(reset=not ok)
            _give_back(self.streams, owner)

    @op("port.connect")
    async def op_connect(self, ctx: Request, a: PortConnectArgs) -> PortConnectReply:
        address, port, timeout_s = a["address"], a["port"], a["connect_timeout_s"]
        check_local(address)
        self.policy.check_port(port)

        return await self._relay(ctx, a["chunk"], lambda r: connect(r, address, port, timeout_s))  # type: ignore[return-value]

    @op("port.accept")
    async def op_accept(self, ctx: Request, a: PortAcceptArgs) -> PortAcceptReply:
        fwd = self.forwards.get(a["forward"])
        sock = fwd.claim(a["conn"]) if fwd is not None and fwd.owner is ctx.connection else None
        if sock is None:
            raise GuestdError(
                ErrorCode.NOT_FOUND,
                f"no connection {a['conn']} waits on forward {a['forward']!r} of this connection",
                details={"field": "conn"},
            )
        if a["refuse"]:
            reset(sock)
            return {"sent": 0, "received": 0}

        async def open_socket(r: Relay) -> None:
            r.open(sock)

        try:
            return await self._relay(ctx, a["chunk"], open_socket)  # type: ignore[return-value]
        except GuestdError as err:
            if err.details.get("limit") == "max_port_streams":
                reset(sock)
            raise

    @op("port.reverse")
    async def op_reverse(self, ctx: Request, a: PortReverseArgs) -> PortReverseReply:
        self.policy.check_reverse()
        family, loopback = check_address(a["address"])
        if not loopback:
            raise GuestdError(
                ErrorCode.PERMISSION_DENIED,
                "a reverse forward listens on a guest loopback address only",
                details={"policy": "ports.reverse", "field": "address"},
            )
        owner = ctx.connection
        with _counted(self.forward_counts, owner, self.limits.max_port_forwards, "max_port_forwards"):
            listener = socket.socket(family, socket.SOCK_STREAM)
            try:
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind((a["address"], a["port"]))
                listener.listen(128)
                listener.setblocking(False)
            except OSError as exc:
                listener.close()
                if exc.errno == errno.EADDRINUSE:
                    raise GuestdError(
                        ErrorCode.EXISTS,
                        f"guest port {a['port']} is in use",
                        errno=exc.errno,
                        details={"field": "port"},
                    ) from None
                raise GuestdError.from_os_error(exc, stage="listen") from None
            fwd = Forward(
                f"r{next(self.forward_ids)}", owner, listener, self.limits.max_port_pending, a["accept_timeout_s"]
            )
            self.forwards[fwd.id] = fwd
            tasks: list[asyncio.Future[None]] = []
            try:
                await ctx.send_event({"ev": "listening", "forward": fwd.id, "port": fwd.port})
                server = asyncio.ensure_future(fwd.serve(ctx))
                tasks += [server, asyncio.ensure_future(_until_eof(ctx))]
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                if server in done:
                    server.result()  # the listener failed: say why
                return {"accepted": fwd.accepted}
            finally:
                for t in tasks:
                    t.cancel()
                del self.forwards[fwd.id]
                fwd.close()

    async def _listed(self, listing: Listing) -> PortListReply:
        records, searched_all = await self.services.run_in_io(describe, listing)
        return {
            "listeners": records,
            "total": listing.total,
            "truncated": listing.truncated,
            "owners_truncated": not searched_all,
        }

    @op("port.list")
    async def op_list(self, ctx: Request, a: PortListArgs) -> PortListReply:
        return await self._listed(await self.services.run_in_io(scan, wanted_ports(a["ports"])))

    @op("port.watch")
    async def op_watch(self, ctx: Request, a: PortWatchArgs) -> PortWatchReply:
        wanted = wanted_ports(a["ports"])
        loop = asyncio.get_running_loop()
        end = loop.time() + a["timeout_s"]
        while True:
            began = loop.time()
            listing = await self.services.run_in_io(scan, wanted)
            took = loop.time() - began
            changed = listing.digest != a["digest"]
            if changed or loop.time() >= end:
                return {"digest": listing.digest, "changed": changed, **await self._listed(listing)}
            # The workload decides how long a look takes (how many listeners): a watch spends at
            # most about a tenth of a core on it, whatever interval_s asks.
            pause = max(a["interval_s"], WATCH_PACE * took)
            await asyncio.sleep(min(pause, max(0.0, end - loop.time())))

    @op("port.wait")
    async def op_wait(self, ctx: Request, a: PortWaitArgs) -> PortWaitReply:
        address, port = a["address"], a["port"]
        path = a["path"] if a["http"] else None
        if path is not None and (not path.startswith("/") or any(c in path for c in " \r\n\t")):
            raise GuestdError(
                ErrorCode.BAD_REQUEST, "path must start with / and hold no spaces", details={"field": "path"}
            )
        check_local(address)
        self.policy.check_port(port)
        loop = asyncio.get_running_loop()
        start = time.monotonic()
        end = loop.time() + a["timeout_s"]
        status: int | None = None
        for attempt in itertools.count():
            left = end - loop.time()
            ready, seen = await probe(address, port, max(0.05, min(2.0, left)), path)
            status = seen if seen is not None else status
            if ready or loop.time() >= end:
                reply: PortWaitReply = {"ready": ready, "elapsed_s": time.monotonic() - start}
                if path is not None:
                    reply["http_status"] = status
                return reply
            interval = WAIT_INTERVALS_S[min(attempt, len(WAIT_INTERVALS_S) - 1)]
            await asyncio.sleep(min(interval, max(0.0, end - loop.time())))
        raise AssertionError("unreachable")


def register(services: Services) -> None:
    ports = PortsCapability(services)
    add_ops(services.ops, ports)


def _too_many(limit: int, name: str) -> GuestdError:
    return limit_error(name, limit, f"more than {limit} open on this connection (limits.{name})")


@contextmanager
def _counted(table: dict[object, int], owner: object, limit: int, name: str) -> Iterator[None]:
    """One more open for ``owner`` in ``table`` while the block runs, at most ``limit`` (``name``)."""
    if table.get(owner, 0) >= limit:
        raise _too_many(limit, name)
    table[owner] = table.get(owner, 0) + 1
    try:
        yield
    finally:
        _give_back(table, owner)


def _give_back(table: dict[object, int], owner: object) -> None:
    table[owner] -= 1
    if not table[owner]:
        del table[owner]


def wanted_ports(ports: list[int] | None) -> frozenset[int] | None:
    """port.list's and port.watch's ``ports``, checked."""
    if ports is None:
        return None
    if len(ports) > MAX_WANTED_PORTS or not all(1 <= p <= 65535 for p in ports):
        raise GuestdError(
            ErrorCode.BAD_REQUEST,
            f"ports takes at most {MAX_WANTED_PORTS} ports, each 1..65535",
            details={"field": "ports"},
        )
    return frozenset(ports)


async def _until_eof(ctx: Request) -> None:
    while not (await ctx.input.get()).get("eof"):
        pass
