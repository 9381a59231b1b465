"""guestctl ps | attach | kill | wait: background processes (started by ``exec --detach`` or
``exec --pty``, whose start and terminal bridge live here too)."""

from __future__ import annotations

import argparse
import os
import sys

from guestd.cli import terminal
from guestd.cli.bridge import TerminalBridge, local_size
from guestd.cli.shared import Subcommands, add_command, exit_code_of, print_death, print_json
from guestd.cli.terminal import field
from guestd.client.aio import AsyncClient
from guestd.client.replies import ProcessWaitResult


def register(sub: Subcommands) -> None:
    add_command(sub, "ps", list_processes, help="list background processes")
    at = add_command(sub, "attach", attach, help="stream a background process's output")
    at.add_argument("id")
    at.add_argument("--from", dest="offset", type=int, default=0, help="stdout offset to start from")
    at.add_argument("--stderr-from", type=int, default=0)
    at.add_argument("--no-follow", action="store_true", help="print what is buffered and return")
    k = add_command(sub, "kill", kill, help="signal a background process group")
    k.add_argument("id")
    k.add_argument("signal", nargs="?", default="TERM")
    w = add_command(sub, "wait", wait, help="wait for a background process to exit")
    w.add_argument("id")
    w.add_argument("--timeout", type=float, default=None, help="the guest answers timed out after this, seconds")


async def list_processes(client: AsyncClient, ns: argparse.Namespace) -> int:
    procs = await client.process_list()
    if ns.json:
        print_json({"processes": procs})
    else:
        for p in procs:
            status = (
                p.state if p.state == "running" else f"exit {p.exit_code}" if p.signal is None else f"signal {p.signal}"
            )
            command = field(p.command[:60])
            print(f"{field(p.id)}  pid {p.pid:<8} {status:12} out {p.stdout_offset:<10} {command}")
    return 0


async def kill(client: AsyncClient, ns: argparse.Namespace) -> int:
    await client.process_signal(ns.id, ns.signal)
    return 0


async def wait(client: AsyncClient, ns: argparse.Namespace) -> int:
    res = await client.process_wait(ns.id, timeout_s=ns.timeout)
    if ns.json:
        print_json(res)
    else:
        print_death(res.killed_by, res.oom_killed, res.signal)
        print_ring_spills(res)
    if res.timed_out:
        return 124
    return exit_code_of(res)


def print_ring_spills(res: ProcessWaitResult) -> None:
    """exec --detach --spill: where the bytes a ring no longer holds can be read."""
    for spill, start, name in (
        (res.stdout_spill, res.stdout_ring_start, "stdout"),
        (res.stderr_spill, res.stderr_ring_start, "stderr"),
    ):
        if spill is not None and start is not None and (start or spill.stopped):
            stopped = f", stopped: {field(str(spill.stopped))}" if spill.stopped else ""
            print(
                f"guestctl: {name} before offset {start} is no longer in the ring; the full {name} is in "
                f"{field(spill.path)} ({spill.bytes} bytes{stopped})",
                file=sys.stderr,
            )


async def attach(client: AsyncClient, ns: argparse.Namespace) -> int:
    # A person or a script follows a process for as long as it runs: no overall deadline.
    a = client.attach(ns.id, stdout_from=ns.offset, stderr_from=ns.stderr_from, follow=not ns.no_follow, deadline=None)
    out, err = terminal.stdout(ns.raw), terminal.stderr(ns.raw)
    try:
        async for name, offset, data in a:
            if name == "lost":
                print(f"guestctl: output before offset {offset} was overwritten in the ring", file=sys.stderr)
            elif name == "stderr":
                err.write(data)
            else:
                out.write(data)
    finally:
        out.close()
        err.close()
    final = await a.result()
    if ns.json:
        print_json(final)
    else:
        print(
            f"guestctl: {final.state}; reattach with --from {final.stdout_offset} --stderr-from {final.stderr_offset}",
            file=sys.stderr,
        )
    if final.state == "running":
        return 0
    return exit_code_of(final)


async def start_process(client: AsyncClient, ns: argparse.Namespace, cmd: list[str] | str, env: dict[str, str]) -> int:
    """``exec --detach`` (print the new process's id) or ``exec --pty`` (bridge this terminal to it)."""
    if not ns.pty:
        p = await client.process_start(cmd, cwd=ns.cwd, env=env or None, stdin=ns.stdin, spill=ns.spill or None)
        print_json(p.info) if ns.json else print(field(p.id))
        return 0
    size = local_size()
    p = await client.process_start(cmd, cwd=ns.cwd, env=env or None, pty=True, rows=size.lines, cols=size.columns)
    return await attach_terminal(client, p.id, detach_ok=ns.detach, raw=ns.raw)


async def attach_terminal(client: AsyncClient, process_id: str, detach_ok: bool, raw: bool = False) -> int:
    """Local terminal <-> remote pty (:class:`guestd.cli.bridge.TerminalBridge`). What the remote
    program writes goes through the pty filter of ``guestd.cli.terminal`` unless ``raw``."""
    bridge = TerminalBridge(raw)

    def on_input(data: bytes) -> None:
        if data:
            bridge.spawn(client.process_write(process_id, data))

    def on_resize(size: os.terminal_size) -> None:
        bridge.spawn(client.process_resize(process_id, size.lines, size.columns))

    with bridge.open(on_input, on_resize) as out:
        a = client.attach(process_id, deadline=None)  # a person is at the terminal
        async for _, _, data in a:
            out.write(data)
        final = await a.result()
    return exit_code_of(final)
