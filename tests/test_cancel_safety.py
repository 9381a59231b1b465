"""Requests cancelled (their connection dropped) at an await between taking something and
giving it back: what they took still goes back (fds, threads, files, table entries).

Each guestd runs in a private mount namespace with its runtime directory on a loop-mounted
ext4 (tests/test_spill_bounds.py ``private_fs_guestd``); freezing that file system (``frozen``)
makes the await block for real: a process writing there sleeps uninterruptibly (a SIGKILL
waits for the thaw), an I/O thread writing there is held. Leaks are measured from outside:
guestd's fds and threads in /proc, files left in its directories."""

from __future__ import annotations

import asyncio
import contextlib
import os

import psutil
import pytest

from guestd.client.aio import AsyncClient
from guestd.testing.rawwire import RawPeer
from guestd.wire.frames import Kind, encode_frame
from tests.private_fs import (
    assert_fds_back_to,
    fd_count,
    fd_targets,
    frozen,
    io_thread_blocked,
    needs_freeze,
    needs_mounts,
    private_fs_guestd,
    settled,
    until,
)


def in_d_state(pid: int) -> bool:
    """``pid``'s main thread sleeps uninterruptibly (a write waiting on the frozen file system)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :].startswith("D")


def sockets(pid: int) -> set[str]:
    """What guestd's socket fds name: its listening sockets and one per open connection."""
    return {t for t in fd_targets(pid) if "socket:" in t}


async def connections_gone(pid: int, idle: set[str]) -> None:
    """Until guestd has no socket but those of ``idle``: every connection since is closed on
    its side too (its requests cancelled)."""
    await until(lambda: sockets(pid) <= idle)


def thread_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def settled_thread_count(pid: int, want: int) -> int:
    return settled(lambda: thread_count(pid), want)


async def listed_gone(c: AsyncClient, kind: str, ident: str) -> None:
    """Until ``ident`` is no more in shell.list (kind "shell") or code.list (bounded)."""
    for _ in range(400):
        items = await (c.shell_list() if kind == "shell" else c.code_list())
        if all(i.id != ident for i in items):
            return
        await asyncio.sleep(0.025)
    raise AssertionError(f"{kind} {ident} still listed")


@needs_mounts
@needs_freeze
def test_a_shell_close_cancelled_while_bash_cannot_die_yet_still_releases_the_session() -> None:
    """shell.close of a session whose bash sleeps uninterruptibly (a write to the frozen disk:
    its SIGKILL waits for the thaw), cancelled while close waits for bash to be gone: once bash
    dies its pipes, control socket and pidfd are closed all the same. Before, the release came
    after that wait, with no try/finally: the fds leaked."""
    with private_fs_guestd("ext4", 64) as (g, _rt, rt_inside):
        idle = sockets(g.pid)
        before: list[int] = []

        async def go() -> None:
            async with await AsyncClient.connect(g.address) as c:  # what a first session opens for good
                warm = (await c.shell_create()).id
                await c.shell_run(warm, "true")
                await c.shell_close(warm)
            await connections_gone(g.pid, idle)
            before.append(fd_count(g.pid))
            a = await AsyncClient.connect(g.address)
            made = await a.shell_create()
            sid, bash = made.id, made.pid
            with frozen(g, rt_inside):
                run = asyncio.ensure_future(a.shell_run(sid, f"echo x > {rt_inside}/blocked"))
                await until(lambda: in_d_state(bash) or run.done())
                assert not run.done()
                busy = sockets(g.pid)  # a's connection
                b = await AsyncClient.connect(g.address)
                closing = asyncio.ensure_future(b.shell_close(sid))
                async with await AsyncClient.connect(g.address) as c:
                    await listed_gone(c, "shell", sid)  # off the table: close waits for bash now
                assert not closing.done() and psutil.pid_exists(bash)
                closing.cancel()
                await b.close()
                await connections_gone(g.pid, busy)  # guestd saw b go: its close is cancelled
                assert psutil.pid_exists(bash)
            await run  # bash died at the thaw: the run ends
            await a.close()
            async with await AsyncClient.connect(g.address) as c:
                assert all(s.id != sid for s in await c.shell_list())
            await connections_gone(g.pid, idle)

        asyncio.run(go())
        assert_fds_back_to(g.pid, before[0])
        assert g.alive() and "Traceback" not in g.log(), g.log()


@needs_mounts
@needs_freeze
def test_a_code_close_cancelled_while_the_kernel_cannot_die_yet_still_releases_the_kernel() -> None:
    """code.close of a context whose kernel sleeps uninterruptibly in a cell (a write to the
    frozen disk), cancelled while close waits for the kernel to be gone: once it dies its pidfd
    is closed and its ipc socket files are removed all the same. Before, both came after that
    wait, with no try/finally."""
    with private_fs_guestd("ext4", 64, config="[code]\npool = 0\n") as (g, rt, rt_inside):
        idle = sockets(g.pid)
        before: list[int] = []

        async def go() -> None:
            async with await AsyncClient.connect(g.address) as c:  # what a first context opens for good
                warm = (await c.code_create()).id
                await c.code_run("1", context=warm)
                await c.code_close(warm)
            await connections_gone(g.pid, idle)
            before.append(fd_count(g.pid))
            kernel_files = sorted(os.listdir(rt + "/kernels"))
            a = await AsyncClient.connect(g.address)
            made = await a.code_create()
            cid, kernel = made.id, made.pid
            with frozen(g, rt_inside):
                run = asyncio.ensure_future(a.code_run(f"open({rt_inside + '/blocked'!r}, 'w')", context=cid))
                await until(lambda: in_d_state(kernel) or run.done())
                assert not run.done()
                busy = sockets(g.pid)  # a's connection and the kernel's
                b = await AsyncClient.connect(g.address)
                closing = asyncio.ensure_future(b.code_close(cid))
                async with await AsyncClient.connect(g.address) as c:
                    await listed_gone(c, "code", cid)  # off the table: close waits for the kernel now
                assert not closing.done() and psutil.pid_exists(kernel)
                closing.cancel()
                await b.close()
                await connections_gone(g.pid, busy)  # guestd saw b go: its close is cancelled
                assert psutil.pid_exists(kernel)
            with contextlib.suppress(Exception):
                await run  # the kernel died at the thaw: the run ends (an error)
            await a.close()
            await connections_gone(g.pid, idle)
            await until(lambda: not psutil.pid_exists(kernel))
            left.extend(sorted(set(os.listdir(rt + "/kernels")) - set(kernel_files)))

        left: list[str] = []
        asyncio.run(go())
        assert_fds_back_to(g.pid, before[0])
        assert left == []  # the kernel's ipc socket files
        assert g.alive() and "Traceback" not in g.log(), g.log()


@needs_mounts
@needs_freeze
def test_a_watch_cancelled_before_its_watcher_is_ready_stops_the_watcher() -> None:
    """file.watch whose wait for its watcher's first scan is queued behind an upload held by
    the frozen disk (guestd with one I/O thread), cancelled there: the watcher is stopped all
    the same (its thread ends; its inotify fd, wake pipe and root fd are closed). Before, the
    watcher was started and then waited for, with no try/finally: a thread and four fds leaked.

    The two requests go in one write, so guestd starts both in one turn of its loop: the
    watch's directory open goes to the I/O thread first, the upload's temp file second (it
    blocks there, on the frozen disk), and the watch's wait for its scan queues behind it."""
    with private_fs_guestd("ext4", 64, config="io_threads = 1\n") as (g, _rt, rt_inside):
        watched = os.path.join(g.workdir, "watched")
        os.mkdir(watched)
        idle = sockets(g.pid)
        before: list[int] = []

        async def go() -> None:
            async with await AsyncClient.connect(g.address) as c:  # the I/O thread, a watch's first use
                await c.write_file(rt_inside + "/warm", b"x")
                w = c.watch(watched)
                await w.wait_ready()
                await w.close()
            await connections_gone(g.pid, idle)
            before.extend((fd_count(g.pid), thread_count(g.pid)))
            peer = RawPeer(g.raw_socket())
            peer.hello()
            with frozen(g, rt_inside):
                both = encode_frame(Kind.REQUEST, 1, {"op": "file.watch", "args": {"path": watched}})
                both += encode_frame(Kind.REQUEST, 3, {"op": "file.upload", "args": {"path": rt_inside + "/up"}})
                busy = sockets(g.pid)
                peer.send_bytes(both)
                await until(lambda: io_thread_blocked(g.pid))  # the upload's temp file waits for the disk
                await until(lambda: thread_count(g.pid) > before[1])  # the watcher's thread runs
                peer.sock.close()
                await until(lambda: len(sockets(g.pid)) < len(busy))  # guestd saw it go: both cancelled
            await connections_gone(g.pid, idle)

        asyncio.run(go())
        assert_fds_back_to(g.pid, before[0])
        assert settled_thread_count(g.pid, before[1]) == before[1]
        assert g.alive() and "Traceback" not in g.log(), g.log()


@needs_mounts
@needs_freeze
def test_a_freezing_prepare_cancelled_after_the_freeze_still_thaws_after_freeze_max_s(scratch: str) -> None:
    """snapshot.prepare freeze: true, freeze_max_s 0.3, cancelled after it froze the workload
    while its sync waits for the (only) I/O thread, held by a write to the frozen disk: the
    workload still thaws by itself after freeze_max_s, and new work is taken again. Before, the
    thaw timer was set only after the sync: a prepare cancelled there left the workload frozen
    and guestd quiesced until someone called snapshot.resume."""
    config = f'io_threads = 1\n[workload]\ncgroup = "{scratch}/cancel-prepare"\n'
    with private_fs_guestd("ext4", 64, config=config) as (g, _rt, rt_inside):

        async def frozen_now(c: AsyncClient) -> bool:
            return bool((await c.info()).raw["snapshot"]["frozen"])

        async def go() -> None:
            a = await AsyncClient.connect(g.address)
            await a.write_file(rt_inside + "/warm", b"x")  # the I/O thread
            with frozen(g, rt_inside):
                write = asyncio.ensure_future(a.write_file(rt_inside + "/blocked", b"x"))
                await until(lambda: io_thread_blocked(g.pid) or write.done())
                assert not write.done()
                busy = sockets(g.pid)
                b = await AsyncClient.connect(g.address)
                prep = asyncio.ensure_future(b.snapshot_prepare(freeze=True, freeze_max_s=0.3, timeout_s=0.1))
                for _ in range(400):  # the workload is frozen; the prepare's sync waits
                    if await frozen_now(a) or prep.done():
                        break
                    await asyncio.sleep(0.025)
                assert await frozen_now(a) and not prep.done()
                prep.cancel()
                await b.close()
                await until(lambda: sockets(g.pid) <= busy)  # guestd saw b go: the prepare is cancelled
            await write
            for _ in range(400):  # freeze_max_s (0.3 s) on: thawed with no resume
                if not await frozen_now(a):
                    break
                await asyncio.sleep(0.025)
            assert not await frozen_now(a)
            assert (await a.exec("echo ok")).stdout == b"ok\n"  # not quiesced any more
            await a.close()

        asyncio.run(go())
        assert g.alive() and "Traceback" not in g.log(), g.log()


def threads_in_d_state(pid: int) -> int:
    """How many of guestd's threads sleep uninterruptibly (held by the frozen file system)."""
    held = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/stat") as f:
            stat = f.read()
            held += stat[stat.rindex(")") + 2 :].startswith("D")
    return held


@needs_mounts
@needs_freeze
def test_a_write_cancelled_while_its_thread_still_writes_is_not_settled_for_prepare() -> None:
    """file.write cancelled while its I/O thread is held by the frozen disk: the write is still
    landing, so snapshot.prepare waits for it and says writes_settled false when its timeout
    comes first. Before, the cancelled request counted its write as finished at once, and
    prepare said settled with the write still in flight."""
    with private_fs_guestd("ext4", 64) as (g, rt, rt_inside):

        async def go() -> None:
            a = await AsyncClient.connect(g.address)
            await a.write_file(rt_inside + "/warm", b"x")  # the I/O threads exist
            idle = sockets(g.pid)
            b = await AsyncClient.connect(g.address)
            with frozen(g, rt_inside):
                write = asyncio.ensure_future(b.write_file(rt_inside + "/landing", b"y" * 4096))
                await until(lambda: io_thread_blocked(g.pid) or write.done())
                assert not write.done()
                write.cancel()
                await b.close()
                await connections_gone(g.pid, idle)  # the write's request is cancelled
                prep = asyncio.ensure_future(a.snapshot_prepare(timeout_s=0.2))
                # Its wait for writes ends (0.2 s); then its sync may wait for the thaw too.
                await until(lambda: prep.done() or threads_in_d_state(g.pid) >= 2)
            report = await prep
            assert report.writes_settled is False, report
            await a.snapshot_resume()
            await until(lambda: os.path.exists(rt + "/landing"))  # the thread finished it after all
            assert (await a.read_file(rt_inside + "/landing")) == b"y" * 4096
            assert (await a.exec("echo ok")).stdout == b"ok\n"
            await a.close()

        asyncio.run(go())
        assert g.alive() and "Traceback" not in g.log(), g.log()


def test_a_watcher_whose_first_scan_failed_is_stopped_without_touching_its_closed_fds(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watcher's thread owns its fds and closes them however it ends; stop() after a failed
    first scan (start_watcher's error path) only wakes it. Before, stop() wrote its wake byte to
    the number the thread had closed: EBADF raised out of stop() (this test, the thread done
    first), or, with the thread between its close and its bookkeeping, a byte into whatever fd
    took that number (in guestd: another connection's socket)."""
    from guestd.files import watch, watchscan

    def failing_sink(changes: list[watch.Change]) -> None:
        raise RuntimeError("the loop is gone")

    monkeypatch.setattr(watchscan, "MAX_WATCHES", 0)  # the first watch reports overflow to the sink
    root = os.open(str(tmp_path), os.O_RDONLY | os.O_DIRECTORY)
    w = watch.Watcher(root, failing_sink)
    fds = (w.ifd, w.wake_r, w.wake_w, root)
    w.start()
    assert w.ready.wait(10) and isinstance(w.error, RuntimeError)
    assert w.thread is not None
    w.thread.join(10)
    assert not w.thread.is_alive()
    for fd in fds:  # the thread closed them
        with pytest.raises(OSError):
            os.fstat(fd)
    reused = os.pipe()  # takes the lowest free numbers: those the thread just closed
    try:
        w.stop()  # raised EBADF, or wrote into a reused number
        assert w.sync(timeout=10) is False  # at once: the watcher has ended
        os.set_blocking(reused[0], False)
        with pytest.raises(BlockingIOError):
            os.read(reused[0], 1)  # nothing was written into the pipe that took a number
    finally:
        for fd in reused:
            os.close(fd)
