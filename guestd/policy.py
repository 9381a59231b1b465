"""Who may talk to guestd and what they may do: peer uids, an op allow/deny list, write roots,
and the unprivileged user the workload runs as.

Configured in guestd.toml (``[policy]``) so an image can, for example, turn off file
writes outside its workspace. Every refusal is ``permission_denied`` naming the rule.
"""

from __future__ import annotations

import fnmatch
import os
import socket
import struct
from typing import Any

from guestd.wire.errors import ErrorCode, GuestdError


class Policy:
    # A plain class, not a dataclass: those compile their generated methods at every start.
    def __init__(self) -> None:
        self.allowed_uids: set[int] | None = None  # Unix-socket peers; None: guestd's own uid and root
        self.allow_ops: list[str] | None = None  # fnmatch patterns; None: every op
        self.deny_ops: list[str] = []
        self.write_roots: list[str] | None = None  # None: writes anywhere guestd may write
        self.read_roots: list[str] | None = None  # None: reads anywhere guestd may read
        self.workload_user: str | None = None  # run exec/processes/shells as this user when guestd is root

    def peer_allowed(self, sock: Any) -> str | None:
        """None when the Unix-socket peer may connect, else why not (SO_PEERCRED)."""
        if sock is None or getattr(sock, "family", None) != socket.AF_UNIX:
            return None
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        except OSError:
            return "cannot read the peer's credentials"
        _pid, uid, _gid = struct.unpack("3i", raw)
        allowed = self.allowed_uids if self.allowed_uids is not None else {0, os.geteuid()}
        return None if uid in allowed else f"peer uid {uid} is not allowed (policy.allowed_uids)"

    def check_op(self, op: str) -> None:
        if self.allow_ops is not None and not any(fnmatch.fnmatchcase(op, p) for p in self.allow_ops):
            raise GuestdError(
                ErrorCode.PERMISSION_DENIED,
                f"op {op!r} is not allowed by policy.allow_ops",
                details={"policy": "allow_ops", "op": op},
            )
        for pattern in self.deny_ops:
            if fnmatch.fnmatchcase(op, pattern):
                raise GuestdError(
                    ErrorCode.PERMISSION_DENIED,
                    f"op {op!r} is denied by policy.deny_ops ({pattern})",
                    details={"policy": "deny_ops", "op": op},
                )

    def workload_ids(self) -> tuple[int, int] | None:
        """(uid, gid) to run the workload as, or None (not root, or no user configured)."""
        if self.workload_user is None or os.geteuid() != 0:
            return None
        import pwd

        try:
            pw = (
                pwd.getpwuid(int(self.workload_user))
                if self.workload_user.isdigit()
                else pwd.getpwnam(self.workload_user)
            )
        except KeyError:
            raise GuestdError(
                ErrorCode.BAD_REQUEST, f"policy.workload_user {self.workload_user!r} does not exist"
            ) from None
        return pw.pw_uid, pw.pw_gid


class PortPolicy:
    """What the relay may reach (``[ports]``): the guest ports port.connect and port.wait may
    open, and whether the guest may reach the host at all (port.reverse, off by default)."""

    def __init__(self) -> None:
        self.allow: list[str] | None = None  # "8080" or "3000-3999"; None: every port
        self.reverse = False

    def check_syntax(self) -> None:
        for rule in self.allow or []:
            lo, _, hi = rule.partition("-")
            if not (lo.isdigit() and (not hi or hi.isdigit())):
                raise ValueError(f"ports.allow entry {rule!r} is not PORT or LOW-HIGH")

    def check_port(self, port: int) -> None:
        if self.allow is None:
            return
        for rule in self.allow:
            lo, _, hi = rule.partition("-")
            if int(lo) <= port <= int(hi or lo):
                return
        raise GuestdError(
            ErrorCode.PERMISSION_DENIED,
            f"guest port {port} is not in ports.allow",
            details={"policy": "ports.allow", "port": port},
        )

    def check_reverse(self) -> None:
        if not self.reverse:
            raise GuestdError(
                ErrorCode.PERMISSION_DENIED,
                "reverse forwards are off (ports.reverse = false)",
                details={"policy": "ports.reverse"},
            )
