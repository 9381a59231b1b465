"""A command that has exited by the time its spawn is collected (most short ones: issue 34's
exec `true`): its exit is reaped and its pipes read at once, with no watch put on the loop and
taken off again, and nothing of its output or exit is lost on the way. Real pipes and real
children; the pump tests run on asyncio's loop and on uvloop (guestd's)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import pytest
import uvloop

from guestd.children import Child
from guestd.client import Client
from guestd.output.capture import OutputCapture
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


def _captures() -> dict[int, OutputCapture]:
    return {1: OutputCapture(1 << 20), 2: OutputCapture(1 << 20)}


class _WatchedFds:
    """The pump's loop, recording the fds put on it to be read (uvloop says nothing back)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.added: list[int] = []

    def add_reader(self, fd: int, callback: Callable[..., Any], *args: Any) -> None:
        self.added.append(fd)
        self._loop.add_reader(fd, callback, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loop, name)


def _recording(pump: OutputPump) -> _WatchedFds:
    watched = _WatchedFds(pump.loop)
    pump.loop = watched  # type: ignore[assignment]
    return watched


def test_read_now_takes_an_ended_pipe_whole_and_never_watches_it(run: Any, pipe: tuple[int, int]) -> None:
    r, w = pipe
    data = os.urandom(60_000)  # within one pipe buffer: written whole before the writer closes

    async def body() -> None:
        ended: list[str] = []
        pump = OutputPump(on_end=ended.append, read_size=4096)  # several reads for the whole
        watched = _recording(pump)
        caps = _captures()
        pump.route(caps)
        os.write(w, data)
        os.close(w)
        pump.add("stdout", r, 1, read_now=True)
        assert caps[1].data() == data and caps[1].total == len(data)
        assert ended == ["stdout"] and not pump.sources
        assert watched.added == []  # it was never on the loop
        pump.close()

    run(body)


def test_read_now_watches_a_pipe_whose_writer_is_still_open(run: Any, pipe: tuple[int, int]) -> None:
    """A leftover process (``daemon &``) holds the pipe: what is there is read, then the pipe is
    watched as usual and its later output and end arrive."""
    r, w = pipe

    async def body() -> None:
        pump = OutputPump()
        watched = _recording(pump)
        caps = _captures()
        pump.route(caps)
        os.write(w, b"early ")
        pump.add("stdout", r, 1, read_now=True)
        assert caps[1].data() == b"early " and "stdout" in pump.sources and watched.added == [r]
        os.write(w, b"late")
        os.close(w)
        assert await pump.wait_ended(30.0)
        assert caps[1].data() == b"early late"
        pump.close()

    run(body)


def test_read_now_with_a_streaming_client_out_of_credit_reads_nothing_until_it_grants(
    run: Any, pipe: tuple[int, int]
) -> None:
    r, w = pipe

    async def body() -> None:
        stream = FakeStream(credit=0)
        pump = OutputPump()
        watched = _recording(pump)
        pump.route(_captures(), _typed(stream))
        os.write(w, b"held")
        os.close(w)
        pump.add("stdout", r, 1, read_now=True)
        assert pump.paused and stream.sent == [] and watched.added == []
        stream.grant(1 << 16)
        assert await pump.wait_ended(30.0)
        assert b"".join(data for _fields, data in stream.sent) == b"held"
        pump.close()

    run(body)


class _Owner:
    def __init__(self) -> None:
        self.reaped_children: list[Child] = []

    def reaped(self, child: Child) -> None:
        self.reaped_children.append(child)

    def retire(self, child: Child) -> None:
        pass


def test_watch_reaps_an_exited_child_at_once_without_a_watch() -> None:
    async def body() -> None:
        proc = subprocess.Popen(["sh", "-c", "exit 3"])
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # a zombie now, not reaped
        owner = _Owner()
        child = Child(owner, "exec", proc.pid, None, None, {}, proc)
        seen: list[int | None] = []
        child.watch(lambda: seen.append(child.status))
        assert child._exit_watch is None  # nothing was put on the loop
        assert child.status is not None and os.waitstatus_to_exitcode(child.status) == 3
        assert seen == [child.status] and owner.reaped_children == [child] and child.exited.done()
        assert child.rusage is not None
        child.release()

    asyncio.run(body())


def test_watch_of_a_running_child_still_sees_its_exit() -> None:
    async def body() -> None:
        r, w = os.pipe()
        proc = subprocess.Popen(["sh", "-c", "read x; exit 4"], stdin=r)
        os.close(r)
        child = Child(_Owner(), "exec", proc.pid, None, None, {}, proc)
        child.watch()
        assert child.running and child._exit_watch is not None
        os.close(w)  # read sees its end: the shell exits
        await asyncio.wait_for(asyncio.shield(child.exited), 30)
        assert child.status is not None and os.waitstatus_to_exitcode(child.status) == 4
        child.release()

    asyncio.run(body())


def test_exec_that_ends_before_its_spawn_is_collected_keeps_every_byte_and_its_exit(client: Client) -> None:
    """Output on both streams, more than one read's worth on one of them, then exit: everything
    is in the reply, counted exactly, whichever of exit and end of output guestd sees first."""
    script = "head -c 60000 /dev/zero | tr '\\0' x; printf err >&2; exit 5"
    for _ in range(20):
        r = client.exec(script)
        assert r.exit_code == 5
        assert r.stdout == b"x" * 60000 and r.stdout_bytes == 60000 and r.stdout_dropped == 0
        assert r.stderr == b"err" and r.stderr_bytes == 3


def test_exec_leftover_holding_the_pipes_is_still_waited_for_within_linger(client: Client) -> None:
    """The main process exits at once; what it left behind writes later, before linger_s ends."""
    r = client.exec("(sleep 0.3; echo late) & echo now", linger_s=10.0)
    assert r.exit_code == 0 and r.stdout == b"now\nlate\n"
