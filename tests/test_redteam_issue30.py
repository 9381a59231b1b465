"""Red team of the issue-30 changes, as the hostile workload: code running as the workload user
inside the sandbox, planting files and FIFOs where guestd looks.

info.kernels (guestd.code.python.kernels_info) runs inline on guestd's event loop and reads each
kernelspec's kernel.json in JUPYTER_PATH and jupyter's system directories. A directory there that
the workload can write (a JUPYTER_PATH pointing into the workload's own tree, as a development
guestd inherits it) let the workload plant a FIFO as kernel.json: open() waited for a writer for
ever, on the loop, so that info, and every request after it (ping included), never answered.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from guestd.client import Client
from guestd.testing.local import NOBODY, Guestd, start_guestd


@pytest.fixture
def guestd_with_a_workload_jupyter_path() -> Iterator[tuple[Guestd, str]]:
    """(guestd, a JUPYTER_PATH directory in its environment that the workload user owns)."""
    top = tempfile.mkdtemp(prefix="guestd-rt30-")
    os.chmod(top, 0o755)
    jupyter = f"{top}/jupyter"
    os.makedirs(f"{jupyter}/kernels/honest")
    with open(f"{jupyter}/kernels/honest/kernel.json", "w") as f:
        f.write('{"argv": ["/opt/honest/bin/kernel", "{connection_file}"], "display_name": "h", "language": "x"}')
    ws = f"{top}/ws"
    os.makedirs(ws)
    config = f'workspace = "{ws}"\n'
    if os.geteuid() == 0:
        for d in (ws, f"{jupyter}/kernels"):
            os.chown(d, NOBODY, NOBODY)
        config += '[policy]\nworkload_user = "nobody"\n'
    with open(f"{top}/guestd.toml", "w") as f:
        f.write(config)
    g = start_guestd(top, "--config", f"{top}/guestd.toml", "--runtime-dir", f"{top}/rt", env={"JUPYTER_PATH": jupyter})
    try:
        yield g, jupyter
    finally:
        # Before the fix guestd sits in open() on the FIFO: a writer lets that open return.
        fifo = f"{jupyter}/kernels/evil/kernel.json"
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        g.stop()
        shutil.rmtree(top, ignore_errors=True)


def test_a_fifo_kernelspec_the_workload_plants_never_blocks_info(
    guestd_with_a_workload_jupyter_path: tuple[Guestd, str],
) -> None:
    g, jupyter = guestd_with_a_workload_jupyter_path
    with Client(g.address) as c:
        # The workload (as the workload user, through exec) plants a kernelspec whose kernel.json is
        # a FIFO nobody writes, and one that is a symlink to a FIFO.
        planted = c.exec(
            [
                "sh",
                "-c",
                f"mkdir {jupyter}/kernels/evil {jupyter}/kernels/evil2 && mkfifo {jupyter}/kernels/evil/kernel.json"
                f" && ln -s {jupyter}/kernels/evil/kernel.json {jupyter}/kernels/evil2/kernel.json",
            ],
            timeout_s=30,
        )
        assert planted.exit_code == 0, planted
        # Before: the client's deadline ran out (guestd's loop blocked in open() for ever).
        kernels = c.info(deadline=30).raw["kernels"]
        names = [k["name"] for k in kernels]
        assert "evil" not in names and "evil2" not in names
        honest = next(k for k in kernels if k["name"] == "honest")
        assert honest["python"] == "/opt/honest/bin/kernel"
        c.ping()


# --------------------------------------------------------------------------- the change feed
# renameat2(RENAME_EXCHANGE) is unprivileged: the workload swaps two names whenever it likes. The
# kernel reports it as two moves (MOVED_FROM a, MOVED_TO b, MOVED_FROM b, MOVED_TO a). With a
# directory on either side the watcher took the second half for the directory it had just moved
# in: it dropped the watches of the directory that was displaced (a directory swapped with a
# directory: what then happened in it was never reported, a real deletion included), reported a
# name that still exists as deleted, or left a directory that is still in the tree in limbo.

RENAME_EXCHANGE = 2


def _exchange(a: str, b: str) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.renameat2(-100, a.encode(), -100, b.encode(), RENAME_EXCHANGE) != 0:
        raise OSError(ctypes.get_errno(), "renameat2")


def _plant(ws: str) -> None:
    for d, inner in (("dd_a", "x"), ("dd_b", "y"), ("fd_d", "z"), ("df_d", "w")):
        os.makedirs(f"{ws}/{d}")
        with open(f"{ws}/{d}/{inner}", "w") as f:
            f.write(inner)
    for name in ("fd_f", "df_f"):
        with open(f"{ws}/{name}", "w") as f:
            f.write(name)
    if os.geteuid() == 0:
        for root, dirs, files in os.walk(ws):
            for n in dirs + files:
                os.chown(os.path.join(root, n), NOBODY, NOBODY)


def test_exchanges_with_directories_hide_no_change_and_delete_nothing_that_exists() -> None:
    import asyncio

    from guestd.client import AsyncClient
    from guestd.testing.local import workspace_guestd

    with workspace_guestd("guestd-rt30-xchg-", prepare=lambda _top, ws: _plant(ws)) as (g, ws):

        async def main() -> None:
            c = await AsyncClient.connect(g.address)
            try:
                cursor = (await c.changes()).cursor
                w = c.watch(ws, latency_s=0)
                await w.wait_ready()
                _exchange(f"{ws}/dd_a", f"{ws}/dd_b")  # a directory with a directory
                _exchange(f"{ws}/fd_f", f"{ws}/fd_d")  # a file onto a directory's name
                _exchange(f"{ws}/df_d", f"{ws}/df_f")  # a directory onto a file's name
                # Now dd_b holds x, dd_a holds y, fd_f holds z, df_f holds w; fd_d and df_d are files.
                # Each settles before the workload changes what is inside.
                cursor2 = (await c.changes(cursor, deadline=15)).cursor
                done = await c.exec(
                    f"rm {ws}/dd_b/x {ws}/fd_f/z {ws}/df_f/w && touch {ws}/dd_a/new {ws}/df_f/new && touch {ws}/end",
                    timeout_s=30,
                )
                assert done.exit_code == 0, done
                seen: list[tuple[str, bytes]] = []
                it = w.__aiter__()
                while not seen or seen[-1][1] != b"end":  # bounded: each wait is
                    ch = await asyncio.wait_for(it.__anext__(), 30)
                    seen.append((ch.kind, ch.path))
                exists = {b"dd_a", b"dd_b", b"fd_f", b"fd_d", b"df_f", b"df_d"}
                assert not [p for kind, p in seen if kind == "deleted" and p in exists], seen
                for gone in (b"dd_b/x", b"fd_f/z", b"df_f/w"):
                    assert ("deleted", gone) in seen, (gone, seen)
                for made in (b"dd_a/new", b"df_f/new"):
                    assert ("created", made) in seen, (made, seen)
                report = await c.changes(cursor2, deadline=15)
                assert {"dd_b/x", "fd_f/z", "df_f/w"} <= set(report.deleted), report
                assert {"dd_a/new", "df_f/new"} <= set(report.created), report
                whole = await c.changes(cursor, deadline=15)
                assert not set(whole.deleted) & {p.decode() for p in exists}, whole
                await w.close()
            finally:
                await c.close()

        asyncio.run(main())


def test_a_directory_moved_over_an_empty_one_and_on_is_still_followed() -> None:
    """The plain rename(2) that looks like an exchange's first half: a directory replaces an
    empty one (which is dropped), then moves on; what happens in it is still reported."""
    import asyncio

    from guestd.client import AsyncClient
    from guestd.testing.local import workspace_guestd

    def plant(_top: str, ws: str) -> None:
        os.makedirs(f"{ws}/m")
        os.makedirs(f"{ws}/empty")
        with open(f"{ws}/m/q", "w") as f:
            f.write("q")
        if os.geteuid() == 0:
            for p in (f"{ws}/m", f"{ws}/empty", f"{ws}/m/q"):
                os.chown(p, NOBODY, NOBODY)

    with workspace_guestd("guestd-rt30-over-", prepare=plant) as (g, ws):

        async def main() -> None:
            c = await AsyncClient.connect(g.address)
            try:
                w = c.watch(ws, latency_s=0)
                await w.wait_ready()
                done = await c.exec(
                    f"mv -T {ws}/m {ws}/empty && mv {ws}/empty {ws}/k && rm {ws}/k/q && touch {ws}/k/new {ws}/end",
                    timeout_s=30,
                )
                assert done.exit_code == 0, done
                seen: list[tuple[str, bytes]] = []
                it = w.__aiter__()
                while not seen or seen[-1][1] != b"end":  # bounded: each wait is
                    ch = await asyncio.wait_for(it.__anext__(), 30)
                    seen.append((ch.kind, ch.path))
                assert ("deleted", b"k/q") in seen and ("created", b"k/new") in seen, seen
                assert ("deleted", b"empty") in seen and ("deleted", b"m") in seen, seen
                await w.close()
            finally:
                await c.close()

        asyncio.run(main())


# --------------------------------------------------------------------------- unix listen paths


def test_a_datagram_socket_at_the_listen_path_is_probed_as_one() -> None:
    """A stale datagram socket at the path (a workload may leave one where it can write) is
    replaced like a stale stream socket; a live one is refused like a live server. Before, the
    stream probe's EPROTOTYPE ended guestd's start: 'cannot serve: Protocol wrong type'."""
    import socket
    import subprocess
    import sys

    from guestd.testing.local import REPO

    with tempfile.TemporaryDirectory(prefix="guestd-rt30-dgram-") as d:
        path = f"{d}/g.sock"
        live = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        live.bind(path)
        try:
            refused = subprocess.run(
                [sys.executable, "-m", "guestd", "--listen", f"unix:{path}", "--runtime-dir", f"{d}/rt"],
                capture_output=True,
                text=True,
                timeout=60,
                cwd=d,
                env={**os.environ, "PYTHONPATH": REPO},
            )
        finally:
            live.close()  # now stale: the file stays, nobody has it open
        assert refused.returncode == 1 and "served by a live process" in refused.stderr, refused.stderr[-500:]
        g = start_guestd(d, "--runtime-dir", f"{d}/rt", listen=[f"unix:{path}"], ready_timeout_s=60)
        try:
            with Client(f"unix:{path}") as c:
                c.ping()
        finally:
            g.stop()
