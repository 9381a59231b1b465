"""Glob patterns with gitignore's rules, for ``file.glob``, ``file.grep``'s filters, tree
include/exclude and ``.gitignore`` files.

One translation (a glob to a ``re`` over the path relative to a base, as bytes) serves all of
them, so the pure-Python search and ripgrep's own glob and ignore rules (the ``ignore`` crate:
overrides first, then ``.gitignore`` deepest first, then hidden names) decide the same way:

- ``*`` and ``?`` never match ``/``; ``[...]`` is a class (``[!...]`` negated); ``\\x`` is ``x``.
- ``**/`` at the start matches any leading directories (none included), ``/**/`` in the middle
  any directories between (none included), ``/**`` at the end everything below.
- A pattern with no ``/`` but a trailing one matches the name at any depth; one with a ``/``
  elsewhere is anchored to the base (a leading ``/`` only anchors). A trailing ``/`` matches
  directories only. In ignore files ``!`` negates, ``#`` starts a comment, and the last
  matching line of a file decides.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from guestd.files.fs import reopen_regular
from guestd.wire.errors import GuestdError

MAX_IGNORE_BYTES = 1024 * 1024  # a .gitignore larger than this is read only this far
MAX_PATTERNS = 10_000  # lines kept per ignore file


def glob_regex(glob: str, *, anchored: bool) -> re.Pattern[bytes]:
    """``glob`` (already without a ``!`` or trailing ``/``) as a regex over relative paths.
    ``anchored``: the pattern names paths from the base; else a name at any depth."""
    pat = os.fsencode(glob)
    if pat.startswith(b"/"):
        pat = pat[1:]
    out = [] if anchored else [b"(?:.*/)?"]
    i, n = 0, len(pat)
    while i < n:
        c = pat[i : i + 1]
        if pat.startswith(b"**", i):
            before_ok = i == 0 or pat[i - 1 : i] == b"/"
            after = pat[i + 2 : i + 3]
            if before_ok and after == b"/":
                out.append(b"(?:.*/)?")
                i += 3
                continue
            if before_ok and after == b"":
                out.append(b".*")
                i += 2
                continue
            out.append(b"[^/]*")
            i += 2
            continue
        if c == b"*":
            out.append(b"[^/]*")
        elif c == b"?":
            out.append(b"[^/]")
        elif c == b"[":
            j = i + 1
            if pat[j : j + 1] in (b"!", b"^"):
                j += 1
            if pat[j : j + 1] == b"]":
                j += 1
            while j < n and pat[j : j + 1] != b"]":
                j += 1
            if j >= n:
                out.append(re.escape(c))
            else:
                body = pat[i + 1 : j]
                if body[:1] in (b"!", b"^"):
                    body = b"^" + body[1:]
                body = body.replace(b"\\", b"\\\\")
                out.append(b"(?!/)[" + body + b"]")
                i = j
        elif c == b"\\" and i + 1 < n:
            i += 1
            out.append(re.escape(pat[i : i + 1]))
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile(b"".join(out) + b"\\Z", re.DOTALL)


@dataclass(frozen=True, slots=True)
class Rule:
    regex: re.Pattern[bytes]
    negated: bool
    dir_only: bool


def parse_rule(line: str | bytes, *, always_anchored: bool = False) -> Rule | None:
    """One gitignore line (or one override glob) as a rule; None for blanks and comments."""
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
    return Rule(glob_regex(os.fsdecode(raw), anchored=anchored), negated, dir_only)


class RuleSet:
    """The rules of one ignore file (or one override list), relative to ``base``: the last
    matching rule decides: True (matched: ignored, or for overrides whitelisted), False (a
    negation matched), None (no rule matched)."""

    def __init__(self, rules: list[Rule]) -> None:
        self.rules = rules

    @classmethod
    def parse(cls, text: bytes) -> RuleSet:
        rules = []
        for line in text.split(b"\n")[:MAX_PATTERNS]:
            rule = parse_rule(line)
            if rule is not None:
                rules.append(rule)
        return cls(rules)

    def matched(self, rel: bytes, is_dir: bool) -> bool | None:
        for rule in reversed(self.rules):
            if rule.dir_only and not is_dir:
                continue
            if rule.regex.match(rel):
                return not rule.negated
        return None


class Overrides:
    """ripgrep's ``--glob`` list: a glob includes, ``!glob`` excludes, the last match wins;
    with any including glob, a file that matches none is excluded (directories still walked).
    An override decides before ``.gitignore`` and hidden names do."""

    def __init__(self, globs: list[str]) -> None:
        self.rules: list[Rule] = []
        self.whitelists = 0
        for g in globs:
            rule = parse_rule(g)
            if rule is None:
                continue
            self.rules.append(rule)  # here a plain glob takes, a negated one skips
            self.whitelists += not rule.negated

    def decide(self, rel: bytes, is_dir: bool) -> str | None:
        """'take', 'skip' or None (no say)."""
        for rule in reversed(self.rules):
            if rule.dir_only and not is_dir:
                continue
            if rule.regex.match(rel):
                return "skip" if rule.negated else "take"
        if self.whitelists and not is_dir:
            return "skip"
        return None


def read_ignore_file(dirfd: int, name: bytes = b".gitignore") -> RuleSet | None:
    """The rules of ``name`` in ``dirfd``, read without following a symlink or opening anything
    but a regular file (bounded); None when there is none."""
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
        return RuleSet.parse(os.read(fd, MAX_IGNORE_BYTES))
    except OSError:
        return None
    finally:
        os.close(fd)
