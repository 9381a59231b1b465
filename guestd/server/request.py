"""What a handler sees of its request (``RequestContext``), apart from the connection it came on.

The connection (guestd/server/connection.py) makes one per request and runs its handler as a
task; the context reaches back only through :class:`Link`, the little of a connection a request
uses, so this module imports no other module of the server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from guestd.wire.session import ServerSession, Stream

MAX_EARLY_SIGNALS = 16  # signals kept for a handler that has not started yet


class Link(Protocol):
    """What a request uses of its connection (guestd.server.connection.Connection is one)."""

    session: ServerSession
    # What admission steps keep per connection (the bulk-reply bound's semaphore), by step.
    step_state: dict[object, Any]

    @property
    def write_paused(self) -> bool: ...

    async def drain(self) -> None: ...

    def flush(self) -> None: ...


class RequestContext:
    """What a handler sees of its request: stream sending with credit, input, cancel."""

    __slots__ = (
        "_credit_waiters",
        "_early_signals",
        "_input",
        "cancel_reason",
        "cancel_shielded",
        "conn",
        "id",
        "input_handler",
        "op",
        "signal_handler",
        "stream",
        "takes_data",
        "task",
    )

    def __init__(self, conn: Link, stream: Stream) -> None:
        self.conn = conn
        self.stream = stream  # the core's handle: identity, not the id, decides what it acts on
        self.id = stream.id
        self.op = stream.op
        self.task: asyncio.Task[None] | None = None
        self._credit_waiters: list[asyncio.Future[None]] = []
        self._input: asyncio.Queue[dict[str, Any]] | None = None
        # Handlers that react to INPUT synchronously (exec signals) set this instead of reading ``input``.
        self.input_handler: Callable[[dict[str, Any]], None] | None = None
        self.signal_handler: Callable[[Any], None] | None = None
        self._early_signals: list[Any] = []
        self.takes_data = True
        # Set by a handler past its point of no return (an upload committing): a client
        # cancel then no longer interrupts it, and the reply says what really happened.
        self.cancel_shielded = False
        self.cancel_reason: str | None = None

    @property
    def active(self) -> bool:
        """False once the request's final frame went out (e.g. the core refused its input)."""
        return self.stream.open

    @property
    def connection(self) -> Link:
        return self.conn

    @property
    def write_paused(self) -> bool:
        """The connection's unsent output is over its mark: producers should wait (drain)."""
        return self.conn.write_paused

    async def drain(self) -> None:
        """Until the connection takes more output, or this request has ended (its final frame
        sent, or its connection gone): a producer never waits for a client that has left."""
        if not self.stream.open:
            return  # ended: nothing of it is sent any more, so nothing waits for the peer
        if not self.conn.write_paused:
            await self.conn.drain()  # returns at once (or raises: the connection is closing)
            return
        ended = asyncio.get_running_loop().create_future()
        self._credit_waiters.append(ended)
        drained = asyncio.ensure_future(self.conn.drain())
        try:
            await asyncio.wait((drained, ended), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if ended in self._credit_waiters:
                self._credit_waiters.remove(ended)
            if not drained.done():
                drained.cancel()
        if drained.done() and not drained.cancelled():
            drained.result()  # the connection closed: raise as conn.drain() does

    # -- server -> client stream ------------------------------------------------------
    async def send_event(self, body: dict[str, Any]) -> None:
        """Send one small, non-data EVENT (it needs no credit)."""
        self.post_event(body)
        await self.conn.drain()

    def post_event(self, body: dict[str, Any]) -> None:
        """Queue one non-data EVENT without waiting for the transport."""
        if self.conn.session.send_event(self.stream, body):
            self.conn.flush()

    async def send_data_event(self, fields: Mapping[str, Any], data: bytes | bytearray) -> None:
        """Send ``data`` as data EVENTs, each within the client's credit and max_frame.

        When ``fields`` has an ``offset`` it is the offset of ``data``'s first byte, and
        each frame carries the offset of its own first byte.
        """
        session = self.conn.session
        fields = dict(fields)
        view = memoryview(data)
        while view:
            room = session.data_room(self.stream, fields)
            if room <= 0:
                if not self.active:
                    return
                await self.wait_credit()
                continue
            piece = data if room >= len(view) and len(view) == len(data) else bytes(view[:room])
            session.send_data(self.stream, fields, piece)
            self.conn.flush()
            view = view[len(piece) :]
            if "offset" in fields:
                fields["offset"] += len(piece)
            await self.conn.drain()

    @property
    def max_frame(self) -> int:
        """The largest frame payload the client takes: replies and events must fit it."""
        return self.conn.session.peer_max_frame

    def data_room(self, fields: Mapping[str, Any]) -> int:
        """Data bytes the next frame may carry now (0: out of credit, or the request ended)."""
        return self.conn.session.data_room(self.stream, fields)

    def push_data(self, fields: Mapping[str, Any], data: bytes | bytearray) -> None:
        """Queue one data EVENT of at most :meth:`data_room` bytes without waiting."""
        if self.conn.session.send_data(self.stream, fields, data):
            self.conn.flush()

    async def wait_credit(self) -> None:
        """Until the client grants credit (or the request ends). Several tasks of one
        request may wait at once (exec's reader and its final drain); each is woken."""
        await self._wait_until(lambda: self.stream.send_credit > 0)

    async def wait_room(self, fields: Mapping[str, Any], nbytes: int) -> None:
        """Until one data EVENT with ``fields`` may carry ``nbytes`` whole (or the request
        ends): for events whose data must not be split (a grep line, a watched path)."""
        await self._wait_until(lambda: self.conn.session.data_room(self.stream, fields) >= nbytes)

    async def _wait_until(self, ready: Callable[[], bool]) -> None:
        """Until ``ready()`` or the request ends, woken at each credit grant (:meth:`on_credit`)."""
        while self.stream.open and not ready():
            waiter = asyncio.get_running_loop().create_future()
            self._credit_waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._credit_waiters:
                    self._credit_waiters.remove(waiter)

    def on_credit(self) -> None:
        waiters, self._credit_waiters = self._credit_waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    def end(self) -> None:
        """The request is over (final frame sent, or forgotten with its connection): every task
        still waiting for its credit or its connection's drain (a shielded final drain, a
        paused reader) wakes, sees the stream closed and drops what is left instead of
        holding its session, context or process for a client that will never read."""
        self.on_credit()

    # -- client -> server input -------------------------------------------------------
    @property
    def input(self) -> asyncio.Queue[dict[str, Any]]:
        if self._input is None:
            self._input = asyncio.Queue()
        return self._input

    def push_input(self, body: dict[str, Any]) -> None:
        # A signal never waits behind data (a process that does not read its stdin must
        # still be interruptible), nor for the handler to start: it goes to the signal
        # handler at once, or is kept for it.
        signal = body.pop("signal", None)
        if signal is not None:
            if self.signal_handler is not None:
                self.signal_handler(signal)
            elif len(self._early_signals) < MAX_EARLY_SIGNALS:
                self._early_signals.append(signal)
        if not body or (body.get("data") == b"" and not body.get("eof")):
            return  # nothing left to deliver (empty data frames cost no credit: never queue them)
        if self.input_handler is not None:
            self.input_handler(body)
        elif self.takes_data:
            self.input.put_nowait(body)

    def handle_signals(self, handler: Callable[[Any], None]) -> None:
        """Apply INPUT signals with ``handler`` from now on; signals that arrived before
        (in the same read as the request, say) are applied first, not lost."""
        self.signal_handler = handler
        early, self._early_signals = self._early_signals, []
        for signal in early:
            handler(signal)

    def stop_taking_data(self) -> None:
        """The handler reads no more data or eof (stdin given whole, or closed): later ones
        are dropped instead of queued for nobody."""
        self.takes_data = False
        if self._input is not None:
            while not self._input.empty():
                self._input.get_nowait()

    def ack_input(self, nbytes: int) -> None:
        """Tell the client it may send ``nbytes`` more (after we consumed them)."""
        self.conn.session.ack_input(self.stream, nbytes)
        self.conn.flush()

    def commit(self) -> None:
        """Past the point of no return (an upload's eof taken): a client cancel no longer
        interrupts the request and later input is ignored, so the reply reports what
        really happened."""
        self.cancel_shielded = True
        self.conn.session.close_input(self.stream)

    def respond(self, result: Mapping[str, Any]) -> None:
        """Send the request's final RESPONSE now (an admission step that must send the reply
        before it lets go of what it holds, as the bulk-reply bound does)."""
        self.conn.session.respond(self.stream, result)
        self.conn.flush()

    def cancel(self, reason: str) -> None:
        if self.task is not None and not self.task.done():
            self.cancel_reason = self.cancel_reason or reason
            self.task.cancel(msg=reason)


# Each handler takes its op's generated ``<Op>Args`` and returns its ``<Op>Reply``
# (guestd/wire/types.py, from the schema); here they meet as the maps the core checked.
Handler = Callable[[RequestContext, Any], Awaitable[Mapping[str, Any]]]
