"""guestctl port-forward | ports | port-wait: reach guest ports from this host, and (with
``--reverse``) let the guest reach one host destination."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import signal
import sys
from collections.abc import Iterator

from guestd.cli import terminal
from guestd.cli.shared import Subcommands, UsageError, add_command, print_json
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
    f.add_argument(
        "specs",
        nargs="+",
        metavar="LOCAL:GUEST | GUEST | GUEST_PORT:HOST:HOSTPORT",
        help="one or more mappings, as kubectl port-forward takes them",
    )
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


@contextlib.contextmanager
def _interrupted() -> Iterator[asyncio.Event]:
    """An event SIGINT/SIGTERM sets, installed before the first "Forwarding" line is printed:
    a ^C sent as soon as the line is read ends guestctl with 0, as one sent later does."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        yield stop
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise ValueError(f"port {port} is out of range")
    return port


def _mapping(spec: str, reverse: bool) -> tuple[int, int] | tuple[int, str, int]:
    """One command-line mapping: (local, guest) ports, or with ``--reverse`` (guest port, host, host port)."""
    try:
        if reverse:
            parts = spec.rsplit(":", 2)
            if len(parts) != 3:
                raise UsageError(f"--reverse takes GUEST_PORT:HOST:HOSTPORT, got {spec!r}")
            return _port(parts[0]), parts[1].strip("[]"), _port(parts[2])
        parts = spec.split(":")
        if len(parts) == 1:
            return _port(parts[0]), _port(parts[0])
        if len(parts) == 2:
            return _port(parts[0] or "0"), _port(parts[1])
    except ValueError as exc:
        raise UsageError(f"{spec!r}: {exc}") from None
    raise UsageError(f"give LOCAL:GUEST or GUEST, got {spec!r}")


async def port_forward(client: AsyncClient, ns: argparse.Namespace) -> int:
    """Every mapping opened (all or none: a failure closes those already open), one line each
    (``--json``: one JSON object each), then relayed until SIGINT/SIGTERM."""
    mappings = [_mapping(spec, ns.reverse) for spec in ns.specs]  # every usage error before any listener
    with _interrupted() as stop:
        return await _forward_until(stop, client, ns, mappings)


async def _forward_until(
    stop: asyncio.Event,
    client: AsyncClient,
    ns: argparse.Namespace,
    mappings: list[tuple[int, int] | tuple[int, str, int]],
) -> int:
    async with contextlib.AsyncExitStack() as stack:
        forwards = []
        for m in mappings:
            if len(m) == 3:
                guest_port, host, host_port = m
                reverse = await stack.enter_async_context(
                    await client.reverse_forward(guest_port, (host, host_port), address=ns.guest_address)
                )
                if ns.json:
                    print_json({"guest_port": reverse.guest_port, "destination": [host, host_port]})
                else:
                    print(f"Forwarding guest 127.0.0.1:{reverse.guest_port} -> {host}:{host_port}", flush=True)
                continue
            local, guest = m
            forward = await stack.enter_async_context(
                await client.port_forward(guest, local_port=local, local_address=ns.address, address=ns.guest_address)
            )
            forwards.append(forward)
            if ns.json:
                print_json(
                    {"local_address": forward.local_address, "local_port": forward.local_port, "guest_port": guest}
                )
            else:
                print(f"Forwarding from {forward.local_address}:{forward.local_port} -> guest {guest}", flush=True)
        await stop.wait()
        for forward in forwards:
            for err in forward.errors:
                print(
                    f"guestctl: a connection was not relayed: [{terminal.field(err.code)}] "
                    f"{terminal.field(err.message)}",
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
        print_json({**dataclasses.asdict(res), "timed_out": None if res.ready else "wall"})
    elif not res.ready:
        what = (
            f"did not answer GET {ns.path or '/'} with 2xx or 3xx"
            + ("" if res.http_status is None else f" (last status {res.http_status})")
            if ns.http
            else "did not accept a connection"
        )
        print(f"guestctl: guest port {ns.port} {what} within {res.elapsed_s:.1f} s", file=sys.stderr)
    return 0 if res.ready else TIMED_OUT
