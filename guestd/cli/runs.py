"""guestctl runs ls | get ID | wait ID | cancel ID: kept runs (``shell run --keep``, ``code run --keep``)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from guestd.cli import terminal
from guestd.cli.shared import Subcommands, add_command, jsonable, print_json, print_listing
from guestd.cli.terminal import field
from guestd.client.aio import AsyncClient
from guestd.client.replies import RunInfo
from guestd.client.results import CodeResult, ShellResult
from guestd.client.runs import result_of, start_kept
from guestd.wire.errors import GuestdError


def register(sub: Subcommands) -> None:
    runs = sub.add_parser("runs", help="kept runs (--keep)").add_subparsers(dest="runs_cmd", required=True)
    add_command(runs, "ls", list_runs, help="every kept run")
    add_command(runs, "get", get_run, help="a kept run and its result").add_argument("id")
    w = add_command(runs, "wait", get_run, help="wait for a kept run, then its result")
    w.add_argument("id")
    w.add_argument("--timeout", type=float, default=None, help="how long the guest waits, seconds (default 30)")
    c = add_command(runs, "cancel", get_run, help="interrupt a running kept run, then the run")
    c.add_argument("id")
    c.add_argument("--timeout", type=float, default=None, help="how long the guest waits for it to end (default 10)")


async def list_runs(client: AsyncClient, ns: argparse.Namespace) -> int:
    return print_listing(ns, "runs", await client.run_list(), run_line)


def run_line(r: RunInfo) -> str:
    return f"{field(r.id)}  {r.op:9} {r.state:8} {field(r.target)}  {terminal.text(r.what)[:60]}"


async def run_kept(client: AsyncClient, ns: argparse.Namespace, op: str, args: dict[str, Any]) -> int:
    """``--keep``: the run id on stderr as soon as the guest keeps the run (it goes on if
    guestctl is stopped), then its result as ``runs wait`` gives it."""
    rid = await start_kept(client, op, args)
    print(f"guestctl: kept as run {field(rid)} (guestctl runs get {field(rid)})", file=sys.stderr)
    sys.stderr.flush()
    run = await client.run_wait(rid)
    while run.state == "running":
        run = await client.run_wait(rid)
    return show_run(run, ns)


async def get_run(client: AsyncClient, ns: argparse.Namespace) -> int:
    """Exit status: the run's (as ``shell run`` / ``code run`` would exit), 124 still running."""
    if ns.runs_cmd == "wait":
        run = await client.run_wait(ns.id, timeout_s=ns.timeout)
    elif ns.runs_cmd == "cancel":
        run = await client.run_cancel(ns.id, timeout_s=ns.timeout)
    else:
        run = await client.run_get(ns.id)
    return show_run(run, ns)


def show_run(run: RunInfo, ns: argparse.Namespace) -> int:
    """The run as guestctl reports it. Exit: the run's own (as ``shell run``/``code run``); 124
    while it still runs (``runs wait``/``cancel``: their --timeout passed first, said on stderr);
    ``runs cancel`` 0 once the cancel ended it; 1 for a run that failed otherwise."""
    verb = getattr(ns, "runs_cmd", None)  # None: shell run --keep / code run --keep
    waited = verb in ("wait", "cancel")
    if run.state == "running":
        if ns.json:
            print_json({**jsonable(run), "timed_out": "wall" if waited else None})
        elif waited:
            did = "end" if verb == "wait" else "end after the cancel"
            print(
                f"guestctl: run {field(run.id)} did not {did} within the --timeout; it is still running",
                file=sys.stderr,
            )
        else:
            print(f"guestctl: run {field(run.id)} is still running", file=sys.stderr)
        return 124
    try:
        res = result_of(run)
    except GuestdError as e:
        cancelled = verb == "cancel" and e.code == "cancelled"
        if ns.json:
            print_json({**jsonable(run), "timed_out": None})
        elif cancelled:
            print(f"guestctl: run {field(run.id)} cancelled", file=sys.stderr)
        else:
            print(f"guestctl: run failed: {e.code}: {field(e.message)}", file=sys.stderr)
        return 0 if cancelled else 1
    if ns.json:
        print_json({**jsonable(run), "result": res, "timed_out": None})
    else:
        terminal.write_output(res.stdout, res.stderr, ns.raw)
        if isinstance(res, CodeResult):
            text = res.text
            if text is not None:
                print(terminal.text(text))
    if isinstance(res, ShellResult):
        return 124 if res.timed_out else (res.exit_code if res.exit_code is not None else 1)
    return 0 if res.status == "ok" else 1
