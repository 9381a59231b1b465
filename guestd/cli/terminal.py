"""The one output sanitizer: every guest-controlled string guestctl prints to a terminal.

The guest runs model-written code, so a file name, an error message, a process's command line or
a workload's output may carry terminal control sequences: OSC 52 writes the operator's clipboard,
OSC 0/2 the window title, OSC 8 hyperlinks, CSI 2J clears the screen, CSI 21 t makes some
terminals type the title back into stdin (which ``exec --pty`` forwards to the guest), DCS and
APC strings reach terminal extensions. Three uses, one escaper:

* :func:`field`: a name, id or one-line value in guestctl's own text. Every control character
  (C0, DEL, C1, bidi overrides) is shown as ``\\xNN`` / ``\\uNNNN``; always, tty or not.
* :class:`TerminalFilter` in ``strict`` mode: workload output (exec, sh, shell run, code run,
  cat, attach) when the destination is a terminal and ``--raw`` was not given: text, ``\\n``,
  ``\\t``, ``\\r`` and SGR colours (``ESC [ ... m``) pass; every other control is shown escaped.
* :class:`TerminalFilter` in ``pty`` mode (``exec --pty``): what a full-screen program needs
  passes (CSI cursor and mode sequences, ``ESC 7``, charset selection, backspace, bell); OSC,
  DCS, SOS, PM and APC strings are dropped whole, CSI window operations and reports
  (final ``t``) too; :data:`RESET_MODES` is written when the session ends.

JSON output (``--json``) escapes control characters by construction (``json.dumps``).
Bytes that are not UTF-8 are shown as ``\\xNN``.
"""

from __future__ import annotations

import codecs
import re
import sys
from typing import BinaryIO

# C0 except nothing, DEL, C1, and the bidirectional overrides and isolates ("Trojan source").
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_MAX_SEQUENCE = 64  # a CSI longer than this is not one a program needs: shown escaped
_STRING_STARTS = {"]": "OSC", "P": "DCS", "X": "SOS", "^": "PM", "_": "APC"}
_C1_STRINGS = {"\x9d", "\x90", "\x98", "\x9e", "\x9f"}
_SGR = re.compile(r"\x1b\[[0-9;:]*m")

# What ``exec --pty`` writes to the terminal when the session ends (a program that dies in the
# alternate screen, with the cursor hidden or mouse reporting on, leaves the terminal unusable):
# main screen, cursor shown, mouse and focus reporting off, bracketed paste off, normal cursor
# keys and keypad, autowrap on, US-ASCII charset, colours reset.
RESET_MODES = (
    b"\x1b[?1049l\x1b[?47l\x1b[?25h\x1b[?1000l\x1b[?1002l\x1b[?1003l\x1b[?1006l\x1b[?1015l"
    b"\x1b[?1004l\x1b[?2004l\x1b[?1l\x1b>\x1b[?7h\x1b(B\x1b[0m"
)


def _escape_char(c: str) -> str:
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}"


def escape(text: str, keep: str = "") -> str:
    """``text`` with every control character but those in ``keep`` shown as an escape."""
    return _CONTROL.sub(lambda m: m.group() if m.group() in keep else _escape_char(m.group()), text)


def field(value: object) -> str:
    """A guest value for one line of guestctl's text: every control character escaped."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", "backslashreplace")
    return escape(value if isinstance(value, str) else str(value))


def text(value: object) -> str:
    """Guest text of several lines (an error message, a traceback, a cell's value): lines and
    tabs kept, every other control character escaped."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", "backslashreplace")
    return escape(value if isinstance(value, str) else str(value), keep="\n\t")


class TerminalFilter:
    """Workload bytes in, text safe for a terminal out; sequences split across chunks are held
    until they complete. ``pty``: the interactive rules (see the module docstring)."""

    def __init__(self, *, pty: bool = False) -> None:
        self.pty = pty
        self._decoder = codecs.getincrementaldecoder("utf-8")("backslashreplace")
        self._pending = ""  # an escape sequence not complete yet
        self._in_string = False  # inside an OSC/DCS/... string (pty mode): dropped up to its end
        self._string_esc = False  # that string's last character was ESC (ST is ESC \)

    def feed(self, data: bytes) -> str:
        return self._filter(self._decoder.decode(data))

    def flush(self) -> str:
        """What is left at the end: an incomplete sequence is shown escaped."""
        out = self._filter(self._decoder.decode(b"", final=True))
        pending, self._pending = self._pending, ""
        self._in_string = False
        return out + escape(pending)

    def _filter(self, s: str) -> str:
        out: list[str] = []
        i, n = 0, len(s)
        while i < n:
            if self._in_string:
                i = self._skip_string(s, i)
                continue
            if self._pending:
                i = self._continue_sequence(s, i, out)
                continue
            m = _CONTROL.search(s, i)
            if m is None:
                out.append(s[i:])
                break
            out.append(s[i : m.start()])
            c = m.group()
            i = m.end()
            if c in "\n\t\r" or (self.pty and c in "\x08\x07"):
                out.append(c)
            elif c == "\x1b":
                self._pending = c
            elif c == "\x9b":
                self._pending = "\x1b["
            elif self.pty and c in _C1_STRINGS:
                self._in_string = True
            else:
                out.append(_escape_char(c))
        return "".join(out)

    def _skip_string(self, s: str, i: int) -> int:
        """Drop an OSC/DCS/SOS/PM/APC string up to its BEL or ST (``ESC \\`` or ``\\x9c``)."""
        while i < len(s):
            c = s[i]
            i += 1
            if self._string_esc:
                self._string_esc = False
                if c == "\\":
                    self._in_string = False
                    return i
            if c in "\x07\x9c":
                self._in_string = False
                return i
            if c == "\x1b":
                self._string_esc = True
        return i

    def _continue_sequence(self, s: str, i: int, out: list[str]) -> int:
        """Extend the pending ``ESC ...`` with ``s[i]``; settle it when it is complete or wrong."""
        seq = self._pending + s[i]
        i += 1
        if len(seq) == 2:
            c = seq[1]
            if c == "[":
                self._pending = seq
                return i
            self._pending = ""
            if self.pty and c in _STRING_STARTS:
                self._in_string = True
            elif self.pty and c in "()*+":
                self._pending = seq  # charset selection: one more character
            elif self.pty and "0" <= c <= "~":
                out.append(seq)
            else:
                out.append(_escape_char("\x1b"))
                return i - 1  # the character after ESC is read again as text
            return i
        if seq[1] in "()*+":  # ESC ( B and the like (pty mode only)
            self._pending = ""
            out.append(seq if "0" <= seq[2] <= "~" else escape(seq))
            return i
        c = seq[-1]
        if "\x20" <= c <= "\x3f" and len(seq) < _MAX_SEQUENCE:
            self._pending = seq  # parameter and intermediate bytes
            return i
        self._pending = ""
        if "\x40" <= c <= "\x7e":
            allowed = (c != "t") if self.pty else bool(_SGR.fullmatch(seq))
            out.append(seq if allowed else escape(seq) if not self.pty else "")
            return i
        out.append(escape(seq[:-1]))  # not a CSI: show it, and read the last character again
        return i - 1


class StreamOut:
    """Workload bytes for stdout or stderr: filtered when ``filtered`` (a terminal, no ``--raw``),
    else written as they are."""

    def __init__(self, binary: BinaryIO, filtered: bool, *, pty: bool = False) -> None:
        self.binary = binary
        self.filter = TerminalFilter(pty=pty) if filtered else None

    def write(self, data: bytes) -> None:
        if self.filter is not None:
            self.binary.write(self.filter.feed(data).encode("utf-8", "backslashreplace"))
        else:
            self.binary.write(data)
        self.binary.flush()

    def close(self) -> None:
        if self.filter is not None:
            self.binary.write(self.filter.flush().encode("utf-8", "backslashreplace"))
        self.binary.flush()


def stdout(raw: bool, *, pty: bool = False) -> StreamOut:
    return StreamOut(sys.stdout.buffer, not raw and sys.stdout.isatty(), pty=pty)


def stderr(raw: bool) -> StreamOut:
    return StreamOut(sys.stderr.buffer, not raw and sys.stderr.isatty())


def write_output(stdout_bytes: bytes, stderr_bytes: bytes, raw: bool) -> None:
    """A run's captured output, each stream neutralized when it goes to a terminal (not ``raw``)."""
    out = stdout(raw)
    out.write(stdout_bytes)
    out.close()
    err = stderr(raw)
    err.write(stderr_bytes)
    err.close()
