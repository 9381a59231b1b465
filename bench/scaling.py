"""How guestd's cost grows with the work (issue 34), each point against a floor from the same run.

    .venv/bin/python -m bench.scaling [--quick] [--keep]

Four curves, each on a guestd of its own (``--listen unix:`` only, pinned to the server CPU as in
bench/run.py, limits raised so that every point fits):

- **clients**: N clients (1, 16, 64, 256) loop ``exec true`` from a load process of their own;
  a third client measures ping p99 meanwhile. exec p50 is what the N clients see; its floor is
  N threads looping ``subprocess.run(['true'])`` in a process pinned where guestd is. ping's
  floor is the idle p99 of a uvloop + msgpack echo (bench/floor_server.py); the echo's p99
  while the floor's threads spawn is shown beside it.
- **background processes**: 10, 100, 1,000 live ``sleep`` runs (``process.start``): idle ping
  p99 and exec ``true`` p50, the echo and ``subprocess.run`` measured in the same state.
- **memory**: guestd's own RSS (never its children's) with 1, 10, 100 shells, kept runs and
  watches, and 1 and 10 code contexts (kernels of ~60-100 MB and ~1 s each: 100 would hold
  6-10 GB of a 24 GiB machine and take minutes to start on 2 cores, so it is left out; what a
  context costs guestd itself is its table entry and channels, linear in 1 -> 10 already).
- **files**: ``file.glob``, ``file.grep``, ``tree.download`` and the watcher's first scan
  (``file.watch`` until ``ready``) on trees of 10k, 100k and 1M small files (--quick: up to
  100k), against ``find -name``, ``rg`` run directly with guestd's printer, ``tar -c | socket |
  cat`` and ``os.walk``; best of the rounds, interleaved.

Trees are made once under /tmp/guestd-bench-scaling (a marker file says a tree is whole) and
removed at the end unless ``--keep``. Writes bench/out/scaling.json, the section between
``<!-- scaling:begin -->`` and ``<!-- scaling:end -->`` of bench/RESULTS.md (appended when
absent) and bench/charts/scaling.png (with bench/.peers-venv's matplotlib, as bench/charts.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any

import psutil
import uvloop

from bench.floor_client import FloorClient
from bench.run import (
    CLIENT_CPUS,
    HERE,
    SERVER_CPUS,
    MiB,
    Proc,
    guestd_argv,
    pct,
    peak_rss,
    pin_all_threads,
    pin_servers,
    summary_ms,
    time_loop,
)
from bench.sections import markers, write_section
from bench.trees import tar_through_socket
from guestd.client import AsyncClient
from guestd.files.search import GrepQuery, rg_command

CLIENTS = (1, 16, 64, 256)
BACKGROUND = (10, 100, 1_000)
HELD = (1, 10, 100)
CONTEXTS = (1, 10)
TREES = (10_000, 100_000, 1_000_000)
QUICK_TREES = (10_000, 100_000)
TREE_TOP = "/tmp/guestd-bench-scaling"
TREE_LAYOUT = "v1: 100 files per directory, 100 directories per top directory; .py every 100th, needle every 1000th"
FILES_PER_DIR = 100
KEPT_RUN_COMMAND = "seq 1 2000"  # 8.9 KB of output kept per run
RESULTS_MD = os.path.join(HERE, "RESULTS.md")
SCALING_JSON = os.path.join(HERE, "out", "scaling.json")
CHART_DIR = os.path.join(HERE, "charts")
BEGIN, END = markers("scaling")


@dataclass(frozen=True)
class Plan:
    """How much each point samples: --quick is a smoke run, the full one the figures to quote."""

    window_s: float  # load window of one concurrency point
    least_pings: int  # pings per point, at least
    n_exec: int  # execs per idle point
    file_rounds: int  # interleaved rounds of the file operations (best of them)
    trees: tuple[int, ...]


QUICK = Plan(window_s=2.0, least_pings=300, n_exec=60, file_rounds=3, trees=QUICK_TREES)
FULL = Plan(window_s=5.0, least_pings=1000, n_exec=200, file_rounds=3, trees=TREES)


def config_text(workspace: str) -> str:
    """Limits raised so that every point of every curve fits (256 clients and a probe, 1,000
    background processes, 100 shells, kept runs and watches, 10 contexts)."""
    return (
        f'workspace = "{workspace}"\n'
        "[limits]\n"
        "max_connections = 320\n"
        "max_processes = 1100\n"
        "max_kept_processes = 1100\n"
        "max_kept_runs = 128\n"
        "max_shells = 128\n"
        "max_contexts = 12\n"
    )


@contextmanager
def guestd(tmp: str, name: str) -> Iterator[tuple[Proc, str]]:
    """A guestd of its own for one curve (its socket, runtime dir and workspace under ``tmp``),
    pinned to the server CPU; stopped, with every child it still has, on the way out."""
    ws = f"{tmp}/ws-{name}"
    os.makedirs(ws, exist_ok=True)
    os.chmod(ws, 0o755)
    config = f"{tmp}/{name}.toml"
    with open(config, "w") as f:
        f.write(config_text(ws))
    sock = f"{tmp}/{name}.sock"
    argv = [*guestd_argv(sock), "--config", config, "--runtime-dir", f"{tmp}/rt-{name}", "--code-pool", "0"]
    proc = Proc(argv, ready_via_fd=True)
    try:
        yield proc, f"unix:{sock}"
    finally:
        stop_with_children(proc)


def stop_with_children(proc: Proc) -> None:
    """guestd ends its children at its stop; anything it left behind is ended here, by pid."""
    try:
        left = proc.ps.children(recursive=True)
    except psutil.Error:
        left = []
    proc.stop()
    for child in left:
        try:
            child.kill()
        except psutil.Error:
            pass


@contextmanager
def echo_floor(tmp: str) -> Iterator[Proc]:
    proc = Proc([sys.executable, os.path.join(HERE, "floor_server.py"), f"{tmp}/floor.sock"], ready_via_fd=False)
    try:
        yield proc
    finally:
        proc.stop()


async def echo_client(tmp: str) -> FloorClient:
    _, fc = await asyncio.get_running_loop().create_unix_connection(FloorClient, f"{tmp}/floor.sock")
    return fc


@asynccontextmanager
async def guestd_beside_echo(tmp: str, name: str) -> AsyncIterator[tuple[Proc, str, AsyncClient, FloorClient]]:
    """A guestd (``guestd``) and the echo floor, a warm client connected to each; all closed after."""
    with echo_floor(tmp), guestd(tmp, name) as (proc, address):
        fc = await echo_client(tmp)
        c = await AsyncClient.connect(address)
        try:
            await time_loop(c.ping, 0, 200)
            await time_loop(lambda: fc.call({"op": "ping", "id": 1}), 0, 200)
            yield proc, address, c, fc
        finally:
            await c.close()
            assert fc.transport is not None
            fc.transport.close()


async def ping_window(call: Callable[[], Awaitable[Any]], seconds: float, least: int) -> list[float]:
    """Round trips one after the other for ``seconds``, at least ``least`` of them."""
    out: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(out) < least:
        t = time.perf_counter()
        await call()
        out.append(time.perf_counter() - t)
    return out


# --------------------------------------------------------------------------- load helpers
# Each runs in a process of its own (``--load-helper``, ``--floor-helper``): it says "ready", records
# between a "go" and a "stop" line on its stdin, then prints what it measured as JSON.


async def load_helper(address: str, clients: int) -> None:
    """``clients`` connections to guestd, each looping ``exec true``."""
    conns = [await AsyncClient.connect(address) for _ in range(clients)]
    recording = threading.Event()
    stop = asyncio.Event()
    latencies: list[float] = []
    warm = [0]

    async def worker(c: AsyncClient) -> None:
        first = True
        while not stop.is_set():
            t = time.perf_counter()
            await c.exec(["true"])
            if recording.is_set():
                latencies.append(time.perf_counter() - t)
            if first:
                warm[0] += 1
                first = False

    tasks = [asyncio.ensure_future(worker(c)) for c in conns]
    while warm[0] < clients:
        await asyncio.sleep(0.01)
    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    recording.set()
    t0 = time.perf_counter()
    await asyncio.to_thread(sys.stdin.readline)
    recording.clear()
    elapsed = time.perf_counter() - t0
    stop.set()
    await asyncio.gather(*tasks)
    for c in conns:
        await c.close()
    print(json.dumps({"latencies": latencies, "elapsed": elapsed}), flush=True)


def floor_helper(threads: int) -> None:
    """``threads`` threads looping ``subprocess.run(['true'])``: exec's floor at that concurrency."""
    recording = threading.Event()
    stop = threading.Event()
    latencies: list[float] = []
    lock = threading.Lock()

    def worker() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            subprocess.run(["true"], check=True)
            dt = time.perf_counter() - t
            if recording.is_set():
                with lock:
                    latencies.append(dt)

    pool = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
    for t in pool:
        t.start()
    time.sleep(0.3)
    print("ready", flush=True)
    sys.stdin.readline()
    recording.set()
    t0 = time.perf_counter()
    sys.stdin.readline()
    recording.clear()
    elapsed = time.perf_counter() - t0
    stop.set()
    for t in pool:
        t.join()
    print(json.dumps({"latencies": latencies, "elapsed": elapsed}), flush=True)


class Helper:
    """A load or floor helper process (``args`` after ``-m bench.scaling``); ended by ``finish``."""

    def __init__(self, args: list[str], on_server_cpu: bool) -> None:
        self.p = subprocess.Popen(
            [sys.executable, "-m", "bench.scaling", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=pin_servers if on_server_cpu else None,
        )

    async def ready(self) -> None:
        assert self.p.stdout is not None
        line = await asyncio.to_thread(self.p.stdout.readline)
        if line.strip() != "ready":
            self.kill()
            raise RuntimeError(f"bench helper {self.p.args!r} did not start")

    def say(self, word: str) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(word + "\n")
        self.p.stdin.flush()

    async def finish(self) -> dict[str, Any]:
        self.say("stop")
        assert self.p.stdout is not None
        line = await asyncio.to_thread(self.p.stdout.readline)
        await asyncio.to_thread(self.p.wait, 60)
        out: dict[str, Any] = json.loads(line)
        return out

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


def cpu_seconds(p: psutil.Process) -> float:
    """CPU time of ``p`` itself (user + system), its children not counted."""
    t = p.cpu_times()
    return float(t.user + t.system)


async def under_load(
    helper: Helper, probe: Callable[[], Awaitable[Any]], plan: Plan, server: psutil.Process | None = None
) -> tuple[list[float], dict[str, Any]]:
    """The probe's round trips while ``helper`` loads the machine, and what the helper measured
    (with ``server``: the CPU seconds it and the helper spent in the window, ``server_cpu_s`` and
    ``helper_cpu_s``, to tell whose cost a bend is)."""
    try:
        await helper.ready()
        loader = psutil.Process(helper.p.pid)
        cpu0 = (cpu_seconds(server) if server else 0.0, cpu_seconds(loader))
        helper.say("go")
        pings = await ping_window(probe, plan.window_s, plan.least_pings)
        cpu1 = (cpu_seconds(server) if server else 0.0, cpu_seconds(loader))
        out = await helper.finish()
        out.update(server_cpu_s=cpu1[0] - cpu0[0], helper_cpu_s=cpu1[1] - cpu0[1])
        return pings, out
    finally:
        helper.kill()


# --------------------------------------------------------------------------- curves


async def clients_curve(tmp: str, plan: Plan) -> dict[str, Any]:
    points: list[dict[str, Any]] = []
    async with guestd_beside_echo(tmp, "clients") as (proc, address, c, fc):
        idle_ping = await time_loop(c.ping, plan.least_pings, 20)
        idle_echo = await time_loop(lambda: fc.call({"op": "ping", "id": 1}), plan.least_pings, 20)
        for n in CLIENTS:
            t0 = time.perf_counter()
            pings, load = await under_load(Helper(["--load-helper", address, str(n)], False), c.ping, plan, proc.ps)
            execs = max(1, len(load["latencies"]))
            echo, floor = await under_load(
                Helper(["--floor-helper", str(n)], True), lambda: fc.call({"op": "ping", "id": 1}), plan
            )
            points.append(
                {
                    "clients": n,
                    "ping": summary_ms(pings),
                    "exec": summary_ms(load["latencies"]),
                    "execs_per_s": len(load["latencies"]) / load["elapsed"],
                    # guestd's own CPU per exec (children not counted) and how busy its CPU was
                    "guestd_cpu_ms_per_exec": load["server_cpu_s"] / execs * 1000,
                    "guestd_cpu_busy": load["server_cpu_s"] / load["elapsed"],
                    "client_cpu_ms_per_exec": load["helper_cpu_s"] / execs * 1000,
                    "floor_exec": summary_ms(floor["latencies"]),
                    "floor_execs_per_s": len(floor["latencies"]) / floor["elapsed"],
                    "echo_under_floor_load": summary_ms(echo),
                }
            )
            print(f"  {n} clients: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        # The idle floor again at the end: the better of the two (a burst elsewhere would flatter guestd).
        idle_echo_after = await time_loop(lambda: fc.call({"op": "ping", "id": 1}), plan.least_pings, 20)
    return {
        "idle_ping": summary_ms(idle_ping),
        "idle_echo_p99_ms": min(pct(idle_echo, 99), pct(idle_echo_after, 99)) * 1000,
        "points": points,
    }


async def idle_point(c: AsyncClient, fc: FloorClient, plan: Plan, server: psutil.Process) -> dict[str, Any]:
    """Ping and exec on an otherwise idle guestd, and their floors, interleaved in two halves;
    with guestd's own CPU time per exec (its children not counted)."""
    pings: list[float] = []
    echo: list[float] = []
    execs: list[float] = []
    runs: list[dict[str, Any]] = []
    exec_cpu = 0.0
    for _ in range(2):
        pings += await time_loop(c.ping, plan.least_pings // 2, 10)
        echo += await time_loop(lambda: fc.call({"op": "ping", "id": 1}), plan.least_pings // 2, 10)
        await time_loop(lambda: c.exec(["true"]), 0, 2)
        cpu0 = cpu_seconds(server)
        execs += await time_loop(lambda: c.exec(["true"]), plan.n_exec // 2, 0)
        exec_cpu += cpu_seconds(server) - cpu0
        helper = Helper(["--floor-helper", "1"], True)
        try:
            await helper.ready()
            helper.say("go")
            await asyncio.sleep(plan.window_s / 4)
            runs.append(await helper.finish())
        finally:
            helper.kill()
    floor = [x for r in runs for x in r["latencies"]]
    return {
        "ping": summary_ms(pings),
        "echo": summary_ms(echo),
        "exec": summary_ms(execs),
        "floor_exec": summary_ms(floor),
        "guestd_cpu_ms_per_exec": exec_cpu / len(execs) * 1000,
    }


async def background_curve(tmp: str, plan: Plan) -> dict[str, Any]:
    points: list[dict[str, Any]] = []
    async with guestd_beside_echo(tmp, "background") as (proc, _, c, fc):
        await time_loop(lambda: c.exec(["true"]), 0, 20)
        ids: list[str] = []
        try:
            for n in (0, *BACKGROUND):
                while len(ids) < n:
                    batch = min(n - len(ids), 50)
                    started = await asyncio.gather(*(c.process_start(["sleep", "3600"]) for _ in range(batch)))
                    ids += [p.id for p in started]
                await asyncio.sleep(0.5)
                point = await idle_point(c, fc, plan, proc.ps)
                point.update(processes=n, live=len(proc.ps.children()), rss_MiB=proc.rss() / MiB)
                points.append(point)
        finally:
            for i in range(0, len(ids), 50):
                await asyncio.gather(
                    *(c.process_signal(pid, "KILL") for pid in ids[i : i + 50]), return_exceptions=True
                )
    return {"points": points}


async def memory_kind(tmp: str, kind: str, counts: tuple[int, ...]) -> dict[str, Any]:
    """guestd's own RSS with 0 and then ``counts`` of ``kind`` held live (a guestd of its own)."""
    with guestd(tmp, f"mem-{kind}") as (proc, address):
        c = await AsyncClient.connect(address)
        await time_loop(c.ping, 0, 50)
        await asyncio.sleep(0.5)
        rss = [(0, proc.rss() / MiB)]
        extra: dict[str, Any] = {}
        held: list[Any] = []
        watched = f"{tmp}/watched"
        if kind == "watches" and not os.path.exists(watched):
            make_tree(watched, 100)
        shell = (await c.shell_create()).id if kind == "kept runs" else None
        if shell is not None:
            rss = [(0, proc.rss() / MiB)]  # the session the runs run in is not theirs to count
        try:
            for n in counts:
                while len(held) < n:
                    if kind == "shells":
                        held.append(await c.shell_create())
                    elif kind == "kept runs":
                        assert shell is not None
                        held.append(await c.shell_run(shell, KEPT_RUN_COMMAND, keep=True))
                    elif kind == "watches":
                        w = c.watch(watched)
                        await w.wait_ready(60)
                        held.append(w)
                    else:
                        ctx = await c.code_create(start_timeout_s=300)
                        pin_all_threads(ctx.pid)
                        held.append(ctx)
                await asyncio.sleep(0.5)
                rss.append((n, proc.rss() / MiB))
            if kind == "contexts":
                kernels = [psutil.Process(h.pid).memory_info().rss / MiB for h in held]
                extra["kernel_rss_MiB_median"] = statistics.median(kernels)
        finally:
            for h in held:
                if kind == "shells":
                    await c.shell_close(h.id)
                elif kind == "watches":
                    await h.close()
                elif kind == "contexts":
                    await c.code_close(h.id)
            await c.close()
    return {"kind": kind, "rss_MiB": rss, **extra}


async def memory_curve(tmp: str) -> dict[str, Any]:
    with echo_floor(tmp) as floor:
        await asyncio.sleep(0.5)
        floor_rss = floor.rss() / MiB
    kinds = [await memory_kind(tmp, kind, HELD) for kind in ("shells", "kept runs", "watches")]
    kinds.append(await memory_kind(tmp, "contexts", CONTEXTS))
    return {"floor_idle_rss_MiB": floor_rss, "kinds": kinds}


# --------------------------------------------------------------------------- files


def tree_dir(n: int) -> str:
    return f"{TREE_TOP}/tree-{n}"


def make_tree(root: str, n: int) -> None:
    """``n`` files of ~60 bytes, 100 per directory, 100 directories per top directory; every
    100th file is ``.py`` (glob's pattern), every 1000th holds ``needle_marker`` (grep's)."""
    body = b"alpha beta gamma delta\nepsilon zeta eta theta\n"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    for i in range(n):
        d = f"{root}/d{i // 10_000:03d}/s{(i // FILES_PER_DIR) % 100:02d}"
        if i % FILES_PER_DIR == 0:
            os.makedirs(d, mode=0o755, exist_ok=True)
        fd = os.open(f"{d}/f{i}.{'py' if i % 100 == 7 else 'txt'}", flags, 0o644)
        os.write(fd, body + (b"needle_marker = 1\n" if i % 1000 == 3 else b""))
        os.close(fd)


def ensure_tree(n: int) -> tuple[str, float]:
    """The tree of ``n`` files, made unless a whole one is there already; seconds spent making it."""
    root = tree_dir(n)
    marker = f"{TREE_TOP}/tree-{n}.complete"
    try:
        with open(marker) as f:
            if f.read() == TREE_LAYOUT:
                return root, 0.0
    except OSError:
        pass
    os.makedirs(TREE_TOP, exist_ok=True)
    os.chmod(TREE_TOP, 0o755)  # rg runs as nobody: it must be able to enter
    shutil.rmtree(root, ignore_errors=True)
    t = time.perf_counter()
    make_tree(root, n)
    with open(marker, "w") as f:
        f.write(TREE_LAYOUT)
    return root, time.perf_counter() - t


def remove_trees() -> None:
    shutil.rmtree(TREE_TOP, ignore_errors=True)


@contextmanager
def every_cpu() -> Iterator[None]:
    """The calling thread (and what it starts) on every CPU while inside: as guestd's children run
    (``guestd.children`` gives them every CPU of their cpuset, not guestd's pinning)."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, range(os.cpu_count() or 1))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def floor_glob(root: str) -> tuple[float, int]:
    with every_cpu():
        t = time.perf_counter()
        r = subprocess.run(["find", root, "-name", "*.py"], stdout=subprocess.PIPE, check=True)
        return time.perf_counter() - t, r.stdout.count(b"\n")


def floor_grep(root: str) -> tuple[float, int]:
    """rg itself, with the printer and filters guestd asks rg for, into a pipe."""
    rg = shutil.which("rg")
    assert rg is not None
    with every_cpu():
        t = time.perf_counter()
        argv = rg_command(rg, GrepQuery("needle_marker"), ".")
        r = subprocess.run(argv, cwd=root, stdout=subprocess.PIPE, check=True)
        return time.perf_counter() - t, r.stdout.count(b"\n")


def floor_walk(root: str) -> tuple[float, int]:
    t = time.perf_counter()
    entries = 0
    for _, dirs, names in os.walk(root):
        entries += len(dirs) + len(names)
    return time.perf_counter() - t, entries


def floor_tar(root: str) -> tuple[float, int]:
    with every_cpu():
        return tar_through_socket(root, ["cat"]), 1


async def files_point(c: AsyncClient, proc: Proc, n: int, plan: Plan) -> dict[str, Any]:
    """Each op and its floor, interleaved, ``rounds`` times: the best wall time of each, and for
    guestd its own CPU time (glob, the download and the watcher's scan run inside guestd; grep's
    rg is a child, not counted) and its peak RSS."""
    root, made_s = await asyncio.to_thread(ensure_tree, n)
    rounds = plan.file_rounds if n < 1_000_000 else 1
    best: dict[str, float] = {}
    cpu: dict[str, float] = {}
    counts: dict[str, int] = {}
    peaks: dict[str, float] = {}

    async def op(key: str, run: Callable[[], Awaitable[int]]) -> None:
        with peak_rss(proc) as pk:
            cpu0, t = cpu_seconds(proc.ps), time.perf_counter()
            counts[key] = await run()
            best[key] = min(best.get(key, math.inf), time.perf_counter() - t)
            cpu[key] = min(cpu.get(key, math.inf), cpu_seconds(proc.ps) - cpu0)
        peaks[key] = max(peaks.get(key, 0.0), pk["peak"] / MiB)

    async def floor(key: str, run: Callable[[str], tuple[float, int]]) -> None:
        seconds, counts[key] = await asyncio.to_thread(run, root)
        best[key] = min(best.get(key, math.inf), seconds)

    async def glob() -> int:
        return (await c.glob(root, "*.py", max_results=1000, timeout_s=3600)).total

    async def grep() -> int:
        return (await c.grep(root, "needle_marker", max_matches=1_000_000, timeout_s=3600)).matches

    async def download() -> int:
        return len(await c.download_tree(root, max_bytes=1 << 34, deadline=3600))

    async def watch() -> int:
        before = proc.rss() / MiB
        w = c.watch(root)
        await w.wait_ready(3600)
        peaks["watch_held_growth"] = proc.rss() / MiB - before
        await w.close()
        return 1

    rss_before = proc.rss() / MiB
    for _ in range(rounds):
        await op("glob", glob)
        await floor("floor_glob", floor_glob)
        await op("grep", grep)
        await floor("floor_grep", floor_grep)
        await op("download", download)
        await floor("floor_download", floor_tar)
        await op("watch", watch)
        await floor("floor_watch", floor_walk)
    return {
        "files": n,
        "rounds": rounds,
        "made_s": made_s,
        "seconds": best,
        "guestd_cpu_s": cpu,
        "counts": counts,
        "rss_before_MiB": rss_before,
        "peak_rss_MiB": peaks,
    }


async def files_curve(tmp: str, plan: Plan) -> dict[str, Any]:
    points = []
    with guestd(tmp, "files") as (proc, address):
        c = await AsyncClient.connect(address)
        for n in plan.trees:
            points.append(await files_point(c, proc, n, plan))
        await c.close()
    return {"layout": TREE_LAYOUT, "points": points}


# --------------------------------------------------------------------------- what else runs


def source_state() -> dict[str, Any]:
    """Which guestd ran: the commit, and the files under guestd/ that differ from it (a shared
    checkout: other work in progress is measured too)."""

    def git(*args: str) -> str:
        r = subprocess.run(["git", *args], cwd=os.path.dirname(HERE), capture_output=True, text=True, check=False)
        return r.stdout

    changed = [line[3:] for line in git("status", "--porcelain", "--", "guestd").splitlines() if len(line) > 3]
    return {
        "commit": git("rev-parse", "--short", "HEAD").strip(),
        "guestd_tree": git("rev-parse", "HEAD:guestd").strip(),  # changes only when guestd/ does
        "uncommitted": changed,
    }


def other_work() -> dict[str, Any]:
    """The load average and the other guestd / bench / test processes on the machine (not ours)."""
    mine = {os.getpid()} | {p.pid for p in psutil.Process().children(recursive=True)}
    others: dict[str, int] = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if p.info["pid"] in mine:
            continue
        for word in ("guestd.code.kernel", "-m guestd", "bench.", "pytest", "qemu-system"):
            if word in cmd:
                others[word] = others.get(word, 0) + 1
                break
    return {"loadavg": list(os.getloadavg()), "processes": others}


# --------------------------------------------------------------------------- report


def growth(xs: list[float], ys: list[float]) -> list[float]:
    """The exponent k of y ~ x^k between each two neighbouring points (1: linear, 0: flat)."""
    out = []
    for (x0, y0), (x1, y1) in zip(zip(xs, ys, strict=True), zip(xs[1:], ys[1:], strict=True), strict=False):
        out.append(math.log(max(y1, 1e-9) / max(y0, 1e-9)) / math.log(x1 / x0))
    return out


def shape(ks: list[float]) -> str:
    """A curve's growth in words, from its exponents."""
    worst = max(ks)
    if worst <= 0.25:
        kind = "flat"
    elif worst <= 0.85:
        kind = "sub-linear"
    elif worst <= 1.15:
        kind = "linear"
    elif worst <= 1.3:
        kind = "near-linear (the cost per item grows a little)"
    else:
        kind = "SUPER-LINEAR"
    return f"{kind} (exponent per step {', '.join(f'{k:.2f}' for k in ks)})"


# Where each curve bends and why: read from the code (and a perf profile where one is named; those
# figures are from the day they were taken, not re-measured by each run).
WHY = {
    "clients": [
        "Why: exec p50 is N / throughput (N clients, each with one exec in flight), so it is linear while "
        "guestd's throughput holds and bends up when it falls. What falls with N: guestd's own CPU per exec "
        "(column) is flat to slightly up, but its full garbage collections walk every live object, and live "
        "objects grow with the requests in flight (perf, 2026-12-03: `gc_collect_main` 0.2% of guestd's samples "
        "at 16 clients, 5% at 256; `guestd/server/daemon.py` freezes start-up objects, not per-request ones); "
        "each spawn's child also copies and closes guestd's fd table, one socket per client (see the next curve)."
        " On this shared 2-CPU machine the rest of a bend is the other work: in a perf sample of a re-run of the "
        "16- and 256-client points, a QEMU guest (TCG) of another bench took 17% and 32% of all CPU samples.",
        "ping p99 is answered on the event loop between other callbacks, so it waits for the longest loop "
        "iteration; with N connections ready at once an iteration holds up to N frames and exec completions, so "
        "p99 grows with N, sub-linearly while batches stay small.",
    ],
    "background": [
        "Why: each exec pays for every live process twice, both linear in their number. (1) `Children.reaped` "
        "(guestd/children/spawner.py) calls `Reaper.sweep` (guestd/children/reaper.py) after each exit: "
        "`waitid(P_ALL, WNOHANG | WNOWAIT)` makes the kernel walk all of guestd's children "
        "(`wait_consider_task`). (2) the clone3 child (guestd/children/_clone.c, no `CLONE_FILES`) gets a copy of"
        " guestd's fd table (`dup_fd`) and `close_from` closes every inherited fd with `close_range`, each close "
        "a `filp_flush` (`dnotify_flush`, `locks_remove_posix`); every background process holds 3 fds in guestd "
        "(its pidfd and two pipes). perf, 2026-12-03, 1,000 processes: `dnotify_flush` 14%, `filp_flush` 12%, "
        "`wait_consider_task` 5.7%, `close_range` 1.9%, `dup_fd` 1.5% of guestd's samples. The fd-table part runs"
        " in the child before exec, so it adds to exec's latency more than to guestd's CPU column. At the default"
        " `max_processes` (64) this is tens of microseconds; RSS grows ~4 KiB per process (its record, ring "
        "buffers allocated as output comes, pipes).",
    ],
    "memory": [
        "Why: the first shell and the first context import their machinery (shells: a few modules, 0.3-2 MiB "
        "across runs; contexts: jupyter_client, zmq, tornado and traitlets, 11-14 MiB, imported on first use by "
        "guestd/code/contexts.py); after that, what guestd holds per item is small and constant: a shell is a "
        "bash child and its session record and pty/pipe buffers (a few KiB), a kept run its reply (bounded by the"
        " op's `max_output`; 7-11 KiB per run here, about its 8.9 KB reply), a watch a `Watcher` thread of its "
        "own with an inotify instance and the names of its tree (~40 KiB here, more for a larger tree: see the "
        "files curve), a context its zmq sockets and session (~175 KiB). Each is linear, bounded by `max_shells`,"
        " `max_kept_runs`, `max_contexts` and, for watches, `MAX_WATCHES` / `MAX_NAMES_BYTES` "
        "(guestd/files/watch.py) and the kernel's `fs.inotify.max_user_instances` (128 here, per user).",
    ],
    "files": [
        "Why: glob, tree.download and the watcher's scan walk the tree in Python inside guestd; each entry costs "
        "a constant (an `os.stat` and the filter per entry in `Walk.entries`, guestd/files/walk.py; names are "
        "sorted per directory, in chunks of 16,384 merged lazily, so a directory's sort is n log n of its own "
        "size, not the tree's), so they are linear and their ratio to the C floors is the per-entry Python cost: "
        "glob ~5-10x `find`, the watcher's scan ~3x `os.walk` (`Watcher._list` adds an inotify watch per "
        "directory and keeps every name, `MAX_NAMES_BYTES` = 16 MiB for all watchers; past it names are not kept,"
        " so the held RSS stops growing). grep is rg itself as a workload child, so it follows rg. tree.download "
        "costs more per entry than `tar`: a Python walk, an `openat`, `fstat` and `read` per file and a header "
        "built in Python. Before commit 294d543 headers came from `tarfile.TarInfo.tobuf(PAX_FORMAT)` (~60% of the"
        " archive's CPU by cProfile on 10k files; 90-130 us of guestd CPU per small file in the quick runs of "
        "15:11-15:27); guestd/files/tarhead.py builds them by hand since (40-50 us). An mtime with a fraction of "
        "a second still gets a pax record, so nearly every entry carries a pax extended header: 2 KiB per small "
        "file (20.6 MB for the 10k tree) where GNU tar's default format, the floor, writes 1 KiB and drops the "
        "fraction. Still linear: a cost per entry, not per tree. At 1M files every wall time, the floors' too, "
        "bends up when the machine is busy (the tree's 1M inodes and 4 GB of blocks compete for cache with the "
        "other work); guestd's CPU per file stays near-flat.",
    ],
}


def render(res: dict[str, Any]) -> str:
    meta = res["meta"]
    lines = [
        BEGIN,
        "## How cost grows with the work (bench/scaling.py)",
        "",
        f"`python -m bench.scaling [--quick]` on {meta['cpus']} CPUs, guestd pinned to CPU {meta['server_cpus']}, "
        f"the bench's clients to CPU {meta['client_cpus']}. Each curve says when it was measured, which guestd, "
        "and what else ran (the load average and the other guestd, bench, test and QEMU processes found at its "
        "start). Each point's floor is measured in the same run, next to it. Growth is the exponent k of "
        "cost ~ work^k between neighbouring points (1 linear, 0 flat); on a shared machine one noisy point moves "
        "it, so guestd's own CPU time (moved least by other work) is given beside wall times.",
        "",
    ]
    for name, part in (
        ("clients", render_clients),
        ("background", render_background),
        ("memory", render_memory),
        ("files", render_files),
    ):
        lines += (
            [*part(res[name]), *when(res[name]), *WHY[name], ""] if name in res else [f"({name}: not measured yet)", ""]
        )
    if res.get("chart"):
        lines += [res["chart"], ""]
    lines += [END]
    return "\n".join(lines) + "\n"


def when(curve: dict[str, Any]) -> list[str]:
    w = curve.get("when")
    if w is None:
        return []
    cmd = "python -m bench.scaling" + (" --quick" if w["quick"] else "")
    text = (
        f"Measured {w['date']} by `{cmd}` in {w['seconds']:.0f} s; {describe_source(w.get('source', {}))} "
        f"{moved(w.get('source', {}), w.get('source_after', w.get('source', {})))}"
        f"Load average {w['loadavg'][0]:.1f} before, {w['loadavg'][1]:.1f} after"
    )
    if "others" in w:
        text += f"; other work at the start: {describe_others(w['others'])}"
    return [text + ".", ""]


def moved(before: dict[str, Any], after: dict[str, Any]) -> str:
    """What changed under guestd/ while the curve ran (another helper's commit or edit), if anything."""
    committed = before.get("guestd_tree") != after.get("guestd_tree")
    changed = sorted(set(before.get("uncommitted", [])) ^ set(after.get("uncommitted", [])))
    if not committed and not changed:
        return ""
    text = "guestd's source changed while it ran"
    if committed:
        text += f" (guestd/ at commit {after.get('commit', '?')} differs)"
    if changed:
        text += ": " + ", ".join(f"`{path}`" for path in changed)
    return text + "; a module imported after the change may be the new one. "


def describe_source(src: dict[str, Any]) -> str:
    changed = src.get("uncommitted", [])
    text = f"guestd as of commit {src.get('commit', '?')}"
    if changed:
        text += f", with uncommitted changes (other work in progress) in {len(changed)} files under guestd/: "
        text += ", ".join(f"`{path}`" for path in changed)
    return text + "."


def describe_others(procs: dict[str, int]) -> str:
    if not procs:
        return "none found"
    return ", ".join(f"{n} `{w}`" for w, n in sorted(procs.items()))


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "-"


def render_clients(cl: dict[str, Any]) -> list[str]:
    pts = cl["points"]
    echo = cl["idle_echo_p99_ms"]
    xs = [float(p["clients"]) for p in pts]
    out = [
        "### ping p99 and exec `true` p50 vs concurrent clients",
        "",
        "N clients loop `exec true` from a load process of their own (CPU 0), a third client pings.",
        "exec's floor at N: N threads looping `subprocess.run(['true'])` in a process on guestd's CPU.",
        f"ping's floor: the echo's idle p99, {echo:.3f} ms (guestd idle: {cl['idle_ping']['p99_ms']:.3f} ms).",
        "",
        "| clients | ping p99 | / idle echo p99 | echo p99 under the floor's load | ping / that | exec p50 "
        "| floor p50 | exec / floor | execs/s | floor execs/s | guestd CPU per exec (busy) | clients' CPU per exec |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in pts:
        out.append(
            f"| {p['clients']} | {p['ping']['p99_ms']:.2f} ms | {ratio(p['ping']['p99_ms'], echo)} "
            f"| {p['echo_under_floor_load']['p99_ms']:.2f} ms "
            f"| {ratio(p['ping']['p99_ms'], p['echo_under_floor_load']['p99_ms'])} | {p['exec']['p50_ms']:.2f} ms "
            f"| {p['floor_exec']['p50_ms']:.2f} ms | {ratio(p['exec']['p50_ms'], p['floor_exec']['p50_ms'])} "
            f"| {p['execs_per_s']:,.0f} | {p['floor_execs_per_s']:,.0f} "
            f"| {p.get('guestd_cpu_ms_per_exec', math.nan):.2f} ms ({p.get('guestd_cpu_busy', math.nan):.0%}) "
            f"| {p.get('client_cpu_ms_per_exec', math.nan):.2f} ms |"
        )
    out += [
        "",
        f"- ping p99: {shape(growth(xs, [p['ping']['p99_ms'] for p in pts]))}.",
        f"- exec p50: {shape(growth(xs, [p['exec']['p50_ms'] for p in pts]))}; its floor: "
        f"{shape(growth(xs, [p['floor_exec']['p50_ms'] for p in pts]))}; "
        f"guestd's CPU per exec: {cpu_shape(xs, pts)}.",
        "",
    ]
    return out


def render_background(bg: dict[str, Any]) -> list[str]:
    pts = bg["points"]
    out = [
        "### ping p99 and exec `true` p50 vs live background processes",
        "",
        "N `sleep` runs started with `process.start` and left running; then idle pings and execs, the echo and",
        "`subprocess.run(['true'])` (a process on guestd's CPU) measured in the same state, interleaved.",
        "",
        "| processes | ping p99 | echo p99 | ping / echo | exec p50 | subprocess.run p50 | exec / floor "
        "| guestd CPU per exec | guestd RSS |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in pts:
        out.append(
            f"| {p['processes']:,} | {p['ping']['p99_ms']:.2f} ms | {p['echo']['p99_ms']:.2f} ms "
            f"| {ratio(p['ping']['p99_ms'], p['echo']['p99_ms'])} | {p['exec']['p50_ms']:.2f} ms "
            f"| {p['floor_exec']['p50_ms']:.2f} ms | {ratio(p['exec']['p50_ms'], p['floor_exec']['p50_ms'])} "
            f"| {p.get('guestd_cpu_ms_per_exec', math.nan):.2f} ms | {p['rss_MiB']:.1f} MiB |"
        )
    live = [p for p in pts if p["processes"] > 0]
    xs = [float(p["processes"]) for p in live]
    out += [
        "",
        f"- ping p99: {shape(growth(xs, [p['ping']['p99_ms'] for p in live]))}.",
        f"- exec p50: {shape(growth(xs, [p['exec']['p50_ms'] for p in live]))}; "
        f"guestd's CPU per exec: {cpu_shape(xs, live)}.",
        f"- guestd RSS: {shape(growth(xs, [p['rss_MiB'] for p in live]))}; "
        f"{per_item(pts, 'processes', 'rss_MiB')} per process.",
        "",
    ]
    return out


def cpu_shape(xs: list[float], pts: list[dict[str, Any]]) -> str:
    """guestd's own CPU per exec along a curve: the cost that other work on the machine moves least."""
    if not all("guestd_cpu_ms_per_exec" in p for p in pts):
        return "not measured"
    return shape(growth(xs, [max(p["guestd_cpu_ms_per_exec"], 1e-3) for p in pts]))


def per_item(pts: list[dict[str, Any]], x: str, y: str) -> str:
    first, last = pts[0], pts[-1]
    return f"{(last[y] - first[y]) / (last[x] - first[x]) * 1024:.0f} KiB"


def render_memory(mem: dict[str, Any]) -> list[str]:
    out = [
        "### guestd's own RSS vs what it holds",
        "",
        f"A fresh guestd per kind; RSS of guestd's process only (children and kernels not counted). The floor"
        f" (bare uvloop + msgpack server) idles at {mem['floor_idle_rss_MiB']:.1f} MiB. Kept runs: `{KEPT_RUN_COMMAND}`"
        " (8.9 KB of output each) in one shell; watches: `file.watch` of one 100-file tree, each its own watcher.",
        "Code contexts stop at 10: each is a kernel of ~60-100 MB that takes ~1 s to start, so 100 would hold"
        " 6-10 GB of this 24 GiB machine and minutes of start-up on 2 cores; guestd's own share is measured"
        " from 1 to 10.",
        "",
        "| held | 0 | 1 | 10 | 100 | per item (last step) | / floor at the last point | growth |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for k in mem["kinds"]:
        by = dict(k["rss_MiB"])
        pts = k["rss_MiB"]
        cells = [f"{by[n]:.1f}" if n in by else "-" for n in (0, 1, 10, 100)]
        (x0, y0), (x1, y1) = pts[-2], pts[-1]
        items = [(x, y - by[0]) for x, y in pts if x > 0]
        ks = growth([float(x) for x, _ in items], [max(y, 0.05) for _, y in items])
        note = (
            f" (kernel median {k['kernel_rss_MiB_median']:.0f} MiB, not counted)"
            if "kernel_rss_MiB_median" in k
            else ""
        )
        out.append(
            f"| {k['kind']}{note} | {' | '.join(cells)} | {(y1 - y0) / (x1 - x0) * 1024:.0f} KiB "
            f"| {ratio(y1, mem['floor_idle_rss_MiB'])} | growth over idle: {shape(ks)} |"
        )
    out.append("")
    return out


FILE_OPS = (
    ("glob", "floor_glob", "`file.glob '*.py'`", "`find -name '*.py'`"),
    ("grep", "floor_grep", "`file.grep needle_marker`", "`rg` directly, guestd's printer"),
    ("download", "floor_download", "`tree.download`", "`tar -c | socket | cat`"),
    ("watch", "floor_watch", "`file.watch` until `ready`", "`os.walk`"),
)


def render_files(fl: dict[str, Any]) -> list[str]:
    pts = fl["points"]
    out = [
        "### file.glob, file.grep, tree.download and the watcher's first scan vs files in the tree",
        "",
        f"Trees of ~60-byte files ({fl['layout']}); best of the interleaved rounds (1 round at 1M); guestd and the"
        " floors read a warm page cache alike; the floors' processes may use both CPUs, as guestd's children do"
        " (guestd itself is pinned to one). guestd's CPU time is its own process's (rg, a child, not counted): on"
        " a loaded machine it moves less than wall time.",
        "",
        "| files | op | guestd | floor | guestd / floor | guestd per file | guestd CPU per file | guestd peak RSS |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in pts:
        s, cpu = p["seconds"], p.get("guestd_cpu_s", {})
        for key, fkey, label, flabel in FILE_OPS:
            peak = p["peak_rss_MiB"].get(key)
            # grep's work is rg's, a child of guestd: guestd's own CPU says nothing of it
            cpu_per_file = "-" if key == "grep" else f"{cpu.get(key, math.nan) / p['files'] * 1e6:.1f} us"
            out.append(
                f"| {p['files']:,} | {label} vs {flabel} | {s[key] * 1000:,.0f} ms | {s[fkey] * 1000:,.0f} ms "
                f"| {ratio(s[key], s[fkey])} | {s[key] / p['files'] * 1e6:.1f} us "
                f"| {cpu_per_file} | {f'{peak:.0f} MiB' if peak else '-'} |"
            )
    xs = [float(p["files"]) for p in pts]
    out.append("")
    for key, fkey, label, _ in FILE_OPS:
        g = growth(xs, [p["seconds"][key] for p in pts])
        f = growth(xs, [p["seconds"][fkey] for p in pts])
        text = f"- {label}: wall {shape(g)}"
        if key != "grep" and all("guestd_cpu_s" in p for p in pts):
            text += f"; guestd CPU {shape(growth(xs, [max(p['guestd_cpu_s'][key], 1e-3) for p in pts]))}"
        out.append(text + f"; floor {shape(f)}.")
    held = [p["peak_rss_MiB"].get("watch_held_growth", math.nan) for p in pts]
    out += [
        "- guestd's RSS growth while a watch of the tree is held (over its RSS just before the watch): "
        + ", ".join(f"{p['files']:,}: {h:+.0f} MiB" for p, h in zip(pts, held, strict=True))
        + ".",
        "",
    ]
    return out


def chart(json_path: str) -> str:
    """bench/charts/scaling.png with bench/.peers-venv's matplotlib (bench/scaling_chart.py); its
    markdown, or why there is none."""
    py = os.path.join(HERE, ".peers-venv", "bin", "python")
    if not os.path.exists(py):
        return "(chart not drawn: bench/.peers-venv, which has matplotlib, is made by `python -m bench.run`)"
    r = subprocess.run(
        [py, os.path.join(HERE, "scaling_chart.py"), json_path, CHART_DIR],
        capture_output=True,
        text=True,
        check=False,
    )
    return r.stdout.strip() if r.returncode == 0 else f"(chart failed: {r.stderr[-300:]})"


async def memory_curve_planned(tmp: str, plan: Plan) -> dict[str, Any]:
    return await memory_curve(tmp)


CURVES: dict[str, Callable[[str, Plan], Awaitable[dict[str, Any]]]] = {
    "clients": clients_curve,
    "background": background_curve,
    "memory": memory_curve_planned,
    "files": files_curve,
}


async def amain(plan: Plan, quick: bool, only: list[str]) -> dict[str, Any]:
    if SERVER_CPUS:
        os.sched_setaffinity(0, CLIENT_CPUS)
    res: dict[str, Any] = {}
    meta: dict[str, Any] = {
        "cmd": "python -m bench.scaling" + (" --quick" if quick else ""),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpus": os.cpu_count(),
        "server_cpus": sorted(SERVER_CPUS),
        "client_cpus": sorted(CLIENT_CPUS),
        "before": other_work(),
        "source": source_state(),
    }
    with tempfile.TemporaryDirectory(prefix="guestd-bench-scaling-") as tmp:
        os.chmod(tmp, 0o755)
        for name in only:
            t, load, others = time.perf_counter(), os.getloadavg()[0], other_work()["processes"]
            source = source_state()  # what the curve's guestd starts from (a shared checkout moves)
            res[name] = await CURVES[name](tmp, plan)
            res[name]["when"] = {
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "seconds": time.perf_counter() - t,
                "loadavg": [load, os.getloadavg()[0]],
                "others": others,
                "source": source,
                "source_after": source_state(),
                "quick": quick,
            }
            print(f"{name}: {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    meta["after"] = other_work()
    res["meta"] = meta
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer samples, trees up to 100k files")
    ap.add_argument("--keep", action="store_true", help=f"keep the generated trees under {TREE_TOP}")
    ap.add_argument("--load-helper", nargs=2, metavar=("ADDRESS", "CLIENTS"), help=argparse.SUPPRESS)
    ap.add_argument("--floor-helper", type=int, metavar="THREADS", help=argparse.SUPPRESS)
    ap.add_argument(
        "--only",
        default=",".join(CURVES),
        help="comma-separated curves to measure (the others are kept from the last bench/out/scaling.json)",
    )
    ns = ap.parse_args()
    if ns.load_helper:
        uvloop.run(load_helper(ns.load_helper[0], int(ns.load_helper[1])))
        return
    if ns.floor_helper:
        floor_helper(ns.floor_helper)
        return
    only = [name for name in ns.only.split(",") if name]
    if unknown := set(only) - set(CURVES):
        ap.error(f"unknown curves {sorted(unknown)}; there are {list(CURVES)}")
    try:
        res = uvloop.run(amain(QUICK if ns.quick else FULL, ns.quick, only))
    finally:
        if not ns.keep:
            remove_trees()
    if set(only) != set(CURVES) and os.path.exists(SCALING_JSON):
        with open(SCALING_JSON) as f:  # the other curves from the last run (their meta is this run's)
            res = {**json.load(f), **res}
    os.makedirs(os.path.dirname(SCALING_JSON), exist_ok=True)
    with open(SCALING_JSON, "w") as f:
        json.dump(res, f, indent=1)
    measured = all(name in res for name in CURVES)
    res["chart"] = chart(SCALING_JSON) if measured else "(the chart is drawn once every curve is measured)"
    text = render(res)
    write_section(RESULTS_MD, "scaling", text)
    print(text)


if __name__ == "__main__":
    main()
