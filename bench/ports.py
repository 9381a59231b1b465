"""port.list at scale (issue 29, defect 11): how long one read of the socket tables and the owner
search take with many listeners and many connections, and how much memory they hold.

    .venv/bin/python -m bench.ports --listeners 5000 --connections 50000

Runs itself in a private network namespace (``unshare -n``, root): this process opens the
listeners (127.0.0.1, consecutive ports) and the connected pairs (each pair is two rows of
/proc/net/tcp), then times ``guestd.ports.listeners.scan`` and ``describe``, and with
``--old DIR`` the same functions of an older copy (a directory holding its ``listeners.py``
and ``tcp_table.py``) for a before/after row."""

from __future__ import annotations

import argparse
import importlib
import os
import resource
import shutil
import socket
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

PAIRS_PER_PROCESS = 8000  # 16,000 fds: under a hard RLIMIT_NOFILE of 20,000


def _raise_nofile(want: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if want > hard:
        sys.exit(f"needs {want} fds in one process; the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))


def _pairs_in_a_child(pairs: int) -> int:
    """A forked process holding ``pairs`` connected pairs until this one ends; returns its pid."""
    parent = os.getpid()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(ready_w)
        if os.read(ready_r, 1) != b"x":
            sys.exit("a process holding connections failed")
        os.close(ready_r)
        return pid
    try:
        os.close(ready_r)
        _raise_nofile(2 * pairs + 64)
        server = socket.socket()
        server.bind(("127.0.0.1", 0))
        server.listen(4096)
        held = []
        for _ in range(pairs):
            c = socket.socket()
            c.connect(server.getsockname())
            a, _ = server.accept()
            held += [c, a]
        os.write(ready_w, b"x")
        while os.getppid() == parent:
            time.sleep(0.2)
    finally:
        os._exit(0)


def _open(listeners: int, connections: int, first_port: int) -> list[socket.socket]:
    while connections > 0:  # first: a forked process must not inherit the listeners' fds
        _pairs_in_a_child(min(connections, PAIRS_PER_PROCESS))
        connections -= PAIRS_PER_PROCESS
    _raise_nofile(listeners + 1024)
    held = []
    for i in range(listeners):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", first_port + i))
        s.listen(8)
        held.append(s)
    return held


def _timed(label: str, fn: Callable[[], Any], runs: int) -> Any:
    result = None
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    tracemalloc.start()
    fn()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(f"| {label} | {best * 1000:.1f} | {peak / 1e6:.1f} |", flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--listeners", type=int, default=5000)
    ap.add_argument("--connections", type=int, default=50000)
    ap.add_argument("--first-port", type=int, default=55001)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--old", default=None, help="a directory with an older listeners.py and tcp_table.py")
    ap.add_argument("--in-netns", action="store_true", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if not ns.in_netns:
        if os.geteuid() != 0 or shutil.which("unshare") is None:
            sys.exit("needs root and unshare (a private network namespace)")
        netns = [
            "unshare",
            "-n",
            "sh",
            "-c",
            'ip link set lo up && sysctl -qw net.ipv4.ip_local_port_range="10000 50000" && exec "$@"',
            "sh",
        ]
        sys.exit(subprocess.run([*netns, sys.executable, "-m", "bench.ports", *sys.argv[1:], "--in-netns"]).returncode)
    held = _open(ns.listeners, ns.connections, ns.first_port)
    rows = 0
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(path) as f:
            rows += sum(1 for _ in f) - 1
    print(f"{ns.listeners} listeners, {ns.connections} connected pairs: {rows} rows in /proc/net/tcp{{,6}}\n")
    print("| step | best ms | peak MB (tracemalloc) |\n|---|---|---|")
    from guestd.ports import listeners

    listing = _timed("scan (new)", listeners.scan, ns.runs)
    _, searched_all = _timed("describe (new: owner search + records)", lambda: listeners.describe(listing), ns.runs)
    print(
        f"\nnew: total {listing.total}, listed {len(listing.sockets)}, truncated {listing.truncated}, "
        f"owners_truncated {not searched_all}"
    )
    if ns.old:
        sys.path.insert(0, ns.old)
        old = importlib.import_module("old_listeners")
        found = _timed("scan (old)", old.scan, ns.runs)
        _timed("describe (old)", lambda: old.describe(found), ns.runs)
        print(f"old: listed {len(old.describe(found))} of {len(found)} (no total, no flag)")
    for s in held:
        s.close()


if __name__ == "__main__":
    main()
