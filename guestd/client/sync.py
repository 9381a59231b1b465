"""Blocking client: the asyncio client driven on a private event-loop thread.

:class:`Client` has every value-returning method of :class:`~guestd.client.aio.AsyncClient`
with the same name, parameters, defaults and return type (``tests/test_client_surface.py``
holds them equal); see :mod:`guestd.client.aio` for how timeouts and deadlines are named and
for defaults (None: the guest applies the schema's default). The streaming calls
(``exec_stream``, ``code_run_stream``, ``attach``) are async only: use :attr:`Client.aio`
from async code, or :meth:`Client.process_output` to collect what an attach delivers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, overload

from guestd.client._blocking import CALLBACK_BACKLOG, CANCEL_SEND_S, ITEM_COST, CallerThread, ClientBase, held_size
from guestd.client.aio import DEFAULT_DEADLINE, UNBOUNDED_RUN_DEADLINE, OnTimeout, Progress, WriteFlag
from guestd.client.git_sync import Git
from guestd.client.handles_sync import CodeContext, KeptRun, Process, Shell
from guestd.client.ports_sync import SyncPortsAPI
from guestd.client.replies import (
    ClockCheckResult,
    ContextInfo,
    MetricsSample,
    ProcessInfo,
    ProcessWaitResult,
    RunInfo,
    ShellInfo,
    SnapshotPrepareResult,
    SnapshotRestoreResult,
)
from guestd.client.results import CodeResult, DirListing, ExecResult, FileStat, Info, ProcessOutput, ShellResult
from guestd.client.streaming import DERIVED, EventCallback, OutputCallback, RunDeadline, StdinSource
from guestd.client.workspace_sync import SyncWorkspaceAPI
from guestd.wire.paths import WirePath

__all__ = ["CALLBACK_BACKLOG", "CANCEL_SEND_S", "ITEM_COST", "CallerThread", "Client", "held_size"]


class Client(SyncPortsAPI, SyncWorkspaceAPI, ClientBase):
    """``with Client("unix:/run/guestd.sock") as c: c.exec(["ls"])``"""

    def call(
        self, op: str, args: dict[str, Any] | None = None, *, deadline: float | None = DEFAULT_DEADLINE
    ) -> dict[str, Any]:
        return self._run(self._aio.call(op, args, deadline=deadline))

    def ping(self, *, deadline: float | None = 10.0) -> float:
        return self._run(self._aio.ping(deadline=deadline))

    def info(self, *, deadline: float | None = 10.0) -> Info:
        return self._run(self._aio.info(deadline=deadline))

    def metrics(self, *, interval_ms: int | None = None, deadline: float | None = 70.0) -> MetricsSample:
        return self._run(self._aio.metrics(interval_ms=interval_ms, deadline=deadline))

    def exec(
        self,
        cmd: list[str] | str,
        *,
        cwd: WirePath | None = None,
        env: dict[str, str] | None = None,
        replace_env: bool = False,
        stdin: StdinSource | None = None,
        timeout_s: float | None = None,
        idle_timeout_s: float | None = None,
        max_output: int | None = None,
        head_tail: bool = False,
        kill_grace_s: float | None = None,
        linger_s: float | None = None,
        on_timeout: OnTimeout | None = None,
        merge_stderr: bool | None = None,
        spill: bool | None = None,
        strip_ansi: bool | None = None,
        collapse_cr: bool | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        deadline: RunDeadline = DERIVED,
    ) -> ExecResult:
        """See :meth:`AsyncClient.exec`; the callbacks run in this (the calling) thread."""
        pump = CallerThread(self._loop)
        return self._run(
            self._aio.exec(
                cmd,
                cwd=cwd,
                env=env,
                replace_env=replace_env,
                stdin=stdin,
                timeout_s=timeout_s,
                idle_timeout_s=idle_timeout_s,
                max_output=max_output,
                head_tail=head_tail,
                kill_grace_s=kill_grace_s,
                linger_s=linger_s,
                on_timeout=on_timeout,
                merge_stderr=merge_stderr,
                spill=spill,
                strip_ansi=strip_ansi,
                collapse_cr=collapse_cr,
                on_stdout=pump.wrap(on_stdout),
                on_stderr=pump.wrap(on_stderr),
                deadline=deadline,
            ),
            pump,
        )

    def read_file(
        self,
        path: WirePath,
        *,
        offset: int | None = None,
        length: int | None = None,
        deadline: float | None = DEFAULT_DEADLINE,
    ) -> bytes:
        return self._run(self._aio.read_file(path, offset=offset, length=length, deadline=deadline))

    def write_file(
        self,
        path: WirePath,
        data: bytes | str,
        *,
        flag: WriteFlag | None = None,
        perm: int | None = None,
        parents: bool | None = None,
        deadline: float | None = DEFAULT_DEADLINE,
    ) -> int:
        return self._run(self._aio.write_file(path, data, flag=flag, perm=perm, parents=parents, deadline=deadline))

    def upload(
        self,
        src: str | bytes,
        dst: WirePath,
        *,
        perm: int | None = None,
        parents: bool | None = None,
        exclusive: bool = False,
        progress: Progress | None = None,
        deadline: float | None = None,
        progress_timeout: float | None = DEFAULT_DEADLINE,
    ) -> int:
        return self._run(
            self._aio.upload(
                src,
                dst,
                perm=perm,
                parents=parents,
                exclusive=exclusive,
                progress=progress,
                deadline=deadline,
                progress_timeout=progress_timeout,
            )
        )

    @overload
    def download(
        self,
        src: WirePath,
        dst: None = None,
        *,
        offset: int | None = None,
        length: int | None = None,
        max_bytes: int | None = None,
        progress: Progress | None = None,
        sink: None = None,
        deadline: float | None = None,
        progress_timeout: float | None = DEFAULT_DEADLINE,
    ) -> bytes: ...

    @overload
    def download(
        self,
        src: WirePath,
        dst: str,
        *,
        offset: int | None = None,
        length: int | None = None,
        max_bytes: int | None = None,
        progress: Progress | None = None,
        sink: None = None,
        deadline: float | None = None,
        progress_timeout: float | None = DEFAULT_DEADLINE,
    ) -> int: ...

    @overload
    def download(
        self,
        src: WirePath,
        dst: None = None,
        *,
        offset: int | None = None,
        length: int | None = None,
        max_bytes: int | None = None,
        progress: Progress | None = None,
        sink: Callable[[bytes], object],
        deadline: float | None = None,
        progress_timeout: float | None = DEFAULT_DEADLINE,
    ) -> int: ...

    def download(
        self,
        src: WirePath,
        dst: str | None = None,
        *,
        offset: int | None = None,
        length: int | None = None,
        max_bytes: int | None = None,
        progress: Progress | None = None,
        sink: Callable[[bytes], object] | None = None,
        deadline: float | None = None,
        progress_timeout: float | None = DEFAULT_DEADLINE,
    ) -> bytes | int:
        return self._run(
            self._aio._download(
                src,
                dst,
                offset=offset,
                length=length,
                max_bytes=max_bytes,
                progress=progress,
                sink=sink,
                deadline=deadline,
                progress_timeout=progress_timeout,
            )
        )

    @property
    def git(self) -> Git:
        """git in the guest through exec, as the workload user (:mod:`guestd.client.git`)."""
        return Git(self)

    def chmod(self, path: str, mode: int | str, *, recursive: bool = False, timeout_s: float = 60.0) -> None:
        """See :meth:`AsyncClient.chmod`: ``chmod`` as the workload user, with its permissions."""
        self._run(self._aio.chmod(path, mode, recursive=recursive, timeout_s=timeout_s))

    def stat(
        self, path: WirePath, *, follow: bool | None = None, deadline: float | None = DEFAULT_DEADLINE
    ) -> FileStat:
        return self._run(self._aio.stat(path, follow=follow, deadline=deadline))

    def exists(self, path: WirePath, *, deadline: float | None = DEFAULT_DEADLINE) -> bool:
        return self._run(self._aio.exists(path, deadline=deadline))

    def listdir(
        self, path: WirePath, *, max_entries: int | None = None, deadline: float | None = DEFAULT_DEADLINE
    ) -> DirListing:
        return self._run(self._aio.listdir(path, max_entries=max_entries, deadline=deadline))

    def mkdir(
        self,
        path: WirePath,
        *,
        parents: bool | None = None,
        perm: int | None = None,
        deadline: float | None = DEFAULT_DEADLINE,
    ) -> bool:
        return self._run(self._aio.mkdir(path, parents=parents, perm=perm, deadline=deadline))

    def remove(
        self, path: WirePath, *, recursive: bool | None = None, deadline: float | None = DEFAULT_DEADLINE
    ) -> int:
        return self._run(self._aio.remove(path, recursive=recursive, deadline=deadline))

    def rename(
        self,
        src: WirePath,
        dst: WirePath,
        *,
        overwrite: bool | None = None,
        deadline: float | None = DEFAULT_DEADLINE,
    ) -> None:
        self._run(self._aio.rename(src, dst, overwrite=overwrite, deadline=deadline))

    def code_create(
        self,
        *,
        cwd: WirePath | None = None,
        env: dict[str, str] | None = None,
        name: str | None = None,
        kernel: str | None = None,
        start_timeout_s: float | None = None,
        deadline: float | None = None,
    ) -> CodeContext:
        created = self._run(
            self._aio.code_create(
                cwd=cwd, env=env, name=name, kernel=kernel, start_timeout_s=start_timeout_s, deadline=deadline
            )
        )
        return CodeContext(self, created.info)

    def code_run(
        self,
        code: str,
        *,
        context: str | None = None,
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
        """See :meth:`AsyncClient.code_run`; the callbacks run in this (the calling) thread."""
        pump = CallerThread(self._loop)
        return self._run(
            self._aio.code_run(
                code,
                context=context,
                timeout_s=timeout_s,
                interrupt_grace_s=interrupt_grace_s,
                input_lines=input_lines,
                strip_ansi=strip_ansi,
                max_output=max_output,
                keep=keep,
                on_stdout=pump.wrap(on_stdout),
                on_stderr=pump.wrap(on_stderr),
                on_result=pump.wrap(on_result),
                on_error=pump.wrap(on_error),
                deadline=deadline,
            ),
            pump,
        )

    def code_interrupt(self, context: str, *, deadline: float | None = 30.0) -> None:
        self._run(self._aio.code_interrupt(context, deadline=deadline))

    def code_restart(self, context: str, *, deadline: float | None = 120.0) -> int:
        return self._run(self._aio.code_restart(context, deadline=deadline))

    def code_close(self, context: str, *, deadline: float | None = 30.0) -> None:
        self._run(self._aio.code_close(context, deadline=deadline))

    def code_list(self, *, deadline: float | None = 30.0) -> list[ContextInfo]:
        return self._run(self._aio.code_list(deadline=deadline))

    def process_start(
        self,
        cmd: list[str] | str,
        *,
        cwd: WirePath | None = None,
        env: dict[str, str] | None = None,
        stdin: bool | None = None,
        pty: bool | None = None,
        rows: int | None = None,
        cols: int | None = None,
        ring_bytes: int | None = None,
        merge_stderr: bool | None = None,
        spill: bool | None = None,
        deadline: float | None = DEFAULT_DEADLINE,
    ) -> Process:
        started = self._run(
            self._aio.process_start(
                cmd,
                cwd=cwd,
                env=env,
                stdin=stdin,
                pty=pty,
                rows=rows,
                cols=cols,
                ring_bytes=ring_bytes,
                merge_stderr=merge_stderr,
                spill=spill,
                deadline=deadline,
            )
        )
        return Process(self, started.info)

    def process_list(self, *, deadline: float | None = DEFAULT_DEADLINE) -> list[ProcessInfo]:
        return self._run(self._aio.process_list(deadline=deadline))

    def process_output(
        self,
        process_id: str,
        *,
        stdout_from: int | None = None,
        stderr_from: int | None = None,
        follow: bool | None = None,
        deadline: float | None = UNBOUNDED_RUN_DEADLINE,
        progress_timeout: float | None = None,
    ) -> ProcessOutput:
        return self._run(
            self._aio.process_output(
                process_id,
                stdout_from=stdout_from,
                stderr_from=stderr_from,
                follow=follow,
                deadline=deadline,
                progress_timeout=progress_timeout,
            )
        )

    def process_wait(
        self, process_id: str, *, timeout_s: float | None = None, deadline: float | None = None
    ) -> ProcessWaitResult:
        return self._run(self._aio.process_wait(process_id, timeout_s=timeout_s, deadline=deadline))

    def process_signal(self, process_id: str, sig: str | int = "TERM", *, deadline: float | None = 30.0) -> None:
        self._run(self._aio.process_signal(process_id, sig, deadline=deadline))

    def process_write(self, process_id: str, data: StdinSource, *, deadline: float | None = 60.0) -> int:
        return self._run(self._aio.process_write(process_id, data, deadline=deadline))

    def process_close_stdin(self, process_id: str, *, deadline: float | None = 30.0) -> None:
        self._run(self._aio.process_close_stdin(process_id, deadline=deadline))

    def process_resize(self, process_id: str, rows: int, cols: int, *, deadline: float | None = 30.0) -> None:
        self._run(self._aio.process_resize(process_id, rows, cols, deadline=deadline))

    def process_forget(self, process_id: str, *, deadline: float | None = 30.0) -> None:
        self._run(self._aio.process_forget(process_id, deadline=deadline))

    def shell_create(
        self,
        *,
        cwd: WirePath | None = None,
        env: dict[str, str] | None = None,
        name: str | None = None,
        deadline: float | None = 60.0,
    ) -> Shell:
        created = self._run(self._aio.shell_create(cwd=cwd, env=env, name=name, deadline=deadline))
        return Shell(self, created.info)

    def shell_run(
        self,
        session: str,
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
        """See :meth:`AsyncClient.shell_run`; the callbacks run in this (the calling) thread."""
        pump = CallerThread(self._loop)
        return self._run(
            self._aio.shell_run(
                session,
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
                on_stdout=pump.wrap(on_stdout),
                on_stderr=pump.wrap(on_stderr),
                deadline=deadline,
            ),
            pump,
        )

    def kept_run(self, run_id: str) -> KeptRun:
        """A handle on the kept run ``run_id`` (``result.run_id`` of a run with ``keep=True``)."""
        return KeptRun(self, run_id)

    def run_get(self, run_id: str, *, deadline: float | None = 30.0) -> RunInfo:
        return self._run(self._aio.run_get(run_id, deadline=deadline))

    def run_wait(self, run_id: str, *, timeout_s: float | None = None) -> RunInfo:
        return self._run(self._aio.run_wait(run_id, timeout_s=timeout_s))

    def run_cancel(self, run_id: str, *, timeout_s: float | None = None) -> RunInfo:
        return self._run(self._aio.run_cancel(run_id, timeout_s=timeout_s))

    def run_list(self, *, deadline: float | None = 30.0) -> list[RunInfo]:
        return self._run(self._aio.run_list(deadline=deadline))

    def shell_resize(self, session: str, rows: int, cols: int, *, deadline: float | None = 30.0) -> None:
        self._run(self._aio.shell_resize(session, rows, cols, deadline=deadline))

    def shell_list(self, *, deadline: float | None = 30.0) -> list[ShellInfo]:
        return self._run(self._aio.shell_list(deadline=deadline))

    def shell_close(self, session: str, *, deadline: float | None = 30.0) -> None:
        self._run(self._aio.shell_close(session, deadline=deadline))

    def snapshot_prepare(
        self,
        *,
        quiesce: bool | None = None,
        timeout_s: float | None = None,
        freeze: bool | None = None,
        fsfreeze: WirePath | None = None,
        freeze_max_s: float | None = None,
        deadline: float | None = None,
    ) -> SnapshotPrepareResult:
        return self._run(
            self._aio.snapshot_prepare(
                quiesce=quiesce,
                timeout_s=timeout_s,
                freeze=freeze,
                fsfreeze=fsfreeze,
                freeze_max_s=freeze_max_s,
                deadline=deadline,
            )
        )

    def clock_check(self, *, time_ns: int | None = None, deadline: float | None = 10.0) -> ClockCheckResult:
        return self._run(self._aio.clock_check(time_ns=time_ns, deadline=deadline))

    def snapshot_resume(self, *, deadline: float | None = 30.0) -> None:
        self._run(self._aio.snapshot_resume(deadline=deadline))

    def restore(
        self,
        *,
        generation: int | None = None,
        nonce: str | None = None,
        time_ns: int | None = None,
        entropy: bytes | None = None,
        sandbox_id: str | None = None,
        hostname: str | None = None,
        env: dict[str, str] | None = None,
        token: str | None = None,
        deadline: float | None = 120.0,
    ) -> SnapshotRestoreResult:
        return self._run(
            self._aio.restore(
                generation=generation,
                nonce=nonce,
                time_ns=time_ns,
                entropy=entropy,
                sandbox_id=sandbox_id,
                hostname=hostname,
                env=env,
                token=token,
                deadline=deadline,
            )
        )
