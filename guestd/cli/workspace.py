"""guestctl find | grep | view | edit | apply-patch | watch: the workspace ops (a
tree's ``cp`` is :mod:`guestd.cli.cp`). They take only guest paths, the ``:`` optional. Guest
text is printed through the terminal sanitizer."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from guestd.cli.paths import guest_only
from guestd.cli.shared import Subcommands, add_command, print_json, print_listing
from guestd.cli.terminal import field, text
from guestd.client.aio import AsyncClient
from guestd.client.replies import PatchedFile
from guestd.client.workspace import GrepResult
from guestd.wire.paths import printable_path


def register(sub: Subcommands) -> None:
    f = add_command(sub, "find", find, help="guest paths under DIR (default: the workspace) matching --glob (sorted)")
    f.add_argument("path", metavar="[:]DIR", nargs="?", default="")
    f.add_argument(
        "--glob", required=True, help="a glob as grep's --glob: '*.py' at any depth, 'src/**/*.py', '/*.py' top only"
    )
    f.add_argument("--gitignore", action="store_true", help="leave out what .gitignore files ignore")
    f.add_argument("--max", type=int, default=None, help="most results")
    g = add_command(
        sub,
        "grep",
        grep,
        help="search guest files (ripgrep's rules; --json prints JSON Lines)",
        description="Search the files under DIR (default: the workspace) with ripgrep in the guest. Prints "
        "PATH:LINE:TEXT per matching line (PATH-LINE-TEXT for context lines, -- between groups that do not "
        "touch); exits 1 when nothing matched. With --json: JSON Lines, one object per line "
        '({"kind": "match"|"context", "path", "line", "text", "truncated"}; with -l {"kind": "file", "path"}) '
        'and last {"kind": "summary", "matches", "files", "truncated", "timed_out"}; text is a str when it is '
        'UTF-8, else {"base64": ...}.',
    )
    g.add_argument("pattern")
    g.add_argument("path", metavar="[:]DIR", nargs="?", default="")
    g.add_argument("-i", "--ignore-case", action="store_true")
    g.add_argument("-F", "--fixed-strings", action="store_true")
    g.add_argument("-w", "--word-regexp", action="store_true", help="only whole words (the pattern within \\b)")
    g.add_argument("-l", "--files-with-matches", action="store_true", help="print only the names of files that match")
    g.add_argument("-n", "--line-number", action="store_true", help="accepted: line numbers are always printed")
    g.add_argument("-C", "--context", type=int, default=None, help="lines of context around each match")
    g.add_argument("--glob", action="append", default=None, help="include GLOB, or !GLOB to exclude (repeatable)")
    g.add_argument("--max", type=int, default=None, help="most matching lines")
    g.add_argument("--hidden", action="store_true")
    g.add_argument("--no-ignore", action="store_true", help="do not respect .gitignore files")
    v = add_command(sub, "view", view, help="a guest file's lines numbered, or a directory two levels deep")
    v.add_argument("path", metavar="[:]PATH")
    v.add_argument(
        "--lines", default=None, metavar="N|A:B", help="only line N, or lines A to B (either end may be left out)"
    )
    e = add_command(sub, "edit", edit, help="replace the one occurrence of --old with --new, or --undo")
    e.add_argument("path", metavar="[:]PATH")
    e.add_argument("--old", default=None)
    e.add_argument("--new", default=None)
    e.add_argument("--undo", action="store_true", help="revert the file's last edit")
    p = add_command(sub, "apply-patch", apply_patch, help="apply a unified diff from stdin under :DIR (all or nothing)")
    p.add_argument("path", metavar="[:]DIR")
    p.add_argument("-p", "--strip", type=int, default=None, help="leading components to strip (default 1)")
    w = add_command(
        sub, "watch", watch, help="print changes under DIR as JSON Lines (one object per change) until interrupted"
    )
    w.add_argument("path", metavar="[:]DIR")
    w.add_argument("--include", action="append", default=None)
    w.add_argument("--exclude", action="append", default=None)


async def find(client: AsyncClient, ns: argparse.Namespace) -> int:
    r = await client.glob(guest_only(ns.path), ns.glob, gitignore=ns.gitignore or None, max_results=ns.max)
    if ns.json:
        print_json({"paths": r.paths, "total": r.total, "truncated": r.truncated, "bound": r.bound})
    else:
        for p in r.paths:
            print(field(printable_path(p)))
        if r.truncated:
            print(f"guestctl: {len(r.paths)} of {r.total} shown ({r.bound or 'max'})", file=sys.stderr)
    return 0


# What Rust's regex::escape escapes: the pattern of -F -w goes to rg as a regex.
RUST_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")


def word_pattern(pattern: str, literal: bool) -> str:
    """grep -w as a regex for rg: the pattern (escaped when literal) between word boundaries."""
    body = "".join("\\" + c if c in RUST_REGEX_META else c for c in pattern) if literal else pattern
    return f"\\b(?:{body})\\b"


async def grep(client: AsyncClient, ns: argparse.Namespace) -> int:
    pattern, literal = ns.pattern, ns.fixed_strings
    if ns.word_regexp:
        pattern, literal = word_pattern(pattern, literal), False
    r = await client.grep(
        guest_only(ns.path),
        pattern,
        literal=literal or None,
        ignore_case=ns.ignore_case or None,
        globs=ns.glob,
        context=None if ns.files_with_matches else ns.context,
        max_matches=ns.max,
        gitignore=False if ns.no_ignore else None,
        hidden=ns.hidden or None,
    )
    if ns.files_with_matches:
        _print_files(r, ns.json)
    elif ns.json:
        for line in r.lines:
            fields = {"kind": line.kind, "path": line.path, "line": line.line, "text": line.text}
            print_json({**fields, "truncated": line.truncated})
    else:
        _print_lines(r, grouped=bool(ns.context))
    summary = {"matches": r.matches, "files": r.files, "truncated": r.truncated, "timed_out": r.timed_out}
    if ns.json:
        print_json({"kind": "summary", **summary})
    else:
        if r.truncated:
            print(f"guestctl: stopped at {r.matches} matching lines (--max)", file=sys.stderr)
        if r.timed_out:
            print("guestctl: the search timed out: what was found in time is shown", file=sys.stderr)
    return 0 if r.matches else 1  # as grep: 1 when nothing matched


def _print_files(r: GrepResult, as_json: bool) -> None:
    """grep -l: each file with a match once, in the order found."""
    seen: set[str | bytes] = set()
    for line in r.lines:
        if line.kind != "match" or line.path in seen:
            continue
        seen.add(line.path)
        if as_json:
            print_json({"kind": "file", "path": line.path})
        else:
            print(field(printable_path(line.path)))


def _print_lines(r: GrepResult, grouped: bool) -> None:
    """PATH:LINE:TEXT (``-`` for context lines), and with context ``--`` between groups that do
    not touch, as grep and rg print them."""
    last: tuple[str | bytes, int] | None = None
    for line in r.lines:
        if grouped and last is not None and (line.path != last[0] or line.line != last[1] + 1):
            print("--")
        last = (line.path, line.line)
        sep = ":" if line.kind == "match" else "-"
        body = line.text.rstrip(b"\n").decode("utf-8", "backslashreplace")
        cut = " [... cut: the line is longer than 4096 bytes]" if line.truncated else ""  # as rg marks it
        print(f"{field(printable_path(line.path))}{sep}{line.line}{sep}{text(body)}{cut}")


def line_range(spec: str) -> tuple[int | None, int | None]:
    """view --lines: ``N`` is line N alone, ``A:B`` lines A to B, either end left out."""
    a, colon, b = spec.partition(":")
    try:
        start, end = (int(a) if a else None), (int(b) if b else None)
    except ValueError:
        raise SystemExit(f"guestctl view: --lines wants N or A:B, got {spec!r}") from None
    return (start, end) if colon else (start, start)


async def view(client: AsyncClient, ns: argparse.Namespace) -> int:
    start, end = line_range(ns.lines) if ns.lines else (None, None)
    v = await client.view(guest_only(ns.path), start_line=start, end_line=end)
    return print_reply(ns, v.__dict__, v.content)


async def edit(client: AsyncClient, ns: argparse.Namespace) -> int:
    path = guest_only(ns.path)
    if ns.undo:
        if ns.old is not None or ns.new is not None:
            raise SystemExit("guestctl edit: --undo takes no --old/--new")
        r = await client.undo(path)
    else:
        if ns.old is None or ns.new is None:
            raise SystemExit("guestctl edit: give --old TEXT --new TEXT, or --undo")
        r = await client.str_replace(path, ns.old, ns.new)
    return print_reply(ns, r.__dict__, r.snippet)


def print_reply(ns: argparse.Namespace, fields: dict[str, Any], shown: str) -> int:
    """view, edit: the reply's ``fields`` under --json, else the text it ``shown`` (sanitized); exit 0."""
    if ns.json:
        print_json(fields)
    else:
        sys.stdout.write(text(shown))
    return 0


async def apply_patch(client: AsyncClient, ns: argparse.Namespace) -> int:
    files = await client.apply_patch(guest_only(ns.path), sys.stdin.buffer.read(), strip=ns.strip)
    return print_listing(ns, "files", files, patched_line)


def patched_line(f: PatchedFile) -> str:
    return f"{f.action:6} {field(printable_path(f.path))} ({f.hunks} hunks)"


async def watch(client: AsyncClient, ns: argparse.Namespace) -> int:
    """JSON lines always (the issue's form); --json changes nothing."""
    w = client.watch(guest_only(ns.path), include=ns.include, exclude=ns.exclude)
    try:
        async for change in w:
            out: dict[str, Any] = {"kind": change.kind, "path": change.path, "dir": change.is_dir}
            print_json(out)
            sys.stdout.flush()
    finally:
        await w.close()
    return 0
