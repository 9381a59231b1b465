"""guestctl shell new | run | ls | rm: persistent bash sessions."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from guestd.cli.runs import run_kept
from guestd.cli.shared import (
    Subcommands,
    add_command,
    json_path,
    parse_env,
    print_death,
    print_json,
    print_spills_and_timeout,
)
from guestd.cli.terminal import field, write_output
from guestd.client.aio import AsyncClient, present
from guestd.wire.paths import printable_path


def register(sub: Subcommands) -> None:
    shell = sub.add_parser("shell", help="persistent bash sessions").add_subparsers(dest="shell_cmd", required=True)
    snew = add_command(shell, "new", create, help="create a session; prints its id")
    snew.add_argument("--cwd", default=None)
    snew.add_argument("--env", action="append", default=[], metavar="K=V")
    snew.add_argument("--name", default=None)
    srun = add_command(shell, "run", run_in_session, help="run COMMAND in session ID")
    srun.add_argument("id")
    srun.add_argument("command")
    srun.add_argument("--timeout", type=float, default=None, help="wall-clock timeout in the guest, seconds")
    srun.add_argument("--idle-timeout", type=float, default=None, help="no-output timeout in the guest, seconds")
    srun.add_argument("--max-output", type=int, default=None)
    srun.add_argument("--stdin", action="store_true", help="send local stdin as the command's input")
    srun.add_argument(
        "--on-timeout",
        choices=("kill", "detach"),
        default=None,
        help="detach: a timeout leaves the command running as a background process (prints its id)",
    )
    srun.add_argument("--merge-stderr", action="store_true", help="stderr into stdout, in write order")
    srun.add_argument("--check-syntax", action="store_true", help="bash -n first; nothing runs on a syntax error")
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
    print_json(s) if ns.json else print(field(s["id"]))
    return 0


async def list_sessions(client: AsyncClient, ns: argparse.Namespace) -> int:
    sessions = await client.shell_list()
    if ns.json:
        print_json({"sessions": [json_path(s, "cwd") for s in sessions]})
    else:
        for s in sessions:
            cwd = field(printable_path(s["cwd"]))
            name = field(s.get("name") or "-")
            print(f"{field(s['id'])}  {name:12} pid {s['pid']:<8} {cwd}  ({s['commands']} commands)")
    return 0


async def close(client: AsyncClient, ns: argparse.Namespace) -> int:
    await client.shell_close(ns.id)
    return 0


async def run_in_session(client: AsyncClient, ns: argparse.Namespace) -> int:
    if ns.pty:
        return await run_on_pty(client, ns)
    stdin = sys.stdin.buffer.read() if ns.stdin else None
    options: dict[str, Any] = {  # shell_run's keywords are the request's field names
        "input": stdin,
        "timeout_s": ns.timeout,
        "idle_timeout_s": ns.idle_timeout,
        "max_output": ns.max_output,
        "on_timeout": ns.on_timeout,
        "merge_stderr": ns.merge_stderr or None,
        "check_syntax": ns.check_syntax or None,
        "spill": ns.spill or None,
    }
    if ns.keep:
        return await run_kept(client, ns, "shell.run", present(id=ns.id, command=ns.command, **options))
    res = await client.shell_run(ns.id, ns.command, **options)
    if ns.json:
        print_json(res.to_json())
    else:
        write_output(res.stdout, res.stderr, ns.raw)
        print_spills_and_timeout(res, "command interrupted")
        print_death(res.killed_by, res.oom_killed)
        if res.session_restarted:
            print("guestctl: the session had to be restarted (cwd and exported variables kept)", file=sys.stderr)
    if res.timed_out:
        return 124
    return res.exit_code if res.exit_code is not None else 1


async def run_on_pty(client: AsyncClient, ns: argparse.Namespace) -> int:
    """``shell run --pty``: the command on a terminal in the session, this terminal bridged
    to it (raw mode, modes put back however it ends). Typed ^C and ^\\ become INT and QUIT
    for the command's process group (its terminal raises no signals itself); the end of a
    piped stdin is ^D."""
    from guestd.cli.bridge import TerminalBridge, local_size

    size = local_size()
    s = client.shell_stream(
        ns.id,
        ns.command,
        pty=True,
        rows=size.lines,
        cols=size.columns,
        timeout_s=ns.timeout,
        idle_timeout_s=ns.idle_timeout,
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
    if ns.json:
        print_json(res.to_json())
    if res.timed_out:
        return 124
    return res.exit_code if res.exit_code is not None else 1
