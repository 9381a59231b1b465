"""The inputs of snapshot.prepare and snapshot.restore that guestd checks itself, whole, before
any step runs: bad input changes nothing."""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Final

from guestd.wire.errors import ErrorCode, GuestdError
from guestd.wire.record import Record

if TYPE_CHECKING:  # the generated message types: annotations only, never imported at run time
    from guestd.wire.types import SnapshotRestoreArgs

HOSTNAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]{0,62}[A-Za-z0-9])?")  # sethostname: <= 64 bytes
CLOCK_MAX_NS = 2**63 - 1  # what clock_settime takes (time_t in ns)


class Identity(Record):  # a Record, not a NamedTuple: cheap to declare (at snapshot.prepare)
    """A restore's identity, checked whole before anything is applied."""

    __slots__ = ("env", "hostname", "sandbox_id", "token")

    def __init__(
        self, sandbox_id: str | None, hostname: str | None, env: dict[str, str] | None, token: str | None
    ) -> None:
        self.sandbox_id: Final = sandbox_id
        self.hostname: Final = hostname
        self.env: Final = env
        self.token: Final = token


def restore_input_error(field: str, why: str) -> GuestdError:
    return GuestdError(
        ErrorCode.BAD_REQUEST, f"snapshot.restore: {field} {why}; nothing was applied", details={"field": field}
    )


def checked_identity(args: SnapshotRestoreArgs) -> Identity:
    """Every input of a restore, checked before any step runs: bad input changes nothing."""
    if not 0 <= args["time_ns"] <= CLOCK_MAX_NS:
        raise restore_input_error("time_ns", "is outside what the clock can be set to")
    raw = args["identity"] or {}
    known = {"sandbox_id", "hostname", "env", "token"}
    for key in raw:
        if key not in known:
            raise restore_input_error(f"identity.{key}", "is not an identity field (sandbox_id, hostname, env, token)")

    def text(key: str) -> str | None:
        value = raw.get(key)
        if value is None or value == "":
            return None
        if not isinstance(value, str):
            raise restore_input_error(f"identity.{key}", "must be a string")
        if "\0" in value or "\n" in value:
            raise restore_input_error(f"identity.{key}", "must not hold NUL or a newline")
        return value

    sandbox_id, hostname, token = text("sandbox_id"), text("hostname"), text("token")
    if hostname is not None and not HOSTNAME.fullmatch(hostname):
        raise restore_input_error("identity.hostname", "must be 1-64 letters, digits, '-' or '.'")
    env = raw.get("env")
    if env is not None:
        if not isinstance(env, dict):
            raise restore_input_error("identity.env", "must be a map of strings")
        for k, v in env.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise restore_input_error(f"identity.env.{k}", "must map a string to a string")
            if not k or "=" in k or "\0" in k or "\0" in v:
                raise restore_input_error(
                    f"identity.env.{k}", "is not a valid environment entry (a name without '=' or NUL)"
                )
    return Identity(sandbox_id, hostname, env, token)


def check_fsfreeze_target(path: str) -> None:
    """Only a mount point, never the root file system: guestd itself (its log, its runtime dir,
    the Python it imports lazily) would block on a frozen /."""
    bad = None
    if not os.path.isabs(path):
        bad = "must be an absolute path"
    elif os.path.realpath(path) == "/":
        bad = "must not be the root file system"
    elif not os.path.ismount(path):
        bad = "is not a mount point"
    if bad is not None:
        raise GuestdError(
            ErrorCode.BAD_REQUEST, f"fsfreeze {path!r} {bad}", details={"field": "fsfreeze", "stage": "fsfreeze"}
        )
