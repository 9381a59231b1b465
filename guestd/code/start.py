"""How long a kernel may take to start, and what a start that gives up leaves.

A fixed wait failed slow guests: a QEMU TCG guest under load needed more than 30 s to import
ipykernel, every ``code.create`` failed, and the pool kept starting kernels that failed the
same way. So the wait is either the host's (``code.create {start_timeout_s}``, a hard bound up
to ``MAX_START_TIMEOUT_S``) or follows the kernel: guestd waits while the kernel's processes
make progress (they use CPU or read), gives up after ``STALL_S`` without any, and after
``CAP_S`` in all. A kernel that is slow but working gets its context; one that hangs is given
up within ``STALL_S``. Whatever gave up, the caller then ends the whole kernel (its leaf cgroup
or process tree) before it answers (``Kernel.shutdown``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any

from guestd.wire.errors import ErrorCode, GuestdError

STALL_S = 30.0  # the default wait: this long without progress, then the start fails
CAP_S = 300.0  # ... and this long in all, progress or not
MAX_START_TIMEOUT_S = 600.0  # the longest start_timeout_s a request may ask for
LOOK_EVERY_S = 1.0  # how often progress is sampled
MAX_SAMPLED = 64  # processes of a starting kernel looked at per sample (a fork bomb costs no more)


@dataclass(frozen=True, slots=True)
class StartWait:
    """One kernel start's bound: the host's ``timeout_s`` (a hard bound), or with None guestd's
    default that follows the kernel's progress (``stall_s`` without, ``cap_s`` in all)."""

    timeout_s: float | None = None
    stall_s: float = STALL_S
    cap_s: float = CAP_S

    def deadline(self, began: float, last_progress: float) -> float:
        if self.timeout_s is not None:
            return began + self.timeout_s
        return min(last_progress + self.stall_s, began + self.cap_s)


def work_done(pids: Iterable[int]) -> tuple[int, ...]:
    """What these processes have done so far: CPU ticks and bytes read, per process (a sample
    that changes while any of them works; a process that execs keeps its counters). Processes
    that are gone or unreadable add nothing."""
    sample: list[int] = []
    for pid in itertools.islice(pids, MAX_SAMPLED):
        sample += [pid, _cpu_ticks(pid), _chars_read(pid)]
    return tuple(sample)


def _cpu_ticks(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read(4096).rpartition(b")")[2].split()
        return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    except (OSError, ValueError, IndexError):
        return 0


def _chars_read(pid: int) -> int:
    """rchar of /proc/<pid>/io: a start blocked on a slow disk progresses as its reads complete
    (guestd as root reads it; a non-dumpable kernel's is root's, so otherwise it is 0)."""
    try:
        with open(f"/proc/{pid}/io", "rb") as f:
            for line in f:
                if line.startswith(b"rchar:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


async def within(
    wait: StartWait,
    coming_up: Coroutine[Any, Any, None],
    died: asyncio.Future[str],
    sample: Callable[[], tuple[int, ...]],
) -> None:
    """Run ``coming_up`` (the kernel's hand-over and first answer) until it ends, the kernel dies
    (``died``) or the wait runs out; the last two raise ``unavailable`` (details.stage start,
    details.reason exited, start_timeout or no_progress, and the seconds waited). ``sample``:
    the kernel's :func:`work_done`, for the default wait. ``coming_up`` is cancelled (and its
    end awaited) whenever this returns without it, a cancel of the caller included."""
    loop = asyncio.get_running_loop()
    task: asyncio.Future[Any] = asyncio.ensure_future(coming_up)
    watched: set[asyncio.Future[Any]] = {task, died}
    began = last_progress = loop.time()
    last = sample() if wait.timeout_s is None else ()
    try:
        while True:
            left = wait.deadline(began, last_progress) - loop.time()
            if left <= 0:
                raise gave_up(wait, loop.time() - began, last_progress - began)
            done, _ = await asyncio.wait(watched, timeout=min(LOOK_EVERY_S, left), return_when="FIRST_COMPLETED")
            if task in done:
                task.result()  # its own error, if it failed
                return
            if died in done:
                raise GuestdError(
                    ErrorCode.UNAVAILABLE,
                    f"kernel failed to start: {died.result()}",
                    details={"stage": "start", "reason": "exited", "waited_s": round(loop.time() - began, 3)},
                )
            if wait.timeout_s is None:
                now = sample()
                if now != last:
                    last, last_progress = now, loop.time()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


def gave_up(wait: StartWait, waited: float, progressed_until: float) -> GuestdError:
    """The ``unavailable`` of a start ``wait`` gave up on after ``waited`` s (progress seen until
    ``progressed_until`` s into it); also a create's bounded wait for a pool kernel it claimed."""
    details: dict[str, Any] = {"stage": "start", "waited_s": round(waited, 3), "start_timeout_s": wait.timeout_s}
    if wait.timeout_s is not None:
        details["reason"] = "start_timeout"
        why = f"not ready within start_timeout_s {wait.timeout_s:g} s"
    elif waited >= wait.cap_s:
        details["reason"] = "start_timeout"
        why = f"not ready within {wait.cap_s:g} s (guestd's longest default start wait)"
    else:
        details["reason"] = "no_progress"
        why = (
            f"not ready, and it used no CPU and read nothing for {wait.stall_s:g} s "
            f"(it last progressed {progressed_until:.1f} s into the start)"
        )
    return GuestdError(ErrorCode.UNAVAILABLE, f"kernel failed to start: {why}", details=details)


def kernel_pids(leader: int, cgroup_pids: Callable[[], list[int]] | None) -> list[int]:
    """The processes of a starting kernel: its leaf cgroup's, or the leader and its children."""
    if cgroup_pids is not None:
        with contextlib.suppress(OSError):
            return cgroup_pids()
    pids = [leader]
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{leader}/task"):
            with open(f"/proc/{leader}/task/{task}/children") as f:
                pids += [int(p) for p in f.read().split()]
    return pids
