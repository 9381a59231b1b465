"""The guest's listening TCP sockets, read from /proc/net/tcp{,6} (the namespace guestd runs in),
with the process holding each found through /proc/<pid>/fd; and waiting for a port to answer.

The workload decides how many listeners there are (5,000 are one loop of ``listen``), so a
listing is whole or says it is cut: ``scan`` reads the tables once as a stream, keeps the first
``MAX_LISTENERS`` by port in a bounded heap, and counts and digests every one of them (the
digest is a keyed sum over the whole set, not over what is listed: a change beyond the cut
still changes it). Memory: the heap; time: linear in the table's rows (``bench/ports.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import heapq
import os
import socket
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from guestd.tcp_table import listening_rows

MAX_COMMAND = 256
MAX_LISTENERS = 4096  # listed per reply; a workload with more is cut here (by port), and told so
MAX_WANTED_PORTS = 1024  # ports one port.list or port.watch may name
OWNER_FD_BUDGET = 1 << 15  # descriptors of /proc/*/fd read per owner search (0.1-0.9 s, bench/ports.py)
WAIT_INTERVALS_S = (0.02, 0.05, 0.1, 0.2)  # port.wait's probes back off to the last one
HTTP_STATUS_LINE_MAX = 8192
_DIGEST_BITS = 128
# Keyed: the workload cannot pick two sets of listeners that share a digest (a set that changed
# would look unchanged to port.watch). Digests name sets of this guestd process only.
_DIGEST_KEY = os.urandom(16)


@dataclass(frozen=True, slots=True)
class Listing:
    """One read of the tables: the first listeners by port, and what the whole set holds."""

    sockets: list[tuple[str, str, int, int]]  # (family, address, port, socket inode), by port
    total: int  # listening sockets found (on the wanted ports)
    digest: str  # names the whole set (of the wanted ports)

    @property
    def truncated(self) -> bool:
        return self.total > len(self.sockets)


def _item_hash(family: str, packed: bytes, port: int) -> int:
    h = hashlib.blake2b(digest_size=_DIGEST_BITS // 8, key=_DIGEST_KEY)
    h.update(family.encode() + packed + port.to_bytes(2, "big"))
    return int.from_bytes(h.digest(), "big")


def scan(ports: Collection[int] | None = None, cap: int = MAX_LISTENERS) -> Listing:
    """Every listening socket (on ``ports`` when given), one socket one record (SO_REUSEPORT
    sockets sharing an address each count): the first ``cap`` by (port, family, address, inode),
    and the count and digest of all. Blocking: run it off the loop."""
    # A max-heap (keys negated) of the cap smallest: once it is full, a socket on a port above
    # the largest kept one costs one comparison.
    kept: list[tuple[int, int, int, int, str, int, bytes]] = []
    total = 0
    summed = 0
    for family, af, packed, port, inode in listening_rows(ports):
        total += 1
        summed += _item_hash(family, packed, port)
        if cap <= 0 or (len(kept) >= cap and port > -kept[0][0]):
            continue
        item = (-port, -af, -int.from_bytes(packed, "big"), -inode, family, af, packed)
        if len(kept) < cap:
            heapq.heappush(kept, item)
        elif item > kept[0]:
            heapq.heapreplace(kept, item)
    sockets = [
        (family, socket.inet_ntop(af, packed), -neg_port, -neg_inode)
        for neg_port, _, _, neg_inode, family, af, packed in sorted(kept, reverse=True)
    ]
    wanted = "all" if ports is None else ",".join(map(str, sorted(set(ports))))
    summed %= 1 << _DIGEST_BITS
    digest = hashlib.blake2b(f"{wanted} {total} {summed:x}".encode(), digest_size=12).hexdigest()
    return Listing(sockets, total, digest)


def _owners(inodes: set[int], budget: int = OWNER_FD_BUDGET) -> tuple[dict[int, int], bool]:
    """Socket inode -> a pid holding it (guestd must be allowed to read that process's fds), and
    whether the search looked at every process: it reads at most ``budget`` descriptors, as
    many as the workload opens (a process with 5,000 listeners holds 5,000)."""
    want = {f"socket:[{i}]": i for i in inodes}
    owners: dict[int, int] = {}
    if not want:
        return owners, True
    left = budget
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fd_dir = f"/proc/{entry}/fd"
        try:
            fds = os.scandir(fd_dir)  # lazily: a process may hold a million descriptors
        except OSError:
            continue
        with fds, contextlib.suppress(OSError):  # the process may end while it is read
            for fd in fds:
                if left <= 0:
                    return owners, False
                left -= 1
                try:
                    target = os.readlink(fd.path)
                except OSError:
                    continue
                inode = want.get(target)
                if inode is not None and inode not in owners:
                    owners[inode] = int(entry)
        if len(owners) == len(want):
            break
    return owners, True


def _command(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read(MAX_COMMAND * 4)
    except OSError:
        return None
    return raw.rstrip(b"\0").replace(b"\0", b" ").decode("utf-8", "replace")[:MAX_COMMAND]


def describe(listing: Listing) -> tuple[list[dict[str, Any]], bool]:
    """Listener records (the schema's ``listener``) of what ``listing`` lists, with owners where
    guestd can see them; and whether the owner search looked everywhere (else a record without
    a pid may have one). Blocking: run it off the loop."""
    owners, searched_all = _owners({inode for *_, inode in listing.sockets})
    commands: dict[int, str | None] = {}  # one process often holds many listeners
    out = []
    for family, address, port, inode in listing.sockets:
        rec: dict[str, Any] = {"port": port, "address": address, "family": family}
        pid = owners.get(inode)
        if pid is not None:
            rec["pid"] = pid
            if pid not in commands:
                commands[pid] = _command(pid)
            command = commands[pid]
            if command is not None:
                rec["command"] = command
        out.append(rec)
    return out, searched_all


async def probe(address: str, port: int, timeout_s: float, http_path: str | None) -> tuple[bool, int | None]:
    """Does ``address:port`` accept a connection (and, with ``http_path``, answer a GET with 2xx
    or 3xx) within ``timeout_s``? Returns (ready, HTTP status seen)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(address, port), timeout_s)
    except (OSError, TimeoutError):
        return False, None
    try:
        if http_path is None:
            return True, None
        host = address if ":" not in address else f"[{address}]"
        writer.write(
            f"GET {http_path} HTTP/1.0\r\nHost: {host}:{port}\r\nUser-Agent: guestd-port-wait\r\n"
            "Connection: close\r\n\r\n".encode()
        )
        try:
            line = await asyncio.wait_for(reader.readline(), timeout_s)
        except (OSError, TimeoutError, ValueError):
            return False, None
        parts = line[:HTTP_STATUS_LINE_MAX].split()
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
            return False, None
        status = int(parts[1])
        return 200 <= status < 400, status
    finally:
        writer.transport.abort()
