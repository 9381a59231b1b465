"""Closing streams and the client leaves no "Future exception was never retrieved" behind
(issue 30): a stream the caller stopped (a watch closed, a metrics watch left by ``break``, an
exec stream cancelled) and then the client closed. asyncio logs that warning when the
unretrieved future is collected, at the interpreter's exit at the latest, so each scenario
runs in its own interpreter and its stderr is read whole."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap

import pytest

from guestd.client import Client
from guestd.testing import Guestd

SCENARIOS = {
    "watch_closed": """
        w = c.watch("/tmp", latency_s=0)
        await w.wait_ready()
        await w.close()
    """,
    "metrics_watch_left_by_break": """
        async for _ in c.watch_metrics(interval_ms=100):
            break
    """,
    "exec_stream_cancelled": """
        s = c.exec_stream(["sleep", "30"])
        await s.cancel()
    """,
    "exec_stream_cancelled_reply_unread": """
        s = c.exec_stream(["sleep", "30"])
        await s.cancel()
        await c.ping()
        await c.ping()  # the guest's cancelled reply has had time to arrive
    """,
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_no_unretrieved_future_after_close(guestd: Guestd, scenario: str) -> None:
    body = textwrap.indent(textwrap.dedent(SCENARIOS[scenario]), " " * 8)
    script = (
        "import asyncio, gc\n"
        "from guestd.client import AsyncClient\n"
        "async def main():\n"
        f"    c = await AsyncClient.connect({guestd.address!r})\n"
        "    try:\n"
        f"{body}\n"
        "    finally:\n"
        "        await c.close()\n"
        "asyncio.run(main())\n"
        "gc.collect()\n"
        "print('ran')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == "ran\n", done.stderr
    assert "never retrieved" not in done.stderr, done.stderr


def test_closing_a_watch_ends_an_iteration_in_another_task(client: Client) -> None:
    """``w.close()`` from one task ends ``async for ch in w`` in another (it raised
    CancelledError in a task nobody cancelled)."""

    async def main() -> list[object]:
        w = client.aio.watch("/tmp", latency_s=0)
        await w.wait_ready()
        seen: list[object] = []

        async def follow() -> None:
            async for ch in w:
                seen.append(ch)

        task = asyncio.ensure_future(follow())
        await asyncio.sleep(0)
        await w.close()
        await asyncio.wait_for(task, 30)
        return seen

    assert asyncio.run_coroutine_threadsafe(main(), client._loop).result(60) == []
