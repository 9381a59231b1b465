"""Red-team pass over tree.upload's hand-written tar reader (guestd/files/tarread.py, b3d38e0)
and the extractor around it (guestd/files/trees.py): a hostile client's archives built byte by
byte, and a hostile workload sharing the file system during the extraction.

Each finding is a test marked ``xfail(strict=True)`` that says what should hold; it passes (and
the mark must go) once the defect is fixed. The attacks that held are plain tests, each cheap.
Memory is read as guestd's peak RSS (VmHWM, reset through /proc/<pid>/clear_refs before each
attack), so one guestd serves the module.
"""

from __future__ import annotations

import asyncio
import gzip
import lzma
import os
import struct
import subprocess
import zlib
from collections.abc import Iterable, Iterator
from typing import Any

import pytest

from guestd.client import Client
from guestd.files import tarhead, tarread
from guestd.testing import Guestd
from guestd.wire.errors import GuestdError
from tests.helpers import peak_rss

MiB = 1024 * 1024
END = bytes(1024)
NOBODY = 65534


# --------------------------------------------------------------------------- archives by hand


def header(name: bytes, size: int = 0, kind: bytes = b"0", mode: int = 0o644, link: bytes = b"") -> bytes:
    return tarhead._block(name, mode, 0, 0, size, 0, kind, link)


def padded(data: bytes) -> bytes:
    return data + bytes(-len(data) % 512)


def record(key: bytes, value: bytes) -> bytes:
    """One pax record, ``"<length> key=value\\n"``, its length counting its own digits."""
    body = b" " + key + b"=" + value + b"\n"
    n = len(body) + 1
    while len(str(n)) + len(body) != n:
        n = len(str(n)) + len(body)
    return str(n).encode() + body


def pax(records: bytes, kind: bytes = b"x") -> bytes:
    return header(b"././@PaxHeader", len(records), kind) + padded(records)


def regular(name: bytes, data: bytes, mode: int = 0o644) -> bytes:
    return header(name, len(data), mode=mode) + padded(data)


def many_tiny_records(first_key: int, nbytes: int) -> tuple[bytes, int]:
    """Records of distinct keys and empty values filling about ``nbytes`` (the cheapest keys to
    send: about 10 bytes each); returns them and the next key number."""
    out: list[bytes] = []
    size, key = 0, first_key
    while size < nbytes - 64:
        r = record(b"k%x" % key, b"")
        out.append(r)
        size += len(r)
        key += 1
    return b"".join(out), key


def xz_claiming_dictionary(parts: Iterable[bytes], dict_props: int) -> bytes:
    """An .xz stream compressed with a 1 MiB dictionary whose block header then says the
    LZMA2 dictionary is ``dict_props`` (39: 1.5 GiB), its CRC32 made again: a valid stream
    that any decoder must allocate (and, as it writes, touch) that dictionary for."""
    comp = lzma.LZMACompressor(
        format=lzma.FORMAT_XZ,
        check=lzma.CHECK_NONE,
        filters=[{"id": lzma.FILTER_LZMA2, "dict_size": 1 << 20, "preset": 0}],
    )
    data = bytearray(b"".join(comp.compress(p) for p in parts) + comp.flush())
    at = 12  # the block header follows the 12-byte stream header
    block = data[at : at + (data[at] + 1) * 4]
    props = block.index(b"\x21\x01", 2) + 2  # filter id 0x21 (LZMA2), 1 byte of properties
    block[props] = dict_props
    block[-4:] = struct.pack("<I", zlib.crc32(bytes(block[:-4])))
    data[at : at + len(block)] = block
    return bytes(data)


# --------------------------------------------------------------------------- guestd and probes


class Chunks:
    """The pieces of an archive as tarread.Reader takes them (in-process, no guestd)."""

    def __init__(self, pieces: Iterable[bytes]) -> None:
        self.pieces = iter(pieces)

    def next_chunk(self) -> bytes | None:
        return next(self.pieces, None)


def upload(c: Client, dst: str, pieces: Iterable[bytes]) -> dict[str, Any] | GuestdError:
    """tree.upload of ``pieces`` (each one INPUT, cut to frames by the client): the reply's
    body, or the error (guestd's, or the client's own about the reply)."""

    async def go() -> dict[str, Any]:
        call = c._aio._conn.start("tree.upload", {"path": dst})
        for p in pieces:
            await call.send_input({"data": p}, 120)
        await call.send_input({"eof": True}, 120)
        return await c._aio._conn.wait(call, 300)

    try:
        return c._run(go())
    except GuestdError as exc:
        return exc


def reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # VmHWM back to the current RSS


def nothing_left(ws: str, dst: str) -> bool:
    return not os.path.lexists(dst) and not [n for n in os.listdir(ws) if "guestd-tree" in n]


# --------------------------------------------------------------------------- findings


def test_bytes_after_the_gzip_stream_are_not_held_in_memory(
    workspace_client: Client, workspace_env: tuple[Guestd, str]
) -> None:
    """A gzip member holding a header that announces a 1 GiB file and 100 bytes of it, then
    32 MiB of junk after the gzip end: guestd held all 32 MiB (2x while concatenating, and
    O(n^2) copies: 64 MiB took 2.3 s of CPU) until the input ended. Measured: +152 MiB of peak
    RSS for 64 MiB of junk. The reply (truncated) is right; the memory is the defect."""
    g, ws = workspace_env
    member = gzip.compress(header(b"f", 1 << 30) + b"x" * 100)
    junk = os.urandom(MiB)
    reset_peak(g.pid)
    before = peak_rss(g.pid)
    r = upload(workspace_client, f"{ws}/gz-trailing", [member, *[junk] * 32])
    assert isinstance(r, GuestdError) and r.code == "bad_request"
    assert peak_rss(g.pid) - before < 16 * MiB


def test_an_xz_dictionary_claim_does_not_size_guestds_memory(
    workspace_client: Client, workspace_env: tuple[Guestd, str]
) -> None:
    """20 KB of .xz (a 64 MiB file of zeros) whose block header says its dictionary is 1.5 GiB:
    guestd's RSS grows by the whole output (measured +136 MiB for 128 MiB, up to 4 GiB per
    upload), though it inflates 1 MiB at a time. Fix: LZMADecompressor(memlimit=...) (xz -9
    needs 65 MiB to decode), refused as bad_request when passed."""
    g, ws = workspace_env
    data = xz_claiming_dictionary([header(b"f", 64 * MiB), *[bytes(MiB)] * 64, END], 39)
    assert len(data) < 64 * 1024
    reset_peak(g.pid)
    before = peak_rss(g.pid)
    upload(workspace_client, f"{ws}/xz-dict", [data])  # refused or extracted: either is fine, the memory is not
    assert peak_rss(g.pid) - before < 32 * MiB


@pytest.mark.parametrize("kind", [b"g", b"x"])
def test_pax_records_guestd_keeps_are_bounded(
    workspace_client: Client, workspace_env: tuple[Guestd, str], kind: bytes
) -> None:
    """8 extended headers of 1 MiB each (under the per-header bound), distinct keys nobody
    reads: guestd's peak RSS grew by about 140 MiB (17x what was sent), and more headers grow
    it without end. Fix: keep only the keys the reader uses (path, linkpath, size, mtime, and
    whether any GNU.sparse.* came) and bound the records' total."""
    g, ws = workspace_env

    def attack() -> Iterator[bytes]:
        key = 0
        for _ in range(8):
            records, key = many_tiny_records(key, MiB)
            yield pax(records, kind)
        yield regular(b"f", b"x") + END

    reset_peak(g.pid)
    before = peak_rss(g.pid)
    upload(workspace_client, f"{ws}/pax-records-{kind.decode()}", attack())
    assert peak_rss(g.pid) - before < 32 * MiB


def test_a_pax_global_header_does_not_make_every_later_entry_costly(
    workspace_client: Client, workspace_env: tuple[Guestd, str]
) -> None:
    """One 1 MiB global header (107,000 records) then 200 directory entries (100 KB): each entry
    merged every global record and scanned them for GNU.sparse., about 20 ms of guestd CPU per
    entry (measured 5.9 s for 300; 1,000,000 entries would be hours of a core) against about
    1 ms without the header. Checked without a clock (a CPU-time comparison is at the mercy of
    the machine's load): the reader keeps of the globals only the keys it uses, so merging them
    into an entry is O(1); and guestd still applies the one that matters (mtime)."""
    ws = workspace_env[1]
    records, _ = many_tiny_records(0, MiB)
    archive = pax(records + record(b"mtime", b"7"), b"g") + b"".join(header(b"d%d" % i, 0, b"5") for i in range(200))
    reader = tarread.Reader(Chunks([archive + END]))
    entries = 0
    while reader.next_member("") is not None:
        entries += 1
    assert entries == 200 and len(reader.globals) <= 4, len(reader.globals)  # path, linkpath, size, mtime
    r = upload(workspace_client, f"{ws}/globals-kept", [archive, END])
    assert isinstance(r, dict) and r["entries"] == 200
    assert os.stat(f"{ws}/globals-kept/d199").st_mtime_ns == 7 * 10**9


def test_a_negative_pax_size_is_refused(workspace_client: Client, workspace_env: tuple[Guestd, str]) -> None:
    """Before: the tree was committed with both entries (f, and g read from 5 bytes past a
    block boundary), and the client got protocol_error 'field bytes must be >= 0'. GNU tar
    refuses such a size; so should the reader (digits only, else bad_request invalid)."""
    ws = workspace_env[1]
    dst = f"{ws}/negative-size"
    data = pax(record(b"size", b"-5")) + header(b"f", 0) + b"\0" * 5 + regular(b"g", b"abc") + END
    r = upload(workspace_client, dst, [data])
    assert isinstance(r, GuestdError) and r.code == "bad_request", r
    assert nothing_left(ws, dst)


def _base256_mtime_header(name: bytes) -> bytes:
    block = bytearray(header(name, 1))
    block[136:148] = b"\x80" + b"\x7f" * 11  # base-256 mtime: about 2^87 seconds
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)
    return bytes(block) + padded(b"x")


@pytest.mark.parametrize(
    "archive",
    [
        pytest.param(pax(record(b"mtime", b"1" + b"0" * 30)) + regular(b"f", b"x") + END, id="pax-file"),
        pytest.param(pax(record(b"mtime", b"-1" + b"0" * 30)) + header(b"d", 0, b"5") + END, id="pax-dir-negative"),
        pytest.param(_base256_mtime_header(b"f") + END, id="ustar-base256"),
        pytest.param(pax(record(b"mtime", b"1e30")) + regular(b"f", b"x") + END, id="pax-float"),
        pytest.param(pax(record(b"mtime", b"9" * 5000)) + regular(b"f", b"x") + END, id="pax-5000-digits"),
    ],
)
def test_an_mtime_out_of_range_is_not_internal(
    workspace_client: Client, workspace_env: tuple[Guestd, str], archive: bytes
) -> None:
    """Refused by the reader as bad_request invalid naming the entry (5000 digits was a bare
    bad_request from int()'s ValueError, without details), nothing left."""
    ws = workspace_env[1]
    dst = f"{ws}/mtime-{zlib.crc32(archive):x}"
    r = upload(workspace_client, dst, [archive])
    assert isinstance(r, GuestdError) and r.code == "bad_request", r
    assert r.details.get("reason") == "invalid" and r.details.get("entry") in ("f", "d"), r.details
    assert nothing_left(ws, dst)


@pytest.mark.skipif(os.geteuid() != 0, reason="the workload runs as nobody: needs root")
def test_a_workload_cannot_swap_the_staging_directory(
    workspace_client: Client, workspace_env: tuple[Guestd, str]
) -> None:
    """Mid-upload (the stream paused after the first file), nobody renames
    .x.guestd-tree-<random> to stash and puts a directory of its own at that name. Before: the
    reply said entries 1, bytes 9, the target held the workload's 'evil', and guestd's tree was
    left at stash (root's, 0700, never removed). Fix: stage inside a private directory and
    rename from its fd, or compare the temp name's inode with fstat(self.root) before and the
    target's after the rename."""
    ws = workspace_env[1]
    dst = f"{ws}/swapped"

    async def go() -> dict[str, Any]:
        call = workspace_client._aio._conn.start("tree.upload", {"path": dst})
        await call.send_input({"data": regular(b"mine", b"host data")}, 30)
        temp: list[str] = []
        for _ in range(1000):  # until guestd has made its temp directory
            temp = [n for n in os.listdir(ws) if n.startswith(".swapped.guestd-tree-")]
            if temp:
                break
            await asyncio.sleep(0.01)
        swap = f"mv {temp[0]} stash && mkdir planted && echo evil > planted/mine && mv planted {temp[0]}"
        subprocess.run(["sh", "-c", swap], cwd=ws, user=NOBODY, group=NOBODY, check=True)
        await call.send_input({"data": END}, 30)
        await call.send_input({"eof": True}, 30)
        return await workspace_client._aio._conn.wait(call, 30)

    try:
        try:
            workspace_client._run(go())
        except GuestdError:
            return  # refused: fine, as long as nothing of the workload's was committed
        with open(f"{dst}/mine") as f:
            assert f.read() == "host data"
        assert os.listdir(f"{ws}/stash") == []  # guestd's private directory, emptied (staging swap)
    finally:  # the workload's directory at guestd's temp name would fail later nothing_left checks
        left = [f"{ws}/{n}" for n in os.listdir(ws) if n == "stash" or n.startswith(".swapped.guestd-tree-")]
        subprocess.run(["rm", "-rf", "--", *left], check=True)


# --------------------------------------------------------------------------- attacks that held


@pytest.mark.parametrize(
    ("archive", "reason"),
    [
        pytest.param(pax(record(b"path", b"../up")) + regular(b"f", b"x") + END, "dotdot", id="pax-path-dotdot"),
        pytest.param(pax(record(b"path", b"/etc/x")) + regular(b"f", b"x") + END, "absolute", id="pax-path-abs"),
        pytest.param(
            header(b"././@LongLink", 9, b"L") + padded(b"a/../../b") + regular(b"f", b"x") + END,
            "dotdot",
            id="gnu-longname-dotdot",
        ),
        pytest.param(
            pax(record(b"linkpath", b"/etc")) + header(b"l", 0, b"2", link=b"x") + END, "link_out", id="pax-link-abs"
        ),
        pytest.param(
            header(b"././@LongLink", 12, b"K") + padded(b"../../outside") + header(b"a/l", 0, b"2", link=b"x") + END,
            "link_out",
            id="gnu-longlink-out",
        ),
        pytest.param(
            pax(record(b"linkpath", b"/etc/passwd")) + header(b"h", 0, b"1", link=b"x") + END,
            "hard_link",
            id="pax-hardlink",
        ),
        pytest.param(
            header(b"l", 0, b"2", link=b".") + regular(b"l/f", b"x") + END, "through_link", id="file-through-link"
        ),
        pytest.param(pax(record(b"GNU.sparse.size", b"10")) + regular(b"s", b"x") + END, "type", id="pax-sparse"),
        pytest.param(header(b"p", 0, b"6") + END, "fifo", id="fifo"),
        pytest.param(pax(record(b"path", b"x")) + END, "invalid", id="pax-then-end"),
        pytest.param(regular(b"f", b"x") + header(b"g", 10)[:300], "truncated", id="cut-mid-header"),
        pytest.param(
            pax(record(b"size", str(2**63).encode())) + header(b"f", 0) + b"abc", "truncated", id="pax-size-2^63"
        ),
    ],
)
def test_hostile_names_links_and_sizes_are_refused_whole(
    workspace_client: Client, workspace_env: tuple[Guestd, str], archive: bytes, reason: str
) -> None:
    ws = workspace_env[1]
    dst = f"{ws}/held-{reason}-{zlib.crc32(archive):x}"
    r = upload(workspace_client, dst, [archive])
    assert isinstance(r, GuestdError) and r.code == "bad_request", r
    assert r.details.get("reason") == reason, r.details
    assert nothing_left(ws, dst)


@pytest.mark.parametrize("where", [b"path", b"linkpath"])
def test_a_nul_in_a_pax_name_is_refused_and_nothing_is_left(
    workspace_client: Client, workspace_env: tuple[Guestd, str], where: bytes
) -> None:
    ws = workspace_env[1]
    dst = f"{ws}/nul-{where.decode()}"
    entry = regular(b"f", b"x") if where == b"path" else header(b"l", 0, b"2", link=b"x")
    r = upload(workspace_client, dst, [pax(record(where, b"a\0b")) + entry + END])
    assert isinstance(r, GuestdError) and r.code == "bad_request", r
    # before: neither (os.open's ValueError, a bare bad_request)
    assert r.details.get("reason") == "invalid" and "entry" in r.details, r.details
    assert nothing_left(ws, dst)


def test_a_checksum_that_lies_is_refused(workspace_client: Client, workspace_env: tuple[Guestd, str]) -> None:
    ws = workspace_env[1]
    block = bytearray(header(b"f", 1))
    block[0] = ord("g")  # the name changed, the checksum not
    dst = f"{ws}/bad-checksum"
    r = upload(workspace_client, dst, [regular(b"a", b"x") + bytes(block) + padded(b"x") + END])
    assert isinstance(r, GuestdError) and r.details.get("reason") == "invalid"
    assert nothing_left(ws, dst)


def test_setuid_setgid_and_archive_ids_are_not_kept(
    workspace_client: Client, workspace_env: tuple[Guestd, str]
) -> None:
    ws = workspace_env[1]
    block = bytearray(tarhead._block(b"f", 0o6777, 0, 0, 1, 0, b"0", b""))  # uid 0, gid 0 (root's)
    dst = f"{ws}/modes"
    r = upload(workspace_client, dst, [bytes(block) + padded(b"x") + header(b"d", 0, b"5", mode=0o2777) + END])
    assert isinstance(r, dict), r
    assert os.stat(f"{dst}/f").st_mode & 0o7777 == 0o777  # setuid and setgid dropped
    assert os.stat(f"{dst}/d").st_mode & 0o7777 == 0o777
    if os.geteuid() == 0:  # the workspace rule, never the archive's ids
        assert (os.stat(f"{dst}/f").st_uid, os.stat(f"{dst}/d").st_gid) == (NOBODY, NOBODY)


def test_a_zero_block_mid_archive_ends_it_and_what_follows_is_not_extracted(
    workspace_client: Client, workspace_env: tuple[Guestd, str]
) -> None:
    ws = workspace_env[1]
    dst = f"{ws}/zero-mid"
    r = upload(workspace_client, dst, [regular(b"a", b"x") + bytes(512) + regular(b"b", b"y") + END])
    assert isinstance(r, dict) and r["entries"] == 1
    assert os.listdir(dst) == ["a"]
