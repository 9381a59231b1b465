"""guestd.integrations.openhands against the real openhands-sdk 1.58.2 (the OpenHands venv
.venv-oh that scripts/test.sh builds with Python >= 3.12; skipped where the SDK is not
installed).

The SDK ships no workspace tests in its package, and its repository's are about its own
LocalWorkspace and agent server. So each case here runs through the SDK's LocalWorkspace
and through GuestdWorkspace on a real guestd (a local one: the same files are on both
sides), and the SDK's own result objects (CommandResult, FileOperationResult, GitChange,
GitDiff, its git exceptions) must be equal; plus the SDK's serialization and
ConversationState persistence of the workspace.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# Before the SDK is imported: no network fetch of LiteLLM's price list, no banner.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("OPENHANDS_SUPPRESS_BANNER", "1")
pytest.importorskip("openhands.sdk")

from openhands.sdk import Agent
from openhands.sdk.conversation.state import ConversationState
from openhands.sdk.git.exceptions import GitError, GitPathError, GitRepositoryError
from openhands.sdk.testing import TestLLM
from openhands.sdk.workspace import BaseWorkspace, LocalWorkspace

from guestd.integrations.openhands import GuestdWorkspace
from guestd.testing.local import Guestd

GIT_ENV = {
    **os.environ,
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@example.invalid",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@example.invalid",
    "GIT_CONFIG_GLOBAL": "/dev/null",
}


@pytest.fixture
def pair(guestd: Guestd, tmp_path: Path) -> Iterator[tuple[LocalWorkspace, GuestdWorkspace]]:
    with GuestdWorkspace(address=guestd.address, working_dir=str(tmp_path)) as ws:
        yield LocalWorkspace(working_dir=tmp_path), ws


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-c", "init.defaultBranch=main", *args],
        cwd=cwd,
        env=GIT_ENV,
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout


def outcome(call: Callable[[], Any]) -> Any:
    """A result, or the exception's type and message (the SDK's git calls raise)."""
    try:
        return call()
    except GitError as e:
        return (type(e).__name__, str(e))


def same(local: BaseWorkspace, guest: BaseWorkspace, call: Callable[[BaseWorkspace], Any]) -> Any:
    a, b = outcome(lambda: call(local)), outcome(lambda: call(guest))
    assert b == a
    return b


# -- the SDK's interface ------------------------------------------------------------------
def test_the_sdk_sees_a_workspace_and_restores_it_from_its_own_state(guestd: Guestd, tmp_path: Path) -> None:
    ws = GuestdWorkspace(address=guestd.address, working_dir="/tmp", token="not-saved")
    assert isinstance(ws, BaseWorkspace)
    dumped = ws.model_dump()
    assert dumped["kind"] == "GuestdWorkspace" and "token" not in dumped
    again = BaseWorkspace.model_validate(dumped)  # the SDK's discriminated union finds the class
    assert isinstance(again, GuestdWorkspace) and again.address == guestd.address
    agent = Agent(llm=TestLLM.from_messages([]), tools=[])
    cid = uuid.uuid4()
    ConversationState.create(id=cid, agent=agent, workspace=ws, persistence_dir=str(tmp_path))
    saved = json.loads((tmp_path / "base_state.json").read_text())
    assert saved["workspace"]["kind"] == "GuestdWorkspace"
    assert saved["workspace"]["address"] == guestd.address and "token" not in saved["workspace"]


# -- commands -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "command",
    [
        "echo hello; echo err >&2",
        "exit 3",
        "pwd",
        "cat no-such-file",
        "printf 'a\\nno newline'",
        "echo $AI_AGENT",
        "kill -9 $$",
        "head -c 100000 /dev/zero | tr '\\0' x",
    ],
)
def test_execute_command_as_local_workspace(pair: tuple[LocalWorkspace, GuestdWorkspace], command: str) -> None:
    local, guest = pair
    r = same(local, guest, lambda w: w.execute_command(command))
    assert r.command == command


def test_execute_command_cwd_and_missing_cwd(pair: tuple[LocalWorkspace, GuestdWorkspace], tmp_path: Path) -> None:
    local, guest = pair
    (tmp_path / "sub").mkdir()
    r = same(local, guest, lambda w: w.execute_command("pwd; ls", cwd=tmp_path / "sub"))
    assert r.stdout == f"{tmp_path / 'sub'}\n"
    # relative to working_dir, as RemoteWorkspace joins it
    assert guest.execute_command("pwd", cwd="sub").stdout == f"{tmp_path / 'sub'}\n"
    r = guest.execute_command("true", cwd="no-such-dir")
    assert r.exit_code == -1 and not r.timeout_occurred and "no-such-dir" in r.stderr


def test_timeout_ends_the_tree_and_keeps_the_output(pair: tuple[LocalWorkspace, GuestdWorkspace]) -> None:
    _, guest = pair
    started = time.monotonic()
    r = guest.execute_command("echo started; sleep 30 & sleep 30", timeout=1)
    assert time.monotonic() - started < 15
    assert (r.exit_code, r.timeout_occurred, r.stdout) == (-1, True, "started\n")
    assert guest.execute_command("echo next").stdout == "next\n"


# -- files --------------------------------------------------------------------------------
def test_upload_and_download(pair: tuple[LocalWorkspace, GuestdWorkspace], tmp_path: Path) -> None:
    local, guest = pair
    src = tmp_path / "tool.sh"
    payload = b"#!/bin/sh\necho tool\n" + bytes(range(256)) * 4000
    src.write_bytes(payload)
    src.chmod(0o750)
    up = guest.file_upload(src, "deep/er/tool.sh")
    assert up.success and up.file_size == len(payload) and up.error is None
    assert up.destination_path == str(tmp_path / "deep/er/tool.sh")
    assert (tmp_path / "deep/er/tool.sh").read_bytes() == payload
    assert (tmp_path / "deep/er/tool.sh").stat().st_mode & 0o777 == 0o750
    down = guest.file_download("deep/er/tool.sh", tmp_path / "back" / "tool.sh")
    assert down.success and down.file_size == len(payload)
    assert (tmp_path / "back" / "tool.sh").read_bytes() == payload
    assert (tmp_path / "back" / "tool.sh").stat().st_mode & 0o777 == 0o750
    ref = local.file_upload(src, tmp_path / "local-copy.sh")
    assert (ref.success, ref.file_size) == (up.success, up.file_size)


def test_upload_and_download_failures_are_results(pair: tuple[LocalWorkspace, GuestdWorkspace], tmp_path: Path) -> None:
    local, guest = pair
    for w in (local, guest):
        r = w.file_upload(tmp_path / "missing", tmp_path / "x")
        assert not r.success and r.error
        r = w.file_download(tmp_path / "missing", tmp_path / "y")
        assert not r.success and r.error
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


# -- git ----------------------------------------------------------------------------------
def check_git(local: BaseWorkspace, guest: BaseWorkspace, root: str, files: list[str]) -> list[Any]:
    """git_changes of ``root`` and git_diff of each file: the same through both."""
    changes = same(local, guest, lambda w: w.git_changes(root))
    for f in files:

        def diff(w: BaseWorkspace, f: str = f) -> Any:
            return w.git_diff(f)

        same(local, guest, diff)
    return changes  # type: ignore[no-any-return]


def test_git_without_remote(pair: tuple[LocalWorkspace, GuestdWorkspace], tmp_path: Path) -> None:
    local, guest = pair
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    for name in ("a.txt", "b.txt", "c.txt", "old.txt"):
        (repo / name).write_text(f"{name}\nline 2\n")
    (repo / "sub").mkdir()
    (repo / "sub" / "s.txt").write_text("s\n")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "one")
    (repo / "a.txt").write_text("a changed\n")
    (repo / "b.txt").unlink()
    git(repo, "mv", "old.txt", "new.txt")
    (repo / "untracked.txt").write_text("new\n")
    (repo / "staged.txt").write_text("staged\n")
    git(repo, "add", "staged.txt")
    (repo / "sub" / "s.txt").write_text("s changed\n")
    files = ["repo/a.txt", "repo/b.txt", "repo/new.txt", "repo/old.txt", "repo/untracked.txt", "repo/c.txt"]
    changes = check_git(local, guest, "repo", files)
    assert {(c.status.value, str(c.path)) for c in changes} >= {
        ("UPDATED", "a.txt"),
        ("DELETED", "b.txt"),
        ("ADDED", "untracked.txt"),
        ("ADDED", "staged.txt"),
        ("UPDATED", "sub/s.txt"),
    }
    sub = check_git(local, guest, "repo/sub", ["repo/sub/s.txt"])
    assert [(c.status.value, str(c.path)) for c in sub] == [("UPDATED", "s.txt")]
    assert guest.git_diff("repo/a.txt").original == "a.txt\nline 2"
    # committed work on a branch forked off local main stays visible
    git(repo, "checkout", "-q", "-b", "feature")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "two")
    assert check_git(local, guest, "repo", files)


def test_git_with_origin(pair: tuple[LocalWorkspace, GuestdWorkspace], tmp_path: Path) -> None:
    local, guest = pair
    seed = tmp_path / "seed"
    seed.mkdir()
    git(seed, "init", "-q")
    (seed / "f.py").write_text("x = 1\n")
    git(seed, "add", ".")
    git(seed, "commit", "-q", "-m", "seed")
    git(tmp_path, "clone", "-q", "--bare", str(seed), "origin.git")
    git(tmp_path, "clone", "-q", str(tmp_path / "origin.git"), "clone")
    clone = tmp_path / "clone"
    git(clone, "checkout", "-q", "-b", "work")
    (clone / "f.py").write_text("x = 2\n")
    (clone / "g.py").write_text("y = 1\n")
    git(clone, "add", ".")
    git(clone, "commit", "-q", "-m", "work")
    files = ["clone/f.py", "clone/g.py"]
    pushed_before = check_git(local, guest, "clone", files)  # merge base with origin/main
    assert {str(c.path) for c in pushed_before} == {"f.py", "g.py"}
    git(clone, "push", "-q", "origin", "work")
    assert check_git(local, guest, "clone", files) == pushed_before  # fully pushed and clean
    (clone / "f.py").write_text("x = 3\n")
    dirty = check_git(local, guest, "clone", files)  # dirty: against its own upstream
    assert [(c.status.value, str(c.path)) for c in dirty] == [("UPDATED", "f.py")]


def test_git_nested_repositories_and_errors(pair: tuple[LocalWorkspace, GuestdWorkspace], tmp_path: Path) -> None:
    local, guest = pair
    ws = tmp_path / "ws"
    for name in ("one", "two"):
        r = ws / name
        r.mkdir(parents=True)
        git(r, "init", "-q")
        (r / "tracked").write_text(name)
        if name == "one":
            git(r, "add", ".")
            git(r, "commit", "-q", "-m", "c")
            (r / "tracked").write_text("changed")
        (r / "extra").write_text("e")
    changes = check_git(local, guest, "ws", ["ws/one/tracked", "ws/two/tracked", "ws/two/extra"])
    assert [str(c.path) for c in changes] == ["one/extra", "one/tracked", "two/extra", "two/tracked"]
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "f").write_text("f")
    assert check_git(local, guest, "plain", [])[0] == "GitRepositoryError"
    assert same(local, guest, lambda w: w.git_diff("plain/f"))[0] == "GitRepositoryError"
    assert same(local, guest, lambda w: w.git_diff("ws/one/missing"))[0] == "GitPathError"
    assert same(local, guest, lambda w: w.git_changes("no-such-dir"))[0] == "GitRepositoryError"
    with pytest.raises(GitRepositoryError):
        guest.git_changes("plain")


def test_git_diff_of_large_files(pair: tuple[LocalWorkspace, GuestdWorkspace], tmp_path: Path) -> None:
    """Past what exec keeps of stdout the script's reply comes back through a file, which is
    removed; past the SDK's 1 MB limit both raise GitPathError."""
    local, guest = pair
    repo = tmp_path / "big"
    repo.mkdir()
    git(repo, "init", "-q")
    line = "0123456789abcdef" * 4 + "\n"
    (repo / "big.txt").write_text(line * 9000)  # ~585 KB
    (repo / "huge.txt").write_text(line * 17000)  # ~1.1 MB
    (repo / "mid.txt").write_text(line * 1500)  # ~100 KB: printed, more than exec keeps by default
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "c")
    (repo / "big.txt").write_text(line * 8999 + "changed\n")
    (repo / "mid.txt").write_text(line * 1499 + "changed\n")
    assert same(local, guest, lambda w: w.git_diff("big/mid.txt")).modified.endswith("changed")
    spills = set(Path("/tmp").glob("guestd-oh-git-*.json"))
    d = same(local, guest, lambda w: w.git_diff("big/big.txt"))
    assert d.modified.endswith("changed") and len(d.original) > 500_000
    assert set(Path("/tmp").glob("guestd-oh-git-*.json")) == spills
    (repo / "huge.txt").write_text(line * 17001)
    with pytest.raises(GitPathError):
        guest.git_diff("big/huge.txt")
    same(local, guest, lambda w: w.git_diff("big/huge.txt"))


def test_a_workload_standing_in_for_the_git_script_cannot_make_the_host_remove_a_file(
    guestd: Guestd, tmp_path: Path
) -> None:
    """The git script runs as the workload, which can replace it (here: the guest's "python").
    Its reply once named the file the host then downloaded (unbounded) and removed through
    guestd: any file guestd may remove. Now only the file the host named is read (bounded)
    and removed; another name, or a reply that is not the script's JSON, is GitCommandError."""
    from openhands.sdk.git.exceptions import GitCommandError

    victim = tmp_path / "victim"
    victim.write_text("keep me")
    fake = tmp_path / "fake-python"
    replies = (
        json.dumps({"file": str(victim)}),
        "[1, 2]",
        "not json",
        json.dumps({"ok": [["X", "a"]]}),
        json.dumps({"nothing": 1}),
        json.dumps({"error": "not an object"}),
    )
    for reply in replies:
        fake.write_text(f"#!/bin/sh\ncat <<'EOF'\n{reply}\nEOF\n")
        fake.chmod(0o755)
        ws = GuestdWorkspace(address=guestd.address, working_dir=str(tmp_path), python=str(fake))
        with ws, pytest.raises(GitCommandError):
            ws.git_changes(".")
    assert victim.read_text() == "keep me"
