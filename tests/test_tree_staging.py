"""tree.upload's staging: the tree fills at ``tree`` inside a private directory
(``.<name>.guestd-tree-<random>``, guestd's, 0700) in the target's directory, which the workload
owns. The workload may rename that private directory or put one of its own at its name while
the upload runs: what is committed is still guestd's tree (renamed from the private directory's
fd), the old tree of a ``replace`` and a failed upload's half tree are removed from it, and the
workload's directory at the name is left alone."""

from __future__ import annotations

import asyncio
import io
import os
import stat
import subprocess
import tarfile
from typing import Any

import pytest

from guestd.client import AsyncClient, Client
from guestd.testing import Guestd, workspace_guestd
from guestd.wire.errors import GuestdError

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="the workload runs as nobody: needs root")


def _file(name: str, data: bytes) -> bytes:
    """One regular-file entry (header and padded data), no end blocks."""
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(info, io.BytesIO(data))
    return out.getvalue()[: tarfile.BLOCKSIZE + -(-len(data) // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE]


END = b"\0" * 1024


def _as_workload(ws: str, script: str) -> None:
    subprocess.run(["sh", "-c", script], cwd=ws, user=NOBODY, group=NOBODY, check=True)


def _upload_with_swap(c: Client, ws: str, name: str, rest: bytes, replace: bool) -> dict[str, Any] | GuestdError:
    """tree.upload of ``name`` paused after its first file while the workload renames guestd's
    private directory to ``<name>-stash`` and puts its own (holding ``mine`` = evil) at its name;
    then ``rest`` and eof. The reply, or the error."""

    async def go() -> dict[str, Any]:
        call = c._aio._conn.start("tree.upload", {"path": f"{ws}/{name}", "replace": replace})
        await call.send_input({"data": _file("mine", b"host data")}, 30)
        temp: list[str] = []
        for _ in range(1000):  # until guestd has made its private directory
            temp = [n for n in os.listdir(ws) if n.startswith(f".{name}.guestd-tree-")]
            if temp:
                break
            await asyncio.sleep(0.01)
        assert temp, "no staging directory appeared"
        _as_workload(
            ws, f"mv {temp[0]} {name}-stash && mkdir {name}-p && echo evil > {name}-p/mine && mv {name}-p {temp[0]}"
        )
        await call.send_input({"data": rest}, 30)
        await call.send_input({"eof": True}, 30)
        return await c._aio._conn.wait(call, 30)

    try:
        return c._run(go())
    except GuestdError as exc:
        return exc


def _planted(ws: str, name: str) -> list[str]:
    """The workload's directories at guestd's staging name: each still holds its 'evil'."""
    found = [n for n in os.listdir(ws) if n.startswith(f".{name}.guestd-tree-")]
    for n in found:
        with open(f"{ws}/{n}/mine") as f:
            assert f.read() == "evil\n"
    return found


@as_root
def test_a_swapped_staging_directory_does_not_keep_the_old_tree_of_a_replace(
    workspace_client: Client, workspace_env: tuple[Guestd, str]
) -> None:
    """With replace, the old tree is exchanged into guestd's private directory and removed
    there, wherever the workload moved it: nothing of it is left at the stash, and the target
    is the host's tree."""
    ws = workspace_env[1]
    _as_workload(ws, "mkdir rep && echo old > rep/old-file && mkdir rep/old-dir && echo x > rep/old-dir/f")
    r = _upload_with_swap(workspace_client, ws, "rep", END, replace=True)
    assert not isinstance(r, GuestdError), r
    assert sorted(os.listdir(f"{ws}/rep")) == ["mine"]
    with open(f"{ws}/rep/mine") as f:
        assert f.read() == "host data"
    assert os.listdir(f"{ws}/rep-stash") == []  # guestd's private directory, emptied
    assert len(_planted(ws, "rep")) == 1  # the workload's own directory: not guestd's to remove


@as_root
def test_a_failed_upload_removes_its_half_tree_from_a_swapped_staging_directory(
    workspace_client: Client, workspace_env: tuple[Guestd, str]
) -> None:
    """An upload refused after the swap removes what it extracted from its private directory
    (wherever it is now), commits nothing, and leaves the workload's directory alone."""
    ws = workspace_env[1]
    r = _upload_with_swap(workspace_client, ws, "bad", _file("../up", b"x") + END, replace=False)
    assert isinstance(r, GuestdError) and r.code == "bad_request", r
    assert not os.path.lexists(f"{ws}/bad")
    assert os.listdir(f"{ws}/bad-stash") == []
    assert len(_planted(ws, "bad")) == 1


def test_the_root_entrys_mode_and_mtime_survive_the_rename_out_of_the_private_directory(
    workspace_client: Client, workspace_env: tuple[Guestd, str]
) -> None:
    """The tree moves to another parent at the commit: the archive's "." mode (read-only
    here) and mtime are what the target has, and nothing is left beside it."""
    ws = workspace_env[1]
    root = tarfile.TarInfo(".")
    root.type = tarfile.DIRTYPE
    root.mode = 0o555
    root.mtime = 1_000_000_000
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(root)
    archive = out.getvalue()[: tarfile.BLOCKSIZE] + _file("f", b"data") + END

    async def go() -> dict[str, Any]:
        call = workspace_client._aio._conn.start("tree.upload", {"path": f"{ws}/ro"})
        await call.send_input({"data": archive}, 30)
        await call.send_input({"eof": True}, 30)
        return await workspace_client._aio._conn.wait(call, 30)

    assert workspace_client._run(go())["entries"] == 2
    info = os.stat(f"{ws}/ro")
    assert stat.S_IMODE(info.st_mode) == 0o555
    assert info.st_mtime == 1_000_000_000
    assert not [n for n in os.listdir(ws) if n.startswith(".ro.guestd-tree-")]


def _tar(files: dict[str, bytes]) -> bytes:
    return b"".join(_file(name, data) for name, data in files.items()) + END


def test_a_watch_sees_the_target_created_and_nothing_of_the_staging() -> None:
    """A new tree and a replace of it, watched: the target is reported created with its
    content, and no name of the private directory or of ``tree`` inside it ever shows (the
    private directory is one of guestd's temp names, never entered)."""
    with workspace_guestd("guestd-tree-staging-watch-") as (g, ws):

        async def main() -> None:
            c = await AsyncClient.connect(g.address)
            try:
                cursor = (await c.changes()).cursor
                w = c.watch(ws, latency_s=0)
                await w.wait_ready()
                await c.upload_tree(_tar({"a": b"one", "d/b": b"two"}), f"{ws}/t")
                await c.upload_tree(_tar({"c": b"three"}), f"{ws}/t", replace=True)
                await c.call("exec", {"argv": ["touch", f"{ws}/end"]})  # the last change
                seen: list[tuple[str, bytes]] = []
                it = w.__aiter__()
                while b"end" not in [p for _, p in seen]:  # bounded: each wait is
                    change = await asyncio.wait_for(it.__anext__(), 30)
                    seen.append((change.kind, change.path))
                await w.close()
                real = {b"t", b"t/a", b"t/d", b"t/d/b", b"t/c", b"end"}
                assert {p for _, p in seen} <= real, seen
                assert ("created", b"t") in seen, seen
                report = await c.changes(cursor, deadline=15)
                named = set(report.created) | set(report.modified) | set(report.deleted)
                assert named <= {p.decode() for p in real}, report
                assert "t" in report.created, report
            finally:
                await c.close()

        asyncio.run(main())
