"""Why a run ended (killed_by, oom_killed) and what it used (CPU seconds), for exec, shell.run,
background processes and guestctl: PROTOCOL.md "Why a run ended". The OOM case needs a memory
controller: tests/qemu/test_systemd.py."""

from __future__ import annotations

import json
import os
import signal

from guestd.client.results import RunFigures
from guestd.testing import Guestd

PY = "/usr/bin/python3"  # the workload user (nobody) can run it
BURN_S = 0.5
BURN = f"import time\nwhile time.process_time() < {BURN_S}: pass"
# The main process waits (pipe EOF) for a double-forked burner it never reaps: wait4's rusage
# of the main process does not include the burner, the run's cgroup does.
ORPHAN_BURN = f"""
import os
r, w = os.pipe()
if os.fork() == 0:
    if os.fork() == 0:
        os.close(r)
        exec({BURN!r})
        os._exit(0)
    os._exit(0)
os.close(w)
os.wait()
os.read(r, 1)
"""


def cpu(r: RunFigures) -> float:
    user, sys_ = r.cpu_user_s, r.cpu_sys_s
    assert isinstance(user, float) and isinstance(sys_, float)
    return user + sys_


def test_exec_reports_why_it_ended(guestd: Guestd) -> None:
    with guestd.client() as c:
        r = c.exec("exit 3")
        assert (r.exit_code, r.killed_by, r.oom_killed) == (3, None, None)  # no memory controller here
        r = c.exec("sleep 30", timeout_s=0.3, kill_grace_s=0.5)
        assert (r.timed_out, r.killed_by, r.signal) == ("wall", "timeout", signal.SIGTERM)
        r = c.exec("sleep 30", idle_timeout_s=0.3, kill_grace_s=0.5)
        assert (r.timed_out, r.killed_by) == ("idle", "idle_timeout")
        r = c.exec("kill -9 $$")  # not guestd's doing: a signal from elsewhere
        assert (r.signal, r.killed_by, r.timed_out) == (signal.SIGKILL, "signal", None)


def test_exec_cpu_seconds_of_a_known_burner(guestd: Guestd) -> None:
    with guestd.client() as c:
        r = c.exec([PY, "-c", BURN])
        assert r.exit_code == 0
        # At least what it burned, at most its wall time (one thread).
        assert BURN_S <= cpu(r) <= r.duration_s + 0.05
        assert r.max_rss_bytes is None  # only from a run's cgroup with memory accounting
        # Without a cgroup the figures are wait4's: a burner the main process never waited for
        # is not in them (with one it is: test_a_runs_cgroup_counts_its_orphans).
        r = c.exec([PY, "-c", ORPHAN_BURN])
        assert r.exit_code == 0 and cpu(r) < BURN_S / 2


def test_a_runs_cgroup_counts_its_orphans(contained: Guestd) -> None:
    with contained.client() as c:
        r = c.exec([PY, "-c", ORPHAN_BURN])
        assert r.exit_code == 0 and BURN_S <= cpu(r) <= r.duration_s + 0.05


def test_shell_run_figures_are_the_commands(contained: Guestd) -> None:
    with contained.client() as c:
        s = c.shell_create()
        r = c.shell_run(s.id, "true")
        assert r.killed_by is None and cpu(r) < BURN_S / 2
        r = c.shell_run(s.id, f"{PY} -c '{BURN}'")
        assert r.exit_code == 0 and BURN_S <= cpu(r) <= r.duration_s + 0.05
        assert r.max_rss_bytes is None  # a session's peak spans its whole life, not one command
        r = c.shell_run(s.id, "sleep 30", timeout_s=0.3)
        assert (r.timed_out, r.killed_by) == ("wall", "timeout")
        r = c.shell_run(s.id, "sleep 30", idle_timeout_s=0.3)
        assert (r.timed_out, r.killed_by) == ("idle", "idle_timeout")
        c.shell_close(s.id)


def test_process_killed_from_outside_says_signal(guestd: Guestd) -> None:
    with guestd.client() as c:
        p = c.process_start("sleep 30")
        os.kill(p.pid, signal.SIGKILL)
        w = c.process_wait(p.id, timeout_s=10)
        assert (w.state, w.signal, w.killed_by) == ("exited", signal.SIGKILL, "signal")
        listed = {x.id: x for x in c.process_list()}[p.id]
        assert listed.killed_by == "signal" and isinstance(listed.cpu_user_s, float)
        p = c.process_start("exit 0")
        w = c.process_wait(p.id, timeout_s=10)
        assert (w.exit_code, w.killed_by) == (0, None)


def test_guestctl_says_why_a_command_died(guestd: Guestd) -> None:
    r = guestd.guestctl("exec", "--", "sh", "-c", "kill -9 $$")
    assert r.returncode == 137 and b"guestctl: killed by a signal (SIGKILL)" in r.stderr
    r = guestd.guestctl("exec", "--", "true")
    assert r.returncode == 0 and b"killed" not in r.stderr
    r = guestd.guestctl("--json", "exec", "--", "sh", "-c", "kill -9 $$")
    out = json.loads(r.stdout)
    assert out["killed_by"] == "signal" and out["oom_killed"] is None and isinstance(out["cpu_sys_s"], float)
