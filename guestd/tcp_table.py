"""The kernel's TCP socket table, /proc/net/tcp and /proc/net/tcp6 of the network namespace guestd
runs in: one reader for the port listing and the snapshot's clone hazards."""

from __future__ import annotations

import socket
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Literal

Family = Literal["ipv4", "ipv6"]

LISTEN = "0A"  # the st column's hex state codes (include/net/tcp_states.h)
ESTABLISHED = "01"
_TABLES: tuple[tuple[str, Family, int], ...] = (
    ("/proc/net/tcp", "ipv4", socket.AF_INET),
    ("/proc/net/tcp6", "ipv6", socket.AF_INET6),
)


@dataclass(frozen=True, slots=True)
class TcpSocket:
    family: Family
    state: str  # LISTEN, ESTABLISHED, ...
    local: tuple[str, int]  # (address as inet_ntop writes it, port)
    remote: tuple[str, int]
    inode: int

    @staticmethod
    def endpoint(family: Family, address: str, port: int) -> str:
        return f"[{address}]:{port}" if family == "ipv6" else f"{address}:{port}"


def _endpoint(hex_endpoint: str, af: int) -> tuple[str, int]:
    hex_address, _, hex_port = hex_endpoint.partition(":")
    raw = bytes.fromhex(hex_address)
    if len(raw) != (4 if af == socket.AF_INET else 16):
        raise ValueError(f"address of {len(raw)} bytes")
    # The kernel prints each 32-bit word in host (little-endian) order.
    packed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(af, packed), int(hex_port, 16)


def tcp_sockets(states: Collection[str]) -> Iterator[TcpSocket]:
    """Every socket in one of ``states``, IPv4 first; a table that cannot be read (no IPv6)
    or a row that does not parse is skipped."""
    for path, family, af in _TABLES:
        try:
            with open(path) as f:
                rows = f.read().splitlines()[1:]  # the first line is the column header
        except OSError:
            continue
        for row in rows:
            columns = row.split()
            if len(columns) < 10 or columns[3] not in states:
                continue
            try:
                local, remote = _endpoint(columns[1], af), _endpoint(columns[2], af)
                inode = int(columns[9])
            except (ValueError, OSError):
                continue
            yield TcpSocket(family, columns[3], local, remote, inode)
