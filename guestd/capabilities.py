"""What guestd serves: its capabilities, composed into the server.

The server (guestd/server/) knows no capability by name. This module, at the package root above
both, declares the capabilities that load on first use, registers the ones needed from the start
and hooks them into the server: ``guestd.server.daemon.Daemon`` calls :func:`compose` with itself
(an :class:`Assembly`) as it is built. A new capability is one line in ``LAZY_CAPABILITIES``.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from guestd.server.admission import AdmissionChain
    from guestd.services import Services

PENDING_WRITES = "pending-writes"  # where the files capability records temps of writes in progress


def _register(module: str) -> Callable[[Services], None]:
    """The capability in ``module`` (its ``register(services)``), imported when it registers."""

    def register(services: Services) -> None:
        importlib.import_module(module).register(services)

    return register


def _register_processes(services: Services) -> None:
    from guestd import runs
    from guestd.processes import handlers

    handlers.register(services)
    # Kept runs (shell.run / code.run keep: true) are a capability of their own, served under the
    # contract's capability name "process" (PROTOCOL.md 10.4).
    runs.register(services)


# Capabilities declared at start and registered at their first request (schema name -> register):
# their modules (the files capability alone was 26 ms and 2.7 MiB of guestd's start)
# load only when used. Order: the order they register in when all are needed at once.
LAZY_CAPABILITIES: dict[str, Callable[[Services], None]] = {
    "exec": _register("guestd.exec.handlers"),
    "files": _register("guestd.files.handlers"),
    "process": _register_processes,
    "shell": _register("guestd.shells.handlers"),
    "port": _register("guestd.ports.handlers"),
    "metrics": _register("guestd.metrics.handlers"),
}


class Assembly(Protocol):
    """What composing needs of the server (guestd.server.daemon.Daemon is one)."""

    @property
    def services(self) -> Services: ...

    @property
    def admission(self) -> AdmissionChain: ...

    @property
    def before_start(self) -> list[Callable[[], None]]:
        """Run when guestd starts serving, before the capabilities' own on_start hooks."""
        ...

    def declare(self, capability: str, register: Callable[[Services], None]) -> None: ...

    def require(self, capability: str) -> None: ...

    def require_all(self) -> None: ...

    def load_before(self, op: str, load: Callable[[], None]) -> None: ...


def compose(server: Assembly) -> None:
    services = server.services
    # Registered now: ping and info answer without loading anything, the snapshot state
    # gates requests and reads hellos, and code's start-up reaps kernels a crashed guestd left.
    from guestd.code import handlers as code_ops
    from guestd.snapshot import handlers as snapshot_ops
    from guestd.system import handlers as system_ops

    system_ops.register(services)
    for capability, register in LAZY_CAPABILITIES.items():
        server.declare(capability, register)
    code_ops.register(services)
    snapshot_ops.register(services, server.admission)
    # A snapshot is taken with every capability loaded: a guest restored from it pays no
    # first-use import, and snapshot.prepare reports the running work of all of them.
    server.load_before("snapshot.prepare", server.require_all)
    # Confinement roots are directory fds opened at start (PROTOCOL.md 8): opened at the
    # first file request instead, a root the workload renamed and replaced by a symlink in
    # the meantime would be followed (tests/test_redteam_fs.py). With roots, files loads now.
    policy = services.config.policy
    if policy.write_roots is not None or policy.read_roots is not None:
        server.require("files")

    def remove_writes_left_behind() -> None:
        if _writes_left_behind(services):
            server.require("files")  # its start-up removes the temp files of a guestd killed mid-write

    server.before_start.append(remove_writes_left_behind)


def _writes_left_behind(services: Services) -> bool:
    """Records of another guestd's writes in progress in the runtime dir (files.temps.PendingTemps)."""
    try:
        owners = os.listdir(os.path.join(services.runtime_dir(), PENDING_WRITES))
    except OSError:
        return False
    from guestd.children.cgroups import guestd_running

    me = os.getpid()
    return any(owner.isdigit() and int(owner) != me and not guestd_running(int(owner)) for owner in owners)
