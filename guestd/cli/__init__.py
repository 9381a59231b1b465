"""guestctl: drive a guestd from a shell or script.

    guestctl --connect ADDR [--json] ping | info | --version
    guestctl ... exec [--timeout S] [--idle-timeout S] [-w DIR] [-e K=V|K]... [--max-output N] [-i] [-t] -- ARGV...
    guestctl ... sh COMMAND WORDS...    (joined with spaces, as ssh does)
    guestctl ... cp SRC DST          (the guest side is written :PATH)
    guestctl ... cat :PATH | ls :PATH | rm [-r] :PATH
    guestctl ... code new [--kernel K] | run [--context ID] [--timeout S] CODE | ls | interrupt ID | restart ID | rm ID
    guestctl ... exec -d -- ARGV... | exec -t -- ARGV...
    guestctl ... ps [rm ID... | prune] | attach ID [--from OFFSET] | kill ID [SIGNAL] | wait ID
    guestctl ... shell new | shell run [ID] 'COMMAND' | shell ls | shell rm ID
    guestctl ... snapshot prepare [--quiesce] | snapshot resume | snapshot restore
    guestctl ... port-forward [--address ADDR] LOCAL:GUEST... | port-forward --reverse GUEST_PORT:HOST:HOSTPORT...
    guestctl ... ports | port-wait GUEST_PORT [--timeout S] [--http] [--path P]
    guestctl ... cp -r DIR :DIR | cp -r :DIR DIR | find :DIR --glob PATTERN | grep [-i] [-F] [--glob G] PATTERN :DIR
    guestctl ... view :PATH [--lines A:B] | edit :PATH --old TEXT --new TEXT | edit :PATH --undo
    guestctl ... apply-patch :DIR < PATCH | watch :DIR (JSON Lines)
    guestctl ... metrics [--watch S] | top [--interval S] [--once]

exec/sh exit with the remote exit code (124 when a timeout fired, 128+N when killed by signal N);
port-wait exits 0 once the port answers, 124 when it did not in time. port-forward runs until
SIGINT/SIGTERM and prints the address it listens on first.
Exit codes of guestctl itself: 0 done; 1 any failure (an error from the guest, a broken or hostile
guest, the connection, a local file), reported as one line on stderr (under --json, as one JSON
object ``{"error": {"code", "message", ...}}`` on stdout); 2 a usage error (under --json
``{"error": {"code": "usage", ...}}``); 126 the program could not be run (not executable), 127 it
was not found (exec, sh, exec --detach: as shells and ``docker exec`` say it); 130 interrupted.
exec, sh, shell run, wait and attach otherwise exit with the remote command's code; code run with
0 ok, 1 error, 124 timeout, 130 interrupted, 137 died.

``--json`` may be given anywhere before a command's own arguments end (``guestctl --json ps`` and
``guestctl ps --json`` alike). A command prints exactly one JSON object (the result's fields; ``{}``
when there is nothing to report), or JSON Lines for the streaming ones
(:data:`guestd.cli.shared.JSON_LINES`). Bytes are a str when they are UTF-8, else
``{"base64": ...}``; ``timed_out`` is null or the kind of timeout that fired ("wall", "idle").

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
from typing import Any, NoReturn

from guestd import __version__
from guestd.cli import code, files, metrics, ports, processes, runs, shells, snapshot, system, terminal, workspace
from guestd.cli import exec as exec_  # the module; plain "exec" would hide the builtin here
from guestd.cli.live import READER_GONE_EXIT, silence_stdout
from guestd.cli.shared import JSON_HELP, JSON_LINES, JSON_REFUSED, USAGE_EXIT, Handler, UsageError, print_json
from guestd.client.aio import CONNECT_TIMEOUT, AsyncClient
from guestd.wire.errors import GuestdError
from guestd.wire.schema import PROTOCOL_VERSION

__all__ = ["build_parser", "main", "run"]

# The README's address too (guestd's own runtime_dir, /run/guestd, is private to it).
DEFAULT_CONNECT = "unix:/run/guestd.sock"
# The order of ``guestctl --help``.
COMMAND_MODULES = (system, exec_, files, workspace, processes, shells, snapshot, code, ports, metrics, runs)
# Top-level names kept working for old scripts but not listed (``restore`` is ``snapshot restore``).
HIDDEN_COMMANDS = ("restore",)
# A program that could not be started (details.stage "spawn"), as a shell reports it.
SPAWN_EXIT = {"not_found": 127, "permission_denied": 126}
SPAWN_DEFAULT_EXIT = 126


class GuestctlParser(argparse.ArgumentParser):
    """argparse, with usage errors as ``{"error": {"code": "usage"}}`` under --json (exit 2 either way)."""

    json_errors = False  # set by main from the command line, before parsing

    def error(self, message: str) -> NoReturn:
        if GuestctlParser.json_errors:
            print_json({"error": {"code": "usage", "message": f"{self.prog}: {message}"}})
            raise SystemExit(USAGE_EXIT)
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    p = GuestctlParser(prog="guestctl", description="Talk to a guestd.")
    p.add_argument("--version", action="version", version=f"guestctl {__version__} (protocol v{PROTOCOL_VERSION})")
    p.add_argument(
        "--connect",
        default=os.environ.get("GUESTD_CONNECT", DEFAULT_CONNECT),
        help=f"unix:PATH, vsock:CID:PORT or fc:UDS_PATH:PORT (env GUESTD_CONNECT; default {DEFAULT_CONNECT})",
    )
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
    hide_commands(sub, HIDDEN_COMMANDS)
    add_json_everywhere(p, (), top=True)
    return p


def hide_commands(sub: Any, names: tuple[str, ...]) -> None:
    """Keep ``names`` parseable but out of ``--help`` and the usage line."""
    sub._choices_actions = [a for a in sub._choices_actions if a.dest not in names]
    sub.metavar = "{" + ",".join(n for n in sub.choices if n not in names) + "}"


def add_json_everywhere(parser: argparse.ArgumentParser, words: tuple[str, ...], top: bool = False) -> None:
    """``--json`` on every parser of the tree, so it may come before or after the subcommand.
    Below the top its default is SUPPRESS: a subcommand that is not given it leaves the top's."""
    name = " ".join(words)
    help_text = JSON_LINES.get(name) or JSON_REFUSED.get(name) or JSON_HELP
    parser.add_argument("--json", action="store_true", default=False if top else argparse.SUPPRESS, help=help_text)
    seen: set[int] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                if id(child) not in seen:  # an alias names the same parser
                    seen.add(id(child))
                    add_json_everywhere(child, (*words, name))


def wants_json(argv: list[str]) -> bool:
    """``--json`` among the options (before a ``--``): for the errors argparse reports itself."""
    options = argv[: argv.index("--")] if "--" in argv else argv
    return "--json" in options


async def run(ns: argparse.Namespace) -> int:
    """Connect, run the parsed command's handler, close; the command's exit code."""
    handler: Handler = ns.handler
    client = await AsyncClient.connect(ns.connect, connect_timeout=ns.connect_timeout, token=ns.token)
    try:
        return await handler(client, ns)
    finally:
        await client.close()


def main(argv: list[str] | None = None) -> int:
    try:
        return parse_and_run(sys.argv[1:] if argv is None else argv)
    except BrokenPipeError:  # our stdout's reader went away (| head): quietly, as SIGPIPE would
        silence_stdout()
        return READER_GONE_EXIT


def parse_and_run(args: list[str]) -> int:
    GuestctlParser.json_errors = wants_json(args)
    ns = build_parser().parse_args(args)
    try:
        return asyncio.run(run(ns))
    except KeyboardInterrupt:
        return 130
    except UsageError as exc:
        return report_usage(ns, str(exc))
    except SystemExit as exc:
        if isinstance(exc.code, str):  # a handler's ``SystemExit("message")``: a usage error too
            return report_usage(ns, exc.code)
        raise
    except BrokenPipeError:
        raise  # main's, not an OSError to report (the report could not be read either)
    except GuestdError as err:
        report_failure(ns, err.to_body())
        return exit_code_of_error(err)
    except (OSError, ValueError) as exc:
        report_failure(ns, {"code": "client_error", "message": str(exc)})
    except Exception as exc:  # a bug here, not the guest's doing; still one line, never a traceback
        report_failure(ns, {"code": "internal", "message": f"{type(exc).__name__}: {exc}"})
    return 1


def exit_code_of_error(err: GuestdError) -> int:
    """127 for a program not found, 126 for one that could not be run, as shells and ``docker
    exec`` exit; 1 for every other error."""
    if (err.details or {}).get("stage") == "spawn":
        return SPAWN_EXIT.get(str(err.code), SPAWN_DEFAULT_EXIT)
    return 1


def report_usage(ns: argparse.Namespace, message: str) -> int:
    """A usage error found by a handler: exit 2, its message on stderr (or as JSON)."""
    text = message if message.startswith("guestctl") else f"guestctl {' '.join(command_words(ns))}: {message}"
    if ns.json:
        print_json({"error": {"code": "usage", "message": text}})
    else:
        print(text, file=sys.stderr)
    return USAGE_EXIT


def command_words(ns: argparse.Namespace) -> list[str]:
    words = [ns.cmd]
    for group in ("shell_cmd", "code_cmd", "runs_cmd", "snap_cmd", "ps_cmd"):
        value = getattr(ns, group, None)
        if isinstance(value, str):
            words.append(value)
    return words


def report_failure(ns: argparse.Namespace, error: dict[str, object]) -> None:
    """One line on stderr, or one JSON object on stdout under --json; guest text escaped."""
    if ns.json:
        print_json({"error": error})
        return
    code, message = error.get("code"), error.get("message")
    details = error.get("details")
    stage = details.get("stage") if isinstance(details, dict) else None
    if stage == "cwd":
        message = f"the working directory (--cwd) cannot be used: {message}"
    elif stage == "spawn":
        message = f"cannot run the program: {message}"
    prefix = "guestctl: error" if code != "client_error" else "guestctl"
    tag = f" [{terminal.field(code)}]" if code != "client_error" else ""
    print(f"{prefix}{tag}: {terminal.field(message)}", file=sys.stderr)
