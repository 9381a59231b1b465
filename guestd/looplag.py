"""An instrument for the bench: how long the event loop was kept from its work, and by what.

``GUESTD_LOOP_LAG=PATH`` turns it on (bench/load.py does; nothing else should). A timer due
every ``TICK_S`` measures how late it fires: a late tick is an iteration that ran long (callbacks,
a wait for the GIL held by another thread, a garbage collection), which is exactly what a ping
waiting in the socket's buffer pays. GC pauses are timed through ``gc.callbacks`` whatever thread
they run in (all of them hold the GIL). SIGUSR1 starts a new measurement, SIGUSR2 writes the
summary to PATH as JSON (also written at exit), so a bench can take one phase at a time; both
first collect what garbage there is, outside the figures: ``cyclic_garbage`` counts the objects
the collector freed meanwhile (what reference counting alone could not free: reference cycles),
which tests/test_exec_garbage.py keeps at zero per exec.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import time
from typing import Any

TICK_S = 0.001
_EDGES_MS = (0.5, 1, 2, 5, 10, 20, 50, 100)  # histogram buckets of lateness


class LoopLag:
    def __init__(self, path: str) -> None:
        self.path = path
        self.loop: asyncio.AbstractEventLoop | None = None
        self._due = 0.0
        self._cpu_at_tick = 0.0
        self._gc_started = (0.0, 0.0)
        self.sequence = 0  # summaries written: a reader waits for the next one
        self.reset()

    def reset(self) -> None:
        self.since = time.monotonic()
        self.ticks = 0
        self.worst: list[tuple[float, float]] = []  # (lateness s, monotonic time), the 10 worst
        # The loop thread's own CPU time between two ticks: the work of the iterations between
        # them, without the time the thread waited for a CPU or the GIL.
        self.worst_cpu: list[float] = []
        self.buckets = [0] * (len(_EDGES_MS) + 1)
        self.collected = 0
        self.gc_count = [0, 0, 0]
        self.gc_total_s = [0.0, 0.0, 0.0]
        self.gc_max_s = [0.0, 0.0, 0.0]
        self.gc_max_cpu_s = [0.0, 0.0, 0.0]  # the same pauses in CPU time: wall - CPU is time without a CPU

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._due = loop.time() + TICK_S
        self._cpu_at_tick = time.thread_time()
        loop.call_at(self._due, self._tick)
        gc.callbacks.append(self._on_gc)
        loop.add_signal_handler(signal.SIGUSR1, self._start_over)
        loop.add_signal_handler(signal.SIGUSR2, self.write)

    def _tick(self) -> None:
        assert self.loop is not None
        now = self.loop.time()
        cpu = time.thread_time()
        busy, self._cpu_at_tick = cpu - self._cpu_at_tick, cpu
        if len(self.worst_cpu) < 10 or busy > self.worst_cpu[-1]:
            self.worst_cpu.append(busy)
            self.worst_cpu.sort(reverse=True)
            del self.worst_cpu[10:]
        late = max(0.0, now - self._due)
        self.ticks += 1
        ms = late * 1000
        i = 0
        while i < len(_EDGES_MS) and ms >= _EDGES_MS[i]:
            i += 1
        self.buckets[i] += 1
        if len(self.worst) < 10 or late > self.worst[-1][0]:
            self.worst.append((late, time.monotonic()))
            self.worst.sort(reverse=True)
            del self.worst[10:]
        self._due = now + TICK_S
        self.loop.call_at(self._due, self._tick)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = (time.perf_counter(), time.thread_time())
            return
        g = int(info.get("generation", 0))
        self.collected += int(info.get("collected", 0))
        took = time.perf_counter() - self._gc_started[0]
        self.gc_max_cpu_s[g] = max(self.gc_max_cpu_s[g], time.thread_time() - self._gc_started[1])
        self.gc_count[g] += 1
        self.gc_total_s[g] += took
        self.gc_max_s[g] = max(self.gc_max_s[g], took)

    def summary(self) -> dict[str, Any]:
        labels = [f"<{e}ms" for e in _EDGES_MS] + [f">={_EDGES_MS[-1]}ms"]
        return {
            "seconds": time.monotonic() - self.since,
            "ticks": self.ticks,
            "max_late_ms": self.worst[0][0] * 1000 if self.worst else 0.0,
            "worst_late_ms": [round(w * 1000, 3) for w, _ in self.worst],
            "max_cpu_between_ticks_ms": self.worst_cpu[0] * 1000 if self.worst_cpu else 0.0,
            "worst_cpu_between_ticks_ms": [round(w * 1000, 3) for w in self.worst_cpu],
            "histogram": dict(zip(labels, self.buckets, strict=True)),
            "objects_per_gen": [len(gc.get_objects(g)) for g in range(3)],
            "frozen_objects": gc.get_freeze_count(),
            "gc": [
                {
                    "gen": g,
                    "count": self.gc_count[g],
                    "total_ms": self.gc_total_s[g] * 1000,
                    "max_ms": self.gc_max_s[g] * 1000,
                    "max_cpu_ms": self.gc_max_cpu_s[g] * 1000,
                }
                for g in range(3)
            ],
        }

    def _collect_unseen(self) -> int:
        """A full collection that the figures do not count; returns what it freed."""
        gc.callbacks.remove(self._on_gc)
        try:
            return gc.collect()
        finally:
            gc.callbacks.append(self._on_gc)

    def _start_over(self) -> None:
        self._collect_unseen()
        self.reset()
        self.write(collect=False)

    def write(self, collect: bool = True) -> None:
        summary = self.summary()
        summary["cyclic_garbage"] = self.collected + (self._collect_unseen() if collect else 0)
        self.sequence += 1
        summary["sequence"] = self.sequence
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(summary, f)
        os.replace(tmp, self.path)


def start_from_env(loop: asyncio.AbstractEventLoop) -> LoopLag | None:
    """The instrument, when ``GUESTD_LOOP_LAG`` names where to write (else None)."""
    path = os.environ.get("GUESTD_LOOP_LAG")
    if not path:
        return None
    lag = LoopLag(path)
    lag.start(loop)
    return lag
