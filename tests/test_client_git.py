"""client.git (status, changed_files, diff, add, commit) and client.chmod, through exec in a
real guestd (issue 30): typed results, typed errors for bad input, NUL-separated porcelain
(names with newlines, spaces, non-UTF-8 bytes, renames), no shell anywhere, and a hostile
repository's fsmonitor, pager, external diff and textconv do not run."""

from __future__ import annotations

import inspect
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from guestd.client import Client
from guestd.client.git import (
    AsyncGit,
    GitFileStatus,
    GitStatus,
    NoSuchRepo,
    NotAGitRepo,
    NothingToCommit,
    parse_status,
)
from guestd.client.git_sync import Git
from guestd.wire.errors import GuestdError

AUTHOR: dict[str, Any] = {"author_name": "Test Author", "author_email": "author@example.invalid"}


def sh(client: Client, script: str) -> str:
    r = client.exec(["sh", "-c", script])
    assert r.exit_code == 0, r.stderr_text
    return r.stdout_text


@pytest.fixture
def repo(client: Client) -> Iterator[str]:
    path = f"/tmp/guestd-git-{uuid.uuid4().hex[:12]}"
    sh(
        client,
        f"mkdir {path} && cd {path} && git init -q -b main . && git config user.name x && git config user.email x@y",
    )
    try:
        yield path
    finally:
        client.exec(["rm", "-rf", "--", path])


def test_parse_status_records() -> None:
    out = b"## main...origin/main [ahead 2, behind 1]\0 M a file.txt\0R  new\nname\0old name\0?? caf\xe9\0A  added\0"
    st = parse_status(out)
    assert (st.branch, st.upstream, st.ahead, st.behind) == ("main", "origin/main", 2, 1)
    assert st.files == [
        GitFileStatus("a file.txt", " ", "M"),
        GitFileStatus("new\nname", "R", " ", "old name"),
        GitFileStatus("caf\udce9", "?", "?"),
        GitFileStatus("added", "A", " "),
    ]
    assert st.files[3].staged and st.files[2].untracked and not st.clean
    assert parse_status(b"## No commits yet on trunk\0") == GitStatus("trunk", None, 0, 0, [])
    assert parse_status(b"## HEAD (no branch)\0").branch is None


def test_status_diff_commit_round_trip(client: Client, repo: str) -> None:
    git = client.git
    assert git.status(repo) == GitStatus("main", None, 0, 0, [])
    client.write_files({f"{repo}/a.txt": "one\n", f"{repo}/with space.txt": "s\n", f"{repo}/nl\nname": "n\n"})
    assert sorted(git.changed_files(repo)) == ["a.txt", "nl\nname", "with space.txt"]
    assert all(f.untracked for f in git.status(repo).files)
    first = git.commit(repo, "-first, a message that looks like a flag", add_all=True, **AUTHOR)
    assert len(first.sha) == 40 and first.branch == "main"
    assert sh(client, f"cd {repo} && git log -1 --format='%an <%ae>|%s'") == (
        "Test Author <author@example.invalid>|-first, a message that looks like a flag\n"
    )
    assert git.status(repo).clean
    client.write_file(f"{repo}/a.txt", "one\ntwo\n")
    d = git.diff(repo)
    assert "+two" in d.patch and not d.truncated and d.size == len(d.patch.encode())
    assert git.diff(repo, "with space.txt").patch == ""  # limited to the paths given
    assert git.diff(repo, staged=True).patch == ""
    git.add(repo, ["a.txt"])
    assert "+two" in git.diff(repo, staged=True).patch
    assert git.status(repo).files == [GitFileStatus("a.txt", "M", " ")]
    cut = git.diff(repo, staged=True, max_output=10)
    assert cut.truncated and len(cut.patch) == 10
    second = git.commit(repo, "second", **AUTHOR)
    assert second.sha != first.sha
    assert "+two" in git.diff(repo, base=first.sha).patch
    sh(client, f"cd {repo} && git mv a.txt b.txt")
    assert git.status(repo).files == [GitFileStatus("b.txt", "R", " ", "a.txt")]


def test_bad_input_is_a_typed_error(client: Client, repo: str) -> None:
    with pytest.raises(NoSuchRepo) as no_dir:
        client.git.status(f"{repo}-absent")
    assert no_dir.value.code == "not_found"
    plain = f"{repo}-plain"
    client.mkdir(plain)
    try:
        with pytest.raises(NotAGitRepo) as not_git:
            client.git.diff(plain)
        assert not_git.value.code == "bad_request"
    finally:
        client.remove(plain, recursive=True)
    with pytest.raises(NothingToCommit) as nothing:
        client.git.commit(repo, "empty", **AUTHOR)  # nothing staged before the first commit
    assert nothing.value.code == "conflict"
    client.write_file(f"{repo}/f", "x")
    client.git.commit(repo, "one", add_all=True, **AUTHOR)
    with pytest.raises(NothingToCommit):
        client.git.commit(repo, "again", add_all=True, **AUTHOR)
    assert client.git.commit(repo, "empty on purpose", allow_empty=True, **AUTHOR).sha
    with pytest.raises(GuestdError):
        client.git.diff(repo, base="--output=/tmp/x")


def test_a_hostile_repositorys_programs_do_not_run(client: Client, repo: str) -> None:
    """core.fsmonitor, core.pager, diff.external and a textconv driver each name a program that
    would leave a marker; status and diff run none of them. Names that look like flags or shell
    are plain paths after ``--``."""
    marks = f"{repo}-marks"
    sh(
        client,
        f"""mkdir {marks} && cd {repo} &&
        for w in fsmonitor pager external textconv; do
          printf '#!/bin/sh\\ntouch {marks}/%s\\ncat\\n' "$w" > {marks}/$w.sh; chmod +x {marks}/$w.sh
        done
        echo '*.txt diff=conv' > .gitattributes
        echo old > t.txt && git add -A && git commit -qm base --no-verify
        git config core.fsmonitor {marks}/fsmonitor.sh
        git config core.pager {marks}/pager.sh
        git config diff.external {marks}/external.sh
        git config diff.conv.textconv {marks}/textconv.sh
        echo new > t.txt""",
    )
    try:
        odd = ["--output=pwned", "$(touch pwned2)", "-rf"]
        client.write_files({f"{repo}/{name}": "x\n" for name in odd})
        st = client.git.status(repo)
        assert {f.path for f in st.files} >= {"t.txt", *odd}
        d = client.git.diff(repo, "t.txt", *odd)
        assert "-old" in d.patch and "+new" in d.patch  # git's own diff, no textconv
        ran = sorted(str(e.name) for e in client.listdir(marks).entries if not str(e.name).endswith(".sh"))
        assert ran == [], f"the repository ran: {ran}"
        assert not client.exists(f"{repo}/pwned") and not client.exists(f"{repo}/pwned2")
    finally:
        client.remove(marks, recursive=True)


def test_chmod_through_exec(client: Client, repo: str) -> None:
    path = f"{repo}/run.sh"
    client.write_file(path, "#!/bin/sh\n")
    client.chmod(path, 0o750)
    assert client.stat(path).mode & 0o7777 == 0o750
    client.chmod(path, "o+r")
    assert client.stat(path).mode & 0o7777 == 0o754
    with pytest.raises(GuestdError) as absent:
        client.chmod(f"{repo}/absent", 0o644)
    assert absent.value.code == "not_found"
    for bad in ("-R", "", 0o17777):
        with pytest.raises(ValueError):
            client.chmod(path, bad)


def test_the_blocking_git_mirrors_the_async_one() -> None:
    def methods(cls: type) -> dict[str, list[inspect.Parameter]]:
        return {
            name: list(inspect.signature(fn).parameters.values())
            for name, fn in vars(cls).items()
            if callable(fn) and not name.startswith("_")
        }

    assert methods(Git) == methods(AsyncGit) and len(methods(Git)) == 5
