"""Walking a directory tree through fds: the walk under ``file.glob``, ``file.grep``'s fallback,
``tree.download``, ``file.view`` of a directory and the change feed's watches.

Every step is an ``*at`` call on the fd of the directory above, subdirectories are opened
``O_DIRECTORY | O_NOFOLLOW`` and symlinks are reported, never followed: a directory the
workload swaps for a symlink mid-walk fails to open (ELOOP/ENOTDIR) and is skipped, so nothing
outside the tree is ever listed or read. Bounded: ``max_entries`` looked at, ``max_depth``
levels (one fd each), and a deadline; each bound reached is reported, never silent.
"""

from __future__ import annotations

import os
import stat as st
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from guestd.files.ignore import Overrides, RuleSet, read_ignore_file

MAX_DEPTH = 256  # directory levels below the root (each holds one fd while the walk is in it)
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

    def entries(self) -> Iterator[Entry]:
        """Every entry the filter takes, directories before their contents, names in byte order."""
        root_ignores: list[tuple[bytes, RuleSet]] = []
        if self.filter.gitignore:
            rules = read_ignore_file(self.root_fd)
            if rules is not None:
                root_ignores.append((b"", rules))
        # (fd, rel of the directory, sorted names still to visit, ignore chain); fd owned unless root
        stack: list[tuple[int, bytes, list[bytes], list[tuple[bytes, RuleSet]]]] = []
        names = self._names(self.root_fd)
        if names is None:
            return
        stack.append((self.root_fd, b"", names, root_ignores))
        try:
            while stack:
                fd, here, todo, ignores = stack[-1]
                if not todo:
                    stack.pop()
                    if fd != self.root_fd:
                        os.close(fd)
                    continue
                name = todo.pop()
                if self.deadline is not None and self.scanned % 256 == 0 and time.monotonic() > self.deadline:
                    self.truncated = "deadline"
                    return
                self.scanned += 1
                if self.scanned > self.max_entries:
                    self.truncated = "entries"
                    return
                try:
                    info = os.stat(name, dir_fd=fd, follow_symlinks=False)
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
                sub_names = self._names(sub)
                if sub_names is None:
                    os.close(sub)
                    continue
                sub_ignores = ignores
                if self.filter.gitignore:
                    rules = read_ignore_file(sub)
                    if rules is not None:
                        sub_ignores = [*ignores, (rel, rules)]
                stack.append((sub, rel, sub_names, sub_ignores))
        finally:
            for fd, _, _, _ in stack:
                if fd != self.root_fd:
                    os.close(fd)

    def _names(self, fd: int) -> list[bytes] | None:
        """The names in ``fd``, sorted so that pop() gives them in byte order."""
        try:
            with os.scandir(fd) as it:
                names = [os.fsencode(e.name) for e in it]
        except OSError:
            self.errors += 1
            return None
        names.sort(reverse=True)
        return names

    def _takes(self, rel: bytes, name: bytes, is_dir: bool, ignores: list[tuple[bytes, RuleSet]]) -> bool:
        f = self.filter
        said = f.overrides.decide(rel, is_dir)
        if said is not None:
            return said == "take"
        if f.gitignore:
            for base, rules in reversed(ignores):
                sub = rel[len(base) + 1 :] if base else rel
                hit = rules.matched(sub, is_dir)
                if hit is True:
                    return False
                if hit is False:
                    return True  # whitelisted by a negation: hidden or not
        return f.hidden or not name.startswith(b".")
