"""tree.upload's header decoding (``tarread.decode_header``): for every block, what tarfile's
``TarInfo.frombuf`` gives, or the same refusal. The decoder reads the usual block (octal
numbers, the unsigned checksum) itself and leaves every other one to ``frombuf``, so these
tests throw at it the blocks tars write and those blocks with their number fields, checksum,
type and prefix bent (base-256, signed sums, spaces, signs, underscores, NULs, high bytes)."""

from __future__ import annotations

import tarfile
from typing import Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from guestd.files import tarhead, tarread

BLOCK = 512
# (offset, width) of each number field: mode, uid, gid, size, mtime, chksum, devmajor, devminor
NUMBER_FIELDS = [(100, 8), (108, 8), (116, 8), (124, 12), (136, 12), (148, 8), (329, 8), (337, 8)]
ODD_BYTES = b"0123456789 \0\t\n+-_xo\x80\xff\x1c\xe9/"


def frombuf(block: bytes) -> tuple[str, str, bytes, int, int, int] | str:
    try:
        info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
    except tarfile.HeaderError as exc:
        return type(exc).__name__
    return info.name, info.linkname, info.type, info.mode, info.size, int(info.mtime)


def decoded(block: bytes) -> tuple[str, str, bytes, int, int, int] | str:
    try:
        h = tarread.decode_header(block)
    except tarfile.HeaderError as exc:
        return type(exc).__name__
    return h.name, h.linkname, h.type, h.mode, h.size, h.mtime


def with_checksum(block: bytearray, signed: bool) -> bytes:
    """``block`` with its checksum field set to its (unsigned or signed) sum."""
    block[148:156] = b" " * 8
    total = sum(block) - (256 * sum(1 for b in block if b >= 128) if signed else 0)
    block[148:156] = b"%06o\0 " % (total & 0o777777)
    return bytes(block)


text = hs.text(hs.characters(exclude_characters="\0"), max_size=120)


@hs.composite
def written_blocks(draw: hs.DrawFn) -> bytes:
    """The first header block a tar writer makes for one entry: tarfile's three formats or tarhead."""
    kind = draw(hs.sampled_from([tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.AREGTYPE, b"7", b"S"]))
    name, link = draw(text), draw(text)
    mode, size = draw(hs.integers(0, 0o7777)), draw(hs.integers(0, 2**40))
    mtime, uid = draw(hs.integers(-(2**40), 2**40)), draw(hs.integers(0, 2**24))
    writer = draw(hs.sampled_from(["ustar", "gnu", "pax", "tarhead"]))
    if writer == "tarhead":
        raw = tarhead.header(
            name.encode("utf-8", "surrogatepass"), mode, uid, uid, size, max(mtime, 0) * 10**9, kind, link.encode()
        )
        return raw[-BLOCK:]  # the entry's own block (after any pax header)
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.size, info.mtime, info.uid, info.linkname = kind, mode, size, mtime, uid, link
    formats: dict[str, Literal[0, 1, 2]] = {"ustar": 0, "gnu": 1, "pax": 2}  # tarfile's USTAR, GNU, PAX_FORMAT
    fmt = formats[writer]
    try:
        raw = info.tobuf(fmt, "utf-8", "surrogateescape")
    except (ValueError, UnicodeEncodeError):  # a name or number this format cannot hold
        raw = tarhead.header(b"plain/name", mode, 0, 0, 0, 0, kind)
    return raw[-BLOCK:]


@settings(max_examples=400, deadline=None)
@given(block=written_blocks())
def test_a_block_a_tar_writes_is_decoded_as_tarfile_decodes_it(block: bytes) -> None:
    assert decoded(block) == frombuf(block)


@settings(max_examples=1500, deadline=None)
@given(
    block=written_blocks(),
    bends=hs.lists(
        hs.tuples(hs.sampled_from([*NUMBER_FIELDS, (156, 1), (345, 155), (0, 100)]), hs.integers(0, 154), hs.binary()),
        max_size=4,
    ),
    odd=hs.lists(hs.sampled_from(list(ODD_BYTES)), max_size=6),
    fix=hs.sampled_from(["unsigned", "signed", "none"]),
)
def test_a_bent_block_is_decoded_or_refused_as_tarfile_does(
    block: bytes, bends: list[tuple[tuple[int, int], int, bytes]], odd: list[int], fix: str
) -> None:
    bent = bytearray(block)
    for (offset, width), at, extra in bends:
        pos = offset + at % width
        piece = bytes(odd) + extra
        bent[pos : pos + len(piece[: offset + width - pos])] = piece[: offset + width - pos]
    if fix != "none":
        bent = bytearray(with_checksum(bent, signed=fix == "signed"))
    data = bytes(bent)
    if data == bytes(BLOCK):
        return  # the end of the archive: the reader never decodes it
    assert decoded(data) == frombuf(data)


@pytest.mark.parametrize(
    "field, value",
    [
        ((124, 12), b"\x80" + (2**33).to_bytes(11, "big")),  # base-256 size (GNU, big files)
        ((136, 12), b"\xff" * 12),  # base-256 negative mtime
        ((100, 8), b" 644  \0\0"),  # spaces around the digits
        ((100, 8), b"6 44\0\0\0\0"),  # a space between them: refused
        ((108, 8), b"+17\0\0\0\0\0"),  # a sign: int() takes it, so frombuf does
        ((108, 8), b"1_7\0\0\0\0\0"),  # an underscore: int() takes it, so frombuf does
        ((337, 8), b"9\0\0\0\0\0\0\0"),  # not octal, in a field nobody uses: refused
        ((345, 155), b"some/prefix\0"),  # the ustar prefix
    ],
)
@pytest.mark.parametrize("fix", ["unsigned", "signed"])
def test_the_fields_a_fast_path_would_get_wrong_are_read_as_tarfile_reads_them(
    field: tuple[int, int], value: bytes, fix: str
) -> None:
    block = bytearray(tarhead.header(b"dir/file", 0o644, 1000, 1000, 5, 10**9, tarhead.REGULAR)[-BLOCK:])
    offset = field[0]
    block[offset : offset + len(value)] = value
    data = with_checksum(block, signed=fix == "signed")
    assert decoded(data) == frombuf(data)
