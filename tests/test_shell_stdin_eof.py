"""shell.run with stdin_stream: data and eof sent right behind the request reach the command
(the command's FIFO was closed for writing before bash had opened it, and a FIFO opened for
reading without a writer waits for one for ever: the command hung until its timeout)."""

from __future__ import annotations

import asyncio

from guestd.client.aio import AsyncClient
from guestd.testing import Guestd


def test_stdin_data_and_eof_right_behind_the_request_reach_the_command(guestd: Guestd) -> None:
    async def main() -> None:
        async with await AsyncClient.connect(guestd.address) as c:
            session = (await c.shell_create()).id
            for attempt in range(5):
                s = c.shell_stream(session, "cat", stdin_stream=True, timeout_s=20)
                await asyncio.sleep(0)  # input in a write of its own, before bash opens the FIFO
                await s.write_stdin(f"fed {attempt}\n".encode())
                await s.close_stdin()
                out = b"".join([data async for _, data in s])
                res = await s.result()
                assert (out, res.exit_code, res.timed_out) == (f"fed {attempt}\n".encode(), 0, None)
            await c.shell_close(session)

    asyncio.run(main())


def test_the_unopened_fifo_is_looked_at_less_and_less_often() -> None:
    """A command that never opens its stdin FIFO is polled with a doubling interval up to a cap
    (it was every 10 ms for the command's whole life)."""
    from itertools import islice, pairwise

    from guestd.shells.stdin import UNOPENED_FIFO_FIRST_POLL_S, UNOPENED_FIFO_MAX_POLL_S, backing_off

    intervals = list(islice(backing_off(UNOPENED_FIFO_FIRST_POLL_S, UNOPENED_FIFO_MAX_POLL_S), 40))
    assert intervals[0] == UNOPENED_FIFO_FIRST_POLL_S
    assert all(b >= a for a, b in pairwise(intervals))
    assert intervals[-1] == UNOPENED_FIFO_MAX_POLL_S
    # A minute of a command that never reads: a few hundred wake-ups at most, not 6,000.
    polls, waited = 0, 0.0
    for interval in backing_off(UNOPENED_FIFO_FIRST_POLL_S, UNOPENED_FIFO_MAX_POLL_S):
        if waited >= 60:
            break
        polls, waited = polls + 1, waited + interval
    assert polls < 300
