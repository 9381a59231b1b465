#!/usr/bin/env python3
"""Replay guestd conformance transcripts: against a server, or as a fake server for a client.

Standalone on purpose: the standard library and msgpack only, so a team with its own
server or client can run it without installing guestd. The transcript format is in README.md.

    python run.py unix:/run/guestd.sock                 # every transcript, against a server
    python run.py unix:/tmp/s.sock transcripts/ping.json --tmp /guest/scratch
    python run.py --serve unix:/tmp/fake.sock transcripts/ping.json   # a client connects here
    python run.py --check                               # every transcript against the schema
    python run.py --readme                              # rewrite README.md's transcript table
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import shutil
import socket
import struct
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

HEADER = struct.Struct(">2sBBII")  # magic, frame version, kind, payload length, id
NOW_SLACK_NS = 600 * 10**9  # how far a client's {"$now_ns"} may be from the fake server's clock
FLOOR = 65536  # max_frame and stream_window are never negotiated below this
KINDS = {"hello": 1, "request": 2, "response": 3, "error": 4, "event": 5, "input": 6, "window": 7, "cancel": 8}
KIND_NAMES = {v: k for k, v in KINDS.items()}
HERE = Path(__file__).resolve().parent
TRANSCRIPTS = HERE / "transcripts"
README = HERE / "README.md"
SCHEMA = HERE.parent / "schema" / "v1.json"
SERVER_TEST = "(a server test"  # a client_call starting so: no client produces these frames
# The fake server's limits where a transcript names none (guestd's defaults).
DEFAULT_LIMITS: dict[str, Any] = {
    "max_frame": 4194304,
    "stream_window": 4194304,
    "max_inflight": 4096,
    "hello_timeout_s": 10.0,
    "max_chunk": 1048576,
}
TOP_KEYS = {
    "about", "spec", "client_call", "summary", "server_limits", "server_config", "xfail", "windows", "steps", "name",
}  # fmt: skip


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
    """A step did not hold: the peer answered differently, too late, or broke a framing rule."""


class Skip(Exception):
    """The transcript cannot run here: the server runs with other limits or config, or (fake
    server) no client produces its frames."""


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


def is_placeholder(v: Any) -> bool:
    return isinstance(v, dict) and any(isinstance(k, str) and k.startswith("$") for k in v)


def kind_of(spec: dict[str, Any]) -> int:
    kind = spec["kind"]
    return kind if isinstance(kind, int) else KINDS[kind]


def encode_frame(kind: int, req_id: int, body: Any) -> bytes:
    payload: bytes = msgpack.packb(body, use_bin_type=True)
    return HEADER.pack(b"GD", 1, kind, len(payload), req_id) + payload


# ============================================================================ the schema


def load_schema(path: str | Path | None = None) -> dict[str, Any]:
    """protocol/schema/v1.json (``path`` overrides where it is read from)."""
    with open(path or SCHEMA) as f:
        schema: dict[str, Any] = json.load(f)
    return schema


_ENUM = re.compile(r"enum\((.*)\)$")
Fields = dict[str, dict[str, Any]]  # name -> {"type", "required", "gt", "ge", "le", "min_len", ...}


class Types:
    """The schema's type language (PROTOCOL.md 2.3, 12): ``T?`` also nil, ``list<T>``,
    ``map``, ``map<str,str>``, ``enum(a|b)``, ``path`` (str or bin), record names, ``any``."""

    def __init__(self, schema: dict[str, Any]) -> None:
        self.schema = schema
        self.records: dict[str, Fields] = schema.get("records", {})
        self.ops: dict[str, dict[str, Any]] = schema.get("ops", {})
        self.messages: dict[str, Fields] = schema.get("messages", {})
        self.codes: set[str] = set(schema.get("error_codes", []))

    @staticmethod
    def split(typ: str) -> tuple[bool, str]:
        return (True, typ[:-1]) if typ.endswith("?") else (False, typ)

    @staticmethod
    def element(base: str) -> str | None:
        return base[5:-1] if base.startswith("list<") and base.endswith(">") else None

    def fields_of(self, typ: str) -> Fields | None:
        """The fields of a record type (nil for anything else)."""
        return self.records.get(self.split(typ)[1])

    def op_fields(self, op: str | None, part: str) -> Fields | None:
        spec = self.ops.get(op) if isinstance(op, str) else None
        if spec is None:
            return None
        fields: Fields = spec.get(part) or {}
        return fields

    # -- concrete values for a fake server

    def default(self, typ: str) -> Any:
        """The type-default of ``typ``: what a complete frame holds where nothing is said."""
        nullable, base = self.split(typ)
        if nullable or base == "any":
            return None
        if base in ("str", "path"):
            return ""
        if base in ("int", "uint"):
            return 0
        if base == "float":
            return 0.0
        if base == "bool":
            return False
        if base == "bin":
            return b""
        if base.startswith("list<"):
            return []
        if base.startswith("map"):
            return {}
        m = _ENUM.match(base)
        if m:
            return m.group(1).split("|")[0]
        record = self.records.get(base)
        if record is not None:
            return self.complete({}, record)
        raise ValueError(f"unknown schema type {typ!r}")

    def complete(self, body: dict[str, Any], fields: Fields) -> dict[str, Any]:
        """``body`` with every required field it lacks at its type-default, records completed too."""
        out = dict(body)
        for name, f in fields.items():
            if name not in out:
                if f.get("required"):
                    out[name] = self.default(f["type"])
                continue
            out[name] = self.complete_value(out[name], f["type"])
        return out

    def complete_value(self, value: Any, typ: str) -> Any:
        base = self.split(typ)[1]
        inner = self.element(base)
        if inner is not None and isinstance(value, list):
            return [self.complete_value(v, inner) for v in value]
        record = self.records.get(base)
        if record is not None and isinstance(value, dict):
            return self.complete(value, record)
        return value

    # -- checking (transcripts against the schema)

    def check_fields(self, body: Any, fields: Fields, where: str, whole: bool, errs: list[str]) -> None:
        """Every listed key is a known field of the right type; ``whole``: required ones present
        and constraints kept (frames a client sends); else a partial listing (expected frames)."""
        if is_placeholder(body):
            self.check_placeholder(body, "map", where, whole, errs)
            return
        if not isinstance(body, dict):
            errs.append(f"{where}: expected a map, got {show(body, 80)}")
            return
        for key, value in body.items():
            f = fields.get(key)
            if f is None:
                errs.append(f"{where}.{key}: no such field in the schema")
                continue
            self.check_value(value, f["type"], f"{where}.{key}", whole, errs)
            if whole and not is_placeholder(value):
                self.check_constraints(value, f, f"{where}.{key}", errs)
        if whole:
            for name, f in fields.items():
                if f.get("required") and name not in body:
                    errs.append(f"{where}.{name}: required, missing")

    def check_value(self, v: Any, typ: str, where: str, whole: bool, errs: list[str]) -> None:
        if is_placeholder(v):
            self.check_placeholder(v, typ, where, whole, errs)
            return
        nullable, base = self.split(typ)
        if v is None:
            if not nullable and base != "any":
                errs.append(f"{where}: nil, but {typ} does not allow nil (PROTOCOL.md 2.3)")
            return
        bad = f"{where}: {show(v, 80)} is not {typ}"
        inner = self.element(base)
        record = self.records.get(base)
        m = _ENUM.match(base)
        if base == "any":
            return
        if base == "str":
            ok = isinstance(v, str)
        elif base == "path":
            ok = isinstance(v, str)  # bin only through $bin (a placeholder)
        elif base == "int":
            ok = _is_int(v)
        elif base == "uint":
            ok = _is_int(v) and v >= 0
        elif base == "float":
            ok = _is_int(v) or isinstance(v, float)  # a float field also accepts integers
        elif base == "bool":
            ok = isinstance(v, bool)
        elif base == "bin":
            ok = False  # bytes are written {"$bin": hex}
        elif base == "map":
            ok = isinstance(v, dict)
        elif base == "map<str,str>":
            ok = isinstance(v, dict) and all(isinstance(w, str) for w in v.values())
        elif inner is not None:
            if not isinstance(v, list):
                errs.append(bad)
                return
            for i, item in enumerate(v):
                self.check_value(item, inner, f"{where}[{i}]", whole, errs)
            return
        elif record is not None:
            self.check_fields(v, record, where, whole, errs)
            return
        elif m:
            ok = v in m.group(1).split("|")
        else:
            errs.append(f"{where}: unknown schema type {typ!r}")
            return
        if not ok:
            errs.append(bad)

    def check_constraints(self, v: Any, f: dict[str, Any], where: str, errs: list[str]) -> None:
        if not (_is_int(v) or isinstance(v, float)):
            if "min_len" in f and isinstance(v, list | str) and len(v) < f["min_len"]:
                errs.append(f"{where}: shorter than {f['min_len']}")
            return
        for rule, holds in (("gt", v > f.get("gt", v - 1)), ("ge", v >= f.get("ge", v)), ("le", v <= f.get("le", v))):
            if rule in f and not holds:
                errs.append(f"{where}: {v} breaks {rule} {f[rule]}")

    def fits(self, placeholder_type: str, typ: str) -> bool:
        """Whether ``{"$any": placeholder_type}`` can stand for a value of schema type ``typ``."""
        nullable, base = self.split(typ)
        if placeholder_type == "any" or base == "any":
            return True
        if placeholder_type == "nil":
            return nullable
        choices = {
            "str": base in ("str", "path") or bool(_ENUM.match(base)),
            "bin": base in ("bin", "path"),
            "int": base in ("int", "uint"),
            "uint": base in ("int", "uint"),
            "float": base == "float",
            "number": base in ("int", "uint", "float"),
            "bool": base == "bool",
            "map": base.startswith("map") or base in self.records,
            "list": base.startswith("list<"),
        }
        return choices.get(placeholder_type, False)

    def check_placeholder(self, p: dict[str, Any], typ: str, where: str, whole: bool, errs: list[str]) -> None:
        base = self.split(typ)[1]
        for key, arg in p.items():
            if key == "$any":
                if arg not in TYPES:
                    errs.append(f"{where}: unknown $any type {arg!r}")
                elif not self.fits(arg, typ):
                    errs.append(f'{where}: {{"$any": "{arg}"}} cannot be {typ}')
            elif key == "$bin":
                if not self.fits("bin", typ):
                    errs.append(f"{where}: bytes where the schema says {typ}")
            elif key == "$now_ns":
                if not self.fits("int", typ):
                    errs.append(f"{where}: $now_ns where the schema says {typ}")
            elif key in ("$le", "$ge"):
                if not self.fits("number", typ):
                    errs.append(f"{where}: {key} where the schema says {typ}")
            elif key == "$len":
                if not any(self.fits(t, typ) for t in ("bin", "str", "list", "map")):
                    errs.append(f"{where}: $len where the schema says {typ}")
            elif key == "$contains":
                inner = self.element(base)
                if base != "any" and inner is None:
                    errs.append(f"{where}: $contains where the schema says {typ}")
                elif inner is not None and isinstance(arg, list):
                    for i, item in enumerate(arg):
                        self.check_value(item, inner, f"{where}.$contains[{i}]", False, errs)
            elif key not in ("$capture", "$ref", "$times"):
                errs.append(f"{where}: unknown placeholder {key}")


def check_transcript(doc: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    """What in ``doc`` breaks the schema: every client frame whole (args of its op, input of
    its op, the client hello), every server frame as listed (result, events, error shape and a
    known code, the server hello). Frames of a "(a server test)" transcript the client sends,
    and any frame marked ``"invalid": true``, are exempt: they are malformed on purpose."""
    t = Types(schema)
    errs: list[str] = [f"top-level key {k!r} is not part of the format" for k in doc if k not in TOP_KEYS]
    server_test = str(doc.get("client_call", "")).startswith(SERVER_TEST)
    op_of: dict[int, str | None] = {}  # transcript id -> op of its latest request
    for n, step in enumerate(doc.get("steps", []), 1):
        if "send" in step:
            for i, spec in enumerate(step["send"]):
                where = f"step {n} send[{i}]"
                kind, rid, body = spec.get("kind"), spec.get("id"), spec.get("body", {})
                if kind == "request" and isinstance(body, dict) and _is_int(rid):
                    op_of[rid] = body.get("op") if isinstance(body.get("op"), str) else None
                if server_test or spec.get("invalid") or isinstance(kind, int):
                    continue
                _check_client_frame(t, kind, rid, body, op_of, where, errs)
        elif "expect" in step:
            for i, spec in enumerate(step["expect"]):
                if not spec.get("invalid") and not isinstance(spec.get("kind"), int):
                    _check_server_frame(t, spec, op_of, f"step {n} expect[{i}]", errs)
        elif "collect" in step:
            c = step["collect"]
            events = t.op_fields(op_of.get(c.get("id")), "events")
            ev_type = (events or {}).get("ev", {}).get("type", "")
            m = _ENUM.match(ev_type)
            names = c.get("ev") if isinstance(c.get("ev"), list) else [c.get("ev")]
            if not events or "data" not in events:
                errs.append(f"step {n} collect: op {op_of.get(c.get('id'))!r} has no data events")
            elif m and any(e not in m.group(1).split("|") for e in names):
                errs.append(f"step {n} collect: ev {names} not among {ev_type}")
        elif not ("send_raw_hex" in step or step.get("expect_closed")):
            errs.append(f"step {n}: unknown step {show(step, 80)}")
    return errs


def _check_client_frame(
    t: Types, kind: Any, rid: Any, body: Any, op_of: dict[int, str | None], where: str, errs: list[str]
) -> None:
    if kind == "hello":
        t.check_fields(body, t.messages["hello_client"], f"{where} hello", True, errs)
    elif kind == "request":
        t.check_fields(body, t.messages["request"], f"{where} request", True, errs)
        op = body.get("op") if isinstance(body, dict) else None
        spec = t.ops.get(op) if isinstance(op, str) else None
        if spec is None:
            errs.append(f"{where}: op {op!r} is not in the schema")
            return
        args = body.get("args", {})
        t.check_fields(args, spec.get("args") or {}, f"{where} {op} args", True, errs)
        if isinstance(args, dict):
            for group in spec.get("one_of", []):
                if all(not is_placeholder(args.get(g)) for g in group):
                    given = [g for g in group if args.get(g) not in (None, False)]
                    if len(given) != 1:
                        errs.append(f"{where} {op} args: exactly one of {group} (got {given})")
            for group in spec.get("exclusive", []):
                if len([g for g in group if args.get(g) not in (None, False)]) > 1:
                    errs.append(f"{where} {op} args: at most one of {group}")
    elif kind == "input":
        op = op_of.get(rid)
        fields = t.op_fields(op, "input")
        if not fields:
            errs.append(f"{where}: input for id {rid}, whose op {op!r} takes none")
            return
        t.check_fields(body, fields, f"{where} {op} input", True, errs)
    elif kind == "window":
        t.check_fields(body, t.messages["window"], f"{where} window", True, errs)
    elif kind == "cancel":
        t.check_fields(body, t.messages["cancel"], f"{where} cancel", True, errs)
    elif kind not in KINDS:
        errs.append(f"{where}: unknown kind {kind!r}")
    else:
        errs.append(f"{where}: a client never sends {kind}")


def _check_server_frame(
    t: Types, spec: dict[str, Any], op_of: dict[int, str | None], where: str, errs: list[str]
) -> None:
    kind, rid, body = spec.get("kind"), spec.get("id"), spec.get("body", {})
    if kind == "hello":
        t.check_fields(body, t.messages["hello_server"], f"{where} hello", False, errs)
    elif kind == "error":
        t.check_fields(body, t.messages["error"], f"{where} error", False, errs)
        code = body.get("code") if isinstance(body, dict) else None
        if not is_placeholder(code) and code not in t.codes:
            errs.append(f"{where} error: code {code!r} is not a known error code")
    elif kind in ("response", "event"):
        op = op_of.get(rid) if isinstance(rid, int) else None
        fields = t.op_fields(op, "result" if kind == "response" else "events")
        if fields is None:
            errs.append(f"{where}: {kind} for id {rid}, which has no request of a known op before it")
        elif kind == "event" and not fields:
            errs.append(f"{where}: event for {op}, which has no events")
        else:
            t.check_fields(body, fields, f"{where} {op} {'result' if kind == 'response' else 'event'}", False, errs)
    elif kind == "window":
        t.check_fields(body, t.messages["window"], f"{where} window", False, errs)
    else:
        errs.append(f"{where}: a server never sends {kind!r}")


# ============================================================================ values


class Values:
    """Placeholders: what frames we send are built from, and what received frames must match."""

    def __init__(self, tmp: str) -> None:
        self.tmp = tmp
        self.vars: dict[str, Any] = {}

    def build(self, v: Any) -> Any:
        if isinstance(v, dict):
            if "$bin" in v:
                return bytes.fromhex(v["$bin"]) * int(v.get("$times", 1))
            if "$ref" in v:
                return self.ref(v["$ref"])
            if "$now_ns" in v:  # the sender's wall clock plus an offset: a host clock that is true
                return time.time_ns() + int(v["$now_ns"])
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
        if is_placeholder(exp):
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
            elif key == "$now_ns":
                # a client's clock: the receiver's clock plus the offset, within NOW_SLACK_NS
                ok = TYPES["int"](got) and abs(got - (time.time_ns() + int(arg))) <= NOW_SLACK_NS
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


# ============================================================================ against a server


class Replay(Values):
    """One transcript replayed over one connection to a server (we play the client)."""

    def __init__(self, doc: dict[str, Any], sock: socket.socket, tmp: str, timeout: float) -> None:
        super().__init__(tmp)
        self.doc, self.sock, self.timeout = doc, sock, timeout
        self.buf = bytearray()
        self.pool: list[Frame] = []  # received, not yet matched by a step
        self.eof = False
        self.accept = FLOOR  # largest payload we take before the server's hello says more
        self.window: int | None = None  # negotiated stream_window
        self.credit: dict[int, int] = {}  # data bytes the server may still send per id
        self.keep_windows = bool(doc.get("windows", False))

    # -- the wire

    def encode(self, spec: dict[str, Any]) -> bytes:
        kind = kind_of(spec)
        req_id = int(self.build(spec["id"]))
        body = self.build(spec.get("body", {}))
        if kind == KINDS["hello"]:
            self.accept = max(FLOOR, body.get("max_frame", 1 << 32))
        elif kind == KINDS["request"] and self.window is not None:
            self.credit[req_id] = self.window
        elif kind == KINDS["window"] and req_id in self.credit:
            grant = body.get("bytes", 0)
            if _is_int(grant) and grant > 0:  # a malformed window (a server test) grants nothing
                self.credit[req_id] += grant
        return encode_frame(kind, req_id, body)

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
        body = decode_payload(payload, "server", kind, req_id)
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
            self.bind(spec.get("body", {}), frame.body)
            why = (
                f"kind {KIND_NAMES.get(frame.kind, frame.kind)}, expected {spec['kind']}"
                if frame.kind != kind_of(spec)
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


def decode_payload(payload: bytes, who: str, kind: int, req_id: int) -> dict[str, Any]:
    try:
        body = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as exc:
        raise Failure(f"{who} payload (kind {kind}, id {req_id}) is not valid msgpack: {exc}") from None
    if not isinstance(body, dict) or not all(isinstance(k, str) for k in body):
        raise Failure(f"{who} payload (kind {kind}, id {req_id}) is not a map with str keys: {show(body)}")
    return body


# ============================================================================ as a fake server


@dataclass
class Item:
    """One thing the fake server waits for (a client frame) or does (a frame, a data run, a close)."""

    seq: int
    step: int
    side: str  # "client" | "server"
    request: tuple[int, int]  # (transcript id, how many requests that id has started): one request
    spec: dict[str, Any]
    what: str = "frame"  # frame | collect | close
    final: bool = False
    timeout: float = 10.0
    done: bool = False
    left: bytes | None = None  # collect: data not sent yet

    def describe(self) -> str:
        if self.what == "collect":
            return f"step {self.step} collect {show(self.spec, 200)}"
        if self.what == "close":
            return f"step {self.step} expect_closed"
        return f"step {self.step} {show(self.spec, 300)}"


@dataclass
class Flight:
    """A request the client has sent, bound to the transcript's request it matched."""

    cid: int  # the client's id
    op: str | None
    send_credit: int  # data bytes we may still send it
    input_credit: int  # input bytes it may still send us
    input_got: bytearray = field(default_factory=bytearray)
    input_eof: bool = False
    ended: bool = False


class Serve(Values):
    """One transcript played from the server's side over one connection (a client under test
    is the other end): its frames are checked against the ``send`` steps, ours are built from
    the ``expect`` and ``collect`` steps, complete per the schema."""

    def __init__(
        self, doc: dict[str, Any], sock: socket.socket, tmp: str, timeout: float, schema: dict[str, Any]
    ) -> None:
        super().__init__(tmp)
        self.doc, self.sock, self.timeout = doc, sock, timeout
        self.types = Types(schema)
        self.buf = bytearray()
        self.eof = False
        self.closed = False
        self.limits = dict(DEFAULT_LIMITS)
        self.limits.update(doc.get("server_config", {}).get("limits", {}))
        self.limits.update(doc.get("server_limits", {}))
        self.out_max = FLOOR  # largest payload we may send (the client's max_frame, at least 65536)
        self.window = FLOOR
        self.items: list[Item] = []
        self.ops: dict[tuple[int, int], str | None] = {}  # the transcript's request -> its op
        self.flights: dict[tuple[int, int], Flight] = {}
        self.by_cid: dict[int, tuple[int, int]] = {}  # client id -> request in flight
        self.ended_cids: set[int] = set()
        self.auto_windows = not doc.get("windows", False)
        self.version = 1
        self.client_hello: dict[str, Any] = {}

    # -- the plan: what to wait for and what to do, in transcript order

    def plan(self) -> None:
        count: dict[int, int] = {}
        open_ids: set[int] = set()
        for n, step in enumerate(self.doc["steps"], 1):
            timeout = float(step.get("timeout_s", self.timeout))
            if "send_raw_hex" in step:
                raise Skip("sends raw bytes, which no client produces (a server test)")
            for spec in step.get("send", []):
                kind, tid = kind_of(spec), int(spec["id"])
                if kind == KINDS["window"]:
                    continue  # when a client grants credit is its own business; checked by the data we send
                if kind not in KIND_NAMES:
                    raise Skip(f"sends a frame of unknown kind {kind} (a server test)")
                if kind == KINDS["request"] and tid not in open_ids:
                    count[tid] = count.get(tid, 0) + 1
                    open_ids.add(tid)
                    op = spec.get("body", {}).get("op")
                    self.ops[(tid, count[tid])] = op if isinstance(op, str) else None
                req = (tid, count.get(tid, 0)) if tid else (0, 0)
                self.items.append(Item(len(self.items), n, "client", req, spec, timeout=timeout))
            for spec in step.get("expect", []):
                kind, tid = kind_of(spec), int(spec["id"])
                final = tid != 0 and kind in (KINDS["response"], KINDS["error"])
                req = (tid, count.get(tid, 0)) if tid else (0, 0)
                self.items.append(Item(len(self.items), n, "server", req, spec, final=final, timeout=timeout))
                if final:
                    open_ids.discard(tid)
            if "collect" in step:
                tid = int(step["collect"]["id"])
                req = (tid, count.get(tid, 0))
                self.items.append(Item(len(self.items), n, "server", req, step["collect"], "collect", timeout=timeout))
            if step.get("expect_closed"):
                self.items.append(Item(len(self.items), n, "server", (0, 0), {}, "close", timeout=timeout))

    def ready(self, item: Item) -> bool:
        """May this server item go out now? Frames of id 0 and a close wait for everything
        before them; a request's events wait for the request; its final frame waits for every
        client frame of that request listed before it (input, cancel)."""
        earlier = self.items[: item.seq]
        if item.what == "close" or item.request[0] == 0:
            return all(i.done for i in earlier)
        if any(not i.done for i in earlier if i.side == "server" and (i.request == item.request or i.request[0] == 0)):
            return False
        if item.final:
            return all(i.done for i in earlier if i.request == item.request)
        flight = self.flights.get(item.request)
        if flight is None:
            return False
        data = item.spec.get("body", {}).get("data") if item.what == "frame" else None
        return not is_placeholder(data) or len(self.build(data)) <= flight.send_credit  # within the credit

    # -- the run

    def run(self) -> None:
        self.plan()
        self.sock.setblocking(False)
        while not self.closed:
            self.advance()
            pending = [i for i in self.items if not i.done]
            if not pending or self.closed:
                break
            self.receive_one(pending)
        if not self.closed:
            self.linger()

    def advance(self) -> None:
        """Do every server item that is ready, in transcript order, until none is."""
        progress = True
        while progress and not self.closed:
            progress = False
            for item in self.items:
                if item.done or item.side != "server" or not self.ready(item):
                    continue
                if item.what == "close":
                    self.close()
                    item.done = True
                    return
                if item.what == "collect":
                    before = item.left
                    self.collect(item)
                    progress = progress or item.done or item.left != before
                    continue
                self.write(self.frame(item))
                item.done = progress = True

    def receive_one(self, pending: list[Item]) -> None:
        timeout = max([self.timeout, *(i.timeout for i in pending[:1])])
        try:
            frame = self.receive(time.monotonic() + timeout)
        except TimeoutError:
            raise Failure(self.stuck("no frame from the client within the timeout", pending)) from None
        if frame is None:
            raise Failure(self.stuck("the client closed the connection", pending))
        self.on_frame(frame)

    def stuck(self, why: str, pending: list[Item]) -> str:
        lines = [why + "; the transcript still waits for:"]
        for item in pending[:4]:
            note = ""
            if item.what == "collect" and item.left is not None:
                flight = self.flights.get(item.request)
                credit = flight.send_credit if flight else 0
                note = (
                    f"  ({len(item.left)} data bytes not sent: the client's credit is {credit};"
                    " it sends no window frame as it reads)"
                )
            lines.append(f"  {item.side}: {item.describe()}{note}")
        return "\n".join(lines)

    def linger(self) -> None:
        """After the last step: until the client closes (or a quiet timeout), only windows and
        late input/cancel for requests already answered may come."""
        while True:
            try:
                frame = self.receive(time.monotonic() + self.timeout)
            except TimeoutError:
                return
            if frame is None:
                return
            self.on_frame(frame)

    # -- frames from the client

    def receive(self, deadline: float) -> Frame | None:
        while True:
            if len(self.buf) >= HEADER.size:
                magic, version, kind, length, cid = HEADER.unpack_from(self.buf)
                if magic != b"GD" or version != 1:
                    raise Failure(f"client sent a bad frame header {bytes(self.buf[: HEADER.size]).hex()}")
                if length > self.limits["max_frame"]:
                    raise Failure(
                        f"client sent a {length}-byte payload (kind {kind}, id {cid}); "
                        f"the server's limits.max_frame is {self.limits['max_frame']} (PROTOCOL.md 2.1)"
                    )
                if len(self.buf) >= HEADER.size + length:
                    payload = bytes(self.buf[HEADER.size : HEADER.size + length])
                    del self.buf[: HEADER.size + length]
                    if kind not in KIND_NAMES:
                        continue  # receivers ignore unknown kinds
                    return Frame(kind, cid, decode_payload(payload, "client", kind, cid), length)
            if self.eof:
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            readable, _, _ = select.select([self.sock], [], [], left)
            if readable:
                self.fill()

    def fill(self) -> None:
        try:
            chunk = self.sock.recv(1 << 20)
        except (BlockingIOError, InterruptedError):
            return
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            self.eof = True
        self.buf += chunk

    def on_frame(self, frame: Frame) -> None:
        kind = frame.kind
        if kind == KINDS["window"]:
            self.on_window(frame)
        elif kind == KINDS["hello"]:
            self.on_hello(frame)
        elif kind == KINDS["request"]:
            self.on_request(frame)
        elif kind in (KINDS["input"], KINDS["cancel"]):
            self.on_input(frame)
        else:
            raise Failure(f"the client sent a {KIND_NAMES[kind]} frame, which only a server sends: {show(frame)}")

    def on_window(self, frame: Frame) -> None:
        n = frame.body.get("bytes")
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise Failure(f"the client sent a malformed window frame: {show(frame)}")
        req = self.by_cid.get(frame.id)
        if req is not None:
            self.flights[req].send_credit += n

    def waiting(self, match: Callable[[Item], bool]) -> list[Item]:
        return [i for i in self.items if not i.done and i.side == "client" and match(i)]

    def on_hello(self, frame: Frame) -> None:
        expected = self.waiting(lambda i: kind_of(i.spec) == KINDS["hello"])
        if not expected or any(i.seq < expected[0].seq for i in self.waiting(lambda i: True)):
            raise Failure(f"the client sent a hello the transcript does not expect now: {show(frame)}")
        item = expected[0]
        # A client's name and the versions it offers are its own: checked by type only.
        spec = dict(item.spec.get("body", {}))
        spec["client"] = {"$any": "str"}
        spec["versions"] = {"$any": "list"}
        why = self.mismatch(spec, frame.body, "hello") or (
            None
            if isinstance(frame.body.get("versions"), list) and all(TYPES["uint"](v) for v in frame.body["versions"])
            else "hello.versions: expected a list of uint"
        )
        if why:
            raise Failure(f"{why}\n  expected {show(item.spec)}\n  received {show(frame)}")
        self.client_hello = frame.body
        mf, sw = frame.body.get("max_frame"), frame.body.get("stream_window")
        self.out_max = max(FLOOR, min(mf, self.limits["max_frame"])) if _is_int(mf) else self.limits["max_frame"]
        self.window = max(FLOOR, min(sw, self.limits["stream_window"])) if _is_int(sw) else self.limits["stream_window"]
        item.done = True

    def on_request(self, frame: Frame) -> None:
        if frame.id == 0:
            raise Failure(f"the client sent a request with the reserved id 0: {show(frame)}")
        if frame.id in self.by_cid:
            raise Failure(f"the client reused id {frame.id} while its request is in flight: {show(frame)}")
        candidates = self.waiting(lambda i: kind_of(i.spec) == KINDS["request"] and i.request not in self.flights)
        if not candidates:
            raise Failure(f"the client sent a request the transcript does not expect: {show(frame)}")
        whys = []
        for item in candidates:
            why = self.mismatch_sent(item, frame)
            if why is None:
                op = self.ops.get(item.request)
                self.flights[item.request] = Flight(frame.id, op, self.window, self.window)
                self.by_cid[frame.id] = item.request
                self.ended_cids.discard(frame.id)
                item.done = True
                return
            whys.append(f"  step {item.step} {show(item.spec, 300)}:\n    {why}")
        raise Failure(
            f"the client sent a request that matches none the transcript waits for:\n  received {show(frame)}\n"
            + "\n".join(whys[:4])
        )

    def on_input(self, frame: Frame) -> None:
        req = self.by_cid.get(frame.id)
        if req is None:
            if frame.id in self.ended_cids:
                return  # input or cancel racing the final frame we sent: the protocol ignores them
            raise Failure(f"the client sent a frame for id {frame.id}, which is not in flight: {show(frame)}")
        flight = self.flights[req]
        pending = self.waiting(lambda i: i.request == req)
        body = frame.body
        if frame.kind == KINDS["input"] and set(body) <= {"data", "eof"} and body:
            self.on_input_data(frame, flight, pending)
            return
        if not pending:
            raise Failure(f"the client sent a frame the transcript does not list: {show(frame)}")
        why = self.mismatch_sent(pending[0], frame)
        if why:
            raise Failure(f"{why}\n  expected {show(pending[0].spec)}\n  received {show(frame)}")
        pending[0].done = True

    def on_input_data(self, frame: Frame, flight: Flight, pending: list[Item]) -> None:
        """Input data is a byte stream: the client may cut it into frames as it likes, and send
        eof on the last data frame or alone."""
        data, eof = frame.body.get("data", b""), frame.body.get("eof", False)
        if not isinstance(data, bytes) or not isinstance(eof, bool):
            raise Failure(f"the client sent a malformed input frame: {show(frame)}")
        flight.input_credit -= len(data)
        if flight.input_credit < 0:
            raise Failure(f"the client sent {-flight.input_credit} input bytes for id {frame.id} beyond the credit")
        flight.input_got += data
        flight.input_eof = flight.input_eof or eof
        stream_items = [
            i
            for i in self.items
            if i.side == "client" and i.request == self.by_cid[frame.id] and kind_of(i.spec) == KINDS["input"]
            if set(i.spec.get("body", {})) <= {"data", "eof"}
        ]
        expected = b"".join(self.build(i.spec["body"].get("data", {"$bin": ""})) for i in stream_items)
        wants_eof = any(i.spec["body"].get("eof") for i in stream_items)
        got = bytes(flight.input_got)
        if not expected.startswith(got):
            raise Failure(f"the client's input for id {frame.id} differs: expected {show(expected)}, got {show(got)}")
        if flight.input_eof and (not wants_eof or got != expected):
            raise Failure(f"the client ended its input for id {frame.id} after {len(got)} of {len(expected)} bytes")
        upto = 0
        for item in stream_items:
            upto += len(self.build(item.spec["body"].get("data", {"$bin": ""})))
            if item.done:
                continue
            covered = len(got) >= upto and (flight.input_eof or not item.spec["body"].get("eof"))
            if not covered:
                break
            if pending and pending[0] is not item and not pending[0].done:
                raise Failure(f"the client sent input before {pending[0].describe()}: {show(frame)}")
            item.done = True
            pending = [i for i in pending if not i.done]
        if data and self.auto_windows and not flight.ended:
            self.write(encode_frame(KINDS["window"], frame.id, {"bytes": len(data)}))  # we consumed it

    def mismatch_sent(self, item: Item, frame: Frame) -> str | None:
        """A client frame against the transcript's: the same rules as for a server's frames,
        except that a float field also takes an integer of the same value (PROTOCOL.md 2.3)."""
        if frame.kind != kind_of(item.spec):
            return f"kind {KIND_NAMES.get(frame.kind, frame.kind)}, expected {item.spec['kind']}"
        exp, got = item.spec.get("body", {}), frame.body
        if frame.kind == KINDS["request"]:
            fields = self.types.op_fields(exp.get("op"), "args") or {}
            exp = {**exp, "args": floats(exp.get("args", {}), fields)}
            got = {**got, "args": floats(got.get("args", {}), fields)}
        return self.mismatch(exp, got, "body")

    # -- frames to the client

    def frame(self, item: Item) -> bytes:
        kind, tid = kind_of(item.spec), int(item.spec["id"])
        flight = self.flights.get(item.request)
        cid = 0 if tid == 0 else (flight.cid if flight else tid)
        body = self.server_body(kind, item.spec.get("body", {}), flight.op if flight else None)
        if item.final and flight is not None:
            flight.ended = True
            del self.by_cid[flight.cid]
            self.ended_cids.add(flight.cid)
            del self.flights[item.request]
        if kind == KINDS["event"] and flight is not None and isinstance(body.get("data"), bytes):
            flight.send_credit -= len(body["data"])
        payload = encode_frame(kind, cid, body)
        if len(payload) - HEADER.size > self.out_max:
            raise Failure(f"the transcript's frame is {len(payload) - HEADER.size} bytes, above the client's max_frame")
        return payload

    def server_body(self, kind: int, spec: Any, op: str | None) -> dict[str, Any]:
        t = self.types
        if kind == KINDS["hello"]:
            return self.hello_body(spec)
        if kind == KINDS["error"]:
            fields = t.messages["error"]
            body = self.concrete_fields(spec, fields)
            body.setdefault("message", f"{body.get('code', 'error')} (conformance fake server)")
            return t.complete(body, fields)
        part = {KINDS["response"]: "result", KINDS["event"]: "events", KINDS["window"]: None}.get(kind)
        fields = (t.op_fields(op, part) if part else t.messages["window"]) or {}
        return t.complete(self.concrete_fields(spec, fields), fields)

    def hello_body(self, spec: dict[str, Any]) -> dict[str, Any]:
        ops = sorted(self.types.ops)
        natural: dict[str, Any] = {
            "version": self.version,
            "server": "conformance-fake/1",
            "capabilities": sorted({str(self.types.ops[o].get("capability", "")) for o in ops} - {""}),
            "ops": ops,
            "limits": dict(self.limits),
            "max_frame": self.out_max,
            "stream_window": self.window,
            "boot_id": "00000000-0000-4000-8000-000000000000",
            "session": "conformance",
        }
        fields = self.types.messages["hello_server"]
        body = self.concrete_fields(spec, fields, natural)
        if isinstance(body.get("limits"), dict):
            body["limits"] = {**self.limits, **body["limits"]}
        body = {**natural, **body}
        self.out_max = body["max_frame"] if _is_int(body["max_frame"]) else self.out_max
        self.window = body["stream_window"] if _is_int(body["stream_window"]) else self.window
        self.limits = body["limits"] if isinstance(body["limits"], dict) else self.limits
        return body

    def concrete_fields(self, spec: Any, fields: Fields, natural: Any = None) -> dict[str, Any]:
        self.concrete(spec, "map", natural, fields)  # first pass binds every $capture (a $ref may come first)
        value = self.concrete(spec, "map", natural, fields)
        if not isinstance(value, dict):
            raise Failure(f"a frame body that is not a map: {show(spec)}")
        return value

    def concrete(self, exp: Any, typ: str, natural: Any = None, fields: Fields | None = None) -> Any:
        """A value for the client from a transcript value: placeholders become concrete values
        of their type (the ``natural`` one where it fits), captures remember what they chose."""
        if is_placeholder(exp):
            if "$bin" in exp:
                return self.build(exp)
            if "$ref" in exp:
                return self.vars.get(exp["$ref"], self.types.default(typ))
            if "$capture" in exp and exp["$capture"] in self.vars:
                return self.vars[exp["$capture"]]
            value = natural if natural is not None and not self.mismatch(exp, natural, "") else self.invent(exp, typ)
            if "$capture" in exp:
                self.vars[exp["$capture"]] = value
            return value
        if isinstance(exp, dict):
            fields = fields if fields is not None else self.types.fields_of(typ)
            out = {}
            for k, w in exp.items():
                ftype = fields[k]["type"] if fields and k in fields else "any"
                out[k] = self.concrete(w, ftype, natural.get(k) if isinstance(natural, dict) else None)
            return out
        if isinstance(exp, list):
            inner = self.types.element(self.types.split(typ)[1]) or "any"
            return [self.concrete(w, inner) for w in exp]
        return self.build(exp)

    def invent(self, exp: dict[str, Any], typ: str) -> Any:
        base = self.types.split(typ)[1]
        if "$contains" in exp:
            inner = self.types.element(base) or "any"
            return [self.concrete(e, inner) for e in exp["$contains"]]
        if "$len" in exp:
            n = int(exp["$len"])
            elem = self.types.element(base)
            if base == "bin" or exp.get("$any") == "bin":
                return b"x" * n
            if elem is not None or exp.get("$any") == "list":
                return [self.types.default(elem or "any")] * n
            if base.startswith("map") or exp.get("$any") == "map":
                return {f"k{i}": "" for i in range(n)}
            return "x" * n
        if "$ge" in exp or "$le" in exp:
            bound = exp["$ge"] if "$ge" in exp else exp["$le"]
            return float(bound) if base == "float" or exp.get("$any") == "float" else bound
        want = exp.get("$any", "any")
        if want in ("any", "nil") or not self.types.fits(want, typ):
            return None if want == "nil" else self.types.default(typ)
        if want == "str":
            m = _ENUM.match(base)
            return m.group(1).split("|")[0] if m else str(exp.get("$capture", "x"))
        if want in ("int", "uint"):
            return 1
        if want == "number":
            return 1.0 if base == "float" else 1
        if want == "float":
            return 0.5
        if want == "bool":
            return True
        if want == "bin":
            return b"x"
        return self.types.default(typ)

    def collect(self, item: Item) -> None:
        """Data events of ``total`` bytes, each within the client's max_frame (and the step's
        max_payload), never beyond the credit the client granted."""
        spec = item.spec
        flight = self.flights.get(item.request)
        if flight is None:
            raise Failure(f"collect for id {spec['id']}, which is not in flight")
        if item.left is None:
            total = self.concrete(spec.get("total", {"$any": "bin"}), "bin")
            item.left = total if isinstance(total, bytes) else b""
        ev = spec["ev"][0] if isinstance(spec["ev"], list) else spec["ev"]
        fields = self.types.op_fields(flight.op, "events") or {}
        shell = self.types.complete({"ev": ev, "data": b""}, fields)
        room = min(self.out_max, int(spec.get("max_payload", self.out_max)), self.limits.get("max_chunk", 1 << 20))
        room -= len(msgpack.packb(shell, use_bin_type=True)) + 3  # bin8 -> bin32 header
        frames = []
        while item.left and flight.send_credit > 0:
            n = min(room, flight.send_credit, len(item.left))
            chunk, item.left = item.left[:n], item.left[n:]
            flight.send_credit -= n
            frames.append(encode_frame(KINDS["event"], flight.cid, {**shell, "data": chunk}))
        if frames:
            self.write(b"".join(frames))
        item.done = not item.left

    def write(self, data: bytes) -> None:
        """Write everything, reading what the client sends meanwhile (it may be writing too)."""
        view = memoryview(data)
        deadline = time.monotonic() + self.timeout
        while view:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Failure("the client stopped reading: a write did not finish within the timeout")
            readable, writable, _ = select.select([] if self.eof else [self.sock], [self.sock], [], left)
            if readable:
                self.fill()
            if writable:
                try:
                    sent = self.sock.send(view[: 1 << 20])
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError as exc:
                    pending = [i for i in self.items if not i.done]
                    raise Failure(self.stuck(f"cannot send to the client ({exc})", pending)) from None
                view = view[sent:]

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.closed = True


def floats(args: Any, fields: Fields) -> Any:
    """``args`` with integers in float fields as floats (a float field takes either)."""
    if not isinstance(args, dict):
        return args
    out = dict(args)
    for k, v in args.items():
        f = fields.get(k)
        if f and Types.split(f["type"])[1] == "float" and _is_int(v):
            out[k] = float(v)
    return out


# ============================================================================ entry points


def load(transcript: str | Path | dict[str, Any]) -> dict[str, Any]:
    if isinstance(transcript, dict):
        return transcript
    with open(transcript) as f:
        doc: dict[str, Any] = json.load(f)
    doc["name"] = Path(transcript).stem
    return doc


def _finish(doc: dict[str, Any], status: str, message: str, start: float) -> Result:
    if doc.get("xfail") and status in ("pass", "fail"):
        status, message = ("xfail", f"{doc['xfail']}\n{message}") if status == "fail" else ("xpass", doc["xfail"])
    return Result(str(doc.get("name", "?")), status, message, time.monotonic() - start)


def run_transcript(
    transcript: str | Path | dict[str, Any],
    connect: Callable[[], socket.socket],
    tmp: str | None = None,
    timeout: float = 10.0,
    configured: bool = False,
) -> Result:
    """Replay one transcript on a fresh connection from ``connect`` (we play the client).

    ``tmp`` replaces ``${TMP}``: a directory the server can write (by default a fresh local
    one, removed afterwards). ``timeout`` bounds every step that waits for the server.
    ``configured``: the server runs with the transcript's ``server_config`` (otherwise a
    transcript with one is skipped: nothing on the wire says how a server is configured).
    """
    doc = load(transcript)
    start = time.monotonic()
    if doc.get("server_config") and not configured:
        why = f"needs a server configured with {show(doc['server_config'])} (say so with --configured)"
        return Result(str(doc.get("name", "?")), "skip", why, 0.0)
    scratch = tmp or tempfile.mkdtemp(prefix=f"conformance-{doc.get('name', 'x')}-")
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
    return _finish(doc, status, message, start)


def serve_transcript(
    transcript: str | Path | dict[str, Any],
    sock: socket.socket,
    tmp: str = "/tmp",
    timeout: float = 10.0,
    schema: dict[str, Any] | None = None,
) -> Result:
    """Play the server's side of one transcript to a client (we are the fake server).

    ``sock`` is a connected socket, or a listening one (then one connection is accepted within
    ``timeout``); it is closed at the end. ``tmp`` is what ``${TMP}`` stands for (give the
    client the same directory). Server tests (client_call "(a server test...") are skipped."""
    doc = load(transcript)
    start = time.monotonic()
    if str(doc.get("client_call", "")).startswith(SERVER_TEST):
        sock.close()
        return Result(str(doc.get("name", "?")), "skip", "a server test: no client produces its frames", 0.0)
    try:
        with sock:
            conn = sock
            if _listening(sock):
                sock.settimeout(timeout)
                try:
                    conn, _ = sock.accept()
                except TimeoutError:
                    raise Failure(f"no client connected within {timeout} s") from None
            with conn:
                Serve(doc, conn, tmp, timeout, schema or load_schema()).run()
        status, message = "pass", ""
    except Failure as exc:
        status, message = "fail", str(exc)
    except Skip as exc:
        status, message = "skip", str(exc)
    except OSError as exc:
        status, message = "fail", f"socket error: {exc}"
    # No xfail here: an xfail names where guestd-the-server departs from the transcript.
    return Result(str(doc.get("name", "?")), status, message, time.monotonic() - start)


def _listening(sock: socket.socket) -> bool:
    try:
        return bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
    except OSError:
        return False


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


def listen_unix(address: str) -> socket.socket:
    """A listening socket at unix:PATH (an old socket file there is replaced)."""
    kind, _, path = address.partition(":")
    if kind != "unix":
        raise SystemExit(f"--serve takes unix:PATH, not {address!r}")
    if os.path.exists(path):
        os.unlink(path)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.listen(1)
    return s


# ---------------------------------------------------------------------------- the README table

TABLE_START = "<!-- transcripts: generated by `run.py --readme` from each transcript's summary -->"
TABLE_END = "<!-- end of the generated table -->"


def readme_table(docs: Iterable[dict[str, Any]]) -> str:
    """The README's transcript table: one row per transcript, from its ``summary``."""
    rows = ["| transcript | behaviour | client side |", "|---|---|---|"]
    for doc in sorted(docs, key=lambda d: str(d.get("name"))):
        side = "server test" if str(doc.get("client_call", "")).startswith(SERVER_TEST) else "a client call"
        summary = str(doc.get("summary", "")).replace("|", "\\|")
        rows.append(f"| `{doc.get('name')}` | {summary} | {side} |")
    return "\n".join(rows)


def with_table(readme: str, table: str) -> str:
    """``readme`` with the text between the table markers replaced by ``table``."""
    head, sep, rest = readme.partition(TABLE_START)
    _, sep2, tail = rest.partition(TABLE_END)
    if not sep or not sep2:
        raise SystemExit(f"README.md lacks the markers {TABLE_START!r} ... {TABLE_END!r}")
    return f"{head}{TABLE_START}\n{table}\n{TABLE_END}{tail}"


def all_transcripts() -> list[dict[str, Any]]:
    return [load(p) for p in sorted(TRANSCRIPTS.glob("*.json"))]


# ---------------------------------------------------------------------------- the command line


def _report(results: Iterable[Result]) -> int:
    counts: dict[str, int] = {}
    for r in results:
        counts[r.status] = counts.get(r.status, 0) + 1
        print(f"{r.status.upper():5}  {r.name}  {r.seconds:.2f}s", flush=True)
        if r.message and r.status != "pass":
            print("       " + r.message.replace("\n", "\n       "), flush=True)
    print(", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    return 1 if counts.get("fail") else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "args", nargs="*", help="ADDRESS (unix:PATH or fd:N) then transcripts; with --serve, --check: transcripts"
    )
    ap.add_argument(
        "--serve", metavar="unix:PATH", help="be the fake server: a client connects here, once per transcript"
    )
    ap.add_argument("--check", action="store_true", help="check the transcripts against the schema, run nothing")
    ap.add_argument("--readme", action="store_true", help="rewrite README.md's transcript table from the summaries")
    ap.add_argument("--schema", type=Path, help="the schema (default: ../schema/v1.json next to run.py)")
    ap.add_argument(
        "--tmp", help="directory for ${TMP} (against a server: one it can write; give a guest path for a VM)"
    )
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds any step may wait (default 10)")
    ap.add_argument("--configured", action="store_true", help="the server runs with the transcripts' server_config")
    args = ap.parse_args(argv)
    if args.readme:
        README.write_text(with_table(README.read_text(), readme_table(all_transcripts())))
        print(f"rewrote the transcript table in {README}")
        return 0
    if args.check:
        schema = load_schema(args.schema)
        bad = 0
        for path in [Path(a) for a in args.args] or sorted(TRANSCRIPTS.glob("*.json")):
            errs = check_transcript(load(path), schema)
            bad += bool(errs)
            print(f"{'FAIL' if errs else 'OK':5}  {path.stem}" + "".join(f"\n       {e}" for e in errs))
        return 1 if bad else 0
    if args.serve:
        schema = load_schema(args.schema)
        paths = [Path(a) for a in args.args] or sorted(TRANSCRIPTS.glob("*.json"))
        with tempfile.TemporaryDirectory(prefix="conformance-serve-") as made:
            tmp = args.tmp or made  # ours is removed at the end; a --tmp given is the caller's
            print(f"       ${{TMP}} is {tmp}")

            def served() -> Iterable[Result]:
                for path in paths:
                    doc = load(path)
                    if not str(doc.get("client_call", "")).startswith(SERVER_TEST):
                        print(
                            f"       {path.stem}: waiting for a client on {args.serve}: {doc.get('client_call')}",
                            flush=True,
                        )
                    yield serve_transcript(doc, listen_unix(args.serve), tmp, args.timeout, schema)

            return _report(served())
    if not args.args:
        ap.error("give an ADDRESS (or --serve, --check, --readme)")
    connect = connector(args.args[0])
    paths = [Path(a) for a in args.args[1:]] or sorted(TRANSCRIPTS.glob("*.json"))
    return _report(run_transcript(p, connect, args.tmp, args.timeout, args.configured) for p in paths)


if __name__ == "__main__":
    sys.exit(main())
