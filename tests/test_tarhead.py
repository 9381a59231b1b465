"""Tar headers made by hand (guestd/files/tarhead.py) read back by tarfile and GNU tar as
they were meant: names of any bytes and length, link targets, modes, ids and sizes past
ustar's octal fields, mtimes to the nanosecond, before 1970 and past 2242."""

from __future__ import annotations

import io
import os
import random
import shutil
import subprocess
import tarfile
from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from guestd.files import tarhead

component = hs.binary(min_size=1, max_size=40).filter(
    lambda b: b"\0" not in b and b"/" not in b and b not in (b".", b"..")
)
names = hs.lists(component, min_size=1, max_size=8).map(b"/".join)
ids = hs.one_of(hs.integers(0, 70_000), hs.integers(0, 2**40))
mtimes = hs.one_of(
    hs.integers(0, 2**33).map(lambda s: s * 1_000_000_000),  # whole seconds: ustar alone
    hs.integers(-(2**40), 2**45),  # fractions, before 1970, past the octal field
)


def _read_one(blocks: bytes) -> tarfile.TarInfo:
    with tarfile.open(fileobj=io.BytesIO(blocks + b"\0" * 1024), mode="r|", errors="surrogateescape") as tar:
        member = tar.next()
        assert member is not None
        return member


def _pax_mtime(blocks: bytes) -> Decimal | None:
    """The mtime record of the entry's pax header as written (tarfile reads it as a float)."""
    if blocks[156:157] != b"x":
        return None
    size = int(blocks[124:135], 8)
    for record in blocks[512 : 512 + size].split(b"\n"):
        if b" mtime=" in record:
            return Decimal(record.split(b"=", 1)[1].decode())
    return None


@settings(max_examples=300, deadline=None)
@given(
    name=names,
    link=hs.one_of(hs.just(b""), names),
    mode=hs.integers(0, 0o7777),
    uid=ids,
    gid=ids,
    size=hs.one_of(hs.integers(0, 4096), hs.integers(8**11 - 2, 2**40)),
    mtime_ns=mtimes,
)
def test_tarfile_reads_what_the_header_says(
    name: bytes, link: bytes, mode: int, uid: int, gid: int, size: int, mtime_ns: int
) -> None:
    kind = tarhead.SYMLINK if link else tarhead.REGULAR
    blocks = tarhead.header(name, mode, uid, gid, size, mtime_ns, kind, link)
    assert len(blocks) % 512 == 0
    m = _read_one(blocks)
    assert os.fsencode(m.name) == name
    assert os.fsencode(m.linkname) == link
    assert (m.mode, m.uid, m.gid, m.size) == (mode, uid, gid, size)
    assert m.type == kind
    pax = _pax_mtime(blocks)
    if pax is None:
        assert m.mtime == mtime_ns // 1_000_000_000 and mtime_ns % 1_000_000_000 == 0
    else:
        assert pax * 1_000_000_000 == mtime_ns  # exact to the nanosecond as written
        assert abs(m.mtime - mtime_ns / 1e9) <= 1e-6 * max(1.0, abs(mtime_ns / 1e9))


def test_an_ordinary_entry_is_one_ustar_block_and_a_fraction_adds_a_pax_mtime() -> None:
    whole = tarhead.header(b"src/main.py", 0o644, 1000, 1000, 10, 1_700_000_000 * 10**9, tarhead.REGULAR)
    assert len(whole) == 512 and whole[257:265] == b"ustar\x0000"
    fraction = tarhead.header(b"src/main.py", 0o644, 1000, 1000, 10, 1_700_000_000_123_456_789, tarhead.REGULAR)
    assert len(fraction) == 1536 and fraction[512:542] == b"30 mtime=1700000000.123456789\n"
    assert fraction[1024:] == whole


@pytest.mark.skipif(shutil.which("tar") is None, reason="GNU tar not installed")
def test_gnu_tar_lists_and_extracts_the_same(tmp_path: object) -> None:
    long_name = b"d/" + b"n" * 150
    raw = b"raw-\xff\xfe"
    archive = b"".join(
        [
            tarhead.header(b"d", 0o750, 0, 0, 0, 1_600_000_000_500_000_000, tarhead.DIRECTORY),
            tarhead.header(long_name, 0o640, 0, 0, 3, 1_600_000_000 * 10**9, tarhead.REGULAR),
            b"abc" + b"\0" * 509,
            tarhead.header(b"d/" + raw, 0o600, 0, 0, 0, 1_600_000_000 * 10**9, tarhead.REGULAR),
            tarhead.header(b"d/up", 0o777, 0, 0, 0, 1_600_000_000 * 10**9, tarhead.SYMLINK, b"../" + b"t" * 120),
            b"\0" * 1024,
        ]
    )
    dst = str(tmp_path)
    subprocess.run(["tar", "-C", dst, "-xf", "-"], input=archive, check=True)
    base = os.fsencode(dst)
    assert open(os.path.join(base, long_name), "rb").read() == b"abc"
    assert os.stat(os.path.join(base, long_name)).st_mode & 0o777 == 0o640
    assert os.path.exists(os.path.join(base, b"d/" + raw))
    assert os.readlink(os.path.join(base, b"d/up")) == b"../" + b"t" * 120
    assert os.stat(os.path.join(base, b"d")).st_mtime_ns == 1_600_000_000_500_000_000


def _stream(seed: int) -> list[tuple[str, int]]:
    """What to put into Pieces: headers-like runs of bytes, zero runs (padding), in a fixed order."""
    rng = random.Random(seed)
    return [(rng.choice(["put", "zeros"]), rng.randint(1, 3000)) for _ in range(400)]


def _fill(out: tarhead.Pieces, ops: list[tuple[str, int]]) -> bytes:
    expected = bytearray()
    for i, (op, n) in enumerate(ops):
        if op == "put":
            data = bytes([i % 251 + 1]) * n
            out.put(data)
            expected += data
        else:
            out.zeros(n)
            expected += bytes(n)
    out.finish()
    return bytes(expected + bytes(2 * tarhead.BLOCK))


@pytest.mark.parametrize("keep", [0, 1, 2, 5, 1000])
def test_a_piece_is_filled_again_only_once_nobody_holds_it(keep: int) -> None:
    """A consumer holding its last ``keep`` pieces (as the loop and the transport hold the ones
    being sent) finds each one as it was emitted; pieces it let go of are filled again, every
    byte written (a reused piece held the bytes of an earlier one where padding was assumed zero)."""
    held: list[bytearray] = []
    views: list[memoryview] = []
    copies: list[bytes] = []

    def emit(piece: bytearray) -> None:
        copies.append(bytes(piece))
        if keep == 1:
            views[:] = [memoryview(piece)]  # a memoryview holds the piece as a reference does
        elif keep:
            held.append(piece)
            del held[:-keep]

    out = tarhead.Pieces(1000, emit)
    expected = _fill(out, _stream(keep))
    assert b"".join(copies) == expected
    if keep == 1:
        assert bytes(views[0]) == copies[-1]
    for piece, copy in zip(held, copies[-len(held) :] if held else [], strict=True):
        assert bytes(piece) == copy  # what the consumer holds was never written again
    distinct = {id(p) for p in held}
    if keep == 1000:
        assert len(distinct) == len(held)  # all held: each a piece of its own
    if keep == 0:
        assert len(out.spare) <= 1  # nothing held: one piece filled over and over
