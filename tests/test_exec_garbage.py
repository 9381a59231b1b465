"""An exec leaves no reference cycles behind (issue 34): what it built is freed by reference
counting as the request ends, not by the garbage collector, whose passes over thousands of dead
runs held guestd's loop for 10-50 ms under an exec flood (pings waited behind them).

Counted in a real guestd by its loop instrument (guestd/looplag.py, ``GUESTD_LOOP_LAG``):
SIGUSR1 collects and starts counting, SIGUSR2 collects again and reports every object the
collector freed in between.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest

from guestd.client import Client
from guestd.testing.local import Guestd

RUNS = 60


def _summary_after(g: Guestd, path: str, sig: int, seen: int) -> dict[str, Any]:
    """Send ``sig`` and wait for the summary it writes (its sequence number passes ``seen``)."""
    os.kill(g.pid, sig)
    for _ in range(1000):  # bounded: the loop writes it within milliseconds
        try:
            with open(path) as f:
                summary: dict[str, Any] = json.load(f)
            if summary["sequence"] > seen:
                return summary
        except (OSError, ValueError):
            pass
        time.sleep(0.01)
    raise AssertionError("guestd wrote no loop summary")


def _garbage_per_run(g: Guestd, path: str, run: Callable[[Client], object]) -> float:
    with g.client() as c:
        for _ in range(5):  # first runs import and start what later ones reuse
            run(c)
        started = _summary_after(g, path, signal.SIGUSR1, 0)
        for _ in range(RUNS):
            run(c)
        done = _summary_after(g, path, signal.SIGUSR2, started["sequence"])
    return float(done["cyclic_garbage"]) / RUNS


SHAPES: dict[str, Callable[[Client], object]] = {
    "plain": lambda c: c.exec(["true"]),
    "output": lambda c: c.exec(["sh", "-c", "echo out; echo err >&2"]),
    "stdin": lambda c: c.exec(["cat"], stdin=b"input\n"),
    "merged": lambda c: c.exec(["sh", "-c", "echo out; echo err >&2"], merge_stderr=True),
    "streamed": lambda c: c.exec(["sh", "-c", "echo out"], on_stdout=lambda _data: None),
    "timed out": lambda c: c.exec(["sleep", "5"], timeout_s=0.05, kill_grace_s=0.1),
    "failed to start": lambda c: _expect_error(lambda: c.exec(["/nonexistent/program"])),
}


def _expect_error(call: Callable[[], object]) -> None:
    try:
        call()
    except Exception:
        return
    raise AssertionError("the exec should have failed")


@pytest.mark.parametrize("shape", list(SHAPES))
def test_an_exec_leaves_no_reference_cycles(shape: str, fresh_guestd: Any, tmp_path: Any) -> None:
    path = str(tmp_path / "loop.json")
    g = fresh_guestd(env={"GUESTD_LOOP_LAG": path})
    # Before: about 30 objects per run (the run, its Child, exit watch, request context, task).
    assert _garbage_per_run(g, path, SHAPES[shape]) < 1.0


def test_an_exec_in_the_shipped_config_leaves_no_reference_cycles(scratch: str, tmp_path: Any) -> None:
    from guestd.testing.cgroups import contained_config
    from guestd.testing.local import start_guestd

    path = str(tmp_path / "loop.json")
    d = str(tmp_path / "g")
    os.mkdir(d)
    os.chmod(d, 0o755)
    config = contained_config(d, os.path.join(scratch, "garbage"))
    g = start_guestd(d, "--config", config, env={"GUESTD_LOOP_LAG": path})
    try:
        assert _garbage_per_run(g, path, SHAPES["plain"]) < 1.0
    finally:
        g.stop()
