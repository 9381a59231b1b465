"""Walking a directory tree through fds: the walk under ``file.glob``, ``tree.download``,
``file.view`` of a directory and the change feed's watches.

Every step is an ``*at`` call on the fd of the directory above, subdirectories are opened
``O_DIRECTORY | O_NOFOLLOW`` and symlinks are reported, never followed: a directory the
workload swaps for a symlink mid-walk fails to open (ELOOP/ENOTDIR) and is skipped, so nothing
outside the tree is ever listed or read. Bounded: ``max_entries`` looked at, ``max_depth``
levels (one fd each), the ``.gitignore`` rules held along one path (``MAX_IGNORE_HELD``), and a
deadline that matching observes too (a ``wildcard.Budget``: a hostile ``.gitignore`` costs at
most O(path x glob) per entry and stops the walk at the deadline); each bound reached is
reported in ``truncated``, never silent.
"""

from __future__ import annotations

import heapq
import os
import stat as st
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field

from guestd.files.ignore import Overrides, Rule, RuleSet, read_ignore_file
from guestd.files.wildcard import Budget, OutOfTime, TooCostly

MAX_DEPTH = 256  # directory levels below the root (each holds one fd while the walk is in it)
# What the compiled .gitignore files of one directory and those above it may hold together
# (their cost estimate, in bytes): up to 256 levels each with a 1 MiB file of hostile globs
# would otherwise be gigabytes in guestd. Real ones hold kilobytes; a 1 MiB file of 10,000
# names about 5 MiB. A directory whose .gitignore would pass it is listed but not entered
# (truncated "depth": the path got too heavy to go further, as it can get too deep).
MAX_IGNORE_HELD = 16 * 1024 * 1024
ENTRY_STEPS = 200  # budget steps per entry (a stat and the filter): the clock is read every ~250
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(slots=True)
class Entry:
    """One entry met by the walk. ``dirfd`` (its directory) is valid only until the walk moves on."""

    rel: bytes  # path relative to the root, b"a/b/c"
    name: bytes
    dirfd: int
    info: os.stat_result  # lstat: a symlink is described, not followed

    @property
    def is_dir(self) -> bool:
        return st.S_ISDIR(self.info.st_mode)

    @property
    def is_file(self) -> bool:
        return st.S_ISREG(self.info.st_mode)


@dataclass
class Filter:
    """Which entries a walk takes, in ripgrep's order: overrides (``globs``, ``.git`` always
    left out), then ``.gitignore`` files (deepest first), then hidden names."""

    globs: list[str] = field(default_factory=list)
    gitignore: bool = False
    hidden: bool = True
    skip_git: bool = True

    def __post_init__(self) -> None:
        self.overrides = Overrides((["!.git"] if self.skip_git else []) + self.globs)


SORT_CHUNK = 16_384  # names sorted in one call (a few ms); larger directories are merged lazily


def lstat_at(name: bytes, dirfd: int) -> os.stat_result:
    """How a walk describes an entry by default: ``lstat`` relative to its directory."""
    return os.stat(name, dir_fd=dirfd, follow_symlinks=False)


@dataclass
class Walk:
    """An iterative, sorted, depth-first walk below ``root_fd`` (not closed here)."""

    root_fd: int
    filter: Filter = field(default_factory=Filter)
    max_entries: int = 2_000_000
    max_depth: int = MAX_DEPTH
    deadline: float | None = None  # time.monotonic() bound
    scanned: int = 0
    truncated: str | None = None  # which bound stopped the walk: entries, depth, deadline
    errors: int = 0  # directories that could not be opened or listed (vanished, swapped, denied)
    budget: Budget = field(default_factory=Budget, repr=False)  # matching's time budget (the deadline)
    # What describes an entry (name, its directory's fd): an lstat, never following a symlink; an
    # OSError skips the entry. tree.download's archive opens files O_PATH here and keeps the fd.
    lstat: Callable[[bytes, int], os.stat_result] = field(default=lstat_at, repr=False)

    def stop(self) -> None:
        """From any thread: the walk ends at its next step, or within milliseconds of a match
        (truncated "deadline")."""
        self.budget.stop()

    def matching(self, rule: Rule) -> Iterator[Entry]:
        """The entries whose path ``rule`` matches (``file.glob``'s pattern), matched under the
        walk's budget: past the deadline the walk ends, truncated "deadline"."""
        entries = self.entries()
        try:
            for e in entries:
                if rule.matches(e.rel, e.is_dir, self.budget):
                    yield e
        except OutOfTime:
            self.truncated = "deadline"
        finally:
            entries.close()

    def entries(self) -> Generator[Entry, None, None]:
        """Every entry the filter takes, directories before their contents, names in byte order."""
        if self.budget.deadline is None:  # set by stop() already, or the walk's own deadline
            self.budget.deadline = self.deadline
        # (fd, rel of the directory, sorted names still to visit, ignore chain, its cost); fd owned unless root
        stack: list[tuple[int, bytes, list[bytes], list[tuple[bytes, RuleSet]], int]] = []
        try:
            root_ignores = self._ignores(self.root_fd, b"", [], 0)
            if root_ignores is None:
                return  # the root's own .gitignore is over the bound: nothing is listed
            names = self._names(self.root_fd)
            if names is None:
                return
            stack.append((self.root_fd, b"", names, *root_ignores))
            while stack:
                fd, here, todo, ignores, held = stack[-1]
                if not todo:
                    stack.pop()
                    if fd != self.root_fd:
                        os.close(fd)
                    continue
                name = todo.pop()
                self.budget.spend(ENTRY_STEPS)
                self.scanned += 1
                if self.scanned > self.max_entries:
                    self.truncated = "entries"
                    return
                try:
                    info = self.lstat(name, fd)
                except OSError:
                    continue  # gone meanwhile
                rel = here + b"/" + name if here else name
                is_dir = st.S_ISDIR(info.st_mode)
                if not self._takes(rel, name, is_dir, ignores):
                    continue
                yield Entry(rel, name, fd, info)
                if not is_dir:
                    continue
                if len(stack) > self.max_depth:
                    self.truncated = "depth"
                    continue
                try:
                    sub = os.open(name, DIR_FLAGS, dir_fd=fd)
                except OSError:
                    self.errors += 1  # swapped for a symlink or a file, removed, or denied: not entered
                    continue
                sub_names = self._names(sub, pending=sum(len(level[2]) for level in stack))
                if sub_names is None:
                    os.close(sub)
                    continue
                sub_ignores = self._ignores(sub, rel, ignores, held)
                if sub_ignores is None:
                    os.close(sub)
                    continue
                stack.append((sub, rel, sub_names, *sub_ignores))
        except OutOfTime:
            self.truncated = "deadline"
        finally:
            for fd, _, _, _, _ in stack:
                if fd != self.root_fd:
                    os.close(fd)

    def _ignores(
        self, fd: int, rel: bytes, above: list[tuple[bytes, RuleSet]], held: int
    ) -> tuple[list[tuple[bytes, RuleSet]], int] | None:
        """The ignore chain in the directory ``fd`` (``above`` plus its own .gitignore) and what
        it holds; None (truncated "depth") when its .gitignore would pass ``MAX_IGNORE_HELD``."""
        if not self.filter.gitignore:
            return above, held
        try:
            rules = read_ignore_file(fd, budget=self.budget, max_cost=MAX_IGNORE_HELD - held)
        except TooCostly:
            self.truncated = "depth"
            return None
        if rules is None:
            return above, held
        return [*above, (rel, rules)], held + rules.cost

    def _names(self, fd: int, pending: int = 0) -> list[bytes] | None:
        """The names in ``fd``, sorted so that pop() gives them in byte order.

        A workload directory may hold millions of names: at most what the walk may still look
        at (``max_entries`` less what it scanned and the ``pending`` names already listed) is
        read, one more to say it was cut (the walk then stops, truncated "entries"), so the
        names held stay within ``max_entries``. They are sorted in chunks merged lazily: one
        ``sort()`` of 2M names held the GIL (and guestd's loop) for seconds."""
        room = max(0, self.max_entries - self.scanned - pending) + 1
        names: list[bytes] = []
        try:
            with os.scandir(fd) as it:
                for e in it:
                    names.append(os.fsencode(e.name))
                    if len(names) >= room:
                        break
        except OSError:
            self.errors += 1
            return None
        if len(names) <= SORT_CHUNK:
            names.sort(reverse=True)
            return names
        chunks = [sorted(names[i : i + SORT_CHUNK], reverse=True) for i in range(0, len(names), SORT_CHUNK)]
        return list(heapq.merge(*chunks, reverse=True))

    def _takes(self, rel: bytes, name: bytes, is_dir: bool, ignores: list[tuple[bytes, RuleSet]]) -> bool:
        f = self.filter
        said = f.overrides.decide(rel, is_dir, self.budget)
        if said is not None:
            return said == "take"
        if f.gitignore:
            for base, rules in reversed(ignores):
                sub = rel[len(base) + 1 :] if base else rel
                hit = rules.matched(sub, is_dir, self.budget)
                if hit is True:
                    return False
                if hit is False:
                    return True  # whitelisted by a negation: hidden or not
        return f.hidden or not name.startswith(b".")
