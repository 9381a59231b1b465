"""A session's output: bash's stdout and stderr pipes, and the running command's job FIFOs,
on one output pump (guestd.output.pump): into the running command's captures, or to a
streaming client within its credit (reading pauses while the client is behind, so the
command blocks on its pipe instead of guestd buffering without bound). Between commands,
what background jobs write is counted as stray."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from guestd.output.pump import OutputPump

if TYPE_CHECKING:
    from guestd.output.capture import OutputCapture
    from guestd.output.stream import CreditedStream
    from guestd.shells.job import RunningJob

_BASH = {1: "stdout", 2: "stderr"}  # the pump's names of bash's pipes
_JOB = {1: "job stdout", 2: "job stderr"}  # and of the job's FIFOs (its ring taps them)


class ShellOutput:
    def __init__(self) -> None:
        self.pump = OutputPump()
        self.caps: dict[int, OutputCapture] | None = None  # the running command's
        self.job: RunningJob | None = None  # the running command's job, if it has one

    @property
    def last_output(self) -> float:
        return self.pump.last_output

    @property
    def stray_bytes(self) -> int:
        """Output written between commands (background jobs); not attributed."""
        return self.pump.unrouted_bytes

    # -- bash's pipes, the command, its job ----------------------------------------------
    def attach(self, stdout: int, stderr: int) -> None:
        self.pump.add(_BASH[1], stdout, 1)
        self.pump.add(_BASH[2], stderr, 2)

    def detach(self) -> None:
        for name in _BASH.values():
            self.pump.remove(name)

    def begin(self, caps: dict[int, OutputCapture], stream: CreditedStream | None) -> None:
        """A command starts: its output goes to ``caps``, or to ``stream``'s client."""
        self.caps = caps
        self.pump.route(caps, stream)
        self.pump.last_output = time.monotonic()

    def stop_streaming(self) -> None:
        """The command's stream is done with: its output goes to its captures again, and
        reading goes on at once (bash's pipes are read between commands too)."""
        self.pump.route(self.caps)
        self.pump.resume()

    def end(self) -> dict[int, OutputCapture]:
        """The command has ended and its output has been drained: its captures."""
        caps, self.caps = self.caps, None
        assert caps is not None
        self.pump.route(None)
        return caps

    def attach_job(self, job: RunningJob) -> None:
        self.job = job
        for which, name in _JOB.items():
            fd = job.output_fd(which)
            if fd is not None:
                self.pump.add(name, fd, which, (job.rings[which],))
        asyncio.get_running_loop().add_reader(job.fifos.read["status"], job.read_status)

    def detach_job(self) -> RunningJob | None:
        """Stop reading the job's FIFOs (they stay open: its owner closes or hands them on)."""
        job, self.job = self.job, None
        if job is not None:
            for name in _JOB.values():
                self.pump.remove(name)
            asyncio.get_running_loop().remove_reader(job.fifos.read["status"])
        return job

    # -- the end of a command ------------------------------------------------------------
    async def drain_stream(self) -> None:
        """Stream mode, the command has ended: what is still in the pipes (at most their
        buffers) goes to the client within its credit, waiting for credit while it is there."""
        if self.pump.stream is None:
            return
        self.pump.resume()
        await self.pump.drain_to_client()
        self.pump.resume()

    def drain(self) -> None:
        """Read whatever is in the pipes right now (bounded: DRAIN_READS reads per stream)."""
        self.pump.drain_now()
        if self.job is not None:
            self.job.read_status()
