"""exec_stream / shell_stream take the options exec / shell_run take (issue 30): a stdin source
of any kind, merge_stderr, on_timeout, check_syntax, a capture (max_output, head_tail) kept for
the result, spill with live=False; ``deadline=None`` waits for ever (guestctl passes it when
no --timeout is given); the client's default_timeout_s applies to shell runs too."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any, TypeVar

import pytest

from guestd.cli.exec import start_exec
from guestd.cli.shells import start_shell_run
from guestd.client import DERIVED, Client
from guestd.client.aio import UNBOUNDED_RUN_DEADLINE, ExecStream
from guestd.testing import Guestd
from guestd.wire.errors import GuestdError

T = TypeVar("T")


def on_loop(client: Client, coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on the blocking client's loop (the async client lives there)."""
    return asyncio.run_coroutine_threadsafe(coro, client._loop).result(120)


async def collect(stream: ExecStream) -> tuple[bytes, bytes]:
    out = {"stdout": bytearray(), "stderr": bytearray()}
    async for name, data in stream:
        out[name] += data
    return bytes(out["stdout"]), bytes(out["stderr"])


def test_exec_stream_takes_stdin_from_any_source(client: Client) -> None:
    big = bytes(range(256)) * 4096  # 1 MiB: above the inline limit, streamed under credit

    def pieces() -> Iterator[bytes]:
        yield b"from "
        yield b"an iterator\n"

    async def apieces() -> AsyncIterator[bytes]:
        yield b"from an async iterator\n"

    async def main() -> None:
        c = client.aio
        for source, expected in (
            ("a str\n", b"a str\n"),
            (b"small bytes\n", b"small bytes\n"),
            (pieces(), b"from an iterator\n"),
            (apieces(), b"from an async iterator\n"),
        ):
            s = c.exec_stream(["cat"], stdin=source)
            out, _ = await collect(s)
            assert out == expected and (await s.result()).exit_code == 0
        s = c.exec_stream(["sha256sum"], stdin=big)
        out, _ = await collect(s)
        assert out.split()[0].decode() == hashlib.sha256(big).hexdigest()
        with pytest.raises(ValueError, match="not both"):
            c.exec_stream(["cat"], stdin=b"x", stdin_stream=True)

    on_loop(client, main())


def test_exec_stream_capture_merge_and_counts(client: Client) -> None:
    async def main() -> None:
        c = client.aio
        # merge_stderr: one stream, in write order.
        s = c.exec_stream("echo out; echo err >&2", merge_stderr=True)
        out, err = await collect(s)
        assert out == b"out\nerr\n" and err == b""
        # A capture kept for the result, without iterating at all: result() reads the rest.
        s = c.exec_stream("seq 1 10000", max_output=16, head_tail=True)
        r = await s.result()
        produced = sum(len(f"{i}\n") for i in range(1, 10001))
        assert r.stdout_bytes == produced and r.stdout_dropped == produced - 16
        assert r.stdout.startswith(b"1\n2\n") and r.stdout.endswith(b"10000\n")
        # No capture option: as the guest's stream mode, the result repeats nothing.
        s = c.exec_stream("echo hi")
        assert await collect(s) == (b"hi\n", b"")
        r = await s.result()
        assert r.stdout == b"" and r.stdout_bytes == 3
        # strip_ansi shapes the kept copy, not the live chunks.
        s = c.exec_stream(["printf", "\\033[31mred\\033[0m\\n"], strip_ansi=True)
        out, _ = await collect(s)
        assert out == b"\x1b[31mred\x1b[0m\n" and (await s.result()).stdout == b"red\n"

    on_loop(client, main())


def test_exec_stream_not_live_spill_and_on_timeout(client: Client) -> None:
    async def main() -> None:
        c = client.aio
        with pytest.raises(ValueError, match="live=False"):
            c.exec_stream(["true"], spill=True)
        s = c.exec_stream("seq 1 5000", live=False, spill=True, max_output=8, stdin=b"")
        assert await collect(s) == (b"", b"")  # no events: the guest kept the output
        r = await s.result()
        assert r.stdout_spill is not None and r.stdout_spill.bytes == r.stdout_bytes and len(r.stdout) == 8
        s = c.exec_stream("echo started; sleep 30", timeout_s=0.5, on_timeout="detach")
        out, _ = await collect(s)
        r = await s.result()
        assert out == b"started\n" and r.detached is not None
        await c.process_signal(r.detached, "KILL")
        await c.process_wait(r.detached, timeout_s=30)
        await c.process_forget(r.detached)

    on_loop(client, main())


def test_shell_stream_options(client: Client) -> None:
    async def main() -> None:
        c = client.aio
        async with await c.shell_create() as sh:
            s = c.shell_stream(sh.id, "echo ran; if", check_syntax=True)
            with pytest.raises(GuestdError, match="syntax error"):
                await collect(s)
                await s.result()
            s = c.shell_stream(sh.id, "cat; echo e >&2", input=iter([b"typed ", b"in\n"]), merge_stderr=True)
            out, _ = await collect(s)
            assert out == b"typed in\ne\n" and (await s.result()).exit_code == 0
            s = c.shell_stream(sh.id, "seq 1 3000", live=False, max_output=6)
            r = await s.result()
            assert r.stdout == b"\n3000\n"[-6:] and r.stdout_dropped > 0

    on_loop(client, main())


def test_stream_deadline_none_waits_for_ever(client: Client) -> None:
    """``deadline=None`` sets no client clock; the default derives one (an hour without a
    guest timeout)."""

    async def main() -> None:
        c = client.aio
        forever = c.exec_stream(["true"], deadline=None)
        derived = c.exec_stream(["true"])
        assert forever._clock._end is None and derived._clock._deadline == UNBOUNDED_RUN_DEADLINE
        for s in (forever, derived):
            assert (await s.result()).exit_code == 0
        assert (await c.exec(["true"], deadline=None)).exit_code == 0

    on_loop(client, main())


def cli_namespace(**given: Any) -> argparse.Namespace:
    fields: dict[str, Any] = dict(
        cwd=None,
        stdin=False,
        timeout=None,
        idle_timeout=None,
        max_output=None,
        head_tail=False,
        on_timeout=None,
        merge_stderr=False,
        spill=False,
        check_syntax=False,
    )
    return argparse.Namespace(**{**fields, **given})


def test_guestctl_sets_no_client_deadline_without_a_timeout(client: Client) -> None:
    """``guestctl exec -- tail -f`` (and ``shell run``) without --timeout is not cut after an
    hour: the request has no client deadline; with --timeout it follows from it."""

    async def main() -> None:
        c = client.aio
        s = start_exec(c, cli_namespace(), ["true"], {}, live=True)
        assert s._clock._end is None
        await s.result()
        s = start_exec(c, cli_namespace(timeout=5.0), ["true"], {}, live=True)
        assert s._clock._deadline is not None and s._clock._deadline > 5.0
        await s.result()
        async with await c.shell_create() as sh:
            s = start_shell_run(c, cli_namespace(id=sh.id, command="true"), live=True)
            assert s._clock._end is None
            await s.result()

    on_loop(client, main())


def test_default_timeout_applies_to_shell_runs(guestd: Guestd) -> None:
    with Client(guestd.address, default_timeout_s=0.5) as c, c.shell_create() as sh:
        r = sh.run("sleep 20")
        assert r.timed_out is not None
        r = sh.run("sleep 20", timeout_s=0.2)  # a call's own timeout wins
        assert r.timed_out is not None
        assert c.aio.shell_stream(sh.id, "true")._clock._deadline != UNBOUNDED_RUN_DEADLINE
        assert DERIVED.value == "derived"
