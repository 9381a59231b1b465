"""What every run is started from: argv, environment, working directory, and signal names."""

from __future__ import annotations

import errno
import functools
import os
import pwd
import signal
from typing import Any

from guestd.wire.errors import ErrorCode, GuestdError


def parse_signal(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value if 0 < value < signal.NSIG else None
    if not isinstance(value, str):
        return None
    name = value.upper()
    if name.isascii() and name.isdigit():  # str.isdigit() is also true of "²", which int() refuses
        return parse_signal(int(name))
    if not name.startswith("SIG"):
        name = "SIG" + name
    sig = getattr(signal, name, None)
    return int(sig) if isinstance(sig, signal.Signals) else None


def build_env(env: dict[str, str] | None, mode: str, ids: tuple[int, int] | None = None) -> dict[str, str] | None:
    """The environment of a run started as ``ids`` (None: as guestd): guestd's own with ``env``
    over it ("merge"), or ``env`` alone ("replace"). A run that drops to another user gets that
    user's HOME, USER and LOGNAME as login(1) sets them, unless ``env`` names them: guestd's
    HOME (/root under systemd) is not the workload's to write, and ``pip install --user`` or
    git's config must land where the workload's code kernels look. None means "inherit guestd's
    environment" (cheapest: nothing to encode)."""
    if mode == "replace":
        return dict(env or {})
    identity = user_identity(ids[0]) if ids is not None and ids[0] != os.geteuid() else None
    if not env and not identity:
        return None
    merged = dict(_environ_as(identity))
    if env:
        merged.update(env)
    return merged


# Copying os.environ decodes every name and value in Python (28 us here, per exec as the workload
# user); the merged copy is kept per identity while guestd's own environment is unchanged
# (a restore may update it: checked by comparing the raw bytes mapping, 0.4 us).
_RAW_ENVIRON: dict[bytes, bytes] | None = getattr(os.environ, "_data", None)
_merged_cache: dict[tuple[tuple[str, str], ...], tuple[dict[bytes, bytes], dict[str, str]]] = {}


def _environ_as(identity: dict[str, str] | None) -> dict[str, str]:
    """guestd's environment with ``identity`` over it; the caller copies it before changing it."""
    key = tuple(sorted(identity.items())) if identity else ()
    hit = _merged_cache.get(key)
    if hit is not None and _RAW_ENVIRON is not None and hit[0] == _RAW_ENVIRON:
        return hit[1]
    merged = dict(os.environ)
    if identity:
        merged.update(identity)
    if _RAW_ENVIRON is not None:
        if len(_merged_cache) >= 8:  # one entry per workload identity: a handful at most
            _merged_cache.clear()
        _merged_cache[key] = (dict(_RAW_ENVIRON), merged)
    return merged


@functools.lru_cache(maxsize=8)
def user_identity(uid: int) -> dict[str, str] | None:
    """HOME, USER and LOGNAME of ``uid`` from the password database (None: no such user)."""
    try:
        pw = pwd.getpwuid(uid)
    except KeyError:
        return None
    return {"HOME": pw.pw_dir, "USER": pw.pw_name, "LOGNAME": pw.pw_name}


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
