"""guestctl: drive a guestd from a shell or script.

    guestctl --connect ADDR [--json] ping | info
    guestctl ... exec [--timeout S] [--idle-timeout S] [--cwd D] [--env K=V]... [--max-output N] -- ARGV...
    guestctl ... sh 'COMMAND'
    guestctl ... cp SRC DST          (the guest side is written :PATH)
    guestctl ... cat :PATH | ls :PATH | rm [-r] :PATH
    guestctl ... code new | run [--context ID] [--timeout S] CODE | ls | interrupt ID | restart ID | rm ID
    guestctl ... exec --detach -- ARGV... | exec --pty -- ARGV...
    guestctl ... ps | attach ID [--from OFFSET] | kill ID [SIGNAL] | wait ID
    guestctl ... shell new | shell run ID 'COMMAND' | shell ls | shell rm ID

exec/sh exit with the remote exit code (124 when a timeout fired, 128+N when killed by signal N).
--timeout/--idle-timeout are enforced in the guest (the ops' timeout_s/idle_timeout_s; for wait,
how long the guest waits for the exit); guestctl's own wait for the reply is derived from them
(the client's deadline). --connect-timeout bounds connecting and the handshake.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import stat
import sys
from typing import Any

from guestd.client.aio import CONNECT_TIMEOUT, AsyncClient
from guestd.client.results import CodeResult, ExecResult
from guestd.wire.errors import GuestdError
from guestd.wire.paths import printable_path

DEFAULT_CONNECT = "unix:/run/guestd/guestd.sock"
PROGRESS_MIN = 1024 * 1024


def _remote(path: str) -> str | None:
    return path[1:] if path.startswith(":") else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="guestctl", description="Talk to a guestd.")
    p.add_argument(
        "--connect",
        default=os.environ.get("GUESTD_CONNECT", DEFAULT_CONNECT),
        help="unix:PATH, vsock:CID:PORT or fc:UDS_PATH:PORT (env GUESTD_CONNECT)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--token", default=os.environ.get("GUESTD_TOKEN"), help="access token (env GUESTD_TOKEN)")
    p.add_argument("--connect-timeout", type=float, default=CONNECT_TIMEOUT, help="connect + handshake, seconds")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("ping", help="round trip")
    sub.add_parser("info", help="guest and daemon facts")
    for name in ("exec", "sh"):
        e = sub.add_parser(name, help="run ARGV" if name == "exec" else "run a /bin/sh -c command")
        e.add_argument("--timeout", type=float, default=None, help="wall-clock timeout in the guest, seconds")
        e.add_argument("--idle-timeout", type=float, default=None, help="no-output timeout in the guest, seconds")
        e.add_argument("--cwd", default=None)
        e.add_argument("--env", action="append", default=[], metavar="K=V")
        e.add_argument("--max-output", type=int, default=None, help="bytes kept per stream")
        e.add_argument("--head-tail", action="store_true", help="keep both ends of long output")
        e.add_argument("--stdin", action="store_true", help="send local stdin to the command")
        e.add_argument("--detach", action="store_true", help="start in the background; print its process id")
        e.add_argument("--pty", action="store_true", help="run on a pseudo-terminal attached to this terminal")
        if name == "exec":
            e.add_argument("argv", nargs=argparse.REMAINDER, help="-- PROGRAM ARGS...")
        else:
            e.add_argument("command")
    c = sub.add_parser("cp", help="copy a file in or out (:PATH is the guest side)")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--parents", action="store_true", help="create the destination's parents in the guest")
    c.add_argument("--no-progress", action="store_true")
    sub.add_parser("cat", help="print a guest file").add_argument("path")
    sub.add_parser("ls", help="list a guest directory").add_argument("path")
    sub.add_parser("ps", help="list background processes")
    at = sub.add_parser("attach", help="stream a background process's output")
    at.add_argument("id")
    at.add_argument("--from", dest="offset", type=int, default=0, help="stdout offset to start from")
    at.add_argument("--stderr-from", type=int, default=0)
    at.add_argument("--no-follow", action="store_true", help="print what is buffered and return")
    k = sub.add_parser("kill", help="signal a background process group")
    k.add_argument("id")
    k.add_argument("signal", nargs="?", default="TERM")
    w = sub.add_parser("wait", help="wait for a background process to exit")
    w.add_argument("id")
    w.add_argument("--timeout", type=float, default=None, help="the guest answers timed out after this, seconds")
    shell = sub.add_parser("shell", help="persistent bash sessions").add_subparsers(dest="shell_cmd", required=True)
    snew = shell.add_parser("new", help="create a session; prints its id")
    snew.add_argument("--cwd", default=None)
    snew.add_argument("--env", action="append", default=[], metavar="K=V")
    snew.add_argument("--name", default=None)
    srun = shell.add_parser("run", help="run COMMAND in session ID")
    srun.add_argument("id")
    srun.add_argument("command")
    srun.add_argument("--timeout", type=float, default=None, help="wall-clock timeout in the guest, seconds")
    srun.add_argument("--idle-timeout", type=float, default=None, help="no-output timeout in the guest, seconds")
    srun.add_argument("--max-output", type=int, default=None)
    srun.add_argument("--stdin", action="store_true", help="send local stdin as the command's input")
    shell.add_parser("ls", help="list sessions")
    shell.add_parser("rm", help="end a session").add_argument("id")
    snap = sub.add_parser("snapshot", help="before a VM snapshot").add_subparsers(dest="snap_cmd", required=True)
    snap.add_parser("prepare", help="settle writes, sync, drop seed files").add_argument(
        "--quiesce", action="store_true", help="hold new work until restore or resume"
    )
    snap.add_parser("resume", help="accept work again after prepare --quiesce")
    rs = sub.add_parser("restore", help="after every restore/clone: re-seed, fix the clock, new identity")
    rs.add_argument("--entropy-hex", default=None, help="default: 64 fresh random bytes")
    rs.add_argument("--time-ns", type=int, default=None, help="default: this machine's clock")
    rs.add_argument("--generation", type=int, default=None, help="default: the guest's current + 1")
    rs.add_argument("--nonce", default=None)
    rs.add_argument("--id", dest="sandbox_id", default=None, help="new sandbox id")
    rs.add_argument("--hostname", default=None)
    rs.add_argument("--env", action="append", default=[], metavar="K=V", help="environment for future execs")
    code = sub.add_parser("code", help="persistent Python contexts").add_subparsers(dest="code_cmd", required=True)
    cn = code.add_parser("new", help="create a context")
    cn.add_argument("--cwd", default=None)
    cn.add_argument("--env", action="append", default=[], metavar="K=V")
    cn.add_argument("--name", default=None)
    cr = code.add_parser("run", help="run CODE ('-' reads stdin) in a context (default: one made on first use)")
    cr.add_argument("--context", default=None, help="context id or name")
    cr.add_argument("--timeout", type=float, default=None, help="the cell's timeout in the guest, seconds")
    cr.add_argument("--input", action="append", default=None, metavar="LINE", help="an answer for input()")
    cr.add_argument("--save-images", default=None, metavar="DIR", help="write image results to DIR")
    cr.add_argument("--no-color", action="store_true", help="strip ANSI colours")
    cr.add_argument("code")
    code.add_parser("ls", help="list contexts")
    for verb in ("interrupt", "restart", "rm"):
        code.add_parser(verb).add_argument("context")
    r = sub.add_parser("rm", help="remove a guest path")
    r.add_argument("-r", "--recursive", action="store_true")
    r.add_argument("path")
    return p


def _json_path(fields: dict[str, Any], key: str) -> dict[str, Any]:
    """``fields`` with the path at ``key`` as JSON text: a name that is not UTF-8 becomes
    its text with ``\\xff`` escapes plus ``<key>_base64`` holding the exact bytes."""
    value = fields.get(key)
    if not isinstance(value, bytes):
        return fields
    return {**fields, key: printable_path(value), f"{key}_base64": base64.b64encode(value).decode()}


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, sort_keys=True) + "\n")


def _print_exec(res: ExecResult) -> None:
    sys.stdout.buffer.write(res.stdout)
    sys.stdout.flush()
    sys.stderr.buffer.write(res.stderr)
    for name, dropped in (("stdout", res.stdout_dropped), ("stderr", res.stderr_dropped)):
        if dropped:
            print(
                f"guestctl: {name} truncated: {dropped} of {getattr(res, name + '_bytes')} bytes dropped",
                file=sys.stderr,
            )
    if res.timed_out:
        print(f"guestctl: {res.timed_out} timeout fired; process tree killed", file=sys.stderr)
    sys.stderr.flush()


CODE_EXIT = {"ok": 0, "error": 1, "timeout": 124, "interrupted": 130, "died": 137}
IMAGE_EXT = {"image/png": "png", "image/jpeg": "jpg", "image/gif": "gif", "image/svg+xml": "svg"}


def _save_images(res: CodeResult, directory: str) -> list[str]:
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


async def _code(client: AsyncClient, ns: argparse.Namespace) -> int:
    cmd = ns.code_cmd
    if cmd == "new":
        env = _parse_env(ns.env)
        out = await client.code_create(cwd=ns.cwd, env=env or None, name=ns.name)
        _print_json(out) if ns.json else print(out["id"])
        return 0
    if cmd == "ls":
        contexts = await client.code_list()
        if ns.json:
            _print_json({"contexts": contexts})
        else:
            for c in contexts:
                print(
                    f"{c['id']}  {c.get('name') or '-':12} {c['state']:8} "
                    f"pid {c.get('pid')}  runs {c['execution_count']}"
                )
        return 0
    if cmd in ("interrupt", "restart", "rm"):
        if cmd == "interrupt":
            await client.code_interrupt(ns.context)
        elif cmd == "restart":
            pid = await client.code_restart(ns.context)
            if not ns.json:
                print(f"restarted; kernel pid {pid}")
        else:
            await client.code_close(ns.context)
        if ns.json:
            _print_json({"ok": True})
        return 0
    source = sys.stdin.read() if ns.code == "-" else ns.code
    res = await client.code_run(
        source, context=ns.context, timeout_s=ns.timeout, input_lines=ns.input, strip_ansi=ns.no_color or ns.json
    )
    saved = _save_images(res, ns.save_images) if ns.save_images else []
    if ns.json:
        out = res.to_json()
        out["saved_images"] = saved
        _print_json(out)
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


async def _start_process(client: AsyncClient, ns: argparse.Namespace, cmd: list[str] | str, env: dict[str, str]) -> int:
    if not ns.pty:
        p = await client.process_start(cmd, cwd=ns.cwd, env=env or None, stdin=ns.stdin)
        _print_json(p) if ns.json else print(p["id"])
        return 0
    size = os.get_terminal_size(sys.stdout.fileno()) if sys.stdout.isatty() else os.terminal_size((80, 24))
    p = await client.process_start(cmd, cwd=ns.cwd, env=env or None, pty=True, rows=size.lines, cols=size.columns)
    return await _attach_terminal(client, p["id"], detach_ok=ns.detach)


async def _attach_terminal(client: AsyncClient, process_id: str, detach_ok: bool) -> int:
    """Local terminal <-> remote pty: raw mode, keystrokes forwarded, window size followed."""
    import signal as _signal
    import termios
    import tty

    loop = asyncio.get_running_loop()
    fd = sys.stdin.fileno()
    interactive = os.isatty(fd)
    saved = termios.tcgetattr(fd) if interactive else None
    pending: list[asyncio.Task[Any]] = []

    def on_key() -> None:
        data = os.read(fd, 4096)
        if data:
            pending.append(loop.create_task(client.process_write(process_id, data)))
        else:
            loop.remove_reader(fd)

    def on_winch() -> None:
        size = os.get_terminal_size(sys.stdout.fileno())
        pending.append(loop.create_task(client.process_resize(process_id, size.lines, size.columns)))

    pollable = True
    try:
        if interactive:
            tty.setraw(fd)
            loop.add_signal_handler(_signal.SIGWINCH, on_winch)
        try:
            loop.add_reader(fd, on_key)
        except OSError:  # epoll refuses plain files and /dev/null: nothing to forward then
            pollable = False
        a = client.attach(process_id)
        async for _, _, data in a:
            sys.stdout.buffer.write(data)
            sys.stdout.flush()
        final = await a.result()
    finally:
        if pollable:
            loop.remove_reader(fd)
        if saved is not None:
            termios.tcsetattr(fd, termios.TCSADRAIN, saved)
            loop.remove_signal_handler(_signal.SIGWINCH)
        for t in pending:
            t.cancel()
    if final["signal"] is not None:
        return 128 + int(final["signal"])
    return int(final["exit_code"] or 0)


async def _process(client: AsyncClient, ns: argparse.Namespace) -> int:
    if ns.cmd == "ps":
        procs = await client.process_list()
        if ns.json:
            _print_json({"processes": procs})
        else:
            for p in procs:
                status = (
                    p["state"]
                    if p["state"] == "running"
                    else f"exit {p['exit_code']}"
                    if p["signal"] is None
                    else f"signal {p['signal']}"
                )
                print(f"{p['id']}  pid {p['pid']:<8} {status:12} out {p['stdout_offset']:<10} {p['command'][:60]}")
        return 0
    if ns.cmd == "kill":
        await client.process_signal(ns.id, ns.signal)
        return 0
    if ns.cmd == "wait":
        res = await client.process_wait(ns.id, timeout_s=ns.timeout)
        if ns.json:
            _print_json(res)
        if res["timed_out"]:
            return 124
        return 128 + int(res["signal"]) if res["signal"] is not None else int(res["exit_code"] or 0)
    a = client.attach(ns.id, stdout_from=ns.offset, stderr_from=ns.stderr_from, follow=not ns.no_follow)
    async for name, offset, data in a:
        if name == "lost":
            print(f"guestctl: output before offset {offset} was overwritten in the ring", file=sys.stderr)
        elif name == "stderr":
            sys.stderr.buffer.write(data)
            sys.stderr.flush()
        else:
            sys.stdout.buffer.write(data)
            sys.stdout.flush()
    final = await a.result()
    if ns.json:
        _print_json(final)
    else:
        print(
            f"guestctl: {final['state']}; reattach with --from {final['stdout_offset']} "
            f"--stderr-from {final['stderr_offset']}",
            file=sys.stderr,
        )
    if final["state"] == "running":
        return 0
    return 128 + int(final["signal"]) if final["signal"] is not None else int(final["exit_code"] or 0)


async def _shell(client: AsyncClient, ns: argparse.Namespace) -> int:
    cmd = ns.shell_cmd
    if cmd == "new":
        s = await client.shell_create(cwd=ns.cwd, env=_parse_env(ns.env) or None, name=ns.name)
        _print_json(s) if ns.json else print(s["id"])
        return 0
    if cmd == "ls":
        sessions = await client.shell_list()
        if ns.json:
            _print_json({"sessions": [_json_path(s, "cwd") for s in sessions]})
        else:
            for s in sessions:
                cwd = printable_path(s["cwd"])
                print(f"{s['id']}  {s.get('name') or '-':12} pid {s['pid']:<8} {cwd}  ({s['commands']} commands)")
        return 0
    if cmd == "rm":
        await client.shell_close(ns.id)
        return 0
    stdin = sys.stdin.buffer.read() if ns.stdin else None
    res = await client.shell_run(
        ns.id, ns.command, input=stdin, timeout_s=ns.timeout, idle_timeout_s=ns.idle_timeout, max_output=ns.max_output
    )
    if ns.json:
        _print_json(res.to_json())
    else:
        sys.stdout.buffer.write(res.stdout)
        sys.stdout.flush()
        sys.stderr.buffer.write(res.stderr)
        if res.timed_out:
            print(f"guestctl: {res.timed_out} timeout fired; command interrupted", file=sys.stderr)
        if res.session_restarted:
            print("guestctl: the session had to be restarted (cwd and exported variables kept)", file=sys.stderr)
    if res.timed_out:
        return 124
    return res.exit_code if res.exit_code is not None else 1


def _parse_env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for kv in pairs:
        k, sep, v = kv.partition("=")
        if not sep or not k:
            raise SystemExit(f"guestctl: --env wants K=V, got {kv!r}")
        env[k] = v
    return env


def _progress(total: int, desc: str, disabled: bool) -> Any:
    if disabled or total < PROGRESS_MIN or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, file=sys.stderr)


async def _cp(client: AsyncClient, ns: argparse.Namespace) -> dict[str, Any]:
    rsrc, rdst = _remote(ns.src), _remote(ns.dst)
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
    bar = _progress(size, os.path.basename(rsrc), ns.no_progress)
    try:
        got = await client.download(rsrc, local, progress=bar.update if bar else None)
    finally:
        if bar:
            bar.close()
    if os.path.getsize(local) != got:
        raise GuestdError("io_error", f"size check failed: received {got!r}, wrote {os.path.getsize(local)}")
    return {"direction": "download", "src": rsrc, "dst": local, "bytes": got}


async def run(ns: argparse.Namespace) -> int:
    client = await AsyncClient.connect(ns.connect, connect_timeout=ns.connect_timeout, token=ns.token)
    try:
        if ns.cmd == "ping":
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            await client.ping()
            rtt_ms = (loop.time() - t0) * 1000
            _print_json({"ok": True, "rtt_ms": rtt_ms}) if ns.json else print(f"pong {rtt_ms:.3f} ms")
            return 0
        if ns.cmd == "info":
            info = await client.info()
            if ns.json:
                _print_json(info.raw)
            else:
                for k, v in sorted(info.raw.items()):
                    print(f"{k}: {v}")
            return 0
        if ns.cmd in ("exec", "sh"):
            if ns.cmd == "exec":
                argv = ns.argv[1:] if ns.argv[:1] == ["--"] else ns.argv
                if not argv:
                    raise SystemExit("guestctl exec: give the command after --")
                cmd: list[str] | str = argv
            else:
                cmd = ns.command
            env = _parse_env(ns.env)
            if ns.detach or ns.pty:
                return await _start_process(client, ns, cmd, env)
            stdin = sys.stdin.buffer.read() if ns.stdin else None
            res = await client.exec(
                cmd,
                cwd=ns.cwd,
                env=env or None,
                stdin=stdin,
                timeout_s=ns.timeout,
                idle_timeout_s=ns.idle_timeout,
                max_output=ns.max_output,
                head_tail=ns.head_tail,
            )
            if ns.json:
                _print_json(res.to_json())
            else:
                _print_exec(res)
            return res.shell_exit_code()
        if ns.cmd == "code":
            return await _code(client, ns)
        if ns.cmd in ("ps", "attach", "kill", "wait"):
            return await _process(client, ns)
        if ns.cmd == "shell":
            return await _shell(client, ns)
        if ns.cmd == "snapshot":
            if ns.snap_cmd == "prepare":
                out = await client.snapshot_prepare(quiesce=ns.quiesce)
            else:
                await client.snapshot_resume()
                out = {"resumed": True}
            _print_json(out) if ns.json else print(json.dumps(out, indent=1))
            return 0
        if ns.cmd == "restore":
            report = await client.restore(
                generation=ns.generation,
                nonce=ns.nonce,
                time_ns=ns.time_ns,
                entropy=bytes.fromhex(ns.entropy_hex) if ns.entropy_hex else None,
                sandbox_id=ns.sandbox_id,
                hostname=ns.hostname,
                env=_parse_env(ns.env) or None,
            )
            _print_json(report) if ns.json else print(json.dumps(report, indent=1, default=str))
            return 0
        if ns.cmd == "cp":
            out = await _cp(client, ns)
            if ns.json:
                _print_json(out)
            else:
                src, dst = printable_path(out["src"]), printable_path(out["dst"])
                print(f"{src} -> {dst}: {out['bytes']} bytes ({out['direction']}, size verified)")
            return 0
        path = _remote(ns.path)
        if path is None:
            raise SystemExit(f"guestctl {ns.cmd}: the guest path is written :PATH")
        if ns.cmd == "cat":
            if ns.json:
                data = await client.download(path)
                assert isinstance(data, bytes)
                _print_json({"path": path, "data": data.decode("utf-8", "replace"), "bytes": len(data)})
            else:
                await client.download(path, sink=sys.stdout.buffer.write)
                sys.stdout.flush()
            return 0
        if ns.cmd == "ls":
            listing = await client.listdir(path)
            if ns.json:
                entries = [_json_path(dict(e.__dict__), "name") for e in listing.entries]
                _print_json({"entries": entries, "truncated": listing.truncated, "total": listing.total})
            else:
                for e in listing.entries:
                    print(f"{e.type:7} {e.mode:04o} {e.size:>12} {printable_path(e.name)}")
                if listing.truncated:
                    print(f"guestctl: listing truncated: {len(listing.entries)} of {listing.total}", file=sys.stderr)
            return 0
        if ns.cmd == "rm":
            n = await client.remove(path, recursive=ns.recursive)
            if ns.json:
                _print_json({"removed": n})
            return 0
        raise SystemExit(f"unknown command {ns.cmd}")
    finally:
        await client.close()


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return asyncio.run(run(ns))
    except GuestdError as err:
        if ns.json:
            _print_json({"error": err.to_body()})
        else:
            print(f"guestctl: error [{err.code}]: {err.message}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:
        if ns.json:
            _print_json({"error": {"code": "client_error", "message": str(exc)}})
        else:
            print(f"guestctl: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
