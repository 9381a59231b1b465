"""Per-command latency of each framework's own local runtime against the same framework on
guestd, in the same run (issue 20), on one local guestd. Needs the integration venvs
(scripts/bootstrap-integrations.sh, and ``openhands`` for .venv-oh):

    .venv-int/bin/python -m bench.integrations [--n 200]

- SWE-ReX: ``run_in_session(BashAction("echo hi"))`` on ``LocalRuntime`` (pexpect bash) and on
  ``GuestdRuntime`` (a local guestd on a Unix socket);
- mini-swe-agent: ``execute({"command": "echo hi"})`` on ``LocalEnvironment`` (a subprocess per
  command) and on ``GuestdEnvironment`` (one guestd exec per command);
- OpenHands SDK: ``execute_command("echo hi")`` on ``LocalWorkspace`` (a subprocess per command,
  output read by two threads) and on ``GuestdWorkspace`` (one guestd exec per command). The SDK
  needs Python >= 3.12: when it is not importable here, the same module runs it in
  ``.venv-oh/bin/python`` (``--only openhands``, on the same guestd) and its rows are merged.

Median and p90 in milliseconds, printed as a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from guestd.testing.local import start_guestd

Row = tuple[str, str, list[float]]
OH_PYTHON = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".venv-oh", "bin", "python")


def summary(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered) * 1e3, ordered[int(len(ordered) * 0.9)] * 1e3


async def time_async(n: int, step: Callable[[], Awaitable[object]]) -> list[float]:
    await step()  # warm-up
    out = []
    for _ in range(n):
        t = time.perf_counter()
        await step()
        out.append(time.perf_counter() - t)
    return out


def time_sync(n: int, step: Callable[[], object]) -> list[float]:
    step()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        step()
        out.append(time.perf_counter() - t)
    return out


async def swerex_samples(runtime: Any, n: int) -> list[float]:
    from swerex.runtime.abstract import BashAction, CreateBashSessionRequest

    await runtime.create_session(CreateBashSessionRequest())
    try:
        return await time_async(n, lambda: runtime.run_in_session(BashAction(command="echo hi", timeout=30)))
    finally:
        await runtime.close()


def swerex_rows(address: str, n: int) -> list[Row]:
    from swerex.runtime.local import LocalRuntime

    from guestd.integrations.swerex import GuestdRuntime

    what = "SWE-ReX run_in_session"
    return [
        (what, "LocalRuntime", asyncio.run(swerex_samples(LocalRuntime(), n))),
        (what, "GuestdRuntime", asyncio.run(swerex_samples(GuestdRuntime(address), n))),
    ]


def minisweagent_rows(address: str, n: int) -> list[Row]:
    from minisweagent.environments.local import LocalEnvironment

    from guestd.integrations.minisweagent import GuestdEnvironment

    what = "mini-swe-agent execute"
    local = LocalEnvironment()
    rows: list[Row] = [(what, "LocalEnvironment", time_sync(n, lambda: local.execute({"command": "echo hi"})))]
    env = GuestdEnvironment(address=address)
    rows.append((what, "GuestdEnvironment", time_sync(n, lambda: env.execute({"command": "echo hi"}))))
    env.close()
    return rows


@contextlib.contextmanager
def quiet_stdout() -> Iterator[None]:
    """LocalWorkspace echoes each command's output to sys.stdout; keep the table readable."""
    saved = sys.stdout
    with open(os.devnull, "w") as sink:
        sys.stdout = sink
        try:
            yield
        finally:
            sys.stdout = saved


def openhands_rows(address: str, n: int) -> list[Row]:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network fetch on import
    os.environ.setdefault("OPENHANDS_SUPPRESS_BANNER", "1")
    from openhands.sdk.workspace import LocalWorkspace

    from guestd.integrations.openhands import GuestdWorkspace

    what = "OpenHands execute_command"
    workdir = tempfile.gettempdir()
    local = LocalWorkspace(working_dir=workdir)
    with quiet_stdout():
        rows: list[Row] = [(what, "LocalWorkspace", time_sync(n, lambda: local.execute_command("echo hi")))]
    with GuestdWorkspace(address=address, working_dir=workdir) as ws:
        rows.append((what, "GuestdWorkspace", time_sync(n, lambda: ws.execute_command("echo hi"))))
    return rows


FRAMEWORKS: dict[str, tuple[str, Callable[[str, int], list[Row]]]] = {
    "swerex": ("swerex", swerex_rows),
    "minisweagent": ("minisweagent", minisweagent_rows),
    "openhands": ("openhands.sdk", openhands_rows),
}


def importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def collect(address: str, n: int, only: list[str]) -> list[Row]:
    rows: list[Row] = []
    for name in only:
        module, rows_of = FRAMEWORKS[name]
        if importable(module):
            rows += rows_of(address, n)
        elif name == "openhands" and os.path.exists(OH_PYTHON):
            cmd = [OH_PYTHON, "-m", "bench.integrations", "--n", str(n), "--only", "openhands", "--address", address]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=1800).stdout
            rows += [(w, r, samples) for w, r, samples in json.loads(out.strip().splitlines()[-1])]
        else:
            print(f"skipped {name}: {module} is not importable here", file=sys.stderr)
    return rows


DISTRIBUTIONS = {"swerex": "swe-rex", "minisweagent": "mini-swe-agent", "openhands": "openhands-sdk"}


def conditions(only: list[str]) -> str:
    """What the figures hold under: versions, TERM (LocalRuntime's pexpect bash behaves differently
    with a terminal type set), the machine's load."""
    import importlib.metadata

    versions = []
    for name in only:
        try:
            versions.append(f"{DISTRIBUTIONS[name]} {importlib.metadata.version(DISTRIBUTIONS[name])}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{DISTRIBUTIONS[name]} (in .venv-oh)")
    term = os.environ.get("TERM") or "unset"
    load = os.getloadavg()[0]
    return f"Conditions: {', '.join(versions)}; TERM {term}; load {load:.1f} on {os.cpu_count()} CPUs."


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--only", action="append", choices=sorted(FRAMEWORKS), help="frameworks to run (default: all)")
    ap.add_argument("--address", help="an already running guestd (prints the rows as JSON instead of the table)")
    args = ap.parse_args()
    n, only = args.n, args.only or list(FRAMEWORKS)
    if args.address:
        print(json.dumps(collect(args.address, n, only)))
        return
    with tempfile.TemporaryDirectory(prefix="guestd-bench-int-") as d:
        g = start_guestd(d, ready_timeout_s=60)
        try:
            rows = collect(g.address, n, only)
        finally:
            g.stop()
    print(conditions(only))
    print()
    print(f"| framework call (`echo hi`, n={n}) | runtime | median ms | p90 ms |")
    print("|---|---|---|---|")
    for what, runtime, samples in rows:
        med, p90 = summary(samples)
        print(f"| {what} | {runtime} | {med:.2f} | {p90:.2f} |")


if __name__ == "__main__":
    main()
