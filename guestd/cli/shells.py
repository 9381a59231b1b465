"""guestctl shell new | run | ls | rm: persistent bash sessions (``shell run COMMAND`` without an
id runs in the session named ``default``, made on first use, as ``code run`` has its default
context)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TypedDict

from guestd.cli.live import show_run
from guestd.cli.runs import run_kept
from guestd.cli.shared import (
    Subcommands,
    UsageError,
    add_command,
    parse_env,
    print_death,
    print_json,
    print_listing,
    print_spills_and_timeout,
    refuse_flags,
)
from guestd.cli.terminal import field
from guestd.client.aio import AsyncClient, ShellStream, present
from guestd.client.params import OnTimeout
from guestd.client.replies import ShellInfo
from guestd.client.results import ShellResult
from guestd.client.streaming import DERIVED
from guestd.wire.errors import GuestdError
from guestd.wire.paths import printable_path


def register(sub: Subcommands) -> None:
    shell = sub.add_parser("shell", help="persistent bash sessions").add_subparsers(dest="shell_cmd", required=True)
    snew = add_command(shell, "new", create, aliases=["create"], help="create a session; prints its id")
    snew.add_argument("-w", "--cwd", default=None)
    snew.add_argument("-e", "--env", action="append", default=[], metavar="K=V", help="K=V, or K: this K's value")
    snew.add_argument("--name", default=None)
    srun = add_command(
        shell, "run", run_in_session, help="run COMMAND in session ID (default: the session 'default', made on use)"
    )
    srun.add_argument("words", nargs="+", metavar="[ID] COMMAND")
    srun.add_argument("--timeout", type=float, default=None, help="wall-clock timeout in the guest, seconds")
    srun.add_argument("--idle-timeout", type=float, default=None, help="no-output timeout in the guest, seconds")
    srun.add_argument(
        "--max-output",
        type=int,
        default=None,
        help="keep at most this many bytes per stream, printed when the command ends (default: all of the "
        "output, as it comes)",
    )
    srun.add_argument(
        "-i",
        "--stdin",
        action="store_true",
        help="send local stdin to the command as it is read, its end closing the command's stdin "
        "(--keep: read whole first; --pty: always so)",
    )
    srun.add_argument(
        "--on-timeout",
        choices=("kill", "detach"),
        default=None,
        help="detach: a timeout leaves the command running as a background process (prints its id)",
    )
    srun.add_argument("--merge-stderr", action="store_true", help="stderr into stdout, in write order")
    srun.add_argument(
        "--check-syntax",
        action="store_true",
        help="bash -n first; nothing runs on a syntax error",
    )
    srun.add_argument(
        "--pty",
        action="store_true",
        help="run on a terminal in the session's state, bridged to this one (^C interrupts the command)",
    )
    srun.add_argument("--keep", action="store_true", help="the run outlives guestctl; prints its run id")
    srun.add_argument("--spill", action="store_true", help="full output also to files in the guest (named)")
    add_command(shell, "ls", list_sessions, help="list sessions")
    add_command(shell, "rm", close, help="end a session").add_argument("id")


async def create(client: AsyncClient, ns: argparse.Namespace) -> int:
    s = await client.shell_create(cwd=ns.cwd, env=parse_env(ns.env) or None, name=ns.name)
    print_json({"id": s.id, "pid": s.pid}) if ns.json else print(field(s.id))
    return 0


async def list_sessions(client: AsyncClient, ns: argparse.Namespace) -> int:
    return print_listing(ns, "sessions", await client.shell_list(), session_line)


def session_line(s: ShellInfo) -> str:
    cwd, name = field(printable_path(s.cwd)), field(s.name or "-")
    return f"{field(s.id)}  {name:12} pid {s.pid:<8} {cwd}  ({s.commands} commands)"


async def close(client: AsyncClient, ns: argparse.Namespace) -> int:
    await client.shell_close(ns.id)
    print_json({}) if ns.json else None
    return 0


DEFAULT_SESSION = "default"


async def session_and_command(client: AsyncClient, ns: argparse.Namespace) -> None:
    """``shell run ID COMMAND`` or ``shell run COMMAND`` (the session named ``default``, made
    here on first use): sets ``ns.id`` and ``ns.command``."""
    if len(ns.words) > 2:
        raise UsageError("give [ID] 'COMMAND': quote the command as one argument")
    if len(ns.words) == 2:
        ns.id, ns.command = ns.words
        return
    ns.id, ns.command = DEFAULT_SESSION, ns.words[0]
    try:
        await client.shell_create(name=DEFAULT_SESSION)
    except GuestdError as err:
        if err.code != "exists":  # made by an earlier run: used as it is
            raise


async def run_in_session(client: AsyncClient, ns: argparse.Namespace) -> int:
    """Live by default (output as it comes, all of it); ``--max-output``, ``--spill`` and
    ``--json`` keep a bounded capture, printed at the end. ``-i`` sends stdin as it is read
    (``--keep``: read whole first, a kept run takes no stdin stream)."""
    await session_and_command(client, ns)
    if ns.pty:
        return await run_on_pty(client, ns)
    if ns.keep:
        options = present(input=sys.stdin.buffer.read() if ns.stdin else None, **run_flags(ns))
        return await run_kept(client, ns, "shell.run", {"id": ns.id, "command": ns.command, **options})
    live = not (ns.json or ns.max_output is not None or ns.spill)
    return await show_run(start_shell_run(client, ns, live), ns, live, shell_exit_code, print_run_notes)


def start_shell_run(client: AsyncClient, ns: argparse.Namespace, live: bool) -> ShellStream:
    """The shell.run request: output as events when ``live`` (else a bounded capture in the
    reply), stdin from INPUT frames with ``-i``. Without ``--timeout`` nothing bounds the wait
    on this side (the command runs until it ends or Ctrl-C)."""
    return client.shell_stream(
        ns.id,
        ns.command,
        stdin_stream=ns.stdin or None,
        live=live,
        deadline=DERIVED if ns.timeout is not None else None,
        **run_flags(ns),
    )


class RunFlags(TypedDict):
    """The shell.run fields ``shell run``'s flags set, alike for a kept and a streamed run."""

    timeout_s: float | None
    idle_timeout_s: float | None
    max_output: int | None
    on_timeout: OnTimeout | None
    merge_stderr: bool | None
    check_syntax: bool | None
    spill: bool | None


def run_flags(ns: argparse.Namespace) -> RunFlags:
    return {
        "timeout_s": ns.timeout,
        "idle_timeout_s": ns.idle_timeout,
        "max_output": ns.max_output,
        "on_timeout": ns.on_timeout,
        "merge_stderr": ns.merge_stderr or None,
        "check_syntax": ns.check_syntax or None,
        "spill": ns.spill or None,
    }


def print_run_notes(res: ShellResult) -> None:
    print_spills_and_timeout(res, "command interrupted")
    print_death(res.killed_by, res.oom_killed)
    if res.session_restarted:
        print("guestctl: the session had to be restarted (cwd and exported variables kept)", file=sys.stderr)


def shell_exit_code(res: ShellResult) -> int:
    if res.timed_out:
        return 124
    return res.exit_code if res.exit_code is not None else 1


def refuse_flags_beside_pty(ns: argparse.Namespace) -> None:
    """``shell run --pty``: the flags that have no meaning on a terminal are usage errors."""
    refuse_flags(
        (
            ("--max-output", ns.max_output is not None),
            ("--spill", ns.spill),
            ("--keep", ns.keep),
            ("--check-syntax", ns.check_syntax),
            ("--on-timeout detach", ns.on_timeout == "detach"),
            ("--json", ns.json),
        ),
        "--pty",
        "the terminal shows the output as it comes",
    )


async def run_on_pty(client: AsyncClient, ns: argparse.Namespace) -> int:
    """``shell run --pty``: the command on a terminal in the session, this terminal bridged
    to it (raw mode, modes put back however it ends). Typed ^C and ^\\ become INT and QUIT
    for the command's process group (its terminal raises no signals itself); the end of a
    piped stdin is ^D."""
    from guestd.cli.bridge import TerminalBridge, local_size

    refuse_flags_beside_pty(ns)
    size = local_size()
    s = client.shell_stream(
        ns.id,
        ns.command,
        pty=True,
        rows=size.lines,
        cols=size.columns,
        timeout_s=ns.timeout,
        idle_timeout_s=ns.idle_timeout,
        on_timeout=ns.on_timeout,
        merge_stderr=ns.merge_stderr or None,  # a terminal merges them anyway
        deadline=DERIVED if ns.timeout is not None else None,  # a person is at the terminal
    )
    bridge = TerminalBridge(ns.raw)
    keys = {0x03: "INT", 0x1C: "QUIT"}

    def on_input(data: bytes) -> None:
        if not data:
            bridge.spawn(s.close_stdin())
            return
        start = 0
        for i, b in enumerate(data):
            if bridge.interactive and b in keys:
                if data[start:i]:
                    bridge.spawn(s.write_stdin(data[start:i]))
                bridge.spawn(s.signal(keys[b]))
                start = i + 1
        if data[start:]:
            bridge.spawn(s.write_stdin(data[start:]))

    def on_resize(size: os.terminal_size) -> None:
        bridge.spawn(client.shell_resize(ns.id, size.lines, size.columns))

    with bridge.open(on_input, on_resize) as out:
        async for _, data in s:
            out.write(data)
        res = await s.result()
    return shell_exit_code(res)
