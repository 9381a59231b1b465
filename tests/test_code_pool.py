"""The warm kernel pool under creates that find it empty (issue 34: a burst of code.create).

A create that finds no ready pool kernel while the pool is already starting one takes that
kernel when it is up instead of starting another beside it on the same CPUs; the pool starts
no new kernel while creates wait for theirs; a create's cancel or its start_timeout_s leaves a
claimed kernel to the pool; guestd's stop ends a pool kernel mid-start.

Kernels are made slow deterministically: guestd's environment (which every kernel inherits)
puts a ``sitecustomize`` on PYTHONPATH that sleeps ``SLOW_START_S`` while the file ``SLOW_FLAG``
exists, and makes it exit at once while ``SLOW_FLAG.fail`` exists (unless the context's env has
``FIXED``); guestd itself starts before the flags are made.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import psutil
import pytest

from guestd.client import AsyncClient, GuestdError
from guestd.testing import REPO, Guestd, start_guestd

SLOW_START_S = 4.0
SITECUSTOMIZE = """import os, time
flag = os.environ.get("SLOW_FLAG")
if flag and os.path.exists(flag):
    time.sleep(float(os.environ.get("SLOW_START_S", "0")))
if flag and os.path.exists(flag + ".fail") and "FIXED" not in os.environ:
    os._exit(3)
"""
KERNEL_MARK = "guestd.code.kernel"  # in the command line of guestd's own kernel


@dataclass
class PoolGuest:
    g: Guestd
    flag: str
    stopped: bool = False

    def stop(self) -> None:
        self.stopped = True
        self.g.stop()

    def slow(self) -> None:
        with open(self.flag, "w"):
            pass

    def failing(self) -> None:
        with open(self.flag + ".fail", "w"):
            pass

    def fast(self) -> None:
        for path in (self.flag, self.flag + ".fail"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def kernels(self) -> set[int]:
        """The kernel processes under guestd now (starting, pooled or a context's)."""
        out = set()
        for p in psutil.Process(self.g.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if p.status() != psutil.STATUS_ZOMBIE and KERNEL_MARK in " ".join(p.cmdline()):
                    out.add(p.pid)
        return out

    def pool_ready(self, size: int) -> None:
        """Bounded: the pool holds ``size`` kernels."""
        with self.g.client() as c:
            for _ in range(1200):
                if c.call("code.list")["pool_ready"] >= size:
                    return
                time.sleep(0.05)
        raise AssertionError(f"the pool never held {size} kernel(s)")


@contextlib.contextmanager
def pool_guest(*args: str) -> Iterator[PoolGuest]:
    top = tempfile.mkdtemp(prefix="guestd-pool-")
    try:
        os.chmod(top, 0o755)
        os.makedirs(f"{top}/slow", mode=0o755)
        with open(f"{top}/slow/sitecustomize.py", "w") as f:
            f.write(SITECUSTOMIZE)
        env = {"PYTHONPATH": f"{top}/slow:{REPO}", "SLOW_FLAG": f"{top}/slow-flag", "SLOW_START_S": str(SLOW_START_S)}
        g = start_guestd(top, "--runtime-dir", f"{top}/rt", *args, env=env)
        try:
            pg = PoolGuest(g, f"{top}/slow-flag")
            yield pg
            assert pg.stopped or g.alive(), g.log()
        finally:
            g.stop()
    finally:
        shutil.rmtree(top, ignore_errors=True)


class Sampler:
    """The kernel processes seen under guestd while a block runs, sampled every 20 ms."""

    def __init__(self, sample: Callable[[], set[int]]) -> None:
        self.sample = sample
        self.most_at_once = 0
        self.seen: set[int] = set()
        self.first_seen: dict[int, int] = {}  # pid -> its order of first appearance
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            now = self.sample()
            for pid in now - self.seen:
                self.first_seen[pid] = len(self.first_seen)
            self.seen |= now
            self.most_at_once = max(self.most_at_once, len(now))
            self._stop.wait(0.02)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def test_a_create_takes_the_pool_kernel_already_starting_instead_of_starting_another() -> None:
    # The first create of a guestd with a pool starts the pool: its kernel is ahead of (or level
    # with) any kernel this create could start. Before, the create started its own beside it:
    # two kernels starting at once on the same CPUs, and pooled was false.
    with pool_guest("--code-pool", "1") as pg:
        pg.slow()
        with pg.g.client() as c, Sampler(pg.kernels) as seen:
            ctx = c.code_create(deadline=120)
        assert ctx.pooled
        # one kernel at a time while the create waited; the pool's next one starts once it has its
        # kernel, which may be before the create's reply is read here (seen in a loaded CI run):
        # a second kernel only after the context's own, never one started beside it
        later = [pid for pid in seen.seen if seen.first_seen[pid] > seen.first_seen[ctx.pid]]
        assert seen.most_at_once == 1 or (seen.most_at_once == 2 and len(later) == 1), seen.first_seen
        pg.fast()
        pg.pool_ready(1)
        with pg.g.client() as c:
            assert c.code_run("6 * 7", context=ctx.id).text == "42"
            assert len(pg.kernels()) == 2


def test_a_burst_takes_the_ready_kernel_then_the_starting_one_and_the_pool_refills_after() -> None:
    # Pool 1, three creates at once: the first takes the ready kernel (its take starts the
    # refill), the second the refill's kernel as it comes up, the third starts its own; the
    # pool starts no new kernel while they wait. Before: one was pooled and the refill started
    # a third kernel beside the two cold creates.
    with pool_guest("--code-pool", "1", "--code-prewarm") as pg:
        pg.pool_ready(1)

        async def burst() -> list[tuple[bool, int]]:
            c = await AsyncClient.connect(pg.g.address)
            try:
                made = await asyncio.gather(*(c.code_create() for _ in range(3)))
                return [(m.pooled, m.pid) for m in made]
            finally:
                await c.close()

        with Sampler(pg.kernels) as seen:
            made = asyncio.run(burst())
        assert sum(pooled for pooled, _ in made) == 2, made
        # The two creates' kernels and the one they took; the pool's refill starts once the last
        # create has its kernel, which may be before the client reads that reply (4 seen in a
        # loaded clean-clone CI run): a fourth only after all three, never one beside them.
        last = max(seen.first_seen[pid] for _, pid in made)
        later = [pid for pid in seen.seen if seen.first_seen[pid] > last]
        assert seen.most_at_once <= 3 or (seen.most_at_once == 4 and len(later) == 1), seen.first_seen
        pg.pool_ready(1)
        assert len(pg.kernels()) == 4  # three contexts, one pooled: no kernel beyond the bound


def test_a_cancelled_create_leaves_its_claimed_pool_kernel_to_the_pool() -> None:
    with pool_guest("--code-pool", "1") as pg:
        pg.slow()
        with pg.g.client() as c, Sampler(pg.kernels) as seen:
            with pytest.raises(GuestdError) as ei:
                c.code_create(deadline=1)  # the client's deadline: the request is cancelled in guestd
            assert ei.value.code == "timeout"
            pg.fast()
            pg.pool_ready(1)
            assert c.call("code.list")["contexts"] == []
        # The pool's kernel only, never a second beside it (seen once in a loaded CI run: the
        # guestd log says whether a start was given up on and retried).
        assert seen.most_at_once == 1, (seen.seen, pg.g.log()[-4000:])
        (pooled_pid,) = pg.kernels()
        with pg.g.client() as c:
            ctx = c.code_create()
            assert ctx.pooled and ctx.pid == pooled_pid


def test_a_start_timeout_bounds_the_wait_for_a_claimed_pool_kernel() -> None:
    with pool_guest("--code-pool", "1") as pg:
        pg.slow()
        with pg.g.client() as c, Sampler(pg.kernels) as seen:
            with pytest.raises(GuestdError) as ei:
                c.code_create(start_timeout_s=1)
            err = ei.value
            assert err.code == "unavailable", err
            assert (err.details["stage"], err.details["reason"], err.details["start_timeout_s"]) == (
                "start",
                "start_timeout",
                1,
            )
            assert c.call("code.list")["contexts"] == []
            pg.fast()
            pg.pool_ready(1)  # the kernel it gave up on comes up and stays in the pool
        assert seen.most_at_once == 1, seen.seen


def test_stopping_guestd_ends_a_pool_kernel_mid_start_and_its_waiting_create() -> None:
    with pool_guest("--code-pool", "1") as pg:
        pg.slow()

        async def wait_and_stop() -> BaseException | None:
            c = await AsyncClient.connect(pg.g.address)
            create = asyncio.ensure_future(c.code_create())
            for _ in range(500):  # the create is waiting once a kernel is starting
                if pg.kernels():
                    break
                await asyncio.sleep(0.02)
            starting = pg.kernels()
            assert len(starting) == 1
            await asyncio.to_thread(pg.stop)
            try:
                await asyncio.wait_for(create, 30)
            except BaseException as exc:  # any end but a context will do
                outcome: BaseException | None = exc
            else:
                outcome = None
            with contextlib.suppress(Exception):
                await c.close()
            for pid in starting:
                for _ in range(250):
                    if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                        break
                    await asyncio.sleep(0.02)
                else:
                    raise AssertionError(f"kernel {pid} outlived guestd")
            return outcome

        outcome = asyncio.run(wait_and_stop())
        assert outcome is not None, "a create got a context from a guestd that was stopping"
        pg.fast()


def test_a_create_whose_claimed_pool_kernel_fails_to_start_starts_its_own() -> None:
    with pool_guest("--code-pool", "1") as pg:
        pg.failing()  # every kernel without FIXED in its env exits at once: the pool's do
        with pg.g.client() as c:
            ctx = c.code_create(env={"FIXED": "1"}, deadline=120)  # claims the pool's first, then its own
            assert not ctx.pooled
            assert c.code_run("6 * 7", context=ctx.id).text == "42"
            assert c.call("code.list")["pool_ready"] == 0  # the pool backs off after its failure
        assert "pool kernel failed to start" in pg.g.log()
        pg.fast()
