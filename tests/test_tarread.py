"""tree.upload's tar reader (guestd/files/tarread.py): it reads what tarfile reads (ustar, GNU
long names, pax, global pax, gzip/bzip2/xz, the input cut anywhere), and an archive it cannot
read is refused whole as bad_request, never extracted in part or answered ``internal``."""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import os
import struct
import tarfile
import zlib
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from guestd.client import Client
from guestd.files import tarhead, tarread
from guestd.testing import Guestd
from guestd.wire.errors import GuestdError
from tests.helpers import tar_of


class Pieces:
    """A source handing out ``data`` in the given piece sizes (cycled)."""

    def __init__(self, data: bytes, sizes: list[int]) -> None:
        self.data, self.sizes, self.pos, self.i = data, sizes, 0, 0

    def next_chunk(self) -> bytes | None:
        if self.pos >= len(self.data):
            return None
        n = self.sizes[self.i % len(self.sizes)]
        self.i += 1
        piece = self.data[self.pos : self.pos + n]
        self.pos += n
        return piece


def read_all(data: bytes, sizes: list[int]) -> list[tuple[str, bytes, int, int, int, str, bytes]]:
    reader = tarread.Reader(Pieces(data, sizes))
    out = []
    previous = ""
    while (m := reader.next_member(previous)) is not None:
        body = b""
        if m.is_regular:
            got = bytearray()

            def keep(view: memoryview, into: bytearray = got) -> int:
                into.extend(view)
                return len(view)

            reader.finish_data(m.size, reader.copy(m.size, keep), m.name)
            body = bytes(got)
        out.append((m.name, m.kind, m.mode, m.size, m.mtime_ns // 1000, m.linkname, body))
        previous = m.name
    return out


def tarfile_reads(data: bytes) -> list[tuple[str, bytes, int, int, int, str, bytes]]:
    out = []
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:*", errors="surrogateescape") as tar:
        for m in tar:
            body = b""
            if m.isreg():
                f = tar.extractfile(m)
                assert f is not None
                body = f.read()
            kind = tarfile.DIRTYPE if m.isdir() else m.type
            out.append((m.name, kind, m.mode, m.size, round(m.mtime * 1e6), m.linkname, body))
    return out


component = hs.text(hs.characters(exclude_categories=["Cs"], exclude_characters="/\0"), min_size=1, max_size=30)
names = hs.lists(component.filter(lambda c: c not in (".", "..")), min_size=1, max_size=6).map("/".join)
entry = hs.tuples(
    names,
    hs.sampled_from([tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE]),
    hs.binary(max_size=1500),
    hs.integers(0, 0o777),
    hs.one_of(hs.integers(0, 2**33), hs.floats(0, 2**33, allow_nan=False).map(lambda f: round(f, 6))),
    names,
)


@settings(max_examples=80, deadline=None)
@given(
    entries=hs.lists(entry, max_size=12),
    fmt=hs.sampled_from([tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]),
    compress=hs.sampled_from(["", "gz", "bz2", "xz"]),
    sizes=hs.lists(hs.integers(1, 5000), min_size=1, max_size=5),
)
def test_the_reader_reads_what_tarfile_reads(
    entries: list[tuple[str, bytes, bytes, int, float, str]], fmt: int, compress: str, sizes: list[int]
) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt, errors="surrogateescape") as tar:
        for name, kind, body, mode, mtime, link in entries:
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.mtime = kind, mode, mtime if fmt == tarfile.PAX_FORMAT else int(mtime)
            if kind == tarfile.SYMTYPE:
                info.linkname = link
            if kind == tarfile.REGTYPE:
                info.size = len(body)
            try:
                tar.addfile(info, io.BytesIO(body) if kind == tarfile.REGTYPE else None)
            except ValueError:  # a name ustar cannot hold
                return
    data = buf.getvalue()
    data = {"": lambda d: d, "gz": gzip.compress, "bz2": bz2.compress, "xz": lzma.compress}[compress](data)
    ours, theirs = read_all(data, sizes), tarfile_reads(data)
    assert [m[:4] + m[5:] for m in ours] == [m[:4] + m[5:] for m in theirs]
    assert all(abs(a[4] - b[4]) <= 1 for a, b in zip(ours, theirs, strict=True))  # ours exact, tarfile's a float


def test_a_pax_global_header_applies_to_the_entries_after_it() -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT, pax_headers={"mtime": "123.5"}) as tar:
        tar.addfile(tarfile.TarInfo("d"))
    got = read_all(buf.getvalue(), [100])
    assert got == tarfile_reads(buf.getvalue()) and got[0][4] == 123_500_000


def _archive() -> bytes:
    return tar_of(("a", b"x" * 600), ("b", b"y" * 10), ("c", b"z"))


def _broken(how: str) -> bytes:
    good = _archive()
    if how == "corrupt header mid-archive":
        bad = bytearray(good)
        bad[1536] ^= 0xFF  # the name in b's header (after a's header and 2 blocks): a bad checksum
        return bytes(bad)
    if how == "empty":
        return b""
    if how == "not tar":
        return b"hello world\n" * 100
    assert how == "ends inside a file"
    return good[:1700]


@pytest.mark.parametrize(
    ("how", "reason"),
    [
        ("corrupt header mid-archive", "invalid"),
        ("empty", "truncated"),
        ("not tar", "invalid"),
        ("ends inside a file", "truncated"),
    ],
)
def test_an_archive_that_cannot_be_read_is_refused_whole(
    workspace_client: Client, workspace_env: tuple[Guestd, str], how: str, reason: str
) -> None:
    """Before: a corrupted header after the first entry ended the archive silently (the tree
    was committed with the entries before it, and the reply said done); an empty, foreign or
    truncated archive was ``internal`` (tarfile's ReadError)."""
    dst = f"{workspace_env[1]}/broken-{how.replace(' ', '-')}"
    with pytest.raises(GuestdError) as err:
        workspace_client.upload_tree(_broken(how), dst)
    assert err.value.code == "bad_request" and err.value.details["reason"] == reason
    assert not os.path.exists(dst)
    assert not [n for n in os.listdir(workspace_env[1]) if "guestd-tree" in n]


def test_an_archive_without_end_blocks_is_taken_as_tar_takes_it(
    workspace_client: Client, workspace_env: tuple[Guestd, str]
) -> None:
    data = _archive()
    end = data.index(b"z") + 512  # the last file's block, without the two zero blocks
    r = workspace_client.upload_tree(data[:end], f"{workspace_env[1]}/no-end")
    assert (r.entries, r.bytes) == (3, 611)


def test_an_extended_header_past_its_bound_is_refused_before_it_is_read(
    workspace_client: Client, workspace_env: tuple[Guestd, str]
) -> None:
    """A pax header's records are held whole: one that says 2 MiB is refused from its header
    (tarfile read whatever size it said into memory). A bound, not a defect shown failing."""
    records = b"%d path=" % (2 << 20) + b"p" * ((2 << 20) - 20)
    pax = tarhead._block(b"././@PaxHeader", 0, 0, 0, len(records), 0, b"x", b"")
    dst = f"{workspace_env[1]}/huge-pax"
    with pytest.raises(GuestdError) as err:
        workspace_client.upload_tree(pax + records, dst)
    assert err.value.code == "bad_request" and err.value.details["reason"] == "invalid"
    assert not os.path.exists(dst)


# --------------------------------------------------------------------------- streams, pax fields, ranges


def _one_file_tar(name: str = "f", body: bytes = b"hello") -> bytes:
    return tar_of((name, body))


def _refusal(data: bytes, sizes: list[int] | None = None) -> dict[str, object]:
    with pytest.raises(GuestdError) as err:
        read_all(data, sizes or [len(data) or 1])
    assert err.value.code == "bad_request", err.value
    return dict(err.value.details)


COMPRESS: dict[str, Callable[[bytes], bytes]] = {"gz": gzip.compress, "bz2": bz2.compress, "xz": lzma.compress}


@pytest.mark.parametrize("kind", ["gz", "bz2", "xz"])
def test_streams_one_after_another_are_read_as_one_archive(kind: str) -> None:
    """As gzip -d, bzip2 -d and xz -d read them (pigz/pbzip2 and `cat a.gz b.gz` make them):
    the tar cut inside its file, each part its own stream, then zero padding (a tape's blocking)."""
    data = _one_file_tar(body=b"x" * 3000)
    packed = COMPRESS[kind](data[:1000]) + COMPRESS[kind](data[1000:]) + bytes(3000)
    for sizes in ([len(packed)], [1], [7, 3000]):
        assert read_all(packed, sizes) == read_all(data, [len(data)])


@pytest.mark.parametrize("kind", ["gz", "bz2", "xz"])
def test_bytes_after_a_compressed_stream_that_start_no_stream_are_refused(kind: str) -> None:
    """GNU tar fails on gzip's 'trailing garbage' too; before, gzip's were held (all of them,
    copied again at each chunk) and bzip2's and xz's dropped unread."""
    data = _one_file_tar()[:1024]  # the file, without the end blocks: the reader reads on
    packed = COMPRESS[kind](data) + bytes(10) + b"garbage"
    for sizes in ([len(packed)], [1]):
        assert _refusal(packed, sizes) == {"entry": "f", "reason": "invalid"}


def test_an_xz_stream_past_the_decoders_memory_bound_is_refused() -> None:
    """An .xz block header may claim a 4 GiB dictionary (props 40), which liblzma would
    allocate (and touch as it writes); past XZ_MEMLIMIT it is refused."""
    lzma2 = {"id": lzma.FILTER_LZMA2, "dict_size": 1 << 20}
    data = bytearray(lzma.compress(_one_file_tar(), format=lzma.FORMAT_XZ, filters=[lzma2]))
    at = 12  # the block header follows the 12-byte stream header
    block = data[at : at + (data[at] + 1) * 4]
    block[block.index(b"\x21\x01", 2) + 2] = 40  # LZMA2 (0x21), 1 byte of properties: the dictionary
    block[-4:] = struct.pack("<I", zlib.crc32(bytes(block[:-4])))
    data[at : at + len(block)] = block
    assert _refusal(bytes(data)) == {"entry": "", "reason": "invalid"}


def _pax_entry(key: str, value: str, kind: bytes = tarfile.REGTYPE, size: int = 0) -> bytes:
    body = f" {key}={value}\n".encode()
    n = len(body) + 1
    while len(str(n)) + len(body) != n:
        n = len(str(n)) + len(body)
    records = str(n).encode() + body
    ext = tarhead._block(b"././@PaxHeader", 0o644, 0, 0, len(records), 0, b"x", b"")
    records += bytes(-len(records) % 512)
    return ext + records + tarhead._block(b"f", 0o644, 0, 0, size, 0, kind, b"") + bytes(1024)


@pytest.mark.parametrize("value", ["-5", "+10", "1_0", " 10 ", "10 ", "0x10", "1e3", "\u0661\u0660"])
def test_a_pax_size_is_ascii_digits_or_refused_naming_the_entry(value: str) -> None:
    """int() took the first five (-5 misaligned the stream: the tree committed, bytes=-5); the
    others were read as the header's size, silently."""
    assert _refusal(_pax_entry("size", value)) == {"entry": "f", "reason": "invalid"}


def test_a_pax_size_in_digits_is_read() -> None:
    assert read_all(_pax_entry("size", "0"), [100])[0][3] == 0


def test_a_negative_base256_size_is_refused() -> None:
    """frombuf reads base-256 numbers with their sign: a size of -5 skipped 5 padding bytes."""
    block = bytearray(tarhead._block(b"f", 0o644, 0, 0, 0, 0, b"0", b""))
    block[124:136] = b"\xff" * 11 + b"\xfb"  # -5
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)
    assert _refusal(bytes(block) + bytes(1024)) == {"entry": "f", "reason": "invalid"}


@pytest.mark.parametrize(
    "mtime", [str(2**63), "-" + str(2**63 + 1), "1e30", "inf", "9" * 5000, "9223372036854775808.5"]
)
def test_an_mtime_a_file_cannot_hold_is_refused_naming_the_entry(mtime: str) -> None:
    assert _refusal(_pax_entry("mtime", mtime)) == {"entry": "f", "reason": "invalid"}


@pytest.mark.parametrize(
    ("mtime", "ns"), [(str(2**63 - 1), (2**63 - 1) * 10**9), ("-" + str(2**63), -(2**63) * 10**9), ("nan", 0)]
)
def test_an_mtime_at_the_edge_of_time_t_is_read(mtime: str, ns: int) -> None:
    """Up to what os.utime takes (the kernel clamps to what the file system holds); a pax time
    that is no number is the header's (0 here), as before."""
    reader = tarread.Reader(Pieces(_pax_entry("mtime", mtime), [4096]))
    m = reader.next_member("")
    assert m is not None and m.mtime_ns == ns


@pytest.mark.parametrize("key", ["path", "linkpath"])
def test_a_nul_in_a_pax_name_is_refused_with_its_details(key: str) -> None:
    """Before: os.open's ValueError, a bad_request without details.entry or details.reason."""
    data = _pax_entry(key, "a\0b", tarfile.SYMTYPE)
    assert _refusal(data)["reason"] == "invalid"


def test_pax_records_nobody_reads_are_not_kept_and_a_sparse_one_is_seen() -> None:
    """Only path, linkpath, size, mtime are kept (and whether a GNU.sparse.* came): what a
    chain of x headers or any number of g headers leaves is a few values."""

    def ext(kind: bytes, records: bytes) -> bytes:
        head = tarhead._block(b"././@PaxHeader", 0o644, 0, 0, len(records), 0, kind, b"")
        return head + records + bytes(-len(records) % 512)

    junk = b"".join(b"11 k%05d=\n" % i for i in range(20000))  # 20000 records, 11 bytes each
    data = ext(b"g", junk) + ext(b"x", junk) + ext(b"x", b"21 GNU.sparse.size=1\n")
    data += tarhead._block(b"s", 0o644, 0, 0, 0, 0, b"0", b"") + bytes(1024)
    reader = tarread.Reader(Pieces(data, [65536]))
    m = reader.next_member("")
    assert m is not None and m.kind == b"S" and reader.globals == {}
