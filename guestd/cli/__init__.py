"""guestctl: drive a guestd from a shell or script.

    guestctl --connect ADDR [--json] ping | info
    guestctl ... exec [--timeout S] [--idle-timeout S] [--cwd D] [--env K=V]... [--max-output N] -- ARGV...
    guestctl ... sh 'COMMAND'
    guestctl ... cp SRC DST          (the guest side is written :PATH)
    guestctl ... cat :PATH | ls :PATH | rm [-r] :PATH
    guestctl ... code new | run [--context ID] [--timeout S] CODE | ls | interrupt ID | restart ID | rm ID
    guestctl ... exec --detach -- ARGV... | exec --pty -- ARGV...
    guestctl ... ps | attach ID [--from OFFSET] | kill ID [SIGNAL] | wait ID
    guestctl ... shell new | shell run ID 'COMMAND' | shell ls | shell rm ID
    guestctl ... port-forward [--address ADDR] LOCAL:GUEST | port-forward --reverse GUEST_PORT:HOST:HOSTPORT
    guestctl ... ports | port-wait GUEST_PORT [--timeout S] [--http] [--path P]

exec/sh exit with the remote exit code (124 when a timeout fired, 128+N when killed by signal N);
port-wait exits 0 once the port answers, 124 when it did not in time. port-forward runs until
SIGINT/SIGTERM and prints the address it listens on first.
--timeout/--idle-timeout are enforced in the guest (the ops' timeout_s/idle_timeout_s; for wait,
how long the guest waits for the exit); guestctl's own wait for the reply is derived from them
(the client's deadline). --connect-timeout bounds connecting and the handshake.

One module per capability (system, exec, files, processes, shells, snapshot, code, ports), mirroring the
daemon's; each registers its subcommands with their handlers, so a new command touches one module.
This one holds the connection options and ``main``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from guestd.cli import code, files, ports, processes, shells, snapshot, system
from guestd.cli import exec as exec_  # the module; plain "exec" would hide the builtin here
from guestd.cli.shared import Handler, print_json
from guestd.client.aio import CONNECT_TIMEOUT, AsyncClient
from guestd.wire.errors import GuestdError

__all__ = ["build_parser", "main", "run"]

DEFAULT_CONNECT = "unix:/run/guestd/guestd.sock"
# The order of ``guestctl --help``.
COMMAND_MODULES = (system, exec_, files, processes, shells, snapshot, code, ports)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="guestctl", description="Talk to a guestd.")
    p.add_argument(
        "--connect",
        default=os.environ.get("GUESTD_CONNECT", DEFAULT_CONNECT),
        help="unix:PATH, vsock:CID:PORT or fc:UDS_PATH:PORT (env GUESTD_CONNECT)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--token", default=os.environ.get("GUESTD_TOKEN"), help="access token (env GUESTD_TOKEN)")
    p.add_argument("--connect-timeout", type=float, default=CONNECT_TIMEOUT, help="connect + handshake, seconds")
    sub = p.add_subparsers(dest="cmd", required=True)
    for module in COMMAND_MODULES:
        module.register(sub)
    return p


async def run(ns: argparse.Namespace) -> int:
    """Connect, run the parsed command's handler, close; the command's exit code."""
    handler: Handler = ns.handler
    client = await AsyncClient.connect(ns.connect, connect_timeout=ns.connect_timeout, token=ns.token)
    try:
        return await handler(client, ns)
    finally:
        await client.close()


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return asyncio.run(run(ns))
    except GuestdError as err:
        if ns.json:
            print_json({"error": err.to_body()})
        else:
            print(f"guestctl: error [{err.code}]: {err.message}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:
        if ns.json:
            print_json({"error": {"code": "client_error", "message": str(exc)}})
        else:
            print(f"guestctl: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
