"""guestd's end of a kernel's re-seed side channel (a restore with many live contexts re-seeds them at once).

A restore used to re-seed each kernel with a hidden cell: one round trip through the kernel's
message loop per context (about 8 ms each here, 70 ms for eight on a loaded host), and a
context busy with a cell was only re-seeded before its next one, so the running cell kept
drawing the parent's numbers, the same ones in every clone. Now the socketpair a kernel takes
its key over (fd 0 of guestd's launcher, ``guestd.code.kernel``) stays open: guestd writes
``SEED_TAG + token + seed`` as one SOCK_SEQPACKET message, a thread in the kernel applies it
(``random``, numpy, ``tempfile``) without the message loop, and answers with the token.

The kernel runs as the workload user and cells can do anything to their end (close it, read
it, write to it). Against that guestd never blocks and never waits without a bound: its end
is non-blocking; a seed that cannot be written at once (the kernel stopped reading, the end
is closed) is not sent; confirmations are read only while one is awaited, at most
``MAX_READS_PER_SEED`` messages of at most ``ACK_READ_BYTES`` bytes per seed (more: the
channel is closed for good); a token is 64 random bits drawn after the restore's CRNG
re-seed, so nothing sent earlier can confirm a later seed. A channel that is closed or
fails only means the context is re-seeded by a hidden cell instead (guestd.code.contexts).
"""

from __future__ import annotations

import asyncio
import os
import socket

from guestd.code.kernel import SEED_BYTES, SEED_TAG, SEED_TOKEN_BYTES
from guestd.services import derive

ACK_READ_BYTES = 64  # one confirmation is SEED_TOKEN_BYTES; longer messages are cut here (SEQPACKET)
MAX_READS_PER_SEED = 64  # messages read while waiting for one seed's confirmation
READS_PER_WAKE = 16  # per readiness callback, so a flooding kernel cannot hold guestd's loop


def kernel_seed(restore_key: bytes, pid: int) -> bytes:
    """The seed of the kernel ``pid`` for one restore: different for every kernel of a guest and,
    the host's entropy being different per clone, for every clone."""
    return derive(restore_key, f"kernel:{pid}", SEED_BYTES)


def handover_channel() -> tuple[socket.socket, socket.socket]:
    """(guestd's end, the kernel's end): the key goes over it first, then the seeds."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


class ReseedChannel:
    """Seeds to one kernel and its confirmations. ``send`` never blocks; ``confirmed`` waits at
    most its timeout. Every waiter of a seed not yet confirmed is answered by the confirmation
    of that seed or of any later one (a later seed is at least as fresh)."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self._sock: socket.socket | None = sock
        self._token: bytes | None = None  # of the last seed sent, until it is confirmed
        self._confirmed: asyncio.Future[bool] | None = None
        self._reads = 0
        self._watching = False

    @property
    def open(self) -> bool:
        return self._sock is not None

    @property
    def unconfirmed(self) -> bool:
        """A seed was sent and its confirmation has not been read (yet)."""
        return self._token is not None

    def send(self, seed: bytes) -> bool:
        """Hand ``seed`` to the kernel now; False when the channel cannot take it at once (closed
        or failed; a kernel that stopped reading fills it): then nothing was sent."""
        if self._sock is None:
            return False
        token = os.urandom(SEED_TOKEN_BYTES)
        try:
            self._sock.send(SEED_TAG + token + seed)
        except OSError:  # BlockingIOError (full), BrokenPipeError / ECONNRESET (closed by the kernel)
            self.close()
            return False
        self._token, self._reads = token, 0
        if self._confirmed is None or self._confirmed.done():
            self._confirmed = asyncio.get_running_loop().create_future()
        self._watch()
        return True

    async def confirmed(self, timeout_s: float) -> bool:
        """Whether the kernel confirmed the last seed sent, waiting at most ``timeout_s``."""
        waiting = self._confirmed
        if waiting is None:
            return False
        if not waiting.done():
            try:
                await asyncio.wait_for(asyncio.shield(waiting), timeout_s)
            except TimeoutError:
                return False
        return waiting.result()

    def close(self) -> None:
        """Closed for good (the kernel's thread sees the end and stops); waiters learn False."""
        self._unwatch()
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
        self._token = None
        if self._confirmed is not None and not self._confirmed.done():
            self._confirmed.set_result(False)
        self._confirmed = None  # an earlier seed's confirmation says nothing of a later one

    def _watch(self) -> None:
        if not self._watching and self._sock is not None:
            asyncio.get_running_loop().add_reader(self._sock.fileno(), self._on_readable)
            self._watching = True

    def _unwatch(self) -> None:
        if self._watching and self._sock is not None:
            asyncio.get_running_loop().remove_reader(self._sock.fileno())
        self._watching = False

    def _on_readable(self) -> None:
        sock = self._sock
        if sock is None:
            return
        for _ in range(READS_PER_WAKE):
            try:
                message = sock.recv(ACK_READ_BYTES)
            except BlockingIOError:
                return
            except OSError:
                self.close()
                return
            if not message:  # the kernel's end is closed (or sent an empty message: the same to us)
                self.close()
                return
            if message == self._token:
                self._token = None
                self._unwatch()  # nothing awaited: what the kernel sends now stays in its buffer
                if self._confirmed is not None and not self._confirmed.done():
                    self._confirmed.set_result(True)
                return
            self._reads += 1  # a late confirmation of an earlier seed, or noise from a cell
            if self._reads >= MAX_READS_PER_SEED:
                self.close()
                return
