"""The agent-runtime examples against a real guestd on this machine, driven by scripted
stand-ins for the model that fix a real bug in a real git repository until its pytest passes.
(The same examples run against the baked QEMU guest in tests/qemu/test_examples.py.)"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator

import psutil
import pytest

from examples import demo_repo
from examples.guests import LocalGuest
from examples.openhands_runtime import (
    CmdOutputObservation,
    CmdRunAction,
    ErrorObservation,
    FileReadAction,
    FileReadObservation,
    FileWriteAction,
    GuestdRuntime,
    IPythonRunCellAction,
    IPythonRunCellObservation,
    Observation,
    RuntimeConfig,
    scripted_fix,
    tail_text,
)
from examples.swe_agent_driver import ScriptedModel, SweTools, ToolCall, run_episode
from examples.swe_agent_driver import scripted_fix as swe_script

PY = shlex.quote(sys.executable)  # this venv's python has pytest; the QEMU guest installs it


def cmd(obs: Observation) -> CmdOutputObservation:
    assert isinstance(obs, CmdOutputObservation), obs
    return obs


def cell(obs: Observation) -> IPythonRunCellObservation:
    assert isinstance(obs, IPythonRunCellObservation), obs
    return obs


@pytest.fixture
def runtime() -> Iterator[GuestdRuntime]:
    rt = GuestdRuntime.start(LocalGuest)
    try:
        demo_repo.create(rt.client, f"{rt.guest.workspace}/textstats")
        yield rt
    finally:
        rt.close()


def test_tail_text_counts_every_dropped_byte_and_never_splits_a_character() -> None:
    data = "é".encode() * 10  # 20 bytes, 2 per character
    text, dropped = tail_text(data, limit=5, dropped_before=100)
    assert text.endswith("éé") and "\ufffd" not in text  # 5 bytes would start mid-character: 4 kept
    assert dropped == 116 and "the first 116 bytes were dropped, the last 4 are shown" in text
    assert tail_text(b"short", limit=10) == ("short", 0)


def test_openhands_runtime_fixes_the_bug_with_scripted_actions(runtime: GuestdRuntime) -> None:
    obs = [runtime.run_action(a) for a in scripted_fix(PY)]
    ls, first_pytest, read, count, write, imported, last_pytest, diffstat = obs
    assert cmd(ls).cwd.endswith("/textstats") and "textstats.py" in cmd(ls).content
    # cd persisted into the next action (a new shell would be in the workspace and find no tests)
    assert "3 failed, 1 passed" in cmd(first_pytest).content and cmd(first_pytest).cwd == cmd(ls).cwd
    assert isinstance(read, FileReadObservation) and 'text.split(" ")' in read.content and read.dropped_bytes == 0
    assert cell(count).status == "ok" and cell(count).content.strip() == "2"
    assert "Wrote 282 bytes" in write.content
    assert cell(imported).content.strip() == "2"  # the fixed module, imported in the kernel
    assert cmd(last_pytest).exit_code == 0 and "4 passed" in cmd(last_pytest).content
    assert "1 file changed, 3 insertions(+), 3 deletions(-)" in cmd(diffstat).content
    # One kernel for the whole session: a variable from the fourth action is still there.
    assert cell(runtime.run_action(IPythonRunCellAction("len(src) > 100"))).content.strip() == "True"


def test_observations_are_tail_truncated_and_say_how_much_was_dropped(runtime: GuestdRuntime) -> None:
    runtime.config.max_observation_bytes = 1000
    total = len("".join(f"{i}\n" for i in range(1, 100001)).encode())
    o = cmd(runtime.run_action(CmdRunAction("seq 1 100000")))
    assert o.exit_code == 0 and o.dropped_bytes == total - 1000
    assert f"the first {total - 1000} bytes were dropped, the last 1000 are shown" in o.content
    assert o.content.split("...]\n", 1)[1].endswith("99999\n100000\n")
    c = cell(runtime.run_action(IPythonRunCellAction("print('x' * 50000)")))
    assert c.dropped_bytes == 50001 - 1000 and "the first 49001 bytes were dropped" in c.content
    small = cmd(runtime.run_action(CmdRunAction("echo fits")))
    assert small.dropped_bytes == 0 and "truncated" not in small.content
    big = runtime.guest.workspace + "/big.txt"
    runtime.client.write_file(big, "".join(f"line {i}\n" for i in range(5000)))
    r = runtime.run_action(FileReadAction(big, start=10, end=12))
    assert isinstance(r, FileReadObservation) and r.content == "line 10\nline 11\n"
    r = runtime.run_action(FileReadAction(big))
    assert isinstance(r, FileReadObservation) and r.content.startswith("line 0\n") and r.dropped_bytes > 0
    assert f"{r.dropped_bytes} more bytes are not shown" in r.content


def test_every_action_has_a_timeout_and_the_session_survives_it(runtime: GuestdRuntime) -> None:
    cmd(runtime.run_action(CmdRunAction("cd textstats && export KEEP=1")))
    o = cmd(runtime.run_action(CmdRunAction("echo before; sleep 30; echo never", timeout=1)))
    assert o.timed_out and o.exit_code == -1 and "before" in o.content and "never" not in o.content
    assert "timed out after 1 s" in o.content
    after = cmd(runtime.run_action(CmdRunAction("pwd; echo $KEEP")))
    assert after.content.split() == [f"{runtime.guest.workspace}/textstats", "1"]
    assert cell(runtime.run_action(IPythonRunCellAction("kept = 41"))).status == "ok"
    slow = cell(runtime.run_action(IPythonRunCellAction("import time\ntime.sleep(30)", timeout=1)))
    assert slow.status == "timeout" and "timed out after 1 s" in slow.content
    assert cell(runtime.run_action(IPythonRunCellAction("kept + 1"))).content.strip() == "42"


def test_errors_come_back_as_typed_observations(runtime: GuestdRuntime) -> None:
    missing = runtime.run_action(FileReadAction("no/such/file.txt"))
    assert isinstance(missing, ErrorObservation) and missing.error_code == "not_found"
    folder = runtime.run_action(FileReadAction(runtime.guest.workspace))
    assert isinstance(folder, ErrorObservation) and "not a file" in folder.content
    w = runtime.run_action(FileWriteAction("new/dir/notes.md", "hello\n"))
    assert runtime.client.read_file(f"{runtime.guest.workspace}/new/dir/notes.md") == b"hello\n", w
    err = cell(runtime.run_action(IPythonRunCellAction("1 / 0")))
    assert err.status == "error" and "ZeroDivisionError" in err.content
    cell(runtime.run_action(IPythonRunCellAction("lost = 1")))
    died = cell(runtime.run_action(IPythonRunCellAction("import os\nos._exit(3)")))
    assert died.status == "died" and "kernel died" in died.content and "restarted" in died.content
    again = cell(runtime.run_action(IPythonRunCellAction("'lost' in globals(), 6 * 7")))
    assert again.status == "ok" and again.content.strip() == "(False, 42)"  # a new kernel, same session


def test_close_always_tears_the_guest_down() -> None:
    rt = GuestdRuntime.start(LocalGuest)
    assert isinstance(rt.guest, LocalGuest)
    guestd = psutil.Process(rt.guest.proc.pid)
    kernel = next(c.pid for c in rt.client.code_list() if c.id == rt.context_id and c.pid is not None)
    bash = next(s.pid for s in rt.client.shell_list() if s.id == rt.shell_id)
    sessdir = rt.guest.dir
    rt.close()
    rt.close()  # idempotent
    assert not guestd.is_running() and not os.path.exists(sessdir)
    for pid in (kernel, bash):
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    closed = rt.run_action(CmdRunAction("true"))
    assert isinstance(closed, ErrorObservation) and closed.error_code == "closed"

    # A guest that died under the runtime is still stopped and reaped, and close does not raise.
    rt = GuestdRuntime.start(LocalGuest, RuntimeConfig(command_timeout_s=5))
    assert isinstance(rt.guest, LocalGuest)
    os.kill(rt.guest.proc.pid, signal.SIGKILL)
    rt.close()
    assert rt.guest.proc.returncode == -signal.SIGKILL


def test_swe_agent_driver_fixes_the_bug_and_submits_a_patch_that_applies() -> None:
    guest = LocalGuest()
    try:
        with guest.connect() as c:
            repo = f"{guest.workspace}/textstats"
            origin = f"{guest.workspace}/origin.git"
            demo_repo.create(c, repo)
            setup = f"git init -q --bare {origin} && git remote add origin {origin} && git push -q origin HEAD:main"
            assert c.exec(["sh", "-c", setup], cwd=repo, timeout_s=60).exit_code == 0
            refs = c.exec(["git", "-C", origin, "for-each-ref"], timeout_s=60).stdout

            tools = SweTools(c, repo)
            traj = run_episode(ScriptedModel(swe_script(PY)), tools)
            assert traj.exit_status == "submitted" and traj.patch is not None
            assert "1 failed, 1 passed" in traj.steps[0].observation  # reproduced first (-x)
            assert "5 passed" in traj.steps[4].observation and "[exit code 0]" in traj.steps[4].observation
            patch = traj.patch
            assert "new file mode 100644" in patch and "b/tests_regression/test_tabs.py" in patch
            assert "+    return len(text.split())" in patch and "__pycache__" not in patch

            # The patch is real: applied to a fresh checkout of the original commit, the tests pass.
            sub = f"{guest.dir}/submitted.patch"
            c.write_file(sub, patch)
            check = f"git clone -q -b main {origin} fresh && cd fresh && git apply {sub} && {PY} -m pytest -q"
            r = c.exec(["sh", "-c", check], cwd=guest.workspace, timeout_s=300)
            assert r.exit_code == 0 and b"5 passed" in r.stdout, r

            # Nothing pushes: not the existing remote, not one the agent adds itself.
            pushed = tools.shell("git push origin HEAD:main")
            assert "[exit code 0]" not in pushed and "no-push" in pushed
            pushed = tools.shell(f"git remote add mine {origin} && git push mine HEAD:refs/heads/x")
            assert "[exit code 0]" not in pushed
            assert c.exec(["git", "-C", origin, "for-each-ref"], timeout_s=60).stdout == refs

            assert "unknown tool" in tools.dispatch(ToolCall("rm_rf", {}))
            assert "needs the argument" in tools.dispatch(ToolCall("shell", {}))
            busy = run_episode(ScriptedModel([ToolCall("shell", {"command": "true"})] * 5), tools, max_steps=3)
            assert busy.exit_status == "max_steps" and busy.patch is None and len(busy.steps) == 3
            tools.close()
    finally:
        guest.stop()
    assert guest.proc.returncode is not None


def test_the_demos_run_as_documented() -> None:
    for mod, says in (("examples.openhands_runtime", "tests pass"), ("examples.swe_agent_driver", "submitted;")):
        r = subprocess.run(
            [sys.executable, "-m", mod], capture_output=True, text=True, timeout=600, cwd=demo_repo_root()
        )
        assert r.returncode == 0 and says in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


def demo_repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(demo_repo.__file__)))


def test_ensure_pytest_installs_it_for_a_python_that_lacks_it() -> None:
    bare = next((p for p in ("/usr/bin/python3",) if os.path.exists(p)), None)
    if bare is None or subprocess.run([bare, "-c", "import pytest"], capture_output=True).returncode == 0:
        pytest.skip("needs a python3 without pytest")
    guest = LocalGuest()
    try:
        with guest.connect() as c:
            env = demo_repo.ensure_pytest(c, bare, deps_dir=f"{guest.dir}/deps dir")
            assert env == {"PYTHONPATH": f"{guest.dir}/deps dir"}
            r = c.exec([bare, "-m", "pytest", "--version"], env=env, timeout_s=60)
            assert r.exit_code == 0 and b"pytest" in r.stdout + r.stderr, r
            assert demo_repo.ensure_pytest(c, sys.executable) == {}  # already there: nothing to do
    finally:
        guest.stop()
