"""What every guestctl command module uses: the handler contract, JSON printing, ``K=V`` and
``:PATH`` arguments."""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import math
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeAlias, TypeVar

from guestd.cli.terminal import field
from guestd.client.aio import AsyncClient
from guestd.client.replies import ProcessAttachResult, ProcessWaitResult

# A command's handler: runs on a connected client, returns guestctl's exit code.
Handler: TypeAlias = Callable[[AsyncClient, argparse.Namespace], Awaitable[int]]
# What ``ArgumentParser.add_subparsers`` returns; a string because it is generic only in typeshed.
Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


T = TypeVar("T")

# guestctl's exit code for a usage error (argparse's own, and every handler's, under --json too).
USAGE_EXIT = 2

# The commands that print JSON Lines under --json (one object per event, as it happens); every
# other command prints exactly one JSON object. Keyed by the command's words; the value is its
# --json help. The walking test (tests/test_cli_json.py) reads this too.
JSON_LINES: dict[str, str] = {
    "attach": "print JSON Lines: one object per chunk of output ({stream, offset, data}), the last one "
    "the process's state ({ev: end, ...})",
    "metrics": "print one JSON object; with --watch, JSON Lines (one object per sample or OOM event)",
    "port-forward": "print JSON Lines: the forward's address as one object once it listens (then runs until ^C)",
    "watch": "print JSON Lines: one object per change",
    "grep": "print JSON Lines: one object per match (or per file with -l), the last a summary",
}
# Commands that refuse --json (a usage error saying what to use instead).
JSON_REFUSED: dict[str, str] = {"top": "not for top (it draws a screen): use 'metrics --watch S --json'"}
JSON_HELP = "print one JSON object: the result's fields ({} when there is nothing to report)"


class UsageError(Exception):
    """A command line that cannot be run as given: guestctl exits 2 (USAGE_EXIT) with the message
    (under --json as ``{"error": {"code": "usage", "message": ...}}`` on stdout)."""


def refuse_flags(flags: Iterable[tuple[str, bool]], beside: str, why: str) -> None:
    """No flag is silently ignored: a usage error naming each of ``flags`` (flag, given) that
    was given but cannot apply ``beside`` another (``--pty``...), and ``why`` or what to do instead."""
    given = [flag for flag, on in flags if on]
    if given:
        raise UsageError(f"{', '.join(given)} cannot apply with {beside}: {why}")


def add_command(sub: Subcommands, name: str, handler: Handler, **parser_kw: Any) -> argparse.ArgumentParser:
    """A subcommand parser whose namespace carries ``handler`` (``run`` calls it once connected)."""
    parser = sub.add_parser(name, **parser_kw)
    parser.set_defaults(handler=handler)
    return parser


def print_listing(ns: argparse.Namespace, key: str, items: Sequence[T], line: Callable[[T], str]) -> int:
    """A list command's output: ``{key: items}`` under --json, else ``line(item)`` for each; exit 0."""
    if ns.json:
        print_json({key: items})
    else:
        for item in items:
            print(line(item))
    return 0


def print_json(obj: Any) -> None:
    """One JSON object on a line, flushed (a JSON Lines reader sees each as it happens); control
    characters escaped by json.dumps (ensure_ascii)."""
    sys.stdout.write(json.dumps(jsonable(obj), sort_keys=True) + "\n")
    sys.stdout.flush()


def jsonable(value: Any) -> Any:
    """``value`` with what JSON cannot carry made text: bytes as a str when they are UTF-8, else
    ``{"base64": ...}`` (as ripgrep's --json has ``text``/``bytes``), map keys as str, anything
    else that is not a JSON type as its repr (the guest chooses these values)."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return {"base64": base64.b64encode(value).decode()}
    if isinstance(value, dict):
        return {k if isinstance(k, str) else repr(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # the client's typed replies
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value) if f.repr}
    return repr(value)


def parse_env(pairs: list[str]) -> dict[str, str]:
    """``-e/--env K=V`` arguments as a dict; a bare ``K`` passes this environment's value of K
    (left out when K is not set here), as ``docker exec -e K`` does."""
    env = {}
    for kv in pairs:
        k, sep, v = kv.partition("=")
        if not k:
            raise UsageError(f"--env wants K=V or K, got {kv!r}")
        if not sep:
            if k not in os.environ:
                continue
            v = os.environ[k]
        env[k] = v
    return env


def guest_path(arg: str) -> str | None:
    """The guest path of an argument written ``:PATH``; None for a local path."""
    return arg[1:] if arg.startswith(":") else None


def exit_code_of(status: ProcessWaitResult | ProcessAttachResult) -> int:
    """A finished process's status as a shell would report it: 128+N when killed by signal N."""
    return 128 + status.signal if status.signal is not None else int(status.exit_code or 0)


_CAUSES = {
    "signal": "killed by a signal",
    "oom": "killed by the kernel's OOM killer (out of memory)",
    "cancel": "ended by guestd: the request was cancelled",
}


def print_spills_and_timeout(res: Any, killed: str) -> None:
    """guestctl's notes after a run's output (exec, shell run): where a spilled stream's full
    bytes are, and what its timeout did (``killed``: what a timeout that did not detach did)."""
    for name in ("stdout", "stderr"):
        spill = getattr(res, name + "_spill")
        if spill is not None and (getattr(res, name + "_dropped") or spill.stopped):
            stopped = f", stopped: {spill.stopped}" if spill.stopped else ""
            print(
                f"guestctl: full {name} in {field(spill.path)} ({spill.bytes} bytes{stopped})",
                file=sys.stderr,
            )
    if res.detached is not None:
        print(
            f"guestctl: {res.timed_out} timeout fired; the command goes on as process {res.detached}"
            f" (guestctl attach {res.detached})",
            file=sys.stderr,
        )
    elif res.timed_out:
        print(f"guestctl: {res.timed_out} timeout fired; {killed}", file=sys.stderr)


def print_death(killed_by: str | None, oom_killed: bool | None, sig: int | None = None) -> None:
    """On stderr, why something killed the run (timeouts have their own line), so exit 137
    is not left to guessing: the OOM killer, or a signal from outside."""
    note = _CAUSES.get(killed_by or "")
    if note is None:
        if not oom_killed:
            return
        note = "the OOM killer killed one of its processes"
    if sig is not None and killed_by == "signal":
        try:
            note += f" ({signal.Signals(sig).name})"
        except ValueError:
            note += f" ({sig})"
    print(f"guestctl: {note}", file=sys.stderr)
