"""stdin of any size and blocking output callbacks (issue 30): exec/shell_run take bytes, str,
a binary file or an (async) iterator as stdin, streamed under credit past the old one-frame
limit; Client.exec/shell_run/code_run call on_stdout/on_stderr (on_result for code) in the
caller's thread while the result still holds the output."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from guestd.client import AsyncClient, Client
from guestd.client.streaming import INLINE_STDIN_MAX
from guestd.testing import Guestd, live_procs_with

MiB = 1024 * 1024


def pattern_chunks(total: int, chunk: int = MiB) -> Iterator[bytes]:
    """``total`` bytes that are not all alike (a dropped or repeated chunk changes the sum)."""
    for i in range(0, total, chunk):
        block = hashlib.sha256(str(i).encode()).digest() * (chunk // 32 + 1)
        yield block[: min(chunk, total - i)]


def local_sum(total: int) -> str:
    h = hashlib.sha256()
    for c in pattern_chunks(total):
        h.update(c)
    return h.hexdigest()


def guest_sum(r: object) -> str:
    stdout = getattr(r, "stdout")  # noqa: B009 - ExecResult or ShellResult
    assert isinstance(stdout, bytes)
    return stdout.split()[0].decode()


def test_64_mib_from_an_iterator_through_sha256sum(client: Client) -> None:
    total = 64 * MiB
    r = client.exec(["sha256sum"], stdin=pattern_chunks(total), timeout_s=120)
    assert r.exit_code == 0, r.stderr
    assert guest_sum(r) == local_sum(total)


def test_a_binary_file_as_stdin(client: Client, tmp_path: Path) -> None:
    total = 12 * MiB + 7
    path = tmp_path / "in.bin"
    with open(path, "wb") as f:
        for c in pattern_chunks(total):
            f.write(c)
    with open(path, "rb") as f:
        r = client.exec(["sha256sum"], stdin=f, timeout_s=60)
    assert guest_sum(r) == local_sum(total)


def test_bytes_over_one_frame_are_streamed_not_too_large(client: Client) -> None:
    """Before: stdin went in the request frame, and 5 MiB failed too_large."""
    data = b"x" * (5 * MiB)
    r = client.exec(["wc", "-c"], stdin=data)
    assert r.exit_code == 0 and r.stdout.strip() == str(len(data)).encode()


def test_a_str_is_sent_as_utf8(client: Client) -> None:
    r = client.exec(["cat"], stdin="héllo, wörld\n")
    assert r.stdout == "héllo, wörld\n".encode()
    big = "é" * (INLINE_STDIN_MAX)  # two bytes each: streamed
    assert client.exec(["wc", "-c"], stdin=big).stdout.strip() == str(2 * len(big)).encode()


def test_shell_run_input_from_an_iterator(client: Client) -> None:
    total = 9 * MiB
    sid = client.shell_create().id
    try:
        r = client.shell_run(sid, "sha256sum", input=pattern_chunks(total), timeout_s=60)
        assert r.exit_code == 0 and guest_sum(r) == local_sum(total)
        assert client.shell_run(sid, "echo still here").stdout == b"still here\n"
    finally:
        client.shell_close(sid)


def test_an_async_iterator_in_the_async_client(guestd: Guestd) -> None:
    total = 8 * MiB

    async def chunks() -> AsyncIterator[bytes]:
        for c in pattern_chunks(total):
            await asyncio.sleep(0)
            yield c

    async def main() -> str:
        async with AsyncClient.connect(guestd.address) as c:
            return guest_sum(await c.exec(["sha256sum"], stdin=chunks(), timeout_s=60))

    assert asyncio.run(main()) == local_sum(total)


def test_a_command_that_stops_reading_is_not_an_error(client: Client) -> None:
    r = client.exec(["head", "-c", "10"], stdin=pattern_chunks(32 * MiB), timeout_s=60)
    assert r.exit_code == 0 and len(r.stdout) == 10


def test_a_failing_stdin_source_raises_and_ends_the_command(client: Client) -> None:
    token = f"60.{uuid.uuid4().int % 10**9:09d}"

    def source() -> Iterator[bytes]:
        yield b"first\n"
        for _ in range(600):  # until the command runs (bounded)
            if live_procs_with(f"sleep {token}"):
                break
            threading.Event().wait(0.05)
        raise ValueError("the source broke")

    with pytest.raises(ValueError, match="the source broke"):
        client.exec(["sh", "-c", f"sleep {token}"], stdin=source())
    for _ in range(600):
        if not live_procs_with(token):
            break
        threading.Event().wait(0.05)
    assert not live_procs_with(token)
    assert client.exec(["true"]).exit_code == 0


def test_exec_callbacks_run_in_the_callers_thread_and_the_result_keeps_the_output(client: Client) -> None:
    seen: list[tuple[str, bytes, int]] = []
    script = "for i in 1 2 3; do echo out$i; echo err$i >&2; done"
    r = client.exec(
        ["sh", "-c", script],
        on_stdout=lambda b: seen.append(("out", b, threading.get_ident())),
        on_stderr=lambda b: seen.append(("err", b, threading.get_ident())),
    )
    assert r.exit_code == 0
    assert b"".join(b for k, b, _ in seen if k == "out") == b"out1\nout2\nout3\n"
    assert b"".join(b for k, b, _ in seen if k == "err") == b"err1\nerr2\nerr3\n"
    assert {t for _, _, t in seen} == {threading.get_ident()}
    assert r.stdout == b"out1\nout2\nout3\n" and r.stderr == b"err1\nerr2\nerr3\n"
    assert r.stdout_bytes == 15 and r.stdout_dropped == 0


def test_exec_callbacks_with_max_output_keep_the_tail_and_count_exactly(client: Client) -> None:
    got = bytearray()
    r = client.exec(["sh", "-c", "seq 1 20000"], max_output=100, on_stdout=got.extend)
    expected = "".join(f"{i}\n" for i in range(1, 20001)).encode()
    assert bytes(got) == expected
    assert r.stdout == expected[-100:] and r.stdout_bytes == len(expected)
    assert r.stdout_dropped == len(expected) - 100


def test_a_callback_that_raises_cancels_the_command(client: Client) -> None:
    token = f"60.{uuid.uuid4().int % 10**9:09d}"

    def boom(_: bytes) -> None:
        raise RuntimeError("callback failed")

    with pytest.raises(RuntimeError, match="callback failed"):
        client.exec(["sh", "-c", f"echo go; sleep {token}"], on_stdout=boom)
    for _ in range(600):
        if not live_procs_with(token):
            break
        threading.Event().wait(0.05)
    assert not live_procs_with(token)
    assert client.exec(["echo", "ok"]).stdout == b"ok\n"


def test_shell_run_callbacks(client: Client) -> None:
    sid = client.shell_create().id
    try:
        out: list[bytes] = []
        r = client.shell_run(sid, "echo one; echo two", on_stdout=out.append)
        assert b"".join(out) == b"one\ntwo\n" and r.stdout == b"one\ntwo\n" and r.exit_code == 0
    finally:
        client.shell_close(sid)


def test_code_run_callbacks(client: Client) -> None:
    out: list[bytes] = []
    results: list[dict[str, object]] = []
    errors: list[dict[str, object]] = []
    threads: set[int] = set()

    def on_stdout(b: bytes) -> None:
        threads.add(threading.get_ident())
        out.append(b)

    r = client.code_run("print('hi'); 6 * 7", on_stdout=on_stdout, on_result=results.append, deadline=300)
    assert b"".join(out) == b"hi\n" and r.stdout == b"hi\n"
    assert results == [{"kind": "result", "data": {"text/plain": "42"}}] and r.text == "42"
    assert threads == {threading.get_ident()}
    r = client.code_run("1 / 0", on_error=errors.append)
    assert not r.ok and errors and errors[0]["ename"] == "ZeroDivisionError"
