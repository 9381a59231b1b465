"""Issue 29, defect 12: a kernel start that gives up ends what it started, and a slow guest still
gets its context.

A kernel is made slow deterministically: guestd's own kernel through a ``sitecustomize`` on the
context's PYTHONPATH, a kernelspec's through its command; each sleeps ``SLOW_START_S`` while the
file ``SLOW_FLAG`` exists. A start slower than the context's ``start_timeout_s`` fails typed
(``unavailable``, details.reason ``start_timeout``) and none of its processes is left when the
answer comes (guestd's process tree; with a workload cgroup, its leaves); a larger wait lets a
kernel slower than the old fixed 30 s start; restarts follow the context's wait; a create the
client cancels ends its kernel too. Without start_timeout_s the wait follows the kernel's
progress (guestd.code.start, driven here against real processes)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psutil
import pytest

from guestd.client import GuestdError
from guestd.testing import REPO, Guestd, start_guestd

if TYPE_CHECKING:  # imported where used: the test module must load on a guestd without it
    from guestd.code.start import StartWait

SLOW_KERNEL = "slowpy"  # the kernelspec: sleeps while SLOW_FLAG exists, then ipykernel
SITECUSTOMIZE = """import os, time
flag = os.environ.get("SLOW_FLAG")
if flag and os.path.exists(flag):
    time.sleep(float(os.environ.get("SLOW_START_S", "0")))
"""
SLOW_SH = 'if [ -e "$SLOW_FLAG" ]; then sleep "$SLOW_START_S"; fi; exec "$0" -m ipykernel_launcher -f "$1"'


@dataclass
class Guest:
    g: Guestd
    top: str  # a directory every user can read (the slow flag, the sitecustomize)
    workload_cgroup: str | None  # the workload cgroup, when guestd has one

    def slow_env(self, kernel: str, seconds: float, flag: bool = True) -> dict[str, str]:
        """The context's env making its kernel sleep ``seconds`` at start while the flag is there."""
        path = f"{self.top}/slow-flag"
        if flag:
            with open(path, "w"):
                pass
        else:
            self.fast_again()
        env = {"SLOW_FLAG": path, "SLOW_START_S": str(seconds)}
        if kernel == "python":
            env["PYTHONPATH"] = f"{self.top}/slow:{REPO}"
        return env

    def fast_again(self) -> None:
        """Kernels of every context start at once again."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"{self.top}/slow-flag")

    def leftovers(self) -> list[str]:
        """Live processes under guestd and in the workload cgroup's leaves: a kernel's, since
        these tests start nothing else."""
        out = []
        for p in psutil.Process(self.g.pid).children(recursive=True):
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    out.append(f"{p.pid} {' '.join(p.cmdline())[:100]}")
            except psutil.Error:
                continue
        if self.workload_cgroup is not None:
            for leaf, _, names in os.walk(self.workload_cgroup):
                if "cgroup.procs" in names:
                    with open(f"{leaf}/cgroup.procs") as f:
                        out += [f"{pid} in {leaf}" for pid in f.read().split()]
        return out

    def zombies(self) -> list[int]:
        return [p.pid for p in psutil.Process(self.g.pid).children(recursive=True) if _zombie(p)]


def _zombie(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _prepare(top: str, python: str) -> str:
    """The slow sitecustomize and the slow kernelspec under ``top``; returns the JUPYTER_PATH."""
    os.chmod(top, 0o755)
    os.makedirs(f"{top}/slow", mode=0o755)
    with open(f"{top}/slow/sitecustomize.py", "w") as f:
        f.write(SITECUSTOMIZE)
    spec = f"{top}/jp/kernels/{SLOW_KERNEL}"
    os.makedirs(spec)
    with open(f"{spec}/kernel.json", "w") as f:
        json.dump({"argv": ["/bin/sh", "-c", SLOW_SH, python, "{connection_file}"], "language": "python"}, f)
    for here, dirs, files in os.walk(top):
        for name in dirs + files:
            os.chmod(os.path.join(here, name), 0o755)
    return f"{top}/jp"


@pytest.fixture(scope="module")
def plain() -> Iterator[Guest]:
    """guestd as this user (no workload cgroup), no pool."""
    top = tempfile.mkdtemp(prefix="guestd-kstart-")
    jp = _prepare(top, sys.executable)
    g = start_guestd(top, "--runtime-dir", f"{top}/rt", "--code-pool", "0", env={"JUPYTER_PATH": jp})
    try:
        yield Guest(g, top, None)
        assert g.alive(), g.log()
    finally:
        g.stop()
        shutil.rmtree(top, ignore_errors=True)


@pytest.fixture(scope="module")
def contained(scratch: str, workload_py: str) -> Iterator[Guest]:
    """guestd as root in the shipped shape: kernels as nobody in leaves of a workload cgroup."""
    from guestd.testing.cgroups import contained_config

    top = tempfile.mkdtemp(prefix="guestd-kstart-c-")
    jp = _prepare(top, workload_py)
    workload = os.path.join(scratch, "kstart")
    g = start_guestd(
        top,
        "--config",
        contained_config(top, workload),
        "--runtime-dir",
        f"{top}/rt",
        "--code-pool",
        "0",
        python=workload_py,
        env={"JUPYTER_PATH": jp},
    )
    try:
        yield Guest(g, top, workload)
        assert g.alive(), g.log()
    finally:
        g.stop()
        shutil.rmtree(top, ignore_errors=True)


@pytest.fixture(params=["plain", "contained"])
def guest(request: pytest.FixtureRequest) -> Guest:
    return request.getfixturevalue(request.param)  # type: ignore[no-any-return]


def _settled(guest: Guest) -> None:
    """Bounded: the zombies of what was killed are reaped (guestd's sweep), nothing else is left."""
    for _ in range(200):
        if not guest.zombies() and not guest.leftovers():
            return
        time.sleep(0.05)
    raise AssertionError(f"left behind: {guest.leftovers()}, zombies {guest.zombies()}")


@pytest.mark.parametrize("kernel", ["python", SLOW_KERNEL])
def test_a_kernel_slower_than_its_start_wait_fails_typed_and_leaves_nothing(guest: Guest, kernel: str) -> None:
    with guest.g.client() as c:
        with pytest.raises(GuestdError) as ei:
            c.code_create(kernel=kernel, env=guest.slow_env(kernel, 600), start_timeout_s=2)
        err = ei.value
        assert err.code == "unavailable", err
        assert (err.details["stage"], err.details["reason"], err.details["start_timeout_s"]) == (
            "start",
            "start_timeout",
            2,
        )
        # Ended before the answer: nothing of it runs now (the old code answered first, after a
        # fixed 30 s, and its own kernel was never reaped by its owner).
        assert guest.leftovers() == []
        guest.fast_again()
        _settled(guest)
        assert c.call("code.list")["contexts"] == []
    assert "did not exit after SIGKILL" not in guest.g.log()


def test_a_larger_start_wait_gives_a_kernel_slower_than_the_old_fixed_wait_its_context(plain: Guest) -> None:
    # 33 s: more than the 30 s guestd used to wait whatever the host needed.
    with plain.g.client() as c:
        ctx = c.code_create(kernel=SLOW_KERNEL, env=plain.slow_env(SLOW_KERNEL, 33), start_timeout_s=120)
        try:
            assert c.code_run("print(6 * 7)", context=ctx.id).stdout == b"42\n"
        finally:
            plain.fast_again()
            c.code_close(ctx.id)
    _settled(plain)


def test_a_restart_waits_as_long_as_its_context_says_and_a_given_up_one_leaves_nothing(plain: Guest) -> None:
    with plain.g.client() as c:
        ctx = c.code_create(env=plain.slow_env("python", 600, flag=False), start_timeout_s=20)
        try:
            assert c.code_run("x = 1; x", context=ctx.id).text == "1"
            plain.slow_env("python", 600)  # the next start of this context sleeps
            with pytest.raises(GuestdError) as ei:
                c.code_restart(ctx.id, deadline=60)
            assert ei.value.code == "unavailable" and ei.value.details["reason"] == "start_timeout"
            assert ei.value.details["start_timeout_s"] == 20
            assert plain.leftovers() == []
            plain.fast_again()
            c.code_restart(ctx.id)
            assert c.code_run("'x' in dir()", context=ctx.id).text == "False"
        finally:
            c.code_close(ctx.id)
    _settled(plain)


@pytest.mark.parametrize("kernel", ["python", SLOW_KERNEL])
def test_a_create_the_client_cancels_mid_start_ends_its_kernel(guest: Guest, kernel: str) -> None:
    with guest.g.client() as c:
        with pytest.raises(GuestdError) as ei:
            c.code_create(kernel=kernel, env=guest.slow_env(kernel, 600), deadline=2)
        assert ei.value.code == "timeout"  # the client's deadline: the request is cancelled in the guest
        _settled(guest)
        assert c.call("code.list")["contexts"] == []
        guest.fast_again()
        ctx = c.code_create(kernel=kernel)  # and guestd starts the next one as usual
        c.code_close(ctx.id)
    _settled(guest)
    assert "did not exit after SIGKILL" not in guest.g.log()


def test_a_start_timeout_beyond_the_limit_is_refused(plain: Guest) -> None:
    from guestd.code.start import MAX_START_TIMEOUT_S
    from guestd.wire.schema import OPS_BY_NAME

    assert OPS_BY_NAME["code.create"].fields_by_name["start_timeout_s"].le == MAX_START_TIMEOUT_S
    with plain.g.client() as c:
        for bad in (0, MAX_START_TIMEOUT_S + 1):
            with pytest.raises(GuestdError) as ei:
                c.call("code.create", {"start_timeout_s": bad})
            assert ei.value.code == "bad_request" and ei.value.details.get("field") == "start_timeout_s"


# -- the default wait, against real processes -------------------------------------------------

BUSY = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end: pass\nprint('up')"
IDLE = "import sys, time\ntime.sleep(float(sys.argv[1]))\nprint('up')"


async def _start(script: str, seconds: float, wait: StartWait) -> float:
    """A process doing ``script`` for ``seconds`` then saying "up", under ``within``; returns the
    time it took (the error ``within`` raised otherwise). The process is killed either way."""
    from guestd.code.start import within, work_done

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, str(seconds), stdout=asyncio.subprocess.PIPE
    )
    assert proc.stdout is not None
    died: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def up() -> None:
        assert proc.stdout is not None
        assert await proc.stdout.readline() == b"up\n"

    began = time.monotonic()
    try:
        await within(wait, up(), died, lambda: work_done([proc.pid]))
        return time.monotonic() - began
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


def test_the_default_wait_follows_a_kernel_that_works_and_gives_up_on_one_that_does_not() -> None:
    from guestd.code.start import StartWait

    async def main() -> None:
        # Busy for 3 s, three times the stall window: it progresses, so it gets its start.
        await _start(BUSY, 3.0, StartWait(stall_s=1.0, cap_s=60.0))
        # Asleep for 30 s: no CPU, nothing read; given up once the stall window passes.
        with pytest.raises(GuestdError) as ei:
            await _start(IDLE, 30.0, StartWait(stall_s=1.0, cap_s=60.0))
        assert ei.value.code == "unavailable" and ei.value.details["reason"] == "no_progress"
        # Busy beyond the cap: given up at the cap however much it works.
        with pytest.raises(GuestdError) as ei:
            await _start(BUSY, 30.0, StartWait(stall_s=10.0, cap_s=1.5))
        assert ei.value.details["reason"] == "start_timeout" and ei.value.details["start_timeout_s"] is None
        # The host's wait is a hard bound: progress does not extend it.
        with pytest.raises(GuestdError) as ei:
            await _start(BUSY, 30.0, StartWait(timeout_s=1.5))
        assert ei.value.details["reason"] == "start_timeout" and ei.value.details["start_timeout_s"] == 1.5

    asyncio.run(main())
