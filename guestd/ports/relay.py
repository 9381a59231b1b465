"""One relay stream: a guest TCP socket spliced onto a request's data events and INPUT frames.

The relay adds no flow control of its own; it holds the socket to the request's credit
(PROTOCOL.md section 5), so memory per stream is bounded by the protocol's numbers:

- guest socket -> client: at most one chunk (plus one socket read) waits in guestd; past
  that guestd stops reading the socket until the client grants credit and the connection's
  output drains, so a workload that floods blocks in its own ``send``.
- client -> guest socket: the client may send one window; credit goes back only for bytes
  the socket took while its transport buffer is under ``RELAY_WRITE_HIGH``. A workload that
  accepts and never reads holds guestd to one window plus that mark, and stalls only its
  own stream.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import os
import socket
import struct
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from guestd.ports.reverse import reset
from guestd.wire.errors import ErrorCode, GuestdError

if TYPE_CHECKING:
    from guestd.services import Request

RELAY_WRITE_HIGH = 256 * 1024  # unsent bytes per guest socket before credit stops going back
FIRST_READ = 64 * 1024  # a stream's first read buffer from its guest socket (see Relay)
_DATA = {"ev": "data"}
_CONNECTED = {"ev": "connected"}
_EOF = {"ev": "eof"}
_LINGER_0 = struct.pack("ii", 1, 0)  # close() sends RST
_UNREACHABLE = {errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ENETDOWN, errno.EHOSTDOWN, errno.EADDRNOTAVAIL}


def reset_error() -> GuestdError:
    return GuestdError(
        ErrorCode.IO_ERROR,
        "the guest side reset the connection",
        errno=errno.ECONNRESET,
        details={"stage": "relay", "reason": "reset"},
    )


def connect_error(exc: BaseException, address: str, port: int, timeout_s: float) -> GuestdError:
    """The typed error of a failed connect: refused, unreachable, timed out, or the OS error."""
    where = f"{address}:{port}" if ":" not in address else f"[{address}]:{port}"
    if isinstance(exc, TimeoutError):
        return GuestdError(
            ErrorCode.TIMEOUT,
            f"connecting to {where} took longer than {timeout_s:g} s",
            details={"stage": "connect", "reason": "timeout", "limit": "connect_timeout_s"},
        )
    if isinstance(exc, ConnectionRefusedError):
        return GuestdError(
            ErrorCode.UNAVAILABLE,
            f"nothing listens on {where} in the guest (connection refused)",
            errno=exc.errno,
            details={"stage": "connect", "reason": "refused"},
        )
    if isinstance(exc, OSError) and exc.errno in _UNREACHABLE:
        return GuestdError(
            ErrorCode.UNAVAILABLE,
            f"{where} is unreachable in the guest ({exc.strerror})",
            errno=exc.errno,
            details={"stage": "connect", "reason": "unreachable"},
        )
    if isinstance(exc, OSError):
        return GuestdError.from_os_error(exc, stage="connect")
    raise exc


async def connect(relay: Relay, address: str, port: int, timeout_s: float) -> None:
    """Connect ``relay``'s guest socket to ``address:port`` within ``timeout_s``, or raise the
    typed error; ``connected`` goes to the client the moment the socket is connected.

    The socket is connected by hand, not by the loop's create_connection: a loopback connect
    is done when connect() returns (the kernel runs the handshake inside the call), so the
    client hears ``connected`` in the same task step that began the connect. create_connection
    waited a loop iteration for writability and another for connection_made before the event
    could go out (~60 us of a relay connect's ~130 us in guestd, bench/relay.py)."""
    family, _ = check_address(address)  # cached; check_local ran it already
    relay.open(await connect_socket(family, address, port, timeout_s))


async def connect_socket(family: socket.AddressFamily, address: str, port: int, timeout_s: float) -> socket.socket:
    """A non-blocking TCP socket connected to ``address:port`` (an IP literal: no resolver),
    or the typed error; waits for the handshake only when connect() did not finish it."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        err = sock.connect_ex((address, port))
        if err == errno.EINPROGRESS:
            if not _connected(sock):
                await _until_writable(sock, timeout_s)
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            raise OSError(err, os.strerror(err))
    except TimeoutError:
        sock.close()
        raise connect_error(TimeoutError(), address, port, timeout_s) from None
    except OSError as exc:
        sock.close()
        raise connect_error(exc, address, port, timeout_s) from None
    except BaseException:
        sock.close()
        raise
    return sock


def _connected(sock: socket.socket) -> bool:
    """The handshake is over (a loopback connect's usual case by the time connect() returns)."""
    try:
        sock.getpeername()
    except OSError:
        return False
    return True


async def _until_writable(sock: socket.socket, timeout_s: float) -> None:
    """Until ``sock``'s connect has an outcome (it turns writable), at most ``timeout_s``
    (TimeoutError). The deadline is a timer that cancels this task, as asyncio.timeout does
    (which cost a relay connect ~15 us; wait_for before it also ran the connect in a task)."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    cancelling = task.cancelling()
    expired = False

    def expire() -> None:
        nonlocal expired
        expired = True
        task.cancel()

    done: asyncio.Future[None] = loop.create_future()

    def writable() -> None:
        if not done.done():
            done.set_result(None)

    fd = sock.fileno()
    loop.add_writer(fd, writable)
    timer = loop.call_later(timeout_s, expire)
    try:
        await done
    except asyncio.CancelledError:
        if expired and task.uncancel() <= cancelling:
            raise TimeoutError from None
        raise
    finally:
        timer.cancel()
        loop.remove_writer(fd)


class _Socket(asyncio.BufferedProtocol):
    """The guest socket's protocol: reads into its relay's chunk buffer, hands it the rest."""

    __slots__ = ("relay",)

    def __init__(self, relay: Relay) -> None:
        self.relay = relay

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.relay.attach(transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.relay.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self.relay.on_read(nbytes)

    def eof_received(self) -> bool:
        self.relay.on_eof()
        return True  # keep the write side: a half-closed peer may still read

    def connection_lost(self, exc: Exception | None) -> None:
        self.relay.on_lost(exc)

    def pause_writing(self) -> None:
        self.relay.writable = False

    def resume_writing(self) -> None:
        self.relay.on_writable()


class Relay:
    """Both directions of one stream; :meth:`run` returns the result once both have ended.

    One task per stream, the request's own: the guest socket's reads and the client's INPUT
    come in as callbacks (``on_read``, ``on_input``), and the task sends data events and
    sleeps until there is more to do. Before, each stream ran two more tasks (one per
    direction) joined by ``asyncio.wait``, and INPUT went through a queue: with the setup
    around them, three task steps and their cancellation made a relay connect cost guestd
    ~0.5 ms of CPU where a ping costs 0.05 ms (bench/relay.py)."""

    def __init__(self, ctx: Request, chunk: int) -> None:
        self.ctx = ctx
        self.chunk = chunk
        self.transport: Any = None  # uvloop's transports have asyncio's API but not its classes
        self.writable = True  # the guest socket's write buffer is under RELAY_WRITE_HIGH
        self.sent = 0
        self.received = 0
        # The guest socket is read straight into a buffer; a full one becomes a data event as
        # it is (no copy), a partial one is copied out. Before, reads came as uvloop's 256 KiB
        # bytes joined into chunks: two copies per byte of a bulk stream instead of none. A
        # stream starts with FIRST_READ bytes and doubles up to a chunk with each full buffer,
        # so a small or idle stream holds 64 KiB, not a chunk.
        self._fill: bytearray | None = None
        self._size = min(FIRST_READ, chunk)  # of the next buffer
        self._buffered = 0  # bytes of _fill that hold data
        self._reading_paused = False
        self._eof = False
        self._lost = False
        self._error: BaseException | None = None
        # client -> guest socket
        self._early: list[dict[str, Any]] | None = []  # INPUT that came before the socket was open
        self._unacked = 0  # bytes the socket took while over its mark: credit owed once it drains
        self._input_eof = False
        self._failure: Exception | None = None  # the client's side failed: the stream ends with it
        self._waiter: asyncio.Future[None] | None = None  # the task sleeping in _sleep
        self._announced = False  # `connected` went out
        self._idle = False  # the task sleeps with nothing under way (see _send_now)
        self._closed: bool | None = None  # closed (reset: True) before the transport was attached
        # INPUT may come with the request, before this handler ran: it waits in the queue.
        queued = ctx.input
        self._early.extend(queued.get_nowait() for _ in range(queued.qsize()))
        ctx.input_handler = self.on_input

    def protocol(self) -> asyncio.BufferedProtocol:
        return _Socket(self)

    def announce(self) -> None:
        """Tell the client the guest socket is connected (once); it may be before the socket's
        transport is attached (see connect)."""
        if not self._announced:
            self._announced = True
            self.ctx.post_event(_CONNECTED)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _sleep(self) -> None:
        """Until a callback has news (every state it changes is checked before sleeping again)."""
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    # -- from the guest socket -----------------------------------------------------------
    def open(self, sock: socket.socket) -> None:
        """``sock`` is connected: tell the client at once, and attach the socket's transport in
        a task of its own. Awaiting the attach here would put a loop iteration between the
        connect and ``connected``; and a cancel that came during it made the loop close the
        socket gracefully (FIN) where a cut-short stream must reset it. INPUT that comes
        before the transport is there waits in ``_early``; a relay closed before it waits for
        the transport to close it (:meth:`attach`)."""
        self.announce()
        loop = asyncio.get_running_loop()
        attaching = loop.create_task(loop.connect_accepted_socket(self.protocol, sock))
        attaching.add_done_callback(functools.partial(self._attached, sock))

    def _attached(self, sock: socket.socket, task: asyncio.Task[Any]) -> None:
        if task.cancelled():  # guestd is stopping
            reset(sock)
            return
        exc = task.exception()
        if exc is not None:  # no transport: the stream ends with the error (_run reports it)
            reset(sock)  # a no-op once a transport took the socket (it closed it)
            self._fail(exc if isinstance(exc, Exception) else RuntimeError(repr(exc)))

    def attach(self, transport: Any) -> None:
        self.transport = transport
        if self._closed is not None:  # the stream ended while the socket was being attached
            reset_it, self._closed = self._closed, None
            self.close(reset=reset_it)
            return
        transport.set_write_buffer_limits(high=RELAY_WRITE_HIGH)
        early, self._early = self._early, None
        for body in early or ():
            self.on_input(body)

    def get_buffer(self) -> memoryview:
        if self._fill is None:
            self._fill = bytearray(self._size)
        return memoryview(self._fill)[self._buffered :]

    def on_read(self, nbytes: int) -> None:
        self._buffered += nbytes
        if self._idle and self._send_now():
            return
        if self._fill is not None and self._buffered >= len(self._fill) and not self._reading_paused:
            self._reading_paused = True  # a full buffer waits to go out: read no more till then
            self.transport.pause_reading()
        self._wake()

    def _send_now(self) -> bool:
        """Send what was just read as one data event from the read callback itself, when the
        task has nothing else under way (it sleeps at the bottom of run, where it checks every
        state again when it wakes) and the credit and the connection take it whole: a reply
        through a relay then costs no task wake-up (a loop iteration) on its way out. The
        same checks as run's; anything else (no credit, output paused) goes the task's way."""
        ctx = self.ctx
        n = self._buffered
        if self._failure is not None or not ctx.active or ctx.write_paused or min(ctx.data_room(_DATA), self.chunk) < n:
            return False
        ctx.push_data(_DATA, self._take(n))
        self.received += n
        return True

    def on_eof(self) -> None:
        self._eof = True
        self._wake()

    def on_lost(self, exc: BaseException | None) -> None:
        self._lost = True
        self._error = exc
        if self._unacked:
            if exc is not None:
                self._fail(reset_error())  # what the client sent last never reached the workload
            else:
                self.on_writable()
        self._wake()

    def on_writable(self) -> None:
        self.writable = True
        owed, self._unacked = self._unacked, 0
        if owed:
            self.ctx.ack_input(owed)
            self._wake()

    # -- from the client -----------------------------------------------------------------
    def on_input(self, body: dict[str, Any]) -> None:
        """One INPUT body (data and/or eof): data goes to the guest socket, and its credit goes
        back once the socket took it while under its mark (else when it drains, on_writable).
        So a workload that accepts and never reads holds guestd to one window plus the mark."""
        if self._early is not None:
            self._early.append(body)  # bounded: data needs credit, which only a socket grants
            return
        if self._input_eof or self._failure is not None:
            return
        try:
            data = body.get("data")
            if data:
                if self._lost:
                    self._fail(reset_error())
                    return
                self.transport.write(data)
                self.sent += len(data)
                if self.writable:
                    self.ctx.ack_input(len(data))
                else:
                    self._unacked += len(data)
            if body.get("eof"):
                self._input_eof = True
                self.ctx.stop_taking_data()
                if not self._lost and self.transport.can_write_eof():
                    self.transport.write_eof()
                self._wake()
        except Exception as exc:  # raised in the task, which reports it as it reports its own
            self._fail(exc)

    def _fail(self, error: Exception) -> None:
        if self._failure is None:
            self._failure = error
        self._wake()

    # -- the two directions --------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        ctx = self.ctx
        self.announce()
        out_done = False
        while True:
            if self._failure is not None:
                raise self._failure
            if not ctx.active:
                break  # the request ended without us (its task is being cancelled): nothing goes out
            if ctx.write_paused:
                await self._until(ctx.drain())
                continue
            if self._buffered:
                room = min(ctx.data_room(_DATA), self.chunk)
                if room <= 0:
                    await self._until(ctx.wait_credit())
                    continue
                piece = self._take(room)
                ctx.push_data(_DATA, piece)
                self.received += len(piece)
                if self._reading_paused and not self._lost and (self._fill is None or self._buffered < len(self._fill)):
                    self._reading_paused = False
                    self.transport.resume_reading()
                continue
            if not out_done:
                if self._lost and self._error is not None:
                    raise reset_error()
                if self._eof or self._lost:
                    ctx.post_event(_EOF)
                    out_done = True
                    continue
            elif self._input_eof and not self._unacked:
                break
            self._idle = True  # nothing under way: the read callback may send (_send_now)
            try:
                await self._sleep()
            finally:
                self._idle = False
        return {"sent": self.sent, "received": self.received}

    async def _until(self, waiting: Coroutine[Any, Any, None]) -> None:
        """Await ``waiting`` (credit, the connection's drain), unless the client's side fails
        first: a failed stream ends at once, not when the client next grants credit."""
        task = asyncio.ensure_future(waiting)
        task.add_done_callback(lambda _task: self._wake())
        try:
            while not task.done() and self._failure is None:
                await self._sleep()
        finally:
            if not task.done():
                task.cancel()
        if task.done() and not task.cancelled():
            task.result()  # the connection closed: raise as the drain did

    def _take(self, room: int) -> bytes | bytearray:
        buf, n = self._fill, self._buffered
        assert buf is not None
        if n == len(buf) and n <= room:
            self._fill, self._buffered = None, 0  # the full buffer goes out as it is
            self._size = min(2 * n, self.chunk)
            return buf
        k = min(n, room)
        piece = bytes(memoryview(buf)[:k])
        if k < n:
            buf[: n - k] = memoryview(buf)[k:n]
        self._buffered = n - k
        return piece

    def close(self, *, reset: bool) -> None:
        """Close the guest socket: gracefully after the stream ended, with RST when it was cut
        short (cancel, a dropped connection, an error) so the workload sees the abort."""
        self.ctx.input_handler = None
        t = self.transport
        if t is None:
            self._closed = reset  # still attaching: attach closes it
            return
        if t.is_closing():
            return
        if reset:
            sock = t.get_extra_info("socket")
            if sock is not None:
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_0)
                except OSError:
                    pass
            t.abort()
        else:
            t.close()


@functools.lru_cache(maxsize=64)
def check_address(address: str) -> tuple[socket.AddressFamily, bool]:
    """(family, is loopback) of an IP literal; names are refused (no resolver runs in guestd).
    Cached: a pure function of the client's string (parsing took a relay connect ~10 us), and
    nothing the workload does changes it; an error is raised afresh each time (never cached)."""
    import ipaddress

    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        raise GuestdError(
            ErrorCode.BAD_REQUEST, f"address {address!r} is not an IP literal", details={"field": "address"}
        ) from None
    return (socket.AF_INET6 if ip.version == 6 else socket.AF_INET), ip.is_loopback


def check_local(address: str) -> None:
    """Only the guest's own addresses: a relay into the guest must never become a way into the
    networks the guest can reach. An address is the guest's when a socket can bind to it."""
    family, loopback = check_address(address)
    if loopback:
        return
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.bind((address, 0))
    except OSError:
        raise GuestdError(
            ErrorCode.PERMISSION_DENIED,
            f"{address} is not an address of the guest",
            details={"policy": "guest_addresses", "field": "address"},
        ) from None
    finally:
        s.close()
