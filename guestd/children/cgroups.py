"""The workload's cgroup v2, and one leaf cgroup per run inside it.

The workload cgroup (default /sys/fs/cgroup/guestd-workload) carries the limits that keep
guestd alive: a fork bomb hits pids.max, a memory hog meets the OOM killer inside it, a CPU
spinner gets cpu.weight 1 against guestd's 100. Every run (an exec, a background process, a
shell session, a code kernel) gets a leaf of its own below it, and its first process is
created inside that leaf (clone3 CLONE_INTO_CGROUP), so nothing the run forks, double-forks
or re-forks can leave it: ending the run is one write to the leaf's ``cgroup.kill``.

Leaves are named ``<kind>-<guestd pid>-<id>``. A guestd that starts and finds leaves whose
guestd is gone (it was killed) ends their processes and removes them: see
``WorkloadCgroup.end_leftovers``; leaves of another running guestd are left alone. Without
cgroup v2, without root, or with ``[workload] cgroup = ""``, there are no leaves and runs are
ended by process group and descendants (best effort; SECURITY.md says what escapes then).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import time
from dataclasses import dataclass

log = logging.getLogger("guestd.cgroups")


@dataclass
class WorkloadConfig:
    cgroup: str = ""  # "" disables; e.g. "/sys/fs/cgroup/guestd-workload"
    memory_max: str = "max"  # bytes, or "max"
    pids_max: str = "max"
    cpu_weight: int = 1  # 1..10000; guestd (in the parent) keeps the default 100


def _write(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _owner_alive(leaf: str, workload_path: str) -> bool:
    """True when the leaf (``<kind>-<pid>-...``) belongs to another guestd that is running
    (one that runs as guestd's user, outside the workload cgroup)."""
    parts = leaf.split("-")
    if len(parts) < 3 or not parts[1].isdigit():
        return False
    owner = int(parts[1])
    if owner == os.getpid():
        return False  # an earlier guestd that had our pid: it is gone
    return guestd_running(owner) and not _in_tree(owner, workload_path)


def guestd_running(pid: int) -> bool:
    """Is ``pid`` a guestd running as this guestd's user? A workload process that took a dead
    guestd's pid and calls itself guestd runs as another user."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"guestd" not in f.read():
                return False
        with open(f"/proc/{pid}/status") as f:
            uids = next((ln.split()[1:] for ln in f if ln.startswith("Uid:")), [])
    except (OSError, ValueError):
        return False
    return bool(uids) and int(uids[0]) == os.geteuid()


def _in_tree(pid: int, path: str) -> bool:
    """Is ``pid`` in the cgroup at ``path`` or one of its children?"""
    return any(pid in RunCgroup(d, -1).pids() for d, _dirs, _files in os.walk(path))


@dataclass(frozen=True)
class RunUsage:
    """A leaf's counters at one moment: CPU microseconds (user, system), OOM kills and peak
    memory in bytes (None: not known, e.g. no memory controller on the leaves)."""

    user_usec: int | None
    system_usec: int | None
    oom_kills: int | None
    peak_bytes: int | None = None


class RunCgroup:
    """One run's leaf. ``fd`` (O_PATH) is what clone3 places the first process with."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self.fd = fd

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    def pids(self) -> list[int]:
        try:
            return [int(x) for x in _read(os.path.join(self.path, "cgroup.procs")).split()]
        except (OSError, ValueError):
            return []

    def _event(self, key: str) -> str | None:
        """A field of cgroup.events ("populated", "frozen"), or None."""
        try:
            for line in _read(os.path.join(self.path, "cgroup.events")).splitlines():
                name, _, value = line.partition(" ")
                if name == key:
                    return value.strip()
        except OSError:
            pass
        return None

    def usage(self) -> RunUsage:
        """What the leaf has counted so far: CPU of every process that ran in it (cpu.stat, no
        controller needed), OOM kills of its processes and its peak memory (memory.events and
        memory.peak, None without the memory controller on the leaves). Three small files."""
        user = sys_ = None
        try:
            for line in _read(os.path.join(self.path, "cpu.stat")).splitlines():
                name, _, value = line.partition(" ")
                if name == "user_usec":
                    user = int(value)
                elif name == "system_usec":
                    sys_ = int(value)
        except (OSError, ValueError):
            pass
        oom = peak = None
        try:
            for line in _read(os.path.join(self.path, "memory.events")).splitlines():
                name, _, value = line.partition(" ")
                if name == "oom_kill":
                    oom = int(value)
            peak = int(_read(os.path.join(self.path, "memory.peak")))  # Linux 5.19
        except (OSError, ValueError):
            pass
        return RunUsage(user, sys_, oom, peak)

    def populated(self) -> bool:
        value = self._event("populated")
        return value != "0" if value is not None else bool(self.pids())

    def signal_all(self, sig: int) -> None:
        """Send ``sig`` to every process in the leaf (those that fork meanwhile may miss it)."""
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def kill(self) -> None:
        """SIGKILL every process in the leaf at once, forkers included (cgroup.kill, Linux 5.14)."""
        try:
            _write(os.path.join(self.path, "cgroup.kill"), "1")
            return
        except FileNotFoundError:
            if not os.path.isdir(self.path):
                return
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return
        self.kill_except(set())  # older kernels: freeze, kill, thaw

    def kill_except(self, keep: set[int], rounds: int = 50) -> None:
        """SIGKILL every process of the leaf but ``keep`` (a shell's bash and the jobs earlier
        commands left), race-free: frozen processes cannot fork, and a fatal signal still ends
        them while frozen."""
        freeze = os.path.join(self.path, "cgroup.freeze")
        try:
            _write(freeze, "1")
        except OSError:
            freeze = ""
        try:
            for _ in range(100):  # the freeze settles asynchronously: up to ~100 ms
                if not freeze or self._event("frozen") == "1":
                    break
                time.sleep(0.001)
            for _ in range(rounds):
                victims = [p for p in self.pids() if p not in keep]
                if not victims:
                    return
                for pid in victims:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
                time.sleep(0.001)  # killed processes leave the list as they exit
        finally:
            if freeze:
                with contextlib.suppress(OSError):
                    _write(freeze, "0")

    def move_except(self, keep: set[int], dest: RunCgroup, rounds: int = 50) -> list[int]:
        """Move every process of the leaf but ``keep`` into ``dest``, race-free: frozen, they
        cannot fork meanwhile (a shell command detached on its timeout: its processes, wherever
        they went, leave the session's leaf). Returns the pids moved."""
        freeze = os.path.join(self.path, "cgroup.freeze")
        moved: list[int] = []
        try:
            _write(freeze, "1")
        except OSError:
            freeze = ""
        try:
            for _ in range(100):
                if not freeze or self._event("frozen") == "1":
                    break
                time.sleep(0.001)
            for _ in range(rounds):
                movers = [p for p in self.pids() if p not in keep]
                if not movers:
                    break
                for pid in movers:
                    with contextlib.suppress(OSError):  # gone meanwhile
                        _write(os.path.join(dest.path, "cgroup.procs"), str(pid))
                        moved.append(pid)
        finally:
            if freeze:
                with contextlib.suppress(OSError):
                    _write(freeze, "0")
        return moved

    def close_fd(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def remove(self) -> bool:
        """rmdir the leaf; False while processes are still in it (retry later)."""
        try:
            os.rmdir(self.path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno in (errno.EBUSY, errno.ENOTEMPTY):
                return False
            log.warning("cannot remove %s: %s", self.path, exc)
        self.close_fd()
        return True


class WorkloadCgroup:
    def __init__(self, cfg: WorkloadConfig) -> None:
        self.cfg = cfg
        self.path: str | None = None
        self.status = "disabled"
        self.ended_at_start = 0  # processes of a previous guestd's runs ended by setup()
        self.run_memory = False  # each leaf has its own memory.events (per-run OOM kills)

    def _enable_run_memory(self) -> bool:
        """The memory controller on every leaf, so an OOM kill is counted in the victim's own
        run (memory.events oom_kill; the kernel charges it to the victim's cgroup and its
        ancestors) and the limit stays the workload cgroup's. Possible only once no process is
        directly in the workload cgroup (cgroup v2's no-internal-process rule): leftovers were
        just killed, and dying processes leave within milliseconds."""
        assert self.path is not None
        control = os.path.join(self.path, "cgroup.subtree_control")
        for _ in range(100):
            try:
                _write(control, "+memory")
                return True
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    log.warning("no per-run memory accounting: %s", exc)
                    return False
                time.sleep(0.01)  # at start-up, before serving: nothing else waits
        log.warning("no per-run memory accounting: processes stay in %s", self.path)
        return False

    def setup(self) -> None:
        c = self.cfg
        if not c.cgroup:
            return
        parent = os.path.dirname(c.cgroup)
        if not os.path.exists(os.path.join(parent, "cgroup.controllers")):
            self.status = "unavailable: no cgroup v2 at " + parent
            log.warning("workload cgroup %s", self.status)
            return
        try:
            os.makedirs(c.cgroup, exist_ok=True)
            available = set(_read(os.path.join(parent, "cgroup.controllers")).split())
            wanted = [n for n in ("memory", "pids", "cpu") if n in available]
            if wanted:
                _write(os.path.join(parent, "cgroup.subtree_control"), " ".join("+" + n for n in wanted))
            limits = {"memory": ("memory.max", c.memory_max), "pids": ("pids.max", c.pids_max)}
            limits["cpu"] = ("cpu.weight", str(c.cpu_weight))
            for controller in wanted:
                name, value = limits[controller]
                _write(os.path.join(c.cgroup, name), str(value))
        except OSError as exc:
            self.status = f"unavailable: {exc}"
            log.warning("workload cgroup %s", self.status)
            return
        self.path = c.cgroup
        self.ended_at_start = self.end_leftovers()
        self.run_memory = "memory" in wanted and self._enable_run_memory()
        missing = [n for n in ("memory", "pids", "cpu") if n not in wanted]
        self.status = (
            f"active: {c.cgroup} (memory.max={c.memory_max}, pids.max={c.pids_max}, cpu.weight={c.cpu_weight}"
            + (f"; no {'/'.join(missing)} controller" if missing else "")
            + "; a cgroup per run"
            + (" with memory accounting)" if self.run_memory else ")")
        )
        if self.ended_at_start:
            log.warning("ended %d process(es) of runs a previous guestd left", self.ended_at_start)
        log.info("workload cgroup %s", self.status)

    def set_frozen(self, frozen: bool) -> bool:
        """cgroup.freeze on the whole workload (every run's leaf with it); False without a
        workload cgroup. Processes spawned into a frozen workload are frozen before they exec."""
        if self.path is None:
            return False
        _write(os.path.join(self.path, "cgroup.freeze"), "1" if frozen else "0")
        return True

    def is_frozen(self) -> bool:
        """Every process of the workload is frozen (the freeze has settled)."""
        return self.path is not None and RunCgroup(self.path, -1)._event("frozen") == "1"

    def new_run(self, kind: str, run_id: str) -> RunCgroup | None:
        """Make the leaf for one run (None when there is no workload cgroup)."""
        if self.path is None:
            return None
        path = os.path.join(self.path, f"{kind}-{os.getpid()}-{run_id}")  # the owner's pid: see end_leftovers
        os.mkdir(path)
        try:
            fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            with contextlib.suppress(OSError):
                os.rmdir(path)
            raise
        return RunCgroup(path, fd)

    def end_leftovers(self) -> int:
        """Kill and remove every leaf (and any process directly in the workload cgroup): at
        start-up they belong to a guestd that is gone, whose pipes, timeouts and callers are
        gone with it. Returns how many processes were ended."""
        assert self.path is not None
        ended = 0
        for pid in RunCgroup(self.path, -1).pids():  # an older guestd placed runs here directly
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                ended += 1
        try:
            names = sorted(os.listdir(self.path))
        except OSError:
            return ended
        for name in names:
            path = os.path.join(self.path, name)
            if not os.path.isdir(path) or not os.path.exists(os.path.join(path, "cgroup.procs")):
                continue
            if _owner_alive(name, self.path):
                continue  # another guestd on the same workload cgroup: its runs are its own
            leaf = RunCgroup(path, -1)
            ended += len(leaf.pids())
            leaf.kill()
            for _ in range(200):  # dying processes leave within milliseconds
                if leaf.remove():
                    break
                time.sleep(0.01)  # at start-up, before serving: nothing else waits
        return ended
