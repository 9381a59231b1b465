"""guestctl snapshot prepare | resume | restore: before a VM snapshot and after each restore
(``guestctl restore``, the old name, still works but is not listed)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from guestd.cli.shared import Subcommands, UsageError, add_command, jsonable, parse_env, print_json
from guestd.client.aio import AsyncClient


def register(sub: Subcommands) -> None:
    snap = sub.add_parser("snapshot", help="before a VM snapshot, and after each restore").add_subparsers(
        dest="snap_cmd", required=True
    )
    add_command(snap, "prepare", prepare, help="settle writes, sync, drop seed files").add_argument(
        "--quiesce", action="store_true", help="hold new work until 'snapshot restore' or 'snapshot resume'"
    )
    add_command(snap, "resume", resume, help="accept work again after prepare --quiesce")
    add_restore_arguments(
        add_command(snap, "restore", restore, help="after every restore/clone: re-seed, fix the clock, new identity")
    )
    add_restore_arguments(add_command(sub, "restore", restore))  # the old name (hidden by guestd.cli)


def add_restore_arguments(rs: argparse.ArgumentParser) -> None:
    rs.add_argument("--entropy-hex", default=None, help="default: 64 fresh random bytes")
    rs.add_argument("--time-ns", type=int, default=None, help="default: this machine's clock")
    rs.add_argument("--generation", type=int, default=None, help="default: the guest's current + 1")
    rs.add_argument("--nonce", default=None)
    rs.add_argument("--id", dest="sandbox_id", default=None, help="new sandbox id")
    rs.add_argument("--hostname", default=None)
    rs.add_argument("-e", "--env", action="append", default=[], metavar="K=V", help="environment for future execs")


def print_report(report: Any, ns: argparse.Namespace) -> None:
    print_json(report) if ns.json else print(json.dumps(jsonable(report), indent=1, sort_keys=True))


async def prepare(client: AsyncClient, ns: argparse.Namespace) -> int:
    out = await client.snapshot_prepare(quiesce=ns.quiesce)
    print_report(out, ns)
    if out.quiesced and not ns.json:
        # Later commands would otherwise wait with no word: say why, and what releases them.
        print(
            "guestctl: the guest is quiesced: new work waits until 'guestctl snapshot resume' "
            "(or 'guestctl snapshot restore' after a restore)",
            file=sys.stderr,
        )
    return 0


async def resume(client: AsyncClient, ns: argparse.Namespace) -> int:
    await client.snapshot_resume()
    print_json({}) if ns.json else print("guestctl: the guest accepts work again", file=sys.stderr)
    return 0


async def restore(client: AsyncClient, ns: argparse.Namespace) -> int:
    report = await client.restore(
        generation=ns.generation,
        nonce=ns.nonce,
        time_ns=ns.time_ns,
        entropy=entropy_of(ns.entropy_hex),
        sandbox_id=ns.sandbox_id,
        hostname=ns.hostname,
        env=parse_env(ns.env) or None,
    )
    print_report(report, ns)
    return 0


def entropy_of(hex_text: str | None) -> bytes | None:
    if hex_text is None:
        return None
    try:
        return bytes.fromhex(hex_text)
    except ValueError:
        raise UsageError(f"--entropy-hex is not hex: {hex_text[:40]!r}") from None
