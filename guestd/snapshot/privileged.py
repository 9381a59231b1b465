"""Steps of a snapshot or restore that change the machine itself (the kernel CRNG, the wall
clock, hostname, /etc/machine-id, random-seed files, FIFREEZE), recorded instead of done
when guestd is not configured as a guest or is told to simulate them.

They run for real only when the config says guestd runs in a guest (``in_guest = true``: the
baked config, and ``guestd-init`` as PID 1, say so). Otherwise, and always with
``simulate_privileged``, they are recorded instead and every reply that would have made them
says why (``simulated``): on a host they would change the host itself.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

from guestd.wire.errors import GuestdError

if TYPE_CHECKING:
    from guestd.config import Config

log = logging.getLogger("guestd.snapshot")

RNDADDENTROPY = 0x40085203
RNDRESEEDCRNG = 0x5207
RANDOM_SEED_FILES = ("/var/lib/systemd/random-seed", "/var/lib/urandom/random-seed", "/var/lib/random-seed")
FIFREEZE, FITHAW = 0xC0045877, 0xC0045878


NOT_IN_GUEST = (
    "guestd is not configured as a guest (in_guest = false): on a host these steps would change the "
    "host itself (its clock, hostname, machine-id, random seed)"
)
FORCED = "simulate_privileged is set (--simulate-privileged)"


def why_simulated(config: Config) -> str | None:
    """Why the privileged steps are simulated, or None when they are done. Safe by default: a
    guestd that was not told it runs in a guest (a development guestd on a host) never acts."""
    if config.simulate_privileged:
        return FORCED
    if not config.in_guest:
        return NOT_IN_GUEST
    return None


class Privileged:
    """Steps that change the machine. Recorded instead of done when simulating (``why``)."""

    def __init__(self, why: str | None) -> None:
        self.why = why  # None: done for real
        self.simulate = why is not None
        self.recorded: list[str] = []

    def _record(self, what: str) -> bool:
        if self.simulate:
            self.recorded.append(what)
        return self.simulate

    def reseed_crng(self, entropy: bytes) -> str:
        if self._record(f"RNDADDENTROPY {len(entropy)} bytes + RNDRESEEDCRNG"):
            return "simulated"
        import fcntl
        import struct

        fd = os.open("/dev/random", os.O_WRONLY | os.O_CLOEXEC)
        try:
            words = (len(entropy) + 3) // 4
            buf = struct.pack("ii", len(entropy) * 8, len(entropy)) + entropy.ljust(words * 4, b"\0")
            fcntl.ioctl(fd, RNDADDENTROPY, buf)
            fcntl.ioctl(fd, RNDRESEEDCRNG)
        finally:
            os.close(fd)
        return "done"

    def set_clock(self, time_ns: int) -> str:
        if self._record(f"clock_settime(CLOCK_REALTIME, {time_ns})"):
            return "simulated"
        time.clock_settime_ns(time.CLOCK_REALTIME, time_ns)
        return "done"

    def set_hostname(self, name: str) -> str:
        if self._record(f"sethostname({name!r}) and /etc/hostname"):
            return "simulated"
        import socket

        socket.sethostname(name)
        try:
            with open("/etc/hostname", "w") as f:
                f.write(name + "\n")
        except OSError:
            pass
        return "done"

    def set_machine_id(self, machine_id: str) -> str:
        if self._record(f"/etc/machine-id = {machine_id}"):
            return "simulated"
        tmp = "/etc/machine-id.guestd-tmp"
        with open(tmp, "w") as f:
            f.write(machine_id + "\n")
        os.replace(tmp, "/etc/machine-id")
        return "done"

    def remove_seed_files(self) -> list[str]:
        removed = []
        for path in RANDOM_SEED_FILES:
            if os.path.exists(path):
                if not self._record(f"unlink {path}"):
                    os.unlink(path)
                removed.append(path)
        return removed

    def freeze_fs(self, path: str) -> int:
        """FIFREEZE ``path`` (it syncs the file system first: call it in an I/O thread); returns
        the fd that holds the freeze, -1 when simulated."""
        if self._record(f"FIFREEZE {path}"):
            return -1
        import fcntl

        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.ioctl(fd, FIFREEZE, 0)
        except OSError as exc:
            os.close(fd)
            raise GuestdError.from_os_error(exc, stage="fsfreeze", path=path) from None
        return fd

    def thaw_fs(self, path: str, fd: int) -> None:
        """FITHAW what :meth:`freeze_fs` froze and close its fd; a failure is logged, not raised."""
        if self._record(f"FITHAW {path}"):
            return
        import fcntl

        try:
            fcntl.ioctl(fd, FITHAW, 0)
        except OSError as exc:
            log.warning("cannot thaw %s: %s", path, exc)
        finally:
            os.close(fd)
