"""One shell.run in progress: what its phases (session.py) hand on, and the reply made of it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from guestd.children import KilledBy, exit_info, usage_between
from guestd.output.capture import capture_fields_off_loop

if TYPE_CHECKING:
    from guestd.children import Child
    from guestd.children.cgroups import RunUsage
    from guestd.output.capture import OutputCapture
    from guestd.services import Request
    from guestd.shells.job import RunningJob
    from guestd.shells.script import Marker
    from guestd.shells.stdin import CommandInput
    from guestd.wire.paths import WirePath
    from guestd.wire.types import ShellRunArgs, ShellRunReply, ShellRunTimedOut

# How a wait for a command's end ends: its marker ('done'), bash's end ('exited'), a timeout
# ('wall', 'idle'), or its request gone ('cancel').
Outcome = Literal["done", "exited", "wall", "idle", "cancel"]
# A command guestd interrupted: why, as a run's killed_by
_KILLED_BY: dict[str, KilledBy] = {"wall": "timeout", "idle": "idle_timeout", "cancel": "cancel"}


@dataclass
class Command:
    """One shell.run in progress: what its phases hand on."""

    args: ShellRunArgs
    ctx: Request | None
    detach: bool  # on_timeout "detach" applies: a timeout leaves the job running
    job: RunningJob | None  # on_timeout "detach" and pty: the command runs as a job of bash
    stdin: CommandInput
    ran_in: Child  # the session's bash when the command began
    usage_before: RunUsage | None
    outcome: Outcome | None = None
    timed_out: ShellRunTimedOut | None = None
    interrupted: bool = False
    restarted: bool = False
    bash_status: int | None = None  # bash's wait status, when it ended during the command
    marker: Marker | None = None
    detached: str | None = None  # the process id the command goes on as


def exit_of(run: Command) -> tuple[int | None, KilledBy | None]:
    """The command's exit code and why it ended early, from how its wait ended."""
    code = run.marker.status if run.marker is not None and run.detached is None else None  # a detached job still runs
    if run.outcome == "exited" and run.bash_status is not None:
        # bash itself ended during the command (`builtin exit 3`, `exec prog`, or `exit 3`
        # under `set -o posix`, where the builtin comes before guestd's function): its
        # exit status is the command's, as with `bash -c`.
        code = exit_info(run.bash_status)["exit_code"]
    why: KilledBy | None = _KILLED_BY.get(run.outcome or "")
    if run.outcome == "exited":
        why = run.ran_in.exit_info()["killed_by"]
    if run.detached is not None:
        why = None  # not ended: it goes on as a background process
    return code, why


async def reply(
    run: Command, caps: dict[int, OutputCapture], cwd: WirePath, duration_s: float, usage_after: RunUsage | None
) -> ShellRunReply:
    """The reply to a command that has ended (or goes on detached); ``cwd``: the session's
    after it, as the wire carries it. "changes": the handler adds it."""
    code, why = exit_of(run)
    a = run.args
    return {
        "exit_code": code,
        "timed_out": run.timed_out,
        "interrupted": run.interrupted,
        "session_restarted": run.restarted,
        "cwd": cwd,
        **await capture_fields_off_loop(  # shaping may take a worker thread
            caps[1],
            caps[2],
            streamed=a["stream"] and run.ctx is not None,
            strip_ansi=a["strip_ansi"],
            collapse_cr=a["collapse_cr"],
        ),
        "duration_s": duration_s,
        "detached": run.detached,
        **usage_between(run.usage_before, usage_after, why, code),
    }
