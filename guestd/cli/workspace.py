"""guestctl find | grep | view | edit | apply-patch | watch, and ``cp -r`` (called by ``cp``):
the workspace ops of issue 18. Guest text is printed through the terminal sanitizer."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from guestd.cli.shared import Subcommands, add_command, guest_path, print_json
from guestd.cli.terminal import field, text
from guestd.client.aio import AsyncClient
from guestd.wire.paths import printable_path


def register(sub: Subcommands) -> None:
    f = add_command(sub, "find", find, help="guest paths under :DIR matching --glob (sorted)")
    f.add_argument("path", metavar=":DIR")
    f.add_argument(
        "--glob", required=True, help="a glob as grep's --glob: '*.py' at any depth, 'src/**/*.py', '/*.py' top only"
    )
    f.add_argument("--gitignore", action="store_true", help="leave out what .gitignore files ignore")
    f.add_argument("--max", type=int, default=None, help="most results")
    g = add_command(sub, "grep", grep, help="search guest files (ripgrep's rules)")
    g.add_argument("pattern")
    g.add_argument("path", metavar=":DIR")
    g.add_argument("-i", "--ignore-case", action="store_true")
    g.add_argument("-F", "--fixed-strings", action="store_true")
    g.add_argument("-C", "--context", type=int, default=None)
    g.add_argument("--glob", action="append", default=None, help="include GLOB, or !GLOB to exclude (repeatable)")
    g.add_argument("--max", type=int, default=None, help="most matching lines")
    g.add_argument("--hidden", action="store_true")
    g.add_argument("--no-ignore", action="store_true", help="do not respect .gitignore files")
    v = add_command(sub, "view", view, help="a guest file's lines numbered, or a directory two levels deep")
    v.add_argument("path", metavar=":PATH")
    v.add_argument("--lines", default=None, metavar="A:B", help="only lines A to B (either may be left out)")
    e = add_command(sub, "edit", edit, help="replace the one occurrence of --old with --new, or --undo")
    e.add_argument("path", metavar=":PATH")
    e.add_argument("--old", default=None)
    e.add_argument("--new", default=None)
    e.add_argument("--undo", action="store_true", help="revert the file's last edit")
    p = add_command(sub, "apply-patch", apply_patch, help="apply a unified diff from stdin under :DIR (all or nothing)")
    p.add_argument("path", metavar=":DIR")
    p.add_argument("-p", "--strip", type=int, default=None, help="leading components to strip (default 1)")
    w = add_command(sub, "watch", watch, help="print changes under :DIR as JSON lines until interrupted")
    w.add_argument("path", metavar=":DIR")
    w.add_argument("--include", action="append", default=None)
    w.add_argument("--exclude", action="append", default=None)


def _guest(arg: str, cmd: str) -> str:
    path = guest_path(arg)
    if path is None:
        raise SystemExit(f"guestctl {cmd}: the guest path is written :PATH")
    return path


async def find(client: AsyncClient, ns: argparse.Namespace) -> int:
    r = await client.glob(_guest(ns.path, "find"), ns.glob, gitignore=ns.gitignore or None, max_results=ns.max)
    if ns.json:
        print_json({"paths": r.paths, "total": r.total, "truncated": r.truncated, "bound": r.bound})
    else:
        for p in r.paths:
            print(field(printable_path(p)))
        if r.truncated:
            print(f"guestctl: {len(r.paths)} of {r.total} shown ({r.bound or 'max'})", file=sys.stderr)
    return 0


async def grep(client: AsyncClient, ns: argparse.Namespace) -> int:
    r = await client.grep(
        _guest(ns.path, "grep"),
        ns.pattern,
        literal=ns.fixed_strings or None,
        ignore_case=ns.ignore_case or None,
        globs=ns.glob,
        context=ns.context,
        max_matches=ns.max,
        gitignore=False if ns.no_ignore else None,
        hidden=ns.hidden or None,
    )
    if ns.json:
        for line in r.lines:
            fields = {"kind": line.kind, "path": line.path, "line": line.line, "text": line.text}
            print_json({**fields, "truncated": line.truncated})
        print_json({"matches": r.matches, "files": r.files, "truncated": r.truncated, "timed_out": r.timed_out})
    else:
        for line in r.lines:
            sep = ":" if line.kind == "match" else "-"
            body = line.text.rstrip(b"\n").decode("utf-8", "backslashreplace")
            cut = " [... cut: the line is longer than 4096 bytes]" if line.truncated else ""  # as rg marks it
            print(f"{field(printable_path(line.path))}{sep}{line.line}{sep}{text(body)}{cut}")
        if r.truncated:
            print(f"guestctl: stopped at {r.matches} matching lines (--max)", file=sys.stderr)
        if r.timed_out:
            print("guestctl: the search timed out: what was found in time is shown", file=sys.stderr)
    return 0 if r.matches else 1  # as grep: 1 when nothing matched


async def view(client: AsyncClient, ns: argparse.Namespace) -> int:
    start = end = None
    if ns.lines:
        a, _, b = ns.lines.partition(":")
        start, end = (int(a) if a else None), (int(b) if b else None)
    v = await client.view(_guest(ns.path, "view"), start_line=start, end_line=end)
    if ns.json:
        print_json(v.__dict__)
    else:
        sys.stdout.write(text(v.content))
    return 0


async def edit(client: AsyncClient, ns: argparse.Namespace) -> int:
    path = _guest(ns.path, "edit")
    if ns.undo:
        if ns.old is not None or ns.new is not None:
            raise SystemExit("guestctl edit: --undo takes no --old/--new")
        r = await client.undo(path)
    else:
        if ns.old is None or ns.new is None:
            raise SystemExit("guestctl edit: give --old TEXT --new TEXT, or --undo")
        r = await client.str_replace(path, ns.old, ns.new)
    if ns.json:
        print_json(r.__dict__)
    else:
        sys.stdout.write(text(r.snippet))
    return 0


async def apply_patch(client: AsyncClient, ns: argparse.Namespace) -> int:
    files = await client.apply_patch(_guest(ns.path, "apply-patch"), sys.stdin.buffer.read(), strip=ns.strip)
    if ns.json:
        print_json({"files": files})
    else:
        for f in files:
            print(f"{f.action:6} {field(printable_path(f.path))} ({f.hunks} hunks)")
    return 0


async def watch(client: AsyncClient, ns: argparse.Namespace) -> int:
    """JSON lines always (the issue's form); --json changes nothing."""
    w = client.watch(_guest(ns.path, "watch"), include=ns.include, exclude=ns.exclude)
    try:
        async for change in w:
            out: dict[str, Any] = {"kind": change.kind, "path": change.path, "dir": change.is_dir}
            print_json(out)
            sys.stdout.flush()
    finally:
        await w.close()
    return 0


async def copy_tree(client: AsyncClient, ns: argparse.Namespace) -> int:
    """cp -r: a local directory up as :DST, or :SRC down as a new local directory."""
    from guestd.cli.files import _progress

    rsrc, rdst = guest_path(ns.src), guest_path(ns.dst)
    if (rsrc is None) == (rdst is None):
        raise SystemExit("guestctl cp: exactly one of SRC and DST must be a guest path (:PATH)")
    if rdst is not None:
        total = sum(os.lstat(os.path.join(d, n)).st_size for d, _, names in os.walk(ns.src) for n in names)
        bar = _progress(total, os.path.basename(ns.src.rstrip("/")), ns.no_progress)
        try:
            up = await client.upload_tree(
                ns.src, rdst, parents=ns.parents or None, progress=bar.update if bar else None
            )
        finally:
            if bar:
                bar.close()
        out: dict[str, Any] = {"src": ns.src, "dst": rdst, "entries": up.entries, "bytes": up.bytes, "direction": "up"}
    else:
        assert rsrc is not None
        bar = _progress(1 << 62, os.path.basename(rsrc.rstrip("/")), ns.no_progress)  # size unknown: a counter
        try:
            n = await client.download_tree(rsrc, ns.dst, progress=bar.update if bar else None)
        finally:
            if bar:
                bar.close()
        out = {"src": rsrc, "dst": ns.dst, "bytes": n, "direction": "down"}
    if ns.json:
        print_json(out)
    else:
        print(f"{field(printable_path(out['src']))} -> {field(printable_path(out['dst']))}: {out['bytes']} bytes")
    return 0
