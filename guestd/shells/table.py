"""The shell sessions of one guestd: made, found by id or name, closed, reseeded after a restore."""

from __future__ import annotations

import asyncio
import os

from guestd.services import derive
from guestd.shells.session import Session
from guestd.tables import NamedTable
from guestd.wire.errors import ErrorCode, GuestdError


class Shells(NamedTable[Session]):
    what = "shell session"
    field = "session"
    limit = "max_shells"

    async def create(self, cwd: str | None, env: dict[str, str] | None, name: str | None) -> Session:
        other = self.named(name) if name is not None else None
        if other is not None:
            raise GuestdError(
                ErrorCode.EXISTS,
                f"a shell session named {name!r} exists: {other.id}",
                details={"session": other.id, "field": "name"},
            )
        self.check_room()
        s = Session(self.services, "s" + os.urandom(6).hex(), name, cwd, env)
        with self.reserved(s):
            await s.start()  # ends its bash itself when it fails or is cancelled
        return s

    async def close(self, ref: str) -> None:
        s = self.remove(ref)
        s.closed = True
        await s.kill()

    async def shutdown(self) -> None:
        for s in self.by_id.values():
            s.closed = True
        await asyncio.gather(*(s.kill() for s in self.by_id.values()), return_exceptions=True)
        self.by_id.clear()

    def busy(self) -> dict[str, list[str]]:
        return {"busy_shells": [s.id for s in self.by_id.values() if s.lock.locked()]}

    async def reseed(self, entropy: bytes) -> dict[str, list[str]]:
        """After a restore: a new $RANDOM seed in every session (busy ones before their next command)."""

        def give(s: Session) -> None:
            s.pending_seed = int.from_bytes(derive(entropy, "sh:" + s.id, 4), "big") & 0x7FFF_FFFF

        done: list[str] = []
        pending: list[str] = []
        applying = []
        for s in self.by_id.values():
            give(s)
            if s.lock.locked():  # a command runs: its session takes the seed before the next one
                pending.append(s.id)
            else:
                applying.append(s.apply_pending_seed())
                done.append(s.id)
        results = await asyncio.gather(*applying, return_exceptions=True)
        errors = [repr(r) for r in results if isinstance(r, BaseException)]
        return {"shells_reseeded": done, "shells_pending": pending, "reseed_errors": errors}
