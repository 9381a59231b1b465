"""What every run is started from: argv, environment, working directory, and signal names."""

from __future__ import annotations

import errno
import os
import signal
from typing import Any

from guestd.wire.errors import ErrorCode, GuestdError


def parse_signal(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value if 0 < value < signal.NSIG else None
    if not isinstance(value, str):
        return None
    name = value.upper()
    if name.isdigit():
        return parse_signal(int(name))
    if not name.startswith("SIG"):
        name = "SIG" + name
    sig = getattr(signal, name, None)
    return int(sig) if isinstance(sig, signal.Signals) else None


def build_env(env: dict[str, str] | None, mode: str) -> dict[str, str] | None:
    """None means "inherit guestd's environment" (cheapest: Popen encodes nothing)."""
    if mode == "replace":
        return dict(env or {})
    if not env:
        return None
    merged = dict(os.environ)
    merged.update(env)
    return merged


def check_cwd(cwd: str | None) -> None:
    """A missing or non-directory cwd is a could-not-start error with stage "cwd"."""
    if cwd is None:
        return
    try:
        st = os.stat(cwd)
    except OSError as exc:
        raise GuestdError.from_os_error(exc, stage="cwd", cwd=cwd) from None
    except ValueError as exc:
        raise GuestdError(ErrorCode.BAD_REQUEST, f"bad cwd: {exc}", details={"stage": "cwd"}) from None
    if not os.path.isdir(cwd) or not st:
        raise GuestdError(
            ErrorCode.NOT_A_DIRECTORY,
            f"cwd is not a directory: {cwd}",
            errno=errno.ENOTDIR,
            details={"stage": "cwd", "cwd": cwd},
        )


def command_argv(argv: list[str] | None, shell: str | None) -> list[str]:
    """The argv to run: ``argv``, or ``shell`` under /bin/sh -c (the schema admits exactly one)."""
    if argv is not None:
        return argv
    assert shell is not None
    return ["/bin/sh", "-c", shell]
