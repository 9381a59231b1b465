"""Re-seeding code kernels at a restore through their side channel (issue 34; guestd.code.reseed).

Two contexts given the same random state stand for two clones of one context (a real clone
pair is tests/qemu/test_clones.py): after a restore their numbers must differ, also when the
restore lands while a cell runs. Privileged steps are simulated: this machine is untouched."""

from __future__ import annotations

import asyncio
import os
import random
import tempfile
import time
from collections.abc import Iterator

import pytest

from guestd.client import AsyncClient
from guestd.testing import Guestd, scratch_guestd


@pytest.fixture(scope="module")
def sg() -> Iterator[Guestd]:
    with scratch_guestd("guestd-reseed-", "--simulate-privileged", "--code-pool", "0") as g:
        yield g


@pytest.fixture()
def shared_dir() -> Iterator[str]:
    """A directory the kernels (the workload user when guestd is root) and the test both write."""
    with tempfile.TemporaryDirectory(prefix="guestd-reseed-marks-") as d:
        os.chmod(d, 0o777)
        yield d


async def _wait_for(path: str, within_s: float = 60.0) -> None:
    deadline = time.monotonic() + within_s
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} never appeared"
        await asyncio.sleep(0.02)


def _sibling_cell(marks: str, name: str, hold: str) -> str:
    """A cell that gives its kernel the state every clone of it would share (seed 42), says it
    runs, holds the interpreter as ``hold`` says until the test has restored, then draws."""
    return (
        "import os, random, time\n"
        "random.seed(42)\n"
        f"open({marks!r} + '/{name}', 'w').close()\n"
        f"{hold}\n"
        "time.sleep(0.3)\n"  # lets a thread run after a C call that held the interpreter
        "random.random()\n"
    )


def test_contexts_running_a_cell_are_reseeded_at_once_and_siblings_diverge(sg: Guestd, shared_dir: str) -> None:
    """Before: a context busy with a cell was only re-seeded before its next cell (listed
    pending), so the running cell went on drawing the parent's numbers: two clones of it drew
    the same ones (here: both cells returned the same number)."""
    wait_for_go = (
        "for _ in range(6000):\n"  # at most 60 s, a bounded wait for the test's go
        f"    if os.path.exists({shared_dir!r} + '/go'):\n"
        "        break\n"
        "    time.sleep(0.01)\n"
    )

    async def go() -> None:
        c = await AsyncClient.connect(sg.address)
        a, b = (await c.code_create()).id, (await c.code_create()).id
        runs = [
            asyncio.ensure_future(c.code_run(_sibling_cell(shared_dir, name, wait_for_go), context=ctx, timeout_s=90))
            for name, ctx in (("a", a), ("b", b))
        ]
        await _wait_for(f"{shared_dir}/a")
        await _wait_for(f"{shared_dir}/b")
        rep = await c.restore(entropy=os.urandom(32))  # on the cells' connection: it is kept
        assert {a, b} <= set(rep.contexts_reseeded) and not rep.contexts_pending and not rep.reseed_errors
        open(f"{shared_dir}/go", "w").close()
        first, second = await asyncio.gather(*runs)
        assert first.status == second.status == "ok"
        assert first.text != second.text, "clones of one context drew the same numbers after the restore"
        await c.close()

    asyncio.run(go())


def test_a_cell_holding_the_interpreter_does_not_hold_the_restore(sg: Guestd, shared_dir: str) -> None:
    """A C call that keeps the GIL (``sum`` over a long range) stops the kernel's re-seed thread
    too: the restore answers without it (pending) and the seed is applied when the call
    returns, within the running cell. Before: pending too, but never applied to the running
    cell, so both siblings drew the same number."""
    hold = "sum(range(200_000_000))"  # seconds of C holding the GIL

    async def go() -> None:
        c = await AsyncClient.connect(sg.address)
        a, b = (await c.code_create()).id, (await c.code_create()).id
        runs = [
            asyncio.ensure_future(c.code_run(_sibling_cell(shared_dir, name, hold), context=ctx, timeout_s=300))
            for name, ctx in (("a", a), ("b", b))
        ]
        await _wait_for(f"{shared_dir}/a")
        await _wait_for(f"{shared_dir}/b")
        rep = await c.restore(entropy=os.urandom(32))
        assert not any(r.done() for r in runs), "the restore waited for the cells"
        assert {a, b} <= set(rep.contexts_pending) and not rep.reseed_errors
        first, second = await asyncio.gather(*runs)
        assert first.status == second.status == "ok"
        assert first.text != second.text, "the seed was not applied within the running cell"
        await c.close()

    asyncio.run(go())


def test_the_pooled_kernel_is_reseeded_too() -> None:
    """A kernel waiting in the pool was in the snapshot too: before, it was never re-seeded, so
    every clone's first context drew the parent's numbers. Its seed comes from the host's
    entropy (guestd.code.reseed.kernel_seed), checked here number for number."""
    from guestd.code.reseed import kernel_seed
    from guestd.services import derive

    with scratch_guestd("guestd-reseed-pool-", "--simulate-privileged", "--code-pool", "1") as g:

        async def go() -> None:
            c = await AsyncClient.connect(g.address)
            deadline = time.monotonic() + 120
            await c.code_create()  # the pool starts with the first context
            while (await c.call("code.list"))["pool_ready"] < 1:
                assert time.monotonic() < deadline, "the pool never filled"
                await asyncio.sleep(0.1)
            entropy = os.urandom(32)
            rep = await c.restore(entropy=entropy)
            assert not rep.reseed_errors
            ctx = await c.code_create()
            assert ctx.pooled
            drawn = (await c.code_run("import random; random.random()", context=ctx.id)).text
            expected = random.Random(kernel_seed(derive(entropy, "code-kernels"), ctx.pid)).random()
            assert drawn == repr(expected)
            await c.close()

        asyncio.run(go())


def _find_channel(then: str) -> str:
    """Cell code: the kernel's end of its re-seed channel (the one SOCK_SEQPACKET socket it has)
    as ``ch``, then ``then``."""
    return (
        "import os, socket\n"
        "ch = None\n"
        "for fd in map(int, os.listdir('/proc/self/fd')):\n"
        "    try:\n"
        "        s = socket.socket(fileno=os.dup(fd))\n"
        "    except OSError:\n"
        "        continue\n"
        "    if s.type == socket.SOCK_SEQPACKET:\n"
        "        ch = s\n"
        "        break\n"
        "    s.close()\n"
        "assert ch is not None\n" + then
    )


@pytest.mark.parametrize(
    "abuse",
    [
        # fills guestd's receive side with noise until the kernel's send would block
        "ch.setblocking(False)\nn = 0\ntry:\n    while n < 1_000_000:\n        ch.send(b'x' * 8); n += 1\n"
        "except BlockingIOError:\n    pass\nprint(n)\n",
        # shuts the channel down both ways (the kernel's thread ends; guestd's sends fail)
        "ch.shutdown(socket.SHUT_RDWR)\n",
        # a thread of the cell takes guestd's seeds before the kernel's re-seed thread does
        "import threading\n"
        "threading.Thread(target=lambda: [ch.recv(100) for _ in range(10**6)], daemon=True).start()\n",
    ],
    ids=["flood", "shutdown", "steal"],
)
def test_a_cell_abusing_its_channel_neither_wedges_nor_fools_the_restore(sg: Guestd, abuse: str) -> None:
    """The kernel runs the workload's code: it can flood, shut or read its end. The restore
    still answers, within its bounds (guestd reads at most 64 messages per seed, never waits
    without a timeout), and the context is re-seeded all the same (a hidden cell), so a
    second restore with the same entropy gives the same numbers and another entropy others
    (with a thief, the same entropy gives one of two seeds: whichever thread read it)."""

    async def go() -> None:
        c = await AsyncClient.connect(sg.address)
        ctx = (await c.code_create()).id
        r = await c.code_run(_find_channel(abuse), context=ctx, timeout_s=60)
        assert r.status == "ok", r.error
        await c.restore()  # the first seed may still reach the kernel's own thread (flood): settled after
        outs = []
        for entropy in (b"x" * 32, b"x" * 32, b"y" * 32):
            t = time.monotonic()
            rep = await c.restore(entropy=entropy)
            assert time.monotonic() - t < 30  # the bound here is guestd's 1 s wait plus a hidden cell
            assert ctx in rep.contexts_reseeded and not rep.reseed_errors
            outs.append((await c.code_run("import random; random.random()", context=ctx)).text)
        assert outs[2] not in outs[:2]
        if "threading" not in abuse:
            assert outs[0] == outs[1]
        assert await c.ping() > 0
        await c.code_close(ctx)
        await c.close()

    asyncio.run(go())
