"""One output pump: a child's pipes read into captures, rings and spill files, or sent to a
streaming client within its credit.

Every producer of run output (exec, a shell session's commands, the process table) reads its
pipes the same way, and each used to write it out on its own: ``add_reader`` + ``os.read``
(no transport, no buffer beyond one read), at most one event's worth of the client's credit
per read, reading paused while the client is behind (no credit, or the connection's output
over its mark) so the process blocks on its pipe instead of guestd buffering without bound,
reading resumed once credit comes and the connection drains, and a bounded final drain once
the process has ended. Here it is written once, with the cancel safety each copy had to get
right alone: a closed pump has no reader on the loop and no task that could add one back, and
it never closes an fd (the fds belong to the process; their owner closes or hands them on).

Output goes, per source and channel (1 stdout, 2 stderr):
- to every tap of the source as it is read (a ring for a background process, a spill file),
- then to the client as data events when the pump streams to an active request (the
  channel's capture only counts the bytes), else into the channel's capture (bounded, exact
  accounting), else it is counted as ``unrouted_bytes`` (a shell's background jobs between
  commands).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

from guestd.children.tree import read_chunk, set_if_pending

if TYPE_CHECKING:
    from guestd.output.capture import OutputCapture
    from guestd.output.stream import CreditedStream

READ_SIZE = 256 * 1024  # per read: one event's worth when streaming (the client's credit permitting)
DRAIN_READS = 64  # per source in a final drain, credit waits included: what leftover writers get
CHANNELS = {"stdout": 1, "stderr": 2}  # a capture's key, as in ``{1: stdout, 2: stderr}``
FIELDS = {1: {"ev": "stdout"}, 2: {"ev": "stderr"}}  # a channel's data event


class Tap(Protocol):
    """Takes a copy of every byte a source gives (``OutputRing``, ``Spill``)."""

    def write(self, data: bytes) -> None: ...


class _Source:
    __slots__ = ("channel", "fd", "name", "taps")

    def __init__(self, name: str, fd: int, channel: int, taps: tuple[Tap, ...]) -> None:
        self.name = name
        self.fd = fd
        self.channel = channel
        self.taps = taps


class OutputPump:
    """Reads named sources (non-blocking fds) while they are open; see the module docstring.

    ``on_output`` runs after each read that gave data, ``on_end(name)`` when a source has
    ended (end of file, or EIO on a pty whose other side is gone): it is then no longer read.
    """

    __slots__ = (
        "_ended",
        "_resume",
        "captures",
        "closed",
        "drain_reads",
        "last_output",
        "loop",
        "on_end",
        "on_output",
        "paused",
        "read_size",
        "sources",
        "stream",
        "unrouted_bytes",
    )

    def __init__(
        self,
        *,
        on_output: Callable[[], None] | None = None,
        on_end: Callable[[str], None] | None = None,
        read_size: int = READ_SIZE,
        drain_reads: int = DRAIN_READS,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.sources: dict[str, _Source] = {}
        self.captures: Mapping[int, OutputCapture] | None = None
        self.stream: CreditedStream | None = None
        self.on_output = on_output
        self.on_end = on_end
        self.read_size = read_size
        self.drain_reads = drain_reads
        self.last_output = time.monotonic()  # of the last read that gave data (idle timeouts)
        self.unrouted_bytes = 0  # read while no capture was routed
        self.paused = False  # no reader on the loop: a streaming client is behind
        self.closed = False
        self._resume: asyncio.Task[None] | None = None  # waits for the client, then reads again
        self._ended: asyncio.Future[None] | None = None  # wait_ended's, set when no source is left

    # -- sources ---------------------------------------------------------------------------
    def add(self, name: str, fd: int, channel: int, taps: tuple[Tap, ...] = (), *, read_now: bool = False) -> None:
        """Read ``fd`` from now on (unless paused: then from the resume on). ``read_now``: read
        what it holds at once, at most ``drain_reads`` times, and watch it only when it has not
        ended (the process has exited: its pipes are mostly at their end already, and a watch
        would cost a loop turn and two changes of the loop's poll set)."""
        source = self.sources[name] = _Source(name, fd, channel, taps)
        if self.paused or self.closed:
            return
        if read_now:
            for _ in range(self.drain_reads):
                if not self._read(source):
                    break
            if self.sources.get(name) is not source or self.paused or self.closed:
                return  # ended (never watched), or a streaming client is behind (resume adds it)
        self.loop.add_reader(fd, self._read, source)

    def remove(self, name: str) -> int | None:
        """Read ``name`` no more; its fd, which stays open (its owner closes or hands it on)."""
        source = self.sources.pop(name, None)
        if source is None:
            return None
        if not self.paused and not self.closed:
            self.loop.remove_reader(source.fd)
        return source.fd

    def hand_over(self) -> dict[str, int]:
        """Stop reading every source; their fds by name, still open, for a new owner."""
        fds = {name: source.fd for name, source in self.sources.items()}
        for name in fds:
            self.remove(name)
        self._cancel_resume()
        self.paused = False  # nothing left to read: no reader to add back
        return fds

    def route(self, captures: Mapping[int, OutputCapture] | None, stream: CreditedStream | None = None) -> None:
        """Where output goes from now on: to ``stream``'s client while it is active, else into
        ``captures`` (by channel), else counted as unrouted. Set a capture with a stream: the
        streamed bytes are counted in it."""
        self.captures, self.stream = captures, stream

    # -- reading ---------------------------------------------------------------------------
    def read_once(self, name: str) -> bool:
        """One read of ``name`` now: True when it gave data; False when nothing is ready, the
        source has ended (or is not there), or a streaming client is out of credit."""
        source = self.sources.get(name)
        return source is not None and self._read(source)

    def _read(self, source: _Source) -> bool:
        """One read (the loop's reader callback too: it ignores the result)."""
        stream = self.stream
        size = self.read_size
        streaming = stream is not None and stream.active
        if streaming:
            assert stream is not None
            # No more than one event within the client's credit can carry: no event ever
            # exceeds the client's max_frame or its window.
            room = stream.data_room(FIELDS[source.channel])
            if room <= 0:
                self._wait_for_client(stream)
                return False
            size = min(size, room)
        data = read_chunk(source.fd, size)
        if data is None:
            return False
        if not data:
            self._end(source)
            return False
        self.last_output = time.monotonic()
        for tap in source.taps:
            tap.write(data)
        captures = self.captures
        if streaming:
            assert stream is not None
            if captures is not None:
                captures[source.channel].total += len(data)  # streamed, not kept: only counted
            fields = FIELDS[source.channel]
            stream.push_data(fields, data)
            if stream.data_room(fields) <= 0 or stream.write_paused:
                self._wait_for_client(stream)
        elif captures is not None:
            captures[source.channel].feed(data)
        else:
            self.unrouted_bytes += len(data)
        if self.on_output is not None:
            self.on_output()
        return True

    def _end(self, source: _Source) -> None:
        self.remove(source.name)
        if self.on_end is not None:
            self.on_end(source.name)
        ended = self._ended
        if not self.sources and ended is not None and not ended.done():
            ended.set_result(None)

    # -- a streaming client's credit -------------------------------------------------------
    def _wait_for_client(self, stream: CreditedStream) -> None:
        """The client is behind: stop reading, so the process blocks on its pipe instead of
        guestd buffering without bound; read on once it grants credit and the connection drains."""
        if self.paused or self.closed:
            return
        self.paused = True
        for source in self.sources.values():
            self.loop.remove_reader(source.fd)
        self._resume = self.loop.create_task(self._resume_when_ready(stream))

    async def _resume_when_ready(self, stream: CreditedStream) -> None:
        try:
            await stream.wait_credit()
            await stream.drain()
        except Exception:  # the connection is closing: its requests end, their owners close us
            return
        if self._resume is asyncio.current_task():
            self._resume = None
            self._read_again()

    def resume(self) -> None:
        """Read again now, without waiting for the client (the stream is done with, or a
        final drain takes over)."""
        self._cancel_resume()
        self._read_again()

    def _cancel_resume(self) -> None:
        task, self._resume = self._resume, None
        if task is not None:
            task.cancel()

    def _read_again(self) -> None:
        if not self.paused or self.closed:
            return
        self.paused = False
        for source in self.sources.values():
            self.loop.add_reader(source.fd, self._read, source)

    # -- the end ---------------------------------------------------------------------------
    async def wait_ended(self, limit_s: float) -> bool:
        """Until every source has ended, at most ``limit_s`` (leftover children may hold the
        pipes open for ever: ``daemon &``). True when they all ended."""
        if not self.sources:
            return True
        # A future and a timer, not wait_for: that wraps the wait in a task of its own.
        ended = self._ended = self.loop.create_future()
        timer = self.loop.call_later(limit_s, set_if_pending, ended)
        try:
            await ended
        finally:
            timer.cancel()
            self._ended = None
        return not self.sources

    def drain_now(self) -> None:
        """Read what the sources hold right now, at most ``drain_reads`` reads each (a writer
        that never stops cannot hold the caller)."""
        for name in list(self.sources):
            for _ in range(self.drain_reads):
                if not self.read_once(name):
                    break

    async def drain_to_client(self) -> None:
        """The process has ended: what the sources still hold goes out, to the client within
        its credit (waiting for credit while the request is active). At most ``drain_reads``
        reads or credit waits per source."""
        for name in list(self.sources):
            for _ in range(self.drain_reads):
                source = self.sources.get(name)
                if source is None:
                    break
                stream = self.stream
                if stream is not None and stream.active and stream.data_room(FIELDS[source.channel]) <= 0:
                    await stream.wait_credit()
                    continue
                if not self._read(source):
                    break

    def close(self) -> None:
        """Read nothing more: no reader stays on the loop, no resume task is left to add one
        back. Idempotent; the fds stay open (their owner's)."""
        self._cancel_resume()
        if not self.closed and not self.paused:
            for source in self.sources.values():
                self.loop.remove_reader(source.fd)
        self.closed = True
