"""guestctl code new | run | ls | interrupt | restart | rm: persistent code contexts (Python or a kernelspec)."""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any

from guestd.cli import terminal
from guestd.cli.runs import run_kept
from guestd.cli.shared import Subcommands, add_command, jsonable, parse_env, print_death, print_json, print_listing
from guestd.cli.terminal import field
from guestd.client.aio import AsyncClient, present
from guestd.client.replies import ContextInfo
from guestd.client.results import CodeResult

_SAFE_NAME = re.compile(r"[^A-Za-z0-9_.-]")
# Terminal sequences in a traceback written to a pipe: CSI (colours, cursor) and OSC strings.
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-_]")
# A run's status as an exit code, after the shell's conventions (124 timeout, 130 SIGINT, 137 SIGKILL).
CODE_EXIT = {"ok": 0, "error": 1, "timeout": 124, "interrupted": 130, "died": 137}
IMAGE_EXT = {"image/png": "png", "image/jpeg": "jpg", "image/gif": "gif", "image/svg+xml": "svg"}
MAX_SAVED_IMAGES = 64  # one reply of 4 MiB could otherwise name ~280,000 files


def register(sub: Subcommands) -> None:
    code = sub.add_parser("code", help="persistent code contexts").add_subparsers(dest="code_cmd", required=True)
    cn = add_command(code, "new", create, aliases=["create"], help="create a context")
    cn.add_argument("--cwd", default=None)
    cn.add_argument("--env", action="append", default=[], metavar="K=V")
    cn.add_argument("--name", default=None)
    cn.add_argument(
        "--kernel", default=None, metavar="NAME", help="a kernelspec installed in the guest (default: guestd's Python)"
    )
    cn.add_argument(
        "--start-timeout",
        type=float,
        default=None,
        metavar="S",
        help="the longest wait for the kernel to start (default: while it makes progress, at most 300 s)",
    )
    cr = add_command(
        code, "run", run_code, help="run CODE ('-' reads stdin) in a context (default: one made on first use)"
    )
    cr.add_argument("--context", default=None, help="context id or name")
    cr.add_argument("--timeout", type=float, default=None, help="the cell's timeout in the guest, seconds")
    cr.add_argument("--input", action="append", default=None, metavar="LINE", help="an answer for input()")
    cr.add_argument("--save-images", default=None, metavar="DIR", help="write image results to DIR")
    cr.add_argument(
        "--max-images", type=int, default=MAX_SAVED_IMAGES, help="save at most this many images (default 64)"
    )
    cr.add_argument("--overwrite-images", action="store_true", help="replace images of the same name in DIR")
    cr.add_argument("--no-color", action="store_true", help="strip ANSI colours")
    cr.add_argument("--keep", action="store_true", help="the run outlives guestctl; prints its run id")
    cr.add_argument("code")
    add_command(code, "ls", list_contexts, help="list contexts")
    for verb in ("interrupt", "restart", "rm"):
        add_command(code, verb, manage_context).add_argument("context")


async def create(client: AsyncClient, ns: argparse.Namespace) -> int:
    env = parse_env(ns.env)
    out = await client.code_create(
        cwd=ns.cwd, env=env or None, name=ns.name, kernel=ns.kernel, start_timeout_s=ns.start_timeout
    )
    print_json(out.info) if ns.json else print(field(out.id))
    return 0


async def list_contexts(client: AsyncClient, ns: argparse.Namespace) -> int:
    return print_listing(ns, "contexts", await client.code_list(), context_line)


def context_line(c: ContextInfo) -> str:
    name, kernel = field(c.name or "-"), field(c.kernel or "python")
    return f"{field(c.id)}  {name:12} {kernel:8} {c.state:8} pid {c.pid}  runs {c.execution_count}"


async def manage_context(client: AsyncClient, ns: argparse.Namespace) -> int:
    """interrupt, restart or rm one context."""
    if ns.code_cmd == "interrupt":
        await client.code_interrupt(ns.context)
    elif ns.code_cmd == "restart":
        pid = await client.code_restart(ns.context)
        print_json({"pid": pid}) if ns.json else print(f"restarted; kernel pid {pid}")
        return 0
    else:
        await client.code_close(ns.context)
    if ns.json:
        print_json({})
    return 0


async def run_code(client: AsyncClient, ns: argparse.Namespace) -> int:
    source = sys.stdin.read() if ns.code == "-" else ns.code
    options: dict[str, Any] = {  # code_run's keywords are the request's field names
        "context": ns.context,
        "timeout_s": ns.timeout,
        "input_lines": ns.input,
        "strip_ansi": ns.no_color or ns.json or None,
    }
    if ns.keep:
        return await run_kept(client, ns, "code.run", present(code=source, **options))
    res = await client.code_run(source, **options)
    saved, skipped, taken = (
        save_images(res, ns.save_images, ns.context, ns.max_images, ns.overwrite_images)
        if ns.save_images
        else ([], 0, [])
    )
    if ns.json:
        out = jsonable(res)
        out["saved_images"] = saved
        out["images_not_saved"] = skipped
        out["images_name_taken"] = taken
        print_json(out)
        return CODE_EXIT.get(res.status, 1)
    out_stream = terminal.stdout(ns.raw)
    out_stream.write(res.stdout)
    out_stream.close()
    for r in res.results:
        value = r["data"].get("text/plain")
        images = [m for m in r["data"] if m in IMAGE_EXT]
        if images and not ns.save_images:
            print(f"[{', '.join(images)} result: use --save-images DIR]")
        elif isinstance(value, str) and not images:
            print(terminal.text(value))
    for path in saved:
        print(f"[saved {field(path)}]")
    for path in taken:
        print(f"guestctl: {field(path)} exists, kept (--overwrite-images replaces it)", file=sys.stderr)
    if skipped > len(taken):
        print(f"guestctl: {skipped - len(taken)} images not saved (--max-images {ns.max_images})", file=sys.stderr)
    sys.stdout.flush()
    err_stream = terminal.stderr(ns.raw)
    err_stream.write(res.stderr)
    err_stream.close()
    if res.error is not None:
        print_traceback("\n".join(res.error.traceback) or f"{res.error.ename}: {res.error.evalue}", ns.raw)
    if res.status not in ("ok", "error"):
        extra = res.timeout_action or field(res.exit_reason or "")
        print(f"guestctl: run {res.status}" + (f" ({extra})" if extra else ""), file=sys.stderr)
    print_death(res.killed_by, res.oom_killed)
    return CODE_EXIT.get(res.status, 1)


def print_traceback(tb: str, raw: bool) -> None:
    """The kernel's traceback (coloured by IPython) on stderr: its colours kept on a terminal
    (every other control sequence neutralized), plain text in a pipe or file, as it came with --raw."""
    if raw:
        print(tb, file=sys.stderr)
    elif sys.stderr.isatty():
        err = terminal.stderr(raw)
        err.write(tb.encode() + b"\n")
        err.close()
    else:
        print(_ANSI.sub("", tb), file=sys.stderr)


def save_images(
    res: CodeResult, directory: str, context: str | None, limit: int, overwrite: bool
) -> tuple[list[str], int, list[str]]:
    """Write the run's image results into ``directory``; (their paths, images not saved, the
    paths of those not saved because the name was taken: the file there is kept).

    Names come from the host: ``<context>-<count>-<index>.<ext>``, the context as given on the
    command line with anything but ``[A-Za-z0-9_.-]`` replaced (nothing the guest sends names a
    file). Files are made inside the directory's fd, never through a symlink, and never replace
    an existing name unless ``overwrite`` (then a new file is renamed over the name). At most
    ``limit`` are written; the reply's size (max_frame) bounds their bytes."""
    os.makedirs(directory, exist_ok=True)
    prefix = _SAFE_NAME.sub("_", context or "default")[:64]
    count = res.execution_count if res.execution_count is not None and res.execution_count >= 0 else 0
    images = [
        (i, ext, r["data"][mime])
        for i, r in enumerate(res.results)
        for mime, ext in IMAGE_EXT.items()
        if mime in r["data"]
    ]
    saved: list[str] = []
    taken: list[str] = []
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i, ext, value in images[: max(0, limit)]:
            name = f"{prefix}-{count}-{i}.{ext}"
            data = value if isinstance(value, bytes) else str(value).encode()
            try:
                _write_new(dir_fd, name, data, overwrite)
            except FileExistsError:  # one taken name costs that image, not the others or the output
                taken.append(os.path.join(directory, name))
                continue
            saved.append(os.path.join(directory, name))
    finally:
        os.close(dir_fd)
    return saved, len(images) - len(saved), taken


def _write_new(dir_fd: int, name: str, data: bytes, overwrite: bool) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    target = name if not overwrite else f".{name}.{os.getpid()}.tmp"
    fd = os.open(target, flags, 0o644, dir_fd=dir_fd)  # EEXIST: an existing name is never replaced
    try:
        with os.fdopen(fd, "wb", closefd=False) as f:
            f.write(data)
    finally:
        os.close(fd)
    if overwrite:
        try:
            os.rename(target, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)  # replaces a link, never follows it
        except IsADirectoryError:  # a directory is never replaced: the name is taken
            os.unlink(target, dir_fd=dir_fd)
            raise FileExistsError(name) from None
