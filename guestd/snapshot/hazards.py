"""What a snapshot will copy into every clone that the clones cannot both own: listening TCP
sockets (each clone answers on the same address) and established TCP connections (each clone
holds the same connection, sequence numbers and all, to a peer that knows only one)."""

from __future__ import annotations

import socket
import struct
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from guestd.wire.types import SnapshotHazardsRecord

MAX_LISTED = 256  # per kind; the counts are exact
_LISTEN, _ESTABLISHED = "0A", "01"


def _address(hexaddr: str, family: int) -> tuple[str, int]:
    host, port = hexaddr.split(":")
    raw = bytes.fromhex(host)
    if family == socket.AF_INET:
        packed = struct.pack("<I", int.from_bytes(raw, "big"))
    else:  # four 32-bit words, each in host (little-endian) order
        packed = b"".join(struct.pack("<I", int.from_bytes(raw[i : i + 4], "big")) for i in range(0, 16, 4))
    return socket.inet_ntop(family, packed), int(port, 16)


def clone_hazards() -> SnapshotHazardsRecord:
    listening: list[str] = []
    established: list[str] = []
    counts = {"listening": 0, "established": 0}
    for path, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            with open(path) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) < 4 or parts[3] not in (_LISTEN, _ESTABLISHED):
                continue
            try:
                local = _address(parts[1], family)
                remote = _address(parts[2], family)
            except (ValueError, OSError):
                continue
            fmt = "[{}]:{}" if family == socket.AF_INET6 else "{}:{}"
            if parts[3] == _LISTEN:
                counts["listening"] += 1
                if len(listening) < MAX_LISTED:
                    listening.append(fmt.format(*local))
            else:
                counts["established"] += 1
                if len(established) < MAX_LISTED:
                    established.append(fmt.format(*local) + " -> " + fmt.format(*remote))
    return {
        "listening": listening,
        "established": established,
        "listening_count": counts["listening"],
        "established_count": counts["established"],
    }
