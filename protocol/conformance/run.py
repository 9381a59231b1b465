#!/usr/bin/env python3
"""Replay guestd conformance transcripts against a server speaking protocol v1.

Standalone on purpose: the standard library and msgpack only, so a team with its own
server can run it without installing guestd. The transcript format is in README.md.

    python run.py unix:/run/guestd.sock                 # every transcript next to this file
    python run.py unix:/tmp/s.sock transcripts/ping.json --tmp /guest/scratch
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

HEADER = struct.Struct(">2sBBII")  # magic, frame version, kind, payload length, id
FLOOR = 65536  # max_frame and stream_window are never negotiated below this
KINDS = {"hello": 1, "request": 2, "response": 3, "error": 4, "event": 5, "input": 6, "window": 7, "cancel": 8}
KIND_NAMES = {v: k for k, v in KINDS.items()}
TRANSCRIPTS = Path(__file__).resolve().parent / "transcripts"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


TYPES: dict[str, Callable[[Any], bool]] = {
    "str": lambda v: isinstance(v, str),
    "int": _is_int,
    "uint": lambda v: _is_int(v) and v >= 0,
    "float": lambda v: isinstance(v, float),
    "number": lambda v: _is_int(v) or isinstance(v, float),
    "bool": lambda v: isinstance(v, bool),
    "bin": lambda v: isinstance(v, bytes),
    "map": lambda v: isinstance(v, dict),
    "list": lambda v: isinstance(v, list),
    "nil": lambda v: v is None,
    "any": lambda v: True,
}


class Failure(Exception):
    """A step did not hold: the server answered differently, too late, or broke a framing rule."""


class Skip(Exception):
    """The server runs with other limits than the transcript's server_limits."""


@dataclass
class Frame:
    kind: int
    id: int
    body: dict[str, Any]
    size: int  # payload bytes on the wire


@dataclass
class Result:
    name: str
    status: str  # pass | fail | xfail | xpass | skip
    message: str = ""
    seconds: float = 0.0


def show(v: Any, limit: int = 600) -> str:
    """A frame or value as JSON, bytes as {"$bin": hex} (long ones cut), for failure messages."""

    def plain(x: Any) -> Any:
        if isinstance(x, bytes):
            return {"$bin": x[:32].hex() + (f"...({len(x)} bytes)" if len(x) > 32 else "")}
        if isinstance(x, Frame):
            return {"kind": KIND_NAMES.get(x.kind, x.kind), "id": x.id, "body": plain(x.body)}
        if isinstance(x, dict):
            return {str(k): plain(w) for k, w in x.items()}
        if isinstance(x, list | tuple):
            return [plain(w) for w in x]
        return x

    text = json.dumps(plain(v))
    return text if len(text) <= limit else text[:limit] + "..."


def same(a: Any, b: Any) -> bool:
    """Equality that keeps msgpack types apart (1 != 1.0 != True)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


class Replay:
    """One transcript replayed over one connection."""

    def __init__(self, doc: dict[str, Any], sock: socket.socket, tmp: str, timeout: float) -> None:
        self.doc, self.sock, self.tmp, self.timeout = doc, sock, tmp, timeout
        self.vars: dict[str, Any] = {}
        self.buf = bytearray()
        self.pool: list[Frame] = []  # received, not yet matched by a step
        self.eof = False
        self.accept = FLOOR  # largest payload we take before the server's hello says more
        self.window: int | None = None  # negotiated stream_window
        self.credit: dict[int, int] = {}  # data bytes the server may still send per id
        self.keep_windows = bool(doc.get("windows", False))

    # -- values: placeholders in frames we send and frames we expect

    def build(self, v: Any) -> Any:
        if isinstance(v, dict):
            if "$bin" in v:
                return bytes.fromhex(v["$bin"]) * int(v.get("$times", 1))
            if "$ref" in v:
                return self.ref(v["$ref"])
            return {k: self.build(w) for k, w in v.items()}
        if isinstance(v, list):
            return [self.build(w) for w in v]
        if isinstance(v, str):
            return v.replace("${TMP}", self.tmp)
        return v

    def ref(self, name: str) -> Any:
        if name not in self.vars:
            raise Failure(f"$ref {name!r}: no earlier frame captured it")
        return self.vars[name]

    def bind(self, exp: Any, got: Any) -> None:
        """Bind every $capture in ``exp`` first, so a $ref in the same frame sees it (key order is free)."""
        if isinstance(exp, dict):
            if "$capture" in exp:
                self.vars[exp["$capture"]] = got
            elif isinstance(got, dict):
                for k, w in exp.items():
                    if not k.startswith("$") and k in got:
                        self.bind(w, got[k])
        elif isinstance(exp, list) and isinstance(got, list):
            for e, g in zip(exp, got, strict=False):
                self.bind(e, g)

    def mismatch(self, exp: Any, got: Any, path: str) -> str | None:
        """Why ``got`` does not match ``exp``, or None when it does."""
        if isinstance(exp, dict) and any(k.startswith("$") for k in exp):
            return self.placeholder(exp, got, path)
        if isinstance(exp, dict):
            if not isinstance(got, dict):
                return f"{path}: expected a map, got {show(got)}"
            for k, w in exp.items():
                if k not in got:
                    return f"{path}.{k}: missing"
                why = self.mismatch(w, got[k], f"{path}.{k}")
                if why:
                    return why
            return None
        if isinstance(exp, list):
            if not isinstance(got, list) or len(got) != len(exp):
                return f"{path}: expected a list of {len(exp)}, got {show(got)}"
            for i, (e, g) in enumerate(zip(exp, got, strict=True)):
                why = self.mismatch(e, g, f"{path}[{i}]")
                if why:
                    return why
            return None
        want = self.build(exp)
        return None if same(want, got) else f"{path}: expected {show(want)}, got {show(got)}"

    def placeholder(self, exp: dict[str, Any], got: Any, path: str) -> str | None:
        for key, arg in exp.items():
            ok = True
            if key == "$any":
                if arg not in TYPES:
                    raise Failure(f"{path}: unknown type {arg!r} in the transcript")
                ok = TYPES[arg](got)
            elif key == "$capture":
                ok = True  # bound by bind()
            elif key == "$ref":
                ok = same(self.ref(arg), got)
            elif key == "$bin":
                ok = same(self.build(exp), got)
            elif key == "$times":
                ok = "$bin" in exp
            elif key == "$len":
                ok = isinstance(got, bytes | str | list | dict) and len(got) == arg
            elif key in ("$le", "$ge"):
                ok = TYPES["number"](got) and (got <= arg if key == "$le" else got >= arg)
            elif key == "$contains":
                ok = isinstance(got, list) and all(any(not self.mismatch(e, g, path) for g in got) for e in arg)
            else:
                raise Failure(f"{path}: unknown placeholder {key!r} in the transcript")
            if not ok:
                return f"{path}: expected {show(exp)}, got {show(got)}"
        return None

    # -- the wire

    def encode(self, spec: dict[str, Any]) -> bytes:
        kind = spec["kind"] if isinstance(spec["kind"], int) else KINDS[spec["kind"]]
        req_id = int(self.build(spec["id"]))
        body = self.build(spec.get("body", {}))
        payload: bytes = msgpack.packb(body, use_bin_type=True)
        if kind == KINDS["hello"]:
            self.accept = max(FLOOR, body.get("max_frame", 1 << 32))
        elif kind == KINDS["request"] and self.window is not None:
            self.credit[req_id] = self.window
        elif kind == KINDS["window"] and req_id in self.credit:
            self.credit[req_id] += body.get("bytes", 0)
        return HEADER.pack(b"GD", 1, kind, len(payload), req_id) + payload

    def write(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except OSError as exc:
            raise Failure(f"cannot send: {exc}") from None

    def fill(self, deadline: float | None) -> bool:
        """Read more bytes; False at end of stream. deadline None: only what is already there."""
        try:
            if deadline is None:
                self.sock.settimeout(0)
            else:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                self.sock.settimeout(left)
            chunk = self.sock.recv(1 << 20)
        except (BlockingIOError, InterruptedError):
            return True
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            self.eof = True
            return False
        self.buf += chunk
        return True

    def receive(self, deadline: float | None) -> Frame | None:
        """The next frame the transcript can see; None at end of stream (or nothing there, deadline None)."""
        while True:
            while len(self.buf) < HEADER.size or len(self.buf) < HEADER.size + self._length():
                size = len(self.buf)
                if self.eof or not self.fill(deadline):
                    return None
                if deadline is None and len(self.buf) == size:
                    return None
            frame = self.decode()
            if frame is not None:
                return frame

    def _length(self) -> int:
        magic, version, kind, length, req_id = HEADER.unpack_from(self.buf)
        if magic != b"GD" or version != 1:
            raise Failure(f"server sent a bad frame header {bytes(self.buf[: HEADER.size]).hex()}")
        if length > self.accept:
            raise Failure(f"server sent a {length}-byte payload (kind {kind}, id {req_id}); we accept {self.accept}")
        return int(length)

    def decode(self) -> Frame | None:
        _, _, kind, length, req_id = HEADER.unpack_from(self.buf)
        payload = bytes(self.buf[HEADER.size : HEADER.size + length])
        del self.buf[: HEADER.size + length]
        if kind not in KIND_NAMES:
            return None  # receivers ignore unknown kinds
        try:
            body = msgpack.unpackb(payload, raw=False, strict_map_key=True)
        except Exception as exc:
            raise Failure(f"server payload (kind {kind}, id {req_id}) is not valid msgpack: {exc}") from None
        if not isinstance(body, dict) or not all(isinstance(k, str) for k in body):
            raise Failure(f"server payload (kind {kind}, id {req_id}) is not a map with str keys: {show(body)}")
        frame = Frame(kind, req_id, body, length)
        if kind == KINDS["hello"]:
            self.hello(body)
        data = body.get("data")
        if kind == KINDS["event"] and isinstance(data, bytes) and req_id in self.credit:
            if len(data) > self.credit[req_id]:
                raise Failure(f"{len(data)} data bytes for id {req_id} beyond the credit {self.credit[req_id]}")
            self.credit[req_id] -= len(data)
        if kind == KINDS["window"] and not self.keep_windows:
            return None
        return frame

    def hello(self, body: dict[str, Any]) -> None:
        self.accept, self.window = body.get("max_frame", self.accept), body.get("stream_window")
        limits = body.get("limits", {})
        wanted = self.doc.get("server_limits", {})
        differ = {k: limits.get(k) for k, v in wanted.items() if not same(limits.get(k), v)}
        if differ:
            raise Skip(f"needs a server with limits {show(wanted)}; this one has {show(differ)}")

    def next_for(self, ids: set[int], deadline: float, waiting: Any) -> Frame:
        """The first frame (pool first, then the wire) whose id is in ``ids``; others wait in the pool."""
        for i, pooled in enumerate(self.pool):
            if pooled.id in ids:
                return self.pool.pop(i)
        while True:
            try:
                frame = self.receive(deadline)
            except TimeoutError:
                raise Failure(f"no answer within the timeout; waiting for {show(waiting)}") from None
            if frame is None:
                raise Failure(f"connection closed; waiting for {show(waiting)}")
            if frame.id in ids:
                return frame
            self.pool.append(frame)

    # -- steps

    def run(self) -> None:
        for n, step in enumerate(self.doc["steps"], 1):
            try:
                self.step(step)
            except Failure as exc:
                raise Failure(f"step {n} {show(step, 300)}:\n  {exc}") from None
        while not self.eof and (frame := self.receive(None)) is not None:
            self.pool.append(frame)
        if self.pool:
            raise Failure(f"after the last step: unexpected frames {show(self.pool)}")

    def step(self, step: dict[str, Any]) -> None:
        deadline = time.monotonic() + float(step.get("timeout_s", self.timeout))
        if "send" in step:
            self.write(b"".join(self.encode(f) for f in step["send"]))
        elif "send_raw_hex" in step:
            self.write(bytes.fromhex(step["send_raw_hex"]))
        elif "expect" in step:
            self.expect(step["expect"], deadline)
        elif "collect" in step:
            self.collect(step["collect"], deadline)
        elif step.get("expect_closed"):
            if self.pool:
                raise Failure(f"expected the connection to close, still unmatched: {show(self.pool)}")
            try:
                frame = self.receive(deadline)
            except TimeoutError:
                raise Failure("the connection is still open") from None
            if frame is not None:
                raise Failure(f"expected the connection to close, got {show(frame)}")
        else:
            raise Failure("unknown step type in the transcript")

    def expect(self, frames: list[dict[str, Any]], deadline: float) -> None:
        """Server frames in any order across ids, in the listed order within one id."""
        pending: dict[int, list[dict[str, Any]]] = {}
        for spec in frames:
            pending.setdefault(int(self.build(spec["id"])), []).append(spec)
        while pending:
            frame = self.next_for(set(pending), deadline, [f for fs in pending.values() for f in fs])
            spec = pending[frame.id].pop(0)
            if not pending[frame.id]:
                del pending[frame.id]
            kind = spec["kind"] if isinstance(spec["kind"], int) else KINDS[spec["kind"]]
            self.bind(spec.get("body", {}), frame.body)
            why = (
                f"kind {KIND_NAMES.get(frame.kind, frame.kind)}, expected {spec['kind']}"
                if frame.kind != kind
                else self.mismatch(spec.get("body", {}), frame.body, "body")
            )
            if why:
                raise Failure(f"{why}\n  expected {show(spec)}\n  received {show(frame)}")

    def collect(self, spec: dict[str, Any], deadline: float) -> None:
        """Consecutive data events of one id; the first other frame of that id stays for the next step."""
        req_id = int(self.build(spec["id"]))
        evs = spec["ev"] if isinstance(spec["ev"], list) else [spec["ev"]]
        got = bytearray()
        while True:
            frame = self.next_for({req_id}, deadline, {"collect": spec, "so_far": len(got)})
            data = frame.body.get("data")
            if frame.kind != KINDS["event"] or frame.body.get("ev") not in evs or not isinstance(data, bytes):
                self.pool.insert(0, frame)
                break
            if frame.size > spec.get("max_payload", frame.size):
                raise Failure(f"a {frame.size}-byte payload, above max_payload {spec['max_payload']}")
            got += data
            if spec.get("auto_window") and data:
                self.write(self.encode({"kind": "window", "id": req_id, "body": {"bytes": len(data)}}))
        why = self.mismatch(spec.get("total", {"$any": "bin"}), bytes(got), "total")
        if why:
            raise Failure(f"collected {len(got)} bytes: {why}")


def load(transcript: str | Path | dict[str, Any]) -> dict[str, Any]:
    if isinstance(transcript, dict):
        return transcript
    with open(transcript) as f:
        doc: dict[str, Any] = json.load(f)
    doc["name"] = Path(transcript).stem
    return doc


def run_transcript(
    transcript: str | Path | dict[str, Any],
    connect: Callable[[], socket.socket],
    tmp: str | None = None,
    timeout: float = 10.0,
) -> Result:
    """Replay one transcript on a fresh connection from ``connect``.

    ``tmp`` replaces ``${TMP}``: a directory the server can write (by default a fresh local
    one, removed afterwards). ``timeout`` bounds every step that waits for the server.
    """
    doc = load(transcript)
    name = str(doc.get("name", "?"))
    scratch = tmp or tempfile.mkdtemp(prefix=f"conformance-{name}-")
    start = time.monotonic()
    try:
        with connect() as sock:
            Replay(doc, sock, scratch, timeout).run()
        status, message = "pass", ""
    except Failure as exc:
        status, message = "fail", str(exc)
    except Skip as exc:
        status, message = "skip", str(exc)
    except OSError as exc:
        status, message = "fail", f"socket error: {exc}"
    finally:
        if tmp is None:
            shutil.rmtree(scratch, ignore_errors=True)
    if doc.get("xfail"):
        status, message = ("xfail", f"{doc['xfail']}\n{message}") if status == "fail" else ("xpass", doc["xfail"])
    return Result(name, status, message, time.monotonic() - start)


def connector(address: str) -> Callable[[], socket.socket]:
    """unix:PATH connects anew for each transcript; fd:N is one connected socket (one transcript)."""
    kind, _, rest = address.partition(":")
    if kind == "unix":

        def unix() -> socket.socket:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(rest)
            return s

        return unix
    if kind == "fd":
        given = [socket.socket(fileno=int(rest))]

        def fd() -> socket.socket:
            if not given:
                raise SystemExit("fd: serves one transcript; name exactly one")
            return given.pop()

        return fd
    raise SystemExit(f"address must be unix:PATH or fd:N, not {address!r}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("address", help="unix:PATH, or fd:N for an already connected socket")
    ap.add_argument("transcripts", nargs="*", type=Path, help="files (default: every transcripts/*.json)")
    ap.add_argument("--tmp", help="directory the server can write, used for ${TMP} (give a guest path for a VM)")
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds any step may wait (default 10)")
    args = ap.parse_args(argv)
    paths = args.transcripts or sorted(TRANSCRIPTS.glob("*.json"))
    connect = connector(args.address)
    counts: dict[str, int] = {}
    for path in paths:
        r = run_transcript(path, connect, args.tmp, args.timeout)
        counts[r.status] = counts.get(r.status, 0) + 1
        print(f"{r.status.upper():5}  {r.name}  {r.seconds:.2f}s")
        if r.message and r.status != "pass":
            print("       " + r.message.replace("\n", "\n       "))
    print(", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    return 1 if counts.get("fail") else 0


if __name__ == "__main__":
    sys.exit(main())
