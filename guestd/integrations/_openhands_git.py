"""What OpenHands' ``get_git_changes`` and ``get_git_diff`` (openhands-sdk 1.58.2,
``openhands/sdk/git/git_changes.py``, ``git_diff.py``, ``utils.py``) compute, as one
standard-library script that runs in the guest (``python3 -c SOURCE changes|diff PATH``).

OpenHands runs that code where the files are: in process for ``LocalWorkspace``, in the
agent server for ``RemoteWorkspace``. A guest has no SDK (and no pydantic), so the same
steps, in the same order, with the same git commands, are here; the host rebuilds the
SDK's models and exceptions from the JSON this prints (``{"ok": ...}`` or ``{"error":
{"type", "message", ...}}``). tests/test_integrations_openhands.py compares the two on
the same repositories (no remote, pushed branches, renames, nested repositories...).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

GIT_EMPTY_TREE_HASH = "4b825dc642cb6eb9a060e54bf8d69288fbee4904"
MAX_FILE_SIZE_FOR_GIT_DIFF = 1024 * 1024
INLINE_REPLY = 256 * 1024  # bytes of JSON printed; a longer reply goes to a file the host reads and removes
STATUS = {"M": "UPDATED", "A": "ADDED", "D": "DELETED", "U": "UPDATED"}


class GitFailure(Exception):
    """One of the SDK's git exceptions, by name (``GitRepositoryError``, ``GitCommandError``,
    ``GitPathError``), with the fields the SDK's carries."""

    def __init__(self, kind: str, message: str, **fields: Any) -> None:
        super().__init__(message)
        self.kind = kind
        self.fields = fields


def git(args: list[str], cwd: Path | str, *, strip: bool = True) -> str:
    """``run_git_command``: the output, or ``GitCommandError`` on a non-zero exit."""
    try:
        r = subprocess.run(args, cwd=cwd, capture_output=True, text=True, errors="replace", timeout=30, check=False)
    except subprocess.TimeoutExpired:
        raise GitFailure(
            "GitCommandError", f"Git command timed out: {' '.join(args)}", command=args, exit_code=-1
        ) from None
    except FileNotFoundError:
        raise GitFailure(
            "GitCommandError", "Git command not found. Is git installed?", command=args, exit_code=-1
        ) from None
    if r.returncode != 0:
        raise GitFailure(
            "GitCommandError",
            f"Git command failed: {' '.join(args)}",
            command=args,
            exit_code=r.returncode,
            stderr=r.stderr.strip(),
        )
    return r.stdout.strip() if strip else r.stdout


def probe(args: list[str], repo: Path) -> str | None:
    try:
        return git(["git", "--no-pager", *args], repo) or None
    except GitFailure:
        return None


def validate(repo_dir: Path | str) -> Path:
    repo = Path(repo_dir).resolve()
    if not repo.exists():
        raise GitFailure("GitRepositoryError", f"Directory does not exist: {repo}")
    if not repo.is_dir():
        raise GitFailure("GitRepositoryError", f"Path is not a directory: {repo}")
    try:
        git(["git", "rev-parse", "--git-dir"], repo)
    except GitFailure:
        raise GitFailure("GitRepositoryError", f"Not a git repository: {repo}") from None
    return repo


def remote_default_branch(repo: Path) -> str | None:
    symref = probe(["rev-parse", "--abbrev-ref", "origin/HEAD"], repo) or ""
    if symref.startswith("origin/") and len(symref) > len("origin/"):
        return symref[len("origin/") :]
    try:
        info = git(["git", "--no-pager", "remote", "show", "origin"], repo)
    except GitFailure:
        return None
    for line in info.splitlines():
        if "HEAD branch:" in line:
            branch = line.split(":")[-1].strip()
            return branch if branch and branch != "(unknown)" else None
    return None


def has_tracked_changes(repo: Path) -> bool:
    try:
        return bool(git(["git", "--no-pager", "status", "--porcelain", "--untracked-files=no"], repo))
    except GitFailure:
        return True  # the SDK's fail-safe: keep comparing against the upstream


def display_base_ref(repo: Path) -> str:
    """``get_valid_ref(purpose="display")`` of a repository with commits."""
    head = probe(["rev-parse", "--verify", "HEAD"], repo)
    branch = probe(["rev-parse", "--abbrev-ref", "HEAD"], repo)
    branch = None if branch == "HEAD" else branch
    if branch is not None:
        upstream = probe(["rev-parse", "--verify", f"origin/{branch}"], repo)
        if upstream is not None and (upstream != head or has_tracked_changes(repo)):
            return upstream
    default = remote_default_branch(repo)
    if default is not None:
        base = probe(["merge-base", "HEAD", f"origin/{default}"], repo)
        if base is not None:
            return base
        tip = probe(["rev-parse", "--verify", f"origin/{default}"], repo)
        if tip is not None:
            return tip
    else:
        for local in ("main", "master"):
            sha = probe(["rev-parse", "--verify", local], repo)
            if sha is not None:
                if local != branch:
                    base = probe(["merge-base", "HEAD", local], repo)
                    if base is not None and base == sha:
                        return base
                break
    return head if head is not None else GIT_EMPTY_TREE_HASH


def valid_ref(repo: Path) -> str:
    try:
        count = git(["git", "--no-pager", "rev-list", "--count", "--all"], repo)
    except GitFailure:
        count = "0"
    if count.strip() == "0":
        return GIT_EMPTY_TREE_HASH
    return display_base_ref(repo)


def parse_name_status(lines: list[str]) -> list[tuple[str, str]]:
    """``_parse_name_status``: renames as DELETED + ADDED, copies as ADDED."""
    out: list[tuple[str, str]] = []
    cmd = ["git", "diff", "--name-status"]
    for line in lines:
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) < 2:
            raise GitFailure("GitCommandError", f"Unexpected git diff output format: {line}", command=cmd, exit_code=0)
        status = parts[0].strip()
        if status.startswith("R") and len(parts) == 3:
            out += [("DELETED", parts[1].strip()), ("ADDED", parts[2].strip())]
            continue
        if status.startswith("C") and len(parts) == 3:
            out.append(("ADDED", parts[2].strip()))
            continue
        if len(parts) != 2:
            raise GitFailure("GitCommandError", f"Unexpected git diff output format: {line}", command=cmd, exit_code=0)
        status = {"??": "A", "*": "M"}.get(status, status)
        if status not in STATUS:
            raise GitFailure("GitCommandError", f"Unexpected git status: {status}", command=cmd, exit_code=0)
        out.append((STATUS[status], parts[1].strip()))
    return out


def changes_in_repo(repo_dir: Path | str) -> list[tuple[str, str]]:
    repo = validate(repo_dir)
    ref = valid_ref(repo)
    diff = git(["git", "--no-pager", "diff", "--name-status", "--relative", ref], repo)
    changes = parse_name_status(diff.splitlines() if diff else [])
    try:
        untracked = git(["git", "--no-pager", "ls-files", "--others", "--exclude-standard"], repo)
    except GitFailure:
        untracked = ""
    changes += [("ADDED", p.strip()) for p in untracked.splitlines() if p.strip()]
    return changes


def git_changes(cwd: str) -> list[tuple[str, str]]:
    """``get_git_changes(cwd)``: the repository at ``cwd`` and those one level below it."""
    nested = {os.path.dirname(f)[2:] for f in glob.glob("./*/.git", root_dir=cwd, recursive=True)}
    base_error: GitFailure | None = None
    try:
        changes = changes_in_repo(cwd)
    except GitFailure as e:
        if e.kind != "GitRepositoryError" or not nested:
            raise
        base_error, changes = e, []
    changes = [c for c in changes if not any(Path(c[1]).is_relative_to(d) for d in nested)]
    found = False
    for d in nested:
        try:
            inner = changes_in_repo(str(Path(cwd, d)))
        except GitFailure:
            continue
        found = True
        changes += [(status, str(Path(d) / path)) for status, path in inner]
    if base_error is not None and not found:
        raise base_error
    return sorted(changes, key=lambda c: str(Path(c[1])))


def closest_repo(path: Path) -> Path | None:
    current = path.resolve()
    while True:
        if (current / ".git").exists():
            return current
        if current.parent == current:
            return None
        current = current.parent


def git_diff(file: str) -> dict[str, str]:
    """``get_git_diff(file)``: the file at the display base ref and now."""
    path = Path(os.getcwd(), file).resolve()
    missing = GitFailure("GitPathError", f"File does not exist: {path}")
    deleted = not path.exists()
    try:
        size = 0 if deleted else os.path.getsize(path)
    except OSError:
        raise GitFailure("GitPathError", f"Cannot access file: {path}") from None
    if size > MAX_FILE_SIZE_FOR_GIT_DIFF:
        raise GitFailure(
            "GitPathError", f"File too large for git diff: {size} bytes (max: {MAX_FILE_SIZE_FOR_GIT_DIFF} bytes)"
        )
    found = closest_repo(path)
    if found is None:
        if deleted:
            raise missing
        raise GitFailure("GitRepositoryError", f"File is not in a git repository: {path}")
    repo = validate(found)
    rev = valid_ref(repo)
    try:
        relative = path.relative_to(repo)
    except ValueError:
        raise GitFailure("GitPathError", f"File is not within git repository: {path}") from None
    if deleted:
        spec = f"{rev}:{relative.as_posix()}"
        try:
            base_size = (
                int(git(["git", "cat-file", "-s", spec], repo))
                if git(["git", "cat-file", "-t", spec], repo) == "blob"
                else None
            )
        except (GitFailure, ValueError):
            base_size = None
        if base_size is None:
            raise missing
        if base_size > MAX_FILE_SIZE_FOR_GIT_DIFF:
            raise GitFailure(
                "GitPathError",
                f"File too large for git diff: {base_size} bytes (max: {MAX_FILE_SIZE_FOR_GIT_DIFF} bytes)",
            )
    try:
        original = "\n".join(git(["git", "show", f"{rev}:{relative}"], repo, strip=False).splitlines())
    except GitFailure:
        original = ""
    if deleted:
        return {"modified": "", "original": original}
    try:
        with open(path, encoding="utf-8") as f:
            modified = "\n".join(f.read().splitlines())
    except (OSError, UnicodeDecodeError):
        modified = ""
    return {"modified": modified, "original": original}


def main(argv: list[str]) -> int:
    what, path, spill = argv[1], argv[2], argv[3]
    try:
        reply = {"ok": git_changes(path) if what == "changes" else git_diff(path)}
    except GitFailure as e:
        reply = {"error": {"type": e.kind, "message": str(e), **e.fields}}
    text = json.dumps(reply)
    if len(text) > INLINE_REPLY:  # a diff of two 1 MB files: past what exec keeps of stdout
        # The host named the file (an unguessable name it alone accepts back), never this script.
        fd = os.open(spill, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        text = json.dumps({"file": spill})
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
