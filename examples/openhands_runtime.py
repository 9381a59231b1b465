"""An OpenHands-style runtime backend whose sandbox is a guestd guest.

OpenHands' agent emits actions (run bash, run IPython, read a file, write a file) and its
runtime turns each into an observation for the model. This is that runtime's action-execution
side on guestd:

- one guest per session (``GuestdRuntime.start`` takes a guest factory; ``close`` stops it);
- bash runs in one persistent guestd shell session, so ``cd``, variables and activated venvs
  persist between actions;
- Python runs in one persistent code context (an ipykernel) for the whole session;
- files are read and written in the workspace (relative paths resolve against the shell's
  current directory, as the agent expects);
- every action has a timeout enforced in the guest, plus a client-side deadline;
- observations are tail-truncated to a budget and say in words how many bytes were dropped
  (counting what guestd already dropped in the guest);
- ``close`` always tears everything down, even after errors, and may be called twice.

Run the scripted demo (starts a local guestd, fixes a real bug, runs its tests):

    .venv/bin/python -m examples.openhands_runtime
"""

from __future__ import annotations

import os
import posixpath
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from examples import demo_repo
from examples.guests import Guest, LocalGuest
from guestd.client import Client, GuestdError

# --- actions and observations (the shapes of OpenHands' events, trimmed to what a sandbox does)


@dataclass
class CmdRunAction:
    command: str
    timeout: float | None = None  # seconds; None: the runtime's default


@dataclass
class IPythonRunCellAction:
    code: str
    timeout: float | None = None


@dataclass
class FileReadAction:
    path: str
    start: int = 0  # first line (0-based)
    end: int = -1  # line after the last one; -1: to the end


@dataclass
class FileWriteAction:
    path: str
    content: str


Action = CmdRunAction | IPythonRunCellAction | FileReadAction | FileWriteAction


@dataclass
class CmdOutputObservation:
    content: str
    command: str
    exit_code: int  # -1 when the command was stopped by its timeout
    cwd: str
    timed_out: bool = False
    dropped_bytes: int = 0

    @property
    def message(self) -> str:
        """What the model reads."""
        return (
            f"{self.content}\n[Current working directory: {self.cwd}]\n"
            f"[Command finished with exit code {self.exit_code}]"
        )


@dataclass
class IPythonRunCellObservation:
    content: str
    code: str
    status: str  # ok | error | timeout | interrupted | died
    dropped_bytes: int = 0
    images: list[bytes] = field(default_factory=list)


@dataclass
class FileReadObservation:
    content: str
    path: str
    dropped_bytes: int = 0


@dataclass
class FileWriteObservation:
    content: str
    path: str


@dataclass
class ErrorObservation:
    content: str
    error_code: str = "error"


Observation = (
    CmdOutputObservation | IPythonRunCellObservation | FileReadObservation | FileWriteObservation | ErrorObservation
)


# --- truncation for the model


def tail_text(data: bytes, *, limit: int, dropped_before: int = 0, what: str = "output") -> tuple[str, int]:
    """Keep the last ``limit`` bytes of ``data`` (never splitting a UTF-8 character) and say, in
    words, how many bytes were dropped in all (``dropped_before``: bytes the guest already cut)."""
    cut = max(0, len(data) - limit)
    while cut < len(data) and (data[cut] & 0xC0) == 0x80:  # continuation byte: drop the whole character
        cut += 1
    dropped = dropped_before + cut
    text = data[cut:].decode("utf-8", "replace")
    if dropped:
        shown = len(data) - cut
        text = f"[... {what} truncated: the first {dropped} bytes were dropped, the last {shown} are shown ...]\n{text}"
    return text, dropped


# --- the runtime


@dataclass
class RuntimeConfig:
    max_observation_bytes: int = 10_000  # per observation, what the model sees
    command_timeout_s: float = 120.0
    python_timeout_s: float = 120.0
    file_timeout_s: float = 60.0
    max_read_bytes: int = 1 << 20  # a file read never moves more than this
    env: dict[str, str] = field(default_factory=dict)  # for the shell and the kernel


class GuestdRuntime:
    """One agent session: one guest, one bash session, one Python context."""

    def __init__(self, guest: Guest, client: Client, config: RuntimeConfig | None = None) -> None:
        self.guest = guest
        self.client = client
        self.config = config or RuntimeConfig()
        self.cwd = guest.workspace
        self.shell_id: str | None = None
        self.context_id: str | None = None
        self.closed = False

    @classmethod
    def start(cls, make_guest: Callable[[], Guest] = LocalGuest, config: RuntimeConfig | None = None) -> GuestdRuntime:
        """Create the session's guest, connect, and open the shell and the Python context."""
        guest = make_guest()
        try:
            client = guest.connect()
        except BaseException:
            guest.stop()
            raise
        rt = cls(guest, client, config)
        try:
            rt.connect()
        except BaseException:
            rt.close()
            raise
        return rt

    def connect(self) -> None:
        env = {"TERM": "dumb", "PAGER": "cat", "GIT_PAGER": "cat", **self.config.env}
        self.shell_id = self.client.shell_create(cwd=self.cwd, env=env).id
        self.context_id = self.client.code_create(cwd=self.cwd, env=self.config.env, deadline=300).id

    def __enter__(self) -> GuestdRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- dispatch

    def run_action(self, action: Action) -> Observation:
        """Execute one action; guest-side failures come back as ``ErrorObservation``, never raise."""
        if self.closed:
            return ErrorObservation("the runtime is closed", "closed")
        try:
            if isinstance(action, CmdRunAction):
                return self.run(action)
            if isinstance(action, IPythonRunCellAction):
                return self.run_ipython(action)
            if isinstance(action, FileReadAction):
                return self.read(action)
            if isinstance(action, FileWriteAction):
                return self.write(action)
        except GuestdError as e:
            return ErrorObservation(f"{e.code}: {e.message}", e.code)
        return ErrorObservation(f"unsupported action {type(action).__name__}", "bad_request")

    def resolve(self, path: str) -> str:
        return posixpath.normpath(posixpath.join(self.cwd, path))

    def run(self, action: CmdRunAction) -> CmdOutputObservation:
        assert self.shell_id is not None
        timeout = action.timeout or self.config.command_timeout_s
        limit = self.config.max_observation_bytes
        r = self.client.shell_run(
            self.shell_id, action.command, timeout_s=timeout, max_output=limit, deadline=timeout + 60
        )
        self.cwd = os.fsdecode(r.cwd)  # bytes when not UTF-8; the os str maps back to them
        out, dropped = tail_text(r.stdout, limit=limit, dropped_before=r.stdout_dropped)
        if r.stderr_bytes:
            err, err_dropped = tail_text(r.stderr, limit=limit // 4, dropped_before=r.stderr_dropped, what="stderr")
            out = f"{out}{'' if not out or out.endswith(chr(10)) else chr(10)}[stderr]\n{err}"
            dropped += err_dropped
        if r.timed_out:
            out += (
                f"\n[The command timed out after {timeout:g} s ({r.timed_out} timeout); it was interrupted "
                "and its processes were ended. The shell session is still usable.]"
            )
        if r.session_restarted:
            out += "\n[The shell had to be restarted: the working directory and exported variables were kept.]"
        code = -1 if r.timed_out or r.exit_code is None else r.exit_code
        return CmdOutputObservation(out, action.command, code, self.cwd, bool(r.timed_out), dropped)

    def run_ipython(self, action: IPythonRunCellAction) -> IPythonRunCellObservation:
        assert self.context_id is not None
        timeout = action.timeout or self.config.python_timeout_s
        limit = self.config.max_observation_bytes
        r = self.client.code_run(
            action.code,
            context=self.context_id,
            timeout_s=timeout,
            strip_ansi=True,
            max_output=limit,
            deadline=timeout + 120,
        )
        parts: list[bytes] = [r.stdout, r.stderr]
        images: list[bytes] = []
        for res in r.results:
            data = res["data"]
            if "image/png" in data and isinstance(data["image/png"], bytes):
                images.append(data["image/png"])
                parts.append(f"[image/png, {len(data['image/png'])} bytes]\n".encode())
            elif isinstance(data.get("text/plain"), str):
                parts.append(data["text/plain"].encode() + b"\n")
        if r.error is not None:
            parts.append(("\n".join(r.error.traceback) or f"{r.error.ename}: {r.error.evalue}").encode() + b"\n")
        joined = b"".join(p for p in parts if p)
        text, dropped = tail_text(joined, limit=limit, dropped_before=r.stdout_dropped + r.stderr_dropped)
        if r.status == "timeout":
            text += (
                f"\n[The cell timed out after {timeout:g} s and was interrupted ({r.timeout_action}); "
                "variables defined before it are kept.]"
            )
        elif r.status == "died":
            text += f"\n[The Python kernel died ({r.exit_reason}); it will be restarted and its variables are lost.]"
            self.client.code_restart(self.context_id)
        return IPythonRunCellObservation(text, action.code, r.status, dropped, images)

    def read(self, action: FileReadAction) -> FileReadObservation | ErrorObservation:
        path = self.resolve(action.path)
        st = self.client.stat(path)
        if st.type != "file":
            return ErrorObservation(f"{path} is a {st.type}, not a file", "not_a_file")
        data = self.client.read_file(
            path, length=min(st.size, self.config.max_read_bytes), deadline=self.config.file_timeout_s
        )
        unread = st.size - len(data)
        lines = data.decode("utf-8", "replace").splitlines(keepends=True)
        end = len(lines) if action.end < 0 else action.end
        chosen = "".join(lines[action.start : end]).encode()
        limit = self.config.max_observation_bytes
        # A file is read from the start: keep the head, and say how to page to the rest.
        shown = chosen[:limit]
        while shown and len(shown) < len(chosen) and (chosen[len(shown)] & 0xC0) == 0x80:
            shown = shown[:-1]
        dropped = len(chosen) - len(shown) + unread
        text = shown.decode("utf-8", "replace")
        if dropped:
            text += (
                f"\n[... file truncated: {dropped} more bytes are not shown; "
                "read again with start/end line numbers to see the rest ...]"
            )
        return FileReadObservation(text, path, dropped)

    def write(self, action: FileWriteAction) -> FileWriteObservation:
        path = self.resolve(action.path)
        n = self.client.write_file(path, action.content, parents=True, deadline=self.config.file_timeout_s)
        return FileWriteObservation(f"Wrote {n} bytes to {path}", path)

    # -- teardown

    def close(self) -> None:
        """Close the context and the shell, disconnect, stop the guest: each step runs even if
        one before it fails (a dead guest must still be stopped)."""
        if self.closed:
            return
        self.closed = True
        steps: list[Callable[[], object]] = []
        if self.context_id is not None:
            steps.append(lambda: self.client.code_close(self.context_id or "", deadline=30))
        if self.shell_id is not None:
            steps.append(lambda: self.client.shell_close(self.shell_id or "", deadline=30))
        steps += [self.client.close, self.guest.stop]
        for step in steps:
            try:
                step()
            except Exception as e:  # keep tearing down; report what failed
                print(f"runtime close: {e!r}", file=sys.stderr)


# --- a scripted stand-in for the model


def scripted_fix(python: str) -> list[Action]:
    """The actions a model could take to fix examples/demo_repo's bug, in order."""
    return [
        CmdRunAction("cd textstats && git status --short && ls"),
        CmdRunAction(f"{python} -m pytest -q 2>&1 | tail -n 5", timeout=300),
        FileReadAction("textstats.py"),
        IPythonRunCellAction(
            "import pathlib\np = pathlib.Path('textstats/textstats.py')\nsrc = p.read_text()\nsrc.count('split(\" \")')"
        ),
        FileWriteAction("textstats.py", demo_repo.FIXED),
        IPythonRunCellAction(
            "import sys\nsys.path.insert(0, 'textstats')\nimport textstats\ntextstats.word_count('  a  b ')"
        ),
        CmdRunAction(f"{python} -m pytest -q", timeout=300),
        CmdRunAction("git diff --stat"),
    ]


def main() -> int:
    with GuestdRuntime.start(LocalGuest) as rt:
        demo_repo.create(rt.client, f"{rt.guest.workspace}/textstats")
        for action in scripted_fix(sys.executable):
            obs = rt.run_action(action)
            print(f"\033[1m>>> {action}\033[0m")
            print(obs.message if isinstance(obs, CmdOutputObservation) else obs.content)
        last = rt.run_action(CmdRunAction(f"{sys.executable} -m pytest -q", timeout=300))
        assert isinstance(last, CmdOutputObservation)
        print("tests pass" if last.exit_code == 0 else "tests still fail")
        return 0 if last.exit_code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
