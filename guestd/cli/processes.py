"""guestctl ps [rm | prune] | attach | kill | wait: background processes (started by
``exec --detach``; ``exec --pty`` bridges a terminal to one, in guestd.cli.exec)."""

from __future__ import annotations

import argparse
import sys

from guestd.cli import terminal
from guestd.cli.shared import (
    Subcommands,
    add_command,
    exit_code_of,
    jsonable,
    print_death,
    print_json,
    print_listing,
)
from guestd.cli.terminal import field
from guestd.client.aio import AsyncClient, Attach
from guestd.client.replies import ProcessWaitResult


def register(sub: Subcommands) -> None:
    ps = add_command(sub, "ps", list_processes, help="list background processes (ps rm ID..., ps prune)")
    ps_sub = ps.add_subparsers(dest="ps_cmd", required=False)
    add_command(ps_sub, "ls", list_processes, help="list background processes (the default)")
    add_command(ps_sub, "rm", forget, help="drop finished processes and their output").add_argument("ids", nargs="+")
    add_command(ps_sub, "prune", prune, help="drop every finished process and its output")
    at = add_command(sub, "attach", attach, help="stream a background process's output")
    at.add_argument("id")
    at.add_argument("--from", dest="offset", type=int, default=0, help="stdout offset to start from")
    at.add_argument("--stderr-from", type=int, default=0)
    at.add_argument("--no-follow", action="store_true", help="print what is buffered and return")
    k = add_command(sub, "kill", kill, help="signal a background process group")
    k.add_argument("id")
    k.add_argument("signal", nargs="?", default="TERM", help="a name (TERM, KILL, INT...) or number")
    w = add_command(sub, "wait", wait, help="wait for a background process to exit")
    w.add_argument("id")
    w.add_argument("--timeout", type=float, default=None, help="the guest answers timed out after this, seconds")


PS_HEADER = f"{'ID':14} {'PID':>8}  {'STATUS':12} {'OUTPUT':>10}  COMMAND"


async def list_processes(client: AsyncClient, ns: argparse.Namespace) -> int:
    procs = await client.process_list()
    if ns.json:
        print_json({"processes": procs})
        return 0
    print(PS_HEADER)
    for p in procs:
        status = (
            p.state if p.state == "running" else f"exit {p.exit_code}" if p.signal is None else f"signal {p.signal}"
        )
        print(f"{field(p.id):14} {p.pid:>8}  {status:12} {p.stdout_offset:>10}  {field(p.command[:60])}")
    return 0


async def forget(client: AsyncClient, ns: argparse.Namespace) -> int:
    """``ps rm ID...``: each one dropped (a running one is refused by the guest: kill it first)."""
    for process_id in ns.ids:
        await client.process_forget(process_id)
    print_json({}) if ns.json else None
    return 0


async def prune(client: AsyncClient, ns: argparse.Namespace) -> int:
    """``ps prune``: every process that has exited dropped; the ids, one a line."""
    gone = [p.id for p in await client.process_list() if p.state != "running"]
    for process_id in gone:
        await client.process_forget(process_id)
    return print_listing(ns, "ids", gone, field)


async def kill(client: AsyncClient, ns: argparse.Namespace) -> int:
    await client.process_signal(ns.id, ns.signal)
    print_json({}) if ns.json else None
    return 0


async def wait(client: AsyncClient, ns: argparse.Namespace) -> int:
    """The exit status; 124 (and what did not happen, on stderr) when ``--timeout`` passed first."""
    res = await client.process_wait(ns.id, timeout_s=ns.timeout)
    if ns.json:
        # timed_out as everywhere else: the kind that fired (the wait's wall clock), or null.
        print_json({**jsonable(res), "timed_out": "wall" if res.timed_out else None})
    else:
        print_death(res.killed_by, res.oom_killed, res.signal)
        print_ring_spills(res)
        if res.timed_out:
            print(
                f"guestctl: process {field(ns.id)} did not exit within {ns.timeout} s; it is still running",
                file=sys.stderr,
            )
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
    if ns.json:
        return await attach_json_lines(a)
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
    print(
        f"guestctl: {final.state}; reattach with --from {final.stdout_offset} --stderr-from {final.stderr_offset}",
        file=sys.stderr,
    )
    if final.state == "running":
        return 0
    return exit_code_of(final)


async def attach_json_lines(a: Attach) -> int:
    """``attach --json``: JSON Lines, one ``{"ev": "stdout"|"stderr", "offset", "data"}`` per chunk
    (``{"ev": "lost", "offset"}`` where the ring had overwritten output), then ``{"ev": "end", ...}``
    with the process's state."""
    async for name, offset, data in a:
        print_json({"ev": name, "offset": offset} if name == "lost" else {"ev": name, "offset": offset, "data": data})
    final = await a.result()
    print_json({"ev": "end", **jsonable(final)})
    return 0 if final.state == "running" else exit_code_of(final)
