"""Issue 30, item 6: the change lists (``file.changes``, a ``file.watch``, exec's ``report_changes``)
name only paths the workload could have seen. guestd's own writes go through temp names (an
O_TMPFILE inode that the kernel names ``#<inode>``, named temp links beside the target, a patch's
staged files, an edit's undo copy); none of them may appear, for any op that writes.

The ops are sent with :meth:`AsyncClient.call` (the wire, not the SDK's result types) so this
test pins the daemon's behaviour only.
"""

from __future__ import annotations

import asyncio
import ctypes
import io
import tarfile

from guestd.client import AsyncClient
from guestd.testing.local import workspace_guestd

PATCH = b"""--- a/p.txt
+++ b/p.txt
@@ -1,2 +1,2 @@
 one
-two
+TWO
"""


def _tar_of(name: str, data: bytes) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_every_write_op_reports_only_real_paths() -> None:
    """write (create and overwrite), str_replace, insert, replace_lines, undo, apply_patch,
    upload and a tree upload, then one file the workload writes as the end marker: the journal
    and a watch list exactly the files the ops made or changed."""
    with workspace_guestd("guestd-realpaths-") as (g, ws):

        async def main() -> None:
            c = await AsyncClient.connect(g.address)
            try:
                cursor = (await c.changes()).cursor
                w = c.watch(ws, latency_s=0)
                await w.wait_ready()
                await c.call("file.write", {"path": f"{ws}/e.txt", "data": b"alpha\nbeta\n"})
                await c.call("file.write", {"path": f"{ws}/e.txt", "data": b"alpha\nbeta\ngamma\n"})
                await c.call("file.str_replace", {"path": f"{ws}/e.txt", "old": "beta", "new": "BETA"})
                await c.call("file.insert", {"path": f"{ws}/e.txt", "line": 0, "text": "top"})
                await c.call(
                    "file.replace_lines", {"path": f"{ws}/e.txt", "start_line": 1, "end_line": 1, "text": "TOP"}
                )
                await c.call("file.undo", {"path": f"{ws}/e.txt"})
                await c.call("file.write", {"path": f"{ws}/p.txt", "data": b"one\ntwo\n"})
                await c.call("file.apply_patch", {"path": ws, "patch": PATCH, "strip": 1})
                await c.upload(b"uploaded bytes\n", f"{ws}/u.bin")
                await c.upload_tree(_tar_of("inner.txt", b"in a tree\n"), f"{ws}/t")
                await c.call("exec", {"argv": ["touch", f"{ws}/end"]})  # the workload's write: the last change
                seen: set[bytes] = set()
                it = w.__aiter__()
                while b"end" not in seen:  # bounded: each wait is
                    seen.add((await asyncio.wait_for(it.__anext__(), 30)).path)
                real = {b"e.txt", b"p.txt", b"u.bin", b"t", b"t/inner.txt", b"end"}
                assert seen <= real, seen - real
                report = await c.changes(cursor, deadline=15)
                named = set(report.created) | set(report.modified) | set(report.deleted)
                assert named <= {p.decode() for p in real}, report
                assert {"e.txt", "p.txt", "u.bin", "end"} <= named, report
                await w.close()
            finally:
                await c.close()

        asyncio.run(main())


def test_an_exchange_of_two_files_is_two_modifications() -> None:
    """renameat2(RENAME_EXCHANGE) is a move in and a move out of each name (file.apply_patch
    commits that way). Before: the second half read as "deleted", so a patched file was
    reported deleted by a watch and vanished from the journal (created then deleted)."""
    libc = ctypes.CDLL(None, use_errno=True)
    with workspace_guestd("guestd-exchange-") as (g, ws):
        for name in ("a", "b"):
            with open(f"{ws}/{name}", "w") as f:
                f.write(name)

        async def main() -> None:
            c = await AsyncClient.connect(g.address)
            try:
                cursor = (await c.changes()).cursor
                w = c.watch(ws, latency_s=0)
                await w.wait_ready()
                assert libc.renameat2(-100, f"{ws}/a".encode(), -100, f"{ws}/b".encode(), 2) == 0
                with open(f"{ws}/end", "w"):
                    pass
                seen: list[tuple[str, bytes]] = []
                it = w.__aiter__()
                while not seen or seen[-1][1] != b"end":  # bounded: each wait is
                    ch = await asyncio.wait_for(it.__anext__(), 30)
                    seen.append((ch.kind, ch.path))
                assert ("deleted", b"a") not in seen and ("deleted", b"b") not in seen, seen
                report = await c.changes(cursor, deadline=15)
                assert (report.modified, report.deleted) == (["a", "b"], []), report
                await w.close()
            finally:
                await c.close()

        asyncio.run(main())
