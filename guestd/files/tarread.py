"""Reading a tar stream for ``tree.upload``: the archive's entries one by one, a file's data
written straight from the received frames to its fd.

tarfile's stream mode read the archive in 10 KiB records and copied each file through them
(a quarter of the extraction's CPU), and it ended an archive silently at a header it could
not read after the first (a corrupted archive was extracted in part and reported done), and
answered an empty, foreign or truncated one with ``internal``. Here the 512-byte header block is
decoded by ``tarfile.TarInfo.frombuf`` (checksums, base-256 numbers, the ustar prefix), and the
extended headers are read as tarfile reads them: pax (``x``, and ``g`` for all that follow;
``path``, ``linkpath``, ``size``, ``mtime``, ``hdrcharset``) and GNU long names (``L``, ``K``).
A header that cannot be read is ``bad_request`` (``reason`` ``invalid``), an archive that
ends inside a header or a file ``truncated``. A zero block ends the archive; so does the end
of the input after a whole entry (as tarfile and GNU tar take it). gzip, bzip2 and xz streams
are recognized by their first bytes and inflated at most 1 MiB at a time.
"""

from __future__ import annotations

import bz2
import lzma
import tarfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from guestd.wire.errors import ErrorCode, GuestdError

BLOCK = 512
INFLATE_STEP = 1024 * 1024  # most bytes one inflate call makes: a small archive may inflate to a lot
_ZERO_BLOCK = bytes(BLOCK)
REGULAR_KINDS = (b"0", b"\0", b"7")  # "7": contiguous, a regular file to everyone else
# An extended header's records are held whole (tarfile held any size the header said): names
# are at most 4096 bytes, so real ones are kilobytes.
_PAX_MAX = 1024 * 1024


class Source(Protocol):
    def next_chunk(self) -> bytes | None: ...


@dataclass(slots=True)
class Member:
    """One entry as the archive describes it (after its extended headers)."""

    name: str  # as tarfile gives it: UTF-8, other bytes kept as surrogates
    kind: bytes  # the type flag: b"0" file, b"5" directory, b"2" symlink, ...
    mode: int
    mtime_ns: int
    size: int
    linkname: str

    @property
    def is_regular(self) -> bool:
        return self.kind in REGULAR_KINDS


def bad(entry: str, reason: str, what: str) -> GuestdError:
    return GuestdError(ErrorCode.BAD_REQUEST, f"tar stream refused: {what}", details={"entry": entry, "reason": reason})


class _Inflate:
    """A decompressor that makes at most ``INFLATE_STEP`` bytes per :meth:`pull`."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.zlib = zlib.decompressobj(16 + zlib.MAX_WBITS) if kind == "gz" else None
        self.other: bz2.BZ2Decompressor | lzma.LZMADecompressor | None = (
            bz2.BZ2Decompressor() if kind == "bz2" else lzma.LZMADecompressor() if kind == "xz" else None
        )
        self.tail = b""  # input not yet inflated (zlib keeps it outside)
        self.fresh: bytes | None = None  # input not yet given to bz2/lzma

    def push(self, data: bytes) -> None:
        if self.zlib is not None:
            self.tail = self.tail + data if self.tail else data
        else:
            self.fresh = data

    def pull(self) -> bytes:
        """Output made from the input so far (b"": it needs more input, or the stream ended)."""
        try:
            if self.zlib is not None:
                if self.zlib.eof or not self.tail:
                    return b""
                out = self.zlib.decompress(self.tail, INFLATE_STEP)
                self.tail = self.zlib.unconsumed_tail
                return out
            assert self.other is not None
            if self.other.eof:
                return b""
            if self.fresh is not None:
                data, self.fresh = self.fresh, None
                return self.other.decompress(data, INFLATE_STEP)
            if not self.other.needs_input:
                return self.other.decompress(b"", INFLATE_STEP)
            return b""
        except (zlib.error, OSError, EOFError, lzma.LZMAError) as exc:
            raise bad("", "invalid", f"the {self.kind} stream is corrupt ({exc})") from None


class Reader:
    """The archive's bytes from ``source`` (raw chunks, as they came), inflated if compressed."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self.cur = memoryview(b"")
        self.inflate: _Inflate | None = None
        self.sniffed = False
        self.head = b""  # the first bytes, until there are enough to tell a compressed stream
        self.ended = False
        self.globals: dict[str, bytes] = {}  # pax "g" records: for every entry after them
        self.members = 0  # entries read so far

    def _fill(self) -> bool:
        """The next piece of the archive into ``cur``; False at the end of the input."""
        while not self.ended:
            if self.inflate is not None:
                out = self.inflate.pull()
                if out:
                    self.cur = memoryview(out)
                    return True
            raw = self.source.next_chunk()
            if raw is None:
                self.ended = True
                break
            if not self.sniffed:
                raw = self._sniff(raw)
                if raw is None:
                    continue
            if self.inflate is not None:
                self.inflate.push(raw)
                continue
            self.cur = memoryview(raw)
            return True
        return False

    def _sniff(self, raw: bytes) -> bytes | None:
        """Decide from the first 6 bytes whether the stream is compressed (as tarfile's r|*)."""
        head = self.head + raw
        if len(head) < 6:
            self.head = head
            return None
        self.head = b""
        self.sniffed = True
        if head.startswith(b"\x1f\x8b\x08"):
            self.inflate = _Inflate("gz")
        elif head.startswith(b"BZh91"):
            self.inflate = _Inflate("bz2")
        elif head.startswith((b"\x5d\x00\x00\x80", b"\xfd7zXZ")):
            self.inflate = _Inflate("xz")
        return head

    def read(self, n: int) -> bytes:
        """The next ``n`` bytes (fewer only at the end of the input)."""
        if len(self.cur) >= n:
            out = bytes(self.cur[:n])
            self.cur = self.cur[n:]
            return out
        parts: list[bytes] = []
        need = n
        while need:
            if not self.cur and not self._fill():
                break
            take = self.cur[:need]
            parts.append(bytes(take))
            self.cur = self.cur[len(take) :]
            need -= len(take)
        if not self.sniffed and not parts:  # fewer than 6 bytes in all: plain, and too short
            self.sniffed = True
            parts.append(self.head[:n])
        return b"".join(parts)

    def copy(self, n: int, write: Callable[[memoryview], int] | None) -> int:
        """``n`` bytes to ``write`` (None: skipped), straight from the received pieces;
        returns how many there were (fewer only at the end of the input)."""
        done = 0
        while done < n:
            if not self.cur and not self._fill():
                break
            take = self.cur[: n - done]
            self.cur = self.cur[len(take) :]
            done += len(take)
            while write is not None and take:
                take = take[write(take) :]
        return done

    def next_member(self, previous: str) -> Member | None:
        """The next entry's header (its data follows), or None at the end of the archive.
        ``previous`` names the last entry, for a message about what follows it."""
        pax: dict[str, bytes] = {}
        long_name: bytes | None = None
        long_link: bytes | None = None
        while True:
            block = self.read(BLOCK)
            if not block and not pax and long_name is None and long_link is None:
                if not self.members:
                    raise bad(previous, "truncated", "the archive is empty (not even its end blocks)")
                return None  # the input ended between entries
            if len(block) < BLOCK:
                raise bad(previous, "truncated", "the archive ends inside a header")
            if block == _ZERO_BLOCK:
                if pax or long_name is not None or long_link is not None:
                    raise bad(previous, "invalid", "an extended header is followed by the end")
                return None
            try:
                info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
            except tarfile.HeaderError as exc:
                raise bad(previous, "invalid", f"an unreadable header after {previous!r} ({exc})") from None
            kind = info.type
            if kind in (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK):
                if info.size > _PAX_MAX:
                    raise bad(previous, "invalid", f"an extended header of {info.size} bytes")
                data = self.read(info.size)
                if len(data) < info.size or self.copy(-info.size % BLOCK, None) < -info.size % BLOCK:
                    raise bad(previous, "truncated", "the archive ends inside an extended header")
                if kind == tarfile.GNUTYPE_LONGNAME:
                    long_name = data.split(b"\0", 1)[0]
                elif kind == tarfile.GNUTYPE_LONGLINK:
                    long_link = data.split(b"\0", 1)[0]
                else:
                    records = _pax_records(data, previous)
                    (pax if kind == tarfile.XHDTYPE else self.globals).update(records)
                continue
            fields = {**self.globals, **pax}
            name = info.name
            if long_name is not None:
                name = long_name.decode("utf-8", "surrogateescape")
            linkname = info.linkname
            if long_link is not None:
                linkname = long_link.decode("utf-8", "surrogateescape")
            # pax text is UTF-8; with hdrcharset=BINARY (or bytes that are not UTF-8) the bytes as
            # they are, kept as surrogates (what tarfile gives with errors="surrogateescape")
            if "path" in fields:
                name = fields["path"].decode("utf-8", "surrogateescape")
            if "linkpath" in fields:
                linkname = fields["linkpath"].decode("utf-8", "surrogateescape")
            size = _pax_int(fields["size"], info.size) if "size" in fields else info.size
            mtime_ns = _pax_time_ns(fields["mtime"], info.mtime) if "mtime" in fields else int(info.mtime) * 10**9
            if any(k.startswith("GNU.sparse.") for k in fields) or kind == tarfile.GNUTYPE_SPARSE:
                kind = b"S"  # refused by the extractor: a sparse file is not expanded here
            if kind == tarfile.AREGTYPE and name.endswith("/"):
                kind = tarfile.DIRTYPE  # an old archive's directory (as tarfile reads it)
            if kind == tarfile.DIRTYPE:
                name = name.rstrip("/")  # as tarfile gives a directory's name
            self.members += 1
            return Member(name, kind, info.mode, mtime_ns, size, linkname)

    def finish_data(self, size: int, copied: int, name: str) -> None:
        """After a file's ``copied`` of ``size`` bytes: the padding to a block, or truncated."""
        pad = -size % BLOCK
        if copied < size or self.copy(pad, None) < pad:
            raise bad(name, "truncated", "the archive ends inside this file")


def _pax_records(data: bytes, previous: str) -> dict[str, bytes]:
    """``"<length> key=value\\n"`` records; keys as text, values as bytes (decoded later)."""
    out: dict[str, bytes] = {}
    pos = 0
    while pos < len(data):
        if data[pos] == 0:  # padding some writers leave inside the records
            break
        space = data.find(b" ", pos, pos + 24)
        try:
            length = int(data[pos:space])
        except ValueError:
            raise bad(previous, "invalid", "a pax record without its length") from None
        end = pos + length
        if space < 0 or length <= 0 or end > len(data) or data[end - 1 : end] != b"\n":
            raise bad(previous, "invalid", "a pax record of a wrong length")
        key, eq, value = data[space + 1 : end - 1].partition(b"=")
        if not eq:
            raise bad(previous, "invalid", "a pax record without '='")
        out[key.decode("utf-8", "surrogateescape")] = value
        pos = end
    return out


def _pax_int(value: bytes, default: int) -> int:
    try:
        return int(value)
    except ValueError:
        return default


def _pax_time_ns(value: bytes, default: float) -> int:
    """A pax time (``-?digits[.digits]``) to nanoseconds, exactly."""
    text = value.strip()
    negative = text.startswith(b"-")
    whole, _, frac = text.lstrip(b"-").partition(b".")
    if not whole.isdigit() or (frac and not frac.isdigit()):
        try:  # another spelling of a number (tarfile writes str(float): 6.1e-05)
            return round(float(text) * 1e9)
        except (ValueError, OverflowError):
            return int(default) * 10**9
    ns = int(whole) * 10**9 + int((frac[:9] or b"0").ljust(9, b"0"))
    return -ns if negative else ns
