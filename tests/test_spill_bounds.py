"""spill: true against its bounds on real, small file systems: the free-space reserve
(``disk_full``), the disk falling behind (``behind``, a frozen ext4), and the races around
the spill directory (concurrent spills and the reserve, forget while reading, the sweep).

Each guestd here runs in a private mount namespace of its own (``unshare -m --propagation
private``) with its runtime directory on a small tmpfs or a loop-mounted ext4 mounted only
there: nothing stays mounted on this machine once guestd ends. The test reaches the file
system through ``/proc/<guestd pid>/root``."""

from __future__ import annotations

import asyncio
import os

from guestd.client.aio import AsyncClient
from guestd.output.spill import MAX_PENDING, SPILL_RESERVE_MAX
from guestd.testing import Guestd, StartGuestd
from tests.private_fs import (
    assert_fds_back_to,
    fd_count,
    frozen,
    io_thread_blocked,
    needs_freeze,
    needs_mounts,
    private_fs_guestd,
    settled_fd_count,
    until,
)


def reserve_of(path: str) -> int:
    st = os.statvfs(path)
    return min(SPILL_RESERVE_MAX, st.f_blocks * st.f_frsize // 10)


def free_of(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def numbers(n: int) -> bytes:
    """What ``seq 1 n`` prints."""
    return "".join(f"{i}\n" for i in range(1, n + 1)).encode()


def spill_files(rt: str) -> int:
    try:
        return len(os.listdir(rt + "/spill"))
    except FileNotFoundError:
        return 0


def warm_up(g: Guestd) -> int:
    """One exec with spill (the I/O threads and what a first run opens exist from now on);
    guestd's fd count after it."""
    with g.client() as c:
        c.exec("true", spill=True)
    return settled_fd_count(g.pid, 0, polls=10)


@needs_mounts
def test_the_free_space_reserve_stops_a_spill_as_disk_full() -> None:
    """A 24 MiB tmpfs under the spill directory and a command printing ~39 MB: the spill stops
    with disk_full, the file holds exactly the stream's first ``bytes`` bytes, the file system
    keeps its reserve (min(64 MiB, 10% of its size)) free, and guestd goes on answering (an
    exec, and a spill that finds no room stops at byte 0)."""
    full = numbers(5_000_000)
    with private_fs_guestd("tmpfs", 24) as (g, rt, _):

        async def go() -> None:
            async with await AsyncClient.connect(g.address) as c:
                r = await c.exec("seq 1 5000000", max_output=1000, spill=True)
                assert r.exit_code == 0 and r.stdout_bytes == len(full)
                spill = r.stdout_spill
                assert spill is not None and spill.stopped == "disk_full", spill
                here = rt + "/spill/" + os.path.basename(os.fsdecode(spill.path))
                size = os.path.getsize(here)
                assert spill.bytes == size and 0 < size < len(full)
                with open(here, "rb") as f:
                    assert f.read() == full[:size]
                assert free_of(rt) >= reserve_of(rt), (free_of(rt), reserve_of(rt))
                # Healthy: a plain exec, and a spill with no room left stops at once.
                assert (await c.exec("echo still-here")).stdout == b"still-here\n"
                again = await c.exec("seq 1 100000", max_output=100, spill=True)
                assert again.stdout_spill is not None and again.stdout_spill.stopped == "disk_full"
                assert again.stdout_spill.bytes == 0
                assert free_of(rt) >= reserve_of(rt)

        asyncio.run(go())
        assert g.alive() and "Traceback" not in g.log(), g.log()


@needs_mounts
def test_concurrent_spills_share_the_free_space_without_eating_the_reserve() -> None:
    """Six runs spill at once (stdout and stderr each) onto a 32 MiB tmpfs, more than it holds:
    every file holds exactly a prefix of its stream with ``bytes`` its size, and together they
    leave the reserve free. Before, each I/O thread checked the free space and then wrote its
    chunk: two writers both took the same room, and the reserve was eaten (or a write failed
    with ENOSPC part-way and ``bytes`` left out what it had written)."""
    n = 1_200_000
    full = numbers(n)
    gen = f"seq 1 {n} & seq 1 {n} >&2; wait"
    with private_fs_guestd("tmpfs", 32) as (g, rt, _):
        fds_before = warm_up(g)

        async def go() -> None:
            async with await AsyncClient.connect(g.address) as c:
                runs = await asyncio.gather(*(c.exec(gen, max_output=100, spill=True) for _ in range(6)))
                stopped = []
                for r in runs:
                    for spill in (r.stdout_spill, r.stderr_spill):
                        assert spill is not None
                        here = rt + "/spill/" + os.path.basename(os.fsdecode(spill.path))
                        with open(here, "rb") as f:
                            data = f.read()
                        assert spill.bytes == len(data) and data == full[: len(data)], spill
                        stopped.append(spill.stopped)
                assert "disk_full" in stopped and set(stopped) <= {None, "disk_full"}, stopped
                assert free_of(rt) >= reserve_of(rt), (free_of(rt), reserve_of(rt))
                assert (await c.exec("echo ok")).stdout == b"ok\n"

        asyncio.run(go())
        assert_fds_back_to(g.pid, fds_before)
        assert g.alive() and "Traceback" not in g.log(), g.log()


@needs_mounts
@needs_freeze
def test_a_disk_slower_than_the_command_stops_the_spill_as_behind(tmp_path: object) -> None:
    """The spill directory's ext4 frozen (writes block) while a command prints ~30 MB: guestd
    holds at most MAX_PENDING for the disk, then stops the spill as ``behind``; the command is
    not held up; once the disk thaws the file holds exactly the stream's first ``bytes`` bytes
    (what waited: at most MAX_PENDING), and guestd goes on. Before, the chunk already handed to
    an I/O thread was not counted as waiting, so up to twice MAX_PENDING waited (seen on a
    loaded machine: a file of 16,797,696 bytes)."""
    n = 4_500_000
    full = numbers(n)
    assert len(full) > 2 * MAX_PENDING
    gate, done = f"{tmp_path}/go", f"{tmp_path}/done"
    cmd = f"while [ ! -e {gate} ]; do sleep 0.01; done; seq 1 {n}; touch {done}"
    with private_fs_guestd("ext4", 64) as (g, rt, rt_inside):

        async def go() -> None:
            async with await AsyncClient.connect(g.address) as c:
                run = asyncio.ensure_future(c.exec(cmd, max_output=1000, spill=True))
                await until(lambda: spill_files(rt) == 2 or run.done())
                with frozen(g, rt_inside):
                    open(gate, "w").close()
                    # The whole stream went through guestd while the disk could take none of it.
                    await until(lambda: os.path.exists(done) or run.done())
                    assert not run.done()
                r = await run
                assert r.exit_code == 0 and r.stdout_bytes == len(full)
                spill = r.stdout_spill
                assert spill is not None and spill.stopped == "behind", spill
                with open(rt + "/spill/" + os.path.basename(os.fsdecode(spill.path)), "rb") as f:
                    data = f.read()
                assert spill.bytes == len(data) <= MAX_PENDING and data == full[: len(data)]
                assert r.stderr_spill is not None and (r.stderr_spill.bytes, r.stderr_spill.stopped) == (0, None)
                again = await c.exec("seq 1 1000", max_output=10, spill=True)
                assert again.stdout_spill is not None
                assert (again.stdout_spill.bytes, again.stdout_spill.stopped) == (len(numbers(1000)), None)

        asyncio.run(go())
        assert g.alive() and "Traceback" not in g.log(), g.log()


@needs_mounts
@needs_freeze
def test_a_run_cancelled_while_its_spill_files_are_being_made_leaks_no_fd(tmp_path: object) -> None:
    """exec spill: true whose request goes away while the I/O thread making its spill files is
    stuck on the (frozen) disk: once the disk thaws, the directory fd and the two files it
    opened are closed. Before, nothing awaited them: three fds leaked per such run."""
    with private_fs_guestd("ext4", 64) as (g, _rt, rt_inside):
        before = warm_up(g)

        async def go() -> None:
            c = await AsyncClient.connect(g.address)
            with frozen(g, rt_inside):
                run = asyncio.ensure_future(c.exec("echo never", spill=True))
                await until(lambda: io_thread_blocked(g.pid) or run.done())
                assert not run.done()
                run.cancel()
                await c.close()
                await until(lambda: fd_count(g.pid) <= before + 1)  # the connection's fd is gone
            async with await AsyncClient.connect(g.address) as c2:
                assert (await c2.exec("echo after")).stdout == b"after\n"

        asyncio.run(go())
        assert_fds_back_to(g.pid, before)
        assert g.alive() and "Traceback" not in g.log(), g.log()


@needs_mounts
@needs_freeze
def test_a_run_cancelled_while_its_last_output_waits_for_the_disk_leaks_no_fd(tmp_path: object) -> None:
    """exec spill: true whose command has ended while its last output is still being written
    to a frozen disk: the reply waits for that write, and the request goes away then. Once the
    disk thaws the two spill files are closed. Before, the cancel interrupted the files' close
    after the run had handed them to the reply: two fds leaked per such run."""
    import psutil

    with private_fs_guestd("ext4", 64) as (g, _rt, rt_inside):
        before = warm_up(g)

        def command_running() -> bool:
            return any(p.name() == "sleep" for p in psutil.Process(g.pid).children(recursive=True))

        async def go() -> None:
            c = await AsyncClient.connect(g.address)
            run = asyncio.ensure_future(c.exec(["sh", "-c", "sleep 0.5; echo last"], spill=True))
            await until(lambda: command_running() or run.done())
            with frozen(g, rt_inside):
                await until(lambda: io_thread_blocked(g.pid) or run.done())  # "last" waits for the disk
                await until(lambda: not psutil.Process(g.pid).children(recursive=True))  # the command ended
                assert not run.done()
                run.cancel()
                await c.close()
                await until(lambda: fd_count(g.pid) <= before + 2)  # the connection's fd is gone
            async with await AsyncClient.connect(g.address) as c2:
                assert (await c2.exec("echo after")).stdout == b"after\n"

        asyncio.run(go())
        assert_fds_back_to(g.pid, before)
        assert g.alive() and "Traceback" not in g.log(), g.log()


def test_the_sweep_leaves_the_files_a_kept_process_names(fresh_guestd: StartGuestd, tmp_path: object) -> None:
    """limits.max_spill_total: a spill start removes the oldest files until the directory is
    under it, but not the files a kept background process's record names (process.wait and
    process.list give them; they go with process.forget): those count and stay, newer
    unnamed files go first. Before, the process's file (the oldest) was removed and its
    record went on naming it with its ``bytes``."""
    from guestd.testing import limits_config

    full = numbers(100_000)  # 588,895 bytes
    config = limits_config(str(tmp_path), max_spill_total=1_000_000)
    g = fresh_guestd("--config", config, "--runtime-dir", f"{tmp_path}/rt")

    async def go() -> None:
        async with await AsyncClient.connect(g.address) as c:
            pid = (await c.process_start("seq 1 100000", spill=True)).id
            w = await c.process_wait(pid, timeout_s=60)
            kept = w.stdout_spill
            assert kept is not None and kept.bytes == len(full)
            first = await c.exec("seq 1 100000", max_output=10, spill=True)
            assert first.stdout_spill is not None
            # Over the total now: this spill's start sweeps. The unnamed exec file goes.
            second = await c.exec("seq 1 100000", max_output=10, spill=True)
            assert second.stdout_spill is not None and second.stdout_spill.bytes == len(full)
            assert not os.path.exists(first.stdout_spill.path)
            again = await c.process_wait(pid, timeout_s=10)
            assert again.stdout_spill == kept
            assert await c.read_file(kept.path) == full
            listed = [p for p in await c.process_list() if p.id == pid]
            assert listed[0].stdout_spill == kept
            # Forgotten: its files go with it.
            await c.process_forget(pid)
            await until(lambda: not os.path.exists(kept.path))
            third = await c.exec("seq 1 100000", max_output=10, spill=True)
            assert third.stdout_spill is not None and third.stdout_spill.bytes == len(full)

    asyncio.run(go())
    assert g.alive() and "Traceback" not in g.log(), g.log()


def test_sweeps_and_forget_racing_a_detached_quiet_spill(fresh_guestd: StartGuestd, tmp_path: object) -> None:
    """A detached exec (its spill handed to the process table) goes quiet while other spills
    start and sweep a directory far over ``max_spill_total``: its files stay and end whole;
    then process.forget races reads of them (file.read, process.wait): each read either has
    the whole file or says not_found, the files go, no fd stays and nothing reaches the log."""
    from guestd.testing import limits_config
    from guestd.wire.errors import GuestdError

    gate = f"{tmp_path}/go"
    script = f"seq 1 50000; while [ ! -e {gate} ]; do sleep 0.01; done; seq 50001 100000"
    full = numbers(100_000)
    config = limits_config(str(tmp_path), max_spill_total=100_000)
    g = fresh_guestd("--config", config, "--runtime-dir", f"{tmp_path}/rt")
    before = warm_up(g)

    async def go() -> None:
        async with await AsyncClient.connect(g.address) as c:
            r = await c.exec(script, timeout_s=0.5, on_timeout="detach", spill=True, max_output=100)
            assert r.detached is not None and r.stdout_spill is not None
            # Quiet: eight spills start (and sweep) meanwhile, each over the total alone.
            await asyncio.gather(*(c.exec("seq 1 30000", max_output=10, spill=True) for _ in range(8)))
            open(gate, "w").close()
            w = await c.process_wait(r.detached, timeout_s=60)
            spill = w.stdout_spill
            assert spill is not None and (spill.bytes, spill.stopped) == (len(full), None), spill
            assert await c.read_file(spill.path) == full

            async def read() -> str:
                try:
                    return "whole" if await c.read_file(spill.path) == full else "torn"
                except GuestdError as e:
                    return e.code

            pid = r.detached

            async def forget() -> str:
                await c.process_forget(pid)
                return "forgot"

            got = await asyncio.gather(*(read() for _ in range(4)), forget(), *(read() for _ in range(4)))
            assert set(got) <= {"whole", "not_found", "forgot"}, got
            await until(lambda: not os.path.exists(spill.path))

    asyncio.run(go())
    assert_fds_back_to(g.pid, before)
    assert g.alive() and "Traceback" not in g.log(), g.log()
