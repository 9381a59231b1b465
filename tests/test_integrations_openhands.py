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
import shutil
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
from openhands.sdk.git.models import GitDiff
from openhands.sdk.testing import TestLLM
from openhands.sdk.workspace import BaseWorkspace, LocalWorkspace

from guestd.integrations.openhands import GuestdWorkspace
from guestd.testing.local import Guestd, StartGuestd

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
    """A result, or the exception's type (the SDK's git calls raise). The messages are each
    implementation's own words; the class is the interface."""
    try:
        return call()
    except GitError as e:
        return (type(e).__name__,)


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
    """Files up to the SDK's 1 MiB limit are diffed, larger ones raise GitPathError on both
    sides; an original past what one guestd reply holds (1 MiB here) comes back whole."""
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
    d = same(local, guest, lambda w: w.git_diff("big/big.txt"))
    assert d.modified.endswith("changed") and len(d.original) > 500_000
    (repo / "huge.txt").write_text(line * 17001)
    with pytest.raises(GitPathError):
        guest.git_diff("big/huge.txt")
    same(local, guest, lambda w: w.git_diff("big/huge.txt"))
    (repo / "huge.txt").write_text("shrunk\n")  # its original (1.1 MB) is more than one reply holds
    d = same(local, guest, lambda w: w.git_diff("big/huge.txt"))
    assert (d.modified, len(d.original)) == ("shrunk", len(line) * 17000 - 1)


# -- names and repositories the SDK's own code gets wrong; a workload standing in for git ------
# File names as bytes: whitespace and quotes that git's text output quotes or splits, a name that
# is not UTF-8, names that look like options or globs.
HOSTILE = {
    "space": b"with space.txt",
    "tab": b"tab\there",
    "newline": b"new\nline",
    "quotes": b"quote\"d'",
    "backslash": b"back\\slash",
    "blanks": b" lead and trail ",
    "latin": "na\u00efve.txt".encode(),
    "bytes": b"bad\xff\xfe.txt",
    "dash": b"-starts-with-dash",
    "glob": b"*glob?[x]",
    "colon": b":colon:",
}


def put(directory: Path, raw: bytes, data: bytes) -> None:
    with open(os.fsencode(directory) + b"/" + raw, "wb") as f:
        f.write(data)


def text_of(data: bytes) -> str:
    """What GitDiff holds for these bytes (the SDK's form: lines joined by \\n)."""
    return "\n".join(data.decode("utf-8", "replace").splitlines())


def test_git_changes_and_diffs_keep_hostile_names_exact(
    pair: tuple[LocalWorkspace, GuestdWorkspace], tmp_path: Path
) -> None:
    """Every name comes back as its bytes (an os str: surrogate escapes where it is not UTF-8)
    and names the same file when passed back to git_diff. The SDK's own code reads git's
    quoted text split on whitespace: it raises for the space in a changed name and returns
    C-quoted names, so there is no LocalWorkspace result to compare with here."""
    _, guest = pair
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    for raw in HOSTILE.values():
        put(repo, raw, b"old " + raw + b"\n")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "one")
    modified = [HOSTILE[k] for k in ("space", "tab", "newline", "quotes", "backslash", "blanks", "bytes")]
    for raw in modified:
        put(repo, raw, b"new\r\n" + raw)
    renamed = b"renamed\n\xfe"
    git(repo, "mv", "--", os.fsdecode(HOSTILE["dash"]), os.fsdecode(renamed))
    os.unlink(os.fsencode(repo) + b"/" + HOSTILE["glob"])
    untracked = [b"untracked \n\xff", b"\x01control"]
    for raw in untracked:
        put(repo, raw, b"u")
    expected = {("UPDATED", os.fsdecode(raw)) for raw in modified} | {
        ("DELETED", os.fsdecode(HOSTILE["dash"])),
        ("ADDED", os.fsdecode(renamed)),
        ("DELETED", os.fsdecode(HOSTILE["glob"])),
        *(("ADDED", os.fsdecode(raw)) for raw in untracked),
    }
    changes = guest.git_changes("repo")
    assert {(c.status.value, str(c.path)) for c in changes} == expected
    assert [str(c.path) for c in changes] == sorted(str(c.path) for c in changes)
    for c in changes:  # each listed name opens its own diff
        d = guest.git_diff(Path("repo") / c.path)
        raw = os.fsencode(str(c.path))
        if raw in modified:  # what is not UTF-8 on disk has no modified text (as in the SDK)
            on_disk = "" if raw == HOSTILE["bytes"] else text_of(b"new\r\n" + raw)
            assert (d.original, d.modified) == (text_of(b"old " + raw), on_disk)
        elif raw == renamed:
            assert (d.original, d.modified) == ("", text_of(b"old " + HOSTILE["dash"]))
        elif raw in (HOSTILE["dash"], HOSTILE["glob"]):
            assert (d.original, d.modified) == (text_of(b"old " + raw), "")
        else:
            assert (d.original, d.modified) == ("", "u")


def test_git_nested_repositories_with_hostile_names(
    pair: tuple[LocalWorkspace, GuestdWorkspace], tmp_path: Path
) -> None:
    """Repositories one level down, named with a newline and with bytes that are not UTF-8, as
    LocalWorkspace finds them; a dangling .git link and a dot-named repository are left out."""
    local, guest = pair
    ws = tmp_path / "ws"
    ws.mkdir()
    for raw in (b"n\nested", b"r\xfe", b"plain", b".hidden"):
        inner = Path(os.fsdecode(os.fsencode(ws) + b"/" + raw))
        inner.mkdir()
        git(inner, "init", "-q")
        (inner / "tracked").write_text("1")
        git(inner, "add", ".")
        git(inner, "commit", "-q", "-m", "c")
        (inner / "tracked").write_text("2")
        (inner / "new").write_text("n")
    (ws / "broken").mkdir()
    (ws / "broken" / ".git").symlink_to("nowhere")
    changes = same(local, guest, lambda w: w.git_changes("ws"))
    assert [(c.status.value, str(c.path)) for c in changes] == [
        ("ADDED", "n\nested/new"),
        ("UPDATED", "n\nested/tracked"),
        ("ADDED", "plain/new"),
        ("UPDATED", "plain/tracked"),
        ("ADDED", os.fsdecode(b"r\xfe/new")),
        ("UPDATED", os.fsdecode(b"r\xfe/tracked")),
    ]


def test_git_diff_never_opens_what_is_not_a_file(pair: tuple[LocalWorkspace, GuestdWorkspace], tmp_path: Path) -> None:
    """A FIFO is reported without being opened (an open would wait for a writer forever); links
    are followed as Path.resolve() follows them; a link loop is GitPathError."""
    local, guest = pair
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "a.txt").write_text("a\n")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "c")
    (repo / "a.txt").write_text("b\n")
    os.mkfifo(repo / "fifo")
    (repo / "link").symlink_to("a.txt")
    (repo / "dir-link").symlink_to(".")
    (repo / "device").symlink_to("/dev/zero")
    (repo / "loop1").symlink_to("loop2")
    (repo / "loop2").symlink_to("loop1")
    assert guest.git_diff("repo/fifo") == GitDiff(modified="", original="")
    assert same(local, guest, lambda w: w.git_diff("repo/link")) == GitDiff(modified="b", original="a")
    assert same(local, guest, lambda w: w.git_diff("repo/dir-link/dir-link/../repo/a.txt")).original == "a"
    assert same(local, guest, lambda w: w.git_diff("repo/device")) == ("GitRepositoryError",)
    with pytest.raises(GitPathError):
        guest.git_diff("repo/loop1")


def test_git_repository_states_as_local_workspace(pair: tuple[LocalWorkspace, GuestdWorkspace], tmp_path: Path) -> None:
    """No commits, an orphan branch, a detached HEAD, an origin whose HEAD is not recorded
    (asked of the remote), binary and CRLF files: the same results as LocalWorkspace."""
    local, guest = pair
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "staged.txt").write_text("s\n")
    git(repo, "add", ".")
    (repo / "loose.txt").write_text("l\n")
    assert len(check_git(local, guest, "repo", ["repo/staged.txt", "repo/loose.txt"])) == 2
    git(repo, "commit", "-q", "-m", "c")
    (repo / "bin").write_bytes(b"\x00\xff\xfe binary")
    (repo / "crlf.txt").write_bytes(b"one\r\ntwo\r\n\r\n")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "d")
    (repo / "bin").write_bytes(b"\x00\xfd changed")
    (repo / "crlf.txt").write_bytes(b"one\rtwo\n")
    check_git(local, guest, "repo", ["repo/bin", "repo/crlf.txt", "repo/staged.txt"])
    git(repo, "checkout", "-q", "--detach")
    (repo / "staged.txt").write_text("detached\n")
    check_git(local, guest, "repo", ["repo/staged.txt"])
    git(repo, "checkout", "-q", "--orphan", "lone")
    check_git(local, guest, "repo", ["repo/staged.txt", "repo/bin"])
    # a clone whose origin/HEAD was dropped: the default branch is asked of origin itself
    seed = tmp_path / "seed"
    seed.mkdir()
    git(seed, "init", "-q")
    (seed / "f").write_text("f\n")
    git(seed, "add", ".")
    git(seed, "commit", "-q", "-m", "seed")
    git(tmp_path, "clone", "-q", str(seed), "clone")
    clone = tmp_path / "clone"
    git(clone, "checkout", "-q", "-b", "work")
    git(clone, "remote", "set-head", "origin", "-d")
    git(clone, "branch", "-q", "-D", "main")  # no local main to fall back on either
    (clone / "extra.txt").write_text("e\n")
    git(clone, "add", ".")
    git(clone, "commit", "-q", "-m", "work")
    changes = check_git(local, guest, "clone", ["clone/extra.txt"])
    assert [(c.status.value, str(c.path)) for c in changes] == [("ADDED", "extra.txt")]


def test_git_type_changes_and_sha256_repositories(pair: tuple[LocalWorkspace, GuestdWorkspace], tmp_path: Path) -> None:
    """Where the SDK's own code fails: a file that became a link (git's status T; the SDK raises
    GitCommandError) is UPDATED, and a SHA-256 repository without commits is compared with its
    own empty tree (the SDK uses SHA-1's)."""
    local, guest = pair
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "t").write_text("file\n")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "c")
    (repo / "t").unlink()
    (repo / "t").symlink_to("elsewhere")
    assert outcome(lambda: local.git_changes("repo")) == ("GitCommandError",)
    assert [(c.status.value, str(c.path)) for c in guest.git_changes("repo")] == [("UPDATED", "t")]
    wide = tmp_path / "wide"
    wide.mkdir()
    git(wide, "init", "-q", "--object-format=sha256")
    (wide / "f").write_text("f\n")
    git(wide, "add", ".")
    assert [(c.status.value, str(c.path)) for c in guest.git_changes("wide")] == [("ADDED", "f")]
    assert guest.git_diff("wide/f") == GitDiff(modified="f", original="")


def test_git_lists_longer_than_one_reply_come_back_whole(fresh_guestd: StartGuestd, tmp_path: Path) -> None:
    """A guestd that returns 4 KiB of a stream per reply: longer git output is read back
    from guestd's spill file (then removed), whole; the lists equal LocalWorkspace's."""
    runtime = tmp_path / "runtime"
    config = tmp_path / "guestd.toml"
    config.write_text(f'runtime_dir = "{runtime}"\n[limits]\nmax_output = 4096\n')
    g = fresh_guestd("--config", str(config))
    work = tmp_path / "work"
    repo = work / "repo"
    repo.mkdir(parents=True)
    git(repo, "init", "-q")
    for i in range(150):
        (repo / f"tracked-file-with-a-rather-long-name-{i:04d}.txt").write_text("1\n")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "c")
    for i in range(150):
        (repo / f"tracked-file-with-a-rather-long-name-{i:04d}.txt").write_text("2\n")
        (repo / f"untracked-file-with-a-rather-long-name-{i:04d}.txt").write_text("u\n")
    (repo / "tracked-file-with-a-rather-long-name-0000.txt").write_text("x" * 20_000)
    with GuestdWorkspace(address=g.address, working_dir=str(work)) as guest:
        local = LocalWorkspace(working_dir=work)
        changes = check_git(local, guest, "repo", ["repo/tracked-file-with-a-rather-long-name-0000.txt"])
    assert len(changes) == 300
    assert list((runtime / "spill").iterdir()) == []


def fake_git(directory: Path, replies: dict[str, bytes]) -> str:
    """A "git" the workload put in its place: for the subcommands in ``replies`` it prints the
    bytes given and exits 0; the others go to the real git."""
    answers = directory / "answers"
    answers.mkdir(exist_ok=True)
    for sub, data in replies.items():
        (answers / sub).write_bytes(data)
    real = shutil.which("git")
    assert real is not None
    fake = directory / "fake-git"
    fake.write_text(f'#!/bin/bash\nif [ -f "{answers}/$1" ]; then cat "{answers}/$1"; exit 0; fi\nexec {real} "$@"\n')
    fake.chmod(0o755)
    return str(fake)


@pytest.mark.parametrize(
    ("call", "sub", "reply"),
    [
        ("changes", "rev-parse", b"not an object id\n"),
        ("changes", "rev-list", b"zz\n"),
        ("changes", "symbolic-ref", b"refs/heads/x\nrefs/heads/y\n"),
        ("changes", "diff", b"Q\0name\0"),
        ("changes", "diff", b"M\0"),
        ("changes", "diff", b"M\0no terminator"),
        ("changes", "diff", b"R100\0only-one\0"),
        ("changes", "ls-files", b"a\0\0b\0"),
        ("diff", "cat-file", b"garbage\n"),
        ("diff", "rev-parse", b"../../etc/passwd\n"),
    ],
)
def test_a_workload_standing_in_for_git_gets_git_command_errors(
    guestd: Guestd, tmp_path: Path, call: str, sub: str, reply: bytes
) -> None:
    """What git prints is checked before it is used: a forged answer is GitCommandError, never
    another exception nor a wrong list, and never makes the host touch a file."""
    from openhands.sdk.git.exceptions import GitCommandError

    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "a.txt").write_text("a\n")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "c")
    (repo / "a.txt").write_text("b\n")
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    fake = fake_git(tmp_path, {sub: reply})
    ws = GuestdWorkspace(address=guestd.address, working_dir=str(tmp_path), git=fake)
    with ws, pytest.raises(GitCommandError):
        if call == "changes":
            ws.git_changes("repo")
        else:
            ws.git_diff("repo/a.txt")
    assert victim.read_text() == "keep me"


def test_git_output_past_its_bound_is_an_error(guestd: Guestd, tmp_path: Path) -> None:
    """A list longer than the host reads back (64 MiB) is GitCommandError, never a cut list."""
    from openhands.sdk.git.exceptions import GitCommandError

    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    answers = tmp_path / "flood"
    answers.write_text(f"#!/bin/bash\nhead -c {64 * 1024 * 1024 + 1} /dev/zero | tr '\\0' 'a'\n")
    answers.chmod(0o755)
    real = shutil.which("git")
    fake = tmp_path / "fake-git"
    fake.write_text(f'#!/bin/bash\nif [ "$1" = ls-files ]; then exec {answers}; fi\nexec {real} "$@"\n')
    fake.chmod(0o755)
    ws = GuestdWorkspace(address=guestd.address, working_dir=str(tmp_path), git=str(fake))
    with ws, pytest.raises(GitCommandError, match="more than"):
        ws.git_changes("repo")


# -- the parsers, without a guest ------------------------------------------------------------
def test_name_status_parser() -> None:
    from openhands.sdk.git.exceptions import GitCommandError

    from guestd.integrations._openhands_git import Ran, parse_name_status, parse_nested_repositories

    ran = Ran(argv=["git", "diff"], cwd="/r", exit_code=0, stdout=b"", stdout_bytes=0, stderr=b"")
    listed = b"M\0a\nb\0R087\0old name\0new\tname\0C100\0src\0copy\0T\0link\0U\0conflict\0A\0\xff\0D\0-x\0"
    assert [(s.value, n) for s, n in parse_name_status(listed, ran)] == [
        ("UPDATED", b"a\nb"),
        ("DELETED", b"old name"),
        ("ADDED", b"new\tname"),
        ("ADDED", b"copy"),
        ("UPDATED", b"link"),
        ("UPDATED", b"conflict"),
        ("ADDED", b"\xff"),
        ("DELETED", b"-x"),
    ]
    assert parse_name_status(b"", ran) == []
    for bad in (b"M\0a", b"X\0a\0", b"M\0\0", b"R100\0a\0", b"MM\0a\0", b"M1234\0a\0", b"\0"):
        with pytest.raises(GitCommandError):
            parse_name_status(bad, ran)
    assert parse_nested_repositories(b"b/.git\0a\n/.git\0\xfe/.git\0b/.git\0", ran) == sorted(
        ["a\n", "b", os.fsdecode(b"\xfe")]
    )
    for bad in (b"x\0", b".hid/.git\0", b"a/b/.git\0", b"/.git\0", b"a/.git"):
        with pytest.raises(GitCommandError):
            parse_nested_repositories(bad, ran)
