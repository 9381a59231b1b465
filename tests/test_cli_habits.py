"""guestctl as people used to docker/kubectl/ssh use it (issue 31 items 3, 5, 6 and 7, outside
the file commands): exit codes 2/124/126/127/130, errors that say what happened, tracebacks
coloured on a terminal and plain in a pipe, no asyncio noise when a follow ends, and the short
flags and defaults people type. Against a real guestd; terminals are real ptys."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from guestd.cli import DEFAULT_CONNECT
from guestd.testing import REPO, Guestd, scratch_guestd
from tests.terminal import LocalTerminal

WAIT_S = 60.0
NOISE = (b"never retrieved", b"Traceback", b"Task was destroyed", b"Exception ignored")


@pytest.fixture(scope="module")
def g() -> Iterator[Guestd]:
    with scratch_guestd("guestd-cli-habits-", "--code-pool", "0") as guestd:
        yield guestd


def popen(g: Guestd, *argv: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        g.guestctl_argv(*argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": REPO}
    )


def first_output(proc: subprocess.Popen[bytes]) -> bytes:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], WAIT_S)
    assert ready, "guestctl printed nothing in time"
    return os.read(proc.stdout.fileno(), 65536)


def interrupted(proc: subprocess.Popen[bytes]) -> tuple[int, bytes]:
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=WAIT_S)
    return proc.returncode, err


def test_code_run_traceback_is_coloured_on_a_terminal_and_plain_in_a_pipe(g: Guestd) -> None:
    """Was: literal \\x1b[31m escapes in both."""
    r = g.guestctl("code", "run", "1/0")
    assert r.returncode == 1 and b"ZeroDivisionError" in r.stderr
    assert b"\x1b" not in r.stderr and b"\\x1b" not in r.stderr, r.stderr
    term = LocalTerminal(g.guestctl_argv("code", "run", "1/0"), rows=24, cols=100)
    try:
        term.wait_for(rb"division by zero")
        assert term.exit_code() == 1
        assert re.search(rb"\x1b\[[0-9;]*m", term.shown) and b"\\x1b" not in term.shown, bytes(term.shown)
    finally:
        term.close()


def test_a_program_not_found_exits_127_and_one_not_executable_126(g: Guestd, tmp_path: Path) -> None:
    """Was: 1 for both (as any guest error), as docker exec and shells do not."""
    r = g.guestctl("exec", "--", "/no/such/program")
    assert r.returncode == 127 and b"/no/such/program" in r.stderr, r
    data = tmp_path / "data.txt"
    data.write_text("not a program\n")
    r = g.guestctl("exec", "--", str(data))
    assert r.returncode == 126 and b"ermission denied" in r.stderr, r
    assert g.guestctl("exec", "--detach", "--", "/no/such/program").returncode == 127
    assert g.guestctl("sh", "no-such-program-here").returncode == 127
    s = g.guestctl("shell", "new").stdout.decode().strip()
    assert g.guestctl("shell", "run", s, "no-such-program-here").returncode == 127
    assert g.guestctl("shell", "run", s, str(data)).returncode == 126
    r = g.guestctl("exec", "--cwd", "/no/such/dir", "--", "true")
    assert r.returncode == 1 and b"working directory (--cwd)" in r.stderr and b"/no/such/dir" in r.stderr, r


def test_usage_errors_exit_2_timeouts_124_interrupts_130(g: Guestd) -> None:
    """Usage errors found after parsing exited 1 (SystemExit with a message)."""
    for argv in (
        ["exec"],
        ["exec", "--env", "=v", "--", "true"],
        ["shell", "run", "a", "b", "c"],
        ["port-forward", "not-a-port"],
        ["snapshot", "restore", "--entropy-hex", "zz"],
        ["no-such-command"],
    ):
        r = g.guestctl(*argv)
        assert r.returncode == 2 and (r.stderr.startswith(b"guestctl") or b"usage:" in r.stderr), (argv, r)
    assert g.guestctl("sh", "--timeout", "0.2", "sleep 30").returncode == 124
    proc = popen(g, "sh", "echo started; sleep 30")
    assert first_output(proc) == b"started\n"
    code, err = interrupted(proc)
    assert code == 130 and not any(n in err for n in NOISE), err


def test_connect_failure_names_the_address_and_the_default_is_the_readmes(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "guestd.cli", "--connect", f"unix:{tmp_path}/none.sock", "ping"],
        capture_output=True,
        timeout=WAIT_S,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    assert r.returncode == 1 and f"unix:{tmp_path}/none.sock".encode() in r.stderr, r
    assert b"GUESTD_CONNECT" in r.stderr and b"--connect" in r.stderr
    env = {k: v for k, v in os.environ.items() if k != "GUESTD_CONNECT"}
    r = subprocess.run(
        [sys.executable, "-m", "guestd.cli", "--help"],
        capture_output=True,
        timeout=WAIT_S,
        env={**env, "PYTHONPATH": REPO},
    )
    assert DEFAULT_CONNECT.encode() in r.stdout.replace(b"\n", b" ").replace(b"  ", b""), r.stdout
    assert f"GUESTD_CONNECT={DEFAULT_CONNECT}" in Path(REPO, "README.md").read_text()  # was /run/guestd/guestd.sock


def test_timeouts_say_what_did_not_happen(g: Guestd) -> None:
    """Was: exit 124 and nothing said."""
    sleeper = g.guestctl("exec", "-d", "--", "sleep", "30").stdout.decode().strip()
    r = g.guestctl("wait", "--timeout", "0.1", sleeper)
    assert r.returncode == 124 and b"did not exit within 0.1 s; it is still running" in r.stderr, r
    g.guestctl("kill", sleeper, "KILL")
    r = g.guestctl("port-wait", "1", "--timeout", "0.2")
    assert r.returncode == 124 and b"guest port 1 did not accept a connection within" in r.stderr, r


def test_following_commands_end_without_asyncio_noise(g: Guestd) -> None:
    """metrics --watch, attach and top stopped by ^C (or q) print nothing but their output."""
    proc = popen(g, "metrics", "--watch", "0.1")
    first_output(proc)
    code, err = interrupted(proc)
    assert code in (0, 130) and not any(n in err for n in NOISE), err
    talker = g.guestctl("exec", "-d", "--", "sh", "-c", "echo up; sleep 30").stdout.decode().strip()
    proc = popen(g, "attach", talker)
    assert first_output(proc) == b"up\n"
    code, err = interrupted(proc)
    assert code in (0, 130) and not any(n in err for n in NOISE), err
    g.guestctl("kill", talker, "KILL")
    proc = popen(g, "top", "--interval", "0.1")  # not a terminal: frames of text
    first_output(proc)
    code, err = interrupted(proc)
    assert code in (0, 130) and not any(n in err for n in NOISE), err
    term = LocalTerminal(g.guestctl_argv("top", "--interval", "0.1"), rows=30, cols=120)
    try:
        term.wait_for(rb"COMMAND")
        term.type(b"q")
        assert term.exit_code() == 0
        assert not any(n in term.shown for n in NOISE), bytes(term.shown)
    finally:
        term.close()


def test_snapshot_quiesce_says_so_and_restore_lives_under_snapshot(g: Guestd) -> None:
    r = g.guestctl("snapshot", "prepare", "--quiesce")
    assert r.returncode == 0 and b"quiesced" in r.stderr and b"guestctl snapshot resume" in r.stderr, r
    assert json.loads(r.stdout)["quiesced"] is True  # was: a TypeError (the reply is a dataclass)
    r = g.guestctl("snapshot", "resume")
    assert r.returncode == 0 and b"accepts work again" in r.stderr, r
    assert g.guestctl("snapshot", "restore").returncode == 0
    assert g.guestctl("restore").returncode == 0  # the old name still works...
    top_help = g.guestctl("--help").stdout
    assert not re.search(rb"[{,]restore\b|^ +restore ", top_help, re.M), top_help  # ...but is not listed
    assert b"restore" in g.guestctl("snapshot", "--help").stdout


def test_short_flags_version_and_ssh_like_sh(g: Guestd, tmp_path: Path) -> None:
    r = g.guestctl("--version")
    assert r.returncode == 0 and r.stdout.startswith(b"guestctl 0.") and b"protocol v1" in r.stdout
    env = {**os.environ, "PYTHONPATH": REPO, "PASSED_ON": "from here"}
    r = subprocess.run(
        g.guestctl_argv("exec", "-e", "PASSED_ON", "-e", "SET=v", "-e", "NOT_SET_HERE_31", "-w", str(tmp_path), "--",
                        "sh", "-c", 'echo "$PASSED_ON|$SET|${NOT_SET_HERE_31-unset}|$PWD"'),
        capture_output=True, env=env, timeout=WAIT_S,
    )  # fmt: skip
    assert r.stdout == f"from here|v|unset|{tmp_path}\n".encode(), r
    r = g.guestctl("exec", "-t", "--", "sh", "-c", "test -t 0 && echo tty")
    assert r.returncode == 0 and b"tty" in r.stdout
    r = g.guestctl("sh", "echo", "a", "b;", "echo", "c")  # joined with spaces, as ssh does
    assert r.stdout == b"a b\nc\n", r


def test_shell_create_alias_and_a_default_session(g: Guestd) -> None:
    named = g.guestctl("shell", "create", "--name", "mine").stdout.decode().strip()
    assert named.startswith("s")
    assert g.guestctl("shell", "run", "cd /tmp; export KEPT=1").returncode == 0
    r = g.guestctl("shell", "run", "echo $PWD $KEPT")
    assert r.stdout == b"/tmp 1\n", r  # the same session, made on first use
    sessions = json.loads(g.guestctl("--json", "shell", "ls").stdout)["sessions"]
    assert sorted(s["name"] for s in sessions if s["name"]) == ["default", "mine"]


def test_ps_has_headers_and_rm_and_prune(g: Guestd) -> None:
    one = g.guestctl("exec", "-d", "--", "true").stdout.decode().strip()
    two = g.guestctl("exec", "-d", "--", "true").stdout.decode().strip()
    running = g.guestctl("exec", "-d", "--", "sleep", "30").stdout.decode().strip()
    g.guestctl("wait", one)
    g.guestctl("wait", two)
    r = g.guestctl("ps")
    assert r.stdout.splitlines()[0].split() == [b"ID", b"PID", b"STATUS", b"OUTPUT", b"COMMAND"], r.stdout
    assert g.guestctl("ps", "rm", one).returncode == 0
    ids = [p["id"] for p in json.loads(g.guestctl("--json", "ps").stdout)["processes"]]
    assert one not in ids and two in ids
    r = g.guestctl("ps", "prune")
    assert two.encode() in r.stdout and running.encode() not in r.stdout
    ids = [p["id"] for p in json.loads(g.guestctl("--json", "ps").stdout)["processes"]]
    assert two not in ids and running in ids
    g.guestctl("kill", running, "KILL")


def test_head_tail_output_marks_the_gap_in_band(g: Guestd) -> None:
    r = g.guestctl("exec", "--head-tail", "--max-output", "20", "--", "seq", "1", "100")
    assert r.stdout == b"1\n2\n3\n4\n5\n[... 272 bytes dropped ...]\n98\n99\n100\n", r
    r = g.guestctl("sh", "--max-output", "6", "seq 1 100")
    assert r.stdout == b"[... 286 bytes dropped ...]\n9\n100\n", r


def test_a_reader_that_goes_away_ends_any_command_quietly(g: Guestd) -> None:
    """``guestctl metrics --watch | head -1``: exit 141 as SIGPIPE would, nothing on stderr
    (was: a BrokenPipeError traceback, for every command printing through print/print_json)."""
    for argv in (["metrics", "--watch", "0.1"], ["metrics", "--watch", "0.1", "--json"]):
        proc = popen(g, *argv)
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.readline()
        proc.stdout.close()
        assert proc.wait(WAIT_S) == 141
        err = proc.stderr.read()
        proc.stderr.close()
        assert not any(n in err for n in NOISE), err
