"""A red-team pass on the session's changes (foreign kernels, spill, run.cancel, shell.resize, the
O_TMPFILE temp-name record, the framework integrations), against a real guestd as root with the
workload user nobody: each test is an attack a workload process makes for real."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest

from guestd.client import AsyncClient, Client, GuestdError
from guestd.testing import REPO, Guestd, start_guestd
from tests.helpers import KILLED_BETWEEN_LINK_AND_RENAME

NOBODY = 65534


pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a workload user needs guestd as root")


def _bash_kernel_installed() -> bool:
    from jupyter_client.kernelspec import KernelSpecManager

    return "bash" in KernelSpecManager().find_kernel_specs()


needs_bash = pytest.mark.skipif(
    not _bash_kernel_installed(), reason="no 'bash' kernelspec (scripts/test.sh installs it)"
)


def _contained_guestd(
    scratch: str, workload_py: str, prefix: str, jupyter_path: str | None, *args: str
) -> Iterator[Guestd]:
    """guestd as root, workload user nobody (who can run its Python: kernels run as nobody),
    its runtime dir known to the test; ``jupyter_path`` None: this venv's kernelspecs."""
    from guestd.testing.cgroups import contained_config

    d = tempfile.mkdtemp(prefix=prefix)
    os.chmod(d, 0o755)
    jp = jupyter_path.replace("{dir}", d) if jupyter_path else f"{sys.prefix}/share/jupyter"
    if jupyter_path:
        os.makedirs(f"{jp}/kernels/wbash")
        with open(f"{jp}/kernels/wbash/kernel.json", "w") as f:
            json.dump({"argv": ["python", "-m", "bash_kernel", "-f", "{connection_file}"], "language": "bash"}, f)
    cfg = contained_config(d, os.path.join(scratch, prefix.strip("-")))
    g = start_guestd(
        d, "--config", cfg, "--runtime-dir", f"{d}/rt", "--code-pool", "0", *args,
        python=workload_py, env={"JUPYTER_PATH": jp},
    )  # fmt: skip
    try:
        yield g
    finally:
        g.stop()
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def rg(scratch: str, workload_py: str) -> Iterator[Guestd]:
    """guestd as root, workload user nobody, this venv's kernelspecs (bash_kernel)."""
    yield from _contained_guestd(scratch, workload_py, "guestd-redteam-", None, "--max-contexts", "8")


@pytest.fixture
def tmp_path() -> Iterator[str]:
    """A scratch directory the workload user can reach (pytest's own is under a 0700 directory)."""
    d = tempfile.mkdtemp(prefix="guestd-redteam-t-")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def c(rg: Guestd) -> Iterator[Client]:
    with rg.client() as client:
        yield client


def _open_dir(path: str) -> str:
    """A directory nobody can write (the workload's own)."""
    os.makedirs(path, exist_ok=True)
    os.chmod(path, 0o777)
    return path


# A workload process: on every new *.json in the kernel directory it owns, rename a symlink
# to ``target`` over it (inotify: it reacts within microseconds of guestd creating the file).
_SWAPPER = r"""
import ctypes, os, struct, sys
d, target = sys.argv[1], sys.argv[2]
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.inotify_init()
assert fd >= 0 and libc.inotify_add_watch(fd, d.encode(), 0x100 | 0x20) >= 0  # IN_CREATE | IN_OPEN
print("watching", flush=True)
n = 0
while True:
    buf = os.read(fd, 65536)
    i = 0
    while i < len(buf):
        _, mask, _, ln = struct.unpack_from("iIII", buf, i)
        name = buf[i + 16 : i + 16 + ln].rstrip(b"\0").decode()
        i += 16 + ln
        if name.endswith(".json"):
            n += 1
            tmp = os.path.join(d, f".swap{n}")
            try:
                os.symlink(target, tmp)
                os.rename(tmp, os.path.join(d, name))
            except OSError:
                pass
"""


@needs_bash
def test_a_foreign_kernels_connection_file_does_not_follow_the_workloads_symlink(
    rg: Guestd, c: Client, tmp_path: str, workload_py: str
) -> None:
    """guestd (root) wrote the connection file in the workload user's own kernel directory by
    name, then chmod'ed and chown'ed it by name: a workload renaming a symlink over the file as
    soon as it appears had root chown (and truncate, and write the key into) any file it named."""
    victim = f"{tmp_path}/victim"
    with open(victim, "w") as f:
        f.write("ORIGINAL")
    os.chmod(victim, 0o600)
    os.chmod(str(tmp_path), 0o755)
    # The first context makes the workload user's kernel directory (guestd's Python kernel).
    first = c.code_create()
    c.code_close(first.id)
    kdir = f"{rg.workdir}/rt/kernels/u{NOBODY}"
    assert os.stat(kdir).st_uid == NOBODY
    script = _open_dir(f"{tmp_path}/w") + "/swap.py"
    with open(script, "w") as f:
        f.write(_SWAPPER)
    p = c.process_start([workload_py, script, kdir, victim])
    try:
        deadline = time.monotonic() + 20
        while b"watching" not in c.process_output(p.id, follow=False).stdout:
            out = c.process_output(p.id, follow=False)
            assert time.monotonic() < deadline and out.status.state == "running", out
            c.process_wait(p.id, timeout_s=0.1)
        outcomes = []
        for _ in range(15):
            try:
                ctx = c.code_create(kernel="bash")
                outcomes.append("ok")
                c.code_close(ctx.id)
            except GuestdError as e:
                outcomes.append(e.code)
            st = os.lstat(victim)
            assert (st.st_uid, st.st_mode & 0o777) == (0, 0o600), f"root chowned the victim: {outcomes}"
            with open(victim) as f:
                assert f.read() == "ORIGINAL", f"root wrote into the victim: {outcomes}"
    finally:
        c.process_signal(p.id, "KILL")
    assert "unavailable" in outcomes or "ok" in outcomes, outcomes
    # Nothing of the swap's is left for a later kernel to trip on.
    assert [n for n in os.listdir(kdir) if n.endswith(".json")] == []


def test_guestds_kernel_does_not_import_the_workloads_modules_from_its_cwd(c: Client, tmp_path: str) -> None:
    """guestd's own kernel ran ``python -m guestd.code.kernel`` in the context's cwd, so the
    first entry of its sys.path was that directory: a workload's ``guestd/`` (or ``json.py``,
    ``ctypes/``...) there ran inside the kernel before the key hand-over, and read the key that
    no workload process may have."""
    cwd = _open_dir(f"{tmp_path}/ws")
    marks = _open_dir(f"{tmp_path}/marks")
    os.makedirs(f"{cwd}/guestd", exist_ok=True)
    with open(f"{cwd}/guestd/__init__.py", "w") as f:
        f.write(
            "import os\n"
            f"open({marks!r} + '/ran-' + str(os.getpid()), 'w').close()\n"
            f"__path__[:] = [{REPO + '/guestd'!r}]\n"
            f"exec(open({REPO + '/guestd/__init__.py'!r}).read())\n"
        )
    ctx = c.code_create(cwd=cwd)
    try:
        r = c.code_run("import os; print(os.getcwd())", context=ctx.id)
        assert r.status == "ok" and r.stdout == f"{cwd}\n".encode()
        # A cell still imports the workload's modules from its cwd, as in any notebook.
        with open(f"{cwd}/localmod.py", "w") as f:
            f.write("X = 7\n")
        r = c.code_run("import localmod; print(localmod.X)", context=ctx.id)
        assert r.status == "ok" and r.stdout == b"7\n", r
    finally:
        c.code_close(ctx.id)
    assert os.listdir(marks) == [], "the workload's module ran in guestd's kernel"


_TARGET = """
import os, signal, sys
flag = sys.argv[1]
def hit(n, _):
    with open(flag, "a") as f:
        f.write(f"{n}\\n")
for s in (signal.SIGWINCH, signal.SIGINT, signal.SIGTERM, signal.SIGQUIT):
    signal.signal(s, hit)
print("ready", flush=True)
while True:
    signal.pause()
"""


def test_a_pid_the_workload_writes_into_a_jobs_status_fifo_is_never_signalled(c: Client, tmp_path: str) -> None:
    """A pty command's job writes its pid into a status FIFO that the session's bash holds as
    fd 9; guestd (root) took the first line as the job's process group for shell.resize and
    INPUT signals (and the kill after an interrupt). The workload (bash's user) can write into
    that FIFO through /proc/<bash>/fd/9: a pid it wrote first had root signal any process
    group. Now a pid is taken only if it is a child of the session's bash leading its group."""
    from guestd.client.expect import Expect

    flag = f"{tmp_path}/hit"
    target = subprocess.Popen(
        [sys.executable, "-c", _TARGET, flag], stdout=subprocess.PIPE, start_new_session=True
    )  # root's, a process group of its own: never the workload's to signal
    try:
        assert target.stdout is not None and target.stdout.readline() == b"ready\n"
        sid = c.shell_create().id
        bash = next(s.pid for s in c.shell_list() if s.id == sid)
        forger = c.process_start(
            ["/bin/sh", "-c", f"while :; do echo {target.pid} >/proc/{bash}/fd/9; done 2>/dev/null"]
        )

        async def go() -> None:
            async with await AsyncClient.connect(c.aio.address) as ac:
                for i in range(20):
                    # A workload flooding the FIFO may keep its own job from Ctrl-C: the command
                    # then ends by itself.
                    async with Expect.start(ac, sid, "echo go; sleep 1", timeout_s=30) as e:
                        await e.expect(b"go\r\n", timeout=20)
                        await e.resize(30 + i, 100)
                        await e.interrupt()
                        await e.wait(timeout=40)

        try:
            asyncio.run(go())
        finally:
            c.process_signal(forger.id, "KILL")
        assert not os.path.exists(flag), f"root signalled the workload's chosen group: {open(flag).read()!r}"
        assert target.poll() is None
    finally:
        target.kill()
        target.wait(10)


def _alive_with(tag: str) -> list[int]:
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if tag in " ".join(p.info["cmdline"] or []):
                found.append(p.pid)
    return found


def _wait_gone(tag: str, timeout: float = 10) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := _alive_with(tag)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return left


@pytest.fixture(scope="module")
def kernel_user(scratch: str, workload_py: str) -> Iterator[Guestd]:
    """guestd as root with a kernelspec the workload user can run (a bash kernel on the
    workload's Python: the venv's own kernelspec names this venv's Python, which nobody may
    not be able to run)."""
    yield from _contained_guestd(scratch, workload_py, "guestd-redteam-k-", "{dir}/jp")


@needs_bash
def test_a_foreign_kernels_processes_die_with_it(kernel_user: Guestd, tmp_path: str) -> None:
    """A foreign (bash) kernel runs as the workload user in the context's cwd and env; what it
    starts in sessions of its own dies when the kernel dies (it ran on in the dead context
    until a restart or close), and with code.close."""
    tag = str(100000 + int.from_bytes(os.urandom(3)) % 900000)  # sleep takes only digits
    with kernel_user.client() as c:
        ctx = c.code_create(kernel="wbash", cwd=tmp_path, env={"RT_TAG": tag})
        try:
            r = c.code_run('id -u; pwd; echo "$RT_TAG"', context=ctx.id, timeout_s=30)
            assert r.stdout.split() == [str(NOBODY).encode(), tmp_path.encode(), tag.encode()], r

            # 10<tag>1 etc.: sleep's argument carries the tag, so only these are found.
            def spawn_three(prefix: str) -> str:
                # Built from the prefix, not by replacing "10" in the text: a tag holding "10"
                # was changed too, so the test looked for names that were never started.
                return (
                    f"setsid -f sleep {prefix}{tag}1; (sleep {prefix}{tag}2 &); "
                    f"nohup sleep {prefix}{tag}3 >/dev/null 2>&1 & disown"
                )

            c.code_run(spawn_three("10"), context=ctx.id, timeout_s=30)
            assert len(_alive_with(f"sleep 10{tag}")) == 3
            r = c.code_run("kill -9 $PPID", context=ctx.id, timeout_s=30)  # the kernel's Python
            assert r.status != "ok"
            assert _wait_gone(f"sleep 10{tag}") == [], "a dead kernel's processes ran on"
            c.code_restart(ctx.id)
            c.code_run(spawn_three("20"), context=ctx.id, timeout_s=30)
            assert len(_alive_with(f"sleep 20{tag}")) == 3
        finally:
            c.code_close(ctx.id)
        assert _wait_gone(f"sleep 20{tag}") == [], "a closed kernel's processes ran on"


def test_a_temp_name_cleanup_acts_only_in_the_directory_guestd_wrote_in(tmp_path: str) -> None:
    """A guestd killed between an overwrite's link and rename leaves a temp name, recorded with
    its directory's path; the next guestd removes it. The workload (who sees the name in its
    directory) moved that directory away and put a symlink to a root directory in its place:
    the cleanup re-resolved the path, followed the link and unlinked a root file of that name
    there. The victim is planted by the test (the workload cannot make a file with the 48
    random bits of the name outside its own directories, so this guards a hardening, not a
    demonstrated loss); now the path must resolve without symlinks to the recorded inode."""
    ws, rootdir, runtime = _open_dir(f"{tmp_path}/ws"), f"{tmp_path}/rootdir", f"{tmp_path}/rt"
    os.mkdir(rootdir)
    sub = f"{ws}/sub"
    os.mkdir(sub)
    with open(f"{sub}/t0", "wb") as f:
        f.write(b"old")
    for p in (sub, f"{sub}/t0"):
        os.chown(p, NOBODY, NOBODY)
    child = subprocess.run(
        [sys.executable, "-c", KILLED_BETWEEN_LINK_AND_RENAME, f"{sub}/t0", f"{runtime}/pending-writes"],
        env={**os.environ, "PYTHONPATH": REPO},
        capture_output=True,
        timeout=60,
    )
    assert child.returncode == -9, child.stderr.decode()
    (temp,) = (n for n in os.listdir(sub) if ".guestd-tmp-" in n)
    with open(f"{rootdir}/{temp}", "w") as f:
        f.write("ROOT'S")
    # The workload's move, as the workload user.
    subprocess.run(
        ["/bin/sh", "-c", f"mv {sub} {ws}/moved && ln -s {rootdir} {sub}"], user=NOBODY, check=True, timeout=30
    )
    os.mkdir(f"{tmp_path}/run")
    start_guestd(f"{tmp_path}/run", "--runtime-dir", runtime).stop()
    assert os.path.exists(f"{rootdir}/{temp}"), "the cleanup followed the workload's link"
    assert os.listdir(f"{runtime}/pending-writes") == []  # the record itself is gone
