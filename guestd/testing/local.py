"""A real guestd process on this machine, on a private Unix socket: what the host tests and
the local examples run against (the same daemon a VM runs, minus the VM)."""

from __future__ import annotations

import os
import resource
import secrets
import select
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import psutil

from guestd.client import Client
from guestd.client.aio import CONNECT_TIMEOUT

# The directory this guestd package was imported from (the checkout, in a checkout): put on a
# started guestd's PYTHONPATH so it runs this same code, not whatever else is installed.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOBODY = 65534  # the workload user of the tests run as root


@dataclass
class Guestd:
    """A guestd process started by ``start_guestd``, listening on ``address``."""

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

    def guestctl_argv(self, *args: str) -> list[str]:
        """The command line of ``guestctl --connect ADDRESS ARGS`` from this checkout."""
        return [sys.executable, "-m", "guestd.cli", "--connect", self.address, *args]

    def guestctl(
        self, *args: str, stdin: bytes | None = None, timeout: float = 120.0
    ) -> subprocess.CompletedProcess[bytes]:
        """Run guestctl against this guestd to its end: exit status, stdout, stderr."""
        return subprocess.run(
            self.guestctl_argv(*args),
            input=stdin,
            capture_output=True,
            timeout=timeout,
            env={**os.environ, "PYTHONPATH": REPO},
            check=False,
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss(self) -> int:
        return int(psutil.Process(self.proc.pid).memory_info().rss)

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM (guestd then ends its kernels, shells and processes), SIGKILL after ``grace_s``."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace_s)
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
    cwd: str | None = None,
    ready_timeout_s: float | None = None,
    python: str | None = None,
    env: dict[str, str] | None = None,
) -> Guestd:
    """Start ``python -m guestd ARGS`` with its socket and log in ``workdir``; returns once it
    listens. ``listen`` replaces the default ``unix:<workdir>/guestd.sock``; ``wrapper`` is a
    command prefix (e.g. NO_DAC); ``ready_timeout_s`` None waits as long as it takes;
    ``python`` replaces this interpreter (see :func:`workload_python`), ``env`` adds to the
    environment."""
    sock_path = os.path.join(workdir, "guestd.sock")
    log_path = os.path.join(workdir, "guestd.log")
    r, w = os.pipe()
    cmd = [*(wrapper or []), python or sys.executable, "-m", "guestd", "--ready-fd", str(w), *args]
    for addr in listen if listen is not None else [f"unix:{sock_path}"]:
        cmd += ["--listen", addr]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            pass_fds=(w,),
            cwd=cwd or workdir,
            preexec_fn=preexec,
            user=user,
            group=user,
            extra_groups=[] if user is not None else None,
            env={**os.environ, "PYTHONPATH": REPO, **(env or {})},
        )
    os.close(w)
    g = Guestd(proc, sock_path, workdir, log_path, list(args))
    with os.fdopen(r, "rb") as ready:
        if ready_timeout_s is not None and not select.select([ready], [], [], ready_timeout_s)[0]:
            proc.kill()
            proc.wait(5)
            raise RuntimeError(f"guestd did not start within {ready_timeout_s} s:\n{g.log()}")
        line = ready.readline()  # EOF without "ready" means it died during start-up
    if line != b"ready\n":
        proc.wait(5)
        raise RuntimeError(f"guestd did not start:\n{g.log()}")
    return g


StartGuestd = Callable[..., Guestd]


def limits_config(directory: str, **limits: object) -> str:
    """A guestd config file in ``directory`` that sets only these ``[limits]``; returns its path."""
    path = os.path.join(directory, "guestd.toml")
    with open(path, "w") as f:
        f.write("[limits]\n" + "".join(f"{k} = {v!r}\n" for k, v in limits.items()))
    return path


# Root without the capabilities that bypass file permissions: permission checks become real.
NO_DAC = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-dac_override,-dac_read_search", "--"]


def fsize_limit(nbytes: int) -> Callable[[], None]:
    """preexec: cap file size (writes beyond it fail with EFBIG; Python ignores SIGXFSZ)."""

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))

    return apply


def unique_sleep() -> str:
    """``sleep N`` with an N no other test on this machine uses (suites run side by side, e.g. the
    spawn fallback beside the host suite, and ``live_procs_with`` sees every process here)."""
    return f"sleep 9{secrets.randbelow(10**7):07d}"


def live_procs_with(marker: str) -> list[psutil.Process]:
    """This machine's processes, zombies aside, whose command line contains ``marker``."""
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and marker in " ".join(p.info["cmdline"] or []):
                out.append(p)
        except psutil.Error:
            continue
    return out


@contextmanager
def scratch_guestd(prefix: str, *args: str) -> Iterator[Guestd]:
    """A guestd with ``args`` whose socket, log and runtime directory (``--runtime-dir``) are
    in a new directory; stopped and removed after."""
    with tempfile.TemporaryDirectory(prefix=prefix) as d:
        g = start_guestd(d, "--runtime-dir", f"{d}/rt", *args)
        try:
            yield g
        finally:
            g.stop()


@contextmanager
def workspace_guestd(
    prefix: str, *, prepare: Callable[[str, str], None] | None = None, limits: str = ""
) -> Iterator[tuple[Guestd, str]]:
    """A guestd whose workspace is a new directory; yields ``(guestd, workspace)`` and removes
    both after. As root the workload user is nobody, who owns the workspace. ``prepare(top,
    workspace)`` runs before the start (to plant files, or a directory outside beside it);
    ``limits`` are lines for the config's ``[limits]`` table."""
    top = tempfile.mkdtemp(prefix=prefix)
    try:
        os.chmod(top, 0o755)
        ws = f"{top}/ws"
        os.makedirs(ws)
        config = f'workspace = "{ws}"\n'
        if os.geteuid() == 0:
            os.chown(ws, NOBODY, NOBODY)
            config += '[policy]\nworkload_user = "nobody"\n'
        if limits:
            config += "[limits]\n" + limits
        if prepare is not None:
            prepare(top, ws)
        with open(f"{top}/guestd.toml", "w") as f:
            f.write(config)
        g = start_guestd(top, "--config", f"{top}/guestd.toml")
        try:
            yield g, ws
        finally:
            g.stop()
    finally:
        shutil.rmtree(top, ignore_errors=True)


def workload_python(directory: str) -> str | None:
    """A Python the workload user can run, with this interpreter's packages: a venv in
    ``directory`` (made 0755) over the system's python3 of the same version, reading this
    venv's site-packages. guestd started with it (``start_guestd(python=...)``) runs its
    kernels as the workload user, as in a guest; this venv's own interpreter may sit under a
    directory only root can enter (/root/.pyenv). None when the system has no such python3."""
    system = shutil.which("python3", path="/usr/bin:/usr/local/bin")
    if system is None:
        return None
    probe = subprocess.run(
        [system, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True, text=True, check=False
    )
    if probe.stdout.strip() != str(tuple(sys.version_info[:2])):
        return None
    made = subprocess.run([system, "-m", "venv", "--without-pip", directory], capture_output=True, check=False)
    if made.returncode != 0:
        return None
    import site
    import sysconfig

    ours = [p for p in site.getsitepackages() if os.path.isdir(p)]
    theirs = subprocess.run(
        [f"{directory}/bin/python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    with open(os.path.join(theirs, "guestd-host-venv.pth"), "w") as f:
        f.write("\n".join([*ours, sysconfig.get_paths()["platlib"]]) + "\n")
    for here, dirs, files in os.walk(directory):
        for name in dirs + files:
            path = os.path.join(here, name)
            if not os.path.islink(path):
                os.chmod(path, os.stat(path).st_mode | 0o055)
    os.chmod(directory, 0o755)
    return f"{directory}/bin/python"
