"""guestctl code new | run | ls | interrupt | restart | rm: persistent Python contexts."""

from __future__ import annotations

import argparse
import os
import sys

from guestd.cli.shared import Subcommands, add_command, parse_env, print_json
from guestd.client.aio import AsyncClient
from guestd.client.results import CodeResult

# A run's status as an exit code, after the shell's conventions (124 timeout, 130 SIGINT, 137 SIGKILL).
CODE_EXIT = {"ok": 0, "error": 1, "timeout": 124, "interrupted": 130, "died": 137}
IMAGE_EXT = {"image/png": "png", "image/jpeg": "jpg", "image/gif": "gif", "image/svg+xml": "svg"}


def register(sub: Subcommands) -> None:
    code = sub.add_parser("code", help="persistent Python contexts").add_subparsers(dest="code_cmd", required=True)
    cn = add_command(code, "new", create, help="create a context")
    cn.add_argument("--cwd", default=None)
    cn.add_argument("--env", action="append", default=[], metavar="K=V")
    cn.add_argument("--name", default=None)
    cr = add_command(
        code, "run", run_code, help="run CODE ('-' reads stdin) in a context (default: one made on first use)"
    )
    cr.add_argument("--context", default=None, help="context id or name")
    cr.add_argument("--timeout", type=float, default=None, help="the cell's timeout in the guest, seconds")
    cr.add_argument("--input", action="append", default=None, metavar="LINE", help="an answer for input()")
    cr.add_argument("--save-images", default=None, metavar="DIR", help="write image results to DIR")
    cr.add_argument("--no-color", action="store_true", help="strip ANSI colours")
    cr.add_argument("code")
    add_command(code, "ls", list_contexts, help="list contexts")
    for verb in ("interrupt", "restart", "rm"):
        add_command(code, verb, manage_context).add_argument("context")


async def create(client: AsyncClient, ns: argparse.Namespace) -> int:
    env = parse_env(ns.env)
    out = await client.code_create(cwd=ns.cwd, env=env or None, name=ns.name)
    print_json(out) if ns.json else print(out["id"])
    return 0


async def list_contexts(client: AsyncClient, ns: argparse.Namespace) -> int:
    contexts = await client.code_list()
    if ns.json:
        print_json({"contexts": contexts})
    else:
        for c in contexts:
            print(
                f"{c['id']}  {c.get('name') or '-':12} {c['state']:8} pid {c.get('pid')}  runs {c['execution_count']}"
            )
    return 0


async def manage_context(client: AsyncClient, ns: argparse.Namespace) -> int:
    """interrupt, restart or rm one context."""
    if ns.code_cmd == "interrupt":
        await client.code_interrupt(ns.context)
    elif ns.code_cmd == "restart":
        pid = await client.code_restart(ns.context)
        if not ns.json:
            print(f"restarted; kernel pid {pid}")
    else:
        await client.code_close(ns.context)
    if ns.json:
        print_json({"ok": True})
    return 0


async def run_code(client: AsyncClient, ns: argparse.Namespace) -> int:
    source = sys.stdin.read() if ns.code == "-" else ns.code
    res = await client.code_run(
        source, context=ns.context, timeout_s=ns.timeout, input_lines=ns.input, strip_ansi=ns.no_color or ns.json
    )
    saved = save_images(res, ns.save_images) if ns.save_images else []
    if ns.json:
        out = res.to_json()
        out["saved_images"] = saved
        print_json(out)
        return CODE_EXIT.get(res.status, 1)
    sys.stdout.buffer.write(res.stdout)
    for r in res.results:
        text = r["data"].get("text/plain")
        images = [m for m in r["data"] if m in IMAGE_EXT]
        if images and not ns.save_images:
            print(f"[{', '.join(images)} result: use --save-images DIR]")
        elif isinstance(text, str) and not images:
            print(text)
    for path in saved:
        print(f"[saved {path}]")
    sys.stdout.flush()
    sys.stderr.buffer.write(res.stderr)
    if res.error is not None:
        print("\n".join(res.error.traceback) or f"{res.error.ename}: {res.error.evalue}", file=sys.stderr)
    if res.status not in ("ok", "error"):
        extra = res.timeout_action or res.exit_reason or ""
        print(f"guestctl: run {res.status}" + (f" ({extra})" if extra else ""), file=sys.stderr)
    return CODE_EXIT.get(res.status, 1)


def save_images(res: CodeResult, directory: str) -> list[str]:
    """Write the run's image results to ``directory`` as <context>-<count>-<index>.<ext>; their paths."""
    os.makedirs(directory, exist_ok=True)
    saved = []
    for i, r in enumerate(res.results):
        for mime, ext in IMAGE_EXT.items():
            value = r["data"].get(mime)
            if value is None:
                continue
            path = os.path.join(directory, f"{res.context}-{res.execution_count or 0}-{i}.{ext}")
            with open(path, "wb") as f:
                f.write(value if isinstance(value, bytes) else str(value).encode())
            saved.append(path)
    return saved
