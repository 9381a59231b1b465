"""guestctl ping | info: is the guest there, and what is it."""

from __future__ import annotations

import argparse
import asyncio

from guestd.cli.shared import Subcommands, add_command, print_json
from guestd.cli.terminal import field
from guestd.client.aio import AsyncClient


def register(sub: Subcommands) -> None:
    add_command(sub, "ping", ping, help="round trip")
    add_command(sub, "info", info, help="guest and daemon facts")


async def ping(client: AsyncClient, ns: argparse.Namespace) -> int:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await client.ping()
    rtt_ms = (loop.time() - t0) * 1000
    print_json({"rtt_ms": rtt_ms}) if ns.json else print(f"pong {rtt_ms:.3f} ms")
    return 0


async def info(client: AsyncClient, ns: argparse.Namespace) -> int:
    facts = await client.info()
    if ns.json:
        print_json(facts.raw)
    else:
        for k, v in sorted(facts.raw.items()):
            print(f"{field(k)}: {field(v)}")
    return 0
