"""Runs inside the QEMU guest (bench/guest.py writes it there and runs it as root with
/usr/local/bin/guestd-python): first the start to first reply, idle round trip and idle RSS of a
guestd with the shipped-like config against the floor server's (bench/floor_server.py, on the
same Python), in interleaved rounds; then exec ``true`` through a guestd with the shipped-like config, a
guestd without workload settings and the ``subprocess.run`` floor, in the same interleaved rounds,
then ping latency while N clients loop ``exec true`` against each guestd, then ``snapshot.restore``
with N live code contexts on the guestd without workload settings (its privileged steps real: the
guest's CRNG re-seeded, each kernel re-seeded). Prints one JSON object.

    guestd-python guest_probe.py '{"rounds": 5, "n_exec": 20, "loops": 16, "pings": 100,
                                   "restore_contexts": 8, "restores": 20, "start_config": "/tmp/gstart.toml",
                                   "start_rounds": 7, "start_pings": 30,
                                   "daemons": {"shipped": "/tmp/gship.toml", "plain": "/tmp/gplain.toml"}}'

Measured from inside the guest, so the virtio-serial link to the host is not in the figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import platform
import subprocess
import sys
import time
import tomllib
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from guestd.client import AsyncClient

GUESTD = "/usr/local/bin/guestd"
GUEST_PYTHON = "/usr/local/bin/guestd-python"  # guestd's own Python: the floor runs on it too
FLOOR_DIR = "/tmp/bench-floor"  # bench/floor_server.py and floor_client.py, written by bench/guest.py
# The test image's own guestd runs this script in its workload cgroup (cpu.weight 1, pids.max
# 256); in production guestd runs outside the workload at weight 100. The daemons under test are
# started from a sibling cgroup at the default weight, so they meet their workload as they would.
DAEMONS_CGROUP = "/sys/fs/cgroup/gbench-daemons"
CPUS = sorted(os.sched_getaffinity(0))
CLIENT_CPUS = {CPUS[0]} if len(CPUS) >= 2 else set(CPUS)
SERVER_CPUS = {CPUS[1]} if len(CPUS) >= 2 else set(CPUS)


def log(msg: str) -> None:
    print(f"[probe {time.monotonic():.1f}] {msg}", file=sys.stderr, flush=True)


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))]


def summary_ms(xs: list[float]) -> dict[str, float]:
    return {"p50_ms": pct(xs, 50) * 1000, "p99_ms": pct(xs, 99) * 1000, "max_ms": max(xs) * 1000, "n": len(xs)}


def leave_workload_cgroup() -> str:
    os.makedirs(DAEMONS_CGROUP, exist_ok=True)
    with open(os.path.join(DAEMONS_CGROUP, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
    with open("/proc/self/cgroup") as f:
        return f.read().strip()


def start_daemons(configs: dict[str, str]) -> dict[str, subprocess.Popen[bytes]]:
    """Start each guestd on the server CPU (they inherit it, and so do their children)."""
    os.sched_setaffinity(0, SERVER_CPUS)
    try:
        return {
            name: subprocess.Popen(
                [GUESTD, "--config", path, "--log-level", "WARNING"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=open(f"/tmp/{name}.log", "wb"),  # the daemon's for its life
            )
            for name, path in configs.items()
        }
    finally:
        os.sched_setaffinity(0, CLIENT_CPUS)


async def connect(address: str, proc: subprocess.Popen[bytes], name: str) -> AsyncClient:
    deadline = time.monotonic() + 180
    while True:
        if proc.poll() is not None:
            with open(f"/tmp/{name}.log", errors="replace") as f:
                raise RuntimeError(f"guestd {name} exited {proc.returncode}: {f.read()[-2000:]}")
        try:
            return await AsyncClient.connect(address, connect_timeout=5)
        except (OSError, ConnectionError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def timed(fn: Callable[[], Awaitable[Any]], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - t)
    return out


async def run_true() -> None:
    subprocess.run(["true"], check=True)


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


async def first_reply_and_idle(argv: list[str], sock: str, floor: bool, pings: int) -> dict[str, Any]:
    """Spawn a server on the server CPU, time spawn -> the first reply to a ping (a hello first
    for guestd, as the host bench does), then ``pings`` round trips, then its RSS after a second
    idle."""
    from floor_client import FloorClient  # type: ignore[import-not-found]  # beside the floor server

    with contextlib.suppress(FileNotFoundError):
        os.unlink(sock)
    os.sched_setaffinity(0, SERVER_CPUS)
    try:
        t0 = time.perf_counter()
        p = subprocess.Popen(argv, cwd=FLOOR_DIR, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    finally:
        os.sched_setaffinity(0, CLIENT_CPUS)
    try:
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + 180
        while True:
            try:
                if floor:
                    _, fc = await loop.create_unix_connection(FloorClient, sock)
                    ping: Callable[[], Awaitable[Any]] = functools.partial(fc.call, {"op": "ping", "id": 1})
                else:
                    c = await AsyncClient.connect(f"unix:{sock}", connect_timeout=30)
                    ping = c.ping
                await ping()
                break
            except (OSError, ConnectionError):
                if p.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{argv} exited {p.returncode} or never answered") from None
                await asyncio.sleep(0.002)
        first = time.perf_counter() - t0
        rtt = await timed(ping, pings)
        await asyncio.sleep(1.0)
        rss = rss_kib(p.pid)
        if floor:
            fc.transport.close()
        else:
            await c.close()
        return {"first_s": first, "rtt": rtt, "rss_kib": rss}
    finally:
        p.terminate()
        p.wait(60)


async def starts(config: str, rounds: int, pings: int) -> dict[str, Any]:
    """The floor server and guestd with ``config`` (its socket the config's), interleaved in
    ``rounds``: start to first reply, the idle round trip, idle RSS. The floor runs from its
    byte-compiled module on guestd's own Python, as guestd's modules are compiled in the image."""
    import py_compile

    py_compile.compile(os.path.join(FLOOR_DIR, "floor_server.py"), doraise=True)
    py_compile.compile(os.path.join(FLOOR_DIR, "floor_client.py"), doraise=True)
    sys.path.insert(0, FLOOR_DIR)
    with open(config, "rb") as f:
        sock = tomllib.load(f)["listen"][0].removeprefix("unix:")
    kinds = {
        "floor": ([GUEST_PYTHON, "-m", "floor_server", "/run/gfloor.sock"], "/run/gfloor.sock", True),
        "shipped": ([GUESTD, "--config", config, "--log-level", "WARNING"], sock, False),
    }
    got: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
    for r in range(rounds):
        for kind, (argv, path, floor) in kinds.items():
            got[kind].append(await first_reply_and_idle(argv, path, floor, pings))
        log(
            f"start round {r + 1}/{rounds}: "
            + ", ".join(f"{k} {v[-1]['first_s'] * 1000:.0f} ms" for k, v in got.items())
        )
    return {
        kind: {
            "first_reply": summary_ms([x["first_s"] for x in xs]),
            "ping": summary_ms([t for x in xs for t in x["rtt"]]),
            "idle_rss_kib": sorted(x["rss_kib"] for x in xs)[len(xs) // 2],
        }
        for kind, xs in got.items()
    }


async def ping_under_exec_load(address: str, pinger: AsyncClient, loops: int, pings: int) -> dict[str, Any]:
    """``loops`` clients, each its own connection, loop ``exec true`` while ``pinger`` pings back
    to back (``pings`` times, or 120 s, whichever ends first)."""
    conns = [await AsyncClient.connect(address, connect_timeout=30) for _ in range(loops)]
    stop = asyncio.Event()
    done = 0

    async def loop_exec(c: AsyncClient) -> None:
        nonlocal done
        while not stop.is_set():
            await c.exec(["true"], deadline=300)
            done += 1

    tasks = [asyncio.ensure_future(loop_exec(c)) for c in conns]
    await asyncio.sleep(2.0)  # every loop has spawned at least once
    t0, d0 = time.perf_counter(), done
    samples: list[float] = []
    end = time.monotonic() + 120
    while len(samples) < pings and time.monotonic() < end:
        t = time.perf_counter()
        await pinger.ping(deadline=60)
        samples.append(time.perf_counter() - t)
    rate = (done - d0) / (time.perf_counter() - t0)
    stop.set()
    await asyncio.gather(*tasks)
    for c in conns:
        await c.close()
    return {"clients": loops, "execs_per_s": rate, "ping_under_load": summary_ms(samples)}


async def restore_with_contexts(c: AsyncClient, contexts: int, restores: int) -> dict[str, Any]:
    """``restores`` restores with ``contexts`` live code contexts: the round trip, guestd's own
    duration (``duration_s``) and the re-seeding part of it (``workloads_ms``)."""
    ids = []
    t = time.monotonic()
    for _ in range(contexts):
        ids.append((await c.code_create(deadline=600)).id)
    log(f"{contexts} contexts up in {time.monotonic() - t:.0f} s")
    rtt, in_guest, reseeding = [], [], []
    try:
        for _ in range(restores):
            t0 = time.perf_counter()
            rep = await c.restore(entropy=os.urandom(64))
            rtt.append(time.perf_counter() - t0)
            in_guest.append(rep.duration_s)
            reseeding.append(rep.workloads_ms / 1000)
            if len(rep.contexts_reseeded) != contexts:
                raise RuntimeError(f"{len(rep.contexts_reseeded)} of {contexts} contexts re-seeded: {rep}")
    finally:
        for ctx_id in ids:
            with contextlib.suppress(Exception):
                await c.code_close(ctx_id)
    return {
        "contexts": contexts,
        "rtt": summary_ms(rtt),
        "in_guest": summary_ms(in_guest),
        "reseeding": summary_ms(reseeding),
    }


async def measure(params: dict[str, Any]) -> dict[str, Any]:
    configs: dict[str, str] = params["daemons"]
    rounds, n_exec = int(params["rounds"]), int(params["n_exec"])
    out: dict[str, Any] = {"daemons": {}}
    if params.get("start_config"):  # first, before the other daemons run
        out["starts"] = await starts(params["start_config"], int(params["start_rounds"]), int(params["start_pings"]))
    procs = start_daemons(configs)
    clients: dict[str, AsyncClient] = {}
    try:
        addresses = {}
        for name, path in configs.items():
            with open(path, "rb") as f:
                addresses[name] = tomllib.load(f)["listen"][0]
            clients[name] = await connect(addresses[name], procs[name], name)
            info = (await clients[name].info()).raw
            out["daemons"][name] = {
                "config": read(path),
                "spawn": info.get("spawn"),
                "workload_cgroup": info.get("workload_cgroup"),
                "cgroup": read(f"/proc/{procs[name].pid}/cgroup").strip(),
            }
        log("daemons up: " + ", ".join(f"{k} spawn={v['spawn']}" for k, v in out["daemons"].items()))
        for c in clients.values():  # warm-up: first spawns, page cache, the spawn pool's threads
            await timed(functools.partial(c.exec, ["true"]), 5)
            await timed(c.ping, 20)
        await timed(run_true, 5)
        samples: dict[str, list[float]] = {"floor": [], **{name: [] for name in clients}}
        idle: dict[str, list[float]] = {name: [] for name in clients}
        for r in range(rounds):
            samples["floor"] += await timed(run_true, n_exec)
            for name, c in clients.items():
                samples[name] += await timed(functools.partial(c.exec, ["true"]), n_exec)
                idle[name] += await timed(c.ping, n_exec)
            log(f"round {r + 1}/{rounds}")
        out["exec_true"] = {name: summary_ms(xs) for name, xs in samples.items()}
        out["ping_idle"] = {name: summary_ms(xs) for name, xs in idle.items()}
        out["load"] = {}
        for name, c in clients.items():
            out["load"][name] = await ping_under_exec_load(
                addresses[name], c, int(params["loops"]), int(params["pings"])
            )
            log(f"load {name}: {out['load'][name]}")
        if int(params.get("restore_contexts", 0)) > 0 and "plain" in clients:  # last: it drops other connections
            out["restore"] = await restore_with_contexts(
                clients["plain"], int(params["restore_contexts"]), int(params.get("restores", 10))
            )
            log(f"restore: {out['restore']}")
    finally:
        for c in clients.values():
            with contextlib.suppress(Exception):
                await c.close()
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    return out


def run_loop(main: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
    """uvloop, as guestd and the host bench use, when the image has it."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def main() -> None:
    params = json.loads(sys.argv[1])
    moved_to = leave_workload_cgroup()
    os.sched_setaffinity(0, CLIENT_CPUS)
    res = run_loop(measure(params))
    with open("/proc/mounts") as f:
        cgroup2 = [ln.strip() for ln in f if ln.split()[2:3] == ["cgroup2"]]
    res["guest"] = {
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "client_cpus": sorted(CLIENT_CPUS),
        "server_cpus": sorted(SERVER_CPUS),
        "cgroup2_mount": cgroup2,
        "probe_cgroup": moved_to,
        "python": platform.python_version(),
    }
    print(json.dumps(res))


if __name__ == "__main__":
    main()
