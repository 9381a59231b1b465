"""exec against a real guestd: results, errors, timeouts, truncation, streaming, stdin, signals."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import pytest

from guestd.client import AsyncClient, Client, GuestdError
from guestd.testing import Guestd, live_procs_with, unique_sleep


def test_exit_code_output_and_counts(client: Client) -> None:
    r = client.exec(["sh", "-c", "printf out; printf err >&2; exit 3"])
    assert (r.exit_code, r.signal, r.timed_out) == (3, None, None)
    assert (r.stdout, r.stderr) == (b"out", b"err")
    assert (r.stdout_bytes, r.stderr_bytes, r.stdout_dropped, r.stderr_dropped) == (3, 3, 0, 0)
    assert r.pid > 0 and r.duration_s >= 0


def test_shell_string_cwd_env_and_stdin(client: Client, tmp_path: object) -> None:
    r = client.exec("pwd; echo $FOO; cat", cwd=str(tmp_path), env={"FOO": "bar"}, stdin=b"piped")
    assert r.stdout == f"{tmp_path}\nbar\npiped".encode()


def test_env_replace_and_default_stdin_is_devnull(client: Client) -> None:
    r = client.exec(["/usr/bin/env"], env={"ONLY": "1"}, replace_env=True)
    assert r.stdout == b"ONLY=1\n"
    r = client.exec(["cat"], timeout_s=5)  # would hang on a terminal; /dev/null gives EOF
    assert r.exit_code == 0 and r.stdout == b""


def test_killed_by_signal(client: Client) -> None:
    r = client.exec(["sh", "-c", "kill -9 $$"])
    assert r.exit_code is None and r.signal == 9
    assert r.shell_exit_code() == 137


@pytest.mark.parametrize(
    "kwargs, code, stage",
    [
        ({"cmd": ["/nonexistent/prog"]}, "not_found", "spawn"),
        ({"cmd": ["/etc/hostname"]}, "permission_denied", "spawn"),
        ({"cmd": ["true"], "cwd": "/nonexistent-dir"}, "not_found", "cwd"),
        ({"cmd": ["true"], "cwd": "/etc/hostname"}, "not_a_directory", "cwd"),
    ],
)
def test_could_not_start_is_an_error_not_an_exit_code(
    client: Client, kwargs: dict[str, object], code: str, stage: str
) -> None:
    cmd = kwargs.pop("cmd")
    with pytest.raises(GuestdError) as ei:
        client.exec(cmd, **kwargs)  # type: ignore[arg-type]
    assert ei.value.code == code
    assert ei.value.details["stage"] == stage
    assert ei.value.errno is not None


def test_bad_arguments(client: Client) -> None:
    cases: list[dict[str, object]] = [{"cmd": []}, {"cmd": ["true"], "timeout_s": -1}, {"cmd": ["a\0b"]}]
    for kwargs in cases:
        cmd = kwargs.pop("cmd")
        with pytest.raises(GuestdError) as ei:
            client.exec(cmd, **kwargs)  # type: ignore[arg-type]
        assert ei.value.code == "bad_request"
    with pytest.raises(GuestdError) as ei:
        client.exec(["true"], max_output=1 << 40)
    assert ei.value.code == "limit" and ei.value.details["limit"] == "max_output"


def test_wall_timeout_kills_whole_tree_and_keeps_output(client: Client) -> None:
    marker = unique_sleep()
    r = client.exec(f"echo started; {marker} & {marker}", timeout_s=0.5)
    assert r.timed_out == "wall"
    assert r.signal == signal.SIGTERM
    assert r.stdout == b"started\n"
    assert r.shell_exit_code() == 124
    assert live_procs_with(marker) == []


def test_timeout_escalates_to_sigkill_and_catches_escaped_descendants(client: Client) -> None:
    # The child ignores SIGTERM and a grandchild escapes the process group with setsid.
    marker = unique_sleep()
    r = client.exec(f"trap '' TERM; setsid {marker} & {marker}; echo never", timeout_s=0.5, kill_grace_s=0.5)
    assert r.timed_out == "wall" and r.signal == signal.SIGKILL
    assert 0.9 < r.duration_s < 5
    assert live_procs_with(marker) == []


def test_idle_timeout_fires_only_without_output(client: Client) -> None:
    r = client.exec("for i in 1 2 3 4 5; do echo $i; sleep 0.1; done", idle_timeout_s=1.0)
    assert r.timed_out is None and r.exit_code == 0
    r = client.exec("echo one; sleep 30", idle_timeout_s=0.3)
    assert r.timed_out == "idle" and r.stdout == b"one\n"


def test_tail_truncation_reports_exact_counts(client: Client) -> None:
    r = client.exec("seq 1 100000", max_output=1000)
    full = "".join(f"{i}\n" for i in range(1, 100001)).encode()
    assert r.stdout_bytes == len(full)
    assert r.stdout == full[-1000:]
    assert r.stdout_dropped == len(full) - 1000
    assert r.stdout_gap_at == 0
    assert r.truncated


def test_head_tail_truncation_keeps_both_ends(client: Client) -> None:
    r = client.exec("seq 1 100000", max_output=1000, head_tail=True)
    full = "".join(f"{i}\n" for i in range(1, 100001)).encode()
    assert r.stdout == full[:500] + full[-500:]
    assert r.stdout_gap_at == 500 and r.stdout_dropped == len(full) - 1000


def test_streaming_delivers_everything_in_order_then_result(guestd: Guestd) -> None:
    async def go() -> None:
        c = await AsyncClient.connect(guestd.address, stream_window=256 * 1024)
        s = c.exec_stream("seq 1 300000; echo done >&2")
        out = bytearray()
        err = bytearray()
        async for name, data in s:
            (out if name == "stdout" else err).extend(data)
            await asyncio.sleep(0)  # a slow-ish consumer: credit must throttle the sender
        r = await s.result()
        assert bytes(out) == "".join(f"{i}\n" for i in range(1, 300001)).encode()
        assert bytes(err) == b"done\n"
        assert r.stdout_bytes == len(out) and r.stdout == b"" and r.exit_code == 0
        assert s.pid == r.pid
        await c.close()

    asyncio.run(go())


def test_streaming_stdin_and_signal(guestd: Guestd) -> None:
    async def go() -> None:
        c = await AsyncClient.connect(guestd.address)
        s = c.exec_stream(["cat"], stdin_stream=True)
        await s.write_stdin(b"x" * 3_000_000)
        await s.write_stdin(b"end")
        await s.close_stdin()
        total = 0
        async for _, data in s:
            total += len(data)
        r = await s.result()
        assert total == 3_000_003 and r.exit_code == 0
        s = c.exec_stream("trap 'echo got-usr1; exit 7' USR1; echo ready; while :; do sleep 0.05; done")
        async for _, data in s:
            if b"ready" in data:
                await s.signal("USR1")
        r = await s.result()
        assert r.exit_code == 7
        await c.close()

    asyncio.run(go())


def test_stalled_stream_does_not_block_other_requests(guestd: Guestd) -> None:
    async def go() -> None:
        c = await AsyncClient.connect(guestd.address, stream_window=64 * 1024)
        s = c.exec_stream("yes | head -c 20000000")  # never consumed for a while
        t0 = time.monotonic()
        for _ in range(20):
            await c.ping()
        r = await c.exec(["echo", "other"])
        assert r.stdout == b"other\n"
        assert time.monotonic() - t0 < 10
        n = 0
        async for _, data in s:
            n += len(data)
        assert n == 20_000_000
        await c.close()

    asyncio.run(go())


def test_hundred_concurrent_execs(guestd: Guestd) -> None:
    async def go() -> None:
        c = await AsyncClient.connect(guestd.address)
        results = await asyncio.gather(*(c.exec(["sh", "-c", f"echo {i}"]) for i in range(120)))
        assert [r.stdout for r in results] == [f"{i}\n".encode() for i in range(120)]
        await c.close()

    asyncio.run(go())


def test_client_deadline_cancels_the_guest_process(client: Client) -> None:
    marker = unique_sleep()
    with pytest.raises(GuestdError) as ei:
        client.exec(marker, deadline=0.3)
    assert ei.value.code == "timeout"
    deadline = time.monotonic() + 5
    while live_procs_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live_procs_with(marker) == []
    assert client.ping()


def test_background_child_does_not_hold_exec_open(client: Client) -> None:
    r = client.exec("sleep 5 & echo bg", timeout_s=20)
    assert r.exit_code == 0 and r.stdout == b"bg\n"
    assert r.duration_s < 4


@pytest.mark.slow
def test_one_gigabyte_of_output_with_bounded_memory(guestd: Guestd) -> None:
    with guestd.client() as c:
        c.exec(["true"])
        base = guestd.rss()
        peak = [base]
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], guestd.rss())
                time.sleep(0.02)

        t = threading.Thread(target=sample)
        t.start()
        try:
            r = c.exec("head -c 1000000000 /dev/zero; echo tail-marker", max_output=65536, timeout_s=240)
        finally:
            stop.set()
            t.join()
        assert r.exit_code == 0
        assert r.stdout_bytes == 1_000_000_000 + len(b"tail-marker\n")
        assert r.stdout_dropped == r.stdout_bytes - 65536
        assert r.stdout.endswith(b"\0tail-marker\n") and len(r.stdout) == 65536
        assert peak[0] - base < 32 * 1024 * 1024, f"guestd grew by {(peak[0] - base) >> 20} MiB"
