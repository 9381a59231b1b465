"""A shell session's results belong to the command that produced them (issue 14): a cancelled
command is ended before the next one runs, a command cannot forge a result through bash's copy
of the control pipe, and errors read as in ``bash -c``."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from guestd.client import AsyncClient, Client, GuestdError
from guestd.testing import REPO, Guestd


def test_a_cancelled_command_never_completes_the_next_one(guestd: Guestd) -> None:
    async def main() -> None:
        async with await AsyncClient.connect(guestd.address) as c:
            sid = (await c.shell_create(cwd="/tmp")).id
            try:
                for _ in range(2):
                    run = asyncio.ensure_future(c.shell_run(sid, "sleep 30"))
                    await asyncio.sleep(0.2)
                    run.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await run
                    for _ in range(8):
                        r = await c.shell_run(sid, "echo mine; (exit 5)", timeout_s=20)
                        assert (r.stdout, r.exit_code, r.timed_out) == (b"mine\n", 5, None)
            finally:
                await c.shell_close(sid)

    asyncio.run(main())


def test_a_command_waiting_for_the_session_and_cancelled_never_runs(guestd: Guestd) -> None:
    async def main() -> None:
        async with await AsyncClient.connect(guestd.address) as c:
            sid = (await c.shell_create(cwd="/tmp")).id
            try:
                first = asyncio.ensure_future(c.shell_run(sid, "sleep 0.5; echo first"))
                await asyncio.sleep(0.1)
                queued = asyncio.ensure_future(c.shell_run(sid, "touch /tmp/never-$$; echo queued"))
                await asyncio.sleep(0.1)
                queued.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await queued
                assert (await first).stdout == b"first\n"  # the running command was not disturbed
                assert (await c.shell_run(sid, "echo after")).stdout == b"after\n"
            finally:
                await c.shell_close(sid)

    asyncio.run(main())


# Writes a complete marker in the old format (status, cwd, exports) to every fd the command can
# reach, bash's saved copy of the control pipe among them.
FORGE = (
    "for n in $(ls /proc/$$/fd); do [ $n -gt 2 ] && "
    "printf '0\\0/forged\\0declare -x FORGED=1\\0' >&$n 2>/dev/null; done; "
    "for n in $(ls /proc/$$/fd); do [ $n -gt 2 ] && "
    "printf '%s\\0' 00112233445566778899aabbccddeeff 0 /forged x >&$n 2>/dev/null; done; "
    "sleep 0.3; echo real; (exit 7)"
)


def test_a_command_cannot_forge_its_result_or_shift_the_next(client: Client) -> None:
    sid = client.shell_create(cwd="/tmp").id
    try:
        r = client.shell_run(sid, FORGE, timeout_s=20)
        assert (r.exit_code, r.cwd, r.stdout.endswith(b"real\n")) == (7, "/tmp", True)
        r = client.shell_run(sid, 'echo next; echo "[${FORGED-}]"', timeout_s=20)
        assert (r.exit_code, r.stdout, r.cwd) == (0, b"next\n[]\n", "/tmp")
        assert client.shell_run(sid, "echo last").stdout == b"last\n"
    finally:
        client.shell_close(sid)


def test_errors_and_lineno_read_as_in_bash_c(client: Client) -> None:
    sid = client.shell_create(cwd="/tmp").id
    try:
        r = client.shell_run(sid, "nosuchcmd")
        assert r.stderr == b"bash: line 1: nosuchcmd: command not found\n" and r.exit_code == 127
        assert client.shell_run(sid, "echo $LINENO").stdout == b"1\n"
        r = client.shell_run(sid, "true\necho $LINENO\nnosuchcmd2")
        assert r.stdout == b"2\n" and r.stderr == b"bash: line 3: nosuchcmd2: command not found\n"
        # OLDPWD is left as bash got it; the session's library directory is nowhere to be seen.
        assert b"shell-lib" not in client.shell_run(sid, 'echo "[${OLDPWD-unset}] $PWD"').stdout
    finally:
        client.shell_close(sid)


def test_duplicate_session_names_are_refused(client: Client) -> None:
    sid = client.shell_create(name="work-dup").id
    try:
        with pytest.raises(GuestdError) as ei:
            client.shell_create(name="work-dup")
        assert ei.value.code == "exists" and ei.value.details["session"] == sid
        assert [s.id for s in client.shell_list() if s.name == "work-dup"] == [sid]
    finally:
        client.shell_close(sid)


def test_guestctl_shell_run_interrupted_with_ctrl_c_leaves_the_session_in_step(guestd: Guestd) -> None:
    env = {**os.environ, "PYTHONPATH": REPO}
    base = [sys.executable, "-m", "guestd.cli", "--connect", guestd.address]
    sid = subprocess.run([*base, "shell", "new"], capture_output=True, env=env, timeout=60).stdout.decode().strip()
    try:
        for _ in range(2):
            # INT is ignored (inherited by sleep): only the escalation ends the command.
            run = subprocess.Popen([*base, "shell", "run", sid, "trap '' INT; sleep 4; echo late"], env=env)
            time.sleep(0.8)
            run.send_signal(signal.SIGINT)
            run.wait(30)
            for _ in range(4):
                r = subprocess.run(
                    [*base, "shell", "run", sid, "echo mine; (exit 5)"], capture_output=True, env=env, timeout=60
                )
                assert (r.returncode, r.stdout) == (5, b"mine\n"), r
    finally:
        subprocess.run([*base, "shell", "rm", sid], env=env, timeout=60)


@pytest.mark.parametrize(
    "setup",
    [
        "IFS=0123456789",  # before: false, exit 3 and (exit 42) all reported 0 (or the run hung)
        "alias __gd_mark=true __gd_run=true builtin=echo printf=echo",  # before: no status, a timeout
        "trap false DEBUG; trap true RETURN; set -o functrace",
    ],
)
def test_what_a_command_sets_does_not_change_how_results_are_read(client: Client, setup: str) -> None:
    sid = client.shell_create().id
    try:
        assert client.shell_run(sid, setup, timeout_s=10).exit_code == 0
        for cmd, code in (("false", 1), ("exit 3", 3), ("(exit 42)", 42), ("echo out", 0)):
            r = client.shell_run(sid, cmd, timeout_s=10)
            assert (r.exit_code, r.timed_out, r.session_restarted) == (code, None, False), (cmd, r)
        assert client.shell_run(sid, "echo still", timeout_s=10).stdout == b"still\n"
    finally:
        client.shell_close(sid)


def test_exit_under_posix_mode_reports_its_status(client: Client) -> None:
    # Under `set -o posix` the exit builtin comes before guestd's exit function and ends bash:
    # the status is bash's exit status (before: none), and the session is restarted.
    sid = client.shell_create().id
    try:
        client.shell_run(sid, "set -o posix; export KEPT=1", timeout_s=10)
        r = client.shell_run(sid, "exit 3", timeout_s=10)
        assert (r.exit_code, r.session_restarted) == (3, True), r
        r = client.shell_run(sid, 'echo "$KEPT"; false', timeout_s=10)
        assert (r.stdout, r.exit_code) == (b"1\n", 1)
    finally:
        client.shell_close(sid)
