"""Reading a tar stream for ``tree.upload``: the archive's entries one by one, a file's data
written straight from the received frames to its fd.

tarfile's stream mode read the archive in 10 KiB records and copied each file through them (a
quarter of the extraction's CPU), and it ended an archive silently at a header it could not read
after the first (a corrupted archive was extracted in part and reported done), and answered an
empty, foreign or truncated one with ``internal``. Here the 512-byte header block is decoded as
``tarfile.TarInfo.frombuf`` decodes it (:func:`decode_header`: a block in the form tars write,
octal numbers and the unsigned checksum, by one ``struct`` unpack; any other one by ``frombuf``
itself, base-256 numbers, signed checksums and oddities, so the answer or the refusal is
tarfile's; ``frombuf`` for every block was about 22 us, a quarter of the extraction's CPU on a
tree of small files), and the extended headers are read as tarfile reads them: pax (``x``, and
``g`` for all that follow) and GNU long names (``L``, ``K``). Of the pax records only those the
reader uses are kept (``path``, ``linkpath``, ``size``, ``mtime``, and whether any
``GNU.sparse.*`` came), so what a chain of headers leaves in memory is a few names, and merging
the globals into an entry costs the same however many records they had. A pax size is ASCII
digits, an mtime must fit a ``time_t``. A header that cannot be read is ``bad_request``
(``reason`` ``invalid``), an archive that ends inside a header or a file ``truncated``. A zero
block ends the archive; so does the end of the input after a whole entry (as tarfile and GNU tar
take it). gzip, bzip2 and xz streams are recognized by their first bytes and inflated at most 1
MiB at a time; after a stream's end the input may hold another stream (as ``gzip -d``, ``bzip2
-d`` and ``xz -d`` read them) or zero bytes (a tape's blocking: dropped, as gzip does); anything
else there is refused (``invalid``: GNU tar fails on gzip's "trailing garbage" too), never held.
"""

from __future__ import annotations

import bz2
import lzma
import re
import struct
import tarfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from guestd.wire.errors import ErrorCode, GuestdError

if TYPE_CHECKING:
    from zlib import _Decompress

BLOCK = 512
INFLATE_STEP = 1024 * 1024  # most bytes one inflate call makes: a small archive may inflate to a lot
# The most memory an .xz/.lzma stream may make its decoder use: its dictionary (xz -9 needs
# 65 MiB to decode); its header may claim up to 4 GiB, which the decoder would allocate.
XZ_MEMLIMIT = 128 * 1024 * 1024
_ZERO_BLOCK = bytes(BLOCK)
REGULAR_KINDS = (b"0", b"\0", b"7")  # "7": contiguous, a regular file to everyone else
# An extended header's records are read whole (tarfile held any size the header said): names
# are at most 4096 bytes, so real ones are kilobytes.
_PAX_MAX = 1024 * 1024
_PAX_KEPT = (b"path", b"linkpath", b"size", b"mtime")  # the records the reader uses; others dropped
_NUMBER_MAX = 64  # bytes of a pax size or mtime kept (its first 65: more is refused when used)
# what os.utime takes: seconds in a signed 64-bit time_t (the kernel clamps to the file system's)
_MTIME_MIN_NS = -(2**63) * 10**9
_MTIME_MAX_NS = 2**63 * 10**9 - 1
# what starts another stream after one ended (lzma-alone has no such thing)
_NEXT_STREAM = {"gz": b"\x1f\x8b", "bz2": b"BZh", "xz": b"\xfd7zXZ\x00", "lzma": b""}


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


class _Corrupt(Exception):
    """The compressed stream cannot be read (the reader names the entry)."""


class _Inflate:
    """A decompressor that makes at most ``INFLATE_STEP`` bytes per :meth:`pull`, and holds at
    most a few bytes of input beyond what it was last given."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.zlib: _Decompress | None = None
        self.other: bz2.BZ2Decompressor | lzma.LZMADecompressor | None = None
        self.tail = b""  # input not yet given to the decompressor (zlib: what it left over)
        self._start()

    def _start(self) -> None:
        if self.kind == "gz":
            self.zlib = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif self.kind == "bz2":
            self.other = bz2.BZ2Decompressor()  # bounded by the format: 900 kB blocks, ~3.7 MB
        else:
            self.other = lzma.LZMADecompressor(memlimit=XZ_MEMLIMIT)

    def push(self, data: bytes) -> None:
        # pull returned b"": all input taken, but for at most 5 bytes of a next stream's magic
        self.tail = self.tail + data if self.tail else data

    def pull(self) -> bytes:
        """Output made from the input so far (b"": it needs more input, or the stream ended)."""
        try:
            while True:
                if self.zlib is not None:
                    if not self.tail:
                        return b""
                    out = self.zlib.decompress(self.tail, INFLATE_STEP)
                    if self.zlib.eof:
                        self.tail, self.zlib = self.zlib.unused_data, None
                    else:
                        self.tail = self.zlib.unconsumed_tail
                elif self.other is not None:
                    if self.tail:
                        data, self.tail = self.tail, b""
                    elif self.other.needs_input:
                        return b""
                    else:
                        data = b""  # output left from the input it has
                    out = self.other.decompress(data, INFLATE_STEP)
                    if self.other.eof:
                        self.tail, self.other = self.other.unused_data, None
                elif not self._after_end():
                    return b""
                else:
                    continue
                if out:
                    return out
        except (zlib.error, OSError, EOFError, lzma.LZMAError) as exc:
            raise _Corrupt(f"the {self.kind} stream is corrupt ({exc})") from None

    def _after_end(self) -> bool:
        """Input after a stream's end: True when it starts another stream; zero bytes dropped;
        a part of the next stream's magic held until it can be told; anything else refused."""
        rest = self.tail.lstrip(b"\0")
        magic = _NEXT_STREAM[self.kind]
        self.tail = rest
        if not rest:
            return False
        if magic and rest.startswith(magic):
            self._start()
            return True
        if len(rest) < len(magic) and magic.startswith(rest):
            return False
        raise _Corrupt(f"bytes after the end of the {self.kind} stream")


@dataclass(slots=True)
class Header:
    """The fields of one header block the reader uses, as ``tarfile.TarInfo.frombuf`` gives them
    (``name`` with the ustar prefix, a directory's without its trailing slashes)."""

    name: str
    linkname: str
    type: bytes
    mode: int
    size: int
    mtime: int


# name, mode, uid, gid, size, mtime, chksum, type, linkname, (magic, version, uname, gname),
# devmajor, devminor, prefix: the ustar fields up to byte 500
_USTAR = struct.Struct("100s8s8s8s12s12s8sc100s72x8s8s155s")
_OCTAL = b"01234567 "
_GNU_TYPES = (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.GNUTYPE_SPARSE)


class _NotPlain(Exception):
    """A header block :func:`decode_header` leaves to ``frombuf``."""


def _octal(field: bytes) -> int:
    """A number field as ``tarfile.nti`` reads it, when it is octal digits and spaces up to its
    first NUL (anything else, base-256 included, is ``frombuf``'s to read or refuse)."""
    digits = field.split(b"\0", 1)[0]
    if digits.translate(None, _OCTAL):
        raise _NotPlain
    try:
        return int(digits.strip() or b"0", 8)
    except ValueError:  # a space between digits: tarfile refuses it too
        raise _NotPlain from None


# The number fields as GNU tar, tarfile and tarhead write them, bytes 100 to 156: mode, uid, gid
# (7 octal digits and a NUL), size, mtime (11 and a NUL), checksum (6, a NUL, a space); and the
# device numbers (329 to 345) the same or all NULs. Such a block's numbers take one match.
_WRITTEN_NUMBERS = re.compile(rb"([0-7]{7})\0[0-7]{7}\0[0-7]{7}\0([0-7]{11})\0([0-7]{11})\0([0-7]{6})\0 ")
_WRITTEN_DEVICES = re.compile(rb"(?:[0-7]{7}\0|\0{8}){2}")


def _numbers(block: bytes, fields: tuple[bytes, ...]) -> tuple[int, int, int, int]:
    """The header's mode, size, mtime and stated checksum; ``fields`` are its eight number fields
    (mode, uid, gid, size, mtime, chksum, devmajor, devminor), all of which must be readable."""
    written = _WRITTEN_NUMBERS.match(block, 100)
    if written is not None and _WRITTEN_DEVICES.match(block, 329):
        return int(written[1], 8), int(written[2], 8), int(written[3], 8), int(written[4], 8)
    mode, _uid, _gid, size, mtime, chksum, _major, _minor = (_octal(f) for f in fields)
    return mode, size, mtime, chksum


def _text(field: bytes) -> str:
    return field.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def decode_header(block: bytes) -> Header:
    """One 512-byte header block (not all zeros), as ``tarfile.TarInfo.frombuf(block, "utf-8",
    "surrogateescape")`` reads it; raises ``tarfile.HeaderError`` where it does."""
    (name, mode, uid, gid, size, mtime, chksum, kind, link, devmajor, devminor, prefix) = _USTAR.unpack_from(block)
    try:
        # all eight numbers read: those not used too, as frombuf refuses a block with one unreadable
        mode_n, size_n, mtime_n, stated = _numbers(block, (mode, uid, gid, size, mtime, chksum, devmajor, devminor))
        # The unsigned sum of the block with the checksum field as spaces. adler32's low half is
        # 1 + the sum of the bytes mod 65521: exact for 256 bytes (at most 65,280).
        view = memoryview(block)
        unsigned = (zlib.adler32(view[:256]) & 0xFFFF) + (zlib.adler32(view[256:]) & 0xFFFF) - 2
        if stated != unsigned - sum(chksum) + 256 or kind == tarfile.GNUTYPE_SPARSE:
            raise _NotPlain  # a signed sum, a wrong one, or the old GNU sparse fields
        head = Header(_text(name), _text(link), kind, mode_n, size_n, mtime_n)
    except _NotPlain:
        info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
        return Header(info.name, info.linkname, info.type, info.mode, info.size, int(info.mtime))
    if kind == tarfile.AREGTYPE and head.name.endswith("/"):
        head.type = kind = tarfile.DIRTYPE  # an old archive's directory
    if kind == tarfile.DIRTYPE:
        head.name = head.name.rstrip("/")
    if prefix[:1] != b"\0" and kind not in _GNU_TYPES:
        text = _text(prefix)
        if text:
            head.name = text + "/" + head.name
    return head


# The header kinds that describe the entry after them: pax ("x", "g") and GNU long names ("L", "K").
_EXTENDED_KINDS = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK)


@dataclass(slots=True)
class _Extended:
    """What one entry's extended headers said, until its own header comes."""

    came: bool = False  # an extended header came: an entry must follow
    pax: dict[bytes, bytes] = field(default_factory=dict)  # the kept records of its "x" headers
    pax_sparse: bool = False
    long_name: bytes | None = None
    long_link: bytes | None = None


class Reader:
    """The archive's bytes from ``source`` (raw chunks, as they came), inflated if compressed."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self.cur = memoryview(b"")
        self.inflate: _Inflate | None = None
        self.sniffed = False
        self.head = b""  # the first bytes, until there are enough to tell a compressed stream
        self.ended = False
        self.globals: dict[bytes, bytes] = {}  # pax "g" records kept (_PAX_KEPT): for every entry after them
        self.global_sparse = False  # a "g" header had a GNU.sparse.* record
        self.members = 0  # entries read so far
        self.last = ""  # the last entry's name, for a corrupt compressed stream

    def _fill(self) -> bool:
        """The next piece of the archive into ``cur``; False at the end of the input."""
        while not self.ended:
            if self.inflate is not None:
                try:
                    out = self.inflate.pull()
                except _Corrupt as exc:
                    raise bad(self.last, "invalid", str(exc)) from None
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
        elif head.startswith(b"\xfd7zXZ"):
            self.inflate = _Inflate("xz")
        elif head.startswith(b"\x5d\x00\x00\x80"):
            self.inflate = _Inflate("lzma")
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
        ext = _Extended()
        while True:
            info = self._header(previous, ext.came)
            if info is None:
                return None
            if info.type in _EXTENDED_KINDS:
                self._take_extended(info, previous, ext)
                continue
            member = self._member(info, ext)
            self.members += 1
            self.last = member.name
            return member

    def _header(self, previous: str, extended: bool) -> Header | None:
        """The next header block decoded, or None at the end of the archive (refused right after
        an extended header: an entry must follow one)."""
        block = self.read(BLOCK)
        if not block and not extended:
            if not self.members:
                raise bad(previous, "truncated", "the archive is empty (not even its end blocks)")
            return None  # the input ended between entries
        if len(block) < BLOCK:
            raise bad(previous, "truncated", "the archive ends inside a header")
        if block == _ZERO_BLOCK:
            if extended:
                raise bad(previous, "invalid", "an extended header is followed by the end")
            return None
        try:
            return decode_header(block)
        except tarfile.HeaderError as exc:
            raise bad(previous, "invalid", f"an unreadable header after {previous!r} ({exc})") from None

    def _take_extended(self, info: Header, previous: str, ext: _Extended) -> None:
        """An extended header's data (at most ``_PAX_MAX`` bytes) into ``ext`` (pax "g": into the
        reader's globals, for every entry after it)."""
        if not 0 <= info.size <= _PAX_MAX:
            raise bad(previous, "invalid", f"an extended header of {info.size} bytes")
        data = self.read(info.size)
        if len(data) < info.size or self.copy(-info.size % BLOCK, None) < -info.size % BLOCK:
            raise bad(previous, "truncated", "the archive ends inside an extended header")
        ext.came = True
        kind = info.type
        if kind == tarfile.GNUTYPE_LONGNAME:
            ext.long_name = data.split(b"\0", 1)[0]
        elif kind == tarfile.GNUTYPE_LONGLINK:
            ext.long_link = data.split(b"\0", 1)[0]
        elif kind == tarfile.XHDTYPE:
            ext.pax_sparse |= _pax_records(data, previous, ext.pax)
        else:
            self.global_sparse |= _pax_records(data, previous, self.globals)

    def _pax(self, ext: _Extended, key: bytes) -> bytes | None:
        """A pax record of this entry, else of the globals before it."""
        return ext.pax.get(key, self.globals.get(key))

    def _names(self, info: Header, ext: _Extended) -> tuple[str, str]:
        """The entry's name and link name: the header's, replaced by a GNU long name's, replaced
        in turn by a pax record's."""
        name = info.name
        if ext.long_name is not None:
            name = ext.long_name.decode("utf-8", "surrogateescape")
        linkname = info.linkname
        if ext.long_link is not None:
            linkname = ext.long_link.decode("utf-8", "surrogateescape")
        # pax text is UTF-8; with hdrcharset=BINARY (or bytes that are not UTF-8) the bytes as
        # they are, kept as surrogates (what tarfile gives with errors="surrogateescape")
        path = self._pax(ext, b"path")
        if path is not None:
            name = path.decode("utf-8", "surrogateescape")
        link = self._pax(ext, b"linkpath")
        if link is not None:
            linkname = link.decode("utf-8", "surrogateescape")
        if "\0" in name or "\0" in linkname:
            raise bad(name, "invalid", "a NUL byte in a name")
        return name, linkname

    def _size(self, info: Header, ext: _Extended, name: str) -> int:
        size = info.size
        pax_size = self._pax(ext, b"size")
        if pax_size:  # an empty value: the header's (POSIX: it removes the keyword)
            if len(pax_size) > _NUMBER_MAX or not pax_size.isdigit():  # bytes.isdigit: ASCII only
                raise bad(name, "invalid", f"a pax size of {pax_size[:_NUMBER_MAX]!r}")
            size = int(pax_size)
        if size < 0:  # a base-256 size may be negative
            raise bad(name, "invalid", f"a size of {size}")
        return size

    def _mtime_ns(self, info: Header, ext: _Extended, name: str) -> int:
        pax_mtime = self._pax(ext, b"mtime")
        mtime_ns = int(info.mtime) * 10**9
        if pax_mtime:
            mtime_ns = _pax_time_ns(pax_mtime, mtime_ns, name)
        if not _MTIME_MIN_NS <= mtime_ns <= _MTIME_MAX_NS:
            raise bad(name, "invalid", "an mtime past what a file's time can hold")
        return mtime_ns

    def _member(self, info: Header, ext: _Extended) -> Member:
        """The entry a (non-extended) header describes, with its extended headers applied."""
        name, linkname = self._names(info, ext)
        size = self._size(info, ext, name)
        mtime_ns = self._mtime_ns(info, ext, name)
        kind = info.type
        if ext.pax_sparse or self.global_sparse or kind == tarfile.GNUTYPE_SPARSE:
            kind = b"S"  # refused by the extractor: a sparse file is not expanded here
        if kind == tarfile.AREGTYPE and name.endswith("/"):
            kind = tarfile.DIRTYPE  # an old archive's directory (as tarfile reads it)
        if kind == tarfile.DIRTYPE:
            name = name.rstrip("/")  # as tarfile gives a directory's name
        return Member(name, kind, info.mode, mtime_ns, size, linkname)

    def finish_data(self, size: int, copied: int, name: str) -> None:
        """After a file's ``copied`` of ``size`` bytes: the padding to a block, or truncated."""
        pad = -size % BLOCK
        if copied < size or self.copy(pad, None) < pad:
            raise bad(name, "truncated", "the archive ends inside this file")


def _pax_records(data: bytes, previous: str, into: dict[bytes, bytes]) -> bool:
    """``"<length> key=value\\n"`` records into ``into``, only the keys in ``_PAX_KEPT`` (values as
    bytes, decoded later; a size or mtime cut after ``_NUMBER_MAX + 1`` bytes, so a longer one is
    still seen as too long); returns whether a ``GNU.sparse.*`` key came."""
    sparse = False
    pos = 0
    while pos < len(data):
        if data[pos] == 0:  # padding some writers leave inside the records
            break
        space = data.find(b" ", pos, pos + 24)
        digits = data[pos:space] if space > pos else b""
        if not digits.isdigit():  # ASCII digits only (int() takes "+1", "1_0", " 1")
            raise bad(previous, "invalid", "a pax record without its length")
        end = pos + int(digits)
        if end - 1 <= space or end > len(data) or data[end - 1] != 0x0A:
            raise bad(previous, "invalid", "a pax record of a wrong length")
        eq = data.find(b"=", space + 1, end - 1)
        if eq < 0:
            raise bad(previous, "invalid", "a pax record without '='")
        key = data[space + 1 : eq]
        if key in _PAX_KEPT:
            value = data[eq + 1 : end - 1]
            into[key] = value if key in (b"path", b"linkpath") else value[: _NUMBER_MAX + 1]
        elif key.startswith(b"GNU.sparse."):
            sparse = True
        pos = end
    return sparse


def _pax_time_ns(value: bytes, default: int, entry: str) -> int:
    """A pax time (``-?digits[.digits]``) to nanoseconds, exactly; ``default`` (the header's)
    for one that is no number at all."""
    if len(value) > _NUMBER_MAX:
        raise bad(entry, "invalid", f"a pax mtime of more than {_NUMBER_MAX} bytes")
    text = value.strip()
    negative = text.startswith(b"-")
    whole, _, frac = text.removeprefix(b"-").partition(b".")
    if not whole.isdigit() or (frac and not frac.isdigit()):
        try:  # another spelling of a number (tarfile writes str(float): 6.1e-05)
            return round(float(text) * 1e9)
        except ValueError:  # not a number (nan too)
            return default
        except OverflowError:  # inf
            raise bad(entry, "invalid", "an mtime past what a file's time can hold") from None
    ns = int(whole) * 10**9 + int((frac[:9] or b"0").ljust(9, b"0"))
    return -ns if negative else ns
