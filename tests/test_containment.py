"""Containment: no workload process outlives its run (issue 14), with a real guestd whose
workload cgroup is a scratch sub-tree of this host's cgroup v2 (removed afterwards).

Each escape pattern leaves a process that appends to a heartbeat file every 50 ms: a setsid
double fork, ``setsid -f``, and a chain whose every generation starts the next in a new
session and exits (its pid never stays put). Each kill path must stop the heartbeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from guestd.client import AsyncClient, GuestdError
from guestd.testing import Guestd, limits_config, start_guestd
from guestd.testing.cgroups import UNIFIED, cgroup_usable, contained_config, start_contained

BEAT = "while :; do echo b >> {hb}; sleep 0.05; done"
PATTERNS = {
    "setsid-double-fork": "(setsid sh -c '" + BEAT + "' &)",
    "setsid-f": "setsid -f sh -c '" + BEAT + "'",
    # Every generation beats once, starts the next in a new session, and exits.
    "fork-chain": "setsid -f sh {chain} {hb}",
}
CHAIN = 'echo b >> "$1"; sleep 0.05; setsid -f sh "$0" "$1"\n'


needs_cgroup = pytest.mark.skipif(not cgroup_usable(), reason="needs root and cgroup v2 at " + UNIFIED)


class Heartbeat:
    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="guestd-hb-")
        os.chmod(self.dir, 0o777)
        self.path = os.path.join(self.dir, "hb")
        self.chain = os.path.join(self.dir, "chain.sh")
        with open(self.chain, "w") as f:
            f.write(CHAIN)
        os.chmod(self.chain, 0o755)

    def command(self, pattern: str) -> str:
        return PATTERNS[pattern].format(hb=self.path, chain=self.chain)

    def size(self) -> int:
        try:
            return os.path.getsize(self.path)
        except FileNotFoundError:
            return 0

    def wait_beating(self) -> None:
        for _ in range(200):
            if self.size() >= 4:
                return
            time.sleep(0.02)
        raise AssertionError("the escapee never started beating")

    def assert_stopped(self) -> None:
        """No beat for 0.5 s, after allowing 0.3 s for the kill to land."""
        time.sleep(0.3)
        before = self.size()
        time.sleep(0.5)
        assert self.size() == before, f"still beating: {before} -> {self.size()} bytes"

    def cleanup(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def hb() -> Iterator[Heartbeat]:
    h = Heartbeat()
    yield h
    h.cleanup()


def _run_async(coro: Callable[[], object]) -> None:
    asyncio.run(coro())  # type: ignore[arg-type]


@needs_cgroup
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_exec_timeout_ends_escapees(contained: Guestd, hb: Heartbeat, pattern: str) -> None:
    with contained.client() as c:
        r = c.exec(["sh", "-c", f"{hb.command(pattern)}; sleep 0.3; sleep 100"], timeout_s=1.5, kill_grace_s=0.2)
    assert r.timed_out == "wall"
    hb.assert_stopped()


@needs_cgroup
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_shell_timeout_ends_what_the_command_started(contained: Guestd, hb: Heartbeat, pattern: str) -> None:
    with contained.client() as c:
        sid = c.shell_create(cwd="/tmp").id
        try:
            # A job of an earlier command is not this command's to end.
            c.shell_run(sid, "sleep 1000 & echo $! > " + hb.dir + "/job")
            r = c.shell_run(sid, f"{hb.command(pattern)}; sleep 100", timeout_s=1.5)
            assert r.timed_out == "wall" and not r.session_restarted
            hb.assert_stopped()
            with open(hb.dir + "/job") as f:
                job = int(f.read())
            os.kill(job, 0)  # still there
            assert c.shell_run(sid, "echo ok").stdout == b"ok\n"
        finally:
            c.shell_close(sid)


@needs_cgroup
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_process_kill_ends_escapees(contained: Guestd, hb: Heartbeat, pattern: str) -> None:
    with contained.client() as c:
        p = c.process_start(f"{hb.command(pattern)}; sleep 100")
        hb.wait_beating()
        c.process_signal(p.id, "KILL")
        assert c.process_wait(p.id, timeout_s=10).signal == signal.SIGKILL
    hb.assert_stopped()


@needs_cgroup
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_cancel_ends_escapees(contained: Guestd, hb: Heartbeat, pattern: str) -> None:
    async def main() -> None:
        async with await AsyncClient.connect(contained.address) as c:
            run = asyncio.ensure_future(c.exec(["sh", "-c", f"{hb.command(pattern)}; sleep 100"]))
            await asyncio.get_running_loop().run_in_executor(None, hb.wait_beating)
            run.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await run

    _run_async(main)
    hb.assert_stopped()


@needs_cgroup
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_cancelled_shell_command_ends_escapees(contained: Guestd, hb: Heartbeat, pattern: str) -> None:
    async def main() -> None:
        async with await AsyncClient.connect(contained.address) as c:
            sid = (await c.shell_create(cwd="/tmp")).id
            run = asyncio.ensure_future(c.shell_run(sid, f"{hb.command(pattern)}; sleep 100"))
            await asyncio.get_running_loop().run_in_executor(None, hb.wait_beating)
            run.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await run
            r = await c.shell_run(sid, "echo mine")
            assert r.stdout == b"mine\n" and r.exit_code == 0
            await c.shell_close(sid)

    _run_async(main)
    hb.assert_stopped()


@needs_cgroup
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_shutdown_ends_every_run_and_what_finished_runs_left(scratch: str, hb: Heartbeat, pattern: str) -> None:
    g = start_contained(scratch, f"shutdown-{pattern}")
    try:
        with g.client() as c:
            # A finished exec that left an escapee, and a background process that made one.
            r = c.exec(["sh", "-c", hb.command(pattern)], linger_s=0.2)
            assert r.exit_code == 0
            c.process_start("sleep 1000")
            hb.wait_beating()
    finally:
        g.stop()
        shutil.rmtree(g.workdir, ignore_errors=True)
    assert g.proc.returncode == 0
    hb.assert_stopped()
    assert not os.path.exists(os.path.join(scratch, f"shutdown-{pattern}", "proc-1")), "leaves are removed"


@needs_cgroup
def test_a_restarted_guestd_ends_the_runs_the_killed_one_left(scratch: str) -> None:
    name = "restart"
    beats = [Heartbeat(), Heartbeat(), Heartbeat()]
    g = start_contained(scratch, name)
    try:
        with g.client() as c:
            c.process_start(beats[0].command("setsid-double-fork") + "; sleep 1000")
            sid = c.shell_create(cwd="/tmp").id
            c.shell_run(sid, beats[2].command("setsid-f"))  # a session's job that left it

        def exec_with_timeout() -> None:  # its connection dies with guestd; the run must not live on
            with contextlib.suppress(Exception), g.client() as c:
                c.exec(["sh", "-c", "while :; do echo b >> " + beats[1].path + "; sleep 0.05; done"], timeout_s=2)

        t = threading.Thread(target=exec_with_timeout)
        t.start()
        for b in beats:
            b.wait_beating()
        os.kill(g.pid, signal.SIGKILL)
        g.proc.wait(10)
        t.join(10)
        leaves = sorted(n for n in os.listdir(os.path.join(scratch, name)) if "-" in n)
        assert [n.split("-")[0] for n in leaves] == ["exec", "proc", "shell"]
        time.sleep(2.5)  # past the exec's timeout: nobody enforces it while guestd is down
        assert all(b.size() > 0 for b in beats)
        g2 = start_guestd(g.workdir, "--config", contained_config(g.workdir, os.path.join(scratch, name)))
        try:
            for b in beats:
                b.assert_stopped()
            assert not [n for n in os.listdir(os.path.join(scratch, name)) if "-" in n], "leaves removed"
            with g2.client() as c:
                assert c.process_list() == []
                info = c.info().raw
            native = os.environ.get("GUESTD_NATIVE_SPAWN", "1") != "0"
            assert "a cgroup per run" in info["workload_cgroup"] and info["spawn"] == ("clone3" if native else "popen")
            assert info["runs_ended_at_start"] >= 4  # the process, two escapees, the exec
            assert "previous guestd" in g2.log()
        finally:
            g2.stop()
    finally:
        g.stop()
        for b in beats:
            b.cleanup()
        shutil.rmtree(g.workdir, ignore_errors=True)


@needs_cgroup
def test_runs_start_in_their_own_leaf_as_the_workload_user(contained: Guestd) -> None:
    with contained.client() as c:
        r = c.exec(["sh", "-c", "id -u; cat /proc/self/cgroup | grep ^0::"])
        uid, cg = r.stdout.decode().split()
        assert uid == "65534"
        assert cg.startswith("0::/") and "/workload/exec-" in cg
        sid = c.shell_create(cwd="/tmp").id
        assert "/workload/shell-" in c.shell_run(sid, "cat /proc/self/cgroup").stdout.decode()
        c.shell_close(sid)


def test_finished_kept_processes_hold_no_fds(fresh_guestd: Callable[..., Guestd], tmp_path: object) -> None:
    g = fresh_guestd("--config", limits_config(str(tmp_path), max_kept_processes=1100, max_processes=64))

    def fds() -> int:
        return len(os.listdir(f"/proc/{g.pid}/fd"))

    async def main() -> None:
        async with await AsyncClient.connect(g.address) as c:
            await c.ping()
            before = fds()
            for _ in range(1000 // 50):
                ids = [(await c.process_start(["true"])).id for _ in range(50)]
                for pid_id in ids:
                    assert (await c.process_wait(pid_id, timeout_s=30)).exit_code == 0
            for _ in range(100):  # each closes its pipes once both have ended (within ~0.2 s)
                if fds() - before <= 8:
                    break
                await asyncio.sleep(0.05)
            assert fds() - before <= 8, f"{fds() - before} fds more after 1000 finished processes"
            kept = await c.process_list()
            assert len(kept) == 1000 and all(p.state == "exited" for p in kept)
            # Their output stays readable after the fds are gone.
            out = await c.process_start(["echo", "kept"])
            await c.process_wait(out.id, timeout_s=30)
            await asyncio.sleep(0.3)
            collected = await c.process_output(out.id)
            stdout = collected.stdout
            assert stdout == b"kept\n"

    asyncio.run(main())


@pytest.fixture(scope="module")
def contained_as_root(scratch: str) -> Iterator[Guestd]:
    """A workload cgroup without a workload user: this host's Python (the kernel's) is not
    readable by nobody. The shipped config's kernels are covered in tests/qemu."""
    g = start_contained(scratch, "workload-root", user=None)
    yield g
    g.stop()
    shutil.rmtree(g.workdir, ignore_errors=True)


@needs_cgroup
@pytest.mark.parametrize("ending", ["close", "restart", "timeout-restart"])
def test_what_a_cell_started_in_a_session_of_its_own_dies_with_its_kernel(
    contained_as_root: Guestd, hb: Heartbeat, ending: str
) -> None:
    contained = contained_as_root
    beat = BEAT.format(hb=hb.path)
    cell = f"import subprocess\nsubprocess.Popen(['sh', '-c', {beat!r}], start_new_session=True)\n"
    with contained.client() as c:
        ctx = c.code_create(deadline=120).id
        try:
            assert c.code_run(cell, context=ctx, timeout_s=60).status == "ok"
            hb.wait_beating()
            if ending == "close":
                c.code_close(ctx)
            elif ending == "restart":
                c.code_restart(ctx)
            else:  # a cell that ignores SIGINT: the timeout restarts the kernel
                stuck = "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(100)\n"
                r = c.code_run(stuck, context=ctx, timeout_s=1, interrupt_grace_s=0.5)
                assert r.status == "timeout", r
            hb.assert_stopped()
        finally:
            if ending != "close":
                c.code_close(ctx)


@needs_cgroup
def test_spawn_failures_are_typed_and_leave_no_leaf(contained: Guestd, scratch: str) -> None:
    with contained.client() as c:
        cases = [
            (dict(cwd="/nonexistent-dir"), "not_found", "cwd"),
            (dict(), "not_found", "spawn"),
        ]
        if c.info().raw["spawn"] == "clone3":  # the popen fallback enters cwd before the drop
            # The workload user enters its cwd itself (after the drop): root's 0700 home is closed to it.
            cases.append((dict(cwd="/root"), "permission_denied", "cwd"))
        for kw, code, stage in cases:
            argv = ["true"] if kw else ["/no/such/program"]
            with pytest.raises(GuestdError) as ei:
                c.exec(argv, **kw)  # type: ignore[arg-type]
            assert (ei.value.code, ei.value.details.get("stage")) == (code, stage), ei.value
        assert c.exec(["true"]).exit_code == 0  # and nothing is left behind
    leaves = [n for n in os.listdir(os.path.join(scratch, "workload")) if n.startswith("exec-")]
    for _ in range(100):
        if not leaves:
            break
        time.sleep(0.02)
        leaves = [n for n in os.listdir(os.path.join(scratch, "workload")) if n.startswith("exec-")]
    assert leaves == []
