"""asyncio client: typed calls for every op, shaped like the sandbox SDKs agents use.

Naming: every bound is named for what it bounds.

- Bounds the guest enforces take the schema's own field names: ``timeout_s`` and
  ``idle_timeout_s`` (the guest's clock for the work itself), ``kill_grace_s``,
  ``interrupt_grace_s``, ``linger_s``; ``process_wait``'s and ``snapshot_prepare``'s
  ``timeout_s`` are how long the guest waits before it answers.
- ``deadline`` (seconds; None waits for ever) is how long this client waits for the reply
  before it gives up with a ``timeout`` error and cancels the request in the guest. For
  exec, shell and code runs (and their streams) it defaults to :data:`DERIVED`: from the
  guest's bounds (the run's ``timeout_s`` plus the time to stop it and a margin; one hour
  without a ``timeout_s``). ``deadline=None`` waits for ever there too (``tail -f`` watched
  by a person; Ctrl-C, ``cancel()`` or asyncio cancellation still end it).
- ``progress_timeout`` bounds each wait for the next step of a long transfer or stream
  (a chunk's credit, the next event), not the whole of it.
- ``connect_timeout`` bounds connecting and the handshake.

Arguments that map to an op argument default to None, meaning "omitted": the guest applies
the schema's default (``guestd/wire/schema.py``, ``protocol/schema/v1.json``). Where the
client needs such a default itself (to derive a deadline) it reads it from the schema.

Every method that returns a value has a twin of the same signature on the blocking
:class:`guestd.client.Client`. The streaming calls, :meth:`AsyncClient.exec_stream`,
:meth:`AsyncClient.code_run_stream` and :meth:`AsyncClient.attach`, return stream objects to
iterate and exist here only (``Client.process_output`` collects an attach).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Generator
from typing import Any, TypeVar, cast, overload

from guestd.client.address import open_socket, parse_address
from guestd.client.connection import DEFAULT_WINDOW, Call, ClientConnection, GuestProtocolError
from guestd.client.git import AsyncGit
from guestd.client.handles import AsyncCodeContext, AsyncKeptRun, AsyncProcess, AsyncShell
from guestd.client.params import DEFAULT_DEADLINE as DEFAULT_DEADLINE
from guestd.client.params import TRANSFER_DEADLINE as TRANSFER_DEADLINE
from guestd.client.params import OnTimeout as OnTimeout
from guestd.client.params import Progress as Progress
from guestd.client.params import WriteFlag as WriteFlag
from guestd.client.params import present as present
from guestd.client.ports import PortsAPI
from guestd.client.replies import (
    ClockCheckResult,
    CodeCreateResult,
    ContextInfo,
    MetricsSample,
    ProcessInfo,
    ProcessStartResult,
    ProcessWaitResult,
    RunInfo,
    ShellCreateResult,
    ShellInfo,
    SnapshotPrepareResult,
    SnapshotRestoreResult,
)
from guestd.client.results import (
    CodeResult,
    DirEntry,
    DirListing,
    ExecResult,
    FileStat,
    Info,
    OomKills,
    ProcessOutput,
    ShellResult,
    check_bundle,
    checked,
)
from guestd.client.streaming import (
    DERIVED,
    CaptureOptions,
    Derived,
    EventCallback,
    OutputCallback,
    RunDeadline,
    RunOutput,
    StdinSource,
    as_bytes,
    deliver,
    run_call,
    split_stdin,
    stdin_chunks,
)
from guestd.client.streams import UPLOAD_CHUNK, DeadlineClock
from guestd.client.streams import Attach as Attach
from guestd.client.streams import CodeStream as CodeStream
from guestd.client.streams import ExecStream as ExecStream
from guestd.client.streams import ShellStream as ShellStream
from guestd.client.workspace import WorkspaceAPI
from guestd.wire.errors import ErrorCode, GuestdError
from guestd.wire.frames import DEFAULT_MAX_FRAME
from guestd.wire.paths import WirePath, path_to_wire
from guestd.wire.schema import OPS_BY_NAME
from guestd.wire.types import (
    ClockCheckReply,
    CodeCreateReply,
    CodeListReply,
    CodeRunReply,
    ExecReply,
    FileListReply,
    FileStatReply,
    MetricsEvent,
    MetricsReply,
    ProcessListReply,
    ProcessStartReply,
    ProcessWaitReply,
    RunGetReply,
    RunListReply,
    RunWaitReply,
    ShellCreateReply,
    ShellListReply,
    ShellRunReply,
    SnapshotPrepareReply,
    SnapshotRestoreReply,
)

CONNECT_TIMEOUT = 10.0  # connect + handshake
UNBOUNDED_RUN_DEADLINE = 3600.0  # a run with no guest timeout at all: one hour
REPLY_MARGIN = 30.0  # on top of a guest-enforced bound: the guest's own clean-up and the trip back
KERNEL_START_CAP_S = 300.0  # guestd's longest default kernel start (code.create without start_timeout_s)
# On top of a cell's timeout: the default context's first start (or a restart) may take as long
# as guestd's default start wait allows on a slow guest.
KERNEL_MARGIN = KERNEL_START_CAP_S
SHELL_STOP_S = 5.0  # a timed-out shell command: INT, TERM, KILL 1 s apart (guestd/shells.py), then a restart
PREPARE_MARGIN = 90.0  # on top of snapshot.prepare's wait for writes: the filesystem sync after it
DOWNLOAD_MEMORY_CAP = 256 * 1024 * 1024  # an in-memory download without max_bytes
CODE_RESULTS_KEPT = 64  # a streamed cell's rich results kept for its CodeResult (as the guest keeps)

RunStream = TypeVar("RunStream", bound=ExecStream)  # ExecStream or ShellStream


def schema_default(op: str, field: str) -> Any:
    """The default the guest applies to ``op``'s argument ``field`` when it is omitted."""
    return OPS_BY_NAME[op].fields_by_name[field].default


def _seconds(value: float | None) -> float | None:
    return None if value is None else float(value)


def _wire_path(path: WirePath | None) -> WirePath | None:
    return None if path is None else path_to_wire(path)


def _command(cmd: list[str] | str) -> dict[str, Any]:
    """A command's request field: a string for ``/bin/sh -c``, else an argv list."""
    return {"shell": cmd} if isinstance(cmd, str) else {"argv": list(cmd)}


def _run_deadline(timeout_s: float | None, idle_timeout_s: float | None, stop_s: float) -> float:
    """The client deadline of a run the guest bounds: its timeout, the time to stop it, a margin.

    Without a wall-clock timeout: one hour (an idle timeout alone bounds nothing a guest that
    trickles output, or a silent one that never enforces it, cannot extend).
    """
    if timeout_s is None:
        return UNBOUNDED_RUN_DEADLINE
    return timeout_s + stop_s + REPLY_MARGIN


def _exec_deadline(
    timeout_s: float | None, idle_timeout_s: float | None, kill_grace_s: float | None, linger_s: float | None
) -> float:
    if kill_grace_s is None:
        kill_grace_s = schema_default("exec", "kill_grace_s")
    if linger_s is None:
        linger_s = schema_default("exec", "linger_s")
    return _run_deadline(timeout_s, idle_timeout_s, kill_grace_s + linger_s)


def _resolve(deadline: RunDeadline, derive: Callable[[], float]) -> float | None:
    """A run's client deadline: ``derive()`` for DERIVED, else as given (None: for ever)."""
    return derive() if isinstance(deadline, Derived) else deadline


def _code_deadline(timeout_s: float | None, interrupt_grace_s: float | None) -> float:
    if timeout_s is None:
        return UNBOUNDED_RUN_DEADLINE
    if interrupt_grace_s is None:
        interrupt_grace_s = schema_default("code.run", "interrupt_grace_s")
    return timeout_s + interrupt_grace_s + KERNEL_MARGIN


class Connecting:
    """What :meth:`AsyncClient.connect` returns: await it for the client
    (``c = await AsyncClient.connect(addr)``), or enter it to connect and close on exit with one
    await (``async with AsyncClient.connect(addr) as c:``)."""

    def __init__(self, opening: Callable[[], Coroutine[Any, Any, AsyncClient]]) -> None:
        self._opening = opening
        self._client: AsyncClient | None = None

    def __await__(self) -> Generator[Any, None, AsyncClient]:
        return self._opening().__await__()

    async def __aenter__(self) -> AsyncClient:
        self._client = await self._opening()
        return self._client

    async def __aexit__(self, *exc: object) -> None:
        if self._client is not None:
            await self._client.close()


class AsyncClient(PortsAPI, WorkspaceAPI):
    """``async with AsyncClient.connect("unix:/run/guestd/guestd.sock") as c:``, or
    ``c = await AsyncClient.connect(...)`` and ``await c.close()``."""

    def __init__(self, conn: ClientConnection, address: str, *, default_timeout_s: float | None = None) -> None:
        self._conn = conn
        self.address = address
        # The timeout_s of exec and shell runs (and their streams) when a call gives none
        # (None: the guest's, i.e. no timeout).
        self.default_timeout_s = default_timeout_s

    @classmethod
    def connect(
        cls,
        address: str,
        *,
        connect_timeout: float = CONNECT_TIMEOUT,
        token: str | None = None,
        max_frame: int = DEFAULT_MAX_FRAME,
        stream_window: int = DEFAULT_WINDOW,
        default_timeout_s: float | None = None,
    ) -> Connecting:
        """``connect_timeout`` bounds connecting and the handshake, each; ``default_timeout_s`` is
        the ``timeout_s`` of exec, shell_run and their streams wherever a call leaves it out. A failure to connect is a
        :class:`~guestd.client.address.ConnectError` (an OSError) naming the address and what to
        try; no reply in time a ``timeout`` GuestdError."""

        async def opening() -> AsyncClient:
            sock = await open_socket(parse_address(address), connect_timeout)
            try:
                conn = await ClientConnection.open(
                    sock,
                    handshake_timeout=connect_timeout,
                    token=token,
                    max_frame=max_frame,
                    stream_window=stream_window,
                )
            except GuestdError as e:
                if e.code != ErrorCode.TIMEOUT.value:
                    raise
                raise GuestdError(
                    ErrorCode.TIMEOUT,
                    f"{address}: {e.message} (is a guestd serving there, or something else?)",
                ) from None
            return cls(conn, address, default_timeout_s=default_timeout_s)

        return Connecting(opening)

    @classmethod
    async def from_socket(
        cls,
        sock: socket.socket,
        *,
        connect_timeout: float = CONNECT_TIMEOUT,
        token: str | None = None,
        max_frame: int = DEFAULT_MAX_FRAME,
        stream_window: int = DEFAULT_WINDOW,
        default_timeout_s: float | None = None,
    ) -> AsyncClient:
        """Speak the protocol over an already connected stream socket (e.g. a serial bridge);
        ``connect_timeout`` bounds the handshake."""
        sock.setblocking(False)
        conn = await ClientConnection.open(
            sock, handshake_timeout=connect_timeout, token=token, max_frame=max_frame, stream_window=stream_window
        )
        return cls(conn, f"socket:{sock.fileno()}", default_timeout_s=default_timeout_s)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        self._conn.close()

    @property
    def server_hello(self) -> dict[str, Any]:
        assert self._conn.hello is not None
        return self._conn.hello

    @property
    def limits(self) -> dict[str, Any]:
        limits: dict[str, Any] = self.server_hello["limits"]
        return limits

    async def call(
        self, op: str, args: dict[str, Any] | None = None, *, deadline: float | None = DEFAULT_DEADLINE
    ) -> dict[str, Any]:
        """Send any op (including ones this client version has no method for)."""
        return await self._conn.request(op, args or {}, deadline)

    # -- system ---------------------------------------------------------------------------
    async def ping(self, *, deadline: float | None = 10.0) -> float:
        """The round trip to the guest and back, in seconds (the guest's clock: :meth:`clock_check`)."""
        start = time.perf_counter()
        await self._conn.request("ping", {}, deadline)
        return time.perf_counter() - start

    async def info(self, *, deadline: float | None = 10.0) -> Info:
        b = await self._conn.request("info", {}, deadline)
        return Info(b["version"], b["protocol_version"], b["capabilities"], b["boot_id"], b["uptime_s"], b)

    # -- metrics ----------------------------------------------------------------------------
    async def metrics(self, *, interval_ms: int | None = None, deadline: float | None = 70.0) -> MetricsSample:
        """One sample of the guest's figures; CPU % over ``interval_ms`` (default 200, 0: none)."""
        b = cast(MetricsReply, await self._conn.request("metrics", present(interval_ms=interval_ms), deadline))
        sample = b.get("sample")
        if sample is None:
            raise GuestProtocolError("metrics: no sample in the reply")
        return MetricsSample.from_wire(sample)

    async def watch_metrics(
        self, *, interval_ms: int | None = None, count: int | None = None
    ) -> AsyncIterator[MetricsSample | OomKills]:
        """A :class:`MetricsSample` every ``interval_ms`` (default: the schema's), and an
        :class:`OomKills` when the workload's OOM kill count grew; until ``count`` samples, or
        until the caller stops iterating (which cancels the stream in the guest)."""
        call = self._conn.start("metrics", present(interval_ms=interval_ms, stream=True, count=count))
        period_ms = interval_ms if interval_ms is not None else int(schema_default("metrics", "interval_ms"))
        gap = period_ms / 1000 * 3 + 30.0  # a guest that stops sending is a dead guest
        try:
            while True:
                ev = await call.next_event(gap)
                if ev is None:
                    break
                body = cast("MetricsEvent", ev)
                sample = body.get("sample")
                if body["ev"] == "sample" and sample is not None:
                    yield MetricsSample.from_wire(sample)
                elif body["ev"] == "oom":
                    yield OomKills(body.get("oom_kills", 0), body.get("new", 0))
            await self._conn.wait(call, gap)
        finally:
            if not call.future.done():
                call.cancel()

    # -- exec -------------------------------------------------------------------------------
    @staticmethod
    def _exec_args(
        cmd: list[str] | str,
        capture: dict[str, Any],
        *,
        cwd: WirePath | None,
        env: dict[str, str] | None,
        replace_env: bool,
        stdin: bytes | str | None,
        timeout_s: float | None,
        idle_timeout_s: float | None,
        kill_grace_s: float | None,
        linger_s: float | None,
        stdin_stream: bool,
        on_timeout: OnTimeout | None,
        merge_stderr: bool | None,
        spill: bool | None,
    ) -> dict[str, Any]:
        """exec's request args; ``capture``: the run's :meth:`CaptureOptions.request_args`."""
        fields = present(
            cwd=_wire_path(cwd),
            env=env,
            env_mode="replace" if replace_env else None,
            stdin=None if stdin is None else as_bytes(stdin),
            timeout_s=_seconds(timeout_s),
            idle_timeout_s=_seconds(idle_timeout_s),
            kill_grace_s=_seconds(kill_grace_s),
            linger_s=_seconds(linger_s),
            stdin_stream=True if stdin_stream else None,
            on_timeout=on_timeout,
            merge_stderr=merge_stderr,
            spill=spill,
        )
        return {**_command(cmd), **fields, **capture}

    async def exec(
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
        """Run ``cmd`` (argv list, or a string for ``/bin/sh -c``) to completion.

        ``timeout_s``/``idle_timeout_s`` are enforced in the guest and end the whole
        process tree (``kill_grace_s`` between TERM and KILL); without ``timeout_s`` the
        client's ``default_timeout_s`` applies. ``deadline`` is how long the client waits for
        the reply before it cancels the command; by default (:data:`DERIVED`) the guest's
        timeout plus its grace, linger and a margin, one hour without a guest timeout (an idle
        timeout alone does not shorten it); None: for ever. ``on_timeout="detach"``: a timeout
        does not end the command; it goes on as a background process (``result.detached`` is
        its id).

        ``stdin``: bytes, str, a binary file or an (async) iterator of bytes, of any size
        (streamed under the guest's credit, see :mod:`guestd.client.streaming`).
        ``on_stdout``/``on_stderr``: called with each chunk as it arrives; the result still
        holds the output, kept by ``max_output``/``head_tail`` as the guest would (not with
        ``spill``).
        """
        timeout_s = self._default_timeout(timeout_s)
        inline, streamed = split_stdin(stdin)
        watch = on_stdout is not None or on_stderr is not None
        capture = CaptureOptions(max_output, head_tail, strip_ansi, collapse_cr)
        args = self._exec_args(
            cmd,
            capture.request_args(live=watch),
            cwd=cwd,
            env=env,
            replace_env=replace_env,
            stdin=inline,
            timeout_s=timeout_s,
            idle_timeout_s=idle_timeout_s,
            kill_grace_s=kill_grace_s,
            linger_s=linger_s,
            stdin_stream=streamed is not None,
            on_timeout=on_timeout,
            merge_stderr=merge_stderr,
            spill=spill,
        )
        wait = _resolve(deadline, lambda: _exec_deadline(timeout_s, idle_timeout_s, kill_grace_s, linger_s))
        watched = (capture, on_stdout, on_stderr) if watch else None
        body = await self._run_to_end(self._conn.start("exec", args), wait, streamed, watched)
        return ExecResult.from_body(checked(ExecReply, body))

    async def _run_to_end(
        self,
        call: Call,
        wait: float | None,
        stdin: StdinSource | None,
        watched: tuple[CaptureOptions, OutputCallback | None, OutputCallback | None] | None,
    ) -> dict[str, Any]:
        """The reply of a run (exec, shell.run) within ``wait``; streaming ``stdin``, or
        ``watched``: its output live to the callbacks and kept here by the capture options."""
        if stdin is None and watched is None:
            return await self._conn.wait(call, wait)
        if watched is None:
            return await run_call(self._conn, call, wait, stdin=stdin)
        capture, on_stdout, on_stderr = watched
        kept = capture.output(int(schema_default(call.op, "max_output")))

        async def on_event(ev: dict[str, Any]) -> None:
            kind, data = ev.get("ev"), ev.get("data")
            if kind in ("stdout", "stderr") and isinstance(data, bytes):
                kept.feed(kind, data)
                await deliver(on_stdout if kind == "stdout" else on_stderr, data)

        body = await run_call(self._conn, call, wait, stdin=stdin, on_event=on_event)
        return {**body, **capture.fields(kept)}

    def _default_timeout(self, timeout_s: float | None) -> float | None:
        """``timeout_s``, or the client's ``default_timeout_s`` when it is None."""
        return self.default_timeout_s if timeout_s is None else timeout_s

    def _max_output(self, op: str, max_output: int | None) -> int:
        return int(schema_default(op, "max_output")) if max_output is None else max_output

    def exec_stream(
        self,
        cmd: list[str] | str,
        *,
        cwd: WirePath | None = None,
        env: dict[str, str] | None = None,
        replace_env: bool = False,
        stdin: StdinSource | None = None,
        stdin_stream: bool | None = None,
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
        live: bool = True,
        deadline: RunDeadline = DERIVED,
    ) -> ExecStream:
        """Like :meth:`exec`, the run as a stream object (async only): iterate its output as it
        arrives, write to its stdin, signal or cancel it, then await its result.

        ``stdin``: any source :meth:`exec` takes, sent while the run goes on; or
        ``stdin_stream=True`` to write it yourself (:meth:`ExecStream.write_stdin`, then
        :meth:`ExecStream.close_stdin`). ``live`` (the default): output arrives as events, all of
        it, under this client's credit; the result's ``stdout``/``stderr`` are empty (as the
        guest's stream mode) unless a capture option is given (``max_output``, ``head_tail``,
        ``strip_ansi``, ``collapse_cr``): then the result keeps the output as the guest would,
        kept on this side. The counts are always the guest's. ``live=False``: no output events
        (iteration ends at once); the guest keeps the bounded capture (``spill`` only so) and
        the stream carries stdin and the result. ``deadline`` as in
        :meth:`exec`: None waits for ever (cancel, or cancel the awaiting task, to stop)."""
        inline, streamed = self._stream_stdin("exec_stream", stdin, stdin_stream, spill, live)
        timeout_s = self._default_timeout(timeout_s)
        capture = CaptureOptions(max_output, head_tail, strip_ansi, collapse_cr)
        args = self._exec_args(
            cmd,
            capture.request_args(live),
            cwd=cwd,
            env=env,
            replace_env=replace_env,
            stdin=inline,
            timeout_s=timeout_s,
            idle_timeout_s=idle_timeout_s,
            kill_grace_s=kill_grace_s,
            linger_s=linger_s,
            stdin_stream=streamed is not None or bool(stdin_stream),
            on_timeout=on_timeout,
            merge_stderr=merge_stderr,
            spill=spill,
        )
        wait = _resolve(deadline, lambda: _exec_deadline(timeout_s, idle_timeout_s, kill_grace_s, linger_s))
        return self._open_stream(ExecStream, self._conn.start("exec", args), wait, live, capture, streamed)

    def _open_stream(
        self,
        kind: type[RunStream],
        call: Call,
        wait: float | None,
        live: bool,
        capture: CaptureOptions,
        stdin: StdinSource | None,
    ) -> RunStream:
        """A run's stream object; a live one keeps its output here only when a capture option is given."""
        kept = capture.output(int(schema_default(call.op, "max_output"))) if live and capture.given else None
        return kind(
            self,
            call,
            wait,
            kept=kept,
            strip_ansi=bool(capture.strip_ansi),
            collapse_cr=bool(capture.collapse_cr),
            stdin=stdin,
        )

    @staticmethod
    def _stream_stdin(
        method: str, stdin: StdinSource | None, stdin_stream: bool | None, spill: bool | None, live: bool
    ) -> tuple[bytes | None, StdinSource | None]:
        """A stream's ``(inline, streamed)`` stdin; a source and ``stdin_stream`` exclude each
        other, as ``spill`` and ``live`` do."""
        if spill and live:
            raise ValueError(f"{method}: spill keeps the output in the guest; it needs live=False")
        if stdin is not None and stdin_stream:
            raise ValueError("give stdin (a source sent for you) or stdin_stream=True (write it yourself), not both")
        return split_stdin(stdin)

    # -- files ----------------------------------------------------------------------------
    async def read_file(
        self,
        path: WirePath,
        *,
        offset: int | None = None,
        length: int | None = None,
        deadline: float | None = DEFAULT_DEADLINE,
    ) -> bytes:
        args = present(path=path_to_wire(path), offset=offset, length=length)
        data: bytes = (await self._conn.request("file.read", args, deadline))["data"]
        if length is not None and len(data) > length:
            raise GuestProtocolError("file.read returned more bytes than asked")
        return data

    async def write_file(
        self,
        path: WirePath,
        data: bytes | str,
        *,
        flag: WriteFlag | None = None,
        perm: int | None = None,
        parents: bool | None = None,
        deadline: float | None = DEFAULT_DEADLINE,
    ) -> int:
        if isinstance(data, str):
            data = data.encode()
        args = present(path=path_to_wire(path), data=data, flag=flag, perm=perm, parents=parents)
        return int((await self._conn.request("file.write", args, deadline))["size"])

    async def upload(
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
        """Stream a local file (path) or bytes to the guest path ``dst`` atomically.

        ``deadline`` bounds the whole transfer (default: one hour), ``progress_timeout`` each
        wait for the guest to take the next chunk and for its final reply.
        """
        if isinstance(src, bytes):
            size = len(src)
            chunks: Any = (src[i : i + UPLOAD_CHUNK] for i in range(0, size, UPLOAD_CHUNK))
            f = None
        else:
            f = open(src, "rb")  # noqa: SIM115 - closed in finally
            size = os.fstat(f.fileno()).st_size
            reader = f
            chunks = iter(lambda: reader.read(UPLOAD_CHUNK), b"")
        args = present(
            path=path_to_wire(dst),
            parents=parents,
            size=size,
            flag="create" if exclusive else None,
            perm=perm,
        )
        call = self._conn.start("file.upload", args)
        overall = TRANSFER_DEADLINE if deadline is None else deadline
        clock = DeadlineClock(self._conn.loop, "upload", overall, progress_timeout)
        try:
            sent = 0
            for chunk in chunks:
                await call.send_input({"data": chunk}, clock.wait_s())
                sent += len(chunk)
                if progress is not None:
                    progress(len(chunk))
            await call.send_input({"eof": True}, clock.wait_s())
            result = await self._conn.wait(call, clock.wait_s())
        except BaseException:
            self._conn._forget(call)
            raise
        finally:
            if f is not None:
                f.close()
        if result["size"] != sent:
            raise GuestProtocolError(f"upload: guest reports {result['size']} bytes, sent {sent}")
        return sent

    @overload
    async def download(
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
    async def download(
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
    async def download(
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

    async def download(
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
        """Stream ``src`` to a local path or ``sink`` (returns bytes written) or into memory (returns bytes).

        The guest announces the file's size first; a byte more than that (or than ``length``, or
        ``max_bytes``) ends the download with ``GuestProtocolError`` and the partial local file
        is removed. In-memory downloads are capped by ``max_bytes`` (default 256 MiB) so a
        hostile guest cannot exhaust host memory; give ``max_bytes`` for the other two as well
        when you know the size you expect. ``deadline`` bounds the whole transfer (default: one
        hour), ``progress_timeout`` each wait for the next chunk.
        """
        return await self._download(
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

    async def _download(
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
        """The transfer behind the overloads of :meth:`download`."""
        to_memory = dst is None and sink is None
        cap = max_bytes if max_bytes is not None else (DOWNLOAD_MEMORY_CAP if to_memory else None)
        first = offset if offset is not None else int(schema_default("file.download", "offset"))
        args = present(path=path_to_wire(src), offset=offset, length=length)
        call = self._conn.start("file.download", args)
        overall = TRANSFER_DEADLINE if deadline is None else deadline
        clock = DeadlineClock(self._conn.loop, "download", overall, progress_timeout)
        part = dst + ".part" if dst is not None else None
        out = open(part, "wb") if part is not None else None  # noqa: SIM115
        parts: list[bytes] = []  # joined once at the end: one copy of the file, not two
        got = 0
        expected: int | None = None
        announced = 0
        try:
            while True:
                ev = await call.next_event(clock.wait_s())
                if ev is None:
                    break
                if ev.get("ev") == "start" and isinstance(ev.get("size"), int) and expected is None:
                    announced = ev["size"]
                    expected = max(0, announced - first)
                    if length is not None:
                        expected = min(expected, length)
                    continue
                data = ev.get("data")
                if not isinstance(data, bytes):
                    continue
                if expected is None:
                    raise GuestProtocolError("download: data before the guest announced the file's size")
                got += len(data)
                if (expected is not None and got > expected) or (cap is not None and got > cap):
                    raise GuestProtocolError(f"download: guest sent {got} bytes, more than expected/allowed")
                if out is not None:
                    out.write(data)
                elif sink is not None:
                    sink(data)
                else:
                    parts.append(data)
                if progress is not None:
                    progress(len(data))
            result = await self._conn.wait(call, clock.wait_s())
            if result["bytes"] != got or (expected is not None and result["size"] != announced):
                raise GuestProtocolError(f"download: guest reports {result['bytes']} bytes, received {got}")
            if out is not None:
                out.close()
                assert part is not None and dst is not None
                os.replace(part, dst)
                out = None
                return got
            return b"".join(parts) if to_memory else got
        except BaseException:
            self._conn._forget(call)
            if out is not None:
                out.close()
                assert part is not None
                os.unlink(part)
                out = None
            raise

    @property
    def git(self) -> AsyncGit:
        """git in the guest through exec, as the workload user (:mod:`guestd.client.git`)."""
        return AsyncGit(self)

    async def chmod(self, path: str, mode: int | str, *, recursive: bool = False, timeout_s: float = 60.0) -> None:
        """Change ``path``'s mode: an int (``0o755``) or chmod's symbolic form (``"u+x"``).

        Runs ``chmod`` through exec as the workload user, so the workload's permissions apply
        (it changes only what the workload owns, as the workload could itself); a failure is a
        GuestdError: ``not_found``, ``permission_denied``, else ``io_error`` with chmod's message."""
        if isinstance(mode, int):
            if not 0 <= mode <= 0o7777:
                raise ValueError(f"chmod: mode {mode:o} is not within 0..7777 (octal)")
            text = format(mode, "o")
        elif mode and not mode.startswith("-"):
            text = mode
        else:
            raise ValueError(f"chmod: {mode!r} is not a mode")
        r = await self.exec(
            ["chmod", *(["-R"] if recursive else []), "--", text, path], env={"LC_ALL": "C"}, timeout_s=timeout_s
        )
        if r.exit_code == 0:
            return
        said = r.stderr_text.strip()
        code = ErrorCode.IO_ERROR
        if "No such file" in said:
            code = ErrorCode.NOT_FOUND
        elif "Operation not permitted" in said or "Permission denied" in said:
            code = ErrorCode.PERMISSION_DENIED
        raise GuestdError(code, f"chmod {text} {path}: {said[-1000:] or f'exit {r.exit_code}'}")

    async def stat(
        self, path: WirePath, *, follow: bool | None = None, deadline: float | None = DEFAULT_DEADLINE
    ) -> FileStat:
        args = present(path=path_to_wire(path), follow=follow)
        return FileStat.from_body(checked(FileStatReply, await self._conn.request("file.stat", args, deadline)))

    async def exists(self, path: WirePath, *, deadline: float | None = DEFAULT_DEADLINE) -> bool:
        """Whether ``path`` exists (a dangling symlink does)."""
        try:
            await self.stat(path, follow=False, deadline=deadline)
            return True
        except GuestdError as e:
            if e.code == ErrorCode.NOT_FOUND.value:
                return False
            raise

    async def listdir(
        self, path: WirePath, *, max_entries: int | None = None, deadline: float | None = DEFAULT_DEADLINE
    ) -> DirListing:
        """The first entries in order of their names as bytes. A name is a str, or bytes when it
        is not UTF-8 (pass it back as it is to name that entry)."""
        args = present(path=path_to_wire(path), max_entries=max_entries)
        b = checked(FileListReply, await self._conn.request("file.list", args, deadline))
        entries = [DirEntry(e["name"], e["type"], e["size"], e["mode"], e["mtime_ns"]) for e in b["entries"]]
        return DirListing(entries, b["truncated"], b["total"])

    async def mkdir(
        self,
        path: WirePath,
        *,
        parents: bool | None = None,
        perm: int | None = None,
        deadline: float | None = DEFAULT_DEADLINE,
    ) -> bool:
        args = present(path=path_to_wire(path), parents=parents, perm=perm)
        return bool((await self._conn.request("file.mkdir", args, deadline))["created"])

    async def remove(
        self, path: WirePath, *, recursive: bool | None = None, deadline: float | None = DEFAULT_DEADLINE
    ) -> int:
        args = present(path=path_to_wire(path), recursive=recursive)
        return int((await self._conn.request("file.remove", args, deadline))["removed"])

    async def rename(
        self,
        src: WirePath,
        dst: WirePath,
        *,
        overwrite: bool | None = None,
        deadline: float | None = DEFAULT_DEADLINE,
    ) -> None:
        args = present(src=path_to_wire(src), dst=path_to_wire(dst), overwrite=overwrite)
        await self._conn.request("file.rename", args, deadline)

    # -- code contexts --------------------------------------------------------------------
    async def code_create(
        self,
        *,
        cwd: WirePath | None = None,
        env: dict[str, str] | None = None,
        name: str | None = None,
        kernel: str | None = None,
        start_timeout_s: float | None = None,
        deadline: float | None = None,
    ) -> AsyncCodeContext:
        """Create a context (returns its handle: ``.id``, ``.name``, ``.pid``, ``.pooled``, ``.existing``,
        ``.kernel``; ``async with`` it to close it after): guestd's
        own Python kernel, or with ``kernel`` any kernelspec installed in the guest (``"bash"``); an
        unknown name raises ``not_found`` whose ``details["installed"]`` lists the kernels there are.

        ``start_timeout_s`` bounds the kernel's start (and the context's restarts), at most 600 s;
        without it guestd waits while the kernel makes progress, at most 300 s. A start that fails
        is ``unavailable`` (``details["reason"]``), its kernel already ended. ``deadline``: that
        wait plus a margin unless given (reaching it cancels the create, which ends the kernel)."""
        args = present(
            cwd=_wire_path(cwd), env=env, name=name, kernel=kernel, start_timeout_s=_seconds(start_timeout_s)
        )
        if deadline is None:
            deadline = (KERNEL_START_CAP_S if start_timeout_s is None else start_timeout_s) + REPLY_MARGIN
        body = checked(CodeCreateReply, await self._conn.request("code.create", args, deadline))
        return AsyncCodeContext(self, CodeCreateResult.from_wire(body))

    async def code_run(
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
        """Run a cell; without ``context`` the daemon's "default" context (made on first use).

        ``timeout_s`` is enforced in the guest (an interrupt, then a restart after
        ``interrupt_grace_s``). ``deadline`` defaults (:data:`DERIVED`) to that plus a kernel
        start and restart, one hour without a guest timeout; None: for ever.

        Callbacks, each as its part arrives: ``on_stdout``/``on_stderr`` (bytes), ``on_result``
        (``{"kind": "result"|"display", "data": bundle}``), ``on_error`` (``{"ename", "evalue",
        "traceback"}``). The result still holds the output (kept by ``max_output``), the
        results (at most 64) and the error.
        """
        watch = any(cb is not None for cb in (on_stdout, on_stderr, on_result, on_error))
        args = present(
            code=code,
            context=context,
            timeout_s=_seconds(timeout_s),
            interrupt_grace_s=_seconds(interrupt_grace_s),
            input_lines=input_lines,
            strip_ansi=strip_ansi,
            max_output=max_output,
            keep=keep,
            stream=True if watch else None,
        )
        wait = _resolve(deadline, lambda: _code_deadline(timeout_s, interrupt_grace_s))
        if not watch:
            return CodeResult.from_body(checked(CodeRunReply, await self._conn.request("code.run", args, wait)))
        kept = RunOutput(self._max_output("code.run", max_output), head_tail=False)
        results: list[dict[str, Any]] = []
        dropped = 0

        async def on_event(ev: dict[str, Any]) -> None:
            nonlocal dropped
            kind, data = ev.get("ev"), ev.get("data")
            if kind in ("stdout", "stderr") and isinstance(data, bytes):
                kept.feed(kind, data)
                await deliver(on_stdout if kind == "stdout" else on_stderr, data)
            elif kind in ("result", "display") and isinstance(ev.get("bundle"), dict):
                record = {"kind": kind, "data": ev["bundle"]}
                check_bundle(record["data"], f"{kind} event")
                if len(results) < CODE_RESULTS_KEPT:
                    results.append(record)
                else:
                    dropped += 1
                await deliver(on_result, record)
            elif kind == "error":
                await deliver(on_error, {k: ev.get(k) for k in ("ename", "evalue", "traceback")})

        call = self._conn.start("code.run", args)
        body = await run_call(self._conn, call, wait, on_event=on_event)
        fields = kept.fields(bool(strip_ansi), False)
        body = {
            **body,
            **{k: v for k, v in fields.items() if not k.endswith("_gap_at")},
            "results": results,
            "results_dropped": body.get("results_dropped", 0) + dropped,
        }
        return CodeResult.from_body(checked(CodeRunReply, body))

    def code_run_stream(
        self,
        code: str,
        *,
        context: str | None = None,
        timeout_s: float | None = None,
        interrupt_grace_s: float | None = None,
        strip_ansi: bool | None = None,
        deadline: RunDeadline = DERIVED,
    ) -> CodeStream:
        """Like :meth:`code_run`, delivering output and rich results as they arrive (async only);
        ``deadline`` as there (None: for ever)."""
        args = present(
            code=code,
            context=context,
            timeout_s=_seconds(timeout_s),
            interrupt_grace_s=_seconds(interrupt_grace_s),
            strip_ansi=strip_ansi,
            stream=True,
        )
        wait = _resolve(deadline, lambda: _code_deadline(timeout_s, interrupt_grace_s))
        return CodeStream(self, self._conn.start("code.run", args), wait)

    async def code_interrupt(self, context: str, *, deadline: float | None = 30.0) -> None:
        await self._conn.request("code.interrupt", {"context": context}, deadline)

    async def code_restart(self, context: str, *, deadline: float | None = 120.0) -> int:
        return int((await self._conn.request("code.restart", {"context": context}, deadline))["pid"])

    async def code_close(self, context: str, *, deadline: float | None = 30.0) -> None:
        await self._conn.request("code.close", {"context": context}, deadline)

    async def code_list(self, *, deadline: float | None = 30.0) -> list[ContextInfo]:
        body = checked(CodeListReply, await self._conn.request("code.list", {}, deadline))
        return [ContextInfo.from_wire(c) for c in body["contexts"]]

    # -- background processes ---------------------------------------------------------------
    # ``process_id`` is guestd's id of a background process ("p1", ...), not the OS pid.
    async def process_start(
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
    ) -> AsyncProcess:
        """Start a detached process; returns its handle at once (``.id``, guestd's process id, and
        ``.pid``, the OS pid; leaving ``async with`` kills and forgets it).
        ``spill``: every byte of stdout and stderr also goes to a file in the guest, named with the
        offset where each ring starts by :meth:`process_list` and :meth:`process_wait`
        (``stdout_spill``, ``stdout_ring_start``): read what the ring lost with :meth:`read_file`."""
        args = _command(cmd) | present(
            cwd=_wire_path(cwd),
            env=env,
            stdin=stdin,
            pty=pty,
            rows=rows,
            cols=cols,
            ring_bytes=ring_bytes,
            merge_stderr=merge_stderr,
            spill=spill,
        )
        body = checked(ProcessStartReply, await self._conn.request("process.start", args, deadline))
        return AsyncProcess(self, ProcessStartResult.from_wire(body))

    async def process_list(self, *, deadline: float | None = DEFAULT_DEADLINE) -> list[ProcessInfo]:
        body = checked(ProcessListReply, await self._conn.request("process.list", {}, deadline))
        return [ProcessInfo.from_wire(p) for p in body["processes"]]

    def attach(
        self,
        process_id: str,
        *,
        stdout_from: int | None = None,
        stderr_from: int | None = None,
        follow: bool | None = None,
        deadline: float | None = UNBOUNDED_RUN_DEADLINE,
        progress_timeout: float | None = None,
    ) -> Attach:
        """Stream output from the given offsets (async only). ``deadline`` bounds the whole
        attach (one hour by default; None: none, for a person at a terminal),
        ``progress_timeout`` each wait for the next event."""
        args = present(id=process_id, stdout_from=stdout_from, stderr_from=stderr_from, follow=follow)
        return Attach(self, self._conn.start("process.attach", args), deadline, progress_timeout)

    async def process_output(
        self,
        process_id: str,
        *,
        stdout_from: int | None = None,
        stderr_from: int | None = None,
        follow: bool | None = None,
        deadline: float | None = UNBOUNDED_RUN_DEADLINE,
        progress_timeout: float | None = None,
    ) -> ProcessOutput:
        """Everything :meth:`attach` delivers (stdout, stderr, final status); follows until exit
        by default."""
        a = self.attach(
            process_id,
            stdout_from=stdout_from,
            stderr_from=stderr_from,
            follow=follow,
            deadline=deadline,
            progress_timeout=progress_timeout,
        )
        out = {"stdout": bytearray(), "stderr": bytearray()}
        async for name, _, data in a:
            if name in out:
                out[name] += data
        status = await a.result()
        return ProcessOutput(
            bytes(out["stdout"]), bytes(out["stderr"]), status, a.lost_bytes["stdout"], a.lost_bytes["stderr"]
        )

    async def process_wait(
        self, process_id: str, *, timeout_s: float | None = None, deadline: float | None = None
    ) -> ProcessWaitResult:
        """Wait for exit; the guest answers ``timed_out: true`` after ``timeout_s``.
        ``deadline`` defaults to that plus a margin, and to one hour without ``timeout_s``."""
        args = present(id=process_id, timeout_s=_seconds(timeout_s))
        if deadline is None:
            deadline = UNBOUNDED_RUN_DEADLINE if timeout_s is None else timeout_s + REPLY_MARGIN
        body = checked(ProcessWaitReply, await self._conn.request("process.wait", args, deadline))
        return ProcessWaitResult.from_wire(body)

    async def process_signal(self, process_id: str, sig: str | int = "TERM", *, deadline: float | None = 30.0) -> None:
        await self._conn.request("process.signal", {"id": process_id, "signal": str(sig)}, deadline)

    async def process_write(self, process_id: str, data: StdinSource, *, deadline: float | None = 60.0) -> int:
        """Write to the process's stdin: bytes, str, a binary file or an (async) iterator of bytes,
        sent as writes of at most 1 MiB, one after another (``deadline`` bounds each); the bytes
        written."""
        written = 0
        async for chunk in stdin_chunks(data):
            reply = await self._conn.request("process.write", {"id": process_id, "data": chunk}, deadline)
            written += int(reply["written"])
        return written

    async def process_close_stdin(self, process_id: str, *, deadline: float | None = 30.0) -> None:
        await self._conn.request("process.close_stdin", {"id": process_id}, deadline)

    async def process_resize(self, process_id: str, rows: int, cols: int, *, deadline: float | None = 30.0) -> None:
        await self._conn.request("process.resize", {"id": process_id, "rows": rows, "cols": cols}, deadline)

    async def process_forget(self, process_id: str, *, deadline: float | None = 30.0) -> None:
        await self._conn.request("process.forget", {"id": process_id}, deadline)

    # -- shell sessions -----------------------------------------------------------------------
    async def shell_create(
        self,
        *,
        cwd: WirePath | None = None,
        env: dict[str, str] | None = None,
        name: str | None = None,
        deadline: float | None = 60.0,
    ) -> AsyncShell:
        """A new bash session; its handle (``.id``, ``.pid``; ``async with`` it to close it after)."""
        args = present(cwd=_wire_path(cwd), env=env, name=name)
        body = checked(ShellCreateReply, await self._conn.request("shell.create", args, deadline))
        return AsyncShell(self, ShellCreateResult.from_wire(body))

    async def shell_run(
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
        """Run a command in a persistent bash session (cd, variables, venvs persist).

        ``timeout_s``/``idle_timeout_s`` are enforced in the guest; without ``timeout_s`` the
        client's ``default_timeout_s`` applies. ``deadline`` defaults (:data:`DERIVED`) to the
        guest's timeout plus the time to stop the command and a margin, one hour without one;
        None: for ever. ``input`` (the command's stdin) and ``on_stdout``/``on_stderr`` as in
        :meth:`exec` (neither a streamed input nor callbacks with ``keep``)."""
        timeout_s = self._default_timeout(timeout_s)
        inline, streamed = split_stdin(input)
        watch = on_stdout is not None or on_stderr is not None
        capture = CaptureOptions(max_output, head_tail, strip_ansi, collapse_cr)
        args = present(
            id=session,
            command=command,
            input=inline,
            stdin_stream=True if streamed is not None else None,
            timeout_s=_seconds(timeout_s),
            idle_timeout_s=_seconds(idle_timeout_s),
            on_timeout=on_timeout,
            merge_stderr=merge_stderr,
            check_syntax=check_syntax,
            keep=keep,
            spill=spill,
            **capture.request_args(live=watch),
        )
        wait = _resolve(deadline, lambda: _run_deadline(timeout_s, idle_timeout_s, SHELL_STOP_S))
        watched = (capture, on_stdout, on_stderr) if watch else None
        body = await self._run_to_end(self._conn.start("shell.run", args), wait, streamed, watched)
        return ShellResult.from_body(checked(ShellRunReply, body))

    def shell_stream(
        self,
        session: str,
        command: str,
        *,
        input: StdinSource | None = None,
        stdin_stream: bool | None = None,
        timeout_s: float | None = None,
        idle_timeout_s: float | None = None,
        max_output: int | None = None,
        head_tail: bool = False,
        on_timeout: OnTimeout | None = None,
        merge_stderr: bool | None = None,
        check_syntax: bool | None = None,
        spill: bool | None = None,
        strip_ansi: bool | None = None,
        collapse_cr: bool | None = None,
        pty: bool | None = None,
        rows: int | None = None,
        cols: int | None = None,
        live: bool = True,
        deadline: RunDeadline = DERIVED,
    ) -> ShellStream:
        """Like :meth:`shell_run`, the run as a stream object (async only), as
        :meth:`exec_stream`: ``input`` any stdin source sent for you, or ``stdin_stream`` to
        type into the command with :meth:`ShellStream.write_stdin`; ``live`` and the capture
        options as there. ``pty`` runs it on a terminal of ``rows`` x ``cols`` (write_stdin types
        into it, ``signal("INT")`` is Ctrl-C, :meth:`shell_resize` resizes it; see
        :mod:`guestd.client.expect`). ``deadline`` as in :meth:`shell_run` (None: for ever)."""
        inline, streamed = self._stream_stdin("shell_stream", input, stdin_stream, spill, live)
        timeout_s = self._default_timeout(timeout_s)
        capture = CaptureOptions(max_output, head_tail, strip_ansi, collapse_cr)
        args = present(
            id=session,
            command=command,
            input=inline,
            stdin_stream=True if streamed is not None or stdin_stream else None,
            timeout_s=_seconds(timeout_s),
            idle_timeout_s=_seconds(idle_timeout_s),
            on_timeout=on_timeout,
            merge_stderr=merge_stderr,
            check_syntax=check_syntax,
            spill=spill,
            pty=pty,
            rows=rows,
            cols=cols,
            **capture.request_args(live),
        )
        wait = _resolve(deadline, lambda: _run_deadline(timeout_s, idle_timeout_s, SHELL_STOP_S))
        return self._open_stream(ShellStream, self._conn.start("shell.run", args), wait, live, capture, streamed)

    async def shell_resize(self, session: str, rows: int, cols: int, *, deadline: float | None = 30.0) -> None:
        """The terminal size of the session's running ``pty`` command (it gets SIGWINCH)."""
        await self._conn.request("shell.resize", {"id": session, "rows": rows, "cols": cols}, deadline)

    # -- kept runs (keep=True; guestd.client.runs.start_kept) -----------------------------
    def kept_run(self, run_id: str) -> AsyncKeptRun:
        """A handle on the kept run ``run_id`` (``result.run_id`` of a run with ``keep=True``)."""
        return AsyncKeptRun(self, run_id)

    async def run_get(self, run_id: str, *, deadline: float | None = 30.0) -> RunInfo:
        """A kept run (``run_info``): state, and its result or error once it has ended."""
        body = checked(RunGetReply, await self._conn.request("run.get", {"id": run_id}, deadline))
        return RunInfo.from_wire(body["run"])

    async def run_wait(self, run_id: str, *, timeout_s: float | None = None) -> RunInfo:
        """The kept run once it has ended, or as it is after ``timeout_s`` (the guest's
        default when None; state running)."""
        args = present(id=run_id, timeout_s=_seconds(timeout_s))
        return await self._kept_run_until(self._conn.start("run.wait", args), timeout_s)

    async def run_cancel(self, run_id: str, *, timeout_s: float | None = None) -> RunInfo:
        """Cancel a running kept run (its command or cell is interrupted); the run once it has
        ended (state failed, error cancelled), or as it is after ``timeout_s``."""
        args = present(id=run_id, timeout_s=_seconds(timeout_s))
        return await self._kept_run_until(self._conn.start("run.cancel", args), timeout_s)

    async def _kept_run_until(self, call: Call, timeout_s: float | None) -> RunInfo:
        """What a ``run.wait`` or ``run.cancel`` call answers: the run once it has ended, or as it
        is after the guest waited ``timeout_s`` (the schema's default when None)."""
        wait = timeout_s if timeout_s is not None else schema_default(call.op, "timeout_s")
        body = checked(RunWaitReply, await self._conn.wait(call, wait + 30.0))
        return RunInfo.from_wire(body["run"])

    async def run_list(self, *, deadline: float | None = 30.0) -> list[RunInfo]:
        """Every kept run, oldest first (without results)."""
        body = checked(RunListReply, await self._conn.request("run.list", {}, deadline))
        return [RunInfo.from_wire(r) for r in body["runs"]]

    async def shell_list(self, *, deadline: float | None = 30.0) -> list[ShellInfo]:
        body = checked(ShellListReply, await self._conn.request("shell.list", {}, deadline))
        return [ShellInfo.from_wire(r) for r in body["sessions"]]

    async def shell_close(self, session: str, *, deadline: float | None = 30.0) -> None:
        await self._conn.request("shell.close", {"id": session}, deadline)

    # -- snapshots ----------------------------------------------------------------------------
    async def snapshot_prepare(
        self,
        *,
        quiesce: bool | None = None,
        timeout_s: float | None = None,
        freeze: bool | None = None,
        fsfreeze: WirePath | None = None,
        freeze_max_s: float | None = None,
        deadline: float | None = None,
    ) -> SnapshotPrepareResult:
        """Call before pausing/snapshotting the VM. ``timeout_s`` is how long the guest waits
        for in-flight writes; ``deadline`` defaults to that plus time for the sync after it.
        ``freeze``: stop every workload process (cgroup.freeze) until resume or restore;
        ``fsfreeze``: also freeze that mount (PROTOCOL.md 11)."""
        args = present(
            quiesce=quiesce,
            timeout_s=_seconds(timeout_s),
            freeze=freeze,
            fsfreeze=_wire_path(fsfreeze),
            freeze_max_s=_seconds(freeze_max_s),
        )
        if deadline is None:
            wait_s = timeout_s if timeout_s is not None else schema_default("snapshot.prepare", "timeout_s")
            deadline = wait_s + PREPARE_MARGIN
        body = checked(SnapshotPrepareReply, await self._conn.request("snapshot.prepare", args, deadline))
        return SnapshotPrepareResult.from_wire(body)

    async def clock_check(self, *, time_ns: int | None = None, deadline: float | None = 10.0) -> ClockCheckResult:
        """Compare the guest's clock with this host's (``time_ns``: now, unless given); the guest
        reports jumps and drift and sets its clock when it is more than 0.2 s off."""
        args = {"time_ns": time.time_ns() if time_ns is None else time_ns}
        return ClockCheckResult.from_wire(
            checked(ClockCheckReply, await self._conn.request("clock.check", args, deadline))
        )

    async def snapshot_resume(self, *, deadline: float | None = 30.0) -> None:
        await self._conn.request("snapshot.resume", {}, deadline)

    async def restore(
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
        """Call first thing after every restore/clone. Defaults: the next generation, a fresh
        nonce, this host's clock and 64 bytes from os.urandom."""
        if generation is None:
            current = (await self.info()).raw["snapshot"].get("generation")  # a map, by the schema
            if not isinstance(current, int) or isinstance(current, bool) or current < 0:
                raise GuestProtocolError(f"info: snapshot.generation is {type(current).__name__}, not a count")
            generation = current + 1
        identity = present(sandbox_id=sandbox_id, hostname=hostname, env=env, token=token)
        args: dict[str, Any] = {
            "generation": generation,
            "nonce": nonce or os.urandom(16).hex(),
            "time_ns": time_ns if time_ns is not None else time.time_ns(),
            "entropy": entropy if entropy is not None else os.urandom(64),
        }
        if identity:
            args["identity"] = identity
        body = checked(SnapshotRestoreReply, await self._conn.request("snapshot.restore", args, deadline))
        return SnapshotRestoreResult.from_wire(body)
