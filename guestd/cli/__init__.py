"""guestctl: drive a guestd from a shell or script.

    guestctl --connect ADDR [--json] ping | info
    guestctl ... exec [--timeout S] [--idle-timeout S] [--cwd D] [--env K=V]... [--max-output N] -- ARGV...
    guestctl ... sh 'COMMAND'
    guestctl ... cp SRC DST          (the guest side is written :PATH)
    guestctl ... cat :PATH | ls :PATH | rm [-r] :PATH
    guestctl ... code new [--kernel K] | run [--context ID] [--timeout S] CODE | ls | interrupt ID | restart ID | rm ID
    guestctl ... exec --detach -- ARGV... | exec --pty -- ARGV...
    guestctl ... ps | attach ID [--from OFFSET] | kill ID [SIGNAL] | wait ID
    guestctl ... shell new | shell run ID 'COMMAND' | shell ls | shell rm ID
    guestctl ... port-forward [--address ADDR] LOCAL:GUEST | port-forward --reverse GUEST_PORT:HOST:HOSTPORT
    guestctl ... ports | port-wait GUEST_PORT [--timeout S] [--http] [--path P]
    guestctl ... cp -r DIR :DIR | cp -r :DIR DIR | find :DIR --glob PATTERN | grep [-i] [-F] [--glob G] PATTERN :DIR
    guestctl ... view :PATH [--lines A:B] | edit :PATH --old TEXT --new TEXT | edit :PATH --undo
    guestctl ... apply-patch :DIR < PATCH | watch :DIR (JSON lines)
    guestctl ... metrics [--watch S] | top [--interval S] [--once]

exec/sh exit with the remote exit code (124 when a timeout fired, 128+N when killed by signal N);
port-wait exits 0 once the port answers, 124 when it did not in time. port-forward runs until
SIGINT/SIGTERM and prints the address it listens on first.
Exit codes of guestctl itself: 0 done; 1 any failure (an error from the guest, a broken or hostile
guest, the connection, a local file), reported as one line on stderr (under --json, as one JSON
object ``{"error": {"code", "message", ...}}`` on stdout); 2 a usage error; 130 interrupted.
exec, sh, shell run, wait and attach otherwise exit with the remote command's code; code run with
0 ok, 1 error, 124 timeout, 130 interrupted, 137 died.

What the guest sends is printed through ``guestd.cli.terminal``: names and messages with their
control characters escaped, workload output to a terminal with its control sequences neutralized
(``--raw`` writes it as it came).
--timeout/--idle-timeout are enforced in the guest (the ops' timeout_s/idle_timeout_s; for wait,
how long the guest waits for the exit); guestctl's own wait for the reply is derived from them
(the client's deadline). --connect-timeout bounds connecting and the handshake.

One module per capability (system, exec, files, workspace, processes, shells, snapshot, code, ports,
metrics), mirroring the daemon's; each registers its subcommands with their handlers, so a new
command touches one module. This one holds the connection options and ``main``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from guestd.cli import code, files, metrics, ports, processes, runs, shells, snapshot, system, terminal, workspace
from guestd.cli import exec as exec_  # the module; plain "exec" would hide the builtin here
from guestd.cli.shared import Handler, print_json
from guestd.client.aio import CONNECT_TIMEOUT, AsyncClient
from guestd.wire.errors import GuestdError

__all__ = ["build_parser", "main", "run"]

DEFAULT_CONNECT = "unix:/run/guestd/guestd.sock"
# The order of ``guestctl --help``.
COMMAND_MODULES = (system, exec_, files, workspace, processes, shells, snapshot, code, ports, metrics, runs)


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
    p.add_argument(
        "--raw",
        action="store_true",
        help="write workload output to a terminal as it came (default: control sequences neutralized)",
    )
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
    except KeyboardInterrupt:
        return 130
    except GuestdError as err:
        report_failure(ns, err.to_body())
    except (OSError, ValueError) as exc:
        report_failure(ns, {"code": "client_error", "message": str(exc)})
    except Exception as exc:  # a bug here, not the guest's doing; still one line, never a traceback
        report_failure(ns, {"code": "internal", "message": f"{type(exc).__name__}: {exc}"})
    return 1


def report_failure(ns: argparse.Namespace, error: dict[str, object]) -> None:
    """One line on stderr, or one JSON object on stdout under --json; guest text escaped."""
    if ns.json:
        print_json({"error": error})
        return
    code, message = error.get("code"), error.get("message")
    prefix = "guestctl: error" if code != "client_error" else "guestctl"
    tag = f" [{terminal.field(code)}]" if code != "client_error" else ""
    print(f"{prefix}{tag}: {terminal.field(message)}", file=sys.stderr)
