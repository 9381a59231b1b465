"""The output pump (guestd/output/pump.py) on its own: real pipes, a fake request whose credit
the test sets, no daemon. Each test runs on asyncio's loop and on uvloop (guestd's)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import pytest
import uvloop

from guestd.output.capture import OutputCapture, OutputRing
from guestd.output.pump import OutputPump
from guestd.output.stream import CreditedStream
from guestd.testing.services import FakeStream


def _typed(stream: FakeStream) -> CreditedStream:
    return stream  # the fake is a CreditedStream (mypy checks it here)


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Iterator[Callable[[Callable[[], Coroutine[Any, Any, None]]], None]]:
    factory = asyncio.new_event_loop if request.param == "asyncio" else uvloop.new_event_loop

    def run_test(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(test())

    yield run_test


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    r, w = os.pipe()
    os.set_blocking(r, False)
    try:
        yield r, w
    finally:
        for fd in (r, w):
            with contextlib.suppress(OSError):
                os.close(fd)


async def ticks(n: int = 20) -> None:
    """Let the loop run ``n`` times: a registered reader of a readable pipe runs in these."""
    for _ in range(n):
        await asyncio.sleep(0)


async def until(cond: Callable[[], bool], most: int = 2000) -> None:
    for _ in range(most):
        if cond():
            return
        await asyncio.sleep(0)
    raise AssertionError("not reached")


def left_in(fd: int) -> bytes:
    """What the pipe still holds (read by the test, not the pump)."""
    out = b""
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return out
        if not chunk:
            return out
        out += chunk


def no_reader_on(loop: asyncio.AbstractEventLoop, fd: int) -> bool:
    """asyncio's loop says whether it had one; uvloop does not (None): the behaviour shows it."""
    removed = loop.remove_reader(fd)
    return removed is not True


def captures(limit: int = 1 << 20, mode: str = "tail") -> dict[int, OutputCapture]:
    return {1: OutputCapture(limit, mode), 2: OutputCapture(limit, mode)}


def streaming_pump() -> tuple[FakeStream, dict[int, OutputCapture], OutputPump]:
    """A pump routed to a stream with no credit yet, and the captures it falls back to."""
    stream, caps, pump = FakeStream(credit=0), captures(), OutputPump()
    pump.route(caps, _typed(stream))
    return stream, caps, pump


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


# -- credit ---------------------------------------------------------------------------------
def test_no_credit_nothing_is_read(run: Any, pipe: tuple[int, int]) -> None:
    r, w = pipe

    async def test() -> None:
        stream, caps, pump = streaming_pump()
        os.write(w, b"x" * 100)
        pump.add("stdout", r, 1)
        await ticks()
        assert stream.sent == [] and caps[1].total == 0
        assert pump.paused
        pump.close()
        assert left_in(r) == b"x" * 100  # every byte still in the pipe: the process blocks on it

    run(test)


def test_granted_credit_sends_exactly_that_many_bytes(run: Any, pipe: tuple[int, int]) -> None:
    r, w = pipe

    async def test() -> None:
        stream, caps, pump = streaming_pump()
        payload = bytes(range(100))
        os.write(w, payload)
        pump.add("stdout", r, 1)
        await ticks()
        stream.grant(30)
        await until(lambda: stream.credit == 0)
        await ticks()
        assert stream.sent == [("stdout", payload[:30])]  # one event, exactly the credit
        assert caps[1].total == 30 and caps[1].kept == 0  # streamed bytes are counted, not kept
        stream.grant(1000)
        await until(lambda: len(stream.data()) == 100)
        assert stream.data() == payload and caps[1].total == 100
        pump.close()
        assert left_in(r) == b""

    run(test)


def test_one_event_never_exceeds_max_frame(run: Any, pipe: tuple[int, int]) -> None:
    r, w = pipe

    async def test() -> None:
        stream = FakeStream(credit=1 << 20, max_frame=1000)
        pump = OutputPump()
        pump.route(captures(), _typed(stream))
        os.write(w, b"y" * 5000)
        pump.add("stdout", r, 1)
        await until(lambda: len(stream.data()) == 5000)
        assert [len(d) for _, d in stream.sent] == [1000] * 5
        pump.close()

    run(test)


def test_write_paused_pauses_then_resumes_after_drain(run: Any, pipe: tuple[int, int]) -> None:
    r, w = pipe

    async def test() -> None:
        stream = FakeStream(credit=1000)
        stream.write_paused = True
        pump = OutputPump(read_size=4)
        pump.route(captures(), _typed(stream))
        os.write(w, b"abcdefghijkl")
        pump.add("stdout", r, 1)
        await ticks()
        assert stream.sent == [("stdout", b"abcd")]  # one read, then it waits for the connection
        assert pump.paused
        stream.set_write_paused(False)
        await until(lambda: stream.data() == b"abcdefghijkl")
        assert not pump.paused
        pump.close()

    run(test)


def test_an_ended_request_gets_nothing_and_the_output_is_captured(run: Any, pipe: tuple[int, int]) -> None:
    """The request's final frame went out (the core refused its input, say) while the process
    runs on: its output goes into the capture, and reading does not spin on a pause/resume."""
    r, w = pipe

    async def test() -> None:
        stream, caps, pump = streaming_pump()
        stream.end()
        os.write(w, b"late")
        pump.add("stdout", r, 1)
        await until(lambda: caps[1].total == 4)
        assert caps[1].data() == b"late" and stream.sent == [] and not pump.paused
        pump.close()

    run(test)


def test_a_connection_that_fails_its_drain_leaves_reading_paused_quietly(run: Any, pipe: tuple[int, int]) -> None:
    r, w = pipe

    async def test() -> None:
        stream = FakeStream(credit=4)
        stream.drain_error = ConnectionResetError("closing")
        pump = OutputPump()
        pump.route(captures(), _typed(stream))
        os.write(w, b"12345678")
        pump.add("stdout", r, 1)
        await until(lambda: pump.paused)
        stream.grant(100)
        await ticks()
        assert stream.data() == b"1234" and pump.paused  # its owner ends or resumes it
        pump.close()
        assert not [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    run(test)


# -- cancel safety --------------------------------------------------------------------------
def test_cancel_mid_drain_then_close_leaves_no_reader_no_task_no_fd(run: Any) -> None:
    async def test() -> None:
        before = open_fds()
        r, w = os.pipe()
        os.set_blocking(r, False)
        loop = asyncio.get_running_loop()
        stream = FakeStream(credit=3)
        pump = OutputPump()
        pump.route(captures(), _typed(stream))
        os.write(w, b"abcdefgh")
        pump.add("stdout", r, 1)
        drain = loop.create_task(pump.drain_to_client())
        await until(lambda: stream.data() == b"abc" and pump.paused)
        await ticks()
        assert not drain.done()  # waiting for credit, mid-read
        drain.cancel()
        with pytest.raises(asyncio.CancelledError):
            await drain
        pump.close()
        stream.grant(1000)  # credit after the close adds no reader back
        os.write(w, b"ijkl")
        await ticks()
        assert stream.data() == b"abc"
        assert no_reader_on(loop, r)
        assert not [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        assert left_in(r) == b"defghijkl"
        os.close(r)
        os.close(w)
        assert open_fds() == before

    run(test)


def test_close_while_paused_cancels_the_resume(run: Any, pipe: tuple[int, int]) -> None:
    r, w = pipe

    async def test() -> None:
        loop = asyncio.get_running_loop()
        stream = FakeStream(credit=0)
        pump = OutputPump()
        pump.route(captures(), _typed(stream))
        os.write(w, b"data")
        pump.add("stdout", r, 1)
        await until(lambda: pump.paused)
        pump.close()
        pump.close()  # idempotent
        await ticks()
        assert not [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]  # no resume left
        stream.grant(100)
        pump.resume()  # nor does a resume after the close
        await ticks()
        assert stream.sent == [] and no_reader_on(loop, r)
        assert not [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        assert left_in(r) == b"data"

    run(test)


def test_hand_over_gives_the_open_fds_and_reads_no_more(run: Any, pipe: tuple[int, int]) -> None:
    r, w = pipe

    async def test() -> None:
        loop = asyncio.get_running_loop()
        caps = captures()
        pump = OutputPump()
        pump.route(caps)
        pump.add("stdout", r, 1)
        assert pump.hand_over() == {"stdout": r}
        os.write(w, b"for the new owner")
        await ticks()
        assert caps[1].total == 0 and no_reader_on(loop, r)
        assert left_in(r) == b"for the new owner"  # the fd is open: the pump closes no fd

    run(test)


# -- the end --------------------------------------------------------------------------------
def test_final_drain_stops_at_its_bound_when_the_writer_never_closes(run: Any, pipe: tuple[int, int]) -> None:
    r, w = pipe

    async def test() -> None:
        caps = captures()
        pump = OutputPump(read_size=10, drain_reads=64)
        pump.route(caps)
        os.write(w, b"z" * 1000)  # and the write end stays open: no end of file comes
        pump.add("stdout", r, 1)
        pump.close()  # reading has stopped: only the drain reads now
        pump.drain_now()
        assert caps[1].total == 640  # 64 reads of 10 bytes, then it stops
        assert len(left_in(r)) == 360

    run(test)


def test_final_drain_to_the_client_stops_at_its_bound(run: Any, pipe: tuple[int, int]) -> None:
    r, w = pipe

    async def test() -> None:
        stream = FakeStream(credit=1 << 20)
        pump = OutputPump(read_size=10, drain_reads=64)
        pump.route(captures(), _typed(stream))
        os.write(w, b"z" * 1000)
        pump.add("stdout", r, 1)
        pump.close()
        await pump.drain_to_client()
        assert len(stream.data()) == 640
        assert len(left_in(r)) == 360

    run(test)


def test_final_drain_counts_credit_waits_in_its_bound(run: Any, pipe: tuple[int, int]) -> None:
    """A client that grants a few bytes at a time cannot hold the drain past its bound."""
    r, w = pipe

    async def test() -> None:
        stream = FakeStream(credit=0)
        stream.on_wait_credit = lambda: stream.grant(5)
        pump = OutputPump(read_size=10, drain_reads=64)
        pump.route(captures(), _typed(stream))
        os.write(w, b"z" * 1000)
        pump.add("stdout", r, 1)
        pump.close()
        await pump.drain_to_client()
        assert len(stream.data()) == 32 * 5  # 32 waits for credit, 32 reads of 5
        assert all(len(d) == 5 for _, d in stream.sent)

    run(test)


def test_end_of_file_ends_the_source(run: Any, pipe: tuple[int, int]) -> None:
    r, w = pipe

    async def test() -> None:
        loop = asyncio.get_running_loop()
        ended: list[str] = []
        caps = captures()
        pump = OutputPump(on_end=ended.append)
        pump.route(caps)
        pump.add("stderr", r, 2)
        assert not await pump.wait_ended(0.01)  # the writer is open: bounded, not ended
        os.write(w, b"last words")
        os.close(w)
        assert await pump.wait_ended(60)
        assert ended == ["stderr"] and pump.sources == {}
        assert caps[2].data() == b"last words" and caps[1].total == 0
        assert no_reader_on(loop, r)
        pump.close()

    run(test)


# -- where the bytes go ---------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["tail", "head_tail"])
def test_capture_mode_accounts_dropped_bytes_exactly(run: Any, pipe: tuple[int, int], mode: str) -> None:
    r, w = pipe

    async def test() -> None:
        caps = captures(limit=100, mode=mode)
        pump = OutputPump(read_size=64)
        pump.route(caps)
        payload = bytes(i % 251 for i in range(1000))
        pump.add("stdout", r, 1)
        os.write(w, payload)
        os.close(w)
        assert await pump.wait_ended(60)
        cap = caps[1]
        assert cap.total == 1000 and cap.kept == 100 and cap.dropped == 900
        if mode == "tail":
            assert cap.data() == payload[-100:] and cap.gap_at == 0
        else:
            assert cap.data() == payload[:50] + payload[-50:] and cap.gap_at == 50
        pump.close()

    run(test)


def test_taps_get_every_byte_and_unrouted_output_is_counted(run: Any, pipe: tuple[int, int]) -> None:
    r, w = pipe

    async def test() -> None:
        ring = OutputRing(1 << 16)
        notified: list[None] = []
        pump = OutputPump(on_output=lambda: notified.append(None))
        pump.add("stdout", r, 1, (ring,))
        os.write(w, b"between commands")
        await until(lambda: pump.unrouted_bytes == 16)
        stream = FakeStream(credit=4)
        caps = captures()
        pump.route(caps, _typed(stream))
        os.write(w, b"streamed")
        await until(lambda: pump.paused)
        stream.grant(100)
        await until(lambda: stream.data() == b"streamed")
        assert ring.read(0, 1 << 16)[0] == b"between commandsstreamed"
        assert caps[1].total == 8 and pump.unrouted_bytes == 16 and notified
        pump.close()

    run(test)


def test_resume_reads_again_at_once(run: Any, pipe: tuple[int, int]) -> None:
    """A shell command's stream is done with: its output goes to its capture from now on."""
    r, w = pipe

    async def test() -> None:
        stream, caps, pump = streaming_pump()
        os.write(w, b"held")
        pump.add("stdout", r, 1)
        await until(lambda: pump.paused)
        pump.route(caps)
        pump.resume()
        await until(lambda: caps[1].total == 4)
        assert caps[1].data() == b"held" and stream.sent == []
        assert not [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        pump.close()

    run(test)
