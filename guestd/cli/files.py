"""guestctl cp | cat | ls | rm: guest files, the guest side written ``:PATH``."""

from __future__ import annotations

import argparse
import codecs
import json
import os
import stat
import sys
import tempfile
from typing import Any

from guestd.cli import terminal
from guestd.cli.shared import Subcommands, add_command, guest_path, json_path, print_json
from guestd.cli.terminal import field
from guestd.client.aio import AsyncClient
from guestd.wire.errors import GuestdError
from guestd.wire.paths import printable_path

PROGRESS_MIN = 1024 * 1024  # smaller copies finish before a progress bar would tell anything
CAT_SPOOL_MEMORY = 1024 * 1024  # cat --json: kept in memory up to this, then in a temp file
CAT_JSON_CHUNK = 64 * 1024


def register(sub: Subcommands) -> None:
    c = add_command(sub, "cp", copy, help="copy a file in or out (:PATH is the guest side)")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--parents", action="store_true", help="create the destination's parents in the guest")
    c.add_argument("-r", "--recursive", action="store_true", help="copy a directory tree (a tar stream)")
    c.add_argument("--no-progress", action="store_true")
    add_command(sub, "cat", cat, help="print a guest file").add_argument("path")
    add_command(sub, "ls", list_directory, help="list a guest directory").add_argument("path")
    r = add_command(sub, "rm", remove, help="remove a guest path")
    r.add_argument("-r", "--recursive", action="store_true")
    r.add_argument("path")


def guest_path_argument(ns: argparse.Namespace) -> str:
    path = guest_path(ns.path)
    if path is None:
        raise SystemExit(f"guestctl {ns.cmd}: the guest path is written :PATH")
    return path


async def cat(client: AsyncClient, ns: argparse.Namespace) -> int:
    """The file's bytes (neutralized on a terminal unless --raw); under --json one object whose
    ``data`` is streamed out of a spooled copy, so memory stays at one chunk and a failed
    download still prints nothing but the error."""
    path = guest_path_argument(ns)
    if not ns.json:
        out = terminal.stdout(ns.raw)
        try:
            await client.download(path, sink=out.write)
        finally:
            out.close()
        return 0
    with tempfile.SpooledTemporaryFile(max_size=CAT_SPOOL_MEMORY) as spool:
        size = await client.download(path, sink=spool.write)
        spool.seek(0)
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        write = sys.stdout.write
        write(json.dumps({"bytes": size, "path": path})[:-1] + ', "data": "')
        for chunk in iter(lambda: spool.read(CAT_JSON_CHUNK), b""):
            write(json.dumps(decoder.decode(chunk))[1:-1])
        write(json.dumps(decoder.decode(b"", final=True))[1:-1] + '"}\n')
    return 0


async def list_directory(client: AsyncClient, ns: argparse.Namespace) -> int:
    path = guest_path_argument(ns)
    listing = await client.listdir(path)
    if ns.json:
        entries = [json_path(dict(e.__dict__), "name") for e in listing.entries]
        print_json({"entries": entries, "truncated": listing.truncated, "total": listing.total})
    else:
        for e in listing.entries:
            print(f"{e.type:7} {e.mode:04o} {e.size:>12} {field(printable_path(e.name))}")
        if listing.truncated:
            print(f"guestctl: listing truncated: {len(listing.entries)} of {listing.total}", file=sys.stderr)
    return 0


async def remove(client: AsyncClient, ns: argparse.Namespace) -> int:
    path = guest_path_argument(ns)
    n = await client.remove(path, recursive=ns.recursive)
    if ns.json:
        print_json({"removed": n})
    return 0


async def copy(client: AsyncClient, ns: argparse.Namespace) -> int:
    if ns.recursive:
        from guestd.cli.workspace import copy_tree

        return await copy_tree(client, ns)
    out = await _transfer(client, ns)
    if ns.json:
        print_json(out)
    else:
        src, dst = field(printable_path(out["src"])), field(printable_path(out["dst"]))
        print(f"{src} -> {dst}: {out['bytes']} bytes ({out['direction']}, size verified)")
    return 0


async def _transfer(client: AsyncClient, ns: argparse.Namespace) -> dict[str, Any]:
    """Upload or download one regular file and check the size on both ends."""
    rsrc, rdst = guest_path(ns.src), guest_path(ns.dst)
    if (rsrc is None) == (rdst is None):
        raise SystemExit("guestctl cp: exactly one of SRC and DST must be a guest path (:PATH)")
    if rdst is not None:
        local = ns.src
        if not stat.S_ISREG(os.stat(local).st_mode):
            raise SystemExit(f"guestctl cp: {local} is not a regular file")
        size = os.path.getsize(local)
        if rdst.endswith("/"):
            rdst += os.path.basename(local)
        bar = _progress(size, os.path.basename(local), ns.no_progress)
        try:
            sent = await client.upload(local, rdst, parents=ns.parents, progress=bar.update if bar else None)
        finally:
            if bar:
                bar.close()
        remote_size = (await client.stat(rdst)).size
        if remote_size != size or sent != size:
            raise GuestdError("io_error", f"size check failed: local {size}, sent {sent}, guest {remote_size}")
        return {"direction": "upload", "src": local, "dst": rdst, "bytes": size}
    assert rsrc is not None
    local = ns.dst
    if os.path.isdir(local):
        local = os.path.join(local, os.path.basename(rsrc))
    size = (await client.stat(rsrc)).size
    bar = _progress(size, field(os.path.basename(rsrc)), ns.no_progress)
    try:
        # Never more than stat announced: the download fails (and its partial file is removed)
        # at the first byte beyond it.
        got = await client.download(rsrc, local, max_bytes=size, progress=bar.update if bar else None)
    finally:
        if bar:
            bar.close()
    wrote = os.path.getsize(local)
    if got != size or wrote != got:
        raise GuestdError("io_error", f"size check failed: stat said {size}, received {got!r}, wrote {wrote}")
    return {"direction": "download", "src": rsrc, "dst": local, "bytes": got}


def _progress(total: int, desc: str, disabled: bool) -> Any:
    """A tqdm bar on stderr for a large copy to a terminal; None otherwise."""
    if disabled or total < PROGRESS_MIN or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, file=sys.stderr)
