"""A session's output: bash's stdout and stderr pipes, and the running command's job FIFOs,
into the running command's captures, or to a streaming client within its credit (reading
pauses while the client is behind, so the command blocks on its pipe instead of guestd
buffering without bound). Between commands, what background jobs write is counted as stray."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from guestd.children.tree import read_chunk

if TYPE_CHECKING:
    from guestd.capture import OutputCapture
    from guestd.services import Request
    from guestd.shells.job import RunningJob

READ_SIZE = 256 * 1024
DRAIN_READS = 64  # per stream, when a command has ended: at most this many reads
_STREAM_FIELDS = {1: {"ev": "stdout"}, 2: {"ev": "stderr"}}


class ShellOutput:
    def __init__(self) -> None:
        self.fds: dict[int, int] = {}  # bash's stdout (1) and stderr (2), until they end
        self.caps: dict[int, OutputCapture] | None = None  # the running command's
        self.stream: Request | None = None  # stream mode: the running command's request
        self.job: RunningJob | None = None  # the running command's job, if it has one
        self.last_output = 0.0
        self.stray_bytes = 0  # output written between commands (background jobs); not attributed
        self._paused: asyncio.Task[None] | None = None  # reading paused for a streaming client

    # -- bash's pipes, the command, its job ----------------------------------------------
    def attach(self, stdout: int, stderr: int) -> None:
        self.fds = {1: stdout, 2: stderr}
        loop = asyncio.get_running_loop()
        for which, fd in self.fds.items():
            loop.add_reader(fd, self.read_once, which)

    def detach(self) -> None:
        loop = asyncio.get_running_loop()
        for fd in self.fds.values():
            loop.remove_reader(fd)
        self.fds = {}

    def begin(self, caps: dict[int, OutputCapture], stream: Request | None) -> None:
        """A command starts: its output goes to ``caps``, or to ``stream``'s client."""
        self.caps, self.stream = caps, stream
        self.last_output = time.monotonic()

    def end(self) -> dict[int, OutputCapture]:
        """The command has ended and its output has been drained: its captures."""
        caps, self.caps = self.caps, None
        assert caps is not None
        return caps

    def attach_job(self, job: RunningJob) -> None:
        self.job = job
        loop = asyncio.get_running_loop()
        for which in (1, 2):
            fd = job.output_fd(which)
            if fd is not None:
                loop.add_reader(fd, self.read_job, which)
        loop.add_reader(job.fifos.read["status"], job.read_status)

    def detach_job(self) -> RunningJob | None:
        """Stop reading the job's FIFOs (they stay open: its owner closes or hands them on)."""
        job, self.job = self.job, None
        if job is not None:
            loop = asyncio.get_running_loop()
            for fd in job.fifos.read.values():
                loop.remove_reader(fd)
        return job

    # -- reading -------------------------------------------------------------------------
    def read_once(self, which: int) -> bool:
        """One read from a pipe, routed to the running command's capture (or counted as stray).
        False when nothing is ready, the pipe has ended, or a streaming client is out of credit."""
        fd = self.fds.get(which)
        if fd is None:
            return False
        size = self._read_size(which)
        if size <= 0:
            return False
        data = read_chunk(fd, size)
        if data is None:
            return False
        if not data:
            asyncio.get_running_loop().remove_reader(fd)
            del self.fds[which]
            return False
        self.last_output = time.monotonic()
        if self.caps is not None:
            self._take(which, data)
        else:
            self.stray_bytes += len(data)
        return True

    def read_job(self, which: int) -> bool:
        """One read from the job's stdout/stderr FIFO: to the capture and to the job's ring."""
        job = self.job
        if job is None or job.output_fd(which) is None:
            return False
        size = self._read_size(which)
        if size <= 0:
            return False
        data = job.read_output(which, size)
        if data is None:
            return False
        self.last_output = time.monotonic()
        if self.caps is not None:
            self._take(which, data)
        return True

    def _read_size(self, which: int) -> int:
        """READ_SIZE, or in stream mode no more than one event within the client's credit can
        carry (0: out of credit; reading pauses until the client grants more)."""
        ctx = self.stream
        if ctx is None or self.caps is None:
            return READ_SIZE
        room = min(READ_SIZE, ctx.data_room(_STREAM_FIELDS[which])) if ctx.active else READ_SIZE
        if room <= 0:
            self._wait_for_client(ctx)
        return room

    def _take(self, which: int, data: bytes) -> None:
        assert self.caps is not None
        ctx = self.stream
        if ctx is None or not ctx.active:
            self.caps[which].feed(data)
            return
        self.caps[which].total += len(data)  # streamed, not kept: only counted
        ctx.push_data(_STREAM_FIELDS[which], data)
        if ctx.data_room(_STREAM_FIELDS[which]) <= 0 or ctx.write_paused:
            self._wait_for_client(ctx)

    def _output_fds(self) -> list[tuple[int, Callable[[], object]]]:
        out: list[tuple[int, Callable[[], object]]] = [
            (fd, functools.partial(self.read_once, which)) for which, fd in self.fds.items()
        ]
        if self.job is not None:
            for which in (1, 2):
                fd = self.job.output_fd(which)
                if fd is not None:
                    out.append((fd, functools.partial(self.read_job, which)))
        return out

    # -- a streaming client's credit -----------------------------------------------------
    def _wait_for_client(self, ctx: Request) -> None:
        """The streaming client is behind: stop reading, so the command blocks on its pipe
        instead of guestd buffering without bound; read on once it grants credit."""
        if self._paused is not None:
            return
        loop = asyncio.get_running_loop()
        for fd, _cb in self._output_fds():
            loop.remove_reader(fd)

        async def resume() -> None:
            await ctx.wait_credit()
            await ctx.drain()
            if self._paused is asyncio.current_task():
                self._paused = None
                self._read_again()

        self._paused = loop.create_task(resume())

    def resume_reading(self) -> None:
        task, self._paused = self._paused, None
        if task is None:
            return
        task.cancel()
        self._read_again()

    def _read_again(self) -> None:
        loop = asyncio.get_running_loop()
        for fd, cb in self._output_fds():
            loop.add_reader(fd, cb)

    # -- the end of a command ------------------------------------------------------------
    async def drain_stream(self) -> None:
        """Stream mode, the command has ended: what is still in the pipes (at most their
        buffers) goes to the client within its credit, waiting for credit while it is there."""
        ctx = self.stream
        if ctx is None:
            return
        self.resume_reading()
        sources = [(w, self.read_once) for w in (1, 2)] + [(w, self.read_job) for w in (1, 2)]
        for which, read in sources:
            for _ in range(DRAIN_READS):
                if ctx.active and ctx.data_room(_STREAM_FIELDS[which]) <= 0:
                    await ctx.wait_credit()
                    self.resume_reading()
                    continue
                if not read(which):
                    break
        self.resume_reading()

    def drain(self) -> None:
        """Read whatever is in the pipes right now (bounded: DRAIN_READS reads per stream)."""
        for which in list(self.fds):
            for _ in range(DRAIN_READS):
                if not self.read_once(which):
                    break
        for which in (1, 2):
            for _ in range(DRAIN_READS):
                if not self.read_job(which):
                    break
        if self.job is not None:
            self.job.read_status()
