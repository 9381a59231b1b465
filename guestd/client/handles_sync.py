"""The blocking client's handles (see :mod:`guestd.client.handles`): a shell session, a code
context, a background process, a kept run, each a context manager that releases it on exit::

    with client.shell_create() as sh:
        print(sh.run("ls").text)

A handle's methods call the flat :class:`~guestd.client.Client` methods with the same parameters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from guestd.client._blocking import ProcessAttach
from guestd.client.handles import unless_gone
from guestd.client.runs import result_of
from guestd.client.streaming import DERIVED
from guestd.wire.errors import ErrorCode

if TYPE_CHECKING:
    from guestd.client.aio import OnTimeout
    from guestd.client.replies import (
        CodeCreateResult,
        ProcessStartResult,
        ProcessWaitResult,
        RunInfo,
        ShellCreateResult,
    )
    from guestd.client.results import CodeResult, ProcessOutput, ShellResult
    from guestd.client.streaming import EventCallback, OutputCallback, RunDeadline, StdinSource
    from guestd.client.sync import Client


class Shell:
    """A persistent bash session (cd, variables, venvs persist between runs)."""

    def __init__(self, client: Client, created: ShellCreateResult) -> None:
        self.client = client
        self.info = created  # the create call's reply
        self.id = created.id
        self.pid = created.pid

    def __repr__(self) -> str:
        return f"<Shell {self.id} pid={self.pid}>"

    def run(
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
        """:meth:`Client.shell_run` in this session."""
        return self.client.shell_run(
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

    def close(self, *, deadline: float | None = 30.0) -> None:
        """End the session (a session already gone is not an error)."""
        with unless_gone():
            self.client.shell_close(self.id, deadline=deadline)

    def __enter__(self) -> Shell:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CodeContext:
    """A code context: a kernel whose state persists between cells."""

    def __init__(self, client: Client, created: CodeCreateResult) -> None:
        self.client = client
        self.info = created  # the create call's reply
        self.id = created.id
        self.name = created.name
        self.pid = created.pid
        self.pooled = created.pooled
        self.existing = created.existing
        self.kernel = created.kernel

    def __repr__(self) -> str:
        return f"<CodeContext {self.id} kernel={self.kernel} pid={self.pid}>"

    def run(
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
        """:meth:`Client.code_run` in this context."""
        return self.client.code_run(
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

    def interrupt(self, *, deadline: float | None = 30.0) -> None:
        self.client.code_interrupt(self.id, deadline=deadline)

    def restart(self, *, deadline: float | None = 120.0) -> int:
        """A fresh kernel in this context (its state is lost); the new kernel's pid."""
        self.pid = self.client.code_restart(self.id, deadline=deadline)
        return self.pid

    def close(self, *, deadline: float | None = 30.0) -> None:
        """End the context and its kernel (a context already gone is not an error)."""
        with unless_gone():
            self.client.code_close(self.id, deadline=deadline)

    def __enter__(self) -> CodeContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Process(ProcessAttach):
    """A background process (``process_start``). Leaving ``with`` kills it if it still runs and
    forgets it (its output goes with it). :meth:`attach` follows its output with callbacks in
    this thread (:meth:`AsyncProcess.attach <guestd.client.handles.AsyncProcess.attach>` iterates
    it); :meth:`output` collects it."""

    def __init__(self, client: Client, started: ProcessStartResult) -> None:
        self.client = client
        self.info = started  # the start call's reply
        self.id = started.id
        self.pid = started.pid

    def __repr__(self) -> str:
        return f"<Process {self.id} pid={self.pid}>"

    def output(
        self,
        *,
        stdout_from: int | None = None,
        stderr_from: int | None = None,
        follow: bool | None = None,
        deadline: float | None = 3600.0,
        progress_timeout: float | None = None,
    ) -> ProcessOutput:
        """:meth:`Client.process_output`: everything from the offsets, to exit by default."""
        return self.client.process_output(
            self.id,
            stdout_from=stdout_from,
            stderr_from=stderr_from,
            follow=follow,
            deadline=deadline,
            progress_timeout=progress_timeout,
        )

    def write(self, data: StdinSource, *, deadline: float | None = 60.0) -> int:
        """Write to its stdin (started with ``stdin=True``): bytes, str, a file or an iterator."""
        return self.client.process_write(self.id, data, deadline=deadline)

    def close_stdin(self, *, deadline: float | None = 30.0) -> None:
        self.client.process_close_stdin(self.id, deadline=deadline)

    def signal(self, sig: str | int = "TERM", *, deadline: float | None = 30.0) -> None:
        self.client.process_signal(self.id, sig, deadline=deadline)

    def wait(self, *, timeout_s: float | None = None, deadline: float | None = None) -> ProcessWaitResult:
        return self.client.process_wait(self.id, timeout_s=timeout_s, deadline=deadline)

    def close(self, *, deadline: float | None = 30.0) -> None:
        """Kill it if it still runs, then forget it (either already done is not an error)."""
        with unless_gone(ErrorCode.BAD_REQUEST.value):  # gone, or exited already
            self.client.process_signal(self.id, "KILL", deadline=deadline)
        with unless_gone():
            self.client.process_forget(self.id, deadline=deadline)

    def __enter__(self) -> Process:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class KeptRun:
    """A kept run (``keep=True``): it outlives the connection that started it. Leaving ``with``
    cancels it if it still runs."""

    def __init__(self, client: Client, run_id: str) -> None:
        self.client = client
        self.id = run_id

    def __repr__(self) -> str:
        return f"<KeptRun {self.id}>"

    def get(self, *, deadline: float | None = 30.0) -> RunInfo:
        return self.client.run_get(self.id, deadline=deadline)

    def wait(self, *, timeout_s: float | None = None) -> RunInfo:
        return self.client.run_wait(self.id, timeout_s=timeout_s)

    def cancel(self, *, timeout_s: float | None = None) -> RunInfo:
        return self.client.run_cancel(self.id, timeout_s=timeout_s)

    def result(self, *, timeout_s: float | None = None) -> ShellResult | CodeResult:
        """Its result once it has ended (a failed run's error raised; ``bad_request`` when it
        still runs after ``timeout_s``)."""
        return result_of(self.wait(timeout_s=timeout_s))

    def close(self) -> None:
        if self.get().state == "running":
            self.cancel()

    def __enter__(self) -> KeptRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
