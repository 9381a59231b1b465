"""guestctl snapshot prepare | resume, and restore: before a VM snapshot and after each restore."""

from __future__ import annotations

import argparse
import json

from guestd.cli.shared import Subcommands, add_command, parse_env, print_json
from guestd.client.aio import AsyncClient


def register(sub: Subcommands) -> None:
    snap = sub.add_parser("snapshot", help="before a VM snapshot").add_subparsers(dest="snap_cmd", required=True)
    add_command(snap, "prepare", prepare, help="settle writes, sync, drop seed files").add_argument(
        "--quiesce", action="store_true", help="hold new work until restore or resume"
    )
    add_command(snap, "resume", resume, help="accept work again after prepare --quiesce")
    rs = add_command(sub, "restore", restore, help="after every restore/clone: re-seed, fix the clock, new identity")
    rs.add_argument("--entropy-hex", default=None, help="default: 64 fresh random bytes")
    rs.add_argument("--time-ns", type=int, default=None, help="default: this machine's clock")
    rs.add_argument("--generation", type=int, default=None, help="default: the guest's current + 1")
    rs.add_argument("--nonce", default=None)
    rs.add_argument("--id", dest="sandbox_id", default=None, help="new sandbox id")
    rs.add_argument("--hostname", default=None)
    rs.add_argument("--env", action="append", default=[], metavar="K=V", help="environment for future execs")


async def prepare(client: AsyncClient, ns: argparse.Namespace) -> int:
    out = await client.snapshot_prepare(quiesce=ns.quiesce)
    print_json(out) if ns.json else print(json.dumps(out, indent=1))
    return 0


async def resume(client: AsyncClient, ns: argparse.Namespace) -> int:
    await client.snapshot_resume()
    out = {"resumed": True}
    print_json(out) if ns.json else print(json.dumps(out, indent=1))
    return 0


async def restore(client: AsyncClient, ns: argparse.Namespace) -> int:
    report = await client.restore(
        generation=ns.generation,
        nonce=ns.nonce,
        time_ns=ns.time_ns,
        entropy=bytes.fromhex(ns.entropy_hex) if ns.entropy_hex else None,
        sandbox_id=ns.sandbox_id,
        hostname=ns.hostname,
        env=parse_env(ns.env) or None,
    )
    print_json(report) if ns.json else print(json.dumps(report, indent=1, default=str))
    return 0
