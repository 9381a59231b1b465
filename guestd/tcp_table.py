"""The kernel's TCP socket table, /proc/net/tcp and /proc/net/tcp6 of the network namespace guestd
runs in: one reader for the port listing and the snapshot's clone hazards.

The workload decides how many rows there are (100,000 sockets are a few lines of Python), so
the tables are read as a stream, one buffer at a time: memory stays one buffer however long
they are, and the time is linear in the rows (about 1 us a row to split, more only for the
rows a caller keeps)."""

from __future__ import annotations

import itertools
import socket
import struct
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Literal

Family = Literal["ipv4", "ipv6"]

LISTEN = "0A"  # the st column's hex state codes (include/net/tcp_states.h)
ESTABLISHED = "01"
READ_BUFFER = 256 * 1024  # bytes per read of a table (the kernel fills it from its seq_file)
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


def packed_address(hex_address: str, af: int) -> bytes:
    """The address of a table's ``ADDR:PORT`` column in network order (as inet_pton gives it)."""
    raw = bytes.fromhex(hex_address)
    if len(raw) != (4 if af == socket.AF_INET else 16):
        raise ValueError(f"address of {len(raw)} bytes")
    # The kernel prints each 32-bit word in host (little-endian) order.
    return b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))


def endpoint_text(hex_endpoint: str, af: int) -> tuple[str, int]:
    """(address as inet_ntop writes it, port) of a table's ``ADDR:PORT`` column."""
    hex_address, _, hex_port = hex_endpoint.partition(":")
    return socket.inet_ntop(af, packed_address(hex_address, af)), int(hex_port, 16)


def _rows(path: str) -> Iterator[list[str]]:
    """The first ten columns of every row of one table (sl, local, remote, st, ..., inode); a table
    that cannot be read (no IPv6) or stops being readable ends the rows there."""
    try:
        f = open(path, encoding="ascii", errors="replace", buffering=READ_BUFFER)  # noqa: SIM115
    except OSError:
        return
    with f:
        try:
            next(f, None)  # the column header
            for row in f:
                yield row.split(None, 10)  # the columns after the inode are not needed
        except OSError:
            return


def tcp_sockets(states: Collection[str]) -> Iterator[TcpSocket]:
    """Every socket in one of ``states``, IPv4 first; a table that cannot be read (no IPv6)
    or a row that does not parse is skipped."""
    for path, family, af in _TABLES:
        for columns in _rows(path):
            if len(columns) < 10 or columns[3] not in states:
                continue
            try:
                local, remote = endpoint_text(columns[1], af), endpoint_text(columns[2], af)
                inode = int(columns[9])
            except (ValueError, OSError):
                continue
            yield TcpSocket(family, columns[3], local, remote, inode)


def listening_rows(ports: Collection[int] | None = None) -> Iterator[tuple[Family, int, bytes, int, int]]:
    """(family, address family, local address in network order, port, inode) of every listening
    socket (on one of ``ports`` when given), IPv4 first.

    From the kernel's sock_diag netlink dump of listening sockets only: its cost follows the
    listeners, not the connections (100,000 established sockets make /proc/net/tcp 15 MB, about
    240 ms of kernel time to generate; the dump of 5,000 listeners beside them takes a few ms,
    bench/ports.py). Without sock_diag (a kernel built without INET_DIAG) the tables are read."""
    for path, family, af in _TABLES:
        try:
            dump = _diag_listeners(af)
            first = next(dump, None)
        except OSError:
            yield from _proc_listeners(path, family, af, ports)
            continue
        if first is None:
            continue
        for packed, port, inode in itertools.chain((first,), dump):
            if ports is None or port in ports:
                yield family, af, packed, port, inode


def _proc_listeners(
    path: str, family: Family, af: int, ports: Collection[int] | None
) -> Iterator[tuple[Family, int, bytes, int, int]]:
    for columns in _rows(path):
        if len(columns) < 10 or columns[3] != LISTEN:
            continue
        hex_address, _, hex_port = columns[1].partition(":")
        try:
            port = int(hex_port, 16)
            if ports is not None and port not in ports:
                continue
            yield family, af, packed_address(hex_address, af), port, int(columns[9])
        except ValueError:
            continue


NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
TCP_LISTEN_STATE = 10
_NLMSG = struct.Struct("=IHHII")  # nlmsghdr: len, type, flags, seq, pid
_DIAG_REQ = struct.Struct("=BBBBI48x")  # inet_diag_req_v2: family, protocol, ext, pad, states, sockid (any)
_DIAG_MSG = struct.Struct("=BBBB2s2s16s16sIQIIIII")  # inet_diag_msg: ..., sockid, expires, queues, uid, inode
DIAG_RECV = 64 * 1024  # one recv of the dump (the kernel sends about 32 KiB per batch)


def _diag_listeners(af: int) -> Iterator[tuple[bytes, int, int]]:
    """(local address in network order, port, inode) of each listening TCP socket of family
    ``af``, streamed from a sock_diag dump: one batch in memory at a time. Raises OSError when
    there is no sock_diag for TCP; an error the kernel sends mid-dump ends it as OSError too."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC, NETLINK_SOCK_DIAG)
    with sock:
        body = _DIAG_REQ.pack(af, socket.IPPROTO_TCP, 0, 0, 1 << TCP_LISTEN_STATE)
        sock.sendto(
            _NLMSG.pack(_NLMSG.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, 1, 0) + body, (0, 0)
        )
        size = 4 if af == socket.AF_INET else 16
        while True:
            data = sock.recv(DIAG_RECV)
            if not data:
                return
            at = 0
            while at + _NLMSG.size <= len(data):
                length, kind, _, _, _ = _NLMSG.unpack_from(data, at)
                if length < _NLMSG.size:
                    return
                if kind == NLMSG_DONE:
                    return
                if kind == NLMSG_ERROR:
                    (errno_neg,) = struct.unpack_from("=i", data, at + _NLMSG.size)
                    raise OSError(-errno_neg, "sock_diag dump failed")
                if kind == SOCK_DIAG_BY_FAMILY and length >= _NLMSG.size + _DIAG_MSG.size:
                    fields = _DIAG_MSG.unpack_from(data, at + _NLMSG.size)
                    sport, src, inode = fields[4], fields[6], fields[-1]
                    yield src[:size], int.from_bytes(sport, "big"), inode
                at += (length + 3) & ~3  # NLMSG_ALIGN
