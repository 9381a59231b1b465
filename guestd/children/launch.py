"""How a run's process is made: native clone3 or the subprocess fallback.

What the process must not inherit from guestd (its raised fd limit, OOM score, nice value and
CPU pinning are set back), the native clone3 spawn module (``_clone``, built from ``_clone.c``),
the subprocess fallback where that module is missing, and the typed error of a spawn that failed."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import importlib
import os
import resource
import subprocess
from typing import TYPE_CHECKING, Any

from guestd.wire.errors import ErrorCode, GuestdError

if TYPE_CHECKING:
    from types import ModuleType

    from guestd.children.cgroups import RunCgroup

NO_CLONE3 = (errno.ENOSYS, errno.E2BIG, errno.EINVAL)

# guestd raises its own soft fd limit to the hard one (it holds a pipe pair per run); what it
# starts gets the limit guestd was given, since select()-based programs break above 1024.
NOFILE_AT_START = resource.getrlimit(resource.RLIMIT_NOFILE)


def raise_fd_limit(wanted: int = 1 << 20) -> int:
    """Raise guestd's own fd limit (as root up to ``wanted``, else to the hard limit); returns it."""
    soft, hard = NOFILE_AT_START
    target = hard
    if os.geteuid() == 0:
        try:
            with open("/proc/sys/fs/nr_open") as f:
                target = max(hard, min(wanted, int(f.read())))
        except (OSError, ValueError):
            pass
    for limit in (target, hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
            return limit
        except (ValueError, OSError):
            continue
    return soft


def _own_oom_score_adj() -> int:
    try:
        with open("/proc/self/oom_score_adj") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 0


# guestd runs with OOMScoreAdjust=-1000 and children inherit it: each is set back (to
# GUESTD_CHILD_OOM_SCORE_ADJ, default 0) before it execs. Raising a score needs no privilege.
_CHILD_OOM = os.environ.get("GUESTD_CHILD_OOM_SCORE_ADJ")
OOM_RESET: bytes | None = (_CHILD_OOM or "0").encode() if _CHILD_OOM is not None or _own_oom_score_adj() < 0 else None


# What guestd starts may run on every CPU its cpuset allows, whatever guestd's own affinity
# (GUESTD_CHILD_ALL_CPUS=0: it inherits guestd's, for bench/load.py to compare).
ALL_CPUS = os.environ.get("GUESTD_CHILD_ALL_CPUS", "1") != "0"


# guestd may run at a higher priority than its workload (Nice= in its unit, so the control
# plane answers under load); what it starts is set back to nice 0 before it execs.
NICE_RESET = os.getpriority(os.PRIO_PROCESS, 0) != 0


def load_native() -> ModuleType | None:
    if os.environ.get("GUESTD_NATIVE_SPAWN", "1") == "0":
        return None
    try:
        _clone = clone_module()
    except ImportError:
        return None
    return _clone if _clone.AVAILABLE else None


@functools.cache
def clone_module() -> Any:
    """guestd.children._clone, the extension setup.py builds from _clone.c (ImportError: not
    built). Imported by name: an import statement naming it reads, to tests/test_import_cycles.py,
    as an import of the package itself, whose __init__ imports this module."""
    return importlib.import_module("guestd.children._clone")


@functools.lru_cache(maxsize=256)
def exec_paths(exe: str, path: str | None) -> list[bytes]:
    """Where to look for ``exe``, as execvpe would: as given when it has a slash, else in
    ``path`` (a PATH value; None: the default path). Kept: 15 us per spawn otherwise. The
    caller must not change the list."""
    if os.sep in exe:
        return [os.fsencode(exe)]
    return [os.fsencode(os.path.join(d, exe)) for d in os.get_exec_path({} if path is None else {"PATH": path})]


def popen_fallback(
    argv: list[str],
    env: dict[str, str] | None,
    cwd: str | None,
    child_fds: list[tuple[int, int]],
    ids: tuple[int, int] | None,
    ctty: bool,
    cgroup: RunCgroup | None,
) -> subprocess.Popen[bytes]:
    """Where the native spawn is missing: fork + a Python preexec step (slower, see _clone.c).
    Raises GuestdError (details.stage: cwd or spawn)."""
    import termios  # here, not in the forked child: this path only, off guestd's start path

    by_target = dict((t, s) for s, t in child_fds)
    procs = os.path.join(cgroup.path, "cgroup.procs") if cgroup is not None else ""

    extra = [(source, target) for target, source in by_target.items() if target > 2]

    def preexec() -> None:
        if procs:
            with open(procs, "w") as f:
                f.write("0")
        if ctty:
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)
        if OOM_RESET is not None:
            with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "wb") as f:
                f.write(OOM_RESET)
        place_fds(extra)  # before the fd limit is set back: a copy may land above it
        resource.setrlimit(resource.RLIMIT_NOFILE, NOFILE_AT_START)
        if ALL_CPUS:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, range(1024))  # as the native spawn: every CPU the cpuset allows
        if NICE_RESET:
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, 0, 0)
        if ids is not None:
            os.setgroups([])
            os.setresgid(ids[1], ids[1], ids[1])
            os.setresuid(ids[0], ids[0], ids[0])

    try:
        return subprocess.Popen(
            argv,
            stdin=by_target.get(0),
            stdout=by_target.get(1),
            stderr=by_target.get(2),
            cwd=cwd,
            env=env,
            start_new_session=True,
            # Extra fds are dup'ed onto their numbers in preexec, which runs before close_fds would
            # close them; every fd guestd opens is O_CLOEXEC (PEP 446), so nothing else leaks.
            close_fds=False,
            preexec_fn=preexec,
        )
    except OSError as exc:
        raise spawn_error(exc, argv[0], cwd) from None
    except (ValueError, TypeError) as exc:  # NUL bytes in argv, env or cwd
        raise GuestdError(ErrorCode.BAD_REQUEST, f"cannot spawn: {exc}", details={"stage": "spawn"}) from None
    except subprocess.SubprocessError as exc:
        raise GuestdError(
            ErrorCode.UNAVAILABLE,
            f"could not set up the child (workload cgroup / workload user): {exc}",
            details={"stage": "spawn"},
        ) from None


def place_fds(fds: list[tuple[int, int]]) -> None:
    """In a forked child: each (source, target) fd onto its number, open across exec. As
    _clone.c, every source is first copied above every target: ``dup2(fd, fd)`` changes
    nothing, so a source already on its number would keep guestd's O_CLOEXEC and be closed by
    exec (a session's status socket on fd 63: bash could not report, and start waited 30 s),
    and a source that is another's target would be overwritten before it is placed."""
    if not fds:
        return
    above = max(target for _, target in fds) + 1
    copies = [(fcntl.fcntl(source, fcntl.F_DUPFD_CLOEXEC, above), target) for source, target in fds]
    for copy, target in copies:
        os.dup2(copy, target, inheritable=True)  # a copy is never its target: the flag is cleared
    for copy, _ in copies:
        os.close(copy)


def spawn_error(exc: OSError, argv0: str, cwd: str | None) -> GuestdError:
    """A could-not-start error for a spawn's OSError (its .stage says where it failed)."""
    stage = getattr(exc, "stage", None)
    if stage == "cwd" or (stage is None and cwd is not None and exc.filename == cwd):
        return GuestdError.from_os_error(exc, stage="cwd", cwd=cwd)
    if stage in (None, "exec", "clone"):  # clone: e.g. EAGAIN at the workload's pids.max
        return GuestdError.from_os_error(exc, stage="spawn", argv0=argv0)
    if stage == "stopped":
        return GuestdError(
            ErrorCode.UNAVAILABLE,
            "the process was stopped (by the workload?) before it could exec, and was killed",
            details={"stage": "spawn"},
        )
    if stage == "cgroup":
        return GuestdError(ErrorCode.UNAVAILABLE, f"cannot make the run's cgroup: {exc}", details={"stage": "spawn"})
    return GuestdError(
        ErrorCode.UNAVAILABLE, f"could not set up the child ({stage}): {exc}", details={"stage": "spawn"}
    )


class Clone3Unavailable(Exception):
    """This kernel has no clone3 (5.3) or no CLONE_INTO_CGROUP (5.7): spawn through subprocess."""
