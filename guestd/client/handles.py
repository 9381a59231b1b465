"""Handles for what you hold in the guest, for the asyncio client: a shell session, a code
context, a background process, a kept run. Each is what its create call returns (``.id`` and
the rest of the reply as attributes) and an async context manager that releases it on exit::

    async with await client.shell_create() as sh:
        r = await sh.run("cd /src && make")

The blocking twins are in :mod:`guestd.client.handles_sync`. The flat methods taking an id
(``client.shell_run(sid, ...)``) stay; a handle's methods call them, with the same parameters
(``tests/test_client_typed.py`` keeps them equal). A handle holds its client as the protocol of
exactly those methods (``ShellClient``, ...: :mod:`guestd.client._surface`, generated from
AsyncClient's signatures), so this module, which the client imports, never imports it back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Self

from guestd.client.results import result_of
from guestd.client.streaming import DERIVED
from guestd.wire.errors import ErrorCode, GuestdError

if TYPE_CHECKING:
    from guestd.client._surface import CodeContextClient, KeptRunClient, ProcessClient, ShellClient
    from guestd.client.params import OnTimeout
    from guestd.client.replies import (
        CodeCreateResult,
        ProcessStartResult,
        ProcessWaitResult,
        RunInfo,
        ShellCreateResult,
    )
    from guestd.client.results import CodeResult, ProcessOutput, ShellResult
    from guestd.client.streaming import EventCallback, OutputCallback, RunDeadline, StdinSource
    from guestd.client.streams import Attach

GONE = (ErrorCode.NOT_FOUND.value,)  # releasing what is already gone is not an error


@contextlib.contextmanager
def unless_gone(*also: str) -> Iterator[None]:
    """Releasing what is already gone (``not_found``, or a code in ``also``) is not an error."""
    try:
        yield
    except GuestdError as e:
        if e.code not in (*GONE, *also):
            raise


class AsyncHandle:
    """What every handle is: ``async with`` it, and what it holds is released on exit (:meth:`close`)."""

    async def close(self) -> None:
        """Release it (what is already gone is not an error)."""
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncShell(AsyncHandle):
    """A persistent bash session (cd, variables, venvs persist between runs)."""

    def __init__(self, client: ShellClient, created: ShellCreateResult) -> None:
        self.client = client
        self.info = created  # the create call's reply
        self.id = created.id
        self.pid = created.pid

    def __repr__(self) -> str:
        return f"<AsyncShell {self.id} pid={self.pid}>"

    async def run(
        self,
        command: str,
        *,
        input: StdinSource | None = None,
        timeout_s: float | None = None,
        idle_timeout_s: float | None = None,
        max_output: int | None = None,
        head_tail: bool = False,
        on_timeout: OnTimeout | None = None,
        merge_stderr: bool | None = None,
        check_syntax: bool | None = None,
        keep: bool | None = None,
        spill: bool | None = None,
        strip_ansi: bool | None = None,
        collapse_cr: bool | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        deadline: RunDeadline = DERIVED,
    ) -> ShellResult:
        """:meth:`AsyncClient.shell_run` in this session."""
        return await self.client.shell_run(
            self.id,
            command,
            input=input,
            timeout_s=timeout_s,
            idle_timeout_s=idle_timeout_s,
            max_output=max_output,
            head_tail=head_tail,
            on_timeout=on_timeout,
            merge_stderr=merge_stderr,
            check_syntax=check_syntax,
            keep=keep,
            spill=spill,
            strip_ansi=strip_ansi,
            collapse_cr=collapse_cr,
            on_stdout=on_stdout,
            on_stderr=on_stderr,
            deadline=deadline,
        )

    async def close(self, *, deadline: float | None = 30.0) -> None:
        """End the session (a session already gone is not an error)."""
        with unless_gone():
            await self.client.shell_close(self.id, deadline=deadline)


class AsyncCodeContext(AsyncHandle):
    """A code context: a kernel whose state persists between cells."""

    def __init__(self, client: CodeContextClient, created: CodeCreateResult) -> None:
        self.client = client
        self.info = created  # the create call's reply
        self.id = created.id
        self.name = created.name
        self.pid = created.pid
        self.pooled = created.pooled
        self.existing = created.existing
        self.kernel = created.kernel

    def __repr__(self) -> str:
        return f"<AsyncCodeContext {self.id} kernel={self.kernel} pid={self.pid}>"

    async def run(
        self,
        code: str,
        *,
        timeout_s: float | None = None,
        interrupt_grace_s: float | None = None,
        input_lines: list[str] | None = None,
        strip_ansi: bool | None = None,
        max_output: int | None = None,
        keep: bool | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        on_result: EventCallback | None = None,
        on_error: EventCallback | None = None,
        deadline: RunDeadline = DERIVED,
    ) -> CodeResult:
        """:meth:`AsyncClient.code_run` in this context."""
        return await self.client.code_run(
            code,
            context=self.id,
            timeout_s=timeout_s,
            interrupt_grace_s=interrupt_grace_s,
            input_lines=input_lines,
            strip_ansi=strip_ansi,
            max_output=max_output,
            keep=keep,
            on_stdout=on_stdout,
            on_stderr=on_stderr,
            on_result=on_result,
            on_error=on_error,
            deadline=deadline,
        )

    async def interrupt(self, *, deadline: float | None = 30.0) -> None:
        await self.client.code_interrupt(self.id, deadline=deadline)

    async def restart(self, *, deadline: float | None = 120.0) -> int:
        """A fresh kernel in this context (its state is lost); the new kernel's pid."""
        self.pid = await self.client.code_restart(self.id, deadline=deadline)
        return self.pid

    async def close(self, *, deadline: float | None = 30.0) -> None:
        """End the context and its kernel (a context already gone is not an error)."""
        with unless_gone():
            await self.client.code_close(self.id, deadline=deadline)


class AsyncProcess(AsyncHandle):
    """A background process (``process_start``). Leaving ``async with`` kills it if it still
    runs and forgets it (its output goes with it)."""

    def __init__(self, client: ProcessClient, started: ProcessStartResult) -> None:
        self.client = client
        self.info = started  # the start call's reply
        self.id = started.id
        self.pid = started.pid

    def __repr__(self) -> str:
        return f"<AsyncProcess {self.id} pid={self.pid}>"

    async def output(
        self,
        *,
        stdout_from: int | None = None,
        stderr_from: int | None = None,
        follow: bool | None = None,
        deadline: float | None = 3600.0,
        progress_timeout: float | None = None,
    ) -> ProcessOutput:
        """:meth:`AsyncClient.process_output`: everything from the offsets, to exit by default."""
        return await self.client.process_output(
            self.id,
            stdout_from=stdout_from,
            stderr_from=stderr_from,
            follow=follow,
            deadline=deadline,
            progress_timeout=progress_timeout,
        )

    def attach(
        self,
        *,
        stdout_from: int | None = None,
        stderr_from: int | None = None,
        follow: bool | None = None,
        deadline: float | None = 3600.0,
        progress_timeout: float | None = None,
    ) -> Attach:
        """:meth:`AsyncClient.attach`: iterate ``(stream, offset, data)`` as it comes."""
        return self.client.attach(
            self.id,
            stdout_from=stdout_from,
            stderr_from=stderr_from,
            follow=follow,
            deadline=deadline,
            progress_timeout=progress_timeout,
        )

    async def write(self, data: StdinSource, *, deadline: float | None = 60.0) -> int:
        """Write to its stdin (started with ``stdin=True``): bytes, str, a file or an iterator."""
        return await self.client.process_write(self.id, data, deadline=deadline)

    async def close_stdin(self, *, deadline: float | None = 30.0) -> None:
        await self.client.process_close_stdin(self.id, deadline=deadline)

    async def signal(self, sig: str | int = "TERM", *, deadline: float | None = 30.0) -> None:
        await self.client.process_signal(self.id, sig, deadline=deadline)

    async def wait(self, *, timeout_s: float | None = None, deadline: float | None = None) -> ProcessWaitResult:
        return await self.client.process_wait(self.id, timeout_s=timeout_s, deadline=deadline)

    async def close(self, *, deadline: float | None = 30.0) -> None:
        """Kill it if it still runs, then forget it (either already done is not an error)."""
        with unless_gone(ErrorCode.BAD_REQUEST.value):  # gone, or exited already
            await self.client.process_signal(self.id, "KILL", deadline=deadline)
        with unless_gone():
            await self.client.process_forget(self.id, deadline=deadline)


class AsyncKeptRun(AsyncHandle):
    """A kept run (``keep=True``): it outlives the connection that started it. Leaving
    ``async with`` cancels it if it still runs."""

    def __init__(self, client: KeptRunClient, run_id: str) -> None:
        self.client = client
        self.id = run_id

    def __repr__(self) -> str:
        return f"<AsyncKeptRun {self.id}>"

    async def get(self, *, deadline: float | None = 30.0) -> RunInfo:
        return await self.client.run_get(self.id, deadline=deadline)

    async def wait(self, *, timeout_s: float | None = None) -> RunInfo:
        return await self.client.run_wait(self.id, timeout_s=timeout_s)

    async def cancel(self, *, timeout_s: float | None = None) -> RunInfo:
        return await self.client.run_cancel(self.id, timeout_s=timeout_s)

    async def result(self, *, timeout_s: float | None = None) -> ShellResult | CodeResult:
        """Its result once it has ended (a failed run's error raised; ``bad_request`` when it
        still runs after ``timeout_s``)."""
        return result_of(await self.wait(timeout_s=timeout_s))

    async def close(self) -> None:
        run = await self.get()
        if run.state == "running":
            await self.cancel()
