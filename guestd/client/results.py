"""Typed results returned by the client."""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ExecResult:
    exit_code: int | None
    signal: int | None
    timed_out: str | None  # "wall" | "idle" | None
    stdout: bytes
    stderr: bytes
    stdout_bytes: int
    stderr_bytes: int
    stdout_dropped: int
    stderr_dropped: int
    stdout_gap_at: int | None
    stderr_gap_at: int | None
    duration_s: float
    pid: int

    @classmethod
    def from_body(cls, b: dict[str, Any]) -> ExecResult:
        return cls(**{k: b[k] for k in cls.__dataclass_fields__})

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.timed_out is None

    @property
    def truncated(self) -> bool:
        return bool(self.stdout_dropped or self.stderr_dropped)

    @property
    def text(self) -> str:
        return self.stdout.decode("utf-8", "replace")

    def shell_exit_code(self) -> int:
        """Exit code as a shell reports it: 124 on timeout, 128+N when killed by signal N."""
        if self.timed_out is not None:
            return 124
        if self.signal is not None:
            return 128 + self.signal
        return self.exit_code if self.exit_code is not None else 1

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k in self.__dataclass_fields__:
            v = getattr(self, k)
            if isinstance(v, bytes):
                try:
                    out[k] = v.decode("utf-8")
                except UnicodeDecodeError:
                    out[k] = v.decode("utf-8", "replace")
                    out[f"{k}_base64"] = base64.b64encode(v).decode()
            else:
                out[k] = v
        return out


@dataclass(frozen=True)
class FileStat:
    type: str
    size: int
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    target: str | None = None

    @classmethod
    def from_body(cls, b: dict[str, Any]) -> FileStat:
        return cls(b["type"], b["size"], b["mode"], b["uid"], b["gid"], b["mtime_ns"], b.get("target"))


@dataclass(frozen=True)
class DirEntry:
    name: str
    type: str
    size: int
    mode: int
    mtime_ns: int


@dataclass(frozen=True)
class DirListing:
    entries: list[DirEntry]
    truncated: bool


@dataclass(frozen=True)
class Info:
    version: str
    protocol_version: int
    capabilities: list[str]
    boot_id: str
    uptime_s: float
    raw: dict[str, Any] = field(repr=False)
