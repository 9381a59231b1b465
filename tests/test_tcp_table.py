"""The /proc/net/tcp{,6} reader behind port.list and snapshot.prepare's clone hazards, on real
sockets of this process."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

from guestd.tcp_table import ESTABLISHED, LISTEN, TcpSocket, tcp_sockets


@contextlib.contextmanager
def _sockets() -> Iterator[list[socket.socket]]:
    held: list[socket.socket] = []
    try:
        yield held
    finally:
        for s in held:
            s.close()


def test_listeners_and_connections_are_read_with_their_addresses_ports_and_inodes() -> None:
    with _sockets() as held:
        v4 = socket.socket(socket.AF_INET)
        v6 = socket.socket(socket.AF_INET6)
        held += [v4, v6]
        v4.bind(("127.0.0.1", 0))
        v6.bind(("::1", 0))
        v4.listen()
        v6.listen()
        mapped = socket.socket(socket.AF_INET6)  # an IPv4 peer seen through an IPv6 socket
        held.append(mapped)
        mapped.connect(("::ffff:127.0.0.1", v4.getsockname()[1]))
        accepted, _ = v4.accept()
        held.append(accepted)

        found = list(tcp_sockets((LISTEN, ESTABLISHED)))
        listening = {(s.family, s.local, s.inode) for s in found if s.state == LISTEN}
        assert ("ipv4", ("127.0.0.1", v4.getsockname()[1]), _inode(v4)) in listening
        assert ("ipv6", ("::1", v6.getsockname()[1]), _inode(v6)) in listening
        ours = [s for s in found if s.state == ESTABLISHED and s.inode == _inode(mapped)]
        assert len(ours) == 1 and ours[0].family == "ipv6"
        assert ours[0].local == ("::ffff:127.0.0.1", mapped.getsockname()[1])
        assert ours[0].remote == ("::ffff:127.0.0.1", v4.getsockname()[1])
        assert TcpSocket.endpoint("ipv6", *ours[0].remote) == f"[::ffff:127.0.0.1]:{v4.getsockname()[1]}"
        assert all(s.state == LISTEN for s in tcp_sockets((LISTEN,)))


def _inode(sock: socket.socket) -> int:
    return os.fstat(sock.fileno()).st_ino
