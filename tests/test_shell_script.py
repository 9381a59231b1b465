"""The bash text guestd writes into a session's shell (guestd/shells/script.py), as plain
functions: no guestd, no daemon. What they build runs through a real bash (a subprocess
sourcing the real library, with a file as its status channel), so the quoting is checked
where it matters: the command reaches ``eval`` byte for byte, hostile text runs as
``bash -c`` runs it and never bends the lines around it, and the marker parser believes only
the marker with the command's nonce."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from guestd.shells.script import (
    CTL_FD,
    LIBRARY,
    MAX_CTL_BYTES,
    Marker,
    ansi_c_quote,
    check_command,
    command_script,
    pty_command,
    run_line,
    start_script,
    stdin_source,
    take_marker,
)
from guestd.wire.errors import GuestdError

BASH = shutil.which("bash") or "/bin/bash"
ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C"}
ALL_BYTES = bytes(range(1, 256)).decode("utf-8", "surrogateescape")  # NUL aside: bash cannot hold it

# Text a workload (or a client passing one on) may send as a command.
HOSTILE = [
    "it's \"quoted\" 'twice' \\ back\\\\slash",
    "a'\"'\"'b",  # the usual shell way to end a single-quoted string
    "$(touch pwned) `touch pwned` ${IFS} $((1+1)) !! !$",
    "line1\nline2\r\nline3\n\n",
    "'; \\__gd_mark 0 'deadbeef'; '",  # guestd's own line, as text
    "\nfi\nif true; then \\__gd_mark 0 '00'; fi\n__gd_cmd=x\n",
    "cat <<'EOF'\n$HOME `id`\nEOF\n",  # heredoc-looking text
    "cat <<EOF\nnever ended",
    "trailing backslash \\",
    "\x1b[31mred\x1b[0m \x7f \x01\x02",  # control bytes
    "caf\u00e9 \U0001f600 \udcff\udcfe",  # UTF-8, and bytes that are not (surrogateescape)
    ALL_BYTES,
    "x" * 300_000 + "'" * 1000 + "\\" * 1000,  # long, and the worst case for escaping
]


@dataclass
class Ran:
    stdout: bytes
    stderr: bytes
    markers: list[Marker | None]  # [the start script's, then one per command]
    discarded: int  # status-channel bytes take_marker did not believe
    nonces: list[str]


def run_session(tmp_path: Path, commands: list[str], exports: str = "", **options: Any) -> Ran:
    """bash as guestd starts a session (``bash -s``, the status channel on fd 63; a file here),
    fed the start script and one command script per command (``options``: command_script's)."""
    lib = tmp_path / "lib it's $(x) dir"
    lib.mkdir(exist_ok=True)
    (lib / "bash").write_text(LIBRARY)
    ctl = tmp_path / "ctl"
    ctl.write_bytes(b"")
    nonces = [os.urandom(16).hex() for _ in range(len(commands) + 1)]
    text = start_script(str(lib), nonces[0], exports)
    text += "".join(command_script(c, n, **options) for c, n in zip(commands, nonces[1:], strict=True))
    wrapper = f"exec {CTL_FD}>>{ansi_c_quote(str(ctl))}; exec {BASH} --noprofile --norc -s"
    done = subprocess.run(
        [BASH, "--noprofile", "--norc", "-c", wrapper],
        input=text.encode("utf-8", "surrogateescape"),
        capture_output=True,
        cwd=tmp_path,
        env=ENV,
        timeout=60,
    )
    buf = bytearray(ctl.read_bytes())
    markers: list[Marker | None] = []
    discarded = 0
    for nonce in nonces:
        dropped, marker = take_marker(buf, nonce.encode())
        discarded += dropped
        markers.append(marker)
    return Ran(done.stdout, done.stderr, markers, discarded + len(buf), nonces)


def bash_c(tmp_path: Path, command: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [BASH, "--noprofile", "--norc", "-c", command.encode("utf-8", "surrogateescape")],
        capture_output=True,
        cwd=tmp_path,
        env=ENV,
        timeout=60,
    )


# -- quoting -------------------------------------------------------------------------------
@pytest.mark.parametrize("locale", ["C", "C.UTF-8"])
def test_ansi_c_quote_round_trips_every_byte_through_bash(tmp_path: Path, locale: str) -> None:
    texts = [*HOSTILE, "", "'", "\\", "\\x41", "\\'"]
    script = "".join(f"builtin printf '%s\\0' {ansi_c_quote(t)}\n" for t in texts)
    done = subprocess.run(
        [BASH, "--noprofile", "--norc", "-s"], input=script.encode(), capture_output=True, env={**ENV, "LC_ALL": locale}
    )
    assert done.returncode == 0 and done.stderr == b""
    assert done.stdout.split(b"\0")[:-1] == [t.encode("utf-8", "surrogateescape") for t in texts]


def test_quoted_text_is_one_printable_line() -> None:
    """Whatever the text, its quoted form is printable ASCII on one line: nothing in it can end
    the line guestd writes it on."""
    for text in HOSTILE:
        quoted = ansi_c_quote(text)
        assert quoted.startswith("$'") and quoted.endswith("'")
        assert all(0x20 <= ord(c) < 0x7F for c in quoted), text[:40]


def test_a_nul_byte_is_refused_not_cut(tmp_path: Path) -> None:
    """bash ends a string at a NUL: the text before it would run as the whole command."""
    quoted = ansi_c_quote("echo a\0; rm -rf x")
    cut = subprocess.run([BASH, "--noprofile", "--norc", "-c", f"builtin printf %s {quoted}"], capture_output=True)
    assert cut.stdout == b"echo a"  # why: the quoting cannot carry it
    for command in ("echo a\0; rm -rf x", "\0", "x" * 10 + "\0"):
        with pytest.raises(GuestdError) as ei:
            check_command(command)
        assert ei.value.code == "bad_request" and ei.value.details == {"field": "command"}
        with pytest.raises(ValueError):
            command_script(command, "00")
    check_command(ALL_BYTES)


def test_a_nonce_is_hex_or_nothing_is_built() -> None:
    for bad in ("", "x'; rm -rf ~; '", "00ff\n", "ABCD"):
        with pytest.raises(ValueError):
            command_script("true", bad)
        with pytest.raises(ValueError):
            start_script("/lib", bad)


def test_stdin_and_job_paths_are_quoted() -> None:
    assert stdin_source(None) == "/dev/null"
    assert stdin_source("/r/in it's") == ansi_c_quote("/r/in it's")
    paths = {"stdout": "/r/o 'x'", "stderr": "/r/$(e)", "status": "/r/`s`"}
    line = run_line("/dev/null", False, paths)
    assert all(ansi_c_quote(p) in line for p in paths.values())
    merged = run_line("/dev/null", True, paths)
    assert merged.count(ansi_c_quote(paths["stdout"])) == 2 and ansi_c_quote(paths["stderr"]) not in merged


# -- the command in a real session bash ----------------------------------------------------
@pytest.mark.parametrize("payload", HOSTILE, ids=range(len(HOSTILE)))
def test_the_command_reaches_eval_byte_for_byte(tmp_path: Path, payload: str) -> None:
    """The command prints the variable it came in: exactly its own text. The payload after
    the return is never run (no file made), and the next command runs as usual."""
    command = 'builtin printf %s "$__gd_cmd"; builtin return 0\n' + payload
    ran = run_session(tmp_path, [command, "echo next"])
    assert ran.stdout == command.encode("utf-8", "surrogateescape") + b"next\n"
    assert [m.status if m else None for m in ran.markers] == [0, 0, 0]
    assert not (tmp_path / "pwned").exists() and ran.discarded == 0


HOSTILE_COMMANDS = [
    "echo \"it's\" 'say \"hi\"' $'tab\\there' \\$HOME",
    "echo $(echo sub) `echo tick` $((6 * 7))",
    "x='$(echo not run)'; echo \"$x\" '$x'",
    "cat <<'EOF'\n$HOME `id` \\\n}\nfi\nEOF",
    "cat <<EOF\n$((6*7)) \\$x\nEOF",
    "cat <<X\nnever ended",
    "echo trailing \\",
    "echo a; false",
    "(exit 42)",
    "exit 3",
    "echo ';fi; \\__gd_mark 0 deadbeef' }",
    "printf '%s\\n' '}' 'fi' 'EOF' \"'\"",
    'f() { echo "in $1"; }\nf one # } fi\nf two',
    "echo one\n}; echo two",  # a syntax error on line 2: what came before it ran
    "echo " + "w" * 100_000,  # bash -c takes at most 128 KiB in one argument
]


@pytest.mark.parametrize("command", HOSTILE_COMMANDS, ids=range(len(HOSTILE_COMMANDS)))
def test_hostile_commands_run_as_bash_c_runs_them(tmp_path: Path, command: str) -> None:
    ran = run_session(tmp_path, [command, "echo next"])
    expected = bash_c(tmp_path, command)
    marker = ran.markers[1]
    assert marker is not None and ran.markers[2] is not None and ran.markers[2].status == 0
    assert (ran.stdout, marker.status) == (expected.stdout + b"next\n", expected.returncode)


def test_statuses_and_state_come_back_in_the_marker(tmp_path: Path) -> None:
    sub = tmp_path / "sub dir 'q'"
    sub.mkdir()
    ran = run_session(
        tmp_path,
        [
            "false",
            "(exit 42)",
            "exit 7",
            "set -e; false; echo after-set-e",
            f"cd {ansi_c_quote(str(sub))}; export K='a b'",
        ],
    )
    statuses = [m.status if m else None for m in ran.markers]
    assert statuses == [0, 1, 42, 7, 0, 0]  # set -e cannot end the session: the command is a condition
    last = ran.markers[-1]
    assert last is not None and last.cwd == str(sub) and 'declare -x K="a b"' in last.exports
    assert b"after-set-e" in ran.stdout


def test_merge_stderr_puts_both_streams_in_write_order(tmp_path: Path) -> None:
    ran = run_session(tmp_path, ["echo 1; echo 2 >&2; echo 3"], merge_stderr=True)
    assert (ran.stdout, ran.stderr) == (b"1\n2\n3\n", b"")


def test_the_command_reads_its_stdin_not_the_script(tmp_path: Path) -> None:
    data = tmp_path / "in 'put'"
    data.write_bytes(b"from the file\n")
    ran = run_session(tmp_path, ["cat; cat", "cat"], stdin=stdin_source(str(data)))
    assert ran.stdout == b"from the file\nfrom the file\n"  # the script after the command was not eaten
    ran = run_session(tmp_path, ["cat; echo done"])
    assert ran.stdout == b"done\n"  # /dev/null


def test_a_restarted_session_gets_its_exports_and_oldpwd_back(tmp_path: Path) -> None:
    """The start script replays a session's last ``export -p`` (as bash wrote it) and leaves
    OLDPWD and the directory as they were, whatever the library directory is called."""
    value = "a 'b' $c `x` \\ \"q\"\nline2 \udcff"
    exports = os.fsdecode(bash_c(tmp_path, f"export KEPT={ansi_c_quote(value)}; export -p").stdout)
    ran = run_session(tmp_path, ['printf "%s|%s|%s" "$KEPT" "${OLDPWD-unset}" "$PWD"'], exports=exports)
    assert ran.stdout == f"{value}|unset|{tmp_path}".encode("utf-8", "surrogateescape")


def test_a_job_gets_its_quoted_fifos(tmp_path: Path) -> None:
    """on_timeout "detach": the command runs as a job of bash with stdout, stderr and status on
    the paths guestd made (plain files here), whatever their names hold."""
    d = tmp_path / "jobs it's $(x)"
    d.mkdir()
    paths = {name: str(d / f"`{name}`") for name in ("stdout", "stderr", "status")}
    ran = run_session(tmp_path, ["echo out; echo err >&2; exit 5"], job_paths=paths)
    marker = ran.markers[1]
    assert marker is not None and marker.status == 5
    assert (Path(paths["stdout"]).read_bytes(), Path(paths["stderr"]).read_bytes()) == (b"out\n", b"err\n")
    pid, status = Path(paths["status"]).read_text().split()
    assert pid.isdigit() and status == "5"


# -- the marker ------------------------------------------------------------------------------
NONCE = b"0123456789abcdef0123456789abcdef"


def marker_bytes(nonce: bytes, status: bytes = b"0", cwd: bytes = b"/w", exports: bytes = b"declare -x A") -> bytes:
    return nonce + b"\0" + status + b"\0" + cwd + b"\0" + exports + b"\0"


def test_take_marker_believes_only_the_nonce() -> None:
    forged = marker_bytes(b"f" * 32, cwd=b"/forged") + b"0\0/forged\0x\0"
    buf = bytearray(forged + marker_bytes(NONCE, b"3") + b"after")
    dropped, marker = take_marker(buf, NONCE)
    assert (dropped, marker, bytes(buf)) == (len(forged), Marker(3, "/w", "declare -x A"), b"after")


def test_take_marker_without_the_nonce_keeps_only_what_may_start_it() -> None:
    buf = bytearray(marker_bytes(b"e" * 32) * 100)
    size = len(buf)
    dropped, marker = take_marker(buf, NONCE)
    assert marker is None and len(buf) == len(NONCE) and dropped == size - len(NONCE)


def test_take_marker_byte_by_byte() -> None:
    """A marker cut anywhere between reads is found once, when its last byte is there."""
    data = b"junk" + marker_bytes(NONCE, b"12", b"/a\xffb") + marker_bytes(NONCE)
    buf, found, dropped = bytearray(), [], 0
    for i in range(len(data)):
        buf += data[i : i + 1]
        n, marker = take_marker(buf, NONCE)
        dropped += n
        if marker is not None:
            found.append((i, marker))
    assert dropped == 4
    assert [m for _, m in found] == [
        Marker(12, os.fsdecode(b"/a\xffb"), "declare -x A"),
        Marker(0, "/w", "declare -x A"),
    ]
    assert found[0][0] == len(marker_bytes(NONCE, b"12", b"/a\xffb")) + 3


def test_take_marker_odd_statuses_and_a_marker_that_never_ends() -> None:
    assert take_marker(bytearray(marker_bytes(NONCE, b"")), NONCE)[1] == Marker(0, "/w", "declare -x A")
    assert take_marker(bytearray(marker_bytes(NONCE, b"x1")), NONCE)[1] == Marker(1, "/w", "declare -x A")
    buf = bytearray(NONCE + b"\0" + b"0\0/w\0" + b"e" * (MAX_CTL_BYTES + 1))
    size = len(buf)
    assert take_marker(buf, NONCE) == (size, None) and buf == b""


def test_the_nonce_is_nowhere_the_command_can_read_it(tmp_path: Path) -> None:
    ran = run_session(
        tmp_path, ['set; declare -f; declare -p; trap -p; alias; echo "$BASH_COMMAND"; history; cat /proc/$$/cmdline']
    )
    assert ran.markers[1] is not None and ran.nonces[1].encode() not in ran.stdout + ran.stderr


FORGE = (
    # guestd's own function, and every fd of bash above 2 (its saved copy of the status channel
    # among them), with a guessed nonce: nothing of it is a marker
    "\\__gd_mark 0 deadbeefdeadbeefdeadbeefdeadbeef; "
    "for n in $(ls /proc/$$/fd); do [ $n -gt 2 ] && "
    "printf '%s\\0' deadbeefdeadbeefdeadbeefdeadbeef 0 /forged x >&$n 2>/dev/null; done; "
    # the marker's text on stdout is output, nothing more
    "printf '%s\\0' deadbeefdeadbeefdeadbeefdeadbeef 0 /forged x; (exit 9)"
)


def test_a_command_cannot_write_a_marker_that_is_believed(tmp_path: Path) -> None:
    ran = run_session(tmp_path, [FORGE, "echo next"])
    first, second = ran.markers[1], ran.markers[2]
    assert first is not None and (first.status, first.cwd) == (9, str(tmp_path))
    assert second is not None and second.status == 0
    assert ran.stdout == b"deadbeefdeadbeefdeadbeefdeadbeef\x000\x00/forged\x00x\x00next\n"
    assert b"Bad file descriptor" in ran.stderr  # __gd_mark: fd 63 is closed for the command
    assert ran.discarded > 0  # the forged markers through bash's saved copy: not believed


# -- pty mode --------------------------------------------------------------------------------
def on_a_terminal(command: str, setup: str = "") -> tuple[bytes, int]:
    """pty_command's text as a job's subshell runs it (``eval`` in a subshell, after the
    session's ``setup``), on a real terminal; what the terminal shows, and the status. The
    output is small: the terminal holds it until the shell has ended."""
    primary, secondary = os.openpty()
    try:
        text = pty_command(command, os.ttyname(secondary))
        code = subprocess.run(
            [BASH, "--noprofile", "--norc", "-c", f'shopt -s expand_aliases; {setup}\n( eval -- "$1" )', "bash", text],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=ENV,
            timeout=30,
        ).returncode
        os.set_blocking(primary, False)
        shown = bytearray()
        with contextlib.suppress(BlockingIOError):
            while data := os.read(primary, 65536):
                shown += data
        return bytes(shown), code
    finally:
        os.close(primary)
        os.close(secondary)


PTY_TEXT = [
    ("echo hi; echo err >&2; [ -t 0 ] && [ -t 1 ] && [ -t 2 ] && echo all-tty", b"hi\r\nerr\r\nall-tty\r\n", 0),
    ("cat <<EOF\nhello", b"hello\r\n", 0),  # a heredoc ended by the end of the text
    ("echo trailing \\", b"trailing \\\r\n", 0),
    ("echo one\n}; echo two", b"one\r\n", 2),  # a syntax error after what ran
    ("echo (", b"syntax error", 2),  # reaches the terminal
    ('echo "[$TERM]"; (exit 4)', b"[xterm-256color]\r\n", 4),
]


@pytest.mark.parametrize(("command", "shown", "status"), PTY_TEXT, ids=range(len(PTY_TEXT)))
def test_a_pty_command_runs_as_its_text_runs_without_a_terminal(command: str, shown: bytes, status: int) -> None:
    """The text is not spliced into guestd's syntax: with ``{ text } <tty``, the first four
    ended with status 2 and not a byte on the terminal."""
    seen, code = on_a_terminal(command)
    assert (shown in seen, code) == (True, status), seen


def test_the_pty_lines_are_not_the_sessions_aliases_or_functions() -> None:
    setup = "alias builtin=echo exec=echo; exec() { echo function; }; unset TERM"
    assert on_a_terminal('echo "[$TERM]"', setup) == (b"[xterm-256color]\r\n", 0)
