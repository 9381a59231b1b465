"""Bounded output capture with exact accounting.

Shared by every producer of process output. It keeps at most ``limit`` bytes:
either the last ``limit`` bytes (``tail``) or the first half and the last half
(``head_tail``), and always knows how many bytes were produced and dropped, so
truncation is never silent.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from guestd.output.spill import Spill
    from guestd.wire.types import CapturedOutput

    # The result fields every output producer reports: the schema's captured_output group alone
    # (closed, so a reply spreads it with **).
    CapturedFields = CapturedOutput


class OutputCapture:
    __slots__ = ("_head", "_tail", "_tail_len", "head_limit", "limit", "spill", "total")

    def __init__(self, limit: int, mode: str = "tail") -> None:
        if limit < 0:
            raise ValueError("limit must be >= 0")
        self.limit = limit
        self.head_limit = limit // 2 if mode == "head_tail" else 0
        self._head = bytearray()
        self._tail: deque[bytes] = deque()
        self._tail_len = 0
        self.total = 0
        self.spill: Spill | None = None  # spill: true: every byte fed also goes to its file

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        if self.spill is not None:
            self.spill.write(data)
        if len(self._head) < self.head_limit:
            take = self.head_limit - len(self._head)
            self._head += data[:take]
            data = data[take:]
            if not data:
                return
        tail_limit = self.limit - self.head_limit
        if tail_limit <= 0:
            return
        if len(data) >= tail_limit:
            self._tail.clear()
            self._tail.append(bytes(data[-tail_limit:]))
            self._tail_len = tail_limit
            return
        self._tail.append(bytes(data))
        self._tail_len += len(data)
        while self._tail_len > tail_limit:
            over = self._tail_len - tail_limit
            first = self._tail[0]
            if len(first) <= over:
                self._tail.popleft()
                self._tail_len -= len(first)
            else:
                self._tail[0] = first[over:]
                self._tail_len -= over

    @property
    def kept(self) -> int:
        return len(self._head) + self._tail_len

    @property
    def dropped(self) -> int:
        return self.total - self.kept

    @property
    def gap_at(self) -> int | None:
        """Offset in :meth:`data` where dropped bytes were cut out; None if nothing was."""
        return len(self._head) if self.dropped else None

    def data(self) -> bytes:
        return bytes(self._head) + b"".join(self._tail)


# Kept bytes shaped on the event loop; more are shaped in a worker thread. Shaping is linear
# but its worst case (short lines each redrawn) is 0.2-0.35 us a byte on a loaded 2-core
# machine (bench/shaping.py), so 8 KiB stays under ~3 ms of loop time.
SHAPE_ON_LOOP_BYTES = 8 * 1024


def capture_fields(
    stdout: OutputCapture,
    stderr: OutputCapture,
    streamed: bool = False,
    strip_ansi: bool = False,
    collapse_cr: bool = False,
) -> CapturedFields:
    """The result fields every output producer reports (exec, shell.run, code.run).

    When the output was streamed as events it is not repeated: empty data, nothing dropped.
    ``strip_ansi`` / ``collapse_cr`` shape the returned bytes (guestd.output.shaping); the counts
    stay those of the raw stream. Shapes on the calling thread: on the event loop, use
    :func:`capture_fields_off_loop`.
    """
    if (strip_ansi or collapse_cr) and not streamed:
        return _shaped_fields(_kept(stdout), _kept(stderr), strip_ansi, collapse_cr)
    return {
        "stdout": b"" if streamed else stdout.data(),
        "stdout_bytes": stdout.total,
        "stdout_dropped": 0 if streamed else stdout.dropped,
        "stdout_gap_at": None if streamed else stdout.gap_at,
        "stderr": b"" if streamed else stderr.data(),
        "stderr_bytes": stderr.total,
        "stderr_dropped": 0 if streamed else stderr.dropped,
        "stderr_gap_at": None if streamed else stderr.gap_at,
    }


async def capture_fields_off_loop(
    stdout: OutputCapture,
    stderr: OutputCapture,
    streamed: bool = False,
    strip_ansi: bool = False,
    collapse_cr: bool = False,
) -> CapturedFields:
    """:func:`capture_fields`, shaping more than :data:`SHAPE_ON_LOOP_BYTES` in a worker
    thread so the loop keeps answering (a 1 MiB redraw line once held it 22-29 s).
    The kept bytes and counts are taken on the loop first: output still read meanwhile is
    in neither, so the reply stays consistent."""
    shaping = (strip_ansi or collapse_cr) and not streamed
    if not shaping or stdout.kept + stderr.kept <= SHAPE_ON_LOOP_BYTES:
        return capture_fields(stdout, stderr, streamed, strip_ansi, collapse_cr)
    kept = _kept(stdout), _kept(stderr)
    return await asyncio.to_thread(_shaped_fields, *kept, strip_ansi, collapse_cr)


class _Kept(NamedTuple):
    """What a capture holds, taken at one moment: ``head`` is empty when nothing was dropped
    (the whole is one piece, so a line across head and tail is shaped whole)."""

    head: bytes
    tail: bytes
    total: int
    dropped: int


def _kept(cap: OutputCapture) -> _Kept:
    if not cap.dropped:
        return _Kept(b"", cap.data(), cap.total, 0)
    return _Kept(bytes(cap._head), b"".join(cap._tail), cap.total, cap.dropped)


def _shaped_fields(stdout: _Kept, stderr: _Kept, strip_ansi: bool, collapse_cr: bool) -> CapturedFields:
    from guestd.output.shaping import shape

    out: dict[str, object] = {}
    for name, kept in (("stdout", stdout), ("stderr", stderr)):
        head = shape(kept.head, strip_ansi, collapse_cr)
        tail = shape(kept.tail, strip_ansi, collapse_cr)
        out[name] = head + tail
        out[f"{name}_bytes"] = kept.total
        out[f"{name}_dropped"] = kept.dropped
        out[f"{name}_gap_at"] = len(head) if kept.dropped else None
    return out  # type: ignore[return-value]


class OutputRing:
    """The last ``capacity`` bytes of a stream, addressed by absolute byte offsets.

    Offset 0 is the first byte the stream ever produced. A reader remembers the
    offset it has seen up to and reads on from there; if the ring has moved past
    it, :meth:`read` says how many bytes were lost, so every byte is delivered
    exactly once or reported missing, across reconnects.

    The byte at offset ``o`` lives at index ``o % capacity``: writes and reads are
    O(bytes moved), and the buffer grows only as far as output actually arrives.
    """

    __slots__ = ("_buf", "capacity", "closed", "total")

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be > 0")
        self.capacity = capacity
        self._buf = bytearray()
        self.total = 0  # bytes ever written == offset of the next byte
        self.closed = False

    @property
    def start(self) -> int:
        """Offset of the oldest byte still held."""
        return max(0, self.total - self.capacity)

    def write(self, data: bytes) -> None:
        cap = self.capacity
        n = len(data)
        if self.total + n <= cap:  # still filling up: plain append
            self._buf += data
            self.total += n
            return
        if len(self._buf) < cap:
            self._buf += bytes(cap - len(self._buf))
        if n > cap:  # only the last `cap` bytes can survive
            self.total += n - cap
            data = data[n - cap :]
            n = cap
        i = self.total % cap
        first = min(n, cap - i)
        self._buf[i : i + first] = data[:first]
        if first < n:
            self._buf[: n - first] = data[first:]
        self.total += n

    def read(self, offset: int, limit: int) -> tuple[bytes, int, int]:
        """Bytes from ``offset`` on (at most ``limit``): (data, offset of data[0], bytes lost before it)."""
        start = self.start
        lost = 0
        if offset < start:
            lost = start - offset
            offset = start
        offset = min(offset, self.total)
        n = min(limit, self.total - offset)
        if n <= 0:
            return b"", offset, lost
        i = offset % self.capacity
        first = min(n, self.capacity - i)
        with memoryview(self._buf) as view:
            data = bytes(view[i : i + first]) if first == n else bytes(view[i : i + first]) + bytes(view[: n - first])
        return data, offset, lost


def give_away_spills(stdout: OutputCapture, stderr: OutputCapture) -> dict[str, Spill] | None:
    """A command detaches: its spill files (if any) go with it to the process table, which
    writes what it prints from now on and closes them; the reply only reports them."""
    if stdout.spill is None or stderr.spill is None:
        return None
    spills = {"stdout": stdout.spill, "stderr": stderr.spill}
    stdout.spill = stderr.spill = None
    for spill in spills.values():
        spill.given_away = True
    return spills
