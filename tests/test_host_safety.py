"""A guestd on a host never changes the host (issue 30, item 7).

restore sets the clock, the hostname and /etc/machine-id and re-seeds the CRNG; prepare removes
random-seed files. Those steps act only when the config says guestd runs in a guest
(``in_guest = true``); a development guestd simulates them and says why.

So that even a broken guard cannot touch this machine, every guestd here runs contained:
its own UTS namespace (sethostname changes only that), its own mount namespace with
overlays on /etc and /var/lib whose writes land in a private tmpfs (machine-id, hostname
file, random-seed files), and no CAP_SYS_TIME (clock_settime fails loudly instead of
setting this machine's clock). Each test checks the containment is in place before it sends
anything that could act, and the control (a guestd configured as a guest) shows the
containment catches what a real step does.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from guestd.client import GuestdError
from guestd.testing import Guestd
from guestd.testing.local import start_guestd

CAP_SYS_TIME = 25
SCRATCH_MACHINE_ID = "0123456789abcdef0123456789abcdef"
SEED_FILES = ("/var/lib/systemd/random-seed", "/var/lib/urandom/random-seed", "/var/lib/random-seed")
HOUR_NS = 3_600 * 10**9

# Run in the new namespaces before guestd: $1 an empty directory for the private tmpfs, then
# guestd's command line. `set -e`: a mount that fails ends here, and guestd never starts.
CONTAIN = """
set -e
mount -t tmpfs -o mode=0700 guestd-host-safety "$1"
for d in etc var/lib; do
    mkdir -p "$1/$d/upper" "$1/$d/work"
    mount -t overlay overlay -o "lowerdir=/$d,upperdir=$1/$d/upper,workdir=$1/$d/work" "/$d"
done
printf '%s\\n' "$2" > /etc/machine-id
mkdir -p /var/lib/systemd /var/lib/urandom
for f in $3; do printf seed > "$f"; done
shift 3
exec setpriv --bounding-set=-sys_time --inh-caps=-sys_time -- "$@"
"""


def _containment_missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root (namespaces, mounts)"
    for tool in ("unshare", "setpriv", "nsenter"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    with open("/proc/filesystems") as f:
        if "overlay" not in f.read():
            return "needs overlayfs"
    return None


pytestmark = pytest.mark.skipif(_containment_missing() is not None, reason=str(_containment_missing()))


def _cap_bits(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1], 16)
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def _ns_hostname(pid: int) -> str:
    return subprocess.run(
        ["nsenter", "--target", str(pid), "--uts", "cat", "/proc/sys/kernel/hostname"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def _in_ns(pid: int, path: str) -> str:
    """A file as guestd sees it (through its mount namespace)."""
    with open(f"/proc/{pid}/root{path}") as f:
        return f.read()


def _wall_minus_mono() -> float:
    return time.time() - time.monotonic()


def assert_contained(g: Guestd) -> None:
    """What makes a broken guard harmless; checked before any request that could act."""
    pid = g.pid
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        assert b"guestd" in f.read(), "the pid is not guestd itself (the wrapper did not exec)"
    for ns in ("uts", "mnt"):
        assert os.readlink(f"/proc/{pid}/ns/{ns}") != os.readlink(f"/proc/self/ns/{ns}"), ns
    for field in ("CapEff", "CapPrm", "CapBnd"):
        assert not _cap_bits(pid, field) >> CAP_SYS_TIME & 1, f"guestd still has CAP_SYS_TIME in {field}"
    assert _in_ns(pid, "/etc/machine-id") == SCRATCH_MACHINE_ID + "\n", "/etc is not the private overlay"
    for path in SEED_FILES:
        assert _in_ns(pid, path) == "seed", f"{path} is not the private overlay's"


@contextmanager
def contained_guestd(config: str, *args: str) -> Iterator[Guestd]:
    """A guestd with this config text (and ``args``), in its own UTS and mount namespaces,
    without CAP_SYS_TIME."""
    with tempfile.TemporaryDirectory(prefix="guestd-hostsafety-") as d:
        os.mkdir(f"{d}/ns")
        with open(f"{d}/guestd.toml", "w") as f:
            f.write(config)
        wrapper = ["unshare", "--uts", "--mount", "--propagation", "private", "--", "sh", "-c", CONTAIN]
        wrapper += ["contain", f"{d}/ns", SCRATCH_MACHINE_ID, " ".join(SEED_FILES)]
        g = start_guestd(
            d, "--config", f"{d}/guestd.toml", "--runtime-dir", f"{d}/rt", "--code-pool", "0", *args, wrapper=wrapper
        )
        try:
            assert_contained(g)
            yield g
        finally:
            g.stop()


def _restore(g: Guestd, generation: int, time_ns: int, hostname: str) -> dict[str, Any]:
    with g.client() as c:
        return c.call(
            "snapshot.restore",
            {
                "generation": generation,
                "nonce": f"n{generation}",
                "time_ns": time_ns,
                "entropy": os.urandom(32),
                "identity": {"sandbox_id": f"sbx-{generation}", "hostname": hostname},
            },
        )


def test_restore_and_prepare_on_a_host_simulate_and_change_nothing() -> None:
    host_name = socket.gethostname()
    with contained_guestd("") as g:
        ns_name, etc_hostname = _ns_hostname(g.pid), _in_ns(g.pid, "/etc/hostname")
        wall_before = _wall_minus_mono()
        rep = _restore(g, 1, time.time_ns() + HOUR_NS, "clone-on-a-host")
        assert rep["simulated"] is not None and "in_guest" in rep["simulated"], rep
        assert (rep["crng"], rep["clock"], rep["hostname"], rep["machine_id"]) == ("simulated",) * 4, rep
        assert any(a.startswith("clock_settime") for a in rep["actions"]), rep["actions"]
        assert _ns_hostname(g.pid) == ns_name and _in_ns(g.pid, "/etc/hostname") == etc_hostname
        assert _in_ns(g.pid, "/etc/machine-id") == SCRATCH_MACHINE_ID + "\n"
        assert abs(_wall_minus_mono() - wall_before) < 60, "the wall clock moved by the restore's hour"
        assert socket.gethostname() == host_name

        with g.client() as c:
            check = c.call("clock.check", {"time_ns": time.time_ns() + HOUR_NS})
            assert check["clock"] == "simulated" and check["simulated"] == rep["simulated"], check
            prep = c.call("snapshot.prepare", {})
            assert prep["simulated"] == rep["simulated"] and sorted(prep["seed_files_removed"]) == sorted(SEED_FILES)
            assert c.info().raw["snapshot"]["simulated"] == rep["simulated"]
        for path in SEED_FILES:
            assert _in_ns(g.pid, path) == "seed", f"prepare removed {path}"
        assert abs(_wall_minus_mono() - wall_before) < 60


def test_simulate_privileged_wins_over_in_guest() -> None:
    with contained_guestd("in_guest = true\nsimulate_privileged = true\n") as g:
        ns_name = _ns_hostname(g.pid)
        rep = _restore(g, 1, time.time_ns(), "forced-simulation")
        assert rep["simulated"] is not None and "simulate_privileged" in rep["simulated"], rep
        assert rep["hostname"] == "simulated" and _ns_hostname(g.pid) == ns_name


def test_the_control_a_guest_config_acts_and_the_containment_catches_it() -> None:
    """in_guest = true: the steps run for real, inside the containment. The clock step fails
    loudly (no CAP_SYS_TIME: what a broken guard would meet); hostname, machine-id and the
    seed files change only in guestd's namespaces."""
    host_name = socket.gethostname()
    with open("/etc/machine-id") as f:
        host_machine_id = f.read()
    with contained_guestd("in_guest = true\n") as g:
        with pytest.raises(GuestdError) as failed:
            _restore(g, 1, time.time_ns() + HOUR_NS, "clone-in-guest")
        assert failed.value.code == "permission_denied", failed.value
        rep = _restore(g, 2, time.time_ns(), "clone-in-guest")
        assert rep["simulated"] is None and rep["actions"] == [], rep
        assert (rep["crng"], rep["clock"], rep["hostname"], rep["machine_id"]) == ("done", "kept", "done", "done")
        assert _ns_hostname(g.pid) == "clone-in-guest" and _in_ns(g.pid, "/etc/hostname") == "clone-in-guest\n"
        assert _in_ns(g.pid, "/etc/machine-id") not in ("", SCRATCH_MACHINE_ID + "\n")
        with g.client() as c:
            prep = c.call("snapshot.prepare", {})
        assert prep["simulated"] is None and sorted(prep["seed_files_removed"]) == sorted(SEED_FILES)
        assert not any(os.path.exists(f"/proc/{g.pid}/root{path}") for path in SEED_FILES)
    assert socket.gethostname() == host_name
    with open("/etc/machine-id") as f:
        assert f.read() == host_machine_id


def test_the_in_guest_flag_guestd_init_passes_as_pid_1_acts_like_the_config_key() -> None:
    with contained_guestd("", "--in-guest") as g:
        rep = _restore(g, 1, time.time_ns(), "clone-by-flag")
        assert rep["simulated"] is None and rep["hostname"] == "done", rep
        assert _ns_hostname(g.pid) == "clone-by-flag"
