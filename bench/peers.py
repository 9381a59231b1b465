"""The agents a platform team would pick instead of guestd, measured the same way.

- qemu-ga (Debian's qemu-guest-agent) as a plain process on a Unix socket, driven with
  its newline-delimited JSON protocol: guest-ping, guest-exec + guest-exec-status polls,
  guest-file-* with base64 payloads.
- SWE-ReX's `swerex-remote` (FastAPI + uvicorn) on loopback, driven over one HTTP
  keep-alive connection: /is_alive, /execute, /write_file + /read_file (text only),
  /run_in_session for a persistent bash.

Each peer is started and stopped here; its server process RSS is sampled like guestd's.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

from bench.run import MiB, Proc, peak_rss, pin_servers, summary_ms

TEN_MB = "head -c 10000000 /dev/zero"


class QGA:
    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(120)
        self.sock.connect(path)
        self.file = self.sock.makefile("rb")
        self.cmd("guest-sync", id=12345)

    def cmd(self, name: str, **args: Any) -> Any:
        msg: dict[str, Any] = {"execute": name}
        if args:
            msg["arguments"] = args
        self.sock.sendall(json.dumps(msg).encode() + b"\n")
        reply = json.loads(self.file.readline())
        if "error" in reply:
            raise RuntimeError(f"{name}: {reply['error']}")
        return reply.get("return")

    def exec(self, path: str, args: list[str]) -> dict[str, Any]:
        pid = self.cmd("guest-exec", path=path, arg=args, **{"capture-output": True})["pid"]
        end = time.monotonic() + PEER_START_BOUND_S
        while time.monotonic() < end:  # qemu-ga has no wait: polled, bounded
            st = self.cmd("guest-exec-status", pid=pid)
            if st.get("exited"):
                return dict(st)
        raise RuntimeError(f"qemu-ga: {path} did not exit within {PEER_START_BOUND_S:g} s")

    def write(self, path: str, data: bytes, chunk: int = MiB) -> None:
        h = self.cmd("guest-file-open", path=path, mode="w")
        for i in range(0, len(data), chunk):
            self.cmd("guest-file-write", handle=h, **{"buf-b64": base64.b64encode(data[i : i + chunk]).decode()})
        self.cmd("guest-file-close", handle=h)

    def read(self, path: str, chunk: int = MiB) -> bytes:
        h = self.cmd("guest-file-open", path=path, mode="r")
        out = bytearray()
        while True:
            r = self.cmd("guest-file-read", handle=h, count=chunk)
            out += base64.b64decode(r["buf-b64"])
            if r.get("eof"):
                break
        self.cmd("guest-file-close", handle=h)
        return bytes(out)


def _timed(fn: Any, n: int, warm: int = 10) -> list[float]:
    for _ in range(warm):
        fn()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def _files(proc: Proc, write: Any, read: Any, tmp: str, size: int) -> dict[str, float]:
    data = os.urandom(min(size, MiB)) * max(1, size // MiB)
    path = f"{tmp}/peer-file-{size}"
    with peak_rss(proc) as up:
        t = time.perf_counter()
        write(path, data)
        w = size / (time.perf_counter() - t) / 1e6
    with peak_rss(proc) as down:
        t = time.perf_counter()
        back = read(path)
        r = size / (time.perf_counter() - t) / 1e6
    os.unlink(path)
    return {
        "write_MBps": w,
        "read_MBps": r,
        "verified": float(back == data),
        "peak_rss_MiB": max(up["peak"], down["peak"]) / MiB,
    }


H = TypeVar("H")
PEER_START_BOUND_S = 60.0  # a peer server not answering by then failed to start


def _cold_starts(start: Callable[[], tuple[subprocess.Popen[bytes], H, float]]) -> tuple[list[float], Proc, H]:
    """Three starts timed to the first reply (each ended again), then one kept for the rest."""
    starts = []
    for _ in range(3):
        p, _handle, dt = start()
        starts.append(dt)
        Proc.adopt(p).stop()
    p, handle, _ = start()
    return starts, Proc.adopt(p), handle


def measure_qga(tmp: str, n: int) -> dict[str, Any]:
    sock = f"{tmp}/qga.sock"
    state = f"{tmp}/qga-state"
    os.makedirs(state, exist_ok=True)
    argv = ["qemu-ga", "-m", "unix-listen", "-p", sock, "-t", state, "-f", f"{tmp}/qga.pid"]

    def start() -> tuple[subprocess.Popen[bytes], QGA, float]:
        if os.path.exists(sock):
            os.unlink(sock)
        t = time.perf_counter()
        p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=pin_servers)
        while True:  # bounded, as swerex-remote's start below
            try:
                q = QGA(sock)
                q.cmd("guest-ping")
                return p, q, time.perf_counter() - t
            except OSError:
                if p.poll() is not None or time.perf_counter() - t > PEER_START_BOUND_S:
                    Proc.adopt(p).stop()
                    raise RuntimeError(f"qemu-ga did not answer (exit {p.returncode})") from None
                time.sleep(0.001)

    starts, proc, q = _cold_starts(start)
    res: dict[str, Any] = {"start_to_first_reply": summary_ms(starts)}
    try:
        time.sleep(0.2)
        res["idle_rss_MiB"] = proc.rss() / MiB
        res["ping"] = summary_ms(_timed(lambda: q.cmd("guest-ping"), n))
        res["exec_true"] = summary_ms(_timed(lambda: q.exec("/bin/true", []), max(20, n // 10)))
        t = time.perf_counter()
        st = q.exec("/bin/sh", ["-c", TEN_MB])
        out = base64.b64decode(st.get("out-data", ""))
        res["out_10mb"] = {"s": time.perf_counter() - t, "returned": len(out), "kept": "head, 16 MiB cap"}
        res["files"] = {str(s): _files(proc, q.write, q.read, tmp, s) for s in (MiB, 64 * MiB)}
        q.sock.close()
    finally:
        proc.stop()
    return res


class HTTP:
    def __init__(self, port: int, token: str) -> None:
        self.c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        self.headers = {"X-API-Key": token, "Content-Type": "application/json"}

    def get(self, path: str) -> Any:
        self.c.request("GET", path, headers=self.headers)
        return json.loads(self.c.getresponse().read())

    def post(self, path: str, obj: dict[str, Any]) -> Any:
        self.c.request("POST", path, body=json.dumps(obj), headers=self.headers)
        r = self.c.getresponse()
        body = r.read()
        if r.status != 200:
            raise RuntimeError(f"{path}: HTTP {r.status} {body[:200]!r}")
        return json.loads(body)


def measure_swerex(tmp: str, n: int, venv_bin: str) -> dict[str, Any]:
    port = 40000 + secrets.randbelow(20000)
    token = secrets.token_hex(8)
    argv = [os.path.join(venv_bin, "swerex-remote"), "--host", "127.0.0.1", "--port", str(port), "--auth-token", token]

    def start() -> tuple[subprocess.Popen[bytes], HTTP, float]:
        t = time.perf_counter()
        p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=pin_servers)
        while True:  # bounded: the server may die at start (a port taken since it was drawn)
            try:
                h = HTTP(port, token)
                if h.get("/is_alive").get("is_alive"):
                    return p, h, time.perf_counter() - t
            except (OSError, http.client.HTTPException, ValueError):
                if p.poll() is not None or time.perf_counter() - t > PEER_START_BOUND_S:
                    Proc.adopt(p).stop()
                    raise RuntimeError(f"swerex-remote did not answer (exit {p.returncode})") from None
                time.sleep(0.002)

    starts, proc, h = _cold_starts(start)
    res: dict[str, Any] = {"start_to_first_reply": summary_ms(starts)}
    try:
        time.sleep(0.3)
        res["idle_rss_MiB"] = proc.rss() / MiB
        res["ping"] = summary_ms(_timed(lambda: h.get("/is_alive"), n))
        res["exec_true"] = summary_ms(_timed(lambda: h.post("/execute", {"command": ["true"]}), max(20, n // 10)))
        t = time.perf_counter()
        r = h.post("/execute", {"command": TEN_MB, "shell": True})
        res["out_10mb"] = {"s": time.perf_counter() - t, "returned": len(r.get("stdout", "")), "kept": "all"}
        h.post("/create_session", {"session": "bench", "session_type": "bash"})
        res["shell_true"] = summary_ms(
            _timed(
                lambda: h.post("/run_in_session", {"command": "true", "session": "bench", "action_type": "bash"}),
                10,
                warm=2,
            )
        )

        def write(path: str, data: bytes) -> None:
            h.post("/write_file", {"path": path, "content": data.decode("latin-1")})

        def read(path: str) -> bytes:
            return str(h.post("/read_file", {"path": path, "encoding": "latin-1"})["content"]).encode("latin-1")

        res["files"] = {str(s): _files(proc, write, read, tmp, s) for s in (MiB, 64 * MiB)}
    finally:
        proc.stop()
    return res


# The peers' versions are pinned, and what ran is recorded beside every figure (peer_versions).
PEER_PACKAGES = ("swe-rex==1.4.0", "aiohttp==3.14.5", "matplotlib")


def peer_versions(venv_bin: str | None) -> dict[str, str]:
    """What each peer is, as it reports itself: printed next to its figures."""
    import shutil

    versions: dict[str, str] = {}
    if shutil.which("qemu-ga") is not None:
        out = subprocess.run(["qemu-ga", "--version"], capture_output=True, text=True, check=False, timeout=30)
        versions["qemu-ga"] = (out.stdout or out.stderr).strip().splitlines()[0] if (out.stdout or out.stderr) else "?"
    if venv_bin is not None:
        py = os.path.join(venv_bin, "python")
        code = "import importlib.metadata as m; print(m.version('swe-rex'))"
        out = subprocess.run([py, "-c", code], capture_output=True, text=True, check=False, timeout=60)
        versions["SWE-ReX"] = f"swe-rex {out.stdout.strip() or '?'}"
    return versions


def ensure_peers(venv: str) -> tuple[bool, str | None]:
    """qemu-ga from Debian (installed as root when missing) and a venv with swe-rex and matplotlib."""
    import shutil

    if shutil.which("qemu-ga") is None and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "-q", "qemu-guest-agent"], capture_output=True, check=False)
    if not os.path.exists(os.path.join(venv, "bin", "swerex-remote")):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        r = subprocess.run(
            [os.path.join(venv, "bin", "pip"), "install", "-q", *PEER_PACKAGES],
            capture_output=True,
            check=False,
        )
        if r.returncode != 0:
            return shutil.which("qemu-ga") is not None, None
    return shutil.which("qemu-ga") is not None, os.path.join(venv, "bin")
