"""stdin of any size and output callbacks for the run calls (exec, shell.run, code.run).

stdin: bytes, a str (sent as UTF-8), a binary file object, or an iterator or async iterator of
bytes. Up to :data:`INLINE_STDIN_MAX` bytes in hand go inline in the request (its ``stdin`` /
``input`` field); anything larger, and every file or iterator, goes as ``stdin_stream`` INPUT
frames under the guest's credit, read as the guest takes it: a source of any size costs this
host about one chunk of memory. A file object or a plain iterator is read in a worker thread,
so a slow read (a pipe, a terminal) never stalls the connection.

Output callbacks (``on_stdout`` / ``on_stderr``, and ``on_result`` / ``on_error`` for code):
the run is made a streaming one and each chunk goes to its callback as it arrives. A callback
may return an awaitable, which is awaited before the next chunk is read (the blocking client
uses that to run callbacks in its caller's thread with bounded memory). The result still
carries the output, kept on this host by the same rules the guest applies (``max_output``,
tail or head and tail, exact counts).
"""

from __future__ import annotations

import asyncio
import enum
import inspect
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from guestd.output.capture import OutputCapture, capture_fields
from guestd.wire.errors import ErrorCode, GuestdError

if TYPE_CHECKING:
    from guestd.client.connection import Call, ClientConnection
    from guestd.output.capture import CapturedFields


class Derived(enum.Enum):
    """The default ``deadline`` of a run (exec, shell.run, code.run and their streams): derived
    from the guest's bounds, see :mod:`guestd.client.aio`."""

    DERIVED = "derived"


DERIVED = Derived.DERIVED
# A run's client deadline: seconds, None (for ever) or DERIVED (from the guest's bounds).
RunDeadline = float | None | Derived

INLINE_STDIN_MAX = 256 * 1024  # bytes in hand up to this go in the request itself
STDIN_CHUNK = 1024 * 1024  # what one read of a file or one INPUT send takes at most


@runtime_checkable
class BinaryReader(Protocol):
    """A binary file object (``open(p, "rb")``, ``sys.stdin.buffer``, ``io.BytesIO``)."""

    def read(self, size: int = -1, /) -> bytes: ...


StdinSource = bytes | bytearray | memoryview | str | BinaryReader | Iterable[bytes] | AsyncIterable[bytes]
OutputCallback = Callable[[bytes], object]  # may return an awaitable: awaited before the next chunk
EventCallback = Callable[[dict[str, Any]], object]  # code results and errors, as above


def as_bytes(data: bytes | bytearray | memoryview | str) -> bytes:
    """What the wire's ``bin`` fields take: a str goes as its UTF-8."""
    return data.encode() if isinstance(data, str) else bytes(data)


def split_stdin(source: StdinSource | None) -> tuple[bytes | None, StdinSource | None]:
    """``(inline, streamed)``: small bytes in hand go inline, everything else streams."""
    if source is None:
        return None, None
    if isinstance(source, (bytes, bytearray, memoryview, str)):
        data = as_bytes(source)
        if len(data) <= INLINE_STDIN_MAX:
            return data, None
        return None, data
    if isinstance(source, (BinaryReader, Iterable, AsyncIterable)):
        return None, source
    raise TypeError(f"stdin: {type(source).__name__} is not bytes, str, a binary file or an iterator of bytes")


def _chunk(item: object) -> bytes:
    if isinstance(item, (bytes, bytearray, memoryview, str)):
        return as_bytes(item)
    raise TypeError(f"stdin: an iterator gave a {type(item).__name__}, not bytes")


_END = object()


def _next(it: Iterator[bytes]) -> object:
    return next(it, _END)


async def stdin_chunks(source: StdinSource) -> AsyncIterator[bytes]:
    """The source's bytes in pieces of at most STDIN_CHUNK; blocking reads in a worker thread."""
    loop = asyncio.get_running_loop()
    if isinstance(source, (bytes, bytearray, memoryview, str)):
        data = memoryview(as_bytes(source))
        for i in range(0, len(data), STDIN_CHUNK):
            yield bytes(data[i : i + STDIN_CHUNK])
    elif isinstance(source, BinaryReader):
        reader = source
        while chunk := _chunk(await loop.run_in_executor(None, reader.read, STDIN_CHUNK)):
            yield chunk
    elif isinstance(source, AsyncIterable):
        async for item in source:
            data = memoryview(_chunk(item))
            for i in range(0, len(data), STDIN_CHUNK):
                yield bytes(data[i : i + STDIN_CHUNK])
    else:
        it: Iterator[bytes] = iter(source)
        while True:
            got = await loop.run_in_executor(None, _next, it)
            if got is _END:
                break
            data = memoryview(_chunk(got))
            for i in range(0, len(data), STDIN_CHUNK):
                yield bytes(data[i : i + STDIN_CHUNK])


async def feed_stdin(call: Call, source: StdinSource) -> None:
    """Send ``source`` as the call's stdin, then its end. Stops quietly when the run stops taking
    stdin (it ended, or closed its stdin): as with a local pipe, unread input is not an error."""
    async for chunk in stdin_chunks(source):
        if await call.send_input({"data": chunk}) < len(chunk):
            return
    await call.send_input({"eof": True})


async def deliver(callback: Callable[[Any], object] | None, value: Any) -> None:
    if callback is None:
        return
    out = callback(value)
    if inspect.isawaitable(out):
        await out


class RunOutput:
    """Output of a streamed run kept on this host the way the guest keeps it (``max_output`` per
    stream, tail or head and tail), with exact counts."""

    def __init__(self, max_output: int, head_tail: bool) -> None:
        mode = "head_tail" if head_tail else "tail"
        self.stdout = OutputCapture(max_output, mode)
        self.stderr = OutputCapture(max_output, mode)

    def feed(self, stream: str, data: bytes) -> None:
        (self.stdout if stream == "stdout" else self.stderr).feed(data)

    def fields(self, strip_ansi: bool, collapse_cr: bool) -> CapturedFields:
        return capture_fields(self.stdout, self.stderr, strip_ansi=strip_ansi, collapse_cr=collapse_cr)


@dataclass(frozen=True)
class CaptureOptions:
    """What a run's result keeps of its output (exec, shell.run and their streams): at most
    ``max_output`` bytes a stream (None: the schema's default), its tail or head and tail, ANSI
    escapes stripped, carriage-return overwrites collapsed. The guest applies them, unless the
    output comes live as events: then this side keeps it, by the same rules."""

    max_output: int | None = None
    head_tail: bool = False
    strip_ansi: bool | None = None
    collapse_cr: bool | None = None

    def request_args(self, live: bool) -> dict[str, Any]:
        """The request's fields: these options for the guest, or ``stream: true`` alone (live)."""
        if live:
            return {"stream": True}
        fields = {
            "max_output": self.max_output,
            "capture": "head_tail" if self.head_tail else None,
            "strip_ansi": self.strip_ansi,
            "collapse_cr": self.collapse_cr,
        }
        return {k: v for k, v in fields.items() if v is not None}

    @property
    def given(self) -> bool:
        return self != CaptureOptions()

    def output(self, default_max_output: int) -> RunOutput:
        """A live run's output as this side keeps it (``default_max_output``: the op's default)."""
        return RunOutput(default_max_output if self.max_output is None else self.max_output, self.head_tail)

    def fields(self, kept: RunOutput) -> CapturedFields:
        """The result's capture fields from the output kept here."""
        return kept.fields(bool(self.strip_ansi), bool(self.collapse_cr))


async def run_call(
    conn: ClientConnection,
    call: Call,
    deadline: float | None,
    *,
    stdin: StdinSource | None = None,
    on_event: Callable[[dict[str, Any]], Any] | None = None,
) -> dict[str, Any]:
    """The final reply of ``call``, feeding it ``stdin`` (stdin_stream) and passing each of its
    events to ``on_event`` (a coroutine function; stream: true) meanwhile. ``deadline`` bounds
    the whole; reaching it, or any error or cancellation here, cancels the request in the guest.
    An error from the stdin source or a callback is raised here."""
    loop = conn.loop
    end = None if deadline is None else loop.time() + deadline
    feeder: asyncio.Task[None] | None = None
    if stdin is not None:
        feeder = loop.create_task(feed_or_fail(conn, call, stdin))
    try:
        if on_event is not None:
            while True:
                ev = await call.next_event(_left(end, call.op))
                if ev is None:
                    break
                await on_event(ev)
        return await conn.wait(call, _left(end, call.op))
    except BaseException:
        conn._forget(call)
        raise
    finally:
        if feeder is not None:
            feeder.cancel()


def _left(end: float | None, op: str) -> float | None:
    if end is None:
        return None
    left = end - asyncio.get_running_loop().time()
    if left <= 0:
        raise GuestdError(ErrorCode.TIMEOUT, f"{op}: no reply before the client deadline (request cancelled)")
    return left


async def feed_or_fail(conn: ClientConnection, call: Call, source: StdinSource) -> None:
    """Feed stdin; a source that fails ends the call with its error (and cancels it in the guest)."""
    try:
        await feed_stdin(call, source)
    except asyncio.CancelledError:
        raise
    except BaseException as exc:
        if not call.future.done():
            conn._drop(call)
            call.finish(None, exc)
