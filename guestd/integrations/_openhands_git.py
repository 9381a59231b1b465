"""``git_changes`` and ``git_diff`` of :class:`~guestd.integrations.openhands.GuestdWorkspace`,
worked out on the host from git processes that guestd runs in the guest.

What comes back is what the OpenHands SDK's ``LocalWorkspace`` returns for the same files: its
``GitChange``/``GitDiff`` models and its ``GitError`` classes (openhands-sdk 1.58.2, interface
in https://github.com/OpenHands/software-agent-sdk/tree/v1.58.2/openhands-sdk/openhands/sdk/git:
``models.py``, ``exceptions.py``; the behaviour ``git_changes.py``/``git_diff.py`` give). The
code here is this project's own, built on guestd: every question is one guestd file op
(``file.stat``, ``file.download``) or one process (``git``, once ``bash``) started with guestd
``exec``. The guest needs git and bash, not Python.

The workload owns the repository and may stand in for ``git`` (its own first on ``PATH``), so
what a process prints is untrusted input: lists are read NUL-separated (``-z``) and checked
field by field, commit ids must be 40 or 64 hex digits before they go back into an argv, every
process has a wall-clock bound in the guest and an output bound on the host, and anything
unexpected is the SDK's ``GitCommandError``. File names never travel in an argv (msgpack argv
strings must be UTF-8, names need not be): they go as ``cwd`` (a wire ``path``, raw bytes when
needed) or on stdin, and come back as os strs (``os.fsdecode``: surrogate escapes for bytes that
are not UTF-8), which name the same bytes when handed back to guestd.

Where this differs from the SDK's own code, on purpose: exact names (the SDK splits git's
quoted text on whitespace, so a changed file with a space in its name is an error there and a
name with a newline comes back C-quoted); a type change (file <-> link) is UPDATED, not an error;
a FIFO, socket or device is never opened (the SDK's ``open`` of a FIFO waits forever); a path
that is a directory or a submodule at the base commit has "" as its original text; a
repository without commits in SHA-256 format gets its own empty tree id; ``main``/``master`` and
``origin/*`` are looked up as ``refs/heads/*``/``refs/remotes/origin/*`` only.
"""

from __future__ import annotations

import os
import posixpath
import re
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from openhands.sdk.git.exceptions import GitCommandError, GitError, GitPathError, GitRepositoryError
from openhands.sdk.git.models import GitChange, GitChangeStatus, GitDiff

from guestd.client import Client, ExecResult, FileStat, GuestdError
from guestd.wire.paths import printable_path

__all__ = ["Ran", "changes", "diff", "git_failures", "parse_name_status", "parse_nested_repositories"]

# -- bounds: the workload controls the repository and what "git" prints --------------------
PROCESS_TIMEOUT_S = 30.0  # one git process, enforced in the guest (its whole tree is killed)
PROBE_BYTES = 64 * 1024  # stdout of a one-line answer (a commit id, a ref name, an object's size)
LIST_BYTES = 64 * 1024 * 1024  # stdout of a list: changed files, untracked files, nested repositories
BLOB_BYTES = 64 * 1024 * 1024  # a file's content at the base commit
DIFF_FILE_BYTES = 1024 * 1024  # the SDK's limit for a diffed file (on disk; at the base when deleted)
MAX_LINKS = 40  # symbolic links followed while resolving one git_diff path (the kernel's own limit)
MAX_STEPS = 4096  # path components looked at while resolving one git_diff path
STDERR_SHOWN = 2000  # characters of a failed process's stderr quoted in its error message

GIT_ENV = {
    "LC_ALL": "C",  # messages, and bash's glob order, independent of the guest's locale
    "GIT_OPTIONAL_LOCKS": "0",  # looking never rewrites the index the agent's own git may be using
    "GIT_TERMINAL_PROMPT": "0",  # asking origin for its default branch never waits for a password
}

# bash lists the entries of its cwd whose <name>/.git exists (a dangling link too); "*" skips dot names.
NESTED_GLOB = "shopt -s nullglob; for found in */.git; do printf '%s\\0' \"$found\"; done"
ORIGIN = "refs/remotes/origin/"
BRANCHES = "refs/heads/"
OBJECT_ID = re.compile(rb"[0-9a-f]{40}|[0-9a-f]{64}")  # SHA-1 or SHA-256 object name
STATUS_TOKEN = re.compile(rb"([ACDMRTU])[0-9]{0,3}")  # --name-status letter, with a score for R/C
STATUS_OF = {
    b"A": GitChangeStatus.ADDED,
    b"D": GitChangeStatus.DELETED,
    b"M": GitChangeStatus.UPDATED,
    b"T": GitChangeStatus.UPDATED,  # type change: a file became a link or the other way round
    b"U": GitChangeStatus.UPDATED,  # unmerged
}
# guestd's answer to a stat of a path that is not there (or not reachable): the path is treated
# as absent. Any other code (a lost connection) goes up as GitCommandError.
ABSENT = frozenset({"not_found", "not_a_directory", "permission_denied", "io_error"})


# -- one process in the guest ----------------------------------------------------------------
@dataclass(frozen=True)
class Ran:
    """A finished process, as far as the host keeps it."""

    argv: list[str]
    cwd: str
    exit_code: int  # -1: ended by a timeout or a signal
    stdout: bytes
    stdout_bytes: int  # produced, whether kept or not
    stderr: bytes

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def failed(self) -> GitCommandError:
        stderr = self.stderr.decode("utf-8", "replace")
        why = f"ended with {self.exit_code}" if self.exit_code >= 0 else "was killed (timeout or signal)"
        return GitCommandError(
            f"{_shown(self.argv)} in {printable_path(self.cwd)} {why}: {stderr[-STDERR_SHOWN:].strip()}",
            command=self.argv,
            exit_code=self.exit_code,
            stderr=stderr,
        )

    def malformed(self, why: str) -> GitCommandError:
        return GitCommandError(
            f"{_shown(self.argv)} in {printable_path(self.cwd)} printed something unexpected: {why}",
            command=self.argv,
            exit_code=self.exit_code,
            stderr=self.stderr.decode("utf-8", "replace"),
        )

    def one_line(self) -> bytes:
        """stdout as one line without its newline; more lines are a malformed reply."""
        line = self.stdout[:-1] if self.stdout.endswith(b"\n") else self.stdout
        if b"\n" in line:
            raise self.malformed("more than one line")
        return line

    def object_id(self) -> str | None:
        """The commit (or tree) id a successful probe printed; None when the probe failed."""
        if not self.ok:
            return None
        line = self.one_line()
        if not OBJECT_ID.fullmatch(line):
            raise self.malformed(f"{line[:80]!r} is not an object id")
        return line.decode("ascii")


def _shown(argv: Sequence[str]) -> str:
    return " ".join(argv[:2])


class GuestGit:
    """Starts git (and the one bash) in the guest through guestd exec, each bounded."""

    def __init__(self, client: Client, program: str) -> None:
        self.client = client
        self.program = program
        # What guestd returns of one stream in a reply; more needs its spill file.
        self.reply_bytes = int(client.aio.limits.get("max_output", 65536))

    def run(
        self,
        args: Sequence[str],
        cwd: str,
        *,
        stdin: bytes | None = None,
        limit: int = PROBE_BYTES,
        program: str | None = None,
    ) -> Ran:
        """Run to its end and keep all of stdout, or raise GitCommandError if it printed more
        than ``limit`` bytes (a list is whole or an error, never cut)."""
        argv = [program or self.program, *args]
        result = self._exec(argv, cwd, stdin, min(limit, self.reply_bytes), spill=False)
        stdout = result.stdout
        if result.stdout_dropped:
            if result.stdout_bytes > limit:
                raise self._too_large(argv, cwd, result.stdout_bytes, limit)
            # Within this bound but past what one reply holds: once more, every byte to a spill file.
            result = self._exec(argv, cwd, stdin, min(limit, self.reply_bytes), spill=True)
            stdout = self._spilled_stdout(argv, cwd, result, limit)
        return self._ran(argv, cwd, result, stdout)

    def produces_output(self, args: Sequence[str], cwd: str) -> Ran:
        """Run to its end keeping one byte: for questions answered by whether it printed anything."""
        argv = [self.program, *args]
        result = self._exec(argv, cwd, None, 1, spill=False)
        return self._ran(argv, cwd, result, result.stdout)

    def _exec(self, argv: list[str], cwd: str, stdin: bytes | None, keep: int, *, spill: bool) -> ExecResult:
        try:
            return self.client.exec(
                argv,
                cwd=cwd,
                env=GIT_ENV,
                stdin=stdin,
                timeout_s=PROCESS_TIMEOUT_S,
                max_output=keep,
                spill=True if spill else None,
            )
        except GuestdError as e:  # not started: no such cwd, no such program, guestd gone
            raise GitCommandError(
                f"guestd could not run {_shown(argv)} in {printable_path(cwd)}: {e}", command=argv, exit_code=-1
            ) from None

    def _spilled_stdout(self, argv: list[str], cwd: str, result: ExecResult, limit: int) -> bytes:
        try:
            if not result.stdout_dropped:  # it printed less this time
                return result.stdout
            if result.stdout_bytes > limit:
                raise self._too_large(argv, cwd, result.stdout_bytes, limit)
            spill = result.stdout_spill
            if spill is None or spill.stopped is not None or spill.bytes != result.stdout_bytes:
                raise GitCommandError(
                    f"{_shown(argv)} in {printable_path(cwd)}: guestd kept only part of its output ({spill})",
                    command=argv,
                    exit_code=-1,
                )
            data = self.client.download(spill.path, max_bytes=limit)
            assert isinstance(data, bytes)
            if len(data) != result.stdout_bytes:
                raise GitCommandError(
                    f"{_shown(argv)}: its spill file holds {len(data)} bytes, not {result.stdout_bytes}",
                    command=argv,
                    exit_code=-1,
                )
            return data
        finally:
            for spilled in (result.stdout_spill, result.stderr_spill):
                if spilled is not None:
                    try:
                        self.client.remove(spilled.path)
                    except GuestdError:
                        pass  # guestd ages its spill files out by itself (processes.retention_s)

    @staticmethod
    def _too_large(argv: list[str], cwd: str, produced: int, limit: int) -> GitCommandError:
        return GitCommandError(
            f"{_shown(argv)} in {printable_path(cwd)} printed {produced} bytes, more than the {limit} read back",
            command=argv,
            exit_code=-1,
        )

    @staticmethod
    def _ran(argv: list[str], cwd: str, result: ExecResult, stdout: bytes) -> Ran:
        return Ran(
            argv=argv,
            cwd=cwd,
            exit_code=result.exit_code if result.exit_code is not None and result.timed_out is None else -1,
            stdout=stdout,
            stdout_bytes=result.stdout_bytes,
            stderr=result.stderr,
        )


@contextmanager
def git_failures(program: str) -> Iterator[None]:
    """guestd failing under a git step (connection lost, a refused op) is the SDK's
    GitCommandError: the SDK's callers catch GitError, never guestd's own types."""
    try:
        yield
    except GitError:
        raise
    except (GuestdError, OSError) as e:
        raise GitCommandError(f"guestd: {e}", command=[program], exit_code=-1) from None


# -- output parsers (pure) -------------------------------------------------------------------
def nul_fields(data: bytes, ran: Ran) -> list[bytes]:
    """The fields of a -z list; each one NUL-terminated, none empty."""
    if not data:
        return []
    if not data.endswith(b"\0"):
        raise ran.malformed("a list that does not end with NUL")
    fields = data[:-1].split(b"\0")
    if not all(fields):
        raise ran.malformed("an empty name in a list")
    return fields


def parse_name_status(data: bytes, ran: Ran) -> list[tuple[GitChangeStatus, bytes]]:
    """``git diff --name-status -z``: a status token, then one name (two for a rename or copy).

    A rename is its old name DELETED and its new name ADDED; a copy only the new name ADDED."""
    fields = nul_fields(data, ran)
    found: list[tuple[GitChangeStatus, bytes]] = []
    at = 0
    while at < len(fields):
        token = fields[at]
        if not STATUS_TOKEN.fullmatch(token):
            raise ran.malformed(f"status {token[:40]!r}")
        letter = token[:1]
        names = fields[at + 1 : at + (3 if letter in b"RC" else 2)]
        at += 1 + len(names)
        if len(names) != (2 if letter in b"RC" else 1):
            raise ran.malformed(f"status {token!r} without its names")
        if letter == b"R":
            found += [(GitChangeStatus.DELETED, names[0]), (GitChangeStatus.ADDED, names[1])]
        elif letter == b"C":
            found.append((GitChangeStatus.ADDED, names[1]))
        else:
            found.append((STATUS_OF[letter], names[0]))
    return found


def parse_nested_repositories(data: bytes, ran: Ran) -> list[str]:
    """NESTED_GLOB's output: the names of the directories holding a ``.git``."""
    names: set[str] = set()
    for field in nul_fields(data, ran):
        name = field.removesuffix(b"/.git")
        if name == field or not name or b"/" in name or name.startswith(b"."):
            raise ran.malformed(f"{field[:80]!r} is not <name>/.git")
        names.add(os.fsdecode(name))
    return sorted(names)


def ref_name(raw: bytes) -> str | None:
    """A branch name taken from git's output, if it can go back into an argv as one."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if not text or any(c.isspace() or c < " " or c == "\x7f" or c in "~^:?*[\\" for c in text):
        return None
    return text


@dataclass(frozen=True)
class Blob:
    object_id: str
    kind: str  # blob, tree, commit (a submodule), ...
    size: int


BATCH_LINE = re.compile(rb"([0-9a-f]{40}|[0-9a-f]{64}) ([a-z]+) ([0-9]{1,19})")


def parse_batch_check(ran: Ran) -> Blob | None:
    """``git cat-file --batch-check='%(objectname) %(objecttype) %(objectsize)'`` for one name:
    the object, or None when the name is not there ("<name> missing") or git failed."""
    if not ran.ok:
        return None
    line = ran.stdout.removesuffix(b"\n")
    found = BATCH_LINE.fullmatch(line)
    if found is not None:
        return Blob(found[1].decode("ascii"), found[2].decode("ascii"), int(found[3]))
    if line.endswith((b" missing", b" ambiguous")):
        return None
    raise ran.malformed(f"{line[:80]!r}")


def unified_lines(text: str) -> str:
    """The SDK's text form of both sides of a diff: lines split at any line end, joined by \\n."""
    return "\n".join(text.splitlines())


# -- which commit the work is shown against ----------------------------------------------------
def display_base(git: GuestGit, repo: str) -> str:
    """The commit (or empty tree) the changes in ``repo`` are listed against, chosen as the SDK
    chooses for its diff view: what has been done here, committed and pushed work included."""
    if not _has_commits(git, repo):
        return empty_tree(git, repo)
    head = _commit(git, repo, "HEAD")
    branch = _current_branch(git, repo) if head is not None else None
    if branch is not None:
        upstream = _commit(git, repo, ORIGIN + branch)
        # A pushed, clean branch compared with its own upstream would show nothing of its work.
        if upstream is not None and not (upstream == head and not _tracked_files_changed(git, repo)):
            return upstream
    default = _origin_default_branch(git, repo)
    if default is not None:
        fork = _merge_base(git, repo, ORIGIN + default)
        tip = fork if fork is not None else _commit(git, repo, ORIGIN + default)
        if tip is not None:
            return tip
    else:
        for name in ("main", "master"):
            local = _commit(git, repo, BRANCHES + name)
            if local is None:
                continue
            # A branch forked off local main: its own commits stay visible.
            if name != branch and _merge_base(git, repo, BRANCHES + name) == local:
                return local
            break
    return head if head is not None else empty_tree(git, repo)


def empty_tree(git: GuestGit, repo: str) -> str:
    """The id of the empty tree in this repository's hash (SHA-1 or SHA-256)."""
    ran = git.run(["hash-object", "-t", "tree", "--stdin"], repo, stdin=b"")
    found = ran.object_id()
    if found is None:
        raise ran.failed()
    return found


def _has_commits(git: GuestGit, repo: str) -> bool:
    ran = git.run(["rev-list", "--max-count=1", "--all"], repo)
    return ran.ok and bool(ran.stdout) and ran.object_id() is not None  # cannot tell: none


def _commit(git: GuestGit, repo: str, ref: str) -> str | None:
    return git.run(["rev-parse", "--verify", "--quiet", ref], repo).object_id()


def _merge_base(git: GuestGit, repo: str, ref: str) -> str | None:
    return git.run(["merge-base", "HEAD", ref], repo).object_id()


def _current_branch(git: GuestGit, repo: str) -> str | None:
    ran = git.run(["symbolic-ref", "--quiet", "HEAD"], repo)
    line = ran.one_line() if ran.ok else b""
    return ref_name(line.removeprefix(BRANCHES.encode())) if line.startswith(BRANCHES.encode()) else None


def _tracked_files_changed(git: GuestGit, repo: str) -> bool:
    ran = git.produces_output(["status", "--porcelain=v2", "-z", "--untracked-files=no"], repo)
    return not ran.ok or ran.stdout_bytes > 0  # cannot tell: changed (keeps the upstream as base)


def _origin_default_branch(git: GuestGit, repo: str) -> str | None:
    ran = git.run(["symbolic-ref", "--quiet", ORIGIN + "HEAD"], repo)
    line = ran.one_line() if ran.ok else b""
    if line.startswith(ORIGIN.encode()):
        name = ref_name(line.removeprefix(ORIGIN.encode()))
        if name is not None:
            return name
    # origin/HEAD not recorded (a remote added by hand, not cloned): ask origin itself, if there
    # is one (else ls-remote would take "origin" for a path).
    if not git.run(["config", "--get", "remote.origin.url"], repo).ok:
        return None
    ran = git.run(["ls-remote", "--symref", "origin", "HEAD"], repo)
    if not ran.ok:
        return None
    for line in ran.stdout.split(b"\n"):
        if line.startswith(b"ref: " + BRANCHES.encode()) and line.endswith(b"\tHEAD"):
            return ref_name(line[len(b"ref: " + BRANCHES.encode()) : -len(b"\tHEAD")])
    return None


# -- git_changes -----------------------------------------------------------------------------
def changes(client: Client, program: str, top: str) -> list[GitChange]:
    """The changes under the directory ``top`` and in the repositories directly below it, paths
    relative to ``top``, sorted by path."""
    git = GuestGit(client, program)
    nested = nested_repositories(git, top)
    own_error: GitRepositoryError | None = None
    try:
        found = changes_in(git, top)
    except GitRepositoryError as e:
        if not nested:
            raise
        own_error, found = e, []
    # A nested repository answers for everything below it (by path components: "foo" is not "foobar").
    answered_below = {(name,) for name in nested}
    found = [c for c in found if c.path.parts[:1] not in answered_below]
    answered = False
    for name in nested:
        try:
            inner = changes_in(git, posixpath.join(top, name))
        except GitError:
            continue  # a .git that is no repository, or git failing there: left out, as the SDK does
        answered = True
        found += [GitChange(status=c.status, path=Path(name) / c.path) for c in inner]
    if own_error is not None and not answered:
        raise own_error
    found.sort(key=lambda c: str(c.path))  # stable: a path listed twice keeps git's order
    return found


def nested_repositories(git: GuestGit, top: str) -> list[str]:
    """Names directly in ``top`` (not starting with a dot) whose ``<name>/.git`` exists."""
    try:
        if git.client.stat(top).type != "dir":
            return []
    except GuestdError as e:
        if e.code in ABSENT:
            return []
        raise
    ran = git.run(["-c", NESTED_GLOB], top, limit=LIST_BYTES, program="bash")
    if not ran.ok:
        raise ran.failed()
    return parse_nested_repositories(ran.stdout, ran)


def changes_in(git: GuestGit, where: str) -> list[GitChange]:
    """Changes of the repository holding ``where``, limited to ``where`` and relative to it:
    tracked files against the display base, then untracked files that are not ignored."""
    require_repository(git, where)
    base = display_base(git, where)
    tracked = git.run(["diff", "--no-color", "--name-status", "-z", "--relative", base, "--"], where, limit=LIST_BYTES)
    if not tracked.ok:
        raise tracked.failed()
    found = parse_name_status(tracked.stdout, tracked)
    untracked = git.run(["ls-files", "-z", "--others", "--exclude-standard"], where, limit=LIST_BYTES)
    if untracked.ok:  # if git cannot list them, there are none (as the SDK has it)
        found += [(GitChangeStatus.ADDED, name) for name in nul_fields(untracked.stdout, untracked)]
    return [GitChange(status=status, path=Path(os.fsdecode(name))) for status, name in found]


def require_repository(git: GuestGit, where: str) -> None:
    shown = printable_path(where)
    try:
        kind = git.client.stat(where).type
    except GuestdError as e:
        if e.code == "not_found":
            raise GitRepositoryError(f"{shown}: no such directory in the guest") from None
        if e.code in ABSENT:
            raise GitRepositoryError(f"{shown}: {e.message}") from None
        raise
    if kind != "dir":
        raise GitRepositoryError(f"{shown}: a {kind}, not a directory")
    ran = git.run(["rev-parse", "--git-dir"], where)
    if not ran.ok:
        stderr = ran.stderr.decode("utf-8", "replace").strip()[-STDERR_SHOWN:]
        raise GitRepositoryError(f"{shown}: git finds no repository here ({stderr})", exit_code=ran.exit_code)


# -- git_diff --------------------------------------------------------------------------------
def diff(client: Client, program: str, target: str) -> GitDiff:
    """The file's text at the display base (``original``) and on disk (``modified``)."""
    git = GuestGit(client, program)
    real = resolve(client, target)
    shown = printable_path(real)
    on_disk = _stat(client, real)
    if on_disk is not None and on_disk.size > DIFF_FILE_BYTES:
        raise GitPathError(f"{shown}: {on_disk.size} bytes, over the {DIFF_FILE_BYTES}-byte limit for a diff")
    repo = enclosing_repository(client, real)
    if repo is None:
        if on_disk is None:
            raise GitPathError(f"{shown}: not on disk, and no repository above it")
        raise GitRepositoryError(f"{shown}: no directory above it holds a .git")
    require_repository(git, repo)
    base = display_base(git, repo)
    at_base = blob_at(git, repo, base, posixpath.relpath(real, repo))
    if on_disk is None:
        if at_base is None or at_base.kind != "blob":
            raise GitPathError(f"{shown}: neither on disk nor a file in the base commit {base}")
        if at_base.size > DIFF_FILE_BYTES:
            raise GitPathError(f"{shown}: {at_base.size} bytes at {base}, over the {DIFF_FILE_BYTES}-byte limit")
    original = "" if at_base is None or at_base.kind != "blob" else read_blob(git, repo, at_base, shown)
    modified = "" if on_disk is None else read_text(client, real, on_disk, shown)
    return GitDiff(modified=modified, original=original)


def resolve(client: Client, path: str) -> str:
    """``path`` with its symbolic links followed one component at a time through guestd (as
    ``Path.resolve()`` does locally): ``..`` applies after a link; from the first component that
    is not there, the rest is kept as written. A relative path (guestd's cwd is not known
    here) is only normalized."""
    if not path.startswith("/"):
        return posixpath.normpath(path)
    pending = deque(path.split("/"))
    done = "/"
    links = steps = 0
    reachable = True
    while pending:
        part = pending.popleft()
        steps += 1
        if steps > MAX_STEPS:
            raise GitPathError(f"{printable_path(path)}: more than {MAX_STEPS} path components to resolve")
        if part in ("", "."):
            continue
        if part == "..":
            done = posixpath.dirname(done)
            continue
        here = posixpath.join(done, part)
        if reachable:
            try:
                st = client.stat(here, follow=False)
            except GuestdError as e:
                if e.code not in ABSENT:
                    raise
                reachable = False
            else:
                if st.type == "symlink" and st.target is not None:
                    links += 1
                    if links > MAX_LINKS:
                        raise GitPathError(f"{printable_path(path)}: more than {MAX_LINKS} symbolic links")
                    target = os.fsdecode(st.target)
                    pending.extendleft(reversed(target.split("/")))
                    if target.startswith("/"):
                        done = "/"
                    continue
        done = here
    return done


def enclosing_repository(client: Client, real: str) -> str | None:
    """The nearest of ``real`` and its parents holding a ``.git`` that exists."""
    here = real
    while True:
        if _stat(client, posixpath.join(here, ".git")) is not None:
            return here
        parent = posixpath.dirname(here)
        if parent == here:
            return None
        here = parent


def _stat(client: Client, path: str) -> FileStat | None:
    try:
        return client.stat(path)
    except GuestdError as e:
        if e.code in ABSENT:
            return None
        raise


def blob_at(git: GuestGit, repo: str, base: str, relative: str) -> Blob | None:
    """What ``relative`` (a path from the top of ``repo``) is at ``base``; the name goes on stdin."""
    name = base.encode("ascii") + b":" + os.fsencode(relative)
    # A name with a newline needs NUL-terminated input (git 2.38+); others work with any git.
    terminated, flags = (name + b"\0", ["-z"]) if b"\n" in name else (name + b"\n", [])
    ran = git.run(
        ["cat-file", "--batch-check=%(objectname) %(objecttype) %(objectsize)", *flags], repo, stdin=terminated
    )
    return parse_batch_check(ran)


def read_blob(git: GuestGit, repo: str, blob: Blob, shown: str) -> str:
    if blob.size > BLOB_BYTES:
        raise GitPathError(f"{shown}: {blob.size} bytes in the base commit, over the {BLOB_BYTES}-byte limit")
    ran = git.run(["cat-file", "blob", blob.object_id], repo, limit=BLOB_BYTES)
    if not ran.ok:
        return ""  # unreadable at the base: no original text, as the SDK has it
    if len(ran.stdout) != blob.size:
        raise ran.malformed(f"{len(ran.stdout)} bytes for a blob of {blob.size}")
    return unified_lines(ran.stdout.decode("utf-8", "replace"))


def read_text(client: Client, real: str, st: FileStat, shown: str) -> str:
    """The file on disk as strict UTF-8 text; "" when it is not a regular file (never opened:
    a FIFO would wait forever), unreadable, or not UTF-8."""
    if st.type != "file":
        return ""
    try:
        data = client.download(real, length=DIFF_FILE_BYTES + 1, max_bytes=DIFF_FILE_BYTES + 1)
    except GuestdError as e:
        if e.code in ABSENT or e.code in ("not_a_file", "is_a_directory", "too_large"):
            return ""
        raise
    assert isinstance(data, bytes)
    if len(data) > DIFF_FILE_BYTES:  # grew since it was looked at
        raise GitPathError(f"{shown}: over the {DIFF_FILE_BYTES}-byte limit for a diff")
    try:
        return unified_lines(data.decode("utf-8"))
    except UnicodeDecodeError:
        return ""
