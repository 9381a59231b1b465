"""Glob patterns with gitignore's rules, for ``file.glob``'s pattern, tree include/exclude, watch
filters and ``.gitignore`` files.

One matcher (``guestd.files.wildcard``: compiled globs matched without backtracking, in
O(path x glob) at worst and under a time budget) serves all of them, with ripgrep's rules (the
``ignore`` crate: overrides first, then ``.gitignore`` deepest first, then hidden names; grep
itself is ripgrep):

- ``*`` and ``?`` never match ``/``; ``[...]`` is a class (``[!...]`` negated); ``\\x`` is ``x``.
- ``**/`` at the start matches any leading directories (none included), ``/**/`` in the middle
  any directories between (none included), ``/**`` at the end everything below.
- A pattern with no ``/`` (or only a trailing one) matches the name at any depth; one with a
  ``/`` elsewhere is anchored to the base (a leading ``/`` only anchors). A trailing ``/``
  matches directories only. ``!`` negates (in ignore files: re-includes; in overrides:
  excludes), ``#`` starts a comment, trailing spaces are dropped unless escaped, and the last
  matching line decides.
- ``file.glob``'s pattern is one such glob too (:func:`find_glob`), so ``find --glob '*.py'``
  and ``grep --glob '*.py'`` both mean every ``.py`` file at any depth, and ``/*.py`` only the
  ones at the top.

Bounds: an ignore file is read up to ``MAX_IGNORE_BYTES`` and ``MAX_PATTERNS`` lines; a line
that does not compile (a reversed range ``[z-a]``) is skipped, as ripgrep skips it; parsing
stops once the compiled rules would hold more than the caller allows (``max_cost``, see
``guestd.files.walk``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from guestd.files.fs import reopen_regular
from guestd.files.wildcard import Budget, Compiler, GlobError, PathGlob
from guestd.wire.errors import ErrorCode, GuestdError

MAX_IGNORE_BYTES = 1024 * 1024  # a .gitignore larger than this is read only this far
MAX_PATTERNS = 10_000  # lines kept per ignore file


@dataclass(frozen=True, slots=True)
class Rule:
    glob: PathGlob
    negated: bool
    dir_only: bool

    def matches(self, rel: bytes, is_dir: bool, budget: Budget | None = None) -> bool:
        """The glob matches ``rel`` (a directory-only rule only directories); negation aside."""
        return (is_dir or not self.dir_only) and self.glob.match(rel, budget)


def parse_rule(line: str | bytes, *, always_anchored: bool = False, compiler: Compiler | None = None) -> Rule | None:
    """One gitignore line (or one override glob) as a rule; None for blanks and comments.
    Raises ``GlobError`` for a glob that does not compile."""
    raw = os.fsencode(line).rstrip(b"\r\n")
    if not raw or raw.startswith(b"#"):
        return None
    while raw.endswith(b" ") and not raw.endswith(b"\\ "):
        raw = raw[:-1]
    negated = raw.startswith(b"!")
    if negated or raw.startswith(b"\\!") or raw.startswith(b"\\#"):
        raw = raw[1:]
    dir_only = raw.endswith(b"/") and len(raw) > 1
    if dir_only:
        raw = raw.rstrip(b"/")
    if not raw:
        return None
    anchored = always_anchored or b"/" in raw
    glob = (compiler or Compiler()).compile(raw, anchored=anchored)
    return Rule(glob, negated, dir_only)


class RuleSet:
    """The rules of one ignore file (or one override list), relative to ``base``: the last
    matching rule decides: True (matched: ignored, or for overrides whitelisted), False (a
    negation matched), None (no rule matched). ``cost``: about the bytes its rules hold."""

    def __init__(self, rules: list[Rule], cost: int = 0) -> None:
        self.rules = rules
        self.cost = cost

    @classmethod
    def parse(cls, text: bytes, budget: Budget | None = None, max_cost: int | None = None) -> RuleSet:
        """``text``'s rules. Raises ``TooCostly`` once they would hold more than ``max_cost``
        bytes (about; having made at most that much) and ``OutOfTime`` past the budget's
        deadline."""
        compiler = Compiler(budget, max_cost)  # equal lines, names and classes of a file are held once
        rules = []
        for line in text.split(b"\n", MAX_PATTERNS)[:MAX_PATTERNS]:
            try:
                rule = parse_rule(line, compiler=compiler)
            except GlobError:
                continue  # ripgrep skips a line it cannot compile too
            if rule is not None:
                rules.append(rule)
        return cls(rules, compiler.cost)

    def matched(self, rel: bytes, is_dir: bool, budget: Budget | None = None) -> bool | None:
        for rule in reversed(self.rules):
            if rule.matches(rel, is_dir, budget):
                return not rule.negated
        return None


class Overrides:
    """ripgrep's ``--glob`` list: a glob includes, ``!glob`` excludes, the last match wins;
    with any including glob, a file that matches none is excluded (directories still walked).
    An override decides before ``.gitignore`` and hidden names do. A glob that does not
    compile is ``bad_request``."""

    def __init__(self, globs: list[str]) -> None:
        self.rules: list[Rule] = []
        self.whitelists = 0
        compiler = Compiler()
        for g in globs:
            try:
                rule = parse_rule(g, compiler=compiler)
            except GlobError as exc:
                raise GuestdError(ErrorCode.BAD_REQUEST, f"bad glob {g!r}: {exc}", details={"glob": g}) from None
            if rule is None:
                continue
            self.rules.append(rule)  # here a plain glob takes, a negated one skips
            self.whitelists += not rule.negated

    def decide(self, rel: bytes, is_dir: bool, budget: Budget | None = None) -> str | None:
        """'take', 'skip' or None (no say)."""
        for rule in reversed(self.rules):
            if rule.matches(rel, is_dir, budget):
                return "skip" if rule.negated else "take"
        if self.whitelists and not is_dir:
            return "skip"
        return None


def find_glob(pattern: str) -> Rule:
    """``file.glob``'s pattern: one glob read as ``file.grep``'s ``globs`` (ripgrep's
    ``--glob``) are, so ``find`` and ``grep`` mean the same by it: without a ``/`` it matches a
    name at any depth (``*.py``), with one it is anchored to the searched directory
    (``src/*.py``, ``/*.py``, ``**/*.py``); a trailing ``/`` matches directories only. What
    selects nothing by construction (a blank, a ``#`` comment, a ``!`` negation) is
    ``bad_request``: escape a leading ``#`` or ``!`` with ``\\``."""

    def bad(why: str) -> GuestdError:
        return GuestdError(ErrorCode.BAD_REQUEST, f"bad glob {pattern!r}: {why}", details={"field": "pattern"})

    try:
        rule = parse_rule(pattern)
    except GlobError as exc:
        raise bad(str(exc)) from None
    if rule is None:
        raise bad("a blank or a # comment matches nothing (escape a leading # as \\#)")
    if rule.negated:
        raise bad("a negated pattern lists nothing (escape a leading ! as \\!)")
    return rule


def read_ignore_file(
    dirfd: int, name: bytes = b".gitignore", budget: Budget | None = None, max_cost: int | None = None
) -> RuleSet | None:
    """The rules of ``name`` in ``dirfd``, read without following a symlink or opening anything
    but a regular file (bounded); None when there is none. Raises ``TooCostly`` and
    ``OutOfTime`` as :meth:`RuleSet.parse` does."""
    try:
        pathfd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
    except OSError:
        return None
    try:
        fd = reopen_regular(pathfd, os.O_RDONLY | os.O_NONBLOCK, os.fsdecode(name))
    except (OSError, GuestdError):
        return None  # a symlink, FIFO or device named .gitignore: not read, not opened
    finally:
        os.close(pathfd)
    try:
        text = os.read(fd, MAX_IGNORE_BYTES)
    except OSError:
        return None
    finally:
        os.close(fd)
    return RuleSet.parse(text, budget, max_cost)
