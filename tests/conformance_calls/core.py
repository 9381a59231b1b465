"""Drivers for the core transcripts: handshake, exec, files, processes, port relays.

Each makes guestd's AsyncClient produce the client frames of its transcript (the
transcript's ``client_call``, as this client spells it)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from guestd.client import AsyncClient, GuestdError
from tests.conformance_calls import CallContext, ClientCall

TRANSCRIPTS = Path(__file__).resolve().parents[2] / "protocol" / "conformance" / "transcripts"


def transcript_args(stem: str, op: str) -> dict[str, Any]:
    """The args of the first ``op`` request in a transcript (long literals are kept there once)."""
    doc = json.loads((TRANSCRIPTS / f"{stem}.json").read_text())
    for step in doc["steps"]:
        for frame in step.get("send", []):
            if frame["kind"] == "request" and frame["body"].get("op") == op:
                args: dict[str, Any] = frame["body"]["args"]
                return args
    raise KeyError(f"{stem} has no {op} request")


async def expect_error(code: str, call: Any) -> None:
    """Await ``call``, which must raise guestd's typed error ``code`` (a step before the final one)."""
    try:
        await call
    except GuestdError as e:
        if e.code != code:
            raise
        return
    raise AssertionError(f"expected error {code}")


async def ping(client: AsyncClient, ctx: CallContext) -> object:
    return await client.ping()


async def exec_capture(client: AsyncClient, ctx: CallContext) -> object:
    first = await client.exec("echo hi; exit 3")
    second = await client.exec("cat; echo err >&2", stdin=b"abc")
    return first, second


async def exec_not_found(client: AsyncClient, ctx: CallContext) -> object:
    await expect_error("not_found", client.exec(["/nonexistent/program"]))
    return await client.exec(["true"], cwd=f"{ctx.tmp}/missing")


async def exec_signal(client: AsyncClient, ctx: CallContext) -> object:
    stream = client.exec_stream("echo ready; sleep 30")
    async for _, data in stream:
        if b"ready" in data:
            await stream.signal("TERM")
            break
    return await stream.result()


async def exec_signal_same_write(client: AsyncClient, ctx: CallContext) -> object:
    stream = client.exec_stream(["sleep", "30"])
    await stream.signal("TERM")
    return await stream.result()


async def exec_cancel_same_write(client: AsyncClient, ctx: CallContext) -> object:
    running = asyncio.create_task(client.exec(["sleep", "30"]))
    await asyncio.sleep(0)  # the request is sent
    running.cancel()  # the client sends cancel and forgets the request
    try:
        await running
    except asyncio.CancelledError:
        pass
    return await client.ping()


async def exec_stdin_stream(client: AsyncClient, ctx: CallContext) -> object:
    stream = client.exec_stream(["cat"], stdin_stream=True)
    await stream.write_stdin(b"abc")
    await stream.write_stdin(b"def")
    await stream.close_stdin()
    return await stream.result()


async def exec_stream_credit(client: AsyncClient, ctx: CallContext) -> object:
    stream = client.exec_stream(["head", "-c", "300000", "/dev/zero"])
    received = 0
    async for _, data in stream:
        received += len(data)
    assert received == 300000
    return await stream.result()


async def files_write_read_stat(client: AsyncClient, ctx: CallContext) -> object:
    path = f"{ctx.tmp}/files_write_read_stat.txt"
    await client.write_file(path, b"hello")
    whole, part = await client.read_file(path), await client.read_file(path, offset=1, length=3)
    assert (whole, part) == (b"hello", b"ell")
    await client.stat(path)
    return await client.stat(f"{ctx.tmp}/files_write_read_stat.missing")


async def upload_download(client: AsyncClient, ctx: CallContext) -> object:
    path = f"{ctx.tmp}/upload_download.bin"
    await client.upload(b"hello world", path)
    data = await client.download(path)
    assert data == b"hello world"
    return data


async def download_small_frames(client: AsyncClient, ctx: CallContext) -> object:
    path = f"{ctx.tmp}/download_small_frames.bin"
    content = bytes.fromhex("00010203") * 50000
    await client.write_file(path, content)
    data = await client.download(path)
    assert data == content
    return len(data)


async def upload_size_mismatch(client: AsyncClient, ctx: CallContext) -> object:
    # guestd's upload() declares the size of what it sends; a declared size that is not met
    # needs the request's own frames (the call object under upload()).
    path = f"{ctx.tmp}/upload_size_mismatch.txt"
    await client.write_file(path, b"old")
    short = client._conn.start("file.upload", {"path": path, "size": 5})
    await short.send_input({"data": b"abc", "eof": True})
    await expect_error("bad_request", client._conn.wait(short, 10.0))
    long = client._conn.start("file.upload", {"path": path, "size": 2})
    await long.send_input({"data": b"abc"})
    await expect_error("bad_request", client._conn.wait(long, 10.0))
    return await client.read_file(path)


async def process_attach(client: AsyncClient, ctx: CallContext) -> object:
    proc = await client.process_start("printf out")
    await client.process_wait(proc.id, timeout_s=10)
    whole = client.attach(proc.id, follow=False)
    tail = client.attach(proc.id, stdout_from=1, follow=False)
    assert [item async for item in whole] == [("stdout", 0, b"out")]
    assert [item async for item in tail] == [("stdout", 1, b"ut")]
    assert (await whole.result()).stdout_offset == 3 and (await tail.result()).stdout_offset == 3
    await client.process_forget(proc.id)
    return await client.process_wait(proc.id)


async def port_relay(client: AsyncClient, ctx: CallContext) -> object:
    echo = await client.process_start(transcript_args("port_relay", "process.start")["argv"])
    assert (await client.port_wait(18765, timeout_s=10.0)).ready
    reader, writer = await client.open_port(18765)
    writer.write(b"hello relay")
    writer.write_eof()
    echoed = await reader.read()
    assert echoed == b"hello relay"
    writer.close()
    await writer.wait_closed()  # the relay's final frame: the request has ended
    await client.process_signal(echo.id, "KILL")
    return echoed


async def port_errors(client: AsyncClient, ctx: CallContext) -> object:
    await expect_error("unavailable", client.open_port(1))
    await expect_error("bad_request", client.open_port(80, address="localhost"))
    return await client.reverse_forward(0, ("127.0.0.1", 9))


async def unknown_op(client: AsyncClient, ctx: CallContext) -> object:
    await expect_error("unknown_op", client.call("no.such.op", {}))
    return await client.ping()


async def connect_then_ping(client: AsyncClient, ctx: CallContext) -> object:
    """The handshake transcripts: the client connects with the transcript's hello options."""
    return await client.ping()


async def connect_only(client: AsyncClient, ctx: CallContext) -> object:
    """unsupported_version: connecting raises; the call never runs."""
    return None


CALLS: dict[str, ClientCall] = {
    "ping": ping,
    "exec_capture": exec_capture,
    "exec_not_found": exec_not_found,
    "exec_signal": exec_signal,
    "exec_signal_same_write": exec_signal_same_write,
    "exec_cancel_same_write": exec_cancel_same_write,
    "exec_stdin_stream": exec_stdin_stream,
    "exec_stream_credit": exec_stream_credit,
    "files_write_read_stat": files_write_read_stat,
    "upload_download": upload_download,
    "download_small_frames": download_small_frames,
    "upload_size_mismatch": upload_size_mismatch,
    "process_attach": process_attach,
    "port_relay": port_relay,
    "port_errors": port_errors,
    "unknown_op": unknown_op,
    "handshake_floor": connect_then_ping,
    "handshake_negotiated": connect_then_ping,
    "handshake_defaults": connect_then_ping,
    "unsupported_version": connect_only,
}
