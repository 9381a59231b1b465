"""Runs inside the guest: drives guestd over real AF_VSOCK (vsock_loopback, CID 1).

Prints one JSON object: {"results": [{"name", "ok", "detail"}...]}. The host-side pytest
uploads this file over virtio-serial, runs it with guestd's Python and asserts every check.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import socket
import sys
import time
import traceback
from collections.abc import Callable

from guestd.client import Client, GuestdError
from guestd.wire.frames import HEADER, MAGIC, Kind, encode_frame

ADDR = sys.argv[1] if len(sys.argv) > 1 else "vsock:1:10700"
CID, PORT = 1, int(ADDR.rsplit(":", 1)[1])
results: list[dict[str, object]] = []


def check(name: str) -> Callable[[Callable[[Client], None]], None]:
    def run(fn: Callable[[Client], None]) -> None:
        t0 = time.monotonic()
        try:
            with Client(ADDR, connect_timeout=60) as c:
                fn(c)
            results.append({"name": name, "ok": True, "detail": f"{time.monotonic() - t0:.2f}s"})
        except BaseException:
            results.append({"name": name, "ok": False, "detail": traceback.format_exc()[-1500:]})

    return run


def raw_vsock() -> socket.socket:
    s = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect((CID, PORT))
    s.sendall(encode_frame(Kind.HELLO, 0, {"versions": [1]}))
    read_frame(s)
    return s


def read_frame(s: socket.socket) -> tuple[int, int, bytes]:
    buf = b""
    while len(buf) < 12:
        chunk = s.recv(12 - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    _, _, kind, length, rid = HEADER.unpack(buf)
    body = b""
    while len(body) < length:
        chunk = s.recv(length - len(body))
        if not chunk:
            raise EOFError
        body += chunk
    return kind, rid, body


@check("ping and info over vsock")
def _(c: Client) -> None:
    assert c.ping() > 0
    info = c.info().raw
    assert {"exec", "files", "process", "shell", "code"} <= set(info["capabilities"]), info["capabilities"]


@check("exec: status, output, could-not-start")
def _(c: Client) -> None:
    r = c.exec(["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert (r.exit_code, r.stdout, r.stderr) == (3, b"out\n", b"err\n")
    try:
        c.exec(["/nonexistent"])
        raise AssertionError("no error")
    except GuestdError as e:
        assert e.code == "not_found" and e.details["stage"] == "spawn"


@check("exec: timeout ends the whole tree")
def _(c: Client) -> None:
    r = c.exec("sleep 1000 & sleep 1000", timeout_s=2)
    assert r.timed_out == "wall"
    # Killed before the reply; a killed orphan may stay a zombie (still named sleep) until
    # guestd, its subreaper, reaps it on its next sweep: a bounded wait for that, not for a kill.
    for _ in range(50):
        left = c.exec(["sh", "-c", "ps -o comm= | grep -c '^sleep$' || true"])
        if left.stdout.strip() == b"0":
            break
        time.sleep(0.1)
    assert left.stdout.strip() == b"0", left.stdout


@check("exec: truncation counts")
def _(c: Client) -> None:
    r = c.exec("seq 1 20000", max_output=100)
    full = "".join(f"{i}\n" for i in range(1, 20001)).encode()
    assert r.stdout == full[-100:] and r.stdout_bytes == len(full) and r.stdout_dropped == len(full) - 100


@check("files: atomic write, read, upload/download with checksum, typed errors")
def _(c: Client) -> None:
    c.write_file("/tmp/suite/a.txt", b"hello", parents=True)
    assert c.read_file("/tmp/suite/a.txt") == b"hello"
    data = os.urandom(3 << 20)
    c.upload(data, "/tmp/suite/big.bin")
    back = c.download("/tmp/suite/big.bin")
    assert isinstance(back, bytes) and hashlib.sha256(back).hexdigest() == hashlib.sha256(data).hexdigest()
    for bad, code in (("/tmp/suite/missing", "not_found"), ("/tmp/suite", "is_a_directory")):
        try:
            c.read_file(bad)
            raise AssertionError("no error")
        except GuestdError as e:
            assert e.code == code, e.code
    assert [e.name for e in c.listdir("/tmp/suite").entries] == ["a.txt", "big.bin"]
    assert c.remove("/tmp/suite", recursive=True) == 3


@check("processes: detach and reattach by offset")
def _(c: Client) -> None:
    p = c.process_start("for i in $(seq 1 300); do echo $i; done")
    c.process_wait(p.id, timeout_s=60)
    collected = c.process_output(p.id)
    out, final = collected.stdout, collected.status
    assert out == "".join(f"{i}\n" for i in range(1, 301)).encode()
    collected = c.process_output(p.id, stdout_from=final.stdout_offset - 4)
    tail = collected.stdout
    assert tail == b"300\n"


@check("shell session: state persists")
def _(c: Client) -> None:
    sid = c.shell_create(cwd="/tmp").id
    c.shell_run(sid, "cd /etc; export K=v")
    r = c.shell_run(sid, "pwd; echo $K; exit 3")
    assert (r.exit_code, r.stdout) == (3, b"/etc\nv\n")
    c.shell_close(sid)


@check("code context: state persists across cells")
def _(c: Client) -> None:
    ctx = c.code_create()
    assert c.code_run("x = 20", context=ctx.id, timeout_s=120).status == "ok"
    r = c.code_run("x * 2 + 2", context=ctx.id, timeout_s=120)
    assert r.text == "42", r
    c.code_close(ctx.id)


@check("errors: unknown op and bad arguments are typed")
def _(c: Client) -> None:
    for op, args, code in (("no.such", {}, "unknown_op"), ("exec", {"argv": "x"}, "bad_request")):
        try:
            c.call(op, args)
            raise AssertionError("no error")
        except GuestdError as e:
            assert e.code == code, e.code


@check("bad input: oversize frame, garbage payload, bad magic")
def _(c: Client) -> None:
    s = raw_vsock()
    s.sendall(HEADER.pack(MAGIC, 1, Kind.REQUEST, 5 << 20, 7))
    for _ in range(5):
        s.sendall(b"\xc1" * (1 << 20))
    s.sendall(encode_frame(Kind.REQUEST, 8, {"op": "ping"}))
    kind, rid, body = read_frame(s)
    assert (kind, rid) == (Kind.ERROR, 7) and b"too_large" in body
    kind, rid, _ = read_frame(s)
    assert (kind, rid) == (Kind.RESPONSE, 8)
    s.sendall(HEADER.pack(MAGIC, 1, Kind.REQUEST, 1, 9) + b"\xc1")
    kind, rid, body = read_frame(s)
    assert (kind, rid) == (Kind.ERROR, 9) and b"bad_request" in body
    s.sendall(b"GET / HTTP/1.1\r\n\r\n")
    kind, rid, body = read_frame(s)
    assert rid == 0 and b"protocol_error" in body
    s.close()
    assert c.ping() > 0


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@check("bounded fuzz: random and mutated frames, guestd keeps answering with bounded RSS")
def _(c: Client) -> None:
    guestd_pid = int(c.info().raw["pid"])
    base = rss_kib(guestd_pid)
    rng = random.Random(int(os.environ.get("FUZZ_SEED", "7")))
    seeds = [
        encode_frame(Kind.REQUEST, 1, {"op": "ping", "args": {}}),
        encode_frame(Kind.REQUEST, 2, {"op": "exec", "args": {"argv": ["true"]}}),
        encode_frame(Kind.REQUEST, 3, {"op": "file.stat", "args": {"path": "/"}}),
        encode_frame(Kind.INPUT, 4, {"data": b"x"}),
    ]
    for i in range(int(os.environ.get("FUZZ_N", "120"))):
        s = raw_vsock()
        if i % 4 == 0:
            blob = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
        else:
            mutated = bytearray(rng.choice(seeds))
            for _ in range(rng.randint(1, 5)):
                mutated[rng.randrange(2, len(mutated))] = rng.randrange(256)
            blob = bytes(mutated)
        try:
            s.sendall(blob)
        except OSError:
            pass
        s.close()
    assert c.ping() > 0
    assert c.exec(["true"]).exit_code == 0
    grown = rss_kib(guestd_pid) - base
    assert grown < 64 * 1024, f"guestd RSS grew by {grown} KiB over the fuzz batch"


print(json.dumps({"results": results}))
