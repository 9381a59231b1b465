"""Live runs (``exec``, ``sh``, ``shell run``): the command's output written here as it arrives,
to a terminal and to a pipe alike, and (``-i``) this process's stdin sent to the command as it
is read, under the guest's credit, its end closing the command's stdin.

The whole output arrives: a streamed run is not cut by the guest's capture (``max_output`` bounds
only what a reply keeps). The client's credit is the only buffer, so a slow local reader slows the
command instead of filling memory. Should the guest still report more bytes than arrived (a
stream that died with its request), :func:`finish_live` says so and the run exits
:data:`OUTPUT_CUT_EXIT`, never 0. :func:`show_run` takes a run of either kind, live or bounded
(``--max-output``...), to its end and its exit code.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from guestd.cli import terminal
from guestd.cli.shared import print_json
from guestd.wire.errors import GuestdError

# guestctl's own failure code: the output that reached this side is not all the command wrote.
OUTPUT_CUT_EXIT = 1
# A reader of our stdout went away (``| head``): as a local producer killed by SIGPIPE would.
READER_GONE_EXIT = 128 + 13
# Bytes asked of local stdin per read; a pipe gives what it holds, up to this.
STDIN_CHUNK = 1024 * 1024

R = TypeVar("R", bound="GapCaptured")  # a run's reply: ExecResult, ShellResult
R_co = TypeVar("R_co", covariant=True)


class RunStream(Protocol[R_co]):
    """What :class:`guestd.client.aio.ExecStream` and ``ShellStream`` offer a live run."""

    def __aiter__(self) -> AsyncIterator[tuple[str, bytes]]: ...

    async def write_stdin(self, data: bytes) -> None: ...

    async def close_stdin(self) -> None: ...

    async def cancel(self) -> None: ...

    async def result(self) -> R_co: ...


async def show_run(
    stream: RunStream[R],
    ns: argparse.Namespace,
    live: bool,
    exit_code: Callable[[R], int],
    notes: Callable[[R], None],
) -> int:
    """A run (``exec``, ``shell run``) to its end and guestctl's exit code: the output relayed
    as it comes (with ``-i``, local stdin sent meanwhile), then the reply as JSON, or what a
    ``live`` run's reply adds (or a bounded run's capture with its gaps marked and what was
    dropped) and the run's ``notes`` on stderr. :data:`OUTPUT_CUT_EXIT` when live output was
    cut, :data:`READER_GONE_EXIT` when our stdout's reader went away."""
    delivered = await relay(stream, ns.raw, send_stdin=ns.stdin)
    if delivered.reader_gone:
        return READER_GONE_EXIT
    res = await stream.result()
    if ns.json:
        print_json(res)
        return exit_code(res)
    if live:
        cut = finish_live(delivered, res, ns.raw)
    else:
        terminal.write_output(*with_gap_markers(res), ns.raw)
        report_truncation(res)  # asked for with --max-output, --head-tail or --spill
        cut = False
    notes(res)
    return OUTPUT_CUT_EXIT if cut else exit_code(res)


@dataclass
class Delivered:
    """Bytes of each stream written here; ``reader_gone``: our stdout's reader went away first."""

    stdout: int = 0
    stderr: int = 0
    reader_gone: bool = False


async def relay(stream: RunStream[object], raw: bool, send_stdin: bool) -> Delivered:
    """Write the run's output here as it arrives (neutralized for a terminal unless ``raw``) and,
    with ``send_stdin``, send local stdin to it meanwhile. A reader of our stdout that goes
    away cancels the run (``reader_gone``) and silences our stdout, as SIGPIPE would."""
    out, err = terminal.stdout(raw), terminal.stderr(raw)
    pump = asyncio.create_task(send_local_stdin(stream)) if send_stdin else None
    delivered = Delivered()
    try:
        async for name, data in stream:
            if name == "stderr":
                err.write(data)
                delivered.stderr += len(data)
            else:
                out.write(data)
                delivered.stdout += len(data)
        out.close()
    except BrokenPipeError:
        delivered.reader_gone = True
        silence_stdout()
        await stream.cancel()
        with contextlib.suppress(GuestdError):  # the cancel's answer: collected, not left unretrieved
            await stream.result()
    finally:
        err.close()
        if pump is not None:
            await _collect(pump)
    return delivered


async def _collect(pump: asyncio.Task[None]) -> None:
    """Stop sending stdin (the run has ended; a terminal's stdin never ends by itself) and
    surface a failure of the sender, which would otherwise go unreported."""
    if not pump.done():
        pump.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await pump


def silence_stdout() -> None:
    """Our stdout's reader is gone: later writes (and the interpreter's final flush) go nowhere
    instead of raising again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


async def send_local_stdin(stream: RunStream[object]) -> None:
    """Local stdin to the command, each read sent as it arrives (a typed line, a pipe's
    buffer) within the guest's credit: a command that reads slowly slows the local writer.
    Its end closes the command's stdin. A command that stops taking stdin (it exited) ends
    the sending: what was not read stays unsent, as with a local pipe."""
    reader = LocalReader(sys.stdin.fileno())
    try:
        while data := await reader.read():
            await stream.write_stdin(data)
        await stream.close_stdin()
    except BrokenPipeError:
        return
    finally:
        reader.close()


class LocalReader:
    """Reads of a local fd without blocking the event loop while it has nothing: a pipe or a
    terminal is polled; a regular file or ``/dev/null`` (which epoll refuses) is read at once,
    as such reads never wait for a writer."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.loop = asyncio.get_running_loop()
        self.pollable = True
        try:
            self.loop.add_reader(fd, lambda: None)
        except OSError:  # EPERM from epoll: a regular file or /dev/null
            self.pollable = False
        else:
            self.loop.remove_reader(fd)

    async def read(self) -> bytes:
        """The next bytes; ``b""`` at the end (or when the fd fails, e.g. a hung-up terminal)."""
        while True:
            if self.pollable:
                await self._readable()
            try:
                return os.read(self.fd, STDIN_CHUNK)
            except BlockingIOError:  # O_NONBLOCK set by someone sharing the fd: wait again
                continue
            except OSError:
                return b""

    async def _readable(self) -> None:
        ready: asyncio.Future[None] = self.loop.create_future()

        def on_readable() -> None:
            if not ready.done():
                ready.set_result(None)

        self.loop.add_reader(self.fd, on_readable)
        try:
            await ready
        finally:
            self.loop.remove_reader(self.fd)

    def close(self) -> None:
        if self.pollable:
            self.loop.remove_reader(self.fd)


def finish_live(delivered: Delivered, res: Captured, raw: bool) -> bool:
    """After a live run: what the reply itself carries (a guest that answered with a capture
    instead of events; guestd's is empty then) is written too, and a stream that arrived shorter
    than the guest reports it was is said on stderr. True when output was cut."""
    if res.stdout or res.stderr:
        terminal.write_output(res.stdout, res.stderr, raw)
    cut = False
    for name, got, produced in (
        ("stdout", delivered.stdout + len(res.stdout), res.stdout_bytes),
        ("stderr", delivered.stderr + len(res.stderr), res.stderr_bytes),
    ):
        if got < produced:
            print(f"guestctl: {name} cut: {produced - got} of {produced} bytes did not arrive", file=sys.stderr)
            cut = True
    return cut


class Captured(Protocol):
    """A run's reply (ExecResult, ShellResult): the bytes it kept and its counts."""

    @property
    def stdout(self) -> bytes: ...
    @property
    def stderr(self) -> bytes: ...
    @property
    def stdout_bytes(self) -> int: ...
    @property
    def stderr_bytes(self) -> int: ...
    @property
    def stdout_dropped(self) -> int: ...
    @property
    def stderr_dropped(self) -> int: ...


def with_gap_markers(res: GapCaptured) -> tuple[bytes, bytes]:
    """A bounded run's stdout and stderr with ``[... N bytes dropped ...]`` in the place the guest
    dropped them (``--head-tail`` keeps both ends: the gap is in the middle), so a reader of the
    output alone sees where it is cut."""
    streams = []
    for data, gap_at, dropped in (
        (res.stdout, res.stdout_gap_at, res.stdout_dropped),
        (res.stderr, res.stderr_gap_at, res.stderr_dropped),
    ):
        if gap_at is not None and dropped and 0 <= gap_at <= len(data):
            head, tail = data[:gap_at], data[gap_at:]
            newline = b"" if not head or head.endswith(b"\n") else b"\n"
            data = head + newline + f"[... {dropped} bytes dropped ...]\n".encode() + tail
        streams.append(data)
    return streams[0], streams[1]


class GapCaptured(Captured, Protocol):
    """A reply that says where its head+tail capture has its gap."""

    @property
    def stdout_gap_at(self) -> int | None: ...
    @property
    def stderr_gap_at(self) -> int | None: ...


def report_truncation(res: Captured) -> bool:
    """A bounded run (``--max-output``...): say on stderr what the guest dropped; True if it did."""
    for name, dropped, produced in (
        ("stdout", res.stdout_dropped, res.stdout_bytes),
        ("stderr", res.stderr_dropped, res.stderr_bytes),
    ):
        if dropped:
            print(f"guestctl: {name} truncated: {dropped} of {produced} bytes dropped", file=sys.stderr)
    return bool(res.stdout_dropped or res.stderr_dropped)
