"""Daemon configuration and limits. Every limit is reported in the handshake and ``info``."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from guestd.children.cgroups import WorkloadConfig
from guestd.policy import Policy, PortPolicy
from guestd.wire.frames import DEFAULT_MAX_FRAME

DEFAULT_VSOCK_PORT = 10_700  # documented in PROTOCOL.md; any free port works
HOST_CID = 2


# Limits and Config are plain classes, not dataclasses: a dataclass compiles its generated
# methods at every start (guestd's start path spent ~50 M instructions parsing and compiling
# such code, at start-up); these are read from the pyc.
class Limits:
    """Every limit, as a class attribute (its default) that a config or a flag overrides per instance."""

    max_frame: int = DEFAULT_MAX_FRAME  # payload bytes, both directions
    max_inflight: int = 4096  # requests in flight per connection
    max_connections: int = 256  # when full, the oldest connection still without a hello is closed
    hello_timeout_s: float = 10.0  # a connection that sends no hello by then is closed
    stream_window: int = 4 * 1024 * 1024  # initial credit per stream, bytes
    max_chunk: int = 1024 * 1024  # bytes per data EVENT / INPUT
    max_output: int = 1024 * 1024  # bytes kept per stream by exec capture
    max_read: int = 2 * 1024 * 1024  # bytes per file.read reply
    max_list_entries: int = 20_000
    max_exec_timeout_s: float = 7 * 24 * 3600.0
    max_contexts: int = 8  # live code contexts (one kernel process each)
    max_processes: int = 64  # live background processes
    max_kept_processes: int = 256  # background processes kept, finished ones included
    max_kept_runs: int = 64  # shell.run / code.run with keep: true, running and ended
    max_spill_bytes: int = 256 * 1024 * 1024  # spill: true, per stream of one run
    max_spill_total: int = 1024 * 1024 * 1024  # the spill directory (oldest files removed first)
    max_ring_bytes: int = 16 * 1024 * 1024  # output ring per stream of a background process
    max_shells: int = 16  # persistent shell sessions
    max_code_queue: int = 16  # runs waiting per context
    max_port_streams: int = 256  # relay streams (port.connect, port.accept) open per connection
    max_port_forwards: int = 16  # port.reverse listeners per connection
    max_port_pending: int = 64  # connections per reverse forward waiting for the host's port.accept

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in LIMIT_NAMES}

    def __repr__(self) -> str:
        return f"Limits({self.as_dict()})"


LIMIT_NAMES = tuple(Limits.__annotations__)  # in declaration order: the hello's limits map


class Config:
    def __init__(self) -> None:
        self.listen: list[str] = []
        self.allowed_cids: set[int] = {HOST_CID}
        self.limits = Limits()
        self.io_threads = 8  # blocking file I/O runs here, never on the event loop
        self.use_uvloop = True
        self.runtime_dir = ""  # private state (kernel connection files); default /run/guestd or a temp dir
        self.code_pool = 1  # pre-started kernels kept ready; 0 disables
        self.code_prewarm = False  # fill the pool at start-up instead of on first use
        # The Python the "python" kernel runs (code_python): "guestd" (guestd's own interpreter: a
        # development guestd on a host), "auto" (python3 on guestd's PATH, the one runs get, else guestd's
        # own: the shipped config), or an interpreter's name (looked up on that PATH) or path.
        self.code_python = "guestd"
        self.code_queue_wait_s = 600.0  # how long a code.run without timeout_s may wait for its context
        self.process_retention_s = 3600.0  # how long a finished background process stays attachable
        self.process_stdin_timeout_s = 30.0  # a process.write not taken by the process by then fails
        self.workspace = ""  # guestd's working directory: the default cwd of exec, shells, processes, code
        self.token_file = ""
        self.log_level = "INFO"
        self.policy = Policy()
        self.ports = PortPolicy()
        self.workload = WorkloadConfig()
        self.simulate_privileged = False  # record CRNG/clock/hostname/machine-id changes instead of making them
        # This machine is a guest VM that guestd may re-identify: only then do restore/prepare set the
        # clock, hostname, /etc/machine-id, re-seed the CRNG and remove random-seed files. False (a
        # development guestd on a host) simulates them: they would change the host itself.
        self.in_guest = False


class ConfigError(ValueError):
    pass


def _want(key: str, value: Any, typ: type | tuple[type, ...]) -> Any:
    if isinstance(value, bool) and typ in (int, float, (int, float)):
        raise ConfigError(f"config key {key!r} must be a number")
    if not isinstance(value, typ):
        raise ConfigError(f"config key {key!r} has the wrong type ({type(value).__name__})")
    return value


def _seconds(key: str, value: Any, *, positive: bool = False) -> float:
    """A number of seconds, a whole one or not; ``positive``: refused unless > 0 (NaN too)."""
    seconds = float(_want(key, value, (int, float)))
    if positive and not seconds > 0:
        raise ConfigError(f"{key} must be > 0")
    return seconds


# The words each [workload] limit takes besides a whole number (bytes for memory, processes
# and threads for pids); "N%" is a share of the workload's own pids.max.
_CGROUP_WORDS = {
    "workload.memory_max": ("max", "auto"),
    "workload.pids_max": ("max",),
    "workload.run_pids_max": ("max", "%"),
}


def _cgroup_value(key: str, value: Any) -> str:
    """A [workload] limit as the cgroup file takes it (or "auto" / "N%", resolved at start)."""
    text = str(_want(key, value, (str, int))).strip()
    words = _CGROUP_WORDS[key]
    if (text.isdigit() and int(text) > 0) or (text in words and text != "%"):
        return text
    if "%" in words and text.endswith("%") and text[:-1].isdigit() and 1 <= int(text[:-1]) <= 100:
        return text
    allowed = " or ".join(["a number > 0", *(f'"{w}"' if w != "%" else '"N%" (1..100)' for w in words)])
    raise ConfigError(f"config key {key!r} must be {allowed}, not {value!r}")


def _apply_code(cfg: Config, table: Any) -> None:
    """The [code] table: the kernels' pool, their Python and how long a run waits for its context."""
    for k, v in _want("code", table, dict).items():
        if k == "pool":
            cfg.code_pool = _want("code.pool", v, int)
        elif k == "prewarm":
            cfg.code_prewarm = _want("code.prewarm", v, bool)
        elif k == "python":  # code_python
            cfg.code_python = _want("code.python", v, str).strip()
            if not cfg.code_python:
                raise ConfigError('code.python must be "guestd", "auto", or a Python\'s name or path')
        elif k == "queue_wait_s":
            cfg.code_queue_wait_s = _seconds("code.queue_wait_s", v, positive=True)
        else:
            raise ConfigError(f"unknown config key code.{k}")


def _apply_processes(cfg: Config, table: Any) -> None:
    """The [processes] table: background processes' retention and stdin deadline."""
    for k, v in _want("processes", table, dict).items():
        if k == "retention_s":
            cfg.process_retention_s = _seconds("processes.retention_s", v)
        elif k == "stdin_timeout_s":
            cfg.process_stdin_timeout_s = _seconds("processes.stdin_timeout_s", v, positive=True)
        else:
            raise ConfigError(f"unknown config key processes.{k}")


def _apply_policy(cfg: Config, table: Any) -> None:
    """The [policy] table: who may connect, which ops, which roots, as whom the workload runs."""
    pol = cfg.policy
    for k, v in _want("policy", table, dict).items():
        if k == "allowed_uids":
            pol.allowed_uids = {_want("policy.allowed_uids[]", x, int) for x in _want(f"policy.{k}", v, list)}
        elif k in ("allow_ops", "deny_ops", "write_roots", "read_roots"):
            setattr(pol, k, [_want(f"policy.{k}[]", x, str) for x in _want(f"policy.{k}", v, list)])
        elif k == "workload_user":
            pol.workload_user = str(_want(f"policy.{k}", v, (str, int)))
        else:
            raise ConfigError(f"unknown config key policy.{k}")


def _apply_ports(cfg: Config, table: Any) -> None:
    """The [ports] table: which guest ports the host may reach, and reverse forwards."""
    for k, v in _want("ports", table, dict).items():
        if k == "allow":
            cfg.ports.allow = [_want("ports.allow[]", x, str) for x in _want("ports.allow", v, list)]
            try:
                cfg.ports.check_syntax()
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        elif k == "reverse":
            cfg.ports.reverse = _want("ports.reverse", v, bool)
        else:
            raise ConfigError(f"unknown config key ports.{k}")


def _apply_workload(cfg: Config, table: Any) -> None:
    """The [workload] table: the workload's cgroup and its limits."""
    wl = cfg.workload
    for k, v in _want("workload", table, dict).items():
        if k == "cgroup":
            wl.cgroup = _want("workload.cgroup", v, str)
        elif k in ("memory_max", "pids_max", "run_pids_max"):
            setattr(wl, k, _cgroup_value(f"workload.{k}", v))
        elif k == "memory_reserve":
            wl.memory_reserve = _want("workload.memory_reserve", v, int)
            if wl.memory_reserve < 0:
                raise ConfigError("workload.memory_reserve must be >= 0 (bytes)")
        elif k == "cpu_weight":
            wl.cpu_weight = _want("workload.cpu_weight", v, int)
            if not 1 <= wl.cpu_weight <= 10_000:
                raise ConfigError("workload.cpu_weight must be 1..10000")
        else:
            raise ConfigError(f"unknown config key workload.{k}")


def _apply_limits(cfg: Config, table: Any) -> None:
    """The [limits] table: any of :data:`LIMIT_NAMES`."""
    for k, v in _want("limits", table, dict).items():
        if k not in LIMIT_NAMES:
            raise ConfigError(f"unknown config key limits.{k}")
        seconds = k.endswith("_s")
        value = _want(f"limits.{k}", v, (int, float) if seconds else int)
        setattr(cfg.limits, k, float(value) if seconds else value)


# The config file's top-level keys that are not tables: the type each takes and where it goes.
_TOP_KEYS: dict[str, tuple[type, Callable[[Config, Any], None]]] = {
    "listen": (list, lambda cfg, v: setattr(cfg, "listen", [_want("listen[]", x, str) for x in v])),
    "allowed_cids": (list, lambda cfg, v: setattr(cfg, "allowed_cids", {_want("allowed_cids[]", x, int) for x in v})),
    "workspace": (str, lambda cfg, v: setattr(cfg, "workspace", v)),
    "runtime_dir": (str, lambda cfg, v: setattr(cfg, "runtime_dir", v)),
    "token_file": (str, lambda cfg, v: setattr(cfg, "token_file", v)),
    "log_level": (str, lambda cfg, v: setattr(cfg, "log_level", v)),
    "io_threads": (int, lambda cfg, v: setattr(cfg, "io_threads", v)),
    "uvloop": (bool, lambda cfg, v: setattr(cfg, "use_uvloop", v)),
    "simulate_privileged": (bool, lambda cfg, v: setattr(cfg, "simulate_privileged", v)),
    "in_guest": (bool, lambda cfg, v: setattr(cfg, "in_guest", v)),
}

# The config file's tables ([code], [policy]...): each one's keys are checked by its own function.
_TABLES: dict[str, Callable[[Config, Any], None]] = {
    "code": _apply_code,
    "processes": _apply_processes,
    "policy": _apply_policy,
    "ports": _apply_ports,
    "workload": _apply_workload,
    "limits": _apply_limits,
}


def load_config_file(path: str, cfg: Config) -> Config:
    """Apply a TOML config file (see rootfs-overlay/etc/guestd/guestd.toml) onto ``cfg``.

    Unknown keys are errors: a typo in an image's config should fail loudly at boot,
    not be silently ignored.
    """
    import tomllib  # only when a config file is given

    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    for key, value in doc.items():
        if key in _TOP_KEYS:
            typ, apply = _TOP_KEYS[key]
            apply(cfg, _want(key, value, typ))
        elif key in _TABLES:
            _TABLES[key](cfg, value)
        else:
            raise ConfigError(f"unknown config key {key!r}")
    return cfg


# Variables the launcher set for guestd's own interpreter (e.g. LD_LIBRARY_PATH of a baked
# image's private Python). They are taken out of the environment the workload inherits and
# handed only to processes that run guestd's Python (kernels).
PRIVATE_ENV: dict[str, str] = {}


def take_private_env() -> None:
    for name in os.environ.pop("GUESTD_PRIVATE_ENV", "").split(","):
        if name and name in os.environ:
            PRIVATE_ENV[name] = os.environ.pop(name)
