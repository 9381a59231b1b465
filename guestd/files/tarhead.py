"""Tar headers made by hand, for ``tree.download`` (guest) and ``upload_tree`` (client).

A ustar header per entry, preceded by a pax extended header (``x``) only for what ustar cannot
say: a name or link target longer than 100 bytes or not ASCII, a number past its octal field,
an mtime with a fraction of a second (kept to the nanosecond, as the file system has it). A
name that is not UTF-8 goes out as its bytes with ``hdrcharset=BINARY``. The result reads as
``tarfile``'s ``PAX_FORMAT`` writes it (GNU tar and tarfile read both), at a fraction of its
cost per entry: ``TarInfo.tobuf`` was about half of a tree download's CPU.
"""

from __future__ import annotations

import functools
import os
import sys
import zlib
from collections.abc import Callable

BLOCK = 512
REGULAR = b"0"
SYMLINK = b"2"
DIRECTORY = b"5"
_PAX = b"x"
_NS = 1_000_000_000
_OCTAL_7 = 8**7  # uid, gid, mode: 7 octal digits and a NUL
_OCTAL_11 = 8**11  # size, mtime: 11 octal digits and a NUL
# A ustar header: name[100] mode[8] uid[8] gid[8] size[12] mtime[12] checksum[8] type[1]
# linkname[100], then magic "ustar\0" and version "00" and NULs to 512 bytes (uname, gname,
# devmajor, devminor, prefix left empty). Numbers are octal, NUL-terminated.
_TAIL = b"ustar\x0000" + b"\0" * (32 + 32 + 8 + 8 + 155 + 12)
# The checksum is the sum of the header's bytes with its own field as 8 spaces: the constant
# part (those spaces and the magic; NULs add nothing) plus the variable fields' bytes.
_CHECKSUM_BASE = 8 * ord(" ") + sum(b"ustar\x0000")


def _block(name: bytes, mode: int, uid: int, gid: int, size: int, mtime: int, kind: bytes, link: bytes) -> bytes:
    # The variable fields are at most 244 bytes (name and link at most 100 each), so their sum is
    # at most 62,220 and adler32's low half, 1 + the sum mod 65,521, is 1 + the sum exactly:
    # summed in C (sum() over the bytes was an eighth of the header's cost).
    fields = b"%s%07o%07o%07o%011o%011o%s%s" % (name, mode, uid, gid, size, mtime, kind, link)
    checksum = _CHECKSUM_BASE + (zlib.adler32(fields) & 0xFFFF) - 1
    return b"%s%07o\0%07o\0%07o\0%011o\0%011o\0%06o\0 %s%s%s" % (
        name.ljust(100, b"\0"),
        mode,
        uid,
        gid,
        size,
        mtime,
        checksum,
        kind,
        link.ljust(100, b"\0"),
        _TAIL,
    )


def _record(key: bytes, value: bytes) -> bytes:
    """One pax record, ``"<length> key=value\\n"``, its length counting its own digits."""
    body = b" %s=%s\n" % (key, value)
    length = len(body) + len(str(len(body)))
    length = len(body) + len(str(length))  # one more digit at most, and only once
    return b"%d%s" % (length, body)


def _decimal_seconds(ns: int) -> bytes:
    sign = b"-" if ns < 0 else b""
    whole, frac = divmod(abs(ns), _NS)
    if not frac:
        return b"%s%d" % (sign, whole)
    return b"%s%d.%s" % (sign, whole, (b"%09d" % frac).rstrip(b"0"))


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode()
    except UnicodeDecodeError:
        return False
    return True


def header(
    name: bytes, mode: int, uid: int, gid: int, size: int, mtime_ns: int, kind: bytes, link: bytes = b""
) -> bytes:
    """The header blocks of one entry: a pax extended header when ustar's fields cannot hold it
    exactly, then its ustar header. ``mode`` is masked to permission and special bits."""
    mtime, frac = divmod(mtime_ns, _NS)
    if (
        len(name) <= 100
        and name.isascii()
        and len(link) <= 100
        and link.isascii()
        and 0 <= uid < _OCTAL_7
        and 0 <= gid < _OCTAL_7
        and 0 <= size < _OCTAL_11
        and 0 <= mtime < _OCTAL_11
    ):  # the usual entry: ustar holds all, but a fraction of a second
        block = _block(name, mode & 0o7777, uid, gid, size, mtime, kind, link)
        if not frac:
            return block
        if _TEN_DIGITS <= mtime < 10 * _TEN_DIGITS:  # 2001 to 2286: a record of 30 bytes, made at once
            return b"%s30 mtime=%d.%09d\n%s%s" % (_PAX_30, mtime, frac, _ZEROS[30:], block)
        record = _record(b"mtime", b"%d.%09d" % (mtime, frac))
        return _pax_block(len(record)) + record + _padding(len(record)) + block
    records: list[bytes] = []
    binary = False  # a name or link target that is not UTF-8: its bytes, with hdrcharset=BINARY
    if len(name) > 100 or not name.isascii():
        records.append(_record(b"path", name))
        binary = not _is_utf8(name)
        name = name[:100] if name.isascii() else bytes(c if c < 128 else 63 for c in name[:100])
    if len(link) > 100 or not link.isascii():
        records.append(_record(b"linkpath", link))
        binary = binary or not _is_utf8(link)
        link = link[:100] if link.isascii() else bytes(c if c < 128 else 63 for c in link[:100])
    if not 0 <= uid < _OCTAL_7:
        records.append(_record(b"uid", b"%d" % uid))
        uid = 0
    if not 0 <= gid < _OCTAL_7:
        records.append(_record(b"gid", b"%d" % gid))
        gid = 0
    if not 0 <= size < _OCTAL_11:
        records.append(_record(b"size", b"%d" % size))
        size = 0
    if frac or not 0 <= mtime < _OCTAL_11:
        records.append(_record(b"mtime", _decimal_seconds(mtime_ns)))
        if not 0 <= mtime < _OCTAL_11:
            mtime = 0
    if binary:
        records.insert(0, b"21 hdrcharset=BINARY\n")
    data = b"".join(records)
    block = _block(name, mode & 0o7777, uid, gid, size, mtime, kind, link)
    return _pax_block(len(data)) + data + _padding(len(data)) + block


@functools.lru_cache(maxsize=1024)
def _pax_block(size: int) -> bytes:
    return _block(b"././@PaxHeader", 0, 0, 0, size, 0, _PAX, b"")


def _padding(size: int) -> bytes:
    return _ZEROS[: -size % BLOCK]


_ZEROS = bytes(BLOCK)
_TEN_DIGITS = 10**9  # the first mtime of ten decimal digits
_PAX_30 = _pax_block(30)  # the pax header block before a 30-byte record
_ZERO_RUN = memoryview(bytes(64 * 1024))
_HELD_ONLY_HERE = 2  # see Pieces._free_piece


class Pieces:
    """An archive's bytes cut into pieces of exactly ``size`` bytes, each handed to ``emit``
    as it fills (the last one shorter, at :meth:`finish`). Headers are copied in, file data
    is read straight into the free part of the piece (``readv``): a byte of a file is copied
    once on its way out, and what is held is one piece.

    A piece emitted earlier is filled again once nobody else holds it (its reference count says
    so: whoever still sends or reads it, a queue, the transport's memoryview, holds a
    reference), so a stream cycles through a few pieces instead of zeroing a new megabyte for
    each (``bytearray(size)`` was a twentieth of tree.download's CPU). Every byte of a piece
    is written, padding included: none is assumed zero."""

    SPARE = 3  # pieces emitted earlier, kept to be filled again

    def __init__(self, size: int, emit: Callable[[bytearray], None]) -> None:
        self.size = size
        self.emit = emit
        self.out = bytearray(size)
        self.filled = 0
        self.spare: list[bytearray] = []

    def _full(self) -> None:
        full = self.out
        self.out = self._free_piece()  # the one emitted is never written again while held
        self.filled = 0
        self.emit(full)
        self.spare.append(full)
        del full

    def _free_piece(self) -> bytearray:
        """A spare piece nobody else holds (referred to only by ``spare`` and getrefcount's
        argument), else a new one; the oldest spare is let go."""
        for i in range(len(self.spare)):
            if sys.getrefcount(self.spare[i]) == _HELD_ONLY_HERE:
                return self.spare.pop(i)
        if len(self.spare) >= self.SPARE:
            del self.spare[0]
        return bytearray(self.size)

    def put(self, data: bytes) -> None:
        end = self.filled + len(data)
        if end < self.size:
            self.out[self.filled : end] = data
            self.filled = end
            return
        view = memoryview(data)
        while view:
            n = min(len(view), self.size - self.filled)
            self.out[self.filled : self.filled + n] = view[:n]
            self.filled += n
            view = view[n:]
            if self.filled == self.size:
                self._full()

    def zeros(self, count: int) -> None:
        """``count`` zero bytes."""
        while count:
            n = min(count, self.size - self.filled, len(_ZERO_RUN))
            self.out[self.filled : self.filled + n] = _ZERO_RUN[:n]
            self.filled += n
            count -= n
            if self.filled == self.size:
                self._full()

    def file(self, fd: int, size: int) -> None:
        """``size`` bytes of ``fd`` and the padding to a block. A file that shrank meanwhile
        (or fails to read) is padded with zeros: the header said ``size``."""
        left = size
        while left:
            room = min(left, self.size - self.filled)
            try:
                got = os.readv(fd, [memoryview(self.out)[self.filled : self.filled + room]])
            except OSError:
                got = 0
            if not got:
                self.zeros(left)
                break
            self.filled += got
            left -= got
            if self.filled == self.size:
                self._full()
        self.zeros(-size % BLOCK)

    def finish(self) -> None:
        """The two zero blocks that end an archive, and the last piece out."""
        self.zeros(2 * BLOCK)
        if self.filled:
            last = self.out
            del last[self.filled :]
            self.filled = 0
            self.emit(last)
