"""Client drivers for the file, tree, watch, search, edit, metrics and info transcripts.

Each driver makes guestd's :class:`~guestd.client.AsyncClient` send exactly the transcript's
requests, in its order, with the typed methods. A request the transcript answers with an error
before its last step is awaited through :func:`refused`, which checks the code and goes on; the
last request's outcome (result or typed error) is the driver's.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Awaitable
from pathlib import Path
from typing import Any, cast

from guestd.client import AsyncClient, GuestdError
from guestd.wire.paths import WirePath
from tests.conformance_calls import CallContext, ClientCall

TRANSCRIPTS = Path(__file__).resolve().parents[2] / "protocol" / "conformance" / "transcripts"


async def refused(call: Awaitable[object], code: str) -> GuestdError:
    """The typed error ``call`` must end with (the transcript answers it with ``code``)."""
    try:
        got = await call
    except GuestdError as e:
        if e.code != code:
            raise AssertionError(f"expected a {code} error, got {e.code}: {e}") from e
        return e
    raise AssertionError(f"expected a {code} error, got the result {got!r}")


def uploaded_archive(stem: str, request_id: int) -> bytes:
    """The archive bytes a transcript sends as its tree.upload's input: one data frame."""
    doc: dict[str, Any] = json.loads((TRANSCRIPTS / f"{stem}.json").read_text())
    for step in doc["steps"]:
        for frame in step.get("send", []):
            if frame["kind"] == "input" and frame["id"] == request_id and "data" in frame["body"]:
                return bytes.fromhex(frame["body"]["data"]["$bin"])
    raise LookupError(f"{stem}: no input data for request {request_id}")


# ------------------------------------------------------------------ trees


async def tree_upload_download(c: AsyncClient, ctx: CallContext) -> object:
    t = f"{ctx.tmp}/tree_upload_download"
    await c.upload_tree(uploaded_archive("tree_upload_download", 1), t, replace=True)
    await c.read_file(f"{t}/sub/b.txt")
    await c.read_file(f"{t}/a.txt")
    return await c.download_tree(t)


async def tree_upload_refused(c: AsyncClient, ctx: CallContext) -> object:
    t = f"{ctx.tmp}/tree_upload_refused"
    stem = "tree_upload_refused"
    await c.mkdir(f"{t}/dir")
    await refused(c.upload_tree(uploaded_archive(stem, 2), f"{t}/dir/abs"), "bad_request")
    await refused(c.upload_tree(uploaded_archive(stem, 3), f"{t}/dir/up"), "bad_request")
    await refused(c.upload_tree(uploaded_archive(stem, 4), f"{t}/dir/out"), "bad_request")
    await refused(c.upload_tree(uploaded_archive(stem, 5), f"{t}/dir"), "exists")
    await refused(c.upload_tree(uploaded_archive(stem, 6), f"{t}/dir/missing/t"), "not_found")
    return await c.listdir(f"{t}/dir")


async def tree_download_chunk(c: AsyncClient, ctx: CallContext) -> object:
    t = f"{ctx.tmp}/tree_download_chunk"
    await c.write_file(f"{t}/big.bin", b"a" * 5000, parents=True)
    await c.download_tree(t, chunk=1000)
    await refused(c.download_tree(f"{t}/missing"), "not_found")
    await refused(c.download_tree(f"{t}/big.bin"), "not_a_directory")
    return await c.download_tree(t, chunk=0)


# ------------------------------------------------------------------ watch and the change feed


async def watch_ready_change_cancel(c: AsyncClient, ctx: CallContext) -> object:
    t = f"{ctx.tmp}/watch_ready_change_cancel"
    await c.mkdir(t)
    watch = c.watch(t)
    await watch.wait_ready()
    changes = aiter(watch)
    await c.write_file(f"{t}/a.txt", b"hi")
    await anext(changes)
    await c.mkdir(f"{t}/sub")
    await anext(changes)
    await watch.close()  # the cancel: the watch ends with cancelled, never a response
    return await c.remove(t, recursive=True)


async def watch_errors(c: AsyncClient, ctx: CallContext) -> object:
    t = f"{ctx.tmp}/watch_errors"
    await c.write_file(f"{t}.txt", b"x")
    await refused(c.watch(f"{t}.missing").wait_ready(), "not_found")
    await refused(c.watch(f"{t}.txt").wait_ready(), "not_a_directory")
    await c.watch(ctx.tmp, latency_s=11.0).wait_ready()
    return None


async def watch_changes_cursor(c: AsyncClient, ctx: CallContext) -> object:
    f = f"{ctx.tmp}/watch_changes_cursor.txt"
    start = await c.changes()
    await c.write_file(f, b"x")
    await c.changes(start.cursor)
    await c.remove(f)
    await c.changes(start.cursor)
    # A cursor of the wrong type: no typed method sends one, so the untyped call does.
    return await c.call("file.changes", {"cursor": "1"})


# ------------------------------------------------------------------ search


async def search_glob(c: AsyncClient, ctx: CallContext) -> object:
    t = f"{ctx.tmp}/search_glob"
    files: dict[WirePath, bytes | str] = {
        f"{t}/a.py": b"a\n",
        f"{t}/b.txt": b"b\n",
        f"{t}/src/c.py": b"c\n",
        f"{t}/.hidden.py": b"h\n",
    }
    await c.write_files(files, parents=True)
    await c.glob(t, "*.py")
    await c.glob(t, "/*.py", hidden=False)
    await c.glob(t, "src/")
    await c.glob(t, "*.py", max_results=1)
    await refused(c.glob(t, "[z-a]"), "bad_request")
    return await c.glob(f"{t}/missing", "*")


async def search_grep(c: AsyncClient, ctx: CallContext) -> object:
    t = f"{ctx.tmp}/search_grep"
    await c.write_files({f"{t}/notes.txt": b"alpha\nbeta\ngamma\ndelta\n", f"{t}/.hidden.txt": b"beta\n"}, parents=True)
    await c.grep(t, "beta", context=1)
    await c.grep(t, "^[a-d]", max_matches=2)
    await c.grep(f"{t}/notes.txt", "delta")
    await refused(c.grep(t, "(?=a)"), "bad_request")
    return await c.grep(f"{t}/missing", "x")


# ------------------------------------------------------------------ edit


async def edit_view(c: AsyncClient, ctx: CallContext) -> object:
    t = f"{ctx.tmp}/edit_view"
    files: dict[WirePath, bytes | str] = {
        f"{t}/f.txt": b"alpha\nbeta\ngamma\n",
        f"{t}/sub/g.txt": b"g\n",
        f"{t}/.hidden": b"h\n",
    }
    await c.write_files(files, parents=True)
    await c.view(f"{t}/f.txt")
    await c.view(f"{t}/f.txt", start_line=2, end_line=2)
    await refused(c.view(f"{t}/f.txt", start_line=5), "bad_request")
    await c.view(t)
    return await c.view(f"{t}/missing")


async def edit_str_replace(c: AsyncClient, ctx: CallContext) -> object:
    f = f"{ctx.tmp}/edit_str_replace.txt"
    await c.write_file(f, b"one\ntwo\nthree\ntwo\n")
    await c.str_replace(f, "three", "3")
    await refused(c.str_replace(f, "two", "TWO"), "conflict")
    await refused(c.str_replace(f, "zzz", "y"), "conflict")
    await refused(c.str_replace(f, "", "y"), "bad_request")
    await refused(c.str_replace(f"{ctx.tmp}/edit_str_replace.missing", "a", "b"), "not_found")
    await c.undo(f)
    return await c.read_file(f)


async def edit_insert(c: AsyncClient, ctx: CallContext) -> object:
    f = f"{ctx.tmp}/edit_insert.txt"
    await c.write_file(f, b"one\ntwo")
    await c.insert(f, 0, "zero")
    await c.insert(f, 3, "three\n")
    await refused(c.insert(f, 9, "x"), "bad_request")
    await c.undo(f)
    await c.undo(f)
    return await c.read_file(f)


async def edit_replace_lines(c: AsyncClient, ctx: CallContext) -> object:
    f = f"{ctx.tmp}/edit_replace_lines.txt"
    await c.write_file(f, b"a\nb\nc\nd\ne")
    await c.replace_lines(f, 2, 3, "X")
    await c.replace_lines(f, 3, 4, "Y")
    await c.replace_lines(f, 2, 2, "")
    await c.read_file(f)
    await refused(c.replace_lines(f, 9, 9, "x"), "bad_request")
    await refused(c.replace_lines(f, 2, 1, "x"), "bad_request")
    await refused(c.replace_lines(f, 0, 1, "x"), "bad_request")
    for _ in range(3):
        await c.undo(f)
    return await c.read_file(f)


async def edit_undo(c: AsyncClient, ctx: CallContext) -> object:
    f = f"{ctx.tmp}/edit_undo.txt"
    await c.write_file(f, b"v1\n")
    await refused(c.undo(f), "conflict")
    await c.str_replace(f, "v1", "v2")
    await c.write_file(f, b"v3\n")
    await refused(c.undo(f), "conflict")
    await c.read_file(f)
    await c.write_file(f, b"v2\n")
    await c.undo(f)
    await c.read_file(f)
    return await c.undo(f)


async def edit_apply_patch(c: AsyncClient, ctx: CallContext) -> object:
    t = f"{ctx.tmp}/edit_apply_patch"
    forward = "--- a/a.txt\n+++ b/a.txt\n@@ -1,3 +1,3 @@\n one\n-two\n+TWO\n three\n"
    forward += "--- /dev/null\n+++ b/new.txt\n@@ -0,0 +1 @@\n+fresh\n"
    stale = "--- a/new.txt\n+++ /dev/null\n@@ -1 +0,0 @@\n-fresh\n"
    stale += "--- a/a.txt\n+++ b/a.txt\n@@ -1,3 +1,3 @@\n one\n-two\n+2\n three\n"
    back = "--- a/a.txt\n+++ b/a.txt\n@@ -1,3 +1,3 @@\n one\n-TWO\n+two\n three\n"
    back += "--- a/new.txt\n+++ /dev/null\n@@ -1 +0,0 @@\n-fresh\n"
    await c.write_file(f"{t}/a.txt", b"one\ntwo\nthree\n", parents=True)
    await c.apply_patch(t, forward)
    await c.read_file(f"{t}/a.txt")
    await c.read_file(f"{t}/new.txt")
    await refused(c.apply_patch(t, stale), "conflict")
    await c.read_file(f"{t}/new.txt")
    await refused(c.apply_patch(t, "--- a/a.txt\n+++ b/a.txt\n@@ -x +y @@\n-one\n+1\n"), "bad_request")
    await refused(c.apply_patch(t, "--- a/../a.txt\n+++ b/../a.txt\n@@ -1 +1 @@\n-one\n+1\n"), "bad_request")
    await c.apply_patch(t, back)
    await c.read_file(f"{t}/a.txt")
    return await c.stat(f"{t}/new.txt")


# ------------------------------------------------------------------ files


async def files_write_many(c: AsyncClient, ctx: CallContext) -> object:
    t = f"{ctx.tmp}/files_write_many"
    await c.write_files({f"{t}/a.txt": b"A", f"{t}/sub/b.txt": b"BB"}, parents=True)
    await c.read_file(f"{t}/sub/b.txt")
    await refused(c.write_files({f"{t}/c.txt": b"C", f"{t}/missing/d.txt": b"D"}), "not_found")
    await refused(c.stat(f"{t}/c.txt"), "not_found")
    return await c.write_files({})


async def files_list(c: AsyncClient, ctx: CallContext) -> object:
    t = f"{ctx.tmp}/files_list"
    await c.write_files({f"{t}/b.txt": b"bb", f"{t}/a.txt": b"a"}, parents=True)
    await c.mkdir(f"{t}/sub")
    await c.listdir(t)
    await c.listdir(t, max_entries=2)
    await refused(c.listdir(f"{t}/missing"), "not_found")
    await refused(c.listdir(f"{t}/a.txt"), "not_a_directory")
    return await c.listdir(t, max_entries=2**32 - 1)


async def files_mkdir(c: AsyncClient, ctx: CallContext) -> object:
    t = f"{ctx.tmp}/files_mkdir"
    await c.mkdir(f"{t}/a/b")
    await c.mkdir(f"{t}/a/b")
    await refused(c.mkdir(f"{t}/a/b", parents=False), "exists")
    await refused(c.mkdir(f"{t}/x/y", parents=False), "not_found")
    await c.write_file(f"{t}/f", b"f")
    await refused(c.mkdir(f"{t}/f/g"), "not_a_directory")
    return await c.remove(t, recursive=True)


async def files_remove(c: AsyncClient, ctx: CallContext) -> object:
    t = f"{ctx.tmp}/files_remove"
    await c.write_files({f"{t}/f.txt": b"f", f"{t}/t/a.txt": b"a", f"{t}/t/sub/b.txt": b"b"}, parents=True)
    await c.remove(f"{t}/f.txt")
    await refused(c.remove(f"{t}/t"), "not_empty")
    await c.remove(f"{t}/t", recursive=True)
    return await c.remove(f"{t}/f.txt")


async def files_rename(c: AsyncClient, ctx: CallContext) -> object:
    t = f"{ctx.tmp}/files_rename"
    await c.write_files({f"{t}/a.txt": b"A", f"{t}/b.txt": b"B"}, parents=True)
    await c.rename(f"{t}/a.txt", f"{t}/c.txt")
    await refused(c.stat(f"{t}/a.txt"), "not_found")
    await refused(c.rename(f"{t}/c.txt", f"{t}/b.txt", overwrite=False), "exists")
    await refused(c.rename(f"{t}/missing", f"{t}/x"), "not_found")
    await c.rename(f"{t}/c.txt", f"{t}/b.txt")
    return await c.read_file(f"{t}/b.txt")


async def files_bad_last_component(c: AsyncClient, ctx: CallContext) -> object:
    t = f"{ctx.tmp}/files_bad_last_component"
    await c.mkdir(f"{t}/a")
    await refused(c.mkdir(f"{t}/a/.."), "bad_request")
    await refused(c.write_file(f"{t}/.", b"x"), "bad_request")
    await refused(c.remove(f"{t}/a/.."), "bad_request")
    await refused(c.rename(f"{t}/a/..", f"{t}/b"), "bad_request")
    await refused(c.rename(f"{t}/a", f"{t}/."), "bad_request")
    return await c.listdir(t)


async def files_trailing_slash(c: AsyncClient, ctx: CallContext) -> object:
    t = f"{ctx.tmp}/files_trailing_slash"
    await c.mkdir(f"{t}/d/")
    await c.write_file(f"{t}/new/", b"x")
    await refused(c.stat(f"{t}/new/"), "not_a_directory")
    assert (await c.stat(f"{t}/d/")).type == "dir"
    await c.rename(f"{t}/new/", f"{t}/n2")
    assert await c.remove(f"{t}/d/") == 1
    return await c.listdir(t)


# ------------------------------------------------------------------ metrics and info


async def metrics_once(c: AsyncClient, ctx: CallContext) -> object:
    await c.metrics(interval_ms=0)
    await c.metrics()
    await refused(c.metrics(interval_ms=60001), "bad_request")
    return [sample async for sample in c.watch_metrics(count=0)]


async def metrics_stream(c: AsyncClient, ctx: CallContext) -> object:
    [sample async for sample in c.watch_metrics(interval_ms=100, count=2)]
    # watch_metrics is an async generator: closing it after one sample cancels the stream.
    samples = cast(AsyncGenerator[object, None], c.watch_metrics(interval_ms=1000))
    try:
        await anext(samples)
    finally:
        await samples.aclose()
    return [sample async for sample in c.watch_metrics(interval_ms=50)]


async def info(c: AsyncClient, ctx: CallContext) -> object:
    return await c.info()


CALLS: dict[str, ClientCall] = {
    "tree_upload_download": tree_upload_download,
    "tree_upload_refused": tree_upload_refused,
    "tree_download_chunk": tree_download_chunk,
    "watch_ready_change_cancel": watch_ready_change_cancel,
    "watch_errors": watch_errors,
    "watch_changes_cursor": watch_changes_cursor,
    "search_glob": search_glob,
    "search_grep": search_grep,
    "edit_view": edit_view,
    "edit_str_replace": edit_str_replace,
    "edit_insert": edit_insert,
    "edit_replace_lines": edit_replace_lines,
    "edit_undo": edit_undo,
    "edit_apply_patch": edit_apply_patch,
    "files_write_many": files_write_many,
    "files_list": files_list,
    "files_mkdir": files_mkdir,
    "files_remove": files_remove,
    "files_rename": files_rename,
    "files_bad_last_component": files_bad_last_component,
    "files_trailing_slash": files_trailing_slash,
    "metrics_once": metrics_once,
    "metrics_stream": metrics_stream,
    "info": info,
}
