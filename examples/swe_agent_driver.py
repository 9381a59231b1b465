"""The SWE-agent style loop with its tools running in a guestd guest.

SWE-agent gives the model a small set of tools over a checked-out repository and, when the
model submits, turns the working tree into a patch. Here:

- ``shell``: a command in one persistent bash session rooted at the repository (``cd`` and
  variables persist), with a timeout and a tail-truncated observation;
- ``write_file``: an atomic write of a whole file (relative to the shell's directory);
- ``submit``: stage everything and return ``git add -A && git diff --cached`` as text, so new
  files are in the patch; the patch is read in full or the submit fails (never half a patch).

Nothing in the guest pushes anywhere: every git in the session gets
``url.no-push://disabled.pushInsteadOf`` for every URL shape (via GIT_CONFIG_* in the shell's
environment), and the repository's existing remotes get a push URL that cannot work. The real
boundary is the VM's network policy; this keeps an agent's ``git push`` from ever leaving.

Run the scripted demo (local guestd, a real bug, its tests, the patch):

    .venv/bin/python -m examples.swe_agent_driver
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from examples import demo_repo
from examples.guests import LocalGuest
from examples.openhands_runtime import tail_text
from guestd.client import Client, GuestdError

NO_PUSH = "no-push://disabled-by-the-sandbox/"
# Every URL prefix a push could use; pushInsteadOf rewrites them all to a transport that fails.
PUSH_PREFIXES = ("https://", "http://", "ssh://", "git://", "git@", "file://", "/", ".", "~")


def no_push_env() -> dict[str, str]:
    env = {"GIT_CONFIG_COUNT": str(len(PUSH_PREFIXES)), "GIT_TERMINAL_PROMPT": "0"}
    for i, prefix in enumerate(PUSH_PREFIXES):
        env[f"GIT_CONFIG_KEY_{i}"] = f"url.{NO_PUSH}.pushInsteadOf"
        env[f"GIT_CONFIG_VALUE_{i}"] = prefix
    return env


@dataclass
class ToolCall:
    name: str  # "shell" | "write_file" | "submit"
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class Step:
    call: ToolCall
    observation: str


@dataclass
class Trajectory:
    steps: list[Step]
    patch: str | None  # None when the model never submitted within max_steps
    exit_status: str  # "submitted" | "max_steps" | "error: ..."


class SweTools:
    """The tools of one episode, over one guest and one repository in it."""

    def __init__(
        self,
        client: Client,
        repo: str,
        *,
        env: dict[str, str] | None = None,
        timeout_s: float = 120.0,
        max_observation_bytes: int = 10_000,
        max_patch_bytes: int = 8 << 20,
    ) -> None:
        self.client = client
        self.repo = repo
        self.timeout_s = timeout_s
        self.limit = max_observation_bytes
        self.max_patch_bytes = max_patch_bytes
        self.env = {"TERM": "dumb", "PAGER": "cat", "GIT_PAGER": "cat", **(env or {}), **no_push_env()}
        self.cwd = repo
        self.session = client.shell_create(cwd=repo, env=self.env).id
        # Existing remotes: a push URL that cannot work (pushInsteadOf does not apply to pushurl).
        self.shell('for r in $(git remote); do git remote set-url --push "$r" ' + NO_PUSH + "; done")

    def shell(self, command: str, timeout: float | None = None) -> str:
        t = timeout or self.timeout_s
        r = self.client.shell_run(self.session, command, timeout_s=t, max_output=self.limit, deadline=t + 60)
        self.cwd = os.fsdecode(r.cwd)  # bytes when not UTF-8; the os str maps back to them
        out, _ = tail_text(r.stdout + r.stderr, limit=self.limit, dropped_before=r.stdout_dropped + r.stderr_dropped)
        if r.timed_out:
            out += f"\n[timed out after {t:g} s; the command's processes were ended]"
        return f"{out}\n[exit code {-1 if r.exit_code is None else r.exit_code}]"

    def write_file(self, path: str, content: str) -> str:
        full = path if path.startswith("/") else f"{self.cwd}/{path}"
        n = self.client.write_file(full, content, parents=True)
        return f"wrote {n} bytes to {full}"

    def submit(self) -> str:
        """The patch of everything changed, new files included. Runs in the repository root,
        not the shell's cwd. Written to a file outside the repository and read back whole
        (bounded by ``max_patch_bytes``), so a large patch is never silently cut."""
        out = f"/tmp/swe-submit-{os.urandom(6).hex()}.patch"
        r = self.client.exec(
            ["sh", "-c", f"git add -A && git diff --cached --output={out}"],
            cwd=self.repo,
            env=self.env,
            timeout_s=self.timeout_s,
        )
        try:
            if r.exit_code != 0:
                raise RuntimeError(f"patch extraction failed ({r.exit_code}): {r.stderr.decode(errors='replace')}")
            size = self.client.stat(out).size
            if size > self.max_patch_bytes:
                raise RuntimeError(f"the patch is {size} bytes, over the {self.max_patch_bytes}-byte bound")
            # stat is the guest's word: the download itself is capped at the bound (a byte more
            # fails it), the same rule the library applies to every download.
            try:
                data = self.client.download(out, max_bytes=self.max_patch_bytes)
            except GuestdError as e:
                raise RuntimeError(f"the patch could not be read whole: {e.code}: {e.message}") from None
            return data.decode("utf-8", "surrogateescape")
        finally:
            try:
                self.client.remove(out)
            except GuestdError:
                pass

    def dispatch(self, call: ToolCall) -> str:
        try:
            if call.name == "shell":
                return self.shell(str(call.args["command"]), call.args.get("timeout"))
            if call.name == "write_file":
                return self.write_file(str(call.args["path"]), str(call.args["content"]))
        except KeyError as e:
            return f"error: {call.name} needs the argument {e}"
        except GuestdError as e:
            return f"error: {e.code}: {e.message}"
        return f"error: unknown tool {call.name!r}; the tools are shell, write_file and submit"

    def close(self) -> None:
        try:
            self.client.shell_close(self.session, deadline=30)
        except GuestdError:
            pass


Model = Callable[[list[Step]], ToolCall]


def run_episode(model: Model, tools: SweTools, *, max_steps: int = 30) -> Trajectory:
    steps: list[Step] = []
    for _ in range(max_steps):
        call = model(steps)
        if call.name == "submit":
            try:
                patch = tools.submit()
            except RuntimeError as e:
                steps.append(Step(call, str(e)))
                return Trajectory(steps, None, f"error: {e}")
            steps.append(Step(call, f"submitted a {len(patch)}-byte patch"))
            return Trajectory(steps, patch, "submitted")
        steps.append(Step(call, tools.dispatch(call)))
    return Trajectory(steps, None, "max_steps")


class ScriptedModel:
    """A stand-in for the model: a fixed list of tool calls, in order."""

    def __init__(self, calls: list[ToolCall]) -> None:
        self.calls: Iterator[ToolCall] = iter(calls)

    def __call__(self, history: list[Step]) -> ToolCall:
        return next(self.calls, ToolCall("submit"))


def scripted_fix(python: str) -> list[ToolCall]:
    """Reproduce, inspect, fix, add a regression test (a new file), verify, submit."""
    return [
        ToolCall("shell", {"command": f"{python} -m pytest -q -x 2>&1 | tail -n 3", "timeout": 300}),
        ToolCall("shell", {"command": "grep -n 'split' textstats.py"}),
        ToolCall("write_file", {"path": "textstats.py", "content": demo_repo.FIXED}),
        ToolCall(
            "write_file",
            {
                "path": "tests_regression/test_tabs.py",
                "content": "import sys\nsys.path.insert(0, '.')\n"
                "from textstats import word_count\n\n\n"
                "def test_tabs_and_newlines() -> None:\n    assert word_count('a\\tb\\nc') == 3\n",
            },
        ),
        ToolCall("shell", {"command": f"{python} -m pytest -q . tests_regression", "timeout": 300}),
        ToolCall("submit"),
    ]


def main() -> int:
    guest = LocalGuest()
    try:
        with guest.connect() as c:
            repo = f"{guest.workspace}/textstats"
            demo_repo.create(c, repo)
            tools = SweTools(c, repo)
            traj = run_episode(ScriptedModel(scripted_fix(shlex.quote(sys.executable))), tools)
            for step in traj.steps:
                print(f"\033[1m>>> {step.call.name} {step.call.args}\033[0m\n{step.observation}")
            print(f"\n{traj.exit_status}; the patch:\n{traj.patch}")
            tools.close()
            return 0 if traj.patch else 1
    finally:
        guest.stop()


if __name__ == "__main__":
    sys.exit(main())
