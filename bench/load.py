"""The control plane under an exec flood, measured from outside, and exec `true` against its floors.

``python -m bench.load`` (as root for the shipped config) runs, for the shipped config (workload
user + a leaf cgroup per run, in a scratch cgroup removed afterwards) and for root without
settings, ``--repeat`` times each:

- guestd alone on CPU 1 (``sched_setaffinity`` before exec), with ``GUESTD_LOOP_LAG`` set so it
  reports how late its loop ran (guestd/looplag.py);
- idle pings from this process (CPU 0): the floor of the ping rows;
- a separate load process on CPU 0 with ``--clients`` connections looping `exec true`, while this
  process (a third client) pings every ``PING_GAP_S`` for ``--seconds``: ping p50/p99/max, the
  exec rate, and the loop's longest iterations and GC pauses over exactly that window;
- exec `true` latency with no load, in rounds alternating with ``subprocess.run(['true'])`` from
  this process (the floor) and, when qemu-ga is installed, qemu-ga's guest-exec of /bin/true
  (pinned like guestd).

Every figure is the median over the repeats, with the spread; ratios are against floors taken in
the same run; the load average is printed with the table. ``--profile FILE`` also records where
guestd's GIL time goes under the load (py-spy, when it is installed; not a dependency).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
_CPUS = sorted(os.sched_getaffinity(0))
CLIENT_CPUS = {_CPUS[0]} if len(_CPUS) >= 2 else set(_CPUS)
SERVER_CPUS = {_CPUS[1]} if len(_CPUS) >= 2 else set(_CPUS)
PING_GAP_S = 0.002  # a health-check client: one ping, a short pause, the next
PING_GOAL_MS = 10.0
EXEC_P50_GOAL = 1.3  # x subprocess.run(['true'])
EXEC_P99_GOAL = 1.5  # x qemu-ga's p99


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))
    return xs[k]


def ms(xs: list[float]) -> dict[str, float]:
    return {"p50": pct(xs, 50) * 1000, "p99": pct(xs, 99) * 1000, "max": max(xs) * 1000, "n": len(xs)}


def cpu_figures(pid: int, loop_only: bool = False) -> tuple[float, float]:
    """(CPU seconds used, seconds runnable but waiting for a CPU) of every thread of ``pid``
    (``loop_only``: of its main thread, the event loop's)."""
    used = waited = 0.0
    for tid in [str(pid)] if loop_only else os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                run_ns, wait_ns, _ = f.read().split()
        except (OSError, ValueError):
            continue
        used += int(run_ns) / 1e9
        waited += int(wait_ns) / 1e9
    return used, waited


SERVER_NICE = 0  # --nice: guestd's priority raised by this much (what it starts gets nice 0 back)


def pin_server() -> None:
    os.sched_setaffinity(0, SERVER_CPUS)


def pin_guestd() -> None:
    pin_server()
    if SERVER_NICE:
        os.nice(-SERVER_NICE)


# --------------------------------------------------------------------------- the load process


async def load_main(address: str, clients: int) -> None:
    """``clients`` connections looping `exec true` until stdin closes; prints the count then."""
    from guestd.client import AsyncClient

    conns = [await AsyncClient.connect(address) for _ in range(clients)]
    done = 0
    stop = asyncio.Event()

    async def worker(c: AsyncClient) -> None:
        nonlocal done
        while not stop.is_set():
            await c.exec(["true"])
            done += 1

    tasks = [asyncio.ensure_future(worker(c)) for c in conns]
    loop = asyncio.get_running_loop()
    print("ready", flush=True)
    marks: list[tuple[float, int]] = []

    def on_line() -> None:
        line = sys.stdin.readline()
        marks.append((time.perf_counter(), done))
        if not line:
            stop.set()

    loop.add_reader(sys.stdin.fileno(), on_line)  # each line: a mark; EOF: stop
    await stop.wait()
    loop.remove_reader(sys.stdin.fileno())
    await asyncio.gather(*tasks)
    for c in conns:
        await c.close()
    print(json.dumps({"marks": marks, "done": done}), flush=True)


class LoadProcess:
    def __init__(self, address: str, clients: int) -> None:
        self.p = subprocess.Popen(
            [sys.executable, "-m", "bench.load", "--load", address, "--clients", str(clients)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
            preexec_fn=lambda: os.sched_setaffinity(0, CLIENT_CPUS),
        )
        assert self.p.stdout is not None
        if self.p.stdout.readline().strip() != "ready":
            raise RuntimeError("the load process did not start")

    def mark(self) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write("\n")
        self.p.stdin.flush()

    def finish(self) -> list[tuple[float, int]]:
        assert self.p.stdin is not None and self.p.stdout is not None
        self.p.stdin.close()
        out = json.loads(self.p.stdout.readline())
        self.p.wait(30)
        return [(float(t), int(n)) for t, n in out["marks"]]


# --------------------------------------------------------------------------- guestd


class Guestd:
    def __init__(self, tmp: str, config: str | None, workspace: str | None, name: str) -> None:
        self.sock = f"{tmp}/{name}.sock"
        self.lag_path = f"{tmp}/{name}.lag.json"
        r, w = os.pipe()
        argv = [sys.executable, "-m", "guestd", "--listen", f"unix:{self.sock}", "--log-level", "WARNING"]
        argv += ["--ready-fd", str(w), "--runtime-dir", f"{tmp}/rt-{name}", "--code-pool", "0"]
        if config is not None:
            argv += ["--config", config]
        if workspace is not None:
            argv += ["--workspace", workspace]
        env = {**os.environ, "GUESTD_LOOP_LAG": self.lag_path}
        self.p = subprocess.Popen(
            argv, pass_fds=(w,), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, preexec_fn=pin_guestd
        )
        os.close(w)
        with os.fdopen(r, "rb") as f:
            if not f.readline():
                raise RuntimeError("guestd did not start")

    def lag_reset(self) -> None:
        self.p.send_signal(signal.SIGUSR1)

    def lag_read(self) -> dict[str, Any]:
        before = os.stat(self.lag_path).st_mtime_ns if os.path.exists(self.lag_path) else 0
        self.p.send_signal(signal.SIGUSR2)
        for _ in range(500):
            if os.path.exists(self.lag_path) and os.stat(self.lag_path).st_mtime_ns != before:
                break
            time.sleep(0.01)
        with open(self.lag_path) as f:
            lag: dict[str, Any] = json.load(f)
        return lag

    def stop(self) -> None:
        self.p.terminate()
        try:
            self.p.wait(15)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()


# --------------------------------------------------------------------------- one run


async def pings_for(c: Any, seconds: float) -> list[float]:
    out = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        out.append(await c.ping())
        await asyncio.sleep(PING_GAP_S)
    return out


async def under_load(g: Guestd, clients: int, seconds: float, profile: str | None) -> dict[str, Any]:
    from guestd.client import AsyncClient

    c = await AsyncClient.connect(f"unix:{g.sock}")
    for _ in range(200):
        await c.ping()
    idle = [await c.ping() for _ in range(500)]
    load = await asyncio.to_thread(LoadProcess, f"unix:{g.sock}", clients)
    spy = None
    try:
        await asyncio.sleep(0.5)  # every client past its first exec
        load.mark()
        g.lag_reset()
        cpu0, loop0 = cpu_figures(g.p.pid), cpu_figures(g.p.pid, loop_only=True)
        spy_bin = shutil.which("py-spy", path=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
        if profile and spy_bin:
            spy = subprocess.Popen(
                [
                    spy_bin,
                    "record",
                    "--pid",
                    str(g.p.pid),
                    "--duration",
                    str(int(seconds)),
                    "--rate",
                    "500",
                    "--nonblocking",
                    "--gil",
                    "--threads",
                    "--format",
                    "raw",
                    "--output",
                    profile,
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        pings = await pings_for(c, seconds)
        lag = g.lag_read()
        cpu1, loop1 = cpu_figures(g.p.pid), cpu_figures(g.p.pid, loop_only=True)
        load.mark()
    finally:
        marks = await asyncio.to_thread(load.finish)
        if spy is not None:
            spy.wait(60)
    (t0, n0), (t1, n1) = marks[0], marks[1]
    await c.close()
    execs = max(1, n1 - n0)
    return {
        "guestd_cpu_ms_per_exec": (cpu1[0] - cpu0[0]) * 1000 / execs,
        "guestd_cpu_share": (cpu1[0] - cpu0[0]) / (t1 - t0),
        "guestd_waited_for_cpu_share": (cpu1[1] - cpu0[1]) / (t1 - t0),
        "loop_cpu_share": (loop1[0] - loop0[0]) / (t1 - t0),
        "loop_waited_for_cpu_share": (loop1[1] - loop0[1]) / (t1 - t0),
        "idle_ping": ms(idle),
        "ping": ms(pings),
        "execs_per_s": (n1 - n0) / (t1 - t0),
        "loop_max_late_ms": lag["max_late_ms"],
        "loop_worst_ms": lag["worst_late_ms"],
        "loop_max_cpu_ms": lag["max_cpu_between_ticks_ms"],
        "loop_worst_cpu_ms": lag["worst_cpu_between_ticks_ms"],
        "loop_histogram": lag["histogram"],
        "gc": lag["gc"],
        "objects_per_gen": lag.get("objects_per_gen"),
    }


async def exec_latency(g: Guestd, n: int, rounds: int) -> tuple[list[float], list[float]]:
    """guestd exec `true` and the floor, in alternating rounds (the floor from this process)."""
    from guestd.client import AsyncClient

    c = await AsyncClient.connect(f"unix:{g.sock}")
    for _ in range(20):
        await c.exec(["true"])
        subprocess.run(["true"], check=True)
    ours: list[float] = []
    floor: list[float] = []
    for _ in range(rounds):
        for _ in range(n // rounds):
            t = time.perf_counter()
            await c.exec(["true"])
            ours.append(time.perf_counter() - t)
        for _ in range(n // rounds):
            t = time.perf_counter()
            subprocess.run(["true"], check=True)
            floor.append(time.perf_counter() - t)
    await c.close()
    return ours, floor


def qga_exec(tmp: str, n: int) -> list[float] | None:
    if shutil.which("qemu-ga") is None:
        return None
    from bench.peers import QGA

    sock, state = f"{tmp}/qga.sock", f"{tmp}/qga-state"
    os.makedirs(state, exist_ok=True)
    argv = ["qemu-ga", "-m", "unix-listen", "-p", sock, "-t", state, "-f", f"{tmp}/qga.pid"]
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=pin_server)
    try:
        for _ in range(500):
            try:
                q = QGA(sock)
                break
            except OSError:
                time.sleep(0.01)
        for _ in range(20):
            q.exec("/bin/true", [])
        out = []
        for _ in range(n):
            t = time.perf_counter()
            q.exec("/bin/true", [])
            out.append(time.perf_counter() - t)
        q.sock.close()
        return out
    finally:
        p.terminate()
        p.wait()


# --------------------------------------------------------------------------- report


def med(runs: list[dict[str, Any]], *path: str) -> tuple[float, float, float]:
    vals = []
    for r in runs:
        v: Any = r
        for k in path:
            v = v[k]
        vals.append(float(v))
    return statistics.median(vals), min(vals), max(vals)


def fmt(t: tuple[float, float, float], spec: str = ".2f") -> str:
    return f"{t[0]:{spec}} ({t[1]:{spec}}-{t[2]:{spec}})"


def report(res: dict[str, Any]) -> str:
    lines = [
        f"load average at start {res['loadavg_start']}, at end {res['loadavg_end']}; "
        f"{res['repeat']} runs per config, median (min-max); guestd on CPU {sorted(SERVER_CPUS)}, "
        f"load process and pinger on CPU {sorted(CLIENT_CPUS)}; guestd's nice -{res['nice']}, what it starts "
        f"on {res['child_cpus']} CPUs",
        "",
        "| config | execs/s | idle ping p99 ms | ping p50 ms | ping p99 ms | ping max ms "
        "| loop's longest iteration ms | GC max ms (gen 0/1/2) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, runs in res["load"].items():
        if not runs:
            continue
        gcmax = [statistics.median(r["gc"][g]["max_ms"] for r in runs) for g in range(3)]
        lines.append(
            f"| {name} | {fmt(med(runs, 'execs_per_s'), '.0f')} | {fmt(med(runs, 'idle_ping', 'p99'))} "
            f"| {fmt(med(runs, 'ping', 'p50'))} | {fmt(med(runs, 'ping', 'p99'))} | {fmt(med(runs, 'ping', 'max'))} "
            f"| {fmt(med(runs, 'loop_max_late_ms'))} | {'/'.join(f'{x:.1f}' for x in gcmax)} |"
        )
    lines += [
        "",
        "| config | exec p50 ms | exec p99 ms | floor p50 ms | floor p99 ms | p50 / floor | qemu-ga p99 ms "
        "| p99 / qemu-ga p99 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, runs in res["exec"].items():
        if not runs:
            continue
        qp99 = med(runs, "qga", "p99") if all(r.get("qga") for r in runs) else None
        ratio50 = statistics.median(r["guestd"]["p50"] / r["floor"]["p50"] for r in runs)
        ratio99 = statistics.median(r["guestd"]["p99"] / r["qga"]["p99"] for r in runs) if qp99 else None
        lines.append(
            f"| {name} | {fmt(med(runs, 'guestd', 'p50'), '.3f')} | {fmt(med(runs, 'guestd', 'p99'), '.3f')} "
            f"| {fmt(med(runs, 'floor', 'p50'), '.3f')} | {fmt(med(runs, 'floor', 'p99'), '.3f')} "
            f"| {ratio50:.2f}x (goal <= {EXEC_P50_GOAL}x) | {fmt(qp99, '.3f') if qp99 else '-'} "
            f"| {f'{ratio99:.2f}x' if ratio99 else '-'} (goal <= {EXEC_P99_GOAL}x) |"
        )
    return "\n".join(lines)


async def amain(ns: argparse.Namespace) -> dict[str, Any]:
    from bench.shipped import cgroup_unusable, scratch_cgroup, shared_dir, shipped_config_text

    res: dict[str, Any] = {
        "nice": ns.nice,
        "child_cpus": ns.child_cpus,
        "repeat": ns.repeat,
        "loadavg_start": os.getloadavg(),
        "load": {},
        "exec": {},
    }
    os.sched_setaffinity(0, CLIENT_CPUS)
    configs = [c for c in ns.configs.split(",") if c]
    with tempfile.TemporaryDirectory(prefix="guestd-load-") as tmp:
        for name in configs:
            res["load"][name], res["exec"][name] = [], []
            for i in range(ns.repeat):
                if name == "shipped":
                    why = cgroup_unusable()
                    if why is not None:
                        print(f"shipped config skipped: {why}", file=sys.stderr)
                        break
                    with scratch_cgroup() as cg, shared_dir("guestd-load-") as shared:
                        config = f"{tmp}/shipped.toml"
                        with open(config, "w") as f:
                            f.write(shipped_config_text(os.path.join(cg, "workload")))
                        g = Guestd(tmp, config, os.path.join(shared, "workspace"), f"shipped{i}")
                        try:
                            await one(ns, res, name, g, tmp, i)
                        finally:
                            g.stop()
                else:
                    g = Guestd(tmp, None, None, f"root{i}")
                    try:
                        await one(ns, res, name, g, tmp, i)
                    finally:
                        g.stop()
    res["loadavg_end"] = os.getloadavg()
    return res


async def one(ns: argparse.Namespace, res: dict[str, Any], name: str, g: Guestd, tmp: str, i: int) -> None:
    if ns.clients > 0:
        profile = f"{ns.profile}.{name}{i}" if ns.profile else None
        r = await under_load(g, ns.clients, ns.seconds, profile)
        res["load"][name].append(r)
        print(
            f"{name} run {i}: {r['execs_per_s']:.0f} execs/s, ping p50/p99 {r['ping']['p50']:.2f}/"
            f"{r['ping']['p99']:.2f} ms, loop max {r['loop_max_late_ms']:.2f} ms, guestd CPU "
            f"{r['guestd_cpu_ms_per_exec']:.3f} ms/exec, {r['guestd_cpu_share']:.0%} busy, "
            f"{r['guestd_waited_for_cpu_share']:.0%} waiting for a CPU; loop thread {r['loop_cpu_share']:.0%} "
            f"busy, {r['loop_waited_for_cpu_share']:.0%} waiting",
            file=sys.stderr,
        )
    if ns.exec_n > 0:
        ours, floor = await exec_latency(g, ns.exec_n, 5)
        qga = await asyncio.to_thread(qga_exec, tmp, ns.exec_n) if ns.qga else None
        ours_ms, floor_ms = ms(ours), ms(floor)
        qga_ms = ms(qga) if qga else None
        res["exec"][name].append({"guestd": ours_ms, "floor": floor_ms, "qga": qga_ms})
        print(
            f"{name} run {i}: exec p50/p99 {ours_ms['p50']:.3f}/{ours_ms['p99']:.3f} ms, floor "
            f"{floor_ms['p50']:.3f}/{floor_ms['p99']:.3f}"
            + (f", qemu-ga {qga_ms['p50']:.3f}/{qga_ms['p99']:.3f}" if qga_ms else ""),
            file=sys.stderr,
        )


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__.split("\n")[0])
    p.add_argument("--configs", default="shipped,root", help="comma-separated: shipped, root")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--clients", type=int, default=64, help="load connections looping exec true (0: no load phase)")
    p.add_argument("--seconds", type=float, default=5.0, help="the load phase's length")
    p.add_argument("--exec-n", type=int, default=500, help="exec true samples per run (0: none)")
    p.add_argument("--no-qga", dest="qga", action="store_false", help="skip qemu-ga's exec")
    p.add_argument("--profile", default=None, metavar="FILE", help="py-spy --gil record under load, to FILE.<run>")
    p.add_argument(
        "--nice",
        type=int,
        default=0,
        help="run guestd N nice levels above the rest (its CPU is its own on a shared machine too)",
    )
    p.add_argument("--child-cpus", choices=["all", "inherit"], default="all", help="GUESTD_CHILD_ALL_CPUS")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    p.add_argument("--load", default=None, help=argparse.SUPPRESS)  # the load process itself
    ns = p.parse_args()
    import uvloop

    global SERVER_NICE
    SERVER_NICE = ns.nice
    os.environ["GUESTD_CHILD_ALL_CPUS"] = "1" if ns.child_cpus == "all" else "0"

    if ns.load:
        uvloop.run(load_main(ns.load, ns.clients))
        return
    res = uvloop.run(amain(ns))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(res, f, indent=1)
    print(report(res))


if __name__ == "__main__":
    main()
