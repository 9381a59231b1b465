"""Write-side flow control shared by the daemon's and the client's connections."""

from __future__ import annotations

import asyncio


class WriteGate:
    """Open while the transport's write buffer is below its high-water mark.

    The transport calls ``pause``/``resume`` (via the protocol's pause_writing /
    resume_writing); senders ``await wait()`` after writing so that nobody queues
    unbounded data behind a slow peer.
    """

    __slots__ = ("_waiters", "paused")

    def __init__(self) -> None:
        self.paused = False
        self._waiters: list[asyncio.Future[None]] = []

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False
        self.release_all()

    def release_all(self) -> None:
        """Wake every waiter (also used when the connection closes)."""
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def wait(self) -> None:
        if self.paused:
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            await fut
