"""What a snapshot will copy into every clone that the clones cannot both own: listening TCP
sockets (each clone answers on the same address) and established TCP connections (each clone
holds the same connection, sequence numbers and all, to a peer that knows only one)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from guestd.wire.types import SnapshotHazardsRecord

MAX_LISTED = 256  # per kind; the counts are exact


def clone_hazards() -> SnapshotHazardsRecord:
    # imported here: the snapshot state is made at guestd's start, the tables read at prepare only
    from guestd.tcp_table import ESTABLISHED, LISTEN, TcpSocket, tcp_sockets

    listening: list[str] = []
    established: list[str] = []
    counts = {"listening": 0, "established": 0}
    for sock in tcp_sockets((LISTEN, ESTABLISHED)):
        local = TcpSocket.endpoint(sock.family, *sock.local)
        if sock.state == LISTEN:
            counts["listening"] += 1
            if len(listening) < MAX_LISTED:
                listening.append(local)
        else:
            counts["established"] += 1
            if len(established) < MAX_LISTED:
                established.append(local + " -> " + TcpSocket.endpoint(sock.family, *sock.remote))
    return {
        "listening": listening,
        "established": established,
        "listening_count": counts["listening"],
        "established_count": counts["established"],
    }
