"""The workload's cgroup v2, and one leaf cgroup per run inside it.

The workload cgroup (default /sys/fs/cgroup/guestd-workload) carries the limits that keep
guestd and the guest's own system alive: a fork bomb hits pids.max, a memory hog (RAM-backed
files it writes included: tmpfs pages are charged to the cgroup that touches them) meets the
OOM killer inside it (memory.max ``"auto"``: what is not in use at start, less a reserve; see
``auto_memory_max``), a CPU spinner gets cpu.weight 1 against guestd's 100. Every run (an
exec, a background process, a shell session, a code kernel) gets a leaf of its own below it,
and its first process is created inside that leaf (clone3 CLONE_INTO_CGROUP), so nothing the
run forks, double-forks or re-forks can leave it: ending the run is one write to the leaf's
``cgroup.kill``.

Runs share the workload fairly: the ``pids`` and ``cpu`` controllers are enabled on the
leaves, each leaf gets its own pids.max (``run_pids_max``, below the workload's, so one run's
fork bomb leaves the others and the host room to fork and start runs) and the same cpu.weight
(the kernel's default, 100: the workload's CPU is split per run, not per process). Hosts
whose cgroup v2 lacks a controller get the leaves all the same, without that share.

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
from collections.abc import Iterator
from typing import Final

from guestd.wire.record import Record

log = logging.getLogger("guestd.cgroups")


MIB = 1 << 20
# "auto": RAM kept out of the workload's reach on top of what is in use when guestd starts: room
# for guestd's own growth (connections, buffers, its I/O threads), the services that start
# after it, journald's RAM journal and the kernel's own allocations. Measured in the shipped
# systemd image (2 GiB): see rootfs-overlay/etc/guestd/guestd.toml.
DEFAULT_MEMORY_RESERVE = 256 * MIB


class WorkloadConfig(Record):
    """The config's ``[workload]`` table (set field by field as the config file is read)."""

    __slots__ = ("cgroup", "cpu_weight", "memory_max", "memory_reserve", "pids_max", "run_pids_max")

    def __init__(
        self,
        cgroup: str = "",  # "" disables; e.g. "/sys/fs/cgroup/guestd-workload"
        memory_max: str = "auto",  # bytes, "max" (no limit) or "auto" (see auto_memory_max)
        memory_reserve: int = DEFAULT_MEMORY_RESERVE,  # bytes, for "auto"
        pids_max: str = "max",
        run_pids_max: str = "25%",  # each run's leaf: a number, "N%" of pids_max, or "max"
        cpu_weight: int = 1,  # 1..10000; guestd (in the parent) keeps the default 100
    ) -> None:
        self.cgroup = cgroup
        self.memory_max = memory_max
        self.memory_reserve = memory_reserve
        self.pids_max = pids_max
        self.run_pids_max = run_pids_max
        self.cpu_weight = cpu_weight

    __hash__ = None  # type: ignore[assignment]  # mutable, as the dataclass was


# Charged to the workload cgroup and not counted by MemAvailable: what a guestd that starts
# again finds held by the workload it restarts into (its tmpfs files above all) is the
# workload's to keep, not "in use by the system".
_UNRECLAIMABLE = ("anon", "shmem", "kernel_stack", "pagetables", "slab_unreclaimable", "percpu", "sock")


class AutoMemory(Record):
    """memory.max ``"auto"``, computed once at start: MemTotal, less what is in use outside
    the workload (the kernel, the image's RAM-backed files, guestd, the system's services:
    MemTotal - MemAvailable, less what the workload cgroup itself holds), less a reserve
    for their growth. All in bytes."""

    __slots__ = ("in_use", "limit", "reserve", "total")

    def __init__(self, total: int, in_use: int, reserve: int, limit: int) -> None:
        self.total: Final = total
        self.in_use: Final = in_use
        self.reserve: Final = reserve
        self.limit: Final = limit

    def describe(self) -> str:
        return (
            f"auto: MemTotal {self.total // MIB} MiB - {self.in_use // MIB} MiB in use at start"
            f" - {self.reserve // MIB} MiB reserve"
        )


def read_meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """/proc/meminfo's fields in bytes (its "kB" are KiB)."""
    fields: dict[str, int] = {}
    for line in _read(path).splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            fields[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return fields


def held_by(cgroup: str | None) -> int:
    """Bytes the cgroup holds that reclaim cannot give back (anon, tmpfs, kernel): 0 without
    it or its memory.stat."""
    if cgroup is None:
        return 0
    try:
        stat = _read(os.path.join(cgroup, "memory.stat"))
    except OSError:
        return 0
    held = 0
    for line in stat.splitlines():
        name, _, value = line.partition(" ")
        if name in _UNRECLAIMABLE and value.strip().isdigit():
            held += int(value)
    return held


def auto_memory_max(reserve: int, meminfo_path: str = "/proc/meminfo", workload: str | None = None) -> AutoMemory:
    """The workload's memory.max for ``"auto"``. The reserve shrinks to at most half of what
    the workload could have (a small VM still runs commands), and the result says so."""
    info = read_meminfo(meminfo_path)
    total, available = info["MemTotal"], info["MemAvailable"]
    for_workload = min(total, available + held_by(workload))
    reserve = max(0, min(reserve, for_workload // 2))
    limit = (for_workload - reserve) // 4096 * 4096  # memory.max rounds down to pages anyway
    return AutoMemory(total=total, in_use=total - for_workload, reserve=reserve, limit=limit)


def run_pids_limit(value: str, workload_pids_max: str, threads_max_path: str = "/proc/sys/kernel/threads-max") -> str:
    """Each run's pids.max: ``value`` as a number or "max", or "N%" of the workload's pids.max
    (of the kernel's threads-max when that is "max"), at least 1."""
    value = value.strip()
    if not value.endswith("%"):
        return value
    whole = workload_pids_max if workload_pids_max != "max" else _read(threads_max_path).strip()
    return str(max(1, int(whole) * int(value[:-1]) // 100))


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


class RunUsage(Record):
    """A leaf's counters at one moment: CPU microseconds (user, system), OOM kills and peak
    memory in bytes (None: not known, e.g. no memory controller on the leaves)."""

    __slots__ = ("oom_kills", "peak_bytes", "system_usec", "user_usec")

    def __init__(
        self, user_usec: int | None, system_usec: int | None, oom_kills: int | None, peak_bytes: int | None = None
    ) -> None:
        self.user_usec: Final = user_usec
        self.system_usec: Final = system_usec
        self.oom_kills: Final = oom_kills
        self.peak_bytes: Final = peak_bytes


class RunCgroup:
    """One run's leaf. ``fd`` (O_PATH) is what clone3 places the first process with."""

    def __init__(self, path: str, fd: int, *, memory_controller: bool = True) -> None:
        self.path = path
        self.fd = fd
        # False when the leaves have no memory controller (WorkloadCgroup.run_memory): usage()
        # then skips memory.events and memory.peak, whose failed open was 10 us per exec here.
        self.memory_controller = memory_controller

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
        user = sys_ = oom = peak = None
        with contextlib.suppress(OSError, ValueError):
            user, sys_ = self._counters(b"cpu.stat", b"user_usec", b"system_usec")
        if self.memory_controller:
            with contextlib.suppress(OSError, ValueError):
                (oom,) = self._counters(b"memory.events", b"oom_kill")
                peak = int(self._read_small(b"memory.peak"))  # Linux 5.19
        return RunUsage(user, sys_, oom, peak)

    def _counters(self, name: bytes, *keys: bytes) -> list[int | None]:
        """The values of ``keys`` in a flat-keyed file of the leaf ("name value" lines:
        cpu.stat, memory.events), None for a key it lacks."""
        found: dict[bytes, int] = {}
        for line in self._read_small(name).splitlines():
            key, _, value = line.partition(b" ")
            if key in keys:
                found[key] = int(value)
        return [found.get(key) for key in keys]

    def _read_small(self, name: bytes) -> bytes:
        """One small file of the leaf, through its directory fd while it has one: every run's
        exit reads three (open() and a text decode cost 26 us each here, this 8 us)."""
        if self.fd >= 0:
            fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=self.fd)
        else:
            fd = os.open(os.path.join(os.fsencode(self.path), name), os.O_RDONLY | os.O_CLOEXEC)
        try:
            return os.read(fd, 4096)
        finally:
            os.close(fd)

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
        with self._frozen():
            for victims in self._others(keep, rounds):
                for pid in victims:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
                time.sleep(0.001)  # killed processes leave the list as they exit

    def move_except(self, keep: set[int], dest: RunCgroup, rounds: int = 50) -> list[int]:
        """Move every process of the leaf but ``keep`` into ``dest``, race-free: frozen, they
        cannot fork meanwhile (a shell command detached on its timeout: its processes, wherever
        they went, leave the session's leaf). Returns the pids moved."""
        moved: list[int] = []
        with self._frozen():
            for movers in self._others(keep, rounds):
                for pid in movers:
                    with contextlib.suppress(OSError):  # gone meanwhile
                        _write(os.path.join(dest.path, "cgroup.procs"), str(pid))
                        moved.append(pid)
        return moved

    def _others(self, keep: set[int], rounds: int) -> Iterator[list[int]]:
        """The leaf's processes but ``keep``, read again each round until none is left (at
        most ``rounds`` times): what the caller did to the last ones may not have taken yet."""
        for _ in range(rounds):
            others = [p for p in self.pids() if p not in keep]
            if not others:
                return
            yield others

    @contextlib.contextmanager
    def _frozen(self) -> Iterator[None]:
        """The leaf frozen while the block runs (its processes cannot fork), thawed after.
        Where the freezer cannot be written the block runs all the same."""
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
            yield
        finally:
            if freeze:
                with contextlib.suppress(OSError):
                    _write(freeze, "0")

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
        self.run_controllers: list[str] = []  # enabled on the leaves
        self.memory_max = cfg.memory_max  # as written ("auto" resolved to bytes)
        self.auto_memory: AutoMemory | None = None
        self.run_pids_max: str | None = None  # written into each leaf (pids on the leaves)
        self._dir_fd = -1  # the workload cgroup's directory (O_PATH), where the spawn thread makes leaves

    def _enable_run_controllers(self, wanted: list[str]) -> list[str]:
        """Enable ``wanted`` on every leaf, each on its own (one a kernel refuses leaves the
        others): memory, so an OOM kill is counted in the victim's own run (memory.events
        oom_kill; the kernel charges it to the victim's cgroup and its ancestors) while the
        limit stays the workload cgroup's; pids and cpu for a share per run. Possible only
        once no process is directly in the workload cgroup (cgroup v2's no-internal-process
        rule): leftovers were just killed, and dying processes leave within milliseconds."""
        assert self.path is not None
        control = os.path.join(self.path, "cgroup.subtree_control")
        enabled: list[str] = []
        for name in wanted:
            for _ in range(100):
                try:
                    _write(control, "+" + name)
                    enabled.append(name)
                    break
                except OSError as exc:
                    if exc.errno != errno.EBUSY:
                        log.warning("no per-run %s controller: %s", name, exc)
                        break
                    time.sleep(0.01)  # at start-up, before serving: nothing else waits
            else:
                log.warning("no per-run %s controller: processes stay in %s", name, self.path)
        return enabled

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
            wanted: list[str] = [n for n in ("memory", "pids", "cpu") if n in available]
            if wanted:
                _write(os.path.join(parent, "cgroup.subtree_control"), " ".join("+" + n for n in wanted))
            if "pids" in wanted:
                _write(os.path.join(c.cgroup, "pids.max"), c.pids_max)
                self.run_pids_max = run_pids_limit(c.run_pids_max, c.pids_max)
            if "cpu" in wanted:
                _write(os.path.join(c.cgroup, "cpu.weight"), str(c.cpu_weight))
        except (OSError, ValueError) as exc:
            self.status = f"unavailable: {exc}"
            log.warning("workload cgroup %s", self.status)
            return
        self.path = c.cgroup
        self.ended_at_start = self.end_leftovers()
        try:
            if "memory" in wanted:
                # After the leftovers are gone: "auto" counts what they held as in use otherwise.
                if c.memory_max == "auto":
                    self.auto_memory = auto_memory_max(c.memory_reserve, workload=c.cgroup)
                    self.memory_max = str(self.auto_memory.limit)
                _write(os.path.join(c.cgroup, "memory.max"), self.memory_max)
        except (OSError, KeyError, ValueError) as exc:
            self.path = None
            self.status = f"unavailable: memory.max={c.memory_max}: {exc}"
            log.warning("workload cgroup %s", self.status)
            return
        self.run_controllers = self._enable_run_controllers(wanted)
        self.run_memory = "memory" in self.run_controllers
        if "pids" not in self.run_controllers:
            self.run_pids_max = None
        self.status = self._describe(wanted)
        if self.ended_at_start:
            log.warning("ended %d process(es) of runs a previous guestd left", self.ended_at_start)
        log.info("workload cgroup %s", self.status)

    def _describe(self, wanted: list[str]) -> str:
        """info.workload_cgroup: the limits as written, and each run's share."""
        c = self.cfg
        memory = f"memory.max={self.memory_max}"
        if self.auto_memory is not None:
            memory += f" ({self.auto_memory.describe()})"
        missing = [n for n in ("memory", "pids", "cpu") if n not in wanted]
        shares = ["memory accounting"] if self.run_memory else []
        if self.run_pids_max is not None:
            shares.append(f"pids.max={self.run_pids_max}")
        if "cpu" in self.run_controllers:
            shares.append("an equal cpu.weight")
        each = ""
        if shares:
            each = " with " + ", ".join(shares[:-1]) + (" and " if len(shares) > 1 else "") + shares[-1]
            each += " each" if self.run_pids_max is not None or "cpu" in self.run_controllers else ""
        return (
            f"active: {c.cgroup} ({memory}, pids.max={c.pids_max}, cpu.weight={c.cpu_weight}"
            + (f"; no {'/'.join(missing)} controller" if missing else "")
            + f"; a cgroup per run{each})"
        )

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

    def leaf_order(self, kind: str, run_id: str) -> tuple[tuple[int, bytes, bytes | None], str] | None:
        """What the native spawn thread needs to make a run's leaf as ``new_run`` does (the
        workload's directory fd, the leaf's name, its pids.max), and the leaf's path; None when
        there is no workload cgroup."""
        if self.path is None:
            return None
        if self._dir_fd < 0:
            self._dir_fd = os.open(self.path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        name = f"{kind}-{os.getpid()}-{run_id}"  # the owner's pid: see end_leftovers
        pids = self.run_pids_max.encode() if self.run_pids_max is not None else None
        return (self._dir_fd, name.encode(), pids), os.path.join(self.path, name)

    def run_leaf(self, path: str, fd: int) -> RunCgroup:
        """A run's leaf made here (new_run) or by the native spawn thread (leaf_order)."""
        return RunCgroup(path, fd, memory_controller=self.run_memory)

    def new_run(self, kind: str, run_id: str) -> RunCgroup | None:
        """Make the leaf for one run (None when there is no workload cgroup)."""
        if self.path is None:
            return None
        path = os.path.join(self.path, f"{kind}-{os.getpid()}-{run_id}")  # the owner's pid: see end_leftovers
        os.mkdir(path)
        try:
            if self.run_pids_max is not None:  # before the first process: its forks count from 1
                _write(os.path.join(path, "pids.max"), self.run_pids_max)
            fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            with contextlib.suppress(OSError):
                os.rmdir(path)
            raise
        return self.run_leaf(path, fd)

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
