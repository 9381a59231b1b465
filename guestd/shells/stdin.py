"""A session command's stdin: /dev/null, a file holding the request's ``input``, a FIFO fed
from INPUT frames (``stdin_stream``), or the terminal of a pty command."""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from guestd.children.tree import write_all
from guestd.shells.script import stdin_source

if TYPE_CHECKING:
    from guestd.services import Request, Services
    from guestd.shells.job import JobFifos

# StdinFifo.end_input looks whether the command has opened its stdin at these intervals: soon
# at first (the usual command opens it within milliseconds), then doubling up to the cap, so a
# command that never reads its stdin costs a few wake-ups a second, not a hundred.
UNOPENED_FIFO_FIRST_POLL_S = 0.002
UNOPENED_FIFO_MAX_POLL_S = 0.25


def backing_off(first_s: float, cap_s: float) -> Iterator[float]:
    """first_s, 2 x first_s, 4 x ... up to cap_s, then cap_s for ever."""
    interval = first_s
    while True:
        yield interval
        interval = min(cap_s, interval * 2)


class StdinFifo:
    """The stdin of a ``stdin_stream`` session command: a FIFO the command opens for reading
    and guestd writes INPUT data into. guestd holds a read end too, so its write end opens at
    once and the command's open never blocks; closing the write end is the command's EOF."""

    def __init__(self, directory: str, ids: tuple[int, int] | None) -> None:
        self.path = os.path.join(directory, f"in-{os.urandom(12).hex()}")
        os.mkfifo(self.path, 0o600)
        self.hold: int | None = None
        self.write: int | None = None
        try:
            if ids is not None:
                os.chown(self.path, *ids)
            self.hold = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            self.write = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except BaseException:
            self.close()
            raise

    def close_write(self) -> None:
        fd, self.write = self.write, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    async def end_input(self) -> None:
        """The command's EOF (INPUT eof). A reader that opens a FIFO without a writer waits for
        one for ever, so closing the write end before bash has opened the FIFO for the command
        (data and eof sent right behind the request) hung the command until its timeout. guestd's
        own read end goes first; then, while poll says the FIFO has no reader (POLLERR), the
        command has not opened it yet: the write end stays (the bytes written wait in the pipe)
        and is looked at again after a backing-off interval, for as long as the command runs
        (this task goes with it)."""
        fd, self.hold = self.hold, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        intervals = backing_off(UNOPENED_FIFO_FIRST_POLL_S, UNOPENED_FIFO_MAX_POLL_S)
        while self.write is not None:
            poller = select.poll()
            poller.register(self.write, 0)  # POLLERR is always reported
            if not any(events & select.POLLERR for _, events in poller.poll(0)):
                break
            await asyncio.sleep(next(intervals))
        self.close_write()

    def give_write(self) -> int | None:
        """The write end for a detached job's stdin (process.write); the FIFO is closed here."""
        fd, self.write = self.write, None
        self.close()
        return fd

    def close(self) -> None:
        self.close_write()
        fd, self.hold = self.hold, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(self.path)


class PtyInput:
    """INPUT data into a pty-mode command: written to the terminal's primary side (a copy of
    the fd, closed with the job); eof is the terminal's end-of-file character (^D), which
    ends a read at the start of a line as a closed pipe would."""

    def __init__(self, master: int) -> None:
        self.write: int | None = os.dup(master)

    def close_write(self) -> None:
        if self.write is not None:
            with contextlib.suppress(OSError):
                os.write(self.write, b"\x04")

    async def end_input(self) -> None:
        self.close_write()

    def close(self) -> None:
        fd, self.write = self.write, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


def input_dir(services: Services) -> str:
    """The 0711 directory of the commands' input files and FIFOs: the workload user can open
    its own (unguessable) names, not list others."""
    runtime = services.runtime_dir()
    directory = os.path.join(runtime, "shell-input")
    os.makedirs(directory, mode=0o711, exist_ok=True)
    os.chmod(runtime, 0o711)
    return directory


def write_input_file(services: Services, data: bytes) -> str:
    """``input`` in a file of its own, readable by the workload user (bash runs as it)."""
    path = os.path.join(input_dir(services), f"in-{os.urandom(12).hex()}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        ids = services.config.policy.workload_ids()
        if ids is not None:
            os.fchown(fd, *ids)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    return path


class CommandInput:
    """The stdin of one session command, from the request; ``source`` is the bash text of
    its ``<`` redirection. close() ends it all (a detached job keeps its FIFO's write end)."""

    def __init__(self, ctx: Request | None) -> None:
        self.ctx = ctx
        self.source = "/dev/null"
        self.fifo: StdinFifo | None = None  # stdin_stream
        self.pty: PtyInput | None = None
        self.file: str | None = None  # input
        self.feeder: asyncio.Task[None] | None = None

    @classmethod
    def prepare(
        cls,
        services: Services,
        data: bytes | None,
        stream: bool,
        ctx: Request | None,
        job: JobFifos | None,
        on_signal: Callable[[Any], None],
    ) -> CommandInput:
        """``data``: the request's input; ``stream``: stdin_stream; ``job``: the command's
        job (pty mode when it has a terminal); ``on_signal``: INPUT signals in pty mode."""
        made = cls(ctx)
        try:
            if data is not None:
                made.file = write_input_file(services, data)
            if job is not None and job.master is not None:
                # pty: stdin, stdout and stderr are the terminal (one stream, as a terminal shows
                # it: stdout); INPUT data is typed into it, INPUT signals go to the job's group.
                made.pty = PtyInput(job.master)
                if ctx is not None:
                    made.feeder = asyncio.get_running_loop().create_task(feed_stdin(ctx, made.pty))
                    ctx.handle_signals(on_signal)
            elif stream and ctx is not None:
                made.fifo = StdinFifo(input_dir(services), services.config.policy.workload_ids())
                made.feeder = asyncio.get_running_loop().create_task(feed_stdin(ctx, made.fifo))
                made.source = stdin_source(made.fifo.path)
            else:
                if ctx is not None:
                    ctx.stop_taking_data()  # INPUT data and eof mean nothing without stdin_stream
                made.source = stdin_source(made.file)
        except BaseException:
            made.close(keep_fifo=False)
            raise
        return made

    def close(self, keep_fifo: bool) -> None:
        """The command has ended, or (``keep_fifo``) goes on as a detached job, which took the
        FIFO's write end (StdinFifo.give_write)."""
        if self.feeder is not None:
            self.feeder.cancel()
        if self.ctx is not None:
            self.ctx.stop_taking_data()
        if self.fifo is not None and not keep_fifo:
            self.fifo.close()
        if self.pty is not None:
            self.pty.close()
        if self.file is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.file)


async def feed_stdin(ctx: Request, stdin: StdinFifo | PtyInput) -> None:
    """INPUT data into a stdin_stream command's FIFO, acknowledged once written (the window is
    exec's); eof closes it."""
    loop = asyncio.get_running_loop()
    try:
        while stdin.write is not None:
            body = await ctx.input.get()
            chunk = body.get("data")
            if isinstance(chunk, bytes) and chunk and stdin.write is not None:
                await write_all(loop, stdin.write, chunk)
                ctx.ack_input(len(chunk))
            if body.get("eof"):
                await stdin.end_input()
                return
    except OSError:
        pass  # the command closed its stdin: nothing more to deliver
