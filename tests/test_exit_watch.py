"""children.tree.ExitWatch, the one exit watcher of exec, processes, shells and code kernels:
a pidfd where the kernel has one, polling where it does not (forced here), both with real children."""

from __future__ import annotations

import asyncio
import os
import subprocess

import pytest

from guestd.children.tree import ExitWatch, try_reap


async def watch_exit(argv: list[str]) -> tuple[int, int]:
    """Run argv and wait for the watch to reap it: (exit status, wake-ups)."""
    loop = asyncio.get_running_loop()
    proc = subprocess.Popen(argv)
    done: asyncio.Future[int] = loop.create_future()
    wakeups = 0

    def ready() -> None:
        nonlocal wakeups
        wakeups += 1
        st = try_reap(proc.pid)
        if st is not None:
            proc.returncode = os.waitstatus_to_exitcode(st)
            watch.close()
            done.set_result(proc.returncode)

    watch = ExitWatch(loop, proc.pid, ready, 0.01)
    code = await asyncio.wait_for(done, 30)
    watch.close()  # idempotent
    assert watch.fd is None and watch.timer is None
    await asyncio.sleep(0.05)  # no wake-up after close
    return code, wakeups


def test_pidfd_wakes_once_when_the_child_exits() -> None:
    code, wakeups = asyncio.run(watch_exit(["sh", "-c", "sleep 0.2; exit 7"]))
    assert code == 7 and wakeups == 1


def test_without_pidfd_it_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_pidfd(pid: int, flags: int = 0) -> int:
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    code, wakeups = asyncio.run(watch_exit(["sh", "-c", "sleep 0.2; exit 3"]))
    assert code == 3 and wakeups >= 5  # polled every 10 ms while it slept
