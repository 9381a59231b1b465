"""snapshot.prepare freeze: the workload cgroup stops until resume, restore or freeze_max_s;
clone hazards; fsfreeze only of a mount point other than / (FIFREEZE itself is simulated here:
privileged steps are, on this host); after a restore, the generation file and the signal to
processes started with GUESTD_ON_RESTORE. PROTOCOL.md 11."""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator

import pytest

from guestd.client import Client, GuestdError
from guestd.testing import Guestd, start_guestd
from guestd.testing.cgroups import contained_config

QUIET_S = 0.5  # a counter beating every 20 ms writes ~25 lines in this window unless frozen


@pytest.fixture(scope="module")
def fg(scratch: str) -> Iterator[Guestd]:
    d = tempfile.mkdtemp(prefix="guestd-freeze-")
    os.chmod(d, 0o755)
    cfg = contained_config(d, os.path.join(scratch, "freeze"))
    g = start_guestd(d, "--config", cfg, "--simulate-privileged", "--runtime-dir", f"{d}/rt", "--code-pool", "0")
    yield g
    g.stop()
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def counter(fg: Guestd) -> Iterator[tuple[Client, str]]:
    """A workload process appending a line every 20 ms to a file the test reads directly."""
    d = tempfile.mkdtemp(prefix="guestd-count-")
    os.chmod(d, 0o777)
    path = os.path.join(d, "count")
    with fg.client() as c:
        p = c.process_start(["sh", "-c", f"while :; do echo x >> {path}; sleep 0.02; done"])
        wait_growing(path)
        yield c, path
        c.snapshot_resume()
        c.process_signal(p.id, "KILL")
    shutil.rmtree(d, ignore_errors=True)


def size(path: str) -> int:
    return os.path.getsize(path) if os.path.exists(path) else 0


def wait_growing(path: str, limit_s: float = 10.0) -> None:
    start, deadline = size(path), time.monotonic() + limit_s
    while size(path) <= start:
        assert time.monotonic() < deadline, "the counter does not count"
        time.sleep(0.02)


def still(path: str) -> bool:
    before = size(path)
    time.sleep(QUIET_S)
    return size(path) == before


def test_freeze_stops_the_workload_until_resume(counter: tuple[Client, str]) -> None:
    c, path = counter
    rep = c.snapshot_prepare(freeze=True)
    assert rep.frozen and rep.quiesced and rep.fs_frozen is None
    assert c.info().raw["snapshot"]["frozen"]
    assert still(path)  # no increments while frozen
    c.snapshot_resume()
    wait_growing(path)
    assert not c.info().raw["snapshot"]["frozen"]


def test_restore_thaws(counter: tuple[Client, str]) -> None:
    c, path = counter
    assert c.snapshot_prepare(freeze=True).frozen
    assert still(path)
    rep = c.restore(time_ns=time.time_ns(), entropy=os.urandom(32))
    assert rep.thawed
    wait_growing(path)
    assert c.exec("echo ok").stdout == b"ok\n"  # new work is taken again


def test_a_forgotten_freeze_ends_by_itself(counter: tuple[Client, str]) -> None:
    c, path = counter
    assert c.snapshot_prepare(freeze=True, freeze_max_s=0.3).frozen
    wait_growing(path)  # thawed after freeze_max_s, with no resume
    assert c.exec("echo ok").stdout == b"ok\n"


def test_hazards_list_listening_sockets_and_connections(fg: Guestd) -> None:
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as cli, srv.accept()[0]:
            with fg.client() as c:
                hz = c.snapshot_prepare().hazards
            local = f"127.0.0.1:{cli.getsockname()[1]}"
            assert f"127.0.0.1:{port}" in hz.listening
            assert f"{local} -> 127.0.0.1:{port}" in hz.established
            assert hz.listening_count >= len(hz.listening) >= 1


def test_fsfreeze_only_of_a_mount_point_other_than_root(fg: Guestd) -> None:
    plain = tempfile.mkdtemp(prefix="guestd-notmount-")
    assert not os.path.ismount(plain)
    with fg.client() as c:
        for bad in (plain, "/", "relative"):
            with pytest.raises(GuestdError) as ei:
                c.snapshot_prepare(fsfreeze=bad)
            assert ei.value.code == "bad_request" and ei.value.details["field"] == "fsfreeze"
        assert c.exec("echo ok").stdout == b"ok\n"  # refused before anything was held
        rep = c.snapshot_prepare(fsfreeze="/proc")  # simulated: recorded, never done on this host
        assert rep.fs_frozen == "/proc" and c.info().raw["snapshot"]["fs_frozen"] == "/proc"
        c.snapshot_resume()
        assert c.info().raw["snapshot"]["fs_frozen"] is None
    os.rmdir(plain)


def lines(path: str) -> int:
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return len(f.read().split())


def wait_lines(path: str, n: int) -> None:
    deadline = time.monotonic() + 10
    while lines(path) < n:
        assert time.monotonic() < deadline, "the registered process did not get its signal"
        time.sleep(0.02)


def test_restore_tells_the_workload(fg: Guestd) -> None:
    """The generation file (readable by the workload user) changes; a process started with
    GUESTD_ON_RESTORE gets its signal, one without it does not."""
    d = tempfile.mkdtemp(prefix="guestd-notify-")
    os.chmod(d, 0o777)
    got = os.path.join(d, "got")
    loop = f"trap 'echo $$ >> {got}' USR2; while :; do sleep 0.05; done"
    with fg.client() as c:
        asked = c.process_start(["sh", "-c", loop], env={"GUESTD_ON_RESTORE": "USR2"})
        other = c.process_start(["sh", "-c", loop])
        rep = c.restore(time_ns=time.time_ns(), entropy=os.urandom(32), hostname="clone-7")
        # Exactly the registered one: not the other, nor its own `sleep` (which inherited the
        # variable but does not catch USR2, so the signal would only kill it).
        assert rep.signalled == [asked.pid]
        wait_lines(got, 1)
        r = c.exec(["cat", rep.generation_file])  # as the workload user (nobody)
        seen = json.loads(r.stdout)
        assert (seen["generation"], seen["hostname"]) == (rep.generation, "clone-7"), r
        assert seen["instance_id"] == rep.instance_id
        again = c.restore(time_ns=time.time_ns(), entropy=os.urandom(32))
        r = c.exec(["cat", rep.generation_file])
        assert json.loads(r.stdout)["generation"] == again.generation > rep.generation
        assert again.signalled == [asked.pid]
        wait_lines(got, 2)
        for p in (asked, other):
            c.process_signal(p.id, "KILL")
    with open(got) as f:
        assert f.read().split() == [str(asked.pid)] * 2  # once per restore, never the other
    shutil.rmtree(d, ignore_errors=True)
