"""guestctl port-forward | ports | port-wait: reach guest ports from this host, and (with
``--reverse``) let the guest reach one host destination."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import signal
import sys

from guestd.cli import terminal
from guestd.cli.shared import Subcommands, add_command, print_json
from guestd.client.aio import AsyncClient

TIMED_OUT = 124


def register(sub: Subcommands) -> None:
    f = add_command(
        sub,
        "port-forward",
        port_forward,
        help="relay LOCAL on this host to GUEST in the guest until interrupted (or, with --reverse, "
        "GUEST_PORT in the guest to HOST:HOSTPORT here)",
    )
    f.add_argument("spec", metavar="LOCAL:GUEST | GUEST | GUEST_PORT:HOST:HOSTPORT")
    f.add_argument("--address", default="127.0.0.1", help="host address to listen on (default 127.0.0.1)")
    f.add_argument("--guest-address", default=None, help="guest address to connect to (default 127.0.0.1)")
    f.add_argument("--reverse", action="store_true", help="guest -> host: the guest connects to GUEST_PORT")
    p = add_command(sub, "ports", list_ports, help="list the guest's listening TCP sockets")
    p.add_argument(
        "--port",
        type=int,
        action="append",
        dest="ports",
        metavar="GUEST_PORT",
        help="only this port (repeatable): whole however many listeners the guest has",
    )
    w = add_command(sub, "port-wait", port_wait, help="wait until a guest port accepts connections (exit 124: not)")
    w.add_argument("port", type=int, metavar="GUEST_PORT")
    w.add_argument("--timeout", type=float, default=None, help="seconds (the guest's default: 30)")
    w.add_argument("--http", action="store_true", help="until GET --path answers 2xx or 3xx")
    w.add_argument("--path", default=None, help="the GET's path (default /)")
    w.add_argument("--guest-address", default=None, help="guest address (default 127.0.0.1)")


async def _until_interrupted() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise ValueError(f"port {port} is out of range")
    return port


async def port_forward(client: AsyncClient, ns: argparse.Namespace) -> int:
    parts = ns.spec.rsplit(":", 2) if ns.reverse else ns.spec.split(":")
    if ns.reverse:
        if len(parts) != 3:
            raise ValueError("--reverse takes GUEST_PORT:HOST:HOSTPORT")
        guest_port, host, host_port = _port(parts[0]), parts[1].strip("[]"), _port(parts[2])
        async with await client.reverse_forward(guest_port, (host, host_port), address=ns.guest_address) as reverse:
            if ns.json:
                print_json({"guest_port": reverse.guest_port, "destination": [host, host_port]})
            else:
                print(f"Forwarding guest 127.0.0.1:{reverse.guest_port} -> {host}:{host_port}", flush=True)
            await _until_interrupted()
        return 0
    if len(parts) == 1:
        local, guest = _port(parts[0]), _port(parts[0])
    elif len(parts) == 2:
        local, guest = _port(parts[0] or "0"), _port(parts[1])
    else:
        raise ValueError("give LOCAL:GUEST or GUEST")
    async with await client.port_forward(
        guest, local_port=local, local_address=ns.address, address=ns.guest_address
    ) as forward:
        if ns.json:
            print_json({"local_address": forward.local_address, "local_port": forward.local_port, "guest_port": guest})
        else:
            print(f"Forwarding from {forward.local_address}:{forward.local_port} -> guest {guest}", flush=True)
        await _until_interrupted()
        for err in forward.errors:
            print(
                f"guestctl: a connection was not relayed: [{terminal.field(err.code)}] {terminal.field(err.message)}",
                file=sys.stderr,
            )
    return 0


async def list_ports(client: AsyncClient, ns: argparse.Namespace) -> int:
    listing = await client.port_list(ports=ns.ports)
    if ns.json:
        print_json(
            {
                "listeners": [dataclasses.asdict(x) for x in listing],
                "total": listing.total,
                "truncated": listing.truncated,
                "owners_truncated": listing.owners_truncated,
            }
        )
        return 0
    for x in listing:
        where = f"{x.address}:{x.port}" if x.family == "ipv4" else f"[{x.address}]:{x.port}"
        pid = "-" if x.pid is None else str(x.pid)
        print(f"{terminal.field(where):<28} pid {pid:<8} {terminal.field(x.command or '')[:80]}")
    if listing.truncated:
        print(
            f"guestctl: {len(listing)} of {listing.total} listeners shown (the guest lists the lowest ports; "
            "ask for one with --port)",
            file=sys.stderr,
        )
    if listing.owners_truncated:
        print(
            "guestctl: the guest's search for owning processes stopped at its budget: some pids are missing",
            file=sys.stderr,
        )
    return 0


async def port_wait(client: AsyncClient, ns: argparse.Namespace) -> int:
    res = await client.port_wait(
        ns.port, address=ns.guest_address, timeout_s=ns.timeout, http=True if ns.http else None, path=ns.path
    )
    if ns.json:
        print_json(dataclasses.asdict(res))
    return 0 if res.ready else TIMED_OUT
