"""The guest's listening TCP sockets, read from /proc/net/tcp{,6} (the namespace guestd runs in),
with the process holding each found through /proc/<pid>/fd; and waiting for a port to answer."""

from __future__ import annotations

import asyncio
import hashlib
import os
from typing import Any

from guestd.tcp_table import LISTEN, tcp_sockets

MAX_COMMAND = 256
MAX_LISTENERS = 4096  # listed per reply; a workload with more is cut here (by port)
WAIT_INTERVALS_S = (0.02, 0.05, 0.1, 0.2)  # port.wait's probes back off to the last one
HTTP_STATUS_LINE_MAX = 8192


def scan() -> list[tuple[str, str, int, int]]:
    """(family, address, port, socket inode) of every listening socket, sorted, without duplicates."""
    found: dict[tuple[str, str, int], int] = {}
    for sock in tcp_sockets((LISTEN,)):
        found.setdefault((sock.family, *sock.local), sock.inode)
    return sorted(((f, a, p, inode) for (f, a, p), inode in found.items()), key=lambda x: (x[2], x[0], x[1]))


def digest(sockets: list[tuple[str, str, int, int]]) -> str:
    h = hashlib.blake2b(digest_size=12)
    for family, address, port, _ in sockets:
        h.update(f"{family} {address} {port}\n".encode())
    return h.hexdigest()


def _owners(inodes: set[int]) -> dict[int, int]:
    """Socket inode -> a pid holding it (guestd must be allowed to read that process's fds)."""
    want = {f"socket:[{i}]": i for i in inodes}
    owners: dict[int, int] = {}
    if not want:
        return owners
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fd_dir = f"/proc/{entry}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"{fd_dir}/{fd}")
            except OSError:
                continue
            inode = want.get(target)
            if inode is not None and inode not in owners:
                owners[inode] = int(entry)
        if len(owners) == len(want):
            break
    return owners


def _command(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read(MAX_COMMAND * 4)
    except OSError:
        return None
    return raw.rstrip(b"\0").replace(b"\0", b" ").decode("utf-8", "replace")[:MAX_COMMAND]


def describe(sockets: list[tuple[str, str, int, int]]) -> list[dict[str, Any]]:
    """Listener records (the schema's ``listener``), with owners where guestd can see them."""
    sockets = sockets[:MAX_LISTENERS]
    owners = _owners({inode for *_, inode in sockets})
    out = []
    for family, address, port, inode in sockets:
        rec: dict[str, Any] = {"port": port, "address": address, "family": family}
        pid = owners.get(inode)
        if pid is not None:
            rec["pid"] = pid
            command = _command(pid)
            if command is not None:
                rec["command"] = command
        out.append(rec)
    return out


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
