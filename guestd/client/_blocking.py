"""The blocking client's hand-written part: the asyncio client driven on a private event-loop
thread, callbacks moved to the caller's thread, and the few blocking twins whose shape differs
from their async originals.

Everything else of the blocking client (``guestd/client/sync.py`` and ``*_sync.py``) is
generated from the async sources by :mod:`guestd.client._generate_sync`: each public coroutine
becomes a method of the same signature that runs it here, through :meth:`ClientBase._run`. The
generated classes inherit from the bases below, and a method a base defines is not generated.
Nothing here imports the blocking client built on it (:mod:`guestd.client.sync`): a base holds
the client as :class:`ClientBase` (all it uses is the loop thread) or as the generated protocol
of what it calls (:mod:`guestd.client._surface_sync`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import socket
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, Generic, Protocol, Self, TypeVar

from guestd.client.aio import CONNECT_TIMEOUT, AsyncClient
from guestd.client.connection import DEFAULT_WINDOW
from guestd.client.expect import Expect
from guestd.client.git import AsyncGit
from guestd.client.ports import PortForward, ReverseForward
from guestd.wire.frames import DEFAULT_MAX_FRAME

if TYPE_CHECKING:
    from guestd.client._surface_sync import SyncProcessClient
    from guestd.client.replies import ProcessAttachResult
    from guestd.client.streaming import OutputCallback
    from guestd.client.streams import Attach

T = TypeVar("T")
V = TypeVar("V")

CANCEL_SEND_S = 5.0  # an interrupted call: how long the cancel may take to be sent
CALLBACK_BACKLOG = 4 * 1024 * 1024  # bytes handed to the caller's thread and not yet taken
ITEM_COST = 256  # what one waiting item costs besides its data (an empty chunk is not free)


def held_size(value: object) -> int:
    """About what ``value`` (a chunk, or a code result or error as decoded) holds in memory: its
    bytes and text, walked through maps and lists (bounded by the frame it came in)."""
    if isinstance(value, (bytes, str)):
        return len(value)
    if isinstance(value, dict):
        return sum(held_size(k) + held_size(v) + 16 for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(held_size(v) + 8 for v in value)
    return 8


class CallerThread:
    """Callbacks the loop thread makes, run in the thread that waits for the call (so user code
    never runs on the client's loop). At most CALLBACK_BACKLOG bytes wait here: beyond it the
    loop stops reading the run's events, so its credit (and the guest) waits for the caller."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: queue.SimpleQueue[tuple[Callable[[Any], object], Any, int] | None] = queue.SimpleQueue()
        self._backlog = 0  # on the loop thread only
        self._room: asyncio.Event | None = None

    def wrap(self, fn: Callable[[V], object] | None) -> Callable[[V], Awaitable[None]] | None:
        """A loop-side callback that hands ``fn``'s calls over to the caller's thread."""
        if fn is None:
            return None

        async def hand_over(value: V) -> None:
            size = ITEM_COST + held_size(value)
            self._backlog += size
            self._items.put((fn, value, size))
            while self._backlog > CALLBACK_BACKLOG:
                self._room = asyncio.Event()
                await self._room.wait()

        return hand_over

    def _taken(self, size: int) -> None:
        self._backlog -= size
        if self._backlog <= CALLBACK_BACKLOG and self._room is not None:
            self._room.set()

    def wake(self) -> None:
        self._items.put(None)

    def run_until_done(self, future: concurrent.futures.Future[Any]) -> None:
        """Run the callbacks handed over, in order, until ``future`` is done."""
        while (item := self._items.get()) is not None or not future.done():
            if item is None:
                continue
            fn, value, size = item
            try:
                fn(value)
            finally:
                self._loop.call_soon_threadsafe(self._taken, size)


class ClosedOnExit:
    """A context manager that calls ``close()`` on exit: the client, a forwarder, an expect, and
    the handles (the blocking twin of :class:`~guestd.client.handles.AsyncHandle`)."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ClientBase(ClosedOnExit):
    """What :class:`~guestd.client.Client` adds to the generated methods: the connection, the
    loop thread that runs the :class:`~guestd.client.AsyncClient` underneath, and closing."""

    def __init__(
        self,
        address: str,
        *,
        connect_timeout: float = CONNECT_TIMEOUT,
        token: str | None = None,
        max_frame: int = DEFAULT_MAX_FRAME,
        stream_window: int = DEFAULT_WINDOW,
        default_timeout_s: float | None = None,
        sock: socket.socket | None = None,
    ) -> None:
        """Connect to ``address``; or, with ``sock``, speak over an already connected stream socket
        (QEMU's chardev socket behind a virtio-serial port, for example). ``connect_timeout``
        bounds connecting and the handshake; ``default_timeout_s`` is the ``timeout_s`` of exec and
        shell_run where a call leaves it out. A failure to connect is a :class:`~guestd.client.ConnectError` (an
        OSError) whose text names the address and what to try."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="guestd-client", daemon=True)
        self._thread.start()
        try:
            if sock is not None:
                self._aio: AsyncClient = self._run(
                    AsyncClient.from_socket(
                        sock,
                        connect_timeout=connect_timeout,
                        token=token,
                        max_frame=max_frame,
                        stream_window=stream_window,
                        default_timeout_s=default_timeout_s,
                    )
                )
            else:
                connecting = AsyncClient.connect(
                    address,
                    connect_timeout=connect_timeout,
                    token=token,
                    max_frame=max_frame,
                    stream_window=stream_window,
                    default_timeout_s=default_timeout_s,
                )

                async def connect() -> AsyncClient:
                    return await connecting

                self._aio = self._run(connect())
        except BaseException:
            self._stop()
            raise

    def _run(self, coro: Coroutine[Any, Any, T], callbacks: CallerThread | None = None) -> T:
        """Run ``coro`` on the loop thread and wait for it, running the ``callbacks`` it hands
        over meanwhile (here, in the caller's thread). Interrupted while waiting (Ctrl-C is
        KeyboardInterrupt here), or by a callback that raises, the coroutine is cancelled, which
        cancels its request: guestd ends the command's process tree. The cancel is given up to
        CANCEL_SEND_S to reach the socket before the exception goes on; the connection stays
        usable."""
        ended = threading.Event()

        async def tracked() -> T:
            try:
                return await coro
            finally:
                ended.set()

        future = asyncio.run_coroutine_threadsafe(tracked(), self._loop)
        try:
            if callbacks is not None:
                future.add_done_callback(lambda _: callbacks.wake())
                callbacks.run_until_done(future)
            return future.result()
        except BaseException:
            if not future.done():
                future.cancel()
                ended.wait(CANCEL_SEND_S)
            raise

    def _follow_attach(
        self,
        attach: Callable[[AsyncClient], Attach],
        on_stdout: OutputCallback | None,
        on_stderr: OutputCallback | None,
    ) -> ProcessAttachResult:
        """Follow the attach ``attach`` starts (on the loop thread) to its end, each chunk handed
        to its callback in this (the calling) thread; its result. Interrupted, it ends the attach,
        not the process."""
        pump = CallerThread(self._loop)
        out, err = pump.wrap(on_stdout), pump.wrap(on_stderr)

        async def follow_output() -> ProcessAttachResult:
            stream = attach(self._aio)
            try:
                async for kind, _offset, data in stream:
                    deliver = out if kind == "stdout" else err if kind == "stderr" else None
                    if deliver is not None:
                        await deliver(data)
                return await stream.result()
            except BaseException:
                stream.cancel()
                raise

        return self._run(follow_output(), pump)

    def _stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()

    @property
    def aio(self) -> AsyncClient:
        """The asyncio client underneath; its coroutines must run on this client's loop thread."""
        return self._aio

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._run(self._aio.close())
        finally:
            self._stop()


class Forward(Protocol):
    """What a blocking forwarder uses of the async forward it runs."""

    guest_port: int

    async def close(self) -> None: ...


F = TypeVar("F", bound=Forward)


class Forwarder(ClosedOnExit, Generic[F]):
    """A running forward (``forward``, the async one) driven on the client's loop: its
    ``guest_port``, ``close()``, and a context manager that closes it on exit."""

    def __init__(self, ports: ClientBase, forward: F) -> None:
        self._ports = ports
        self.forward = forward

    @property
    def guest_port(self) -> int:
        return self.forward.guest_port

    def close(self) -> None:
        self._ports._run(self.forward.close())


class PortForwarder(Forwarder[PortForward]):
    """A running :class:`~guestd.client.ports.PortForward`: ``with client.port_forward(8000) as f:``
    then connect to ``f.local_port`` on this host."""

    @property
    def local_address(self) -> str:
        return self.forward.local_address

    @property
    def local_port(self) -> int:
        return self.forward.local_port


class ReverseForwarder(Forwarder[ReverseForward]):
    """A running :class:`~guestd.client.ports.ReverseForward`: the guest reaches ``destination``
    by connecting to ``guest_port`` on its loopback until ``close()``."""

    @property
    def destination(self) -> tuple[str, int]:
        return self.forward.destination


class GitBase:
    """The blocking ``Client.git``: :class:`~guestd.client.git.AsyncGit` on the client's loop."""

    def __init__(self, client: ClientBase) -> None:
        self.client = client
        self.aio = AsyncGit(client.aio)


class ProcessAttach:
    """The blocking :class:`~guestd.client.handles_sync.Process`'s ``attach``: the async one
    returns a stream to iterate, this one calls back in the caller's thread."""

    client: SyncProcessClient
    id: str

    def attach(
        self,
        *,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        stdout_from: int | None = None,
        stderr_from: int | None = None,
        follow: bool | None = None,
        deadline: float | None = 3600.0,
        progress_timeout: float | None = None,
    ) -> ProcessAttachResult:
        """Follow its output as it comes (to exit by default): ``on_stdout``/``on_stderr`` get each
        chunk in this (the calling) thread, as exec's callbacks do; returns the final status and
        the offsets to attach again from. Bytes the ring overwrote before the offsets are skipped
        (:meth:`output` counts them). Ctrl-C ends the attach, not the process."""
        return self.client._follow_attach(
            lambda aio: aio.attach(
                self.id,
                stdout_from=stdout_from,
                stderr_from=stderr_from,
                follow=follow,
                deadline=deadline,
                progress_timeout=progress_timeout,
            ),
            on_stdout,
            on_stderr,
        )


class SyncExpectBase(ClosedOnExit):
    """The blocking :class:`~guestd.client.expect.Expect`'s own parts: made on the client's loop
    (its reader task lives there), its buffer read from this thread, a context manager."""

    def __init__(self, client: ClientBase, expect: Expect) -> None:
        self._client = client
        self.aio = expect  # the async helper this one drives

    @property
    def before(self) -> bytes:
        """What came before the last match."""
        return self.aio.before

    @property
    def buffer(self) -> bytes:
        """Output not consumed by a match yet."""
        return bytes(self.aio.buffer)

    @property
    def dropped(self) -> int:
        """Bytes dropped from the front of the buffer (over its bound)."""
        return self.aio.dropped

    def close(self) -> None:
        """Stop reading; a command still running is interrupted (as :meth:`Expect.close`)."""
        self._client._run(self.aio.close())
