"""git in the guest, through exec: ``client.git.status(repo)``, ``diff``, ``changed_files``,
``add``, ``commit``, returning typed results (as the sandbox SDKs' ``sandbox.git``).

Every command is an argv list (no shell), paths after ``--``, and runs like any exec: as the
workload user, in its cgroup, under its limits, with a guest timeout. A hostile repository's
own config can still run the workload's code (hooks on commit, a filter, a credential
helper); that code runs as the workload user in the sandbox, never on this host and never as
root. What is cheap to switch off is: ``core.fsmonitor`` (a program run by ``status``/``diff``),
pagers (``GIT_PAGER=cat``, ``--no-pager``), external diff drivers and textconv
(``--no-ext-diff --no-textconv``), colour, prompts (``GIT_TERMINAL_PROMPT=0``) and the
optional index lock a read takes (``GIT_OPTIONAL_LOCKS=0``). Hooks stay: they are the
repository's rules for a commit.

Bad input is a :class:`GitError` (a :class:`~guestd.wire.errors.GuestdError`) with a code:
``not_found`` (:class:`NoSuchRepo`: the directory does not exist), ``bad_request``
(:class:`NotAGitRepo`), ``conflict`` (:class:`NothingToCommit`), else ``io_error`` with git's
own message (:class:`GitCommandError`). Output is bounded by the guest's ``max_output``; a
status longer than that is ``too_large`` rather than a silently partial list.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from guestd.wire.errors import ErrorCode, GuestdError

if TYPE_CHECKING:
    from guestd.client._surface import GitClient
    from guestd.client.results import ExecResult

GIT_TIMEOUT_S = 120.0  # a git command's guest timeout unless a call gives one (hooks included)
GIT_MAX_OUTPUT = 16 * 1024 * 1024  # asked of the guest per stream; its own limit may be lower
# Flags before the subcommand: nothing this repository's config names runs for a read.
GIT_FLAGS = ["--no-pager", "-c", "core.fsmonitor=false", "-c", "color.ui=false", "-c", "core.quotePath=false"]
GIT_ENV = {
    "GIT_PAGER": "cat",
    "PAGER": "cat",
    "GIT_TERMINAL_PROMPT": "0",
    "GIT_OPTIONAL_LOCKS": "0",
    "LC_ALL": "C",  # git's messages in one language: errors are told apart by them
}


class GitError(GuestdError):
    """A git helper's failure; ``code`` says which kind (module doc)."""


class NoSuchRepo(GitError):
    def __init__(self, repo: str) -> None:
        super().__init__(ErrorCode.NOT_FOUND, f"git: {repo}: no such directory in the guest")


class NotAGitRepo(GitError):
    def __init__(self, repo: str) -> None:
        super().__init__(ErrorCode.BAD_REQUEST, f"git: {repo} is not in a git work tree (git init, or clone, first)")


class NothingToCommit(GitError):
    def __init__(self, repo: str) -> None:
        super().__init__(
            ErrorCode.CONFLICT, f"git: nothing to commit in {repo} (add_all=True stages every change; allow_empty=True)"
        )


class GitCommandError(GitError):
    def __init__(self, argv: list[str], result: ExecResult) -> None:
        said = result.stderr_text.strip() or result.stdout_text.strip()
        super().__init__(
            ErrorCode.IO_ERROR,
            f"git {' '.join(argv)}: exit {result.exit_code}: {said[-2000:]}",
            details={"exit_code": result.exit_code, "stderr": result.stderr_text[-4000:]},
        )


@dataclass(frozen=True)
class GitFileStatus:
    """One entry of ``git status``: ``index`` and ``worktree`` are porcelain's X and Y letters
    (``M`` modified, ``A`` added, ``D`` deleted, ``R`` renamed, ``?`` untracked, ``U`` unmerged,
    `` `` unchanged); ``orig_path`` is a rename's or copy's source."""

    path: str
    index: str
    worktree: str
    orig_path: str | None = None

    @property
    def untracked(self) -> bool:
        return self.index == "?"

    @property
    def staged(self) -> bool:
        return self.index not in (" ", "?", "!")


@dataclass(frozen=True)
class GitStatus:
    """``git status`` of a work tree: its branch (None when HEAD is detached), upstream and how
    far ahead/behind it, and every changed path (paths are relative to the top of the tree;
    a name that is not UTF-8 keeps its bytes as surrogate escapes)."""

    branch: str | None
    upstream: str | None
    ahead: int
    behind: int
    files: list[GitFileStatus] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.files


@dataclass(frozen=True)
class GitDiff:
    """A diff's text (``patch`` decoded with replacement); ``truncated`` when the guest kept
    only the first ``max_output`` bytes of ``size``."""

    patch: str
    size: int
    truncated: bool


@dataclass(frozen=True)
class GitCommit:
    """The commit made: its full hash and its branch (None when HEAD is detached)."""

    sha: str
    branch: str | None


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


def parse_status(out: bytes) -> GitStatus:
    """``git status --porcelain=v1 -z --branch`` output as a :class:`GitStatus`. Records are
    NUL-separated; a rename or copy is followed by a record holding its source path."""
    records = out.split(b"\0")
    branch: str | None = None
    upstream: str | None = None
    ahead = behind = 0
    files: list[GitFileStatus] = []
    i = 0
    while i < len(records):
        rec = records[i]
        i += 1
        if not rec:
            continue
        if rec.startswith(b"## "):
            branch, upstream, ahead, behind = _parse_branch(_decode(rec[3:]))
            continue
        if len(rec) < 4 or rec[2:3] != b" ":
            raise GitError(ErrorCode.PROTOCOL_ERROR, f"git status: an entry not in porcelain v1 form: {rec[:80]!r}")
        x, y, path = chr(rec[0]), chr(rec[1]), _decode(rec[3:])
        orig = None
        if x in "RC" or y in "RC":
            orig = _decode(records[i]) if i < len(records) else None
            i += 1
        files.append(GitFileStatus(path, x, y, orig))
    return GitStatus(branch, upstream, ahead, behind, files)


def _parse_branch(head: str) -> tuple[str | None, str | None, int, int]:
    """``main...origin/main [ahead 1, behind 2]``, ``No commits yet on main``, ``HEAD (no branch)``."""
    ahead = behind = 0
    if head.endswith("]") and " [" in head:
        head, counts = head[:-1].rsplit(" [", 1)
        for part in counts.split(", "):
            word, _, n = part.partition(" ")
            if word == "ahead" and n.isdigit():
                ahead = int(n)
            elif word == "behind" and n.isdigit():
                behind = int(n)
    for prefix in ("No commits yet on ", "Initial commit on "):
        if head.startswith(prefix):
            return head[len(prefix) :], None, ahead, behind
    if head.startswith("HEAD (no branch)"):
        return None, None, ahead, behind
    local, _, remote = head.partition("...")
    return local, remote or None, ahead, behind


class AsyncGit:
    """git in the guest for an :class:`~guestd.client.AsyncClient` (``client.git``)."""

    def __init__(self, client: GitClient) -> None:
        self.client = client

    async def _git(
        self,
        repo: str,
        argv: list[str],
        *,
        timeout_s: float | None,
        env: dict[str, str] | None = None,
        ok: tuple[int, ...] = (0,),
    ) -> ExecResult:
        r = await self.client.exec(
            ["git", *GIT_FLAGS, "-C", repo, *argv],
            env={**GIT_ENV, **(env or {})},
            timeout_s=GIT_TIMEOUT_S if timeout_s is None else timeout_s,
            max_output=min(GIT_MAX_OUTPUT, int(self.client.limits.get("max_output", GIT_MAX_OUTPUT))),
        )
        if r.timed_out:
            raise GitError(ErrorCode.TIMEOUT, f"git {argv[0]} in {repo}: not done within its {r.duration_s} s")
        if r.exit_code in ok:
            return r
        raise await self._diagnose(repo, argv, r)

    async def _diagnose(self, repo: str, argv: list[str], r: ExecResult) -> GitError:
        if "not a git repository" in r.stderr_text.lower():
            return NotAGitRepo(repo)
        if "cannot change to" in r.stderr_text:
            try:
                st = await self.client.stat(repo)
            except GuestdError as e:
                if e.code == ErrorCode.NOT_FOUND.value:
                    return NoSuchRepo(repo)
                raise
            if st.type != "dir":
                return GitError(ErrorCode.NOT_A_DIRECTORY, f"git: {repo} is not a directory")
        return GitCommandError(argv, r)

    async def status(self, repo: str, *, timeout_s: float | None = None) -> GitStatus:
        """The work tree's branch and changed files (untracked ones included, ignored not)."""
        r = await self._git(
            repo, ["status", "--porcelain=v1", "-z", "--branch", "--untracked-files=all"], timeout_s=timeout_s
        )
        if r.stdout_dropped:
            raise GitError(ErrorCode.TOO_LARGE, f"git status in {repo}: {r.stdout_bytes} bytes, over max_output")
        return parse_status(r.stdout)

    async def changed_files(self, repo: str, *, timeout_s: float | None = None) -> list[str]:
        """Every path ``status`` lists (staged, unstaged, untracked), relative to the tree's top."""
        return [f.path for f in (await self.status(repo, timeout_s=timeout_s)).files]

    async def diff(
        self,
        repo: str,
        *paths: str,
        staged: bool = False,
        base: str | None = None,
        context_lines: int | None = None,
        max_output: int | None = None,
        timeout_s: float | None = None,
    ) -> GitDiff:
        """``git diff`` of the work tree against the index (``staged``: the index against HEAD;
        ``base``: against that commit), limited to ``paths`` if given; no external diff
        driver or textconv runs. At most ``max_output`` bytes are kept (``truncated``)."""
        argv = ["diff", "--no-ext-diff", "--no-textconv", "--no-color"]
        if staged:
            argv.append("--cached")
        if context_lines is not None:
            argv.append(f"--unified={int(context_lines)}")
        if base is not None:
            if base.startswith("-"):
                raise GitError(ErrorCode.BAD_REQUEST, f"git diff: base {base!r} is not a revision")
            argv.append(base)
        argv += ["--", *paths]
        # Outside a work tree git diff compares any two paths (an implicit --no-index): refuse.
        await self._git(repo, ["rev-parse", "--is-inside-work-tree"], timeout_s=timeout_s)
        r = await self._git(repo, argv, timeout_s=timeout_s)
        kept = r.stdout if max_output is None else r.stdout[:max_output]
        return GitDiff(kept.decode("utf-8", "replace"), r.stdout_bytes, r.stdout_bytes > len(kept))

    async def add(self, repo: str, paths: list[str] | None = None, *, timeout_s: float | None = None) -> None:
        """Stage ``paths`` (None: every change, ``git add -A``)."""
        argv = ["add", "-A"] if paths is None else ["add", "--", *paths]
        await self._git(repo, argv, timeout_s=timeout_s)

    async def commit(
        self,
        repo: str,
        message: str,
        *,
        add_all: bool = False,
        author_name: str | None = None,
        author_email: str | None = None,
        allow_empty: bool = False,
        timeout_s: float | None = None,
    ) -> GitCommit:
        """Commit what is staged (``add_all``: every change first) with ``message``; the author
        (and committer) given, else the repository's configured identity. Nothing staged is
        :class:`NothingToCommit`. The repository's commit hooks run (as the workload user)."""
        if add_all:
            await self.add(repo, timeout_s=timeout_s)
        if not allow_empty:
            # Exit 0: the index equals HEAD (before the first commit: the empty tree).
            staged = await self._git(
                repo, ["diff", "--cached", "--quiet", "--no-ext-diff"], timeout_s=timeout_s, ok=(0, 1)
            )
            if staged.exit_code == 0:
                raise NothingToCommit(repo)
        env: dict[str, str] = {}
        if author_name is not None:
            env["GIT_AUTHOR_NAME"] = env["GIT_COMMITTER_NAME"] = author_name
        if author_email is not None:
            env["GIT_AUTHOR_EMAIL"] = env["GIT_COMMITTER_EMAIL"] = author_email
        argv = ["commit", "--no-edit", "-m", message]
        if allow_empty:
            argv.append("--allow-empty")
        await self._git(repo, argv, timeout_s=timeout_s, env=env)
        head = await self._git(repo, ["rev-parse", "HEAD"], timeout_s=timeout_s)
        branch = await self._git(repo, ["symbolic-ref", "--quiet", "--short", "HEAD"], timeout_s=timeout_s, ok=(0, 1))
        return GitCommit(head.stdout_text.strip(), branch.stdout_text.strip() or None)
