"""Client drivers for the transcripts of issue 32's rules and mismatches that a real client
produces (the others start their client_call with "(a server test)": a correct client never
sends nil for a field without '?', integers for signals, float32, bytes that are not UTF-8,
malformed windows or hellos, or a duplicate id).

Each driver makes guestd's :class:`~guestd.client.AsyncClient` send exactly the transcript's
requests, in its order; the last call's outcome (result or typed error) is the driver's.
"""

from __future__ import annotations

from guestd.client import AsyncClient
from tests.conformance_calls import CallContext, ClientCall


async def tree_download_chunk_within_max_frame(c: AsyncClient, ctx: CallContext) -> object:
    """The client's download_tree has no chunk argument: the request is started on the
    connection, and its events read as download_tree reads them (credit granted as consumed)."""
    t = f"{ctx.tmp}/tree_download_chunk_within_max_frame"
    await c.write_file(f"{t}/big.bin", b"a" * 200000, parents=True)
    call = c._conn.start("tree.download", {"path": t, "chunk": 30000})
    while await call.next_event(30.0) is not None:
        pass  # the server mode checks every event's size; here the client only consumes them
    return await c._conn.wait(call, 30.0)


async def watch_no_temp_names(c: AsyncClient, ctx: CallContext) -> object:
    d = f"{ctx.tmp}/watch_no_temp_names"
    await c.mkdir(d)
    watch = c.watch(d, latency_s=0.0)
    await watch.wait_ready()
    changes = aiter(watch)
    seen = []  # one change per write: a temp name would come in place of one
    await c.write_file(f"{d}/a.txt", b"one")
    seen.append(await anext(changes))
    await c.write_file(f"{d}/a.txt", b"two, over it")
    seen.append(await anext(changes))
    await c.upload(b"three", f"{d}/a.txt")
    seen.append(await anext(changes))
    await c.write_files({f"{d}/a.txt": b"four four"})
    seen.append(await anext(changes))
    await c.str_replace(f"{d}/a.txt", "four four", "five")
    seen.append(await anext(changes))
    await watch.close()  # the cancel: a watch never answers, it ends with cancelled
    return await c.remove(d, recursive=True)


async def events_only_with_stream(c: AsyncClient, ctx: CallContext) -> object:
    await c.exec(["echo", "hi"])
    # call(): the fake server's sample is a placeholder map, which metrics() would refuse
    await c.call("metrics", {"interval_ms": 0})
    session = (await c.shell_create()).id
    await c.shell_run(session, "echo hi")
    await c.shell_close(session)
    return None


async def max_frame_each_direction(c: AsyncClient, ctx: CallContext) -> object:
    """Connected with max_frame 65536: a 100000-byte request is within the server's
    limits.max_frame; the 100000-byte reply is not within the client's, so it is too_large."""
    path = f"{ctx.tmp}/max_frame_each_direction.bin"
    await c.write_file(path, b"a" * 100000)
    return await c.read_file(path)


CALLS: dict[str, ClientCall] = {
    "tree_download_chunk_within_max_frame": tree_download_chunk_within_max_frame,
    "watch_no_temp_names": watch_no_temp_names,
    "events_only_with_stream": events_only_with_stream,
    "max_frame_each_direction": max_frame_each_direction,
}
