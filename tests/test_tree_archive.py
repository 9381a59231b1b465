"""``archive.Archive`` (tree.download's tar maker) on its own: pieces of exactly ``chunk`` bytes
that tarfile reads back, a file that shrinks while read padded to its size at open, and
``close`` from another thread ending the maker's thread and its fds whatever it was doing."""

from __future__ import annotations

import asyncio
import io
import os
import tarfile
import threading
from collections.abc import Iterator

import pytest

from guestd.files import archive
from guestd.files.walk import Filter


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _archive(root: str, chunk: int) -> archive.Archive:
    return archive.Archive(os.open(root, os.O_RDONLY | os.O_DIRECTORY), Filter(skip_git=False), chunk)


def _pieces(arch: archive.Archive) -> Iterator[bytes]:
    while (piece := arch.step()) is not None:
        yield bytes(piece)


@pytest.fixture
def tree(tmp_path: object) -> str:
    root = str(tmp_path)
    os.makedirs(f"{root}/a/b")
    for i in range(40):
        with open(f"{root}/a/b/f{i}", "wb") as f:
            f.write(os.urandom(i * 97))
    os.symlink("../../etc/passwd", f"{root}/a/out")
    os.mkfifo(f"{root}/a/fifo")
    return root


@pytest.mark.parametrize("chunk", [7, 511, 512, 4096, 1 << 20])
def test_pieces_are_chunk_sized_and_read_back_as_the_tree(tree: str, chunk: int) -> None:
    before = _fds()
    arch = _archive(tree, chunk)
    pieces = list(_pieces(arch))
    arch.close()
    assert all(len(p) == chunk for p in pieces[:-1]) and 0 < len(pieces[-1]) <= chunk
    with tarfile.open(fileobj=io.BytesIO(b"".join(pieces)), mode="r:") as tar:
        got = {m.name: m for m in tar.getmembers()}
        for i in range(40):
            data = tar.extractfile(got[f"a/b/f{i}"])
            assert data is not None and data.read() == open(f"{tree}/a/b/f{i}", "rb").read()
    assert got["a/out"].issym() and got["a/out"].linkname == "../../etc/passwd"
    assert "a/fifo" not in got and arch.skipped == 1
    assert arch.entries == len(got) == 43  # a, a/b, 40 files, the link
    assert not arch.thread.is_alive() and _fds() == before


def test_a_file_that_shrinks_while_read_is_padded_to_its_size_at_open(tmp_path: object) -> None:
    root = str(tmp_path)
    with open(f"{root}/big", "wb") as f:
        f.write(b"x" * (3 << 20))
    arch = _archive(root, 1 << 20)
    first = arch.step()  # the maker is one piece ahead: it has the file open by now
    assert first is not None
    os.truncate(f"{root}/big", 1000)
    rest = b"".join(_pieces(arch))
    arch.close()
    with tarfile.open(fileobj=io.BytesIO(bytes(first) + rest), mode="r:") as tar:
        m = tar.getmember("big")
        data = tar.extractfile(m)
        assert data is not None
        body = data.read()
    assert m.size == 3 << 20 and len(body) == 3 << 20
    assert body[:1000] == b"x" * 1000 and body.rstrip(b"\0").rstrip(b"x") == b""


def test_close_mid_stream_ends_the_thread_and_closes_every_fd(tree: str) -> None:
    before = _fds()
    arch = _archive(tree, 512)
    assert arch.step() is not None  # the maker now waits with the next piece ready
    arch.close()
    assert not arch.thread.is_alive() and _fds() == before
    assert arch.step() is None  # after close: the end, not a wait


def test_close_wakes_a_step_waiting_in_another_thread(tree: str) -> None:
    arch = _archive(tree, 512)
    arch.walk.stop()  # nothing more is made: a step after the pieces made waits until close
    results: list[object] = []
    waiter = threading.Thread(target=lambda: results.extend(iter(arch.step, None)))
    waiter.start()
    arch.close()
    waiter.join(timeout=10)
    assert not waiter.is_alive() and not arch.thread.is_alive()


def test_next_piece_awaited_on_a_loop_gives_the_archive_step_gives(tree: str) -> None:
    """The loop's way (the archive's thread wakes it per piece, no I/O thread waits) reads the
    same bytes as the blocking step(), and leaves no fd or thread behind."""
    before = _fds()

    async def on_a_loop() -> list[bytes]:
        arch = _archive(tree, 4096)
        got = []
        while (piece := await arch.next_piece()) is not None:
            got.append(bytes(piece))
        arch.close()
        assert not arch.thread.is_alive()
        return got

    awaited = asyncio.run(on_a_loop())
    stepped = _archive(tree, 4096)
    assert b"".join(awaited) == b"".join(_pieces(stepped)) and len(awaited) > 3
    stepped.close()
    assert _fds() == before
