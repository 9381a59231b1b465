"""The shell sessions of one guestd: made, found by id or name, closed, reseeded after a restore."""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING

from guestd.services import derive, reseed_each
from guestd.shells.session import Session
from guestd.wire.errors import ErrorCode, GuestdError, limit_error

if TYPE_CHECKING:
    from guestd.services import Services


class Shells:
    def __init__(self, services: Services) -> None:
        self.services = services
        self.sessions: dict[str, Session] = {}

    def get(self, ref: str) -> Session:
        s = self.sessions.get(ref)
        if s is None:
            for cand in self.sessions.values():
                if cand.name == ref:
                    return cand
            raise GuestdError(ErrorCode.NOT_FOUND, f"no shell session {ref!r}", details={"session": ref})
        return s

    async def create(self, cwd: str | None, env: dict[str, str] | None, name: str | None) -> Session:
        if name is not None:
            for other in self.sessions.values():
                if other.name == name:
                    raise GuestdError(
                        ErrorCode.EXISTS,
                        f"a shell session named {name!r} exists: {other.id}",
                        details={"session": other.id, "field": "name"},
                    )
        limits = self.services.config.limits
        if len(self.sessions) >= limits.max_shells:
            raise limit_error("max_shells", limits.max_shells, f"at most {limits.max_shells} shell sessions")
        s = Session(self.services, "s" + os.urandom(6).hex(), name, cwd, env)
        self.sessions[s.id] = s
        try:
            await s.start()  # ends its bash itself when it fails or is cancelled
        except BaseException:
            self.sessions.pop(s.id, None)
            raise
        return s

    async def close(self, ref: str) -> None:
        s = self.get(ref)
        del self.sessions[s.id]
        s.closed = True
        await s.kill()

    async def shutdown(self) -> None:
        for s in self.sessions.values():
            s.closed = True
        await asyncio.gather(*(s.kill() for s in self.sessions.values()), return_exceptions=True)
        self.sessions.clear()

    def busy(self) -> dict[str, list[str]]:
        return {"busy_shells": [s.id for s in self.sessions.values() if s.lock.locked()]}

    async def reseed(self, entropy: bytes) -> dict[str, list[str]]:
        """After a restore: a new $RANDOM seed in every session (busy ones before their next command)."""

        def give(s: Session) -> None:
            s.pending_seed = int.from_bytes(derive(entropy, "sh:" + s.id, 4), "big") & 0x7FFF_FFFF

        done, pending, errors = await reseed_each(list(self.sessions.values()), give)
        return {"shells_reseeded": done, "shells_pending": pending, "reseed_errors": errors}
