"""guestd.integrations.swerex against the real SWE-ReX 1.4.0 (the integration venv that
scripts/test.sh builds; skipped where swe-rex is not installed).

SWE-ReX's own tests/test_execution.py is downloaded from its pinned sdist when this runs
(tests/upstream.py, pin in scripts/upstream-suites.txt; skipped with the reason where PyPI
cannot be reached) and run twice in subprocesses, on the same machine in the same run, under
the same environment (TERM unset, as SWE-ReX's own CI runs it): with its runtime fixture on
guestd (GuestdRuntime on a real local guestd; tests/swerex_fixtures.py) and on SWE-ReX's
LocalRuntime. guestd must pass at least as many, and only the tests the module docs say it
fails may fail.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytest.importorskip("swerex")
pytest.importorskip("aiohttp")

from guestd.integrations import swerex as integration
from tests.upstream import UpstreamUnavailable, fetch_test_file

REPO = Path(__file__).resolve().parent.parent
# What guestd fails by design (see guestd/integrations/swerex.py).
EXPECTED_FAILURES = {"test_interrupt_pager"}
# The upstream file imports _Action/_Command from the conftest beside it.
SHIM_CONFTEST = """\
from tests.swerex_fixtures import *  # noqa: F403
from tests.swerex_fixtures import _Action, _Command  # noqa: F401
"""


@pytest.fixture(scope="module")
def upstream_suite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """SWE-ReX 1.4.0's tests/test_execution.py, fetched and checked against its pin, with our shim."""
    try:
        test_file = fetch_test_file("swe-rex", "tests/test_execution.py", tmp_path_factory.mktemp("swerex-sdist"))
    except UpstreamUnavailable as e:
        pytest.skip(f"SWE-ReX's own suite could not be fetched: {e}")
    (test_file.parent / "conftest.py").write_text(SHIM_CONFTEST)
    yield test_file


def run_suite(suite: Path, runtime: str, tmp_path: Path, *, term: str | None = None) -> dict[str, str]:
    """Run the upstream suite on ``runtime`` (TERM unset unless ``term``); returns each test's outcome."""
    report = tmp_path / f"{runtime}-{term or 'noterm'}.xml"
    cmd = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "asyncio_mode=auto",
        "-o", "asyncio_default_fixture_loop_scope=function", "--timeout=60", f"--junitxml={report}",
        f"--rootdir={suite.parent}", str(suite),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TERM"}
    env.update(SWEREX_RUNTIME=runtime, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    if term is not None:
        env["TERM"] = term
    proc = subprocess.run(cmd, cwd=suite.parent, env=env, capture_output=True, text=True, timeout=900)
    assert report.exists(), proc.stdout + proc.stderr
    outcomes: dict[str, str] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcome = kinds[0] if kinds else "passed"
        if outcome == "skipped" and "xfail" in (case.find("skipped").get("type", "") or "").lower():  # type: ignore[union-attr]
            outcome = "xfailed"
        outcomes[case.get("name", "?")] = outcome
    return outcomes


def counts(outcomes: dict[str, str]) -> str:
    kinds = sorted(set(outcomes.values()))
    return ", ".join(f"{sum(1 for o in outcomes.values() if o == k)} {k}" for k in kinds)


def test_swerex_suite_on_guestd_passes_at_least_as_many_as_local_runtime(upstream_suite: Path, tmp_path: Path) -> None:
    guestd = run_suite(upstream_suite, "guestd", tmp_path)
    local = run_suite(upstream_suite, "local", tmp_path)
    guestd_passes = sorted(n for n, o in guestd.items() if o == "passed")
    local_passes = sorted(n for n, o in local.items() if o == "passed")
    # The condition the comparison holds under: LocalRuntime's pexpect bash echoes and adds \r\n
    # when TERM names a terminal (TERM=xterm: 33 passed, 16 failed on 2026-12-03, an idle
    # machine; not re-run here, to keep CI in budget); guestd's outcome does not depend on TERM
    # (checked below), so the fair baseline is TERM unset.
    guestd_xterm = run_suite(upstream_suite, "guestd", tmp_path, term="xterm")
    print(
        f"SWE-ReX 1.4.0 tests/test_execution.py, same machine, same run (load {os.getloadavg()[0]:.1f} on "
        f"{os.cpu_count()} CPUs; LocalRuntime's pexpect waits time out on a loaded machine):\n"
        f"  TERM unset:  guestd {counts(guestd)}; LocalRuntime {counts(local)}\n"
        f"  TERM=xterm:  guestd {counts(guestd_xterm)}"
    )
    assert len(guestd) == len(local) >= 49, (guestd, local)  # the whole file ran on both
    failing = {n for n, o in guestd.items() if o in ("failure", "error")}
    assert failing <= EXPECTED_FAILURES, guestd
    assert len(guestd_passes) >= len(local_passes), (guestd, local)
    assert len(guestd_passes) >= integration.EXPECTED_PASSES
    assert guestd_xterm == guestd


async def test_deployment_starts_a_local_guestd_and_stops_it() -> None:
    from swerex.runtime.abstract import BashAction, Command, CreateBashSessionRequest, UploadRequest

    d = integration.GuestdDeployment()
    assert not await d.is_alive()
    await d.start()
    try:
        assert await d.is_alive()
        r = d.runtime
        await r.create_session(CreateBashSessionRequest())
        await r.run_in_session(BashAction(command="cd /tmp && X=1", timeout=10))
        obs = await r.run_in_session(BashAction(command="echo $X; pwd", timeout=10))
        assert obs.output == "1\n/tmp\n" and obs.exit_code == 0
        out = await r.execute(Command(command="echo out; echo err >&2", shell=True, merge_output_streams=True))
        assert out.stdout == "out\nerr\n" and out.stderr == "" and out.exit_code == 0
        assert (await r.execute(Command(command=["false"]))).exit_code == 1
        with pytest.raises(FileNotFoundError):
            await r.upload(UploadRequest(source_path="/nonexistent-source", target_path="/tmp/x"))
    finally:
        await d.stop()
    assert not await d.is_alive()


async def test_a_deployment_cancelled_while_its_guest_boots_stops_that_guest(tmp_path: Path) -> None:
    """start() given up (a timeout) while the start_guest hook still boots: the guest it then
    returns is stopped. Before, it ran on with nobody to stop it (a QEMU guest: until its own
    1 h timer)."""
    import threading

    from guestd.testing import start_guestd

    release, stopped = threading.Event(), threading.Event()

    def hook() -> tuple[str, Callable[[], None]]:
        release.wait(30)
        g = start_guestd(str(tmp_path))

        def stop() -> None:
            g.stop()
            stopped.set()

        return g.address, stop

    d = integration.GuestdDeployment(start_guest=hook)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(d.start(), 0.2)
    release.set()
    assert await asyncio.to_thread(stopped.wait, 60)
    assert not await d.is_alive()


async def test_interrupt_after_timeout_keeps_the_session_in_sync(tmp_path: Path) -> None:
    """A timed-out command is interrupted by guestd (no manual BashInterruptAction needed),
    the session keeps its state, and the next command sees only its own output."""
    from swerex.exceptions import CommandTimeoutError
    from swerex.runtime.abstract import BashAction, BashInterruptAction, CreateBashSessionRequest

    d = integration.GuestdDeployment()
    await d.start()
    try:
        r = d.runtime
        await r.create_session(CreateBashSessionRequest(session="s"))
        await r.run_in_session(BashAction(command=f"cd {tmp_path}; Y=7", session="s"))
        for _ in range(3):
            with pytest.raises(CommandTimeoutError):
                await r.run_in_session(BashAction(command="echo partial; sleep 30", timeout=0.3, session="s"))
            obs = await r.run_in_session(BashAction(command="echo $Y; pwd", session="s"))
            assert obs.output == f"7\n{tmp_path}\n"
        assert (await r.run_in_session(BashInterruptAction(session="s"))).exit_code == 0
    finally:
        await d.stop()


async def test_cancelled_run_leaves_the_session_in_sync(tmp_path: Path) -> None:
    """A caller that gives up on a command (asyncio cancellation, e.g. its own wait_for)
    cancels the shell.run: guestd interrupts it, and the next command is not completed by it."""
    from swerex.runtime.abstract import BashAction, CreateBashSessionRequest

    d = integration.GuestdDeployment()
    await d.start()
    try:
        r = d.runtime
        await r.create_session(CreateBashSessionRequest())
        await r.run_in_session(BashAction(command="Z=3"))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(r.run_in_session(BashAction(command="sleep 30; echo late", timeout=60)), 0.3)
        obs = await r.run_in_session(BashAction(command="echo $Z", timeout=10))
        assert obs.output == "3\n"
    finally:
        await d.stop()


async def test_interactive_command_runs_in_the_session(tmp_path: Path) -> None:
    """An interactive program runs on the session's own terminal: it sees the session's
    functions, unexported variables and cwd (a separate process would see none of them);
    ctrl-C reaches it, and the session goes on afterwards."""
    from swerex.exceptions import CommandTimeoutError
    from swerex.runtime.abstract import BashAction, BashInterruptAction, CreateBashSessionRequest

    d = integration.GuestdDeployment()
    await d.start()
    try:
        r = d.runtime
        await r.create_session(CreateBashSessionRequest())
        await r.run_in_session(
            BashAction(command=f"cd {tmp_path}; X=41; greet() {{ read -p 'name? ' n; echo \"hi $n $X $PWD\"; }}")
        )
        obs = await r.run_in_session(BashAction(command="greet", is_interactive_command=True, expect=[r"name\? "]))
        assert obs.expect_string == "name? " and obs.output == ""
        obs = await r.run_in_session(BashAction(command="bob", is_interactive_quit=True, timeout=10))
        assert obs.output == f"hi bob 41 {tmp_path}" and obs.exit_code == 0
        with pytest.raises(CommandTimeoutError):  # as LocalRuntime: the program is still running
            await r.run_in_session(
                BashAction(command="cat", is_interactive_command=True, expect=["never"], timeout=0.2)
            )
        with pytest.raises(integration.SessionBusyError):  # the session's terminal is cat's
            await r.run_in_session(BashAction(command="echo no", timeout=5))
        await r.run_in_session(BashInterruptAction())
        obs = await r.run_in_session(BashAction(command="", is_interactive_quit=True, timeout=10))
        assert obs.exit_code == 130  # cat ended by ctrl-C
        assert (await r.run_in_session(BashAction(command="echo $X; pwd", timeout=10))).output == f"41\n{tmp_path}\n"
    finally:
        await d.stop()
