"""A fault in guestd's own code while a finished native spawn is handed to its request (the
loop's ``_collect``) fails that one request with a typed internal error: it never waits forever
(process.start has no deadline), the process it started is killed, its fds and leaf do not
leak, and the other spawns of the same batch still finish. The fault is injected into guestd's
code; the spawns, pipes, children and leaves are real."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import uvloop

from guestd.children import Child, spawner
from guestd.children import child as child_module
from guestd.children.cgroups import WorkloadCgroup, WorkloadConfig
from guestd.children.launch import load_native
from guestd.children.spawner import Children
from guestd.wire.errors import ErrorCode, GuestdError

pytestmark = pytest.mark.skipif(load_native() is None, reason="needs the clone3 spawn extension")


class _FailingOnce(set):  # type: ignore[type-arg]
    """``Children.live``: its first add raises, as a bug after the Child was made would."""

    def __init__(self) -> None:
        super().__init__()
        self.failed = False

    def add(self, item: Any) -> None:
        if not self.failed:
            self.failed = True
            raise RuntimeError("injected: after the child was made")
        super().add(item)


def _open_fds() -> set[int]:
    """Open fds, after a first uvloop has run (libuv keeps a pipe of its own from then on)."""
    _run(asyncio.sleep, 0)
    return {int(n) for n in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{n}")}


def _killed_by(pid: int) -> int | None:
    """Reap ``pid`` (the test process is its parent: nothing else reaps it) and say which
    signal ended it."""
    _, status = os.waitpid(pid, 0)
    return os.WTERMSIG(status) if os.WIFSIGNALED(status) else None


@pytest.fixture
def workload(request: pytest.FixtureRequest) -> Iterator[WorkloadCgroup]:
    if request.param == "no cgroup":
        yield WorkloadCgroup(WorkloadConfig())  # runs are process groups
        return
    scratch = request.getfixturevalue("scratch")
    wl = WorkloadCgroup(WorkloadConfig(cgroup=os.path.join(scratch, "collect")))
    wl.setup()
    assert wl.path is not None, wl.status
    yield wl


def _run(test: Any, *args: Any) -> None:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(test(*args))


def _leaves(wl: WorkloadCgroup) -> list[str]:
    if wl.path is None:
        return []
    return [n for n in os.listdir(wl.path) if n.startswith("exec-")]


async def _two_cats_one_faulted(children: Children) -> None:
    """Two `cat` spawns at once (collected in one batch or two, in either order): the one that
    meets the fault fails with a typed internal error, the other is not held by it and runs to
    its end (it exits 0 at the end of its input)."""
    results = await asyncio.wait_for(
        asyncio.gather(
            *(children.spawn(["cat"], kind="exec", stdin=spawner.PIPE, stdout=spawner.DEVNULL) for _ in range(2)),
            return_exceptions=True,
        ),
        timeout=30,
    )
    failed = [r for r in results if isinstance(r, BaseException)]
    fine = [r for r in results if not isinstance(r, BaseException)]
    assert len(failed) == 1 and len(fine) == 1, results
    error = failed[0]
    assert isinstance(error, GuestdError) and error.code == ErrorCode.INTERNAL, error
    assert error.details == {"stage": "spawn"} and "'cat'" in error.message
    other = fine[0]
    other.watch()
    other.close_fd("stdin")
    await asyncio.wait_for(other.exited, timeout=30)
    assert other.status == 0
    other.release()


@pytest.mark.parametrize("where", ["before the child", "after the child"])
@pytest.mark.parametrize("workload", ["no cgroup", "a leaf per run"], indirect=True)
def test_a_fault_while_collecting_fails_that_spawn_typed_and_ends_its_process(
    where: str, workload: WorkloadCgroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    wl = workload
    children = Children(wl, lambda: None)  # no subreaper here: the test reaps its own children
    started: list[int] = []
    real_child = Child

    def child_failing_once(owner: Any, kind: str, pid: int, *rest: Any) -> Any:
        started.append(pid)
        if where == "before the child" and len(started) == 1:
            raise RuntimeError("injected: before the child was made")
        return real_child(owner, kind, pid, *rest)

    monkeypatch.setattr(child_module, "Child", child_failing_once)  # where the spawner gets it
    if where == "after the child":
        children.live = _FailingOnce()
    fds_before = _open_fds()

    async def test() -> None:
        await _two_cats_one_faulted(children)
        # The faulted spawn's process: killed, not left running for the session.
        assert _killed_by(started[0]) == signal.SIGKILL  # the first to be collected met the fault
        for _ in range(500):  # its leaf goes once it is empty (the lingering sweep)
            children.sweep()
            if not _leaves(wl) and not children.lingering:
                break
            await asyncio.sleep(0.01)
        assert _leaves(wl) == [] and not children.live

    _run(test)
    # Pipes, pidfds and leaf fds of both spawns are closed (the spawn threads' eventfd, /dev/null
    # and the workload's directory fd stay open for the next spawns, as in guestd).
    kept = {fd for fd in (children._done_fd, children._null_fd, wl._dir_fd) if fd is not None and fd >= 0}
    left = _open_fds() - fds_before - kept
    assert left == set(), {fd: os.readlink(f"/proc/self/fd/{fd}") for fd in left}


def test_a_fault_part_way_through_closing_never_closes_an_fd_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """``finish`` fails on the second of the child's pipe ends (another bug closed it already);
    the number the first one freed is taken by a file opened meanwhile (here by a log handler,
    as a spawn thread's openat could). ``abandon`` must leave that file open, still kill the
    process first and fail the request typed, and the other spawn of the batch still finishes.
    Before: abandon closed the new file, and an error out of abandon dropped the batch."""
    children = Children(WorkloadCgroup(WorkloadConfig()), lambda: None)
    real_collect = spawner._collect_native
    faulted: list[int] = []
    freed: list[int] = []  # the child's ends of the faulted spawn: their numbers come free
    opened: list[int] = []

    def collect_with_a_closed_end() -> Any:
        done = real_collect()
        if done and not faulted:
            pending, outcome = done[0]
            assert isinstance(outcome, tuple)
            faulted.append(outcome[0])
            freed.extend(pending.theirs)
            os.close(pending.theirs[0])  # closed by "another bug": finish's close of it fails
        return done

    class OpensAFile(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if not opened:
                opened.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))

    monkeypatch.setattr(spawner, "_collect_native", collect_with_a_closed_end)
    handler = OpensAFile()
    logging.getLogger("guestd.children").addHandler(handler)
    try:

        async def test() -> None:
            await _two_cats_one_faulted(children)

        _run(test)
        assert opened and opened[0] in freed, (opened, freed)  # the file took a number the spawn had
        assert os.path.exists(f"/proc/self/fd/{opened[0]}"), "abandon closed a file it did not own"
        assert _killed_by(faulted[0]) == signal.SIGKILL
    finally:
        logging.getLogger("guestd.children").removeHandler(handler)
        for fd in opened:
            os.close(fd)


def test_a_run_handle_that_cannot_load_fails_the_spawn_before_any_process_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The run handle loads at the first spawn (off guestd's start path): if that import fails
    (fds or memory exhausted, an unreadable file), no process has started yet, so none is left
    untracked; the spawn raises and the next one, once it can load, works."""
    import psutil

    children = Children(WorkloadCgroup(WorkloadConfig()), lambda: None)
    before = {p.pid for p in psutil.Process().children()}
    monkeypatch.setitem(sys.modules, "guestd.children.child", None)  # its import raises ImportError

    async def spawn() -> Child:
        return await children.spawn(["sleep", "30"], kind="exec", stdout=spawner.DEVNULL, stderr=spawner.DEVNULL)

    with pytest.raises(ImportError):
        _run(spawn)
    assert {p.pid for p in psutil.Process().children()} == before  # no sleep, not even a zombie
    monkeypatch.undo()

    async def spawn_and_end() -> None:
        child = await spawn()
        child.watch()
        child.kill_now()
        await asyncio.wait_for(child.exited, timeout=30)
        child.release()

    _run(spawn_and_end)
