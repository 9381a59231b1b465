"""Persistent bash sessions against a real guestd with real bash."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from guestd.client import AsyncClient, Client, GuestdError
from guestd.testing import Guestd, StartGuestd, live_procs_with, unique_sleep


@pytest.fixture
def sh(client: Client, tmp_path: object) -> Iterator[tuple[Client, str]]:
    s = client.shell_create(cwd=str(tmp_path))
    yield client, s.id
    client.shell_close(s.id)


def test_state_persists_between_commands(sh: tuple[Client, str], tmp_path: object) -> None:
    c, sid = sh
    r = c.shell_run(sid, "mkdir -p sub && cd sub && X=1 && export Y=2 && f() { echo fn-$1; } && alias hi='echo hi'")
    assert r.exit_code == 0 and r.cwd == f"{tmp_path}/sub"
    r = c.shell_run(sid, 'pwd; echo "$X $Y"; f a; hi; sh -c \'echo "child sees Y=$Y X=$X"\'')
    assert r.stdout == f"{tmp_path}/sub\n1 2\nfn-a\nhi\nchild sees Y=2 X=\n".encode()


def test_virtualenv_activation_persists(sh: tuple[Client, str], tmp_path: object) -> None:
    c, sid = sh
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", f"{tmp_path}/.venv"], check=True)
    assert c.shell_run(sid, "source .venv/bin/activate").exit_code == 0
    r = c.shell_run(sid, 'echo "$VIRTUAL_ENV"; command -v python')
    assert r.stdout == f"{tmp_path}/.venv\n{tmp_path}/.venv/bin/python\n".encode()


def test_output_is_exact_and_never_leaks(sh: tuple[Client, str]) -> None:
    c, sid = sh
    r = c.shell_run(sid, "printf 'no newline at end'; printf 'err' >&2")
    assert (r.stdout, r.stderr) == (b"no newline at end", b"err")
    big = c.shell_run(sid, "seq 1 200000", max_output=1_000_000)
    assert big.stdout == "".join(f"{i}\n" for i in range(1, 200001)).encode()[-1_000_000:]
    assert big.stdout_bytes == len("".join(f"{i}\n" for i in range(1, 200001)))
    assert c.shell_run(sid, "true").stdout == b""  # nothing of the previous command
    r = c.shell_run(sid, "seq 1 100000", max_output=100)
    assert r.stdout_dropped == r.stdout_bytes - 100 and r.stdout.endswith(b"100000\n")


def test_multiline_heredoc_exit_set_e_and_ps1(sh: tuple[Client, str]) -> None:
    c, sid = sh
    r = c.shell_run(
        sid, "cat <<'EOF'\nline 1\n  $NOT_EXPANDED 'quotes' \"dq\" \\\\ back\nEOF\nfor i in 1 2; do\n  echo $i\ndone"
    )
    assert r.stdout == b"line 1\n  $NOT_EXPANDED 'quotes' \"dq\" \\\\ back\n1\n2\n"
    assert c.shell_run(sid, "exit 3").exit_code == 3
    assert c.shell_run(sid, "echo still here").stdout == b"still here\n"
    r = c.shell_run(sid, "set -e; false; echo after")
    assert not r.session_restarted
    assert c.shell_run(sid, "PS1='weird> '; PROMPT_COMMAND='echo junk'; echo ok").stdout == b"ok\n"
    assert c.shell_run(sid, "echo again").stdout == b"again\n"
    r = c.shell_run(sid, "false")
    assert r.exit_code == 1


def test_stdin_is_dev_null_unless_given(sh: tuple[Client, str]) -> None:
    c, sid = sh
    r = c.shell_run(sid, 'read x; echo "got=[$x] rc=$?"', timeout_s=10)
    assert r.stdout == b"got=[] rc=1\n" and r.timed_out is None  # EOF at once, no wait
    r = c.shell_run(sid, 'read x; echo "got=[$x]"; cat', input=b"first\nrest\n")
    assert r.stdout == b"got=[first]\nrest\n"


def test_background_job_does_not_block_or_leak(sh: tuple[Client, str]) -> None:
    c, sid = sh
    r = c.shell_run(sid, "(sleep 0.3; echo late) & echo now", timeout_s=10)
    assert r.stdout == b"now\n" and r.duration_s < 5
    time.sleep(0.6)
    assert c.shell_run(sid, "echo next").stdout == b"next\n"


def test_timeout_interrupts_and_session_stays_usable(sh: tuple[Client, str], tmp_path: object) -> None:
    c, sid = sh
    c.shell_run(sid, "KEEP=yes")
    marker = unique_sleep()
    r = c.shell_run(sid, f"echo started; {marker}", timeout_s=0.5)
    assert r.timed_out == "wall" and r.interrupted and not r.session_restarted
    assert r.stdout == b"started\n" and r.exit_code == 130
    assert live_procs_with(marker) == []
    assert c.shell_run(sid, "echo $KEEP").stdout == b"yes\n"
    r = c.shell_run(sid, f"trap '' INT; {marker}", timeout_s=0.5)  # ignores SIGINT: escalation
    assert r.timed_out == "wall" and not r.session_restarted
    assert c.shell_run(sid, "echo $KEEP").stdout == b"yes\n"
    r = c.shell_run(sid, "echo quiet-soon; sleep 30", idle_timeout_s=0.4)
    assert r.timed_out == "idle" and r.stdout == b"quiet-soon\n"


def test_unrecoverable_command_restarts_with_cwd_and_exports(sh: tuple[Client, str], tmp_path: object) -> None:
    c, sid = sh
    c.shell_run(sid, "mkdir -p d && cd d && export KEPT=1 && LOCAL=1")
    r = c.shell_run(sid, "while true; do :; done", timeout_s=0.3)  # bash's own loop: the INT trap ends it
    assert r.exit_code == 130 and not r.session_restarted
    r = c.shell_run(sid, "trap '' INT; while true; do :; done", timeout_s=0.3)  # nothing can interrupt this
    assert r.session_restarted and r.timed_out == "wall" and r.exit_code is None
    r = c.shell_run(sid, 'pwd; echo "[$KEPT] [$LOCAL]"')
    assert r.stdout == f"{tmp_path}/d\n[1] []\n".encode()
    r = c.shell_run(sid, "builtin exit 4")
    assert r.session_restarted
    assert c.shell_run(sid, "echo $KEPT").stdout == b"1\n"
    listed = {s.id: s for s in c.shell_list()}
    assert listed[sid].restarts == 2


def test_sessions_are_independent_and_bounded(fresh_guestd: StartGuestd) -> None:
    g = fresh_guestd()
    with g.client() as c:
        a = c.shell_create().id
        b = c.shell_create().id
        c.shell_run(a, "V=a; cd /")
        c.shell_run(b, "V=b; cd /tmp")
        assert c.shell_run(a, "echo $V; pwd").stdout == b"a\n/\n"
        assert c.shell_run(b, "echo $V; pwd").stdout == b"b\n/tmp\n"
        with pytest.raises(GuestdError) as ei:
            c.shell_create(cwd="/nonexistent")
        assert ei.value.code == "not_found"
        with pytest.raises(GuestdError) as ei:
            c.shell_run("nope", "true")
        assert ei.value.code == "not_found"
        with pytest.raises(GuestdError) as ei:
            for _ in range(20):
                c.shell_create()
        assert ei.value.code == "limit" and ei.value.details["limit"] == "max_shells"


def test_commands_in_one_session_are_serialized(guestd: Guestd) -> None:
    async def go() -> None:
        c = await AsyncClient.connect(guestd.address)
        sid = (await c.shell_create()).id
        await c.shell_run(sid, "N=0")
        rs = await asyncio.gather(*(c.shell_run(sid, "N=$((N+1)); echo $N") for _ in range(10)))
        assert sorted(r.stdout for r in rs) == sorted(f"{i}\n".encode() for i in range(1, 11))
        await c.shell_close(sid)
        await c.close()

    asyncio.run(go())


def test_closing_a_session_ends_its_processes(client: Client) -> None:
    sid = client.shell_create().id
    marker = "sleep 995.75"
    client.shell_run(sid, f"{marker} &")
    deadline = time.monotonic() + 5
    while not live_procs_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)  # the job's fork may not have exec'd sleep yet when the command returns
    assert len(live_procs_with(marker)) == 1
    client.shell_close(sid)
    deadline = time.monotonic() + 5
    while live_procs_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live_procs_with(marker) == []
    assert os.path.exists("/bin/bash")


def test_cd_into_a_directory_whose_name_is_not_utf8(sh: tuple[Client, str], tmp_path: object) -> None:
    c, sid = sh
    home = os.fsencode(str(tmp_path))
    bad = home + b"/bad\xff"
    os.mkdir(bad)
    # The defect: the result carrying this cwd could not be encoded; no answer ever came.
    r = c.shell_run(sid, "cd $'bad\\xff' && echo in", deadline=10)
    assert (r.exit_code, r.stdout, r.cwd) == (0, b"in\n", bad)
    [listed] = [s for s in c.shell_list(deadline=10) if s.id == sid]
    assert listed.cwd == bad
    r = c.shell_run(sid, "pwd; cd ..", deadline=10)
    assert (r.stdout, r.cwd) == (bad + b"\n", str(tmp_path))  # still works, and str again
    started_there = c.shell_create(cwd=bad, deadline=10).id
    try:
        r = c.shell_run(started_there, "pwd", deadline=10)
        assert (r.stdout, r.cwd) == (bad + b"\n", bad)
    finally:
        c.shell_close(started_there)
