"""The change feed's consumers: a ``file.watch`` stream's handoff and the workspace's journal.

What a :class:`~guestd.files.watch.Watcher` hands on goes to a ``file.watch`` stream through a
:class:`Handoff` (bounded in bytes, one overflow said in place of what did not fit) or to the
workspace's :class:`Journal` (numbered changes, bounded in count and bytes; a cursor from before
what is kept: overflow), which :class:`WorkspaceChanges` serves to ``file.changes`` and exec's
``report_changes``. :func:`merge` is the net effect of a path's changes.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import os
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from guestd.files.watch import Change, Watcher, change_cost
from guestd.wire.errors import ErrorCode, GuestdError

if TYPE_CHECKING:
    from guestd.services import Services
    from guestd.wire.types import ChangeReportRecord

MAX_HANDOFF_BYTES = 4 << 20  # changes waiting for a file.watch's event loop; more: overflow
MAX_JOURNAL = 100_000  # changes the workspace journal keeps
MAX_JOURNAL_BYTES = 16 << 20  # ... and their bytes; older changes go (a cursor before them: overflow)
MAX_REPORT = 1000  # paths per list in a change report
SYNC_S = 5.0  # how long a journal report waits for the watcher to read what the kernel holds
JOURNAL_ENTRY_COST = 48  # bytes a journal entry costs besides itself (a bytes header, a deque slot)

_KIND_LETTER = {"created": b"c", "modified": b"m", "deleted": b"d"}
_LETTER_KIND = {ord("c"): "created", ord("m"): "modified", ord("d"): "deleted"}


def merge(first: str, last: str) -> str | None:
    """The net effect of a path's changes from ``first`` to ``last`` (None: no effect)."""
    if first == "created":
        return None if last == "deleted" else "created"
    if last == "deleted":
        return "deleted"
    return "modified"


class Handoff:
    """Changes from a watcher's thread to an event loop (``file.watch``): at most ``max_bytes``
    wait; past that they are dropped and one overflow is said in their place, as the kernel
    does with ``IN_Q_OVERFLOW``. One wake is scheduled on the loop at a time."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        wake: Callable[[], None],
        keep: Callable[[bytes, bool], bool] | None = None,
        max_bytes: int = MAX_HANDOFF_BYTES,
    ) -> None:
        self.loop = loop
        self.wake = wake
        # The watch's include/exclude globs, matched on the watcher's thread (its CPU bounded
        # by DUTY, the GIL offered as it goes), not on the event loop.
        self.keep = keep
        self.max_bytes = max_bytes
        self.lock = threading.Lock()
        self.changes: list[Change] = []
        self.nbytes = 0
        self.overflow = False
        self.ended: BaseException | None = None
        self.scheduled = False

    def put(self, changes: list[Change]) -> None:
        """On the watcher's thread."""
        keep = self.keep
        if keep is not None:
            changes = [c for c in changes if c[0] == "overflow" or keep(c[1], c[2])]
        with self.lock:
            for change in changes:
                cost = change_cost(change[1])
                if change[0] == "overflow" or self.nbytes + cost > self.max_bytes:
                    self.overflow = True
                else:
                    self.changes.append(change)
                    self.nbytes += cost
            schedule = not self.scheduled
            self.scheduled = True
        if schedule:
            self.loop.call_soon_threadsafe(self._woken)

    def end(self, error: BaseException) -> None:
        """On the watcher's thread, when it died."""
        with self.lock:
            self.ended = error
            schedule = not self.scheduled
            self.scheduled = True
        if schedule:
            self.loop.call_soon_threadsafe(self._woken)

    def _woken(self) -> None:
        with self.lock:
            self.scheduled = False
        self.wake()

    def take(self) -> tuple[list[Change], bool, BaseException | None]:
        """On the loop: the changes waiting, whether some were lost, and the watcher's death."""
        with self.lock:
            changes, overflow = self.changes, self.overflow
            self.changes, self.nbytes, self.overflow = [], 0, False
            return changes, overflow, self.ended


class Journal:
    """The workspace's change journal: numbered changes, the last ``MAX_JOURNAL`` (and at most
    ``MAX_JOURNAL_BYTES``) kept, each as one bytes object (its kind's letter, then its path: a
    quarter of a tuple's memory). A cursor from before the oldest kept change, or one that an
    overflow or a watcher that ended came after: the report says overflow."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entries: deque[bytes] = deque()  # seq first_seq + i; b"" marks an overflow
        self.first_seq = 1
        self.nbytes = 0
        self.overflow_at = -1  # the seq of the last overflow (changes lost then)
        self.dropped_at = -1  # the seq of the newest change dropped for room

    @property
    def seq(self) -> int:
        return self.first_seq + len(self.entries) - 1

    def add(self, changes: list[Change]) -> None:
        with self.lock:
            for kind, path, _is_dir in changes:
                if kind == "overflow":
                    entry = b""
                    self.overflow_at = self.seq + 1
                else:
                    entry = _KIND_LETTER[kind] + path
                self.entries.append(entry)
                self.nbytes += len(entry) + JOURNAL_ENTRY_COST
            while self.entries and (len(self.entries) > MAX_JOURNAL or self.nbytes > MAX_JOURNAL_BYTES):
                old = self.entries.popleft()
                self.nbytes -= len(old) + JOURNAL_ENTRY_COST
                self.dropped_at = self.first_seq
                self.first_seq += 1

    def cursor(self) -> int:
        with self.lock:
            return self.seq

    def report(self, cursor: int, complete: bool = True) -> ChangeReportRecord:
        """What changed since ``cursor``; ``complete`` False: the watcher cannot vouch for it
        (it ended, is behind, or does not watch all of the tree): overflow."""
        with self.lock:
            overflow = not complete or self.overflow_at > cursor or self.dropped_at > cursor
            newer = max(0, self.seq - max(cursor, self.first_seq - 1))  # only these are looked at
            since = list(itertools.islice(reversed(self.entries), newer))
        state: dict[bytes, tuple[int, int]] = {}  # path -> (first kind, last kind) as letters
        for entry in reversed(since):
            if entry:
                path = entry[1:]
                first = state.get(path)
                state[path] = (first[0] if first else entry[0], entry[0])
        lists: dict[str, list[bytes]] = {"created": [], "modified": [], "deleted": []}
        for path, (first_kind, last_kind) in state.items():
            net = merge(_LETTER_KIND[first_kind], _LETTER_KIND[last_kind])
            if net is not None:
                lists[net].append(path)
        from guestd.wire.paths import path_to_wire

        def listed(paths: list[bytes]) -> list[str | bytes]:
            # nsmallest, not sorted: a loop the GIL can leave, not one C call over 100,000 paths
            return [path_to_wire(os.fsdecode(p)) for p in heapq.nsmallest(MAX_REPORT, paths)]

        return {
            "created": listed(lists["created"]),
            "modified": listed(lists["modified"]),
            "deleted": listed(lists["deleted"]),
            "total": sum(len(v) for v in lists.values()),
            "truncated": any(len(v) > MAX_REPORT for v in lists.values()),
            "overflow": overflow,
        }


class WorkspaceChanges:
    """The workspace's journal (``services.changes``), its watcher started on first use and
    again after one ended (the changes meanwhile: overflow)."""

    def __init__(self, services: Services, start: Callable[..., Any]) -> None:
        self.services = services
        self.start = start  # (path, sink) -> a ready Watcher
        self.journal = Journal()
        self.watcher: Watcher | None = None
        self.lock = asyncio.Lock()

    async def _watcher(self) -> Watcher:
        async with self.lock:
            if self.watcher is not None and not self.watcher.alive:
                # Its thread died (logged): what changed since is not known.
                self.journal.add([("overflow", b"", False)])
                self.watcher.stop()
                self.watcher = None
            if self.watcher is None:
                workspace = self.services.config.workspace
                if not workspace:
                    raise GuestdError(
                        ErrorCode.UNAVAILABLE,
                        "no workspace is configured: no change journal",
                        details={"reason": "no_workspace"},
                    )
                self.watcher = await self.start(workspace, self.journal.add)
            return self.watcher

    async def _synced(self) -> bool:
        """Whether the journal holds every change made until now."""
        watcher = await self._watcher()
        synced: bool = await self.services.run_in_io(watcher.sync, SYNC_S)
        return synced and not watcher.incomplete

    async def begin(self) -> int:
        await self._synced()
        return self.journal.cursor()

    async def report(self, cursor: int) -> ChangeReportRecord:
        complete = await self._synced()
        # Off the loop: up to MAX_JOURNAL changes are merged and sorted.
        report: ChangeReportRecord = await self.services.run_in_io(self.journal.report, cursor, complete)
        return report
