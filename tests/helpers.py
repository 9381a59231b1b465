"""Small helpers that more than one test module uses: a file's bytes written and read whole, a
tar built from its members, a process's peak memory, and the script of a write killed between
its link and its rename. Test modules import from here, never from one another
(tests/test_test_layout.py keeps it so)."""

from __future__ import annotations

import io
import tarfile


def write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def tar_of(*members: tuple[str, str | bytes]) -> bytes:
    """A tar (pax) of (name, link target) symlinks and (name, bytes) files, in this order."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, what in members:
            info = tarfile.TarInfo(name)
            if isinstance(what, str):
                info.type, info.linkname = tarfile.SYMTYPE, what
                tf.addfile(info)
            else:
                info.size = len(what)
                tf.addfile(info, io.BytesIO(what))
    return buf.getvalue()


def peak_rss(pid: int) -> int:
    """The process's peak resident set (VmHWM), bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


# Run with ``python -c``, argv: the target file and the runtime's pending-writes directory. An
# O_TMPFILE overwrite of the target is SIGKILLed after its new inode got its temp name and
# before the rename: what a guestd killed at the worst moment leaves behind.
KILLED_BETWEEN_LINK_AND_RENAME = """
import os, signal, sys
from guestd.files import atomic
from guestd.files.fs import FileSystem
from guestd.files.temps import PendingTemps

target, runtime = sys.argv[1], sys.argv[2]
f = atomic.AtomicFile(FileSystem().place(target), "overwrite", None, PendingTemps(runtime))
assert f.anonymous, "this file system has no O_TMPFILE"
f.write(b"new")
# guestd dies at the worst moment: the new inode has its temp name, the rename has not run
atomic.AtomicFile._rename_temp_over_target = lambda self: os.kill(os.getpid(), signal.SIGKILL)
f.commit()
"""
