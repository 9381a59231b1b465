"""guestctl exec | sh: run a command and exit with its exit code (124 when a timeout fired,
128+N when killed by signal N).

How it runs follows the flags; a flag that cannot apply is a usage error (exit 2), never
silently ignored:

* live (the default): output is written as it arrives, all of it, to a terminal or a pipe. A
  stream that arrived shorter than the guest says it was is reported and exits 1
  (:data:`guestd.cli.live.OUTPUT_CUT_EXIT`), never 0. A reader of our stdout that goes away
  (``| head``) cancels the command: exit 141, as for SIGPIPE.
* bounded (``--max-output``, ``--head-tail``, ``--spill``, ``--json``): guestd keeps at most
  ``--max-output`` bytes per stream (default 64 KiB, the last ones), printed when the command
  ends with a note on stderr naming what was dropped (``--json``: the ``*_dropped`` fields).
* In both, ``-i`` sends local stdin as it is read, under the guest's credit.
* ``--detach`` starts a background process and prints its id; ``--pty`` runs the command on a
  terminal bridged to this one (:mod:`guestd.cli.bridge`), its timeouts kept by guestctl.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys

from guestd.cli.bridge import TerminalBridge, local_size
from guestd.cli.live import show_run
from guestd.cli.shared import (
    Subcommands,
    UsageError,
    add_command,
    parse_env,
    print_death,
    print_json,
    print_spills_and_timeout,
    refuse_flags,
)
from guestd.cli.terminal import field
from guestd.client.aio import AsyncClient, ExecStream
from guestd.client.results import ExecResult
from guestd.client.streaming import DERIVED
from guestd.wire.errors import GuestdError

# exec --pty: a timeout guestctl enforces ends the command as guestd's own would: TERM to its
# process group, then KILL (which also reaches what left the group) after this grace.
PTY_KILL_GRACE_S = 2.0


def register(sub: Subcommands) -> None:
    for name in ("exec", "sh"):
        e = add_command(sub, name, run_command, help="run ARGV" if name == "exec" else "run a /bin/sh -c command")
        e.add_argument(
            "--timeout",
            type=float,
            default=None,
            help="wall-clock timeout in the guest, seconds (--pty: kept by guestctl; not with --detach)",
        )
        e.add_argument(
            "--idle-timeout",
            type=float,
            default=None,
            help="timeout with no output, seconds (--pty: kept by guestctl; not with --detach)",
        )
        e.add_argument("-w", "--cwd", default=None, metavar="DIR", help="the command's working directory")
        e.add_argument(
            "-e",
            "--env",
            action="append",
            default=[],
            metavar="K=V",
            help="set K to V; a bare K passes this environment's value (repeatable)",
        )
        e.add_argument(
            "--max-output",
            type=int,
            default=None,
            help="keep at most this many bytes per stream, printed when the command ends (default: all of "
            "the output, as it comes); --detach: the ring size; not with --pty",
        )
        e.add_argument(
            "--head-tail", action="store_true", help="keep both ends of long output (bounded; not with --pty/--detach)"
        )
        e.add_argument(
            "-i",
            "--stdin",
            action="store_true",
            help="send local stdin to the command as it is read, its end closing the command's stdin "
            "(--detach: the command keeps a stdin pipe for process.write; --pty: always so)",
        )
        e.add_argument("-d", "--detach", action="store_true", help="start in the background; print its process id")
        e.add_argument("-t", "--pty", action="store_true", help="run on a pseudo-terminal attached to this terminal")
        e.add_argument(
            "--on-timeout",
            choices=("kill", "detach"),
            default=None,
            help="detach: a timeout leaves the command running as a background process (prints its id); "
            "not with --detach",
        )
        e.add_argument(
            "--merge-stderr",
            action="store_true",
            help="stderr into stdout, in write order (--pty: always so)",
        )
        e.add_argument(
            "--spill",
            action="store_true",
            help="full output also to files in the guest (named; bounded; --detach: named by wait; not with --pty)",
        )
        if name == "exec":
            e.add_argument("argv", nargs=argparse.REMAINDER, help="-- PROGRAM ARGS...")
        else:
            e.add_argument("command", nargs="+", help="joined with spaces into one /bin/sh -c command, as ssh does")


def refuse_flags_that_cannot_apply(ns: argparse.Namespace) -> None:
    """No flag is silently ignored: one that has no meaning for the way the command runs is a
    usage error saying what to do instead."""
    if ns.detach:
        refuse_flags(
            (
                ("--timeout", ns.timeout is not None),
                ("--idle-timeout", ns.idle_timeout is not None),
                ("--on-timeout", ns.on_timeout is not None),
                ("--head-tail", ns.head_tail),
            ),
            "--detach",
            "a background process has no timeout (guestctl wait ID --timeout S waits for it; guestctl kill ID ends it)",
        )
    elif ns.pty:
        refuse_flags(
            (
                ("--max-output", ns.max_output is not None),
                ("--head-tail", ns.head_tail),
                ("--spill", ns.spill),
                ("--json", ns.json),
            ),
            "--pty",
            "the terminal shows the output as it comes (guestctl exec --detach --pty --spill keeps it in the guest)",
        )


def command_of(ns: argparse.Namespace) -> list[str] | str:
    if ns.cmd == "sh":
        return " ".join(ns.command)
    argv: list[str] = ns.argv[1:] if ns.argv[:1] == ["--"] else ns.argv
    if not argv:
        raise UsageError("give the command after --")
    return argv


async def run_command(client: AsyncClient, ns: argparse.Namespace) -> int:
    cmd = command_of(ns)
    refuse_flags_that_cannot_apply(ns)
    env = parse_env(ns.env)
    if ns.detach:
        return await start_detached(client, ns, cmd, env)
    if ns.pty:
        return await run_on_pty(client, ns, cmd, env)
    live = not (ns.json or ns.max_output is not None or ns.head_tail or ns.spill)
    return await show_run(start_exec(client, ns, cmd, env, live), ns, live, ExecResult.shell_exit_code, print_notes)


def print_notes(res: ExecResult) -> None:
    """After the output: where spilled output is, what a timeout did, why the tree died."""
    print_spills_and_timeout(res, "process tree killed")
    print_death(res.killed_by, res.oom_killed, res.signal)


def start_exec(
    client: AsyncClient, ns: argparse.Namespace, cmd: list[str] | str, env: dict[str, str], live: bool
) -> ExecStream:
    """The exec request: its output as events when ``live`` (else a bounded capture in the
    reply), stdin from INPUT frames with ``-i`` in both cases. Without ``--timeout`` nothing
    bounds the wait on this side (``tail -f`` runs until it ends or Ctrl-C); with one, the
    client's deadline follows from it."""
    return client.exec_stream(
        cmd,
        cwd=ns.cwd,
        env=env or None,
        stdin_stream=ns.stdin or None,
        timeout_s=ns.timeout,
        idle_timeout_s=ns.idle_timeout,
        max_output=ns.max_output,
        head_tail=ns.head_tail,
        on_timeout=ns.on_timeout,
        merge_stderr=ns.merge_stderr or None,
        spill=ns.spill or None,
        live=live,
        deadline=DERIVED if ns.timeout is not None else None,
    )


async def start_detached(client: AsyncClient, ns: argparse.Namespace, cmd: list[str] | str, env: dict[str, str]) -> int:
    """``exec --detach`` (``--pty`` too: on a terminal of this one's size): print the id."""
    size = local_size() if ns.pty else None
    p = await client.process_start(
        cmd,
        cwd=ns.cwd,
        env=env or None,
        stdin=ns.stdin or None,
        pty=ns.pty or None,
        rows=None if size is None else size.lines,
        cols=None if size is None else size.columns,
        ring_bytes=ns.max_output,
        merge_stderr=ns.merge_stderr or None,
        spill=ns.spill or None,
    )
    print_json({"id": p.id, "pid": p.pid}) if ns.json else print(field(p.id))
    return 0


class Timeouts:
    """``--timeout`` / ``--idle-timeout`` for a run guestd does not time itself (``exec --pty``
    is a background process): guestctl keeps the clocks. :meth:`expired` returns which fired."""

    def __init__(self, wall_s: float | None, idle_s: float | None) -> None:
        self.loop = asyncio.get_running_loop()
        self.wall_end = None if wall_s is None else self.loop.time() + wall_s
        self.idle_s = idle_s
        self.last_output = self.loop.time()

    def saw_output(self) -> None:
        self.last_output = self.loop.time()

    async def expired(self) -> str:
        while True:
            ends = []
            if self.wall_end is not None:
                ends.append((self.wall_end, "wall"))
            if self.idle_s is not None:
                ends.append((self.last_output + self.idle_s, "idle"))
            if not ends:
                await asyncio.Event().wait()  # no timeout: never
            end, which = min(ends)
            left = end - self.loop.time()
            if left <= 0:
                return which
            await asyncio.sleep(left)


async def run_on_pty(client: AsyncClient, ns: argparse.Namespace, cmd: list[str] | str, env: dict[str, str]) -> int:
    """``exec --pty``: a background process on a terminal of this one's size, this terminal
    bridged to it. A timeout ends it (TERM, KILL after :data:`PTY_KILL_GRACE_S`) or, with
    ``--on-timeout detach``, leaves it running; either way guestctl exits 124."""
    size = local_size()
    p = await client.process_start(cmd, cwd=ns.cwd, env=env or None, pty=True, rows=size.lines, cols=size.columns)
    process_id = p.id
    bridge = TerminalBridge(ns.raw)
    timeouts = Timeouts(ns.timeout, ns.idle_timeout)

    def on_input(data: bytes) -> None:
        if data:
            bridge.spawn(client.process_write(process_id, data))

    def on_resize(size: os.terminal_size) -> None:
        bridge.spawn(client.process_resize(process_id, size.lines, size.columns))

    fired: str | None = None
    with bridge.open(on_input, on_resize) as out:
        a = client.attach(process_id, deadline=None)  # a person is at the terminal

        async def follow() -> int:
            async for _, _, data in a:
                timeouts.saw_output()
                out.write(data)
            final = await a.result()
            return 128 + final.signal if final.signal is not None else final.exit_code or 0

        following = asyncio.ensure_future(follow())
        clock = asyncio.ensure_future(timeouts.expired())
        try:
            await asyncio.wait({following, clock}, return_when=asyncio.FIRST_COMPLETED)
            if not following.done():
                fired = clock.result()
                if ns.on_timeout == "detach":
                    a.cancel()
                    following.cancel()
                else:
                    await end_process(client, process_id, following)
        finally:
            clock.cancel()
            if not following.done():
                following.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await following
    if fired is None:
        return following.result()
    if ns.on_timeout == "detach":
        print(
            f"guestctl: {fired} timeout fired; the command goes on as process {field(process_id)}"
            f" (guestctl attach {field(process_id)})",
            file=sys.stderr,
        )
    else:
        print(f"guestctl: {fired} timeout fired; process tree killed", file=sys.stderr)
    return 124


async def end_process(client: AsyncClient, process_id: str, exited: asyncio.Future[int]) -> None:
    """TERM to the process group, KILL (the group and what left it) if it has not exited after
    the grace; a process that exits meanwhile makes the signal's not_found harmless."""
    with contextlib.suppress(GuestdError):
        await client.process_signal(process_id, "TERM")
    try:
        await asyncio.wait_for(asyncio.shield(exited), PTY_KILL_GRACE_S)
    except TimeoutError:
        with contextlib.suppress(GuestdError):
            await client.process_signal(process_id, "KILL")
        await exited
