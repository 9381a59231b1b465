"""guestctl cp: ``docker cp``'s rules between this host and the guest (the guest side ``:PATH``).

Where SRC goes, as ``docker cp`` decides it (one side local, the other ``:PATH``; a guest path
that is relative, or empty as in ``:``, starts at the workspace):

| SRC | DST | result |
|---|---|---|
| file | missing | the file is written as DST (DST's parent must exist; ``--parents`` makes it) |
| file | missing, ends with ``/`` | error: the directory must exist (``--parents`` makes it) |
| file | a file | DST is overwritten |
| file | a directory | copied into it as DST/NAME |
| directory | missing | DST is made, holding SRC's contents |
| directory | a file | error: cannot copy a directory to a file |
| directory | a directory | copied into it as DST/NAME (merged into one already there) |
| directory ending in ``/.`` | a directory | SRC's contents are merged into DST |

A directory needs no ``-r`` (``docker cp`` has none; ``-r`` is accepted and changes nothing).
A merge is not atomic (``docker cp``'s is not either): the tree goes to a hidden directory
beside what it lands in (``.guestctl-cp-*``, removed at the end, also on failure), then each
entry is renamed into place; an entry whose type differs from what is there (a file over a
directory or the other way round) stops the copy with an error naming it. A copy into a missing
DST makes the whole tree appear at once, as ``tree.upload``/``tree.download`` do.

Bytes reported are content bytes (regular files' sizes) both ways, never tar bytes. The
progress bar (a terminal's stderr only) counts a file's bytes against its size, and a tree's
archive bytes as a counter (its total is not known ahead).
"""

from __future__ import annotations

import argparse
import os
import posixpath
import secrets
import shutil
import stat
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

from guestd.cli.shared import guest_path, print_json
from guestd.cli.terminal import field
from guestd.client.aio import AsyncClient
from guestd.wire.errors import ErrorCode, GuestdError
from guestd.wire.paths import WirePath, printable_path

PROGRESS_MIN = 1024 * 1024  # smaller files finish before a progress bar would tell anything
TEMP_PREFIX = ".guestctl-cp-"


@dataclass(frozen=True)
class Endpoint:
    """One side of the copy as written: ``guest`` for ``:PATH``; ``path`` without the colon."""

    guest: bool
    path: str

    def shown(self, path: str | None = None) -> str:
        p = self.path if path is None else path
        return field(printable_path((":" if self.guest else "") + p))


def parse_endpoints(src: str, dst: str) -> tuple[Endpoint, Endpoint]:
    gsrc, gdst = guest_path(src), guest_path(dst)
    if (gsrc is None) == (gdst is None):
        raise SystemExit("guestctl cp: exactly one of SRC and DST must be a guest path (:PATH)")
    return Endpoint(gsrc is not None, gsrc if gsrc is not None else src), Endpoint(
        gdst is not None, gdst if gdst is not None else dst
    )


def join(directory: str, name: str) -> str:
    """``directory/name``; an empty guest directory (``:``) is the workspace, so ``name`` alone."""
    if directory in ("", "."):
        return name
    return directory.rstrip("/") + "/" + name if directory.rstrip("/") else "/" + name


def parent_of(path: str) -> str:
    return posixpath.dirname(path.rstrip("/")) or ("/" if path.startswith("/") else ".")


def source_name(path: str) -> str | None:
    """The name SRC takes inside a destination directory; None when SRC means its contents
    (``dir/.``, ``.``, ``/``, the workspace ``:``)."""
    name = posixpath.basename(path.rstrip("/"))
    return None if name in ("", ".", "..") else name


async def kind_of(client: AsyncClient, end: Endpoint, path: str) -> str | None:
    """What is at ``path``: "dir", "file", another type's name, or None when nothing is there
    (symlinks followed). A trailing ``/`` is not asked about here: the plan reads it."""
    path = path.rstrip("/") or path[:1]
    if end.guest:
        try:
            return (await client.stat(path or ".")).type
        except GuestdError as err:
            if err.code == ErrorCode.NOT_FOUND.value:
                return None
            raise
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return None
    return "dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "other"


def _error(code: ErrorCode, message: str) -> GuestdError:
    return GuestdError(code, f"cp: {message}")


@dataclass(frozen=True)
class Plan:
    """What the copy does: write ``target`` (a file, or a new directory), or merge the tree
    into the existing directory ``target`` (``merge``)."""

    directory: bool
    target: str
    merge: bool
    make_parents: bool


async def plan(client: AsyncClient, src: Endpoint, dst: Endpoint, parents: bool) -> Plan:
    """docker cp's table (module docstring) for these two paths as they are now."""
    src_kind = await kind_of(client, src, src.path)
    if src_kind is None:
        raise _error(ErrorCode.NOT_FOUND, f"{src.shown()}: no such file or directory")
    if src_kind not in ("file", "dir"):
        raise _error(ErrorCode.NOT_A_FILE, f"{src.shown()} is a {src_kind}: only files and directories are copied")
    directory = src_kind == "dir"
    name = source_name(src.path)
    must_be_dir = dst.path.endswith("/") or dst.path in ("", ".")
    dst_kind = await kind_of(client, dst, dst.path)
    if dst_kind == "dir":
        if name is None:
            if not directory:  # a file given as "x/." or similar: no name to put it under
                raise _error(ErrorCode.NOT_A_DIRECTORY, f"{src.shown()} is not a directory")
            return Plan(True, dst.path, True, False)
        target = join(dst.path, name)
        there = await kind_of(client, dst, target)
        if directory:
            if there not in (None, "dir"):
                raise _error(
                    ErrorCode.NOT_A_DIRECTORY, f"cannot copy a directory to {dst.shown(target)}: not a directory"
                )
            return Plan(True, target, there == "dir", False)
        if there == "dir":
            raise _error(ErrorCode.IS_A_DIRECTORY, f"cannot overwrite the directory {dst.shown(target)} with a file")
        return Plan(False, target, False, False)
    if dst_kind is not None:  # a file (or another non-directory) is there
        if directory:
            raise _error(ErrorCode.NOT_A_DIRECTORY, f"cannot copy a directory to {dst.shown()}: it is a file")
        if must_be_dir:
            raise _error(ErrorCode.NOT_A_DIRECTORY, f"{dst.shown()}: not a directory (a trailing / says DST is one)")
        return Plan(False, dst.path, False, False)
    # Nothing at DST.
    if must_be_dir and not directory:
        if not parents:
            raise _error(
                ErrorCode.NOT_FOUND,
                f"{dst.shown()}: no such directory (a trailing / says DST is a directory; --parents makes it)",
            )
        if name is None:
            raise _error(ErrorCode.NOT_A_DIRECTORY, f"{src.shown()} is not a directory")
        return Plan(False, join(dst.path, name), False, True)
    parent = parent_of(dst.path)
    if not parents and await kind_of(client, dst, parent) != "dir":
        raise _error(ErrorCode.NOT_FOUND, f"{dst.shown(parent)}: no such directory (--parents makes it)")
    return Plan(directory, dst.path.rstrip("/") or dst.path, False, parents)


def progress_bar(total: int | None, desc: str, disabled: bool) -> Any:
    """A tqdm bar on stderr when it is a terminal: a file of PROGRESS_MIN or more against its
    size, a tree (``total`` None) as a byte counter. None otherwise."""
    if disabled or not sys.stderr.isatty() or (total is not None and total < PROGRESS_MIN):
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, file=sys.stderr)


async def copy(client: AsyncClient, ns: argparse.Namespace) -> int:
    src, dst = parse_endpoints(ns.src, ns.dst)
    how = await plan(client, src, dst, ns.parents)
    if ns.exclude and not how.directory:
        raise SystemExit("guestctl cp: --exclude applies to a directory's tree, SRC is a file")
    desc = field(printable_path(posixpath.basename(src.path.rstrip("/")) or src.path))
    if how.directory:
        out = await (download_tree if src.guest else upload_tree)(client, src.path, how, ns.exclude, desc, ns)
    else:
        out = await (download_file if src.guest else upload_file)(client, src.path, how, desc, ns)
    target = (":" if dst.guest else "") + how.target
    out = {"direction": "download" if src.guest else "upload", "src": ns.src, "dst": target, **out}
    if ns.json:
        print_json(out)
    else:
        what = f"{out['entries']} entries, {out['bytes']} bytes" if how.directory else f"{out['bytes']} bytes"
        merged = ", merged into the directory there" if how.merge else ""
        checked = ", size verified" if not how.directory else ""
        shown = f"{field(printable_path(ns.src))} -> {field(printable_path(target))}"
        print(f"{shown}: {what} ({out['direction']}{merged}{checked})")
    return 0


async def upload_file(client: AsyncClient, local: str, how: Plan, desc: str, ns: argparse.Namespace) -> dict[str, Any]:
    size = os.path.getsize(local)
    bar = progress_bar(size, desc, ns.no_progress)
    try:
        sent = await client.upload(local, how.target, parents=how.make_parents or None, progress=_tick(bar))
    finally:
        if bar is not None:
            bar.close()
    remote_size = (await client.stat(how.target)).size
    if remote_size != size or sent != size:
        raise GuestdError("io_error", f"size check failed: local {size}, sent {sent}, guest {remote_size}")
    return {"bytes": size, "kind": "file"}


async def download_file(
    client: AsyncClient, remote: str, how: Plan, desc: str, ns: argparse.Namespace
) -> dict[str, Any]:
    if how.make_parents:
        os.makedirs(parent_of(how.target), exist_ok=True)
    size = (await client.stat(remote)).size
    bar = progress_bar(size, desc, ns.no_progress)
    try:
        # Never more than stat announced: the download fails (and its partial file is removed)
        # at the first byte beyond it.
        got = await client.download(remote, how.target, max_bytes=size, progress=_tick(bar))
    finally:
        if bar is not None:
            bar.close()
    wrote = os.path.getsize(how.target)
    if got != size or wrote != got:
        raise GuestdError("io_error", f"size check failed: stat said {size}, received {got!r}, wrote {wrote}")
    return {"bytes": got, "kind": "file"}


async def upload_tree(
    client: AsyncClient, local: str, how: Plan, exclude: list[str] | None, desc: str, ns: argparse.Namespace
) -> dict[str, Any]:
    into = join(how.target, TEMP_PREFIX + secrets.token_hex(6)) if how.merge else how.target
    bar = progress_bar(None, desc, ns.no_progress)
    try:
        try:
            up = await client.upload_tree(
                local, into, parents=how.make_parents or None, exclude=exclude or None, progress=_tick(bar)
            )
        finally:
            if bar is not None:
                bar.close()
        if how.merge:
            await merge_in_guest(client, into, how.target, budget=[up.entries + 16])
    finally:
        if how.merge:
            await _remove_quietly(client, into)
    # The guest counts the archive's members, its "." (the directory itself) included: entries
    # below it, as a download counts them.
    return {"bytes": up.bytes, "entries": max(0, up.entries - 1), "kind": "dir", "merged": how.merge}


async def download_tree(
    client: AsyncClient, remote: str, how: Plan, exclude: list[str] | None, desc: str, ns: argparse.Namespace
) -> dict[str, Any]:
    if how.make_parents:
        os.makedirs(parent_of(how.target), exist_ok=True)
    holder = tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=how.target) if how.merge else None
    into = os.path.join(holder, "tree") if holder else how.target
    bar = progress_bar(None, desc, ns.no_progress)
    try:
        try:
            await client.download_tree(remote or ".", into, exclude=exclude or None, progress=_tick(bar))
        finally:
            if bar is not None:
                bar.close()
        entries, content = _content_of(into)
        if holder:
            _merge_locally(into, how.target)
    finally:
        if holder:
            shutil.rmtree(holder, ignore_errors=True)
    return {"bytes": content, "entries": entries, "kind": "dir", "merged": how.merge}


def _tick(bar: Any) -> Any:
    return bar.update if bar is not None else None


def _content_of(root: str) -> tuple[int, int]:
    """Entries below ``root`` and the bytes of its regular files (what the tree holds, not the
    archive that carried it)."""
    entries = content = 0
    for here, dirs, names in os.walk(root):
        entries += len(dirs) + len(names)
        for name in names:
            info = os.lstat(os.path.join(here, name))
            if stat.S_ISREG(info.st_mode):
                content += info.st_size
    return entries, content


def _merge_locally(src: str, dst: str) -> None:
    """Move what ``src`` holds into the existing directory ``dst``: new names are renamed in,
    directories on both sides merged, a non-directory replaces a non-directory, and a type
    clash (a symlink to a directory counts as a non-directory) is an error naming the path."""
    for name in sorted(os.listdir(src)):
        s, d = os.path.join(src, name), os.path.join(dst, name)
        try:
            there = os.lstat(d)
        except FileNotFoundError:
            os.rename(s, d)
            continue
        s_dir, d_dir = stat.S_ISDIR(os.lstat(s).st_mode), stat.S_ISDIR(there.st_mode)
        if s_dir and d_dir:
            _merge_locally(s, d)
        elif not s_dir and not d_dir:
            os.replace(s, d)
        else:
            what = "a directory with a non-directory" if d_dir else "a non-directory with a directory"
            raise _error(ErrorCode.EXISTS, f"cannot overwrite {what}: {field(printable_path(d))}")


def _join_wire(directory: WirePath, name: WirePath) -> WirePath:
    if isinstance(directory, bytes) or isinstance(name, bytes):
        d = directory if isinstance(directory, bytes) else os.fsencode(directory)
        n = name if isinstance(name, bytes) else os.fsencode(name)
        return d.rstrip(b"/") + b"/" + n
    return join(directory, name)


async def merge_in_guest(client: AsyncClient, src: WirePath, dst: WirePath, budget: list[int]) -> None:
    """:func:`_merge_locally` in the guest, by ``file.list``/``file.stat``/``file.rename``.
    Each entry moved out of ``src`` leaves its listing, so listing again reaches the next ones
    (a listing is capped); ``budget`` (the entries uploaded, shared by the recursion) bounds
    the rounds against a guest that keeps listing entries."""
    while True:
        listing = await client.listdir(src)
        if not listing.entries:
            return
        for entry in listing.entries:
            budget[0] -= 1
            if budget[0] < 0:
                raise GuestdError("io_error", "cp: the guest listed more entries than were uploaded")
            s, d = _join_wire(src, entry.name), _join_wire(dst, entry.name)
            try:
                there: str | None = (await client.stat(d, follow=False)).type
            except GuestdError as err:
                if err.code != ErrorCode.NOT_FOUND.value:
                    raise
                there = None
            if there is None:
                await client.rename(s, d, overwrite=False)
            elif entry.type == "dir" and there == "dir":
                await merge_in_guest(client, s, d, budget)
                await client.remove(s)
            elif entry.type != "dir" and there != "dir":
                await client.rename(s, d, overwrite=True)
            else:
                what = "a directory with a non-directory" if there == "dir" else "a non-directory with a directory"
                raise _error(ErrorCode.EXISTS, f"cannot overwrite {what}: :{field(printable_path(d))}")


async def _remove_quietly(client: AsyncClient, path: str) -> None:
    try:
        await client.remove(path, recursive=True)
    except GuestdError as err:
        if err.code != ErrorCode.NOT_FOUND.value:
            raise
