"""guestctl exec | sh: run a command and exit with its exit code (124 when a timeout fired,
128+N when killed by signal N); ``--detach`` and ``--pty`` start a background process instead."""

from __future__ import annotations

import argparse
import sys

from guestd.cli import terminal
from guestd.cli.processes import start_process
from guestd.cli.shared import Subcommands, add_command, parse_env, print_death, print_json, print_spills_and_timeout
from guestd.client.aio import AsyncClient
from guestd.client.results import ExecResult


def register(sub: Subcommands) -> None:
    for name in ("exec", "sh"):
        e = add_command(sub, name, run_command, help="run ARGV" if name == "exec" else "run a /bin/sh -c command")
        e.add_argument("--timeout", type=float, default=None, help="wall-clock timeout in the guest, seconds")
        e.add_argument("--idle-timeout", type=float, default=None, help="no-output timeout in the guest, seconds")
        e.add_argument("--cwd", default=None)
        e.add_argument("--env", action="append", default=[], metavar="K=V")
        e.add_argument("--max-output", type=int, default=None, help="bytes kept per stream")
        e.add_argument("--head-tail", action="store_true", help="keep both ends of long output")
        e.add_argument("--stdin", action="store_true", help="send local stdin to the command")
        e.add_argument("--detach", action="store_true", help="start in the background; print its process id")
        e.add_argument("--pty", action="store_true", help="run on a pseudo-terminal attached to this terminal")
        e.add_argument(
            "--on-timeout",
            choices=("kill", "detach"),
            default=None,
            help="detach: a timeout leaves the command running as a background process (prints its id)",
        )
        e.add_argument("--merge-stderr", action="store_true", help="stderr into stdout, in write order")
        e.add_argument(
            "--spill", action="store_true", help="full output also to files in the guest (named; --detach: by wait)"
        )
        if name == "exec":
            e.add_argument("argv", nargs=argparse.REMAINDER, help="-- PROGRAM ARGS...")
        else:
            e.add_argument("command")


async def run_command(client: AsyncClient, ns: argparse.Namespace) -> int:
    if ns.cmd == "exec":
        argv = ns.argv[1:] if ns.argv[:1] == ["--"] else ns.argv
        if not argv:
            raise SystemExit("guestctl exec: give the command after --")
        cmd: list[str] | str = argv
    else:
        cmd = ns.command
    env = parse_env(ns.env)
    if ns.detach or ns.pty:
        return await start_process(client, ns, cmd, env)
    stdin = sys.stdin.buffer.read() if ns.stdin else None
    res = await client.exec(
        cmd,
        cwd=ns.cwd,
        env=env or None,
        stdin=stdin,
        timeout_s=ns.timeout,
        idle_timeout_s=ns.idle_timeout,
        max_output=ns.max_output,
        head_tail=ns.head_tail,
        on_timeout=ns.on_timeout,
        merge_stderr=ns.merge_stderr or None,
        spill=ns.spill or None,
    )
    if ns.json:
        print_json(res.to_json())
    else:
        print_exec_result(res, ns.raw)
    return res.shell_exit_code()


def print_exec_result(res: ExecResult, raw: bool) -> None:
    """The output as the command wrote it, then guestctl's notes on truncation and timeouts."""
    terminal.write_output(res.stdout, res.stderr, raw)
    for name, dropped in (("stdout", res.stdout_dropped), ("stderr", res.stderr_dropped)):
        if dropped:
            print(
                f"guestctl: {name} truncated: {dropped} of {getattr(res, name + '_bytes')} bytes dropped",
                file=sys.stderr,
            )
    print_spills_and_timeout(res, "process tree killed")
    print_death(res.killed_by, res.oom_killed, res.signal)
    sys.stderr.flush()
