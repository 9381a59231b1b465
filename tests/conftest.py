"""Fixtures: real guestd processes on Unix sockets (guestd.testing starts them), clients for
them, a guestd with a workspace per test module, and a fake guest for the client's side."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator

import pytest

from guestd.client import Client
from guestd.testing import Guestd, StartGuestd, fakeguest, start_guestd, workspace_guestd
from guestd.testing.rawwire import FAKE_GUEST_HELLO, RawPeer
from guestd.wire.frames import Kind

# A suite started from a script's background job (`cmd &` without job control) inherits SIGINT
# ignored, and an ignored signal stays ignored across exec: guestctl and the clients these tests
# interrupt with SIGINT (Ctrl-C) would never see it. A handler, unlike SIG_IGN, is reset at exec.
signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def guestd() -> Iterator[Guestd]:
    """One daemon shared by the tests that do not need special settings."""
    with tempfile.TemporaryDirectory(prefix="guestd-test-") as d:
        g = start_guestd(d)
        yield g
        assert g.alive(), "guestd died during the session:\n" + g.log()
        g.stop()


@pytest.fixture
def fresh_guestd() -> Iterator[StartGuestd]:
    """Factory for a private daemon with extra arguments; stopped after the test."""
    started: list[Guestd] = []

    def make(*args: str, **kw: object) -> Guestd:
        d = tempfile.mkdtemp(prefix="guestd-fresh-")
        g = start_guestd(d, *args, **kw)  # type: ignore[arg-type]
        started.append(g)
        return g

    yield make
    for g in started:
        g.stop()
        shutil.rmtree(g.workdir, ignore_errors=True)


@pytest.fixture
def client(guestd: Guestd) -> Iterator[Client]:
    with guestd.client() as c:
        yield c


@pytest.fixture(scope="module")
def workspace_env(request: pytest.FixtureRequest) -> Iterator[tuple[Guestd, str]]:
    """``(guestd, workspace)``: a guestd of this test module's own whose workspace is a new
    directory (as root: owned by the workload user nobody, whom guestd runs the workload as);
    stopped and removed after the module. A module that needs files planted before the start
    overrides this fixture with its own of the same name (workspace_client then uses that)."""
    module = request.path.stem.removeprefix("test_").replace("_", "-")
    with workspace_guestd(f"guestd-{module}-") as env:
        yield env


@pytest.fixture
def workspace_client(workspace_env: tuple[Guestd, str]) -> Iterator[Client]:
    """A blocking client of the module's workspace guestd, closed after the test."""
    with workspace_env[0].client() as client:
        yield client


@pytest.fixture
def workspace_dir(workspace_env: tuple[Guestd, str]) -> Iterator[str]:
    """A new directory (0755) inside the module's workspace for one test, removed after it."""
    d = tempfile.mkdtemp(dir=workspace_env[1])
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)
    if os.path.lexists(d) and shutil.which("chattr") is not None:
        # What is left is held by an immutable flag a test set (chattr +i) and did not take off.
        subprocess.run(["chattr", "-R", "-i", d], capture_output=True, check=False)
        shutil.rmtree(d, ignore_errors=True)


FakeGuest = Callable[..., str]


@pytest.fixture
def evil(tmp_path: object) -> Iterator[FakeGuest]:
    """``evil(script, hello=None)``: a fake guest on a Unix socket that answers the client's
    hello with ``hello`` (default FAKE_GUEST_HELLO) and then runs ``script`` on the
    connection; returns the address to connect to."""
    servers: list[socket.socket] = []
    conns: list[socket.socket] = []

    def start(script: Callable[[RawPeer], None], hello: dict[str, object] | None = None) -> str:
        path = f"{tmp_path}/evil{len(servers)}.sock"
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(path)
        srv.listen(1)
        servers.append(srv)

        def serve() -> None:
            conn, _ = srv.accept()
            conns.append(conn)
            peer = RawPeer(conn)
            peer.recv()  # the client's hello
            peer.send(Kind.HELLO, 0, hello or FAKE_GUEST_HELLO)
            try:
                script(peer)
            except (OSError, EOFError):
                pass

        threading.Thread(target=serve, daemon=True).start()
        return f"unix:{path}"

    yield start
    for s in servers + conns:
        s.close()


@pytest.fixture
def fake_guest(tmp_path: object) -> Iterator[Callable[..., fakeguest.FakeGuest]]:
    """``fake_guest(script, hello=None)``: a started :class:`FakeGuest` that runs ``script`` on
    every connection (guestctl connects once per run); closed after the test."""
    started: list[fakeguest.FakeGuest] = []

    def start(script: fakeguest.Script, hello: dict[str, object] | None = None) -> fakeguest.FakeGuest:
        g = fakeguest.FakeGuest(f"{tmp_path}/fake{len(started)}.sock", script, hello).start()
        started.append(g)
        return g

    yield start
    for g in started:
        g.close()


@pytest.fixture(scope="session")
def workload_py() -> Iterator[str]:
    """A Python the workload user (nobody) can run with this venv's packages, for a guestd as
    root whose kernels run as the workload user (guestd.testing.workload_python)."""
    from guestd.testing import workload_python

    d = tempfile.mkdtemp(prefix="guestd-wlpy-")
    os.chmod(d, 0o755)
    try:
        python = workload_python(f"{d}/venv")
        if python is None:
            pytest.skip("no system python3 of this version to make a Python the workload user can run")
        yield python
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def scratch() -> Iterator[str]:
    """A scratch cgroup v2 sub-tree for workload cgroups, removed (processes killed) afterwards."""
    from guestd.testing.cgroups import UNIFIED, cgroup_usable, make_scratch, remove_tree

    if not cgroup_usable():
        pytest.skip("needs root and cgroup v2 at " + UNIFIED)
    cg = make_scratch()
    try:
        yield cg
    finally:
        remove_tree(cg)


@pytest.fixture(scope="module")
def contained(scratch: str) -> Iterator[Guestd]:
    """A guestd in the shipped configuration: workload user nobody, a workload cgroup in ``scratch``."""
    from guestd.testing.cgroups import start_contained

    g = start_contained(scratch, "workload")
    yield g
    g.stop()
    shutil.rmtree(g.workdir, ignore_errors=True)
