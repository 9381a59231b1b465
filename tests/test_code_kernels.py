"""Code contexts on kernels beyond Python: a kernelspec installed in the guest (bash_kernel), against a
real guestd. The same run, timeout, interrupt and death semantics as guestd's own Python kernel, and
the foreign kernel's guarantee of SECURITY.md ("foreign kernels")."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import psutil
import pytest

from guestd.client import AsyncClient, Client, GuestdError
from guestd.testing import REPO, Guestd, scratch_guestd, start_guestd


def _bash_kernel_installed() -> bool:
    from jupyter_client.kernelspec import KernelSpecManager

    return "bash" in KernelSpecManager().find_kernel_specs()


needs_bash = pytest.mark.skipif(
    not _bash_kernel_installed(),
    reason="no 'bash' kernelspec: pip install -e '.[dev]' && python -m bash_kernel.install --sys-prefix "
    "(scripts/test.sh does both)",
)


@pytest.fixture(scope="module")
def kg() -> Iterator[Guestd]:
    with scratch_guestd("guestd-kernels-", "--code-pool", "0", "--max-contexts", "6") as g:
        yield g


@pytest.fixture
def c(kg: Guestd) -> Iterator[Client]:
    with kg.client() as client:
        yield client


def _wait_foreground_sleep(kernel_pid: int) -> None:
    """Until a ``sleep`` below the kernel is its terminal's foreground job (its process group
    is the terminal's, /proc/PID/stat's pgrp and tpgid), at most 30 s."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for pid in _descendants(kernel_pid):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{pid}/comm") as f:
                    comm = f.read().strip()
            except OSError:
                continue
            if comm == "sleep" and fields[2] == fields[5]:
                return
        time.sleep(0.01)
    raise AssertionError("no foreground sleep below the kernel within 30 s")


def _descendants(pid: int) -> list[int]:
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _wait_gone(pids: list[int], seconds: float = 10.0) -> list[int]:
    deadline = time.monotonic() + seconds
    alive = pids
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return []
        time.sleep(0.05)
    return alive


@needs_bash
def test_a_bash_context_keeps_its_variables_cwd_and_env(c: Client, tmp_path: object) -> None:
    ctx = c.code_create(kernel="bash", cwd=str(tmp_path), env={"GREETING": "hello"})
    assert ctx.kernel == "bash" and not ctx.pooled
    r = c.code_run('X=41; echo "$GREETING from $(pwd)"', context=ctx.id)
    assert r.status == "ok" and r.stdout == f"hello from {tmp_path}\n".encode()
    assert r.stdout_bytes == len(r.stdout)
    r = c.code_run("echo $((X + 1))", context=ctx.id)
    assert r.status == "ok" and r.stdout == b"42\n"
    # A command that fails is the cell's error (bash_kernel reports the exit status), not a kernel fault.
    r = c.code_run("false", context=ctx.id)
    assert r.status == "error" and r.error is not None and r.error.evalue == "1"
    listed = {x["id"]: x for x in c.call("code.list")["contexts"]}
    assert listed[ctx.id]["kernel"] == "bash" and listed[ctx.id]["state"] == "idle"
    # The Python kernel stays the default, and says so.
    py = c.code_create()
    assert py.kernel == "python" and c.code_run("6 * 7", context=py.id).text == "42"
    c.code_close(py.id)
    c.code_close(ctx.id)


@needs_bash
def test_an_unknown_kernel_is_not_found_and_lists_what_is_installed(c: Client) -> None:
    with pytest.raises(GuestdError) as ei:
        c.code_create(kernel="no-such-kernel")
    e = ei.value
    assert e.code == "not_found" and e.details["field"] == "kernel" and e.details["kernel"] == "no-such-kernel"
    assert {"python", "bash"} <= set(e.details["installed"])
    assert "bash" in str(e)
    assert all(x["kernel"] != "no-such-kernel" for x in c.call("code.list")["contexts"])  # nothing was made


@needs_bash
def test_a_timeout_interrupts_the_bash_cell_and_keeps_state(c: Client) -> None:
    ctx = c.code_create(kernel="bash")
    c.code_run("KEEP=yes", context=ctx.id)
    t0 = time.monotonic()
    r = c.code_run("echo before; sleep 60; echo after", context=ctx.id, timeout_s=1.0)
    assert r.status == "timeout" and r.timeout_action == "interrupted"
    assert time.monotonic() - t0 < 15
    assert r.stdout.startswith(b"before\n") and b"after" not in r.stdout
    r = c.code_run("echo $KEEP", context=ctx.id, timeout_s=30)
    assert r.status == "ok" and r.stdout == b"yes\n"  # the same kernel: interrupted, not restarted
    c.code_close(ctx.id)


@needs_bash
def test_a_fresh_guestds_first_context_may_be_a_foreign_kernel() -> None:
    """The first create of a guestd with a pool: the pool's kernel start and the kernelspec
    lookup both import jupyter_client, one on the loop, one in the IO pool. At once, one of
    them saw the package half-initialised and the create failed as internal (ImportError)."""
    with scratch_guestd("guestd-kernels-first-", "--code-pool", "1") as g, g.client() as c:
        ctx = c.code_create(kernel="bash")
        r = c.code_run("echo first", context=ctx.id, timeout_s=30)
        assert r.status == "ok" and r.stdout == b"first\n"
        py = c.code_create()  # the pool's kernel, started beside the lookup
        assert c.code_run("print(1 + 1)", context=py.id, timeout_s=30).stdout == b"2\n"


@needs_bash
def test_code_interrupt_stops_the_bash_cell(kg: Guestd) -> None:
    async def go() -> None:
        c = await AsyncClient.connect(kg.address)
        ctx = await c.code_create(kernel="bash")
        s = c.code_run_stream("echo started; sleep 60; echo after", context=ctx.id, timeout_s=60)
        seen = b""
        async for kind, value in s:
            if kind == "stdout":
                seen += value
                if b"started" in seen:
                    break  # the cell runs
        # bash loses a Ctrl-C that comes before the sleep is the terminal's foreground job
        # (bash's own race, PROTOCOL.md 9): 1 in 8 runs failed on a loaded machine.
        await asyncio.to_thread(_wait_foreground_sleep, ctx.pid)
        t0 = time.monotonic()
        await c.code_interrupt(ctx.id)
        r = await asyncio.wait_for(s.result(), 30)
        assert r.status == "interrupted" and time.monotonic() - t0 < 15
        r = await c.code_run("echo next", context=ctx.id, timeout_s=30)
        assert r.status == "ok" and r.stdout == b"next\n"
        await c.code_close(ctx.id)
        await c.close()

    asyncio.run(go())


@needs_bash
def test_a_dying_bash_kernel_is_reported_and_restart_recovers(c: Client) -> None:
    ctx = c.code_create(kernel="bash")
    c.code_run("X=1", context=ctx.id)
    kids = _descendants(ctx.pid)
    assert kids, "bash_kernel runs bash as its child"
    r = c.code_run("kill -9 $PPID", context=ctx.id, timeout_s=30)  # bash's parent: the kernel
    assert r.status == "died" and r.killed_by == "signal"
    assert r.exit_reason is not None and "SIGKILL" in r.exit_reason
    with pytest.raises(GuestdError) as ei:
        c.code_run("echo 1", context=ctx.id)
    assert ei.value.code == "unavailable"
    pid = c.code_restart(ctx.id)
    assert pid != ctx.pid
    r = c.code_run("echo ${X:-fresh}", context=ctx.id, timeout_s=30)
    assert r.status == "ok" and r.stdout == b"fresh\n"
    assert _wait_gone([ctx.pid, *kids]) == []  # the dead kernel's bash went with its run
    kids = _descendants(pid)
    c.code_close(ctx.id)
    assert _wait_gone([pid, *kids]) == []


@needs_bash
def test_guestctl_code_create_with_a_kernel(kg: Guestd) -> None:
    r = kg.guestctl("--json", "code", "create", "--kernel", "bash", "--name", "cli-bash")
    assert r.returncode == 0, r.stderr
    made = json.loads(r.stdout)
    assert made["kernel"] == "bash"
    r = kg.guestctl("code", "run", "--context", "cli-bash", "echo from-bash")
    assert r.returncode == 0 and r.stdout == b"from-bash\n"
    assert b"bash" in kg.guestctl("code", "ls").stdout
    r = kg.guestctl("--json", "code", "new", "--kernel", "no-such-kernel")
    assert r.returncode == 1
    err = json.loads(r.stdout)["error"]
    assert err["code"] == "not_found" and "bash" in err["details"]["installed"]
    assert kg.guestctl("code", "rm", "cli-bash").returncode == 0


@needs_bash
@pytest.mark.skipif(os.geteuid() != 0, reason="reading as another user needs root")
def test_a_foreign_kernels_key_file_is_private_and_gone_once_it_is_ready(tmp_path: object) -> None:
    """A kernelspec reads its key from a file: while the kernel starts it is 0600, owned by the
    kernel's user, in a 0700 directory, and another user cannot read it; once the kernel answers
    it is removed. (The workload, as the kernel's user, could read it: SECURITY.md.)"""
    d = str(tmp_path)
    g = start_guestd(d, "--runtime-dir", f"{d}/rt", "--code-pool", "0")
    seen: dict[str, tuple[int, int, int]] = {}  # path -> (file mode, owner uid, directory mode)
    outsider: list[str] = []  # what another user got when it tried to read one: denied, gone or read
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            for top, _, names in os.walk(f"{d}/rt"):
                for n in names:
                    path = os.path.join(top, n)
                    try:
                        with open(path, "rb") as f:
                            if b'"key"' not in f.read(65536):
                                continue
                        st, dst = os.stat(path), os.stat(top)
                    except OSError:
                        continue
                    if path not in seen:
                        seen[path] = (st.st_mode & 0o777, st.st_uid, dst.st_mode & 0o777)
                        other = subprocess.run(
                            ["cat", path], user=54321, group=54321, capture_output=True, timeout=10, check=False
                        )
                        if other.returncode == 0:
                            outsider.append("read")
                        else:
                            outsider.append("gone" if b"No such file" in other.stderr else "denied")

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with g.client() as c:
            for _ in range(3):  # each start is a new chance for the watcher
                ctx = c.code_create(kernel="bash")
                assert c.code_run("echo up", context=ctx.id).stdout == b"up\n"
                left = [
                    os.path.join(top, n) for top, _, names in os.walk(f"{d}/rt") for n in names if n.endswith(".json")
                ]
                assert left == [], f"connection files left once the kernel was ready: {left}"
                c.code_close(ctx.id)
    finally:
        done.set()
        watcher.join(10)
        g.stop()
    assert seen, "the watcher never saw a connection file (it exists while a kernelspec's kernel starts)"
    for path, (mode, uid, dmode) in seen.items():
        assert (mode, uid, dmode) == (0o600, os.geteuid(), 0o700), path
    assert "read" not in outsider and "denied" in outsider, outsider


def test_the_launcher_drops_guestds_private_env_for_a_foreign_command(tmp_path: object) -> None:
    """guestd.code.kernel --exec: guestd's private variables do not reach a command that is not
    guestd's Python; the kernelspec's and the context's env (GUESTD_KERNEL_ENV) do."""
    out = f"{tmp_path}/env"
    env = {
        **os.environ,
        "PYTHONPATH": REPO,
        "SECRET_OF_GUESTD": "x",
        "GUESTD_KERNEL_DROP_ENV": "SECRET_OF_GUESTD",
        "GUESTD_KERNEL_ENV": json.dumps({"FROM_SPEC": "1"}),
    }
    cmd = f"env > {out}"
    r = subprocess.run(
        [sys.executable, "-m", "guestd.code.kernel", "--exec", "/bin/sh", "-c", cmd], env=env, timeout=30, check=False
    )
    assert r.returncode == 0
    with open(out) as f:
        lines = set(f.read().splitlines())
    assert "FROM_SPEC=1" in lines and not any(x.startswith("SECRET_OF_GUESTD=") for x in lines)
    assert not any(x.startswith("GUESTD_KERNEL_") for x in lines)
