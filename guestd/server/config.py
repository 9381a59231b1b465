"""Daemon configuration and limits. Every limit is reported in the handshake and ``info``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from guestd.wire.frames import DEFAULT_MAX_FRAME

DEFAULT_VSOCK_PORT = 10_700  # documented in PROTOCOL.md; any free port works
HOST_CID = 2


@dataclass
class Limits:
    max_frame: int = DEFAULT_MAX_FRAME  # payload bytes, both directions
    max_inflight: int = 4096  # requests in flight per connection
    max_connections: int = 256
    stream_window: int = 4 * 1024 * 1024  # initial credit per stream, bytes
    max_chunk: int = 1024 * 1024  # bytes per data EVENT / INPUT
    max_output: int = 1024 * 1024  # bytes kept per stream by exec capture
    max_read: int = 2 * 1024 * 1024  # bytes per file.read reply
    max_list_entries: int = 20_000
    max_exec_timeout_s: float = 7 * 24 * 3600.0
    max_contexts: int = 8  # live code contexts (one kernel process each)
    max_processes: int = 64  # live background processes
    max_kept_processes: int = 256  # background processes kept, finished ones included
    max_ring_bytes: int = 16 * 1024 * 1024  # output ring per stream of a background process
    max_shells: int = 16  # persistent shell sessions
    max_code_queue: int = 16  # runs waiting per context

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Config:
    listen: list[str] = field(default_factory=list)
    allowed_cids: set[int] = field(default_factory=lambda: {HOST_CID})
    limits: Limits = field(default_factory=Limits)
    io_threads: int = 8  # blocking file I/O runs here, never on the event loop
    use_uvloop: bool = True
    runtime_dir: str = ""  # private state (kernel connection files); default /run/guestd or a temp dir
    code_pool: int = 1  # pre-started kernels kept ready; 0 disables
    code_prewarm: bool = False  # fill the pool at start-up instead of on first use
    process_retention_s: float = 3600.0  # how long a finished background process stays attachable
