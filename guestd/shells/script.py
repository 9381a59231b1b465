"""The bash text guestd writes into a session's shell, its quoting, and the marker bash writes
back: plain functions, no I/O (tests/test_shell_script.py runs what they build through bash).

How a command runs, without markers in the user's output:
- bash reads guestd's script on its stdin; the user's command travels as an ANSI-C
  quoted string and runs through ``eval`` in the shell itself, with stdin from
  /dev/null (or a file holding the request's input) and the control fd closed;
- when it ends, bash writes ``nonce NUL status NUL cwd NUL export -p NUL`` to a separate
  status socket (fd 63, a Unix socket with SO_PASSCRED): bytes written by any process but
  bash itself (a job of the command, which inherits bash's copies of its fds) are discarded,
  and so are bytes without the nonce, which is fresh for every command. guestd's functions
  are read-only. Everything the command wrote to stdout/stderr was written before the
  marker, so guestd drains the pipes and the output is complete, with nothing of the next
  command. (A command can still reprogram bash itself, e.g. with a DEBUG trap, and with it
  what later commands of its session do: PROTOCOL.md 10.)
- ``exit``/``logout`` are shell functions that return from the command, so
  ``exit 3`` gives status 3 and keeps the session (under ``set -o posix`` the builtin
  comes first and ends bash: bash's exit status is then the command's).
- guestd's lines do not depend on what commands set: expansions are quoted (IFS) and its
  functions are called with a backslash (no alias applies) and are read-only.
- The command runs in an ``if`` condition, so ``set -e`` cannot end the session (and has
  no effect inside it).
- guestd's functions are defined by sourcing a file named ``bash``, and the command's
  ``eval`` sits on that file's line 1: error messages and ``$LINENO`` read as they do
  with ``bash -c`` (``bash: line 1: nosuchcmd: command not found``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import NamedTuple

from guestd.wire.errors import ErrorCode, GuestdError

CTL_FD = 63  # the status socket, in bash; closed for the command
MAX_CTL_BYTES = 16 * 1024 * 1024  # a marker carries `export -p`; more than this is not one

# Sourced as a file named "bash" (see the module head). Line 1 must stay the eval.
# Line 1 of the library: the eval of a plain command, and the job of an on_timeout "detach"
# or pty command (job.py). Not `builtin eval`: set -e would end bash.
_LINE1 = (
    '__gd_run() { eval -- "$__gd_cmd"; }; '
    "__gd_job() { builtin set -m; { ( builtin trap : INT TERM HUP QUIT; builtin printf '%s\\n' \"$BASHPID\" >&9; "
    '( builtin unset -f exit logout; eval -- "$__gd_cmd" ) 9>&-; __gd_s=$?; '
    'builtin printf \'%s\\n\' "$__gd_s" >&9; builtin exit "$__gd_s" ) & } '
    '>"$1" 2>"$2" 9>"$3" <"$4"; builtin set +m; '
    # Interrupted (on_timeout detach): the job leaves bash's job table, so bash never reports
    # its end ("Killed") into a later command's stderr. __gd_mark restores the usual trap.
    "builtin trap 'builtin disown -- \"$!\" 2>/dev/null; return 130 2>/dev/null' INT; "
    'builtin wait "$!"; }\n'
)
LIBRARY = (
    _LINE1
    + rf"""__gd_trap() {{ builtin trap 'return 130 2>/dev/null' INT; }}
__gd_trap
shopt -s expand_aliases
exit() {{ builtin return "${{1:-$?}}"; }}
logout() {{ builtin return "${{1:-$?}}"; }}
__gd_mark() {{
  __gd_trap  # a command may have replaced the INT trap; timeouts rely on it
  builtin printf '%s\0%s\0%s\0' "$2" "$1" "$PWD" >&{CTL_FD}
  builtin export -p >&{CTL_FD}; builtin printf '\0' >&{CTL_FD}
}}
builtin readonly -f __gd_run __gd_job __gd_trap __gd_mark
"""
)


def ansi_c_quote(text: str) -> str:
    """Quote for bash as $'...': every byte that could end or bend the string is escaped."""
    out = ["$'"]
    for b in text.encode("utf-8", "surrogateescape"):
        c = chr(b)
        if c == "'" or c == "\\":
            out.append("\\" + c)
        elif 0x20 <= b < 0x7F:
            out.append(c)
        else:
            out.append(f"\\x{b:02x}")
    out.append("'")
    return "".join(out)


def check_command(command: str) -> None:
    """A command bash can hold. bash has no NUL in a string: ``$'a\\x00b'`` is ``a``, so the
    text up to the first NUL would run, silently, as if it were the command."""
    at = command.find("\0")
    if at >= 0:
        raise GuestdError(
            ErrorCode.BAD_REQUEST,
            f"command: a NUL byte at offset {at} (bash cannot hold one)",
            details={"field": "command"},
        )


def _nonce_text(nonce: str) -> str:
    """The nonce as the script writes it, in single quotes: hex only, so nothing to escape."""
    if not nonce or any(c not in "0123456789abcdef" for c in nonce):
        raise ValueError("a marker nonce is lowercase hex")
    return f"'{nonce}'"


def start_script(library_dir: str, nonce: str, exports: str = "") -> str:
    """bash's first input: source the library as "bash" from its own directory (see the module
    head), go back to the session's directory leaving OLDPWD as it was, replay ``exports``
    (a restarted session's last ``export -p``), then mark. The marker says bash is ready."""
    script = (
        f"__gd_o=${{OLDPWD-}}; builtin cd -- {ansi_c_quote(library_dir)} && PATH= builtin . bash; "
        'builtin cd -- "$OLDPWD"\n'
        'if [ -n "$__gd_o" ]; then OLDPWD=$__gd_o; else builtin unset OLDPWD; fi; builtin unset __gd_o\n'
    )
    if exports:
        script += exports + "\n"
    return script + f"\\__gd_mark 0 {_nonce_text(nonce)}\n"


def stdin_source(path: str | None) -> str:
    """The command's stdin as the target of a ``<`` redirection: a file or FIFO, or /dev/null."""
    return ansi_c_quote(path) if path else "/dev/null"


def pty_command(command: str, tty: str) -> str:
    """pty mode: the command as its job's subshell runs it (job.py), on the terminal ``tty``.
    Line 1 makes the terminal the subshell's stdin, stdout and stderr (``\\command exec``: an
    alias, or a function named exec, of the session's does not stand in; a redirection that
    fails ends the job with 1) and gives it a TERM a terminal program can use; the command follows from line 2 as it
    came, never inside guestd's syntax: a text that runs without a terminal (a heredoc the end
    of the text ends, a trailing backslash) runs the same with one, and bash's syntax errors
    reach the terminal."""
    tty_q = ansi_c_quote(tty)
    return (
        f"\\command exec <{tty_q} >{tty_q} 2>&1 || \\builtin exit 1; "
        "[[ ${TERM:-dumb} != dumb ]] || \\builtin export TERM=xterm-256color\n" + command
    )


def run_line(stdin: str, merge_stderr: bool, job_paths: Mapping[str, str] | None = None) -> str:
    """The call that runs ``$__gd_cmd``: in bash itself, or (``job_paths``: the job's stdout,
    stderr and status FIFOs) as a job of its own. ``stdin`` is stdin_source's text. What
    earlier commands set must not bend it: guestd's functions are called as \\name (no alias
    applies; they are read-only)."""
    if job_paths is None:
        return f"\\__gd_run < {stdin} {CTL_FD}>&-" + (" 2>&1" if merge_stderr else "")
    q = ansi_c_quote
    out = job_paths["stdout"]
    err = out if merge_stderr else job_paths["stderr"]  # opened twice: one FIFO, write order
    return f"\\__gd_job {q(out)} {q(err)} {q(job_paths['status'])} {stdin} {CTL_FD}>&-"


def command_script(
    command: str,
    nonce: str,
    *,
    stdin: str = "/dev/null",
    merge_stderr: bool = False,
    job_paths: Mapping[str, str] | None = None,
    tty: str | None = None,
) -> str:
    """The text for one command: the command into ``$__gd_cmd``, then its run (run_line) as an
    ``if`` condition (set -e cannot end bash) and the marker with its status. ``stdin``:
    stdin_source's text; ``job_paths``: the job's FIFOs (on_timeout detach, pty); ``tty``:
    pty mode's terminal."""
    if "\0" in command:
        raise ValueError("a command with a NUL byte (check_command refuses it)")
    if tty is not None:
        command = pty_command(command, tty)
    run = run_line(stdin, merge_stderr, job_paths)
    n = _nonce_text(nonce)
    return f'__gd_cmd={ansi_c_quote(command)}\nif {run}; then \\__gd_mark 0 {n}; else \\__gd_mark "$?" {n}; fi\n'


class Marker(NamedTuple):
    """What bash reports when a command has ended."""

    status: int
    cwd: str  # an os str: any bytes, as cd left them
    exports: str  # `export -p`, replayed into a restarted bash


def take_marker(buf: bytearray, nonce: bytes) -> tuple[int, Marker | None]:
    """Look for the marker with ``nonce`` in what bash wrote to the status socket so far.
    Returns (bytes discarded, the marker or None). ``buf`` keeps what may still become the
    marker (or follows it); everything before the nonce is not ours to believe."""
    token = nonce + b"\0"
    at = buf.find(token)
    if at < 0:
        keep = len(token) - 1  # the token may be cut between two reads
        dropped = max(0, len(buf) - keep)
        del buf[:dropped]
        return dropped, None
    del buf[:at]
    fields = bytes(buf[len(token) :]).split(b"\0", 3)
    if len(fields) < 4:
        if len(buf) > MAX_CTL_BYTES:
            dropped = at + len(buf)
            buf.clear()  # never completes: the command's timeout ends it
            return dropped, None
        return at, None
    code, cwd, exports, rest = fields
    buf[:] = rest
    try:
        status = int(code or b"0")
    except ValueError:
        status = 1
    return at, Marker(status, os.fsdecode(cwd), exports.decode("utf-8", "surrogateescape"))
