"""Two libc calls guestd makes once: becoming the child subreaper (at start) and tuning malloc
(after the first reply). Through the clone3 extension when it is loaded, as it is in the daemon
by then; else through ctypes (guestd/libc_fallback.py: the host client, GUESTD_NATIVE_SPAWN=0, a
build without a compiler), whose import the daemon's start path should not pay (~1 ms, ~0.35 MiB).

Nothing here imports the extension: importing it runs guestd.children's package, which the host
client has no use for."""

from __future__ import annotations

import sys
from typing import Any

_EXTENSION = "guestd.children._clone"


def _from_extension(name: str) -> Any:
    """The loaded extension's function ``name`` (None: the extension is not loaded, or lacks it)."""
    return getattr(sys.modules.get(_EXTENSION), name, None)


def become_subreaper() -> None:
    """prctl(PR_SET_CHILD_SUBREAPER, 1): orphans of what this process starts are re-parented to
    it. OSError when refused."""
    native = _from_extension("become_subreaper")
    if native is None:
        from guestd.libc_fallback import become_subreaper as native
    native()


def mallopt(param: int, value: int) -> bool | None:
    """glibc's mallopt: whether it took the setting; None where there is none (not glibc)."""
    native = _from_extension("mallopt")
    if native is None:
        from guestd.libc_fallback import mallopt as fallback

        return fallback(param, value)
    return bool(native(param, value))
