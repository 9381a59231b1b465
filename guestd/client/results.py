"""Typed results returned by the client.

The convention (every public method of :class:`~guestd.client.AsyncClient` and
:class:`~guestd.client.Client` keeps it; ``tests/test_client_typed.py`` checks the annotations):

- A reply is a frozen dataclass with attribute access, never a dict: the run results here
  (:class:`ExecResult`, :class:`ShellResult`, :class:`CodeResult`, hand-written because they
  carry helpers), the ones generated from the schema in :mod:`guestd.client.replies`
  (``ProcessWaitResult``, ``RunInfo``, ``MetricsSample``, ...: the schema's field names), or a
  plain value where the reply is one (``write_file`` -> bytes written, ``ping`` -> seconds).
  :class:`Info` keeps the whole wire reply as ``.raw``.
- Things you hold are handles, each a context manager that releases what it holds:
  ``shell_create`` -> :class:`~guestd.client.handles.AsyncShell` / ``Shell``, ``code_create`` ->
  ``CodeContext``, ``process_start`` -> ``Process``, ``kept_run`` -> ``KeptRun``. A handle is
  also the create call's result (``.id``, ``.pid``); the flat methods taking an id go on working.
- Output: ``stdout`` / ``stderr`` are the bytes as produced; ``stdout_text`` / ``stderr_text``
  the same decoded as UTF-8 with U+FFFD for bytes that are not; ``text`` is stdout's text for
  commands and the cell's value (``text/plain``) for code, as in E2B's SDK.
- Where the wire takes bytes (stdin, file data, patches) a str is taken too, as UTF-8.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast

from guestd.client.connection import GuestProtocolError
from guestd.client.replies import ProcessAttachResult, RunInfo, SpillInfo
from guestd.wire.errors import ErrorCode, GuestdError
from guestd.wire.paths import WirePath
from guestd.wire.schema import OPS_BY_NAME, validate
from guestd.wire.session import PeerViolation

if TYPE_CHECKING:  # the schema's own types (guestd/wire/types.py, generated), for the fields below
    from guestd.wire.types import (
        CodeOutputRecord,
        CodeRunReply,
        CodeRunStatus,
        CodeRunTimeoutAction,
        DirEntryType,
        ExecKilledBy,
        ExecReply,
        ExecTimedOut,
        FileStatReply,
        FileStatType,
        ShellRunReply,
        ShellRunTimedOut,
    )

Reply = TypeVar("Reply")


def checked(shape: type[Reply], body: dict[str, Any]) -> Reply:
    """``body`` as its op's generated reply type: the session core has validated it against
    the same schema entry the type is generated from (records and enums included)."""
    return cast(Reply, body)


def check_bundle(data: dict[Any, Any], where: str) -> None:
    """A MIME bundle as the README promises it: str MIME types, ``image/*`` values bytes (or the
    kernel's text when it was not valid base64; ``image/svg+xml`` text), ``text/*`` values str,
    others of JSON types. Anything else is the guest breaking the protocol."""
    for mime, value in data.items():
        if not isinstance(mime, str):
            raise PeerViolation(f"code.run: {where} has a key that is not a MIME type string")
        if mime.startswith("image/") and mime != "image/svg+xml":
            ok = isinstance(value, (bytes, str))
        elif mime.startswith("text/") or mime == "image/svg+xml":
            ok = isinstance(value, str)
        else:
            ok = _json_like(value)
        if not ok:
            raise PeerViolation(f"code.run: {where}[{mime!r}] is a {type(value).__name__}, not what the MIME type says")


def _json_like(value: Any) -> bool:
    """Made of JSON types only (str keys); depth is bounded by the session core (MAX_DEPTH)."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return True
    if isinstance(value, list):
        return all(_json_like(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _json_like(v) for k, v in value.items())
    return False


def _spills(b: ExecReply | ShellRunReply) -> dict[str, SpillInfo | None]:
    out, err = b.get("stdout_spill"), b.get("stderr_spill")
    return {
        "stdout_spill": None if out is None else SpillInfo.from_wire(out),
        "stderr_spill": None if err is None else SpillInfo.from_wire(err),
    }


class DecodedOutput:
    """``stdout`` and ``stderr`` (bytes, as produced) also as text: UTF-8, undecodable bytes as
    U+FFFD. A base of every result that holds a run's output."""

    stdout: bytes
    stderr: bytes

    @property
    def stdout_text(self) -> str:
        return self.stdout.decode("utf-8", "replace")

    @property
    def stderr_text(self) -> str:
        return self.stderr.decode("utf-8", "replace")


class CommandOutput(DecodedOutput):
    """A command's output, whose ``text`` is its stdout's (a cell's is its value instead)."""

    @property
    def text(self) -> str:
        """stdout as text (UTF-8, undecodable bytes as U+FFFD): ``print(r.text[-2000:])``."""
        return self.stdout_text


@dataclass(frozen=True, kw_only=True)
class OutputCounts(DecodedOutput):
    """What every run's result carries: the kept bytes of each stream and exact counts of what
    was produced and dropped (the schema's bounded-capture fields)."""

    stdout: bytes
    stderr: bytes
    stdout_bytes: int
    stderr_bytes: int
    stdout_dropped: int
    stderr_dropped: int

    @property
    def truncated(self) -> bool:
        return bool(self.stdout_dropped or self.stderr_dropped)


@dataclass(frozen=True, kw_only=True)
class CapturedOutput(OutputCounts, CommandOutput):
    """A command's result (exec, shell.run): its output and counts, how long it ran."""

    duration_s: float

    def to_json(self) -> dict[str, Any]:
        """JSON-ready: bytes as UTF-8 text, plus ``<field>_base64`` when they are not UTF-8."""
        out: dict[str, Any] = {}
        for k in self.__dataclass_fields__:
            v = getattr(self, k)
            if isinstance(v, bytes):
                try:
                    out[k] = v.decode("utf-8")
                except UnicodeDecodeError:
                    out[k] = v.decode("utf-8", "replace")
                    out[f"{k}_base64"] = base64.b64encode(v).decode()
            else:
                out[k] = v
        return out


@dataclass(frozen=True, kw_only=True)
class RunFigures:
    """Why a run ended and what it used (PROTOCOL.md "Why a run ended"); None: not known, or a
    guest older than these fields."""

    killed_by: ExecKilledBy | None = None
    oom_killed: bool | None = None
    cpu_user_s: float | None = None
    cpu_sys_s: float | None = None
    max_rss_bytes: int | None = None


@dataclass(frozen=True, kw_only=True)
class ExecResult(RunFigures, CapturedOutput):
    exit_code: int | None
    signal: int | None
    timed_out: ExecTimedOut | None
    stdout_gap_at: int | None
    stderr_gap_at: int | None
    pid: int
    detached: str | None = None  # on_timeout "detach": the background process it goes on as
    stdout_spill: SpillInfo | None = None  # spill: where every byte went (path, bytes, stopped)
    stderr_spill: SpillInfo | None = None

    @classmethod
    def from_body(cls, b: ExecReply) -> ExecResult:
        fields: dict[str, Any] = {"detached": None, **b, **_spills(b)}
        return cls(**{k: fields[k] for k in cls.__dataclass_fields__ if k in fields})

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.timed_out is None

    def shell_exit_code(self) -> int:
        """Exit code as a shell reports it: 124 on timeout, 128+N when killed by signal N."""
        if self.timed_out is not None:
            return 124
        if self.signal is not None:
            return 128 + self.signal
        return self.exit_code if self.exit_code is not None else 1


@dataclass(frozen=True)
class FileStat:
    type: FileStatType
    size: int
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    target: WirePath | None = None  # bytes when the link's target is not UTF-8

    @classmethod
    def from_body(cls, b: FileStatReply) -> FileStat:
        return cls(b["type"], b["size"], b["mode"], b["uid"], b["gid"], b["mtime_ns"], b.get("target"))


@dataclass(frozen=True)
class DirEntry:
    name: WirePath  # bytes when the name is not UTF-8
    type: DirEntryType
    size: int
    mode: int
    mtime_ns: int


@dataclass(frozen=True)
class DirListing:
    entries: list[DirEntry]  # the first ones in order of their names as bytes
    truncated: bool
    total: int  # entries in the directory, returned or not


@dataclass(frozen=True)
class Info:
    version: str
    protocol_version: int
    capabilities: list[str]
    boot_id: str
    uptime_s: float
    raw: dict[str, Any] = field(repr=False)


@dataclass(frozen=True)
class CodeError:
    ename: str
    evalue: str
    traceback: list[str]


@dataclass(frozen=True)
class CodeResult(RunFigures, OutputCounts):
    """One cell's outcome. ``results`` holds MIME bundles: ``{"kind", "data": {mime: value}}``.
    (Not a CapturedOutput: its ``text`` is the cell's value, not its stdout.)"""

    context: str
    status: CodeRunStatus
    timeout_action: CodeRunTimeoutAction | None
    exit_reason: str | None
    results: list[CodeOutputRecord]
    results_dropped: int
    error: CodeError | None
    stdin_exhausted: bool
    execution_count: int | None
    duration_s: float
    run_id: str | None = None  # keep: the kept run's id

    @classmethod
    def from_body(cls, b: CodeRunReply) -> CodeResult:
        for i, r in enumerate(b["results"]):
            check_bundle(r["data"], f"results[{i}].data")
        err = b.get("error")
        return cls(
            context=b["context"],
            status=b["status"],
            timeout_action=b.get("timeout_action"),
            exit_reason=b.get("exit_reason"),
            stdout=b["stdout"],
            stderr=b["stderr"],
            stdout_bytes=b["stdout_bytes"],
            stderr_bytes=b["stderr_bytes"],
            stdout_dropped=b["stdout_dropped"],
            stderr_dropped=b["stderr_dropped"],
            results=b["results"],
            results_dropped=b["results_dropped"],
            error=CodeError(err["ename"], err["evalue"], err["traceback"]) if err is not None else None,
            stdin_exhausted=b["stdin_exhausted"],
            execution_count=b.get("execution_count"),
            duration_s=b["duration_s"],
            killed_by=b.get("killed_by"),
            oom_killed=b.get("oom_killed"),
            cpu_user_s=b.get("cpu_user_s"),
            cpu_sys_s=b.get("cpu_sys_s"),
            max_rss_bytes=b.get("max_rss_bytes"),
            run_id=b.get("run_id"),
        )

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def text(self) -> str | None:
        """``text/plain`` of the cell's value (its execute_result), if any (as E2B's
        ``Execution.text``); the cell's printed output is :attr:`stdout_text`."""
        for r in self.results:
            if r["kind"] == "result":
                v = r["data"].get("text/plain")
                return v if isinstance(v, str) else None
        return None

    def to_json(self) -> dict[str, Any]:
        def jsonable(v: Any) -> Any:
            if isinstance(v, bytes):
                return {"base64": base64.b64encode(v).decode()}
            if isinstance(v, dict):
                return {k: jsonable(x) for k, x in v.items()}
            if isinstance(v, list):
                return [jsonable(x) for x in v]
            return v

        out: dict[str, Any] = {}
        for k in self.__dataclass_fields__:
            v = getattr(self, k)
            if k in ("stdout", "stderr"):
                out[k] = v.decode("utf-8", "replace")
            elif k == "error":
                out[k] = None if v is None else {"ename": v.ename, "evalue": v.evalue, "traceback": v.traceback}
            else:
                out[k] = jsonable(v)
        return out


@dataclass(frozen=True, kw_only=True)
class ShellResult(RunFigures, CapturedOutput):
    exit_code: int | None
    timed_out: ShellRunTimedOut | None
    interrupted: bool
    session_restarted: bool
    cwd: WirePath  # bytes when the directory's path is not UTF-8
    stdout_gap_at: int | None
    stderr_gap_at: int | None
    detached: str | None = None  # on_timeout "detach": the background process it goes on as
    run_id: str | None = None  # keep: the kept run's id
    stdout_spill: SpillInfo | None = None  # spill: where every byte went (path, bytes, stopped)
    stderr_spill: SpillInfo | None = None

    @classmethod
    def from_body(cls, b: ShellRunReply) -> ShellResult:
        fields: dict[str, Any] = {"detached": None, "run_id": None, **b, **_spills(b)}
        return cls(**{k: fields[k] for k in cls.__dataclass_fields__ if k in fields})


@dataclass(frozen=True)
class ProcessOutput(CommandOutput):
    """What :meth:`~guestd.client.AsyncClient.process_output` collected from a background
    process: its output from the offsets asked, and its status when the attach ended
    (``status.stdout_offset`` is where to attach again). ``*_lost``: bytes the ring had
    overwritten before they could be read."""

    stdout: bytes
    stderr: bytes
    status: ProcessAttachResult
    stdout_lost: int = 0
    stderr_lost: int = 0


@dataclass(frozen=True)
class OomKills:
    """From :meth:`~guestd.client.AsyncClient.watch_metrics`: the kernel's OOM killer struck in
    the workload (``new`` kills since the last sample, ``oom_kills`` in all)."""

    oom_kills: int
    new: int


def result_of(run: RunInfo) -> ShellResult | CodeResult:
    """A done run's result as the op's result type; a failed run's error raised. The record is
    the guest's word: ``result`` (a map in the schema) is checked against its op's reply schema
    and anything of the wrong shape is a :class:`GuestProtocolError`, never a KeyError."""
    op, state, rid = run.op, run.state, run.id
    if op not in ("shell.run", "code.run") or not isinstance(rid, str):
        raise GuestProtocolError(f"run record: op {op!r} or id {rid!r} is not a kept run's")
    if state == "failed":
        err = run.error
        if not isinstance(err, dict):
            raise GuestProtocolError(f"run {rid}: failed without an error map")
        code, message, details = err.get("code", "internal"), err.get("message", ""), err.get("details")
        if not isinstance(code, str) or not isinstance(message, str) or not isinstance(details, dict | None):
            raise GuestProtocolError(f"run {rid}: its error is not {{code, message, details}}")
        raise GuestdError(code, message, details=details)
    if state != "done" or not isinstance(run.result, dict):
        raise GuestdError(ErrorCode.BAD_REQUEST, f"run {rid} has not ended", details={"run": rid})
    try:
        body = validate(OPS_BY_NAME[op].result, run.result)
        return ShellResult.from_body(body) if op == "shell.run" else CodeResult.from_body(body)  # type: ignore[arg-type]
    except GuestdError as e:
        raise GuestProtocolError(f"run {rid}: its result is not a {op} reply: {e.message}") from None
