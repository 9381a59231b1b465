"""The stream objects the asyncio client's streaming calls return: :class:`ExecStream` and
:class:`ShellStream` (``exec_stream``, ``shell_stream``), :class:`CodeStream`
(``code_run_stream``) and :class:`Attach` (``attach``), each following one call to its end.

They live below :mod:`guestd.client.aio` (which imports them and keeps them importable from
there) so a handle's protocol can name them (``AsyncProcess.attach`` returns an
:class:`Attach`) without an import cycle.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

from guestd.client.replies import ProcessAttachResult
from guestd.client.results import CodeResult, ExecResult, ShellResult, checked
from guestd.client.streaming import RunOutput, StdinSource, feed_or_fail
from guestd.wire.errors import ErrorCode, GuestdError
from guestd.wire.types import CodeRunReply, ExecReply, ProcessAttachReply, ShellRunReply

if TYPE_CHECKING:
    from guestd.client.connection import Call, ClientConnection

UPLOAD_CHUNK = 1024 * 1024  # the data of one input: a chunk of an upload, or of stdin written to a stream


class Connected(Protocol):
    """The client as a stream uses it: the connection its call runs on (an
    :class:`~guestd.client.AsyncClient`)."""

    @property
    def _conn(self) -> ClientConnection: ...


class DeadlineClock:
    """An overall ``deadline`` from now and a bound on each wait for progress (None: none)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        what: str,
        deadline: float | None,
        progress_timeout: float | None = None,
    ) -> None:
        self._loop = loop
        self._what = what
        self._deadline = deadline
        self._progress_timeout = progress_timeout
        self._end = None if deadline is None else self._loop.time() + deadline

    def wait_s(self) -> float | None:
        """How long the next wait may take; raises ``timeout`` once the deadline has passed."""
        if self._end is None:
            return self._progress_timeout
        left = self._end - self._loop.time()
        if left <= 0:
            raise GuestdError(ErrorCode.TIMEOUT, f"{self._what}: not done within the {self._deadline} s deadline")
        return left if self._progress_timeout is None else min(left, self._progress_timeout)


class CallStream:
    """What every stream object is: one call of the client's connection followed to its end
    within a :class:`DeadlineClock`. A wait that times out gives up on the call (it is
    cancelled in the guest)."""

    # A timed-out wait's error says this instead of the connection's "no progress within".
    deadline_message: str | None = None

    def __init__(self, client: Connected, call: Call, clock: DeadlineClock) -> None:
        self._client = client
        self._call = call
        self._clock = clock

    async def _next_event(self) -> dict[str, Any] | None:
        """The call's next event within the clock (None: the call has ended)."""
        try:
            return await self._call.next_event(self._clock.wait_s())
        except GuestdError as e:
            if e.code != ErrorCode.TIMEOUT.value:
                raise
            self._client._conn._forget(self._call)
            if self.deadline_message is None:
                raise
            raise GuestdError(ErrorCode.TIMEOUT, self.deadline_message) from None

    async def _reply(self) -> dict[str, Any]:
        """The call's final reply, within the clock."""
        return await self._client._conn.wait(self._call, self._clock.wait_s())


class ExecStream(CallStream):
    """A streaming exec: iterate ``(stream, bytes)`` pairs, then await :meth:`result`.

    ``deadline`` (from the request; None: none) bounds the iteration and the result together.
    :meth:`result` reads what is left of the output itself (into the kept capture), so it may
    be awaited without iterating. With a ``stdin`` source given to the request, it is sent by
    a task of its own while the run goes on (its failure ends the run with its error).
    """

    def __init__(
        self,
        client: Connected,
        call: Call,
        deadline: float | None,
        *,
        kept: RunOutput | None = None,
        strip_ansi: bool = False,
        collapse_cr: bool = False,
        stdin: StdinSource | None = None,
    ) -> None:
        super().__init__(client, call, DeadlineClock(call.conn.loop, "exec stream", deadline))
        self._kept = kept
        self._shaping = (strip_ansi, collapse_cr)
        self.pid: int | None = None
        if stdin is not None:
            feeder = call.conn.loop.create_task(feed_or_fail(call.conn, call, stdin))
            # The run's end (reply, error, cancel, deadline) stops the sending.
            call.future.add_done_callback(lambda _: feeder.cancel())

    def __aiter__(self) -> AsyncIterator[tuple[str, bytes]]:
        return self._iter()

    deadline_message = "exec stream: no result before the client deadline"

    async def _iter(self) -> AsyncIterator[tuple[str, bytes]]:
        while (ev := await self._next_event()) is not None:
            kind = ev.get("ev")
            if kind == "started" and isinstance(ev.get("pid"), int):
                self.pid = ev["pid"]
            elif kind in ("stdout", "stderr") and isinstance(ev.get("data"), bytes):
                if self._kept is not None:
                    self._kept.feed(kind, ev["data"])
                yield kind, ev["data"]

    async def write_stdin(self, data: bytes) -> None:
        """Send ``data`` to the command's stdin (``stdin_stream`` or ``pty``), within the guest's
        credit. Raises BrokenPipeError when the run ended (or stopped taking stdin) before all
        of it was sent, saying how much was not: input to an ended command is never reported
        as written. Bytes sent may still be in a pipe the command never reads, as with a local
        pipe."""
        for i in range(0, len(data), UPLOAD_CHUNK):
            part = data[i : i + UPLOAD_CHUNK]
            sent = await self._call.send_input({"data": part})
            if sent < len(part):
                raise BrokenPipeError(
                    f"the run took no more stdin: {len(data) - i - sent} of {len(data)} bytes were not delivered"
                )

    async def close_stdin(self) -> None:
        await self._call.send_input({"eof": True})

    async def signal(self, sig: str | int) -> None:
        await self._call.send_input({"signal": str(sig)})

    async def cancel(self) -> None:
        self._call.cancel()

    async def _final_body(self) -> dict[str, Any]:
        """The reply, after the output not iterated yet (kept, not returned), with the capture
        this side kept for a live run. The counts stay the guest's (what the command wrote);
        ``*_dropped`` is every byte of it the result does not hold, by the capture or because
        it never arrived."""
        async for _ in self._iter():
            pass
        body = await self._reply()
        if self._kept is None:
            return body
        fields: dict[str, Any] = dict(self._kept.fields(*self._shaping))
        for name in ("stdout", "stderr"):
            produced, seen = body.get(f"{name}_bytes"), fields[f"{name}_bytes"]
            if isinstance(produced, int) and produced > seen:
                fields[f"{name}_bytes"] = produced
                fields[f"{name}_dropped"] += produced - seen
        return {**body, **fields}

    async def result(self) -> ExecResult:
        return ExecResult.from_body(checked(ExecReply, await self._final_body()))


class ShellStream(ExecStream):
    """A streaming ``shell.run``: iterate ``(stream, bytes)`` pairs, write stdin (with
    ``stdin_stream``), then await :meth:`result`."""

    async def result(self) -> ShellResult:  # type: ignore[override]
        return ShellResult.from_body(checked(ShellRunReply, await self._final_body()))


class CodeStream(CallStream):
    """A streaming code run: iterate events as they arrive, then await :meth:`result`.

    Events are ``("stdout"|"stderr", bytes)``, ``("result"|"display", bundle)`` and
    ``("error", {"ename", "evalue", "traceback"})``. ``deadline`` (from the request) bounds
    the iteration and the result together.
    """

    def __init__(self, client: Connected, call: Call, deadline: float | None) -> None:
        super().__init__(client, call, DeadlineClock(call.conn.loop, "code stream", deadline))

    def __aiter__(self) -> AsyncIterator[tuple[str, Any]]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[tuple[str, Any]]:
        while (ev := await self._next_event()) is not None:
            kind = ev.get("ev")
            if kind in ("stdout", "stderr") and isinstance(ev.get("data"), bytes):
                yield kind, ev["data"]
            elif kind in ("result", "display") and isinstance(ev.get("bundle"), dict):
                yield kind, ev["bundle"]
            elif kind == "error":
                yield kind, {k: ev.get(k) for k in ("ename", "evalue", "traceback")}

    async def result(self) -> CodeResult:
        return CodeResult.from_body(checked(CodeRunReply, await self._reply()))


class Attach(CallStream):
    """Output of a background process from given offsets: iterate ``(stream, offset, data)``.

    A ``("lost", offset, b"")`` item says bytes before ``offset`` were overwritten in the
    ring (``lost_bytes`` keeps the count). After the loop, :meth:`result` gives the exit
    status and the offsets to reattach from. ``progress_timeout`` bounds each wait for the
    next event (and for the final reply).
    """

    def __init__(self, client: Connected, call: Call, deadline: float | None, progress_timeout: float | None) -> None:
        super().__init__(client, call, DeadlineClock(call.conn.loop, "attach", deadline, progress_timeout))
        self.lost_bytes = {"stdout": 0, "stderr": 0}

    def __aiter__(self) -> AsyncIterator[tuple[str, int, bytes]]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[tuple[str, int, bytes]]:
        while (ev := await self._next_event()) is not None:
            kind = ev.get("ev")
            offset = ev.get("offset")
            if not isinstance(offset, int):
                continue
            if kind in ("stdout", "stderr") and isinstance(ev.get("data"), bytes):
                yield kind, offset, ev["data"]
            elif kind == "lost" and ev.get("stream") in self.lost_bytes and isinstance(ev.get("bytes"), int):
                self.lost_bytes[ev["stream"]] += ev["bytes"]
                yield "lost", offset, b""

    async def result(self) -> ProcessAttachResult:
        body = await self._reply()
        return ProcessAttachResult.from_wire(checked(ProcessAttachReply, body))

    def cancel(self) -> None:
        self._client._conn._forget(self._call)
