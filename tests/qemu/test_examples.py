"""The agent-runtime examples against the baked guest under QEMU: one VM per agent session,
and best-of-N over two clones restored from one saved state.

The minimal image has git (guestd-bake --add) but no pytest: the examples install it the way
an agent runtime would (unpacked into /tmp/agent-deps from this machine's copy).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from examples import best_of_n, demo_repo
from examples.guests import QemuGuest
from examples.openhands_runtime import (
    CmdOutputObservation,
    FileReadObservation,
    GuestdRuntime,
    IPythonRunCellObservation,
    RuntimeConfig,
    scripted_fix,
)
from examples.swe_agent_driver import NO_PUSH, ScriptedModel, SweTools, run_episode
from examples.swe_agent_driver import scripted_fix as swe_script
from tests.qemu.harness import ARTIFACTS, require_qemu

pytestmark = [pytest.mark.qemu, pytest.mark.timeout(900)]  # several VMs per test under TCG
PY = best_of_n.GUEST_PYTHON
REPO = best_of_n.REPO


@pytest.fixture(scope="module")
def image() -> Iterator[tuple[str, str, str]]:
    require_qemu()
    work = tempfile.mkdtemp(prefix="guestd-examples-")
    try:
        kernel, initrd = QemuGuest.image(work)
        yield work, kernel, initrd
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture
def keep_logs(image: tuple[str, str, str], request: pytest.FixtureRequest) -> Iterator[None]:
    failed = request.session.testsfailed
    yield
    if request.session.testsfailed > failed:
        os.makedirs(ARTIFACTS, exist_ok=True)
        for f in os.listdir(image[0]):
            if f.endswith("-console.log"):
                shutil.copy(os.path.join(image[0], f), os.path.join(ARTIFACTS, f"examples-{f}"))


def boot_with_task(image: tuple[str, str, str], tag: str) -> tuple[QemuGuest, dict[str, str]]:
    """A VM for one agent session, with the task repository and pytest in it."""
    work, kernel, initrd = image
    guest = QemuGuest.boot(work, kernel, initrd, tag=tag)
    try:
        with guest.connect() as c:
            demo_repo.create(c, REPO)
            return guest, demo_repo.ensure_pytest(c, PY)
    except BaseException:
        guest.stop()
        raise


def test_openhands_runtime_in_a_guest(image: tuple[str, str, str], keep_logs: None) -> None:
    guest, env = boot_with_task(image, "openhands")
    try:
        rt = GuestdRuntime.start(lambda: guest, RuntimeConfig(env=env, command_timeout_s=300))
    except BaseException:
        guest.stop()
        raise
    try:
        obs = [rt.run_action(a) for a in scripted_fix(PY)]
    finally:
        rt.close()
    assert guest.vm.proc.poll() is not None  # close stopped the session's VM
    ls, first, read, count, _write, imported, last, diffstat = obs
    assert isinstance(ls, CmdOutputObservation) and ls.cwd == REPO
    assert isinstance(first, CmdOutputObservation) and "3 failed, 1 passed" in first.content and first.cwd == REPO
    assert isinstance(read, FileReadObservation) and 'text.split(" ")' in read.content
    assert isinstance(count, IPythonRunCellObservation) and count.content.strip() == "2"
    assert isinstance(imported, IPythonRunCellObservation) and imported.content.strip() == "2"
    assert isinstance(last, CmdOutputObservation) and last.exit_code == 0 and "4 passed" in last.content
    assert isinstance(diffstat, CmdOutputObservation) and "1 file changed" in diffstat.content


def test_swe_agent_driver_in_a_guest(image: tuple[str, str, str], keep_logs: None) -> None:
    guest, env = boot_with_task(image, "swe")
    try:
        with guest.connect() as c:
            remote = "git remote add origin https://example.invalid/textstats.git"
            assert c.exec(["sh", "-c", remote], cwd=REPO, timeout_s=60).exit_code == 0
            tools = SweTools(c, REPO, env=env, timeout_s=300)
            traj = run_episode(ScriptedModel(swe_script(PY)), tools)
            assert traj.exit_status == "submitted" and traj.patch is not None, traj.steps
            assert "5 passed" in traj.steps[4].observation
            assert "new file mode" in traj.patch and "b/tests_regression/test_tabs.py" in traj.patch
            # The patch applies to the original tree (git archive of HEAD) and its tests pass there.
            c.write_file("/tmp/submitted.patch", traj.patch)
            check = (
                "mkdir -p /tmp/fresh && git archive HEAD | tar -x -C /tmp/fresh && cd /tmp/fresh && "
                f"git apply /tmp/submitted.patch && {PY} -m pytest -q -p no:cacheprovider"
            )
            r = c.exec(["sh", "-c", check], cwd=REPO, env=env, timeout_s=600)
            assert r.exit_code == 0 and b"5 passed" in r.stdout, r
            assert tools.shell("git remote get-url --push origin").startswith(NO_PUSH)
            pushed = tools.shell("git push origin HEAD:main")
            assert "[exit code 0]" not in pushed and "no-push" in pushed
            tools.close()
    finally:
        guest.stop()


def test_best_of_n_with_two_clones(image: tuple[str, str, str], keep_logs: None) -> None:
    work, kernel, initrd = image
    names = list(demo_repo.CANDIDATES)[:2]
    warm, results = best_of_n.best_of_n({k: demo_repo.CANDIDATES[k] for k in names}, work, (kernel, initrd))
    print(best_of_n.report(warm, results))
    assert "3 failed" in warm.baseline
    by_name = {r.name: r for r in results}
    assert by_name["split-on-whitespace"].passed and "4 passed" in by_name["split-on-whitespace"].summary
    assert not by_name["strip-first"].passed and by_name["strip-first"].applied
    assert "failed" in by_name["strip-first"].summary
    # Re-seeded and re-identified: each clone has its own hostname, a re-seeded CRNG, and the
    # Python context that came from the one snapshot draws different numbers in each clone.
    assert sorted(r.hostname for r in results) == ["candidate-0", "candidate-1"]
    assert all(r.crng == "done" for r in results)
    assert results[0].random_draw != results[1].random_draw and all(r.random_draw for r in results)
