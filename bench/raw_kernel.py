"""Floor for code contexts: jupyter_client driving a standard ipykernel directly.

Runs as a helper process on the same CPU(s) as guestd would (the driver and its
kernel share them inside a guest). Protocol on stdin/stdout, one line each:
``<tmpdir>`` first (prints ``ready``), then ``N`` -> JSON list of N `1+1` round-trip times.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import uvloop


async def run_once(kc: Any, code: str) -> None:
    """Same completion rule as guestd: the shell reply and iopub idle for this request."""
    msg_id = kc.execute(code)
    while True:
        reply = await kc.get_shell_msg(timeout=30)
        if reply["parent_header"].get("msg_id") == msg_id:
            break
    while True:
        msg = await kc.get_iopub_msg(timeout=30)
        if (
            msg["parent_header"].get("msg_id") == msg_id
            and msg["msg_type"] == "status"
            and msg["content"]["execution_state"] == "idle"
        ):
            return


async def main() -> None:
    from jupyter_client.manager import AsyncKernelManager

    tmp = sys.stdin.readline().strip()
    km = AsyncKernelManager(kernel_name="python3")
    km.transport = "ipc"
    km.ip = f"{tmp}/rawk"
    km.connection_file = f"{tmp}/rawk.json"
    await km.start_kernel()
    kc = km.client()
    kc.start_channels()
    await kc.wait_for_ready(timeout=60)
    for _ in range(3):
        await run_once(kc, "1+1")
    print("ready", flush=True)
    try:
        for line in sys.stdin:
            n = int(line)
            out = []
            for _ in range(n):
                t = time.perf_counter()
                await run_once(kc, "1+1")
                out.append(time.perf_counter() - t)
            print(json.dumps(out), flush=True)
    finally:
        kc.stop_channels()
        await km.shutdown_kernel(now=True)


if __name__ == "__main__":
    uvloop.run(main())
