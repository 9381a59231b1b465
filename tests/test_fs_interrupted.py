"""Issue 15, defect 6: a guestd killed in the middle of writes and uploads leaves no temp file,
and the target is always the complete old or the complete new content."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import tempfile

from guestd.client import AsyncClient
from guestd.testing import Guestd, start_guestd

OLD = b"old\n" * 1000
NEW = b"N" * (4 << 20)


async def _write_and_kill(g: Guestd, targets: list[str], delay: float) -> None:
    """Three writes at once on one connection; guestd is SIGKILLed ``delay`` seconds in."""
    async with await AsyncClient.connect(g.address) as c:
        jobs = [
            asyncio.ensure_future(c.upload(NEW, targets[0], deadline=10)),
            asyncio.ensure_future(c.write_file(targets[1], NEW, deadline=10)),
            asyncio.ensure_future(c.write_file(targets[2], NEW, flag="create", deadline=10)),
        ]
        await asyncio.sleep(delay)
        os.kill(g.pid, signal.SIGKILL)
        await asyncio.gather(*jobs, return_exceptions=True)  # they fail: guestd is gone


def _temp_names(directory: str) -> list[str]:
    return [n for n in os.listdir(directory) if not n.startswith("t")]


def _content(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_sigkill_during_writes_and_uploads_leaves_no_temp_file_and_a_whole_target() -> None:
    work = tempfile.mkdtemp(prefix="guestd-kill-")
    data = os.path.join(work, "data")
    os.mkdir(data)
    rng = random.Random(1415)
    try:
        for i in range(50):
            targets = [os.path.join(data, f"t{k}") for k in range(3)]
            for path in targets:
                with open(path, "wb") as out:
                    out.write(OLD)
            g = start_guestd(tempfile.mkdtemp(prefix="guestd-kill-run-", dir=work))
            asyncio.run(_write_and_kill(g, targets, rng.uniform(0.0, 0.08)))
            g.proc.wait(10)
            assert _temp_names(data) == [], f"round {i}: temp files left"
            assert _content(targets[0]) in (OLD, NEW), f"round {i}: the upload's target is torn"
            assert _content(targets[1]) in (OLD, NEW), f"round {i}: the write's target is torn"
            assert _content(targets[2]) == OLD  # "create" on an existing file never replaces it
            restarted = start_guestd(g.workdir)  # nothing for a new guestd to clean up either
            restarted.stop()
            assert _temp_names(data) == []
    finally:
        shutil.rmtree(work, ignore_errors=True)
