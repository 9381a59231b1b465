"""Ctrl-C in the blocking client cancels the remote work (issue 30): the command's process tree
ends in the guest and the connection goes on working. And cancelling an asyncio task running a
call cancels its request the same way."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

from guestd.client import AsyncClient
from guestd.testing import REPO, Guestd, live_procs_with

BLOCKING_SCRIPT = textwrap.dedent(
    """
    import sys
    from guestd.client import Client

    address, marker, digits = sys.argv[1:4]  # not the duration itself: not on this command line
    c = Client(address)
    try:
        c.exec(["sh", "-c", f"echo $$ > {marker}; sleep 60.{digits}; echo never"])
        print("exec returned", flush=True)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    r = c.exec(["echo", "again"])
    print("second:", r.stdout.decode().strip(), flush=True)
    sys.stdin.readline()  # the connection stays open until the test has looked
    c.close()
    """
)


def wait_for(predicate: object, what: str, limit_s: float = 30.0) -> None:
    """Poll ``predicate`` until true; a bound on the wait, not a timing assertion."""
    assert callable(predicate)
    end = time.monotonic() + limit_s
    while not predicate():
        assert time.monotonic() < end, f"not within {limit_s} s: {what}"
        time.sleep(0.05)


def unique_digits() -> str:
    """Decimals for a sleep duration no other process on this machine has on its command line."""
    return f"{uuid.uuid4().int % 10**9:09d}"


def test_ctrl_c_in_a_blocking_exec_ends_the_command_in_the_guest(guestd: Guestd, tmp_path: Path) -> None:
    marker = tmp_path / "started"
    digits = unique_digits()
    token = f"60.{digits}"
    proc = subprocess.Popen(
        [sys.executable, "-c", BLOCKING_SCRIPT, guestd.address, str(marker), digits],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    try:
        wait_for(lambda: marker.exists() and marker.read_text().strip(), "the command started")
        wait_for(lambda: live_procs_with(f"sleep {token}"), "the sleep started")
        proc.send_signal(signal.SIGINT)
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline() == b"interrupted\n"
        assert proc.stdout.readline() == b"second: again\n"  # the same connection, still usable
        # While that connection is still open, guestd has ended the whole tree of the cancelled
        # exec (the shell and its sleep): the cancel reached it, not the connection's end.
        wait_for(lambda: not live_procs_with(token), "the command's tree ended in the guest")
        _, err = proc.communicate(b"\n", timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err.decode()


def test_cancelling_an_async_call_cancels_its_request(guestd: Guestd, tmp_path: Path) -> None:
    marker = tmp_path / "started"
    token = f"60.{unique_digits()}"

    async def main() -> None:
        async with await AsyncClient.connect(guestd.address) as c:
            task = asyncio.ensure_future(c.exec(["sh", "-c", f"echo $$ > {marker}; sleep {token}"]))
            for _ in range(600):
                if marker.exists() and live_procs_with(f"sleep {token}"):
                    break
                await asyncio.sleep(0.05)
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            assert (await c.exec(["echo", "again"])).stdout == b"again\n"
            for _ in range(600):  # with the connection still open
                if not live_procs_with(token):
                    break
                await asyncio.sleep(0.05)
            assert not live_procs_with(token), "the cancelled command's tree still runs"

    asyncio.run(main())
