"""guestctl cp | cat | ls | rm | mkdir: guest files. ``cp`` writes the guest side ``:PATH`` (it
has two sides, :mod:`guestd.cli.cp`); the others take only guest paths, the colon optional."""

from __future__ import annotations

import argparse
import base64
import codecs
import json
import sys
import tempfile
from typing import IO, Any

from guestd.cli import cp, terminal
from guestd.cli.paths import guest_only
from guestd.cli.shared import Subcommands, add_command, print_json
from guestd.cli.terminal import field
from guestd.client.aio import AsyncClient
from guestd.wire.errors import ErrorCode, GuestdError
from guestd.wire.paths import printable_path

CAT_SPOOL_MEMORY = 1024 * 1024  # cat --json: kept in memory up to this, then in a temp file
CAT_JSON_CHUNK = 3 * 21845  # a multiple of 3: base64 of each chunk joins without padding inside
BINARY_SNIFF = 8000  # as git: a NUL (or here, bytes that are not UTF-8) in the first 8000 bytes


def register(sub: Subcommands) -> None:
    c = add_command(
        sub,
        "cp",
        cp.copy,
        help="copy files and directories in or out, as docker cp (:PATH is the guest side)",
        description="Copy SRC to DST, one of them a guest path written :PATH (':' alone is the workspace), "
        "with docker cp's rules: into an existing directory as DIR/NAME, a trailing / on DST says it must be "
        "a directory, SRC ending in /. copies a directory's contents, directories need no -r.",
    )
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--parents", action="store_true", help="make DST's missing parent directories (either side)")
    c.add_argument("-r", "-R", "--recursive", action="store_true", help="accepted, changes nothing (as docker cp)")
    c.add_argument(
        "--exclude",
        action="append",
        default=None,
        metavar="GLOB",
        help="leave out what GLOB matches in a directory's tree (grep's --glob syntax; repeatable)",
    )
    c.add_argument("--no-progress", action="store_true", help="no progress bar (shown only on a terminal)")
    cat_cmd = add_command(
        sub,
        "cat",
        cat,
        help="print a guest file (binary data on a terminal: a note instead; piped: the bytes)",
    )
    cat_cmd.add_argument("path", metavar="[:]PATH")
    ls = add_command(sub, "ls", list_directory, help="list a guest directory (default: the workspace)")
    ls.add_argument("path", metavar="[:]DIR", nargs="?", default="")
    r = add_command(
        sub,
        "rm",
        remove,
        help="remove guest paths, as rm: a directory needs -r (or -d when empty)",
    )
    r.add_argument("-r", "-R", "--recursive", action="store_true", help="remove directories and their contents")
    r.add_argument("-d", "--dir", action="store_true", help="remove empty directories")
    r.add_argument("-f", "--force", action="store_true", help="a missing path is not an error")
    r.add_argument("paths", metavar="[:]PATH", nargs="+")
    m = add_command(sub, "mkdir", make_directory, help="make guest directories")
    m.add_argument("-p", "--parents", action="store_true", help="make missing parents; no error if it exists")
    m.add_argument("paths", metavar="[:]DIR", nargs="+")


class _BinaryFile(Exception):
    """Raised from cat's sink to stop the download: what came is not text for a terminal."""


def looks_binary(head: bytes) -> bool:
    """A NUL, or bytes that are not UTF-8, in the first BINARY_SNIFF bytes (a sequence cut by
    the end of ``head`` is not held against it)."""
    head = head[:BINARY_SNIFF]
    if b"\0" in head:
        return True
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return True
    return False


async def cat(client: AsyncClient, ns: argparse.Namespace) -> int:
    """The file's bytes (neutralized on a terminal unless --raw, and binary data only noted
    there); under --json one object whose ``data`` is the text, or ``{"base64": ...}`` when
    the file is not UTF-8, streamed out of a spooled copy, so memory stays at one chunk and
    a failed download still prints nothing but the error."""
    path = guest_only(ns.path)
    if ns.json:
        return await _cat_json(client, path)
    out = terminal.stdout(ns.raw)
    to_terminal = sys.stdout.isatty() and not ns.raw
    first = True

    def sink(data: bytes) -> None:
        nonlocal first
        if first and to_terminal and looks_binary(data):
            raise _BinaryFile
        first = False
        out.write(data)

    try:
        await client.download(path, sink=sink)
    except _BinaryFile:
        size = (await client.stat(path)).size
        print(
            f"guestctl: {field(printable_path(path))}: binary data, {size} bytes, not shown on a terminal"
            " (pipe or redirect it, or give --raw)",
            file=sys.stderr,
        )
    finally:
        out.close()
    return 0


async def _cat_json(client: AsyncClient, path: str) -> int:
    with tempfile.SpooledTemporaryFile(max_size=CAT_SPOOL_MEMORY) as spool:
        size = await client.download(path, sink=spool.write)
        is_text = _is_utf8(spool)
        write = sys.stdout.write
        write(json.dumps({"bytes": size, "path": path})[:-1] + ', "data": ')
        write('"' if is_text else '{"base64": "')
        decoder = codecs.getincrementaldecoder("utf-8")()
        for chunk in iter(lambda: spool.read(CAT_JSON_CHUNK), b""):
            write(json.dumps(decoder.decode(chunk))[1:-1] if is_text else base64.b64encode(chunk).decode())
        write('"}\n' if is_text else '"}}\n')
    return 0


def _is_utf8(spool: IO[bytes]) -> bool:
    """Whether the spooled bytes are UTF-8 (read once, a chunk at a time); rewound after."""
    spool.seek(0)
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        for chunk in iter(lambda: spool.read(CAT_JSON_CHUNK), b""):
            decoder.decode(chunk)
        decoder.decode(b"", final=True)
        return True
    except UnicodeDecodeError:
        return False
    finally:
        spool.seek(0)


async def list_directory(client: AsyncClient, ns: argparse.Namespace) -> int:
    path = guest_only(ns.path)
    listing = await client.listdir(path)
    if ns.json:
        entries = [dict(e.__dict__) for e in listing.entries]  # a name: str if UTF-8, else {"base64"}
        print_json({"entries": entries, "truncated": listing.truncated, "total": listing.total})
    else:
        for e in listing.entries:
            print(f"{e.type:7} {e.mode:04o} {e.size:>12} {field(printable_path(e.name))}")
        if listing.truncated:
            print(f"guestctl: listing truncated: {len(listing.entries)} of {listing.total}", file=sys.stderr)
    return 0


async def remove(client: AsyncClient, ns: argparse.Namespace) -> int:
    """As coreutils rm: every path is tried; a directory needs -r (or -d when empty); -f
    makes a missing path no error. Exit 1 when any path failed (each said on stderr; under
    --json one error object listing them)."""
    removed = 0
    failed: list[dict[str, Any]] = []
    for arg in ns.paths:
        path = guest_only(arg)
        try:
            removed += await _remove_one(client, path, ns)
        except GuestdError as err:
            if ns.force and err.code == ErrorCode.NOT_FOUND.value:
                continue
            failed.append({"path": path, **err.to_body()})
            if not ns.json:
                print(f"guestctl: rm: {field(printable_path(path))}: {field(err.message)}", file=sys.stderr)
    if ns.json:
        if failed:
            first = failed[0]
            error = {"code": first["code"], "message": f"rm: {first['path']}: {first['message']}"}
            print_json({"error": {**error, "details": {"failed": failed, "removed": removed}}})
        else:
            print_json({"removed": removed})
    return 1 if failed else 0


async def _remove_one(client: AsyncClient, path: str, ns: argparse.Namespace) -> int:
    if not ns.recursive:
        kind = (await client.stat(path, follow=False)).type
        if kind == "dir" and not ns.dir:
            raise GuestdError(
                ErrorCode.IS_A_DIRECTORY,
                "is a directory (-r removes it with its contents, -d removes it when empty)",
            )
    try:
        return await client.remove(path, recursive=ns.recursive or None)
    except GuestdError as err:
        if err.code == ErrorCode.NOT_EMPTY.value:
            raise GuestdError(err.code, "directory not empty (-r removes it with its contents)") from None
        raise


async def make_directory(client: AsyncClient, ns: argparse.Namespace) -> int:
    created = 0
    for arg in ns.paths:
        created += await client.mkdir(guest_only(arg), parents=ns.parents)
    if ns.json:
        print_json({"created": created})
    return 0
