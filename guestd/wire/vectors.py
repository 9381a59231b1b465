"""Golden test vectors: encoded frames with their decoded meaning.

``python -m guestd.wire.vectors`` writes ``protocol/vectors/v1.json``. The file is
checked in; tests decode every vector and re-encode it, so any change to the
bytes on the wire shows up as a diff in review. In the JSON, binary values are
written ``{"$bin": "<hex>"}``.
"""

from __future__ import annotations

import json
import struct
import sys
from typing import Any

from guestd.wire.frames import HEADER, MAGIC, Kind, encode_frame

VECTORS: list[dict[str, Any]] = [
    {
        "name": "hello_client",
        "dir": "c2s",
        "kind": "hello",
        "id": 0,
        "body": {"versions": [1], "client": "example/1.0", "max_frame": 4194304, "stream_window": 4194304},
    },
    {
        "name": "hello_server",
        "dir": "s2c",
        "kind": "hello",
        "id": 0,
        "body": {
            "version": 1,
            "server": "guestd/0.1.0",
            "capabilities": ["exec", "files", "system"],
            "ops": ["exec", "ping"],
            "limits": {"max_frame": 4194304, "max_inflight": 4096},
            "stream_window": 4194304,
            "max_frame": 4194304,
            "boot_id": "2f1c0c1e-8d3a-4c39-9f51-1b7f0d6a5e21",
            "session": "9a8b7c6d5e4f3a2b",
        },
    },
    {
        "name": "unsupported_version",
        "dir": "s2c",
        "kind": "error",
        "id": 0,
        "body": {
            "code": "unsupported_version",
            "message": "no common protocol version; server speaks [1]",
            "details": {"supported": [1]},
        },
    },
    {"name": "ping_request", "dir": "c2s", "kind": "request", "id": 1, "body": {"op": "ping", "args": {}}},
    {"name": "ping_response", "dir": "s2c", "kind": "response", "id": 1, "body": {"t_ns": 5123456789}},
    {
        "name": "exec_request",
        "dir": "c2s",
        "kind": "request",
        "id": 2,
        "body": {
            "op": "exec",
            "args": {
                "argv": ["sh", "-c", "echo hi; exit 3"],
                "cwd": "/workspace",
                "env": {"LANG": "C.UTF-8"},
                "timeout_s": 30.0,
                "max_output": 65536,
            },
        },
    },
    {
        "name": "exec_response",
        "dir": "s2c",
        "kind": "response",
        "id": 2,
        "body": {
            "exit_code": 3,
            "signal": None,
            "timed_out": None,
            "stdout": b"hi\n",
            "stderr": b"",
            "stdout_bytes": 3,
            "stderr_bytes": 0,
            "stdout_dropped": 0,
            "stderr_dropped": 0,
            "stdout_gap_at": None,
            "stderr_gap_at": None,
            "duration_s": 0.0042,
            "pid": 4242,
        },
    },
    {
        "name": "exec_timeout_truncated_response",
        "dir": "s2c",
        "kind": "response",
        "id": 3,
        "body": {
            "exit_code": None,
            "signal": 15,
            "timed_out": "wall",
            "stdout": b"99998\n99999\n",
            "stderr": b"",
            "stdout_bytes": 588895,
            "stderr_bytes": 0,
            "stdout_dropped": 588883,
            "stderr_dropped": 0,
            "stdout_gap_at": 0,
            "stderr_gap_at": None,
            "duration_s": 1.5,
            "pid": 4243,
        },
    },
    {
        "name": "exec_spawn_failed",
        "dir": "s2c",
        "kind": "error",
        "id": 4,
        "body": {
            "code": "not_found",
            "message": "No such file or directory: /nonexistent",
            "errno": 2,
            "details": {"stage": "spawn", "argv0": "/nonexistent"},
        },
    },
    {
        "name": "exec_stream_request",
        "dir": "c2s",
        "kind": "request",
        "id": 5,
        "body": {"op": "exec", "args": {"shell": "cat", "stream": True, "stdin_stream": True}},
    },
    {"name": "exec_started_event", "dir": "s2c", "kind": "event", "id": 5, "body": {"ev": "started", "pid": 4244}},
    {"name": "stdin_input", "dir": "c2s", "kind": "input", "id": 5, "body": {"data": b"hello\n"}},
    {"name": "stdin_eof", "dir": "c2s", "kind": "input", "id": 5, "body": {"eof": True}},
    {"name": "signal_input", "dir": "c2s", "kind": "input", "id": 5, "body": {"signal": "TERM"}},
    {"name": "stdout_event", "dir": "s2c", "kind": "event", "id": 5, "body": {"ev": "stdout", "data": b"hello\n"}},
    {"name": "window_grant", "dir": "c2s", "kind": "window", "id": 5, "body": {"bytes": 6}},
    {"name": "cancel", "dir": "c2s", "kind": "cancel", "id": 5, "body": {}},
    {
        "name": "cancelled_error",
        "dir": "s2c",
        "kind": "error",
        "id": 5,
        "body": {"code": "cancelled", "message": "request cancelled"},
    },
    {
        "name": "file_write_request",
        "dir": "c2s",
        "kind": "request",
        "id": 6,
        "body": {
            "op": "file.write",
            "args": {"path": "/workspace/a.bin", "data": b"\x00\x01\x02\xff", "parents": True},
        },
    },
    {"name": "file_write_response", "dir": "s2c", "kind": "response", "id": 6, "body": {"size": 4}},
    {
        "name": "too_large_error",
        "dir": "s2c",
        "kind": "error",
        "id": 7,
        "body": {
            "code": "too_large",
            "message": "frame of 4194314 bytes exceeds max_frame 4194304",
            "details": {"limit": "max_frame", "value": 4194314},
        },
    },
    {
        "name": "hello_client_with_token_and_clock",
        "dir": "c2s",
        "kind": "hello",
        "id": 0,
        "body": {
            "versions": [1],
            "client": "example/1.0",
            "max_frame": 65536,
            "stream_window": 65536,
            "token": "s3cret",
            "time_ns": 1764567000123456789,
        },
    },
    {
        "name": "file_upload_request",
        "dir": "c2s",
        "kind": "request",
        "id": 10,
        "body": {"op": "file.upload", "args": {"path": "/workspace/a.bin", "size": 5}},
    },
    {"name": "upload_data_input", "dir": "c2s", "kind": "input", "id": 10, "body": {"data": b"abc"}},
    {"name": "upload_last_data_and_eof", "dir": "c2s", "kind": "input", "id": 10, "body": {"data": b"de", "eof": True}},
    {"name": "server_window_grant", "dir": "s2c", "kind": "window", "id": 10, "body": {"bytes": 3}},
    {"name": "file_upload_response", "dir": "s2c", "kind": "response", "id": 10, "body": {"size": 5}},
    {
        "name": "file_download_request",
        "dir": "c2s",
        "kind": "request",
        "id": 11,
        "body": {"op": "file.download", "args": {"path": "/workspace/a.bin"}},
    },
    {"name": "download_start_event", "dir": "s2c", "kind": "event", "id": 11, "body": {"ev": "start", "size": 5}},
    {"name": "download_data_event", "dir": "s2c", "kind": "event", "id": 11, "body": {"ev": "data", "data": b"abcde"}},
    {"name": "file_download_response", "dir": "s2c", "kind": "response", "id": 11, "body": {"bytes": 5, "size": 5}},
    {
        "name": "input_beyond_credit_error",
        "dir": "s2c",
        "kind": "error",
        "id": 10,
        "body": {
            "code": "limit",
            "message": "client sent input beyond its credit",
            "details": {"limit": "stream_window", "over": 1},
        },
    },
    {
        "name": "duplicate_id_error",
        "dir": "s2c",
        "kind": "error",
        "id": 0,
        "body": {
            "code": "protocol_error",
            "message": "request id 11 is already in flight",
            "details": {"field": "id", "reason": "in_flight"},
        },
    },
    {
        "name": "malformed_window_error",
        "dir": "s2c",
        "kind": "error",
        "id": 5,
        "body": {
            "code": "bad_request",
            "message": "bad window frame: field 'bytes' must be >= 0",
            "details": {"field": "bytes"},
        },
    },
    {
        "name": "limit_error",
        "dir": "s2c",
        "kind": "error",
        "id": 2,
        "body": {
            "code": "limit",
            "message": "timeout_s may be at most 604800 (limits.max_exec_timeout_s)",
            "details": {"limit": "max_exec_timeout_s", "value": 604800.0, "field": "timeout_s"},
        },
    },
    {
        "name": "request_id_zero_error",
        "dir": "s2c",
        "kind": "error",
        "id": 0,
        "body": {
            "code": "protocol_error",
            "message": "request id 0 is reserved",
            "details": {"field": "id", "reason": "reserved"},
        },
    },
    {
        "name": "port_connect_request",
        "dir": "c2s",
        "kind": "request",
        "id": 12,
        "body": {"op": "port.connect", "args": {"port": 8080}},
    },
    {"name": "port_connected_event", "dir": "s2c", "kind": "event", "id": 12, "body": {"ev": "connected"}},
    {
        "name": "port_input_data_and_eof",
        "dir": "c2s",
        "kind": "input",
        "id": 12,
        "body": {"data": b"GET /", "eof": True},
    },
    {
        "name": "port_data_event",
        "dir": "s2c",
        "kind": "event",
        "id": 12,
        "body": {"ev": "data", "data": b"HTTP/1.0 200"},
    },
    {"name": "port_eof_event", "dir": "s2c", "kind": "event", "id": 12, "body": {"ev": "eof"}},
    {"name": "port_relay_response", "dir": "s2c", "kind": "response", "id": 12, "body": {"sent": 5, "received": 12}},
    {
        "name": "port_refused_error",
        "dir": "s2c",
        "kind": "error",
        "id": 13,
        "body": {
            "code": "unavailable",
            "message": "nothing listens on 127.0.0.1:8081 in the guest (connection refused)",
            "errno": 111,
            "details": {"stage": "connect", "reason": "refused"},
        },
    },
    {"name": "id_at_maximum", "dir": "c2s", "kind": "request", "id": 0xFFFFFFFF, "body": {"op": "ping", "args": {}}},
]


def _float32_request() -> bytes:
    """exec {argv: [true], timeout_s: 5.0} with the float as msgpack float32 (0xca 40a00000)."""
    args = b"\x82" + _str("argv") + b"\x91" + _str("true") + _str("timeout_s") + b"\xca" + struct.pack(">f", 5.0)
    payload = b"\x82" + _str("op") + _str("exec") + _str("args") + args
    return HEADER.pack(MAGIC, 1, Kind.REQUEST, len(payload), 14) + payload


def _str(text: str) -> bytes:
    raw = text.encode()
    return bytes([0xA0 | len(raw)]) + raw  # fixstr: these are all under 32 bytes


# Frames a receiver must accept that guestd's own encoder never writes (it sends float64):
# decoding them must give the body, re-encoding gives other bytes.
ACCEPTED: list[dict[str, Any]] = [
    {
        "name": "float32_for_a_float_field",
        "dir": "c2s",
        "kind": "request",
        "id": 14,
        "hex": _float32_request().hex(),
        "body": {"op": "exec", "args": {"argv": ["true"], "timeout_s": 5.0}},
        "note": "float32 is accepted wherever a float is allowed (PROTOCOL.md 2.3)",
    },
]

# Byte strings that are not valid frames, and what a decoder must do with them.
BAD_STREAMS: list[dict[str, Any]] = [
    {"name": "bad_magic", "hex": b"HTTP/1.1 200 OK\r\n".hex(), "expect": "framing_error"},
    {"name": "bad_frame_version", "hex": (MAGIC + bytes([9, 2]) + bytes(8)).hex(), "expect": "framing_error"},
    {
        "name": "oversize_request_header",
        "hex": HEADER.pack(MAGIC, 1, Kind.REQUEST, 4194305, 7).hex(),
        "expect": "oversize",
        "max_frame": 4194304,
        "id": 7,
        "length": 4194305,
    },
    {
        "name": "payload_not_a_map",
        "hex": (HEADER.pack(MAGIC, 1, Kind.REQUEST, 1, 8) + b"\x90").hex(),
        "expect": "bad_request",
        "id": 8,
    },
    {
        "name": "str_not_utf8",
        "hex": (
            HEADER.pack(MAGIC, 1, Kind.REQUEST, 28, 10)
            + b"\x82"
            + _str("op")
            + _str("file.read")
            + _str("args")
            + b"\x81"
            + _str("path")
            + b"\xa2\xff\xfe"
        ).hex(),
        "expect": "bad_request",
        "id": 10,
        "details": {"reason": "invalid_utf8", "field": "args.path"},
        "note": "the request's error names the arg: details {reason: invalid_utf8, field: path}",
    },
    {
        "name": "payload_not_msgpack",
        "hex": (HEADER.pack(MAGIC, 1, Kind.REQUEST, 1, 9) + b"\xc1").hex(),
        "expect": "bad_request",
        "id": 9,
    },
]


def to_json_value(v: Any) -> Any:
    if isinstance(v, bytes):
        return {"$bin": v.hex()}
    if isinstance(v, dict):
        return {k: to_json_value(x) for k, x in v.items()}
    if isinstance(v, list):
        return [to_json_value(x) for x in v]
    return v


def from_json_value(v: Any) -> Any:
    if isinstance(v, dict):
        if set(v) == {"$bin"}:
            return bytes.fromhex(v["$bin"])
        return {k: from_json_value(x) for k, x in v.items()}
    if isinstance(v, list):
        return [from_json_value(x) for x in v]
    return v


def document() -> dict[str, Any]:
    frames = []
    for v in VECTORS:
        kind = Kind[v["kind"].upper()]
        frames.append({**v, "body": to_json_value(v["body"]), "hex": encode_frame(kind, v["id"], v["body"]).hex()})
    return {
        "protocol_version": 1,
        "notes": "hex = header + msgpack payload, encoded with map keys in the order listed. Key order is not "
        "significant to receivers; a decoder must accept every vector, an encoder that keeps this order must "
        'reproduce the bytes. Binary values are {"$bin": hex}.',
        "frames": frames,
        "accepted": [{**v, "body": to_json_value(v["body"])} for v in ACCEPTED],
        "bad_streams": BAD_STREAMS,
    }


if __name__ == "__main__":
    sys.stdout.write(json.dumps(document(), indent=1) + "\n")
