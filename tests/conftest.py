"""Fixtures: real guestd processes on Unix sockets, and clients for them."""

from __future__ import annotations

import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import psutil
import pytest

from guestd.client import Client
from guestd.client.aio import CONNECT_TIMEOUT

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Guestd:
    """A guestd process started for a test, listening on ``address``."""

    proc: subprocess.Popen[bytes]
    sock_path: str
    workdir: str
    log_path: str
    extra: list[str] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"unix:{self.sock_path}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def client(self, *, connect_timeout: float = CONNECT_TIMEOUT, token: str | None = None) -> Client:
        return Client(self.address, connect_timeout=connect_timeout, token=token)

    def raw_socket(self) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(self.sock_path)
        return s

    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss(self) -> int:
        return int(psutil.Process(self.proc.pid).memory_info().rss)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def start_guestd(
    workdir: str,
    *args: str,
    preexec: Callable[[], None] | None = None,
    user: int | None = None,
    listen: list[str] | None = None,
    wrapper: list[str] | None = None,
) -> Guestd:
    sock_path = os.path.join(workdir, "guestd.sock")
    log_path = os.path.join(workdir, "guestd.log")
    r, w = os.pipe()
    cmd = [*(wrapper or []), sys.executable, "-m", "guestd", "--ready-fd", str(w), *args]
    for addr in listen if listen is not None else [f"unix:{sock_path}"]:
        cmd += ["--listen", addr]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            pass_fds=(w,),
            cwd=workdir,
            preexec_fn=preexec,
            user=user,
            group=user,
            extra_groups=[] if user is not None else None,
            env={**os.environ, "PYTHONPATH": REPO},
        )
    os.close(w)
    with os.fdopen(r, "rb") as ready:
        line = ready.readline()  # EOF without "ready" means it died during start-up
    if line != b"ready\n":
        proc.wait(5)
        with open(log_path, errors="replace") as f:
            raise RuntimeError(f"guestd did not start:\n{f.read()}")
    return Guestd(proc, sock_path, workdir, log_path, list(args))


StartGuestd = Callable[..., Guestd]


def limits_config(directory: str, **limits: object) -> str:
    """A guestd config file in ``directory`` that sets only these ``[limits]``; returns its path."""
    path = os.path.join(directory, "guestd.toml")
    with open(path, "w") as f:
        f.write("[limits]\n" + "".join(f"{k} = {v!r}\n" for k, v in limits.items()))
    return path


@pytest.fixture(scope="session")
def guestd() -> Iterator[Guestd]:
    """One daemon shared by the tests that do not need special settings."""
    with tempfile.TemporaryDirectory(prefix="guestd-test-") as d:
        g = start_guestd(d)
        yield g
        assert g.alive(), "guestd died during the session:\n" + g.log()
        g.stop()


@pytest.fixture
def fresh_guestd() -> Iterator[Callable[..., Guestd]]:
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


# Root without the capabilities that bypass file permissions: permission checks become real.
NO_DAC = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-dac_override,-dac_read_search", "--"]


def fsize_limit(nbytes: int) -> Callable[[], None]:
    """preexec: cap file size (writes beyond it fail with EFBIG; Python ignores SIGXFSZ)."""

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))

    return apply


FakeGuest = Callable[..., str]


@pytest.fixture
def evil(tmp_path: object) -> Iterator[FakeGuest]:
    """``evil(script, hello=None)``: a fake guest on a Unix socket that answers the client's
    hello with ``hello`` (default FAKE_GUEST_HELLO) and then runs ``script`` on the
    connection; returns the address to connect to."""
    from guestd.wire.frames import Kind
    from tests.rawwire import FAKE_GUEST_HELLO, RawPeer

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
