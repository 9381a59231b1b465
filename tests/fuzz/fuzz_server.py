"""libFuzzer (atheris) target: the frame decoder, request validation and dispatch of a real
guestd server object, fed arbitrary bytes as one connection's input.

Process-spawning ops are denied by policy (after validation, so their argument checks are
fuzzed too) and file writes are confined to a temporary directory; everything else runs for
real. The invariant: nothing escapes data_received, and everything guestd writes back is a
well-formed frame stream.

    python tests/fuzz/fuzz_server.py -runs=20000 [-max_len=4096] [corpus_dir]
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile

import atheris

with atheris.instrument_imports():
    from guestd.config import Config
    from guestd.server.connection import Connection
    from guestd.server.daemon import Daemon
    from guestd.testing.rawwire import SinkTransport
    from guestd.wire.frames import FrameDecoder, Kind, OversizeFrame, encode_frame

# libFuzzer ends the process without atexit: a test gives a directory it removes itself.
WORK = os.environ.get("GUESTD_FUZZ_WORK") or tempfile.mkdtemp(prefix="guestd-fuzz-")
os.chdir(WORK)


loop = asyncio.new_event_loop()
asyncio.set_event_loop(loop)
cfg = Config()
cfg.policy.deny_ops = ["exec", "process.*", "shell.*", "code.*", "snapshot.*"]
cfg.policy.write_roots = [WORK]
cfg.simulate_privileged = True
cfg.runtime_dir = os.path.join(WORK, "rt")
cfg.limits.max_frame = 64 * 1024
daemon = Daemon(cfg)
HELLO = encode_frame(Kind.HELLO, 0, {"versions": [1]})


def one_input(data: bytes) -> None:
    loop.run_until_complete(serve_one(data))


async def serve_one(data: bytes) -> None:
    # Inside the loop, as asyncio calls a protocol: handlers become tasks, timers are set.
    fdp = atheris.FuzzedDataProvider(data)
    conn = Connection(daemon, "fuzz")
    sink = SinkTransport()
    conn.connection_made(sink)  # type: ignore[arg-type]
    if fdp.ConsumeBool():
        conn.data_received(HELLO)
    while fdp.remaining_bytes():
        conn.data_received(fdp.ConsumeBytes(fdp.ConsumeIntInRange(1, 512)))
        if sink.closed:
            break
        await asyncio.sleep(0)
    for _ in range(3):
        await asyncio.sleep(0)
    conn.connection_lost(None)
    await asyncio.sleep(0)
    dec = FrameDecoder(1 << 30)
    dec.feed(bytes(sink.out))
    while (frame := dec.next_frame()) is not None:  # raises on a malformed reply stream
        assert not isinstance(frame, OversizeFrame)


if __name__ == "__main__":
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
