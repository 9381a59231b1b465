"""exec ``true`` and ping under load inside the baked test image under QEMU/TCG.

    .venv/bin/python -m bench.run --guest      (or: python -m bench.guest)

Boots the image the QEMU suite uses (guestd/testing/qemu.py: Debian's kernel, guestd-init as
PID 1), writes bench/guest_probe.py and two configs into it over virtio-serial, and runs the
probe with guestd-python, so every figure is measured inside the guest: the serial link to the
host is not in them. The probe starts two more guestds on Unix sockets, one with the shipped
``[workload]`` table (its cgroup /sys/fs/cgroup/gship-workload) and workload user "nobody", one
without workload settings. Needs qemu-system-x86, busybox-static, cpio and kmod.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

from bench.shipped import (
    EXEC_FLOOR_GOAL,
    IDLE_RSS_GOAL,
    PING_RTT_GOAL,
    START_GOAL,
    other_qemu_pids,
    shipped_config_text,
    verdict,
)
from guestd.testing.qemu import GuestVM, bake_initramfs, ensure_kernel

HERE = os.path.dirname(os.path.abspath(__file__))
EXEC_LOOPS = 16  # exec loops in the guest under TCG (the host uses 64)
PING_UNDER_LOAD_GOAL_MS = 50.0
SHIPPED_VS_PLAIN_GOAL = 1.3
GUEST_PYTHON = "/usr/local/bin/guestd-python"
RESTORE_CONTEXTS = 8  # issue 34: a restore with 8 live contexts in under 10 ms
RESTORE_GOAL_MS = 10.0
START_CONFIG = "/tmp/gstart.toml"
FLOOR_DIR = "/tmp/bench-floor"  # where bench/guest_probe.py runs the floor server from


def daemon_head(name: str) -> str:
    """Top-level keys of a second guestd in the guest: its own socket, state and workspace."""
    return (
        f'listen = ["unix:/run/{name}.sock"]\nruntime_dir = "/run/{name}"\nworkspace = "/tmp/{name}-ws"\n'
        "[code]\npool = 0\n"
    )


def guest_configs() -> dict[str, str]:
    """(name -> TOML text): the shipped-like guestd and one without workload settings."""
    return {
        "shipped": shipped_config_text("/sys/fs/cgroup/gship-workload", head=daemon_head("gship")),
        "plain": daemon_head("gplain"),
        # started and stopped in rounds against the floor (its own workload cgroup: a guestd's
        # start ends what runs in its cgroup, and "shipped" runs meanwhile)
        "start": shipped_config_text("/sys/fs/cgroup/gstart-workload", head=daemon_head("gstart")),
    }


def measure_guest(quick: bool) -> dict[str, Any]:
    configs = {"shipped": "/tmp/gship.toml", "plain": "/tmp/gplain.toml", "start": START_CONFIG}
    daemons = {name: path for name, path in configs.items() if name != "start"}
    params: dict[str, Any] = {
        "rounds": 3 if quick else 6,
        "n_exec": 10 if quick else 25,
        "loops": EXEC_LOOPS,
        "pings": 40 if quick else 100,
        "restore_contexts": 2 if quick else RESTORE_CONTEXTS,
        "restores": 10 if quick else 20,
        "daemons": daemons,
        "start_config": START_CONFIG,
        "start_rounds": 3 if quick else 7,
        "start_pings": 30,
    }
    others_before = other_qemu_pids()
    vmlinux, kdir = ensure_kernel()
    work = tempfile.mkdtemp(prefix="guestd-bench-vm-")
    try:
        t = time.monotonic()
        initrd = bake_initramfs(work, kdir)
        print(f"baked the test image in {time.monotonic() - t:.0f} s", file=sys.stderr)
        vm = GuestVM(work, vmlinux, initrd, timeout_s=1800, tag="bench")
        try:
            t = time.monotonic()
            with vm.client() as c:
                print(f"guest answered after {time.monotonic() - t:.0f} s", file=sys.stderr)
                with open(os.path.join(HERE, "guest_probe.py"), "rb") as f:
                    c.write_file("/tmp/guest_probe.py", f.read())
                for name, text in guest_configs().items():
                    c.write_file(configs[name], text)
                for name in ("floor_server.py", "floor_client.py"):  # the floor, on guestd's Python
                    with open(os.path.join(HERE, name), "rb") as f:
                        c.write_file(f"{FLOOR_DIR}/{name}", f.read(), parents=True)
                r = c.exec(
                    [GUEST_PYTHON, "/tmp/guest_probe.py", json.dumps(params)], timeout_s=1500, max_output=1 << 20
                )
                if r.exit_code != 0:
                    raise RuntimeError(f"guest probe failed ({r.exit_code}):\n{r.stderr.decode()[-4000:]}")
                res: dict[str, Any] = json.loads(r.stdout)
                res["probe_log"] = r.stderr.decode()[-4000:]
        finally:
            vm.kill()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["params"] = params
    res["generated"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    res["other_qemu_pids"] = sorted(set(others_before) | set(other_qemu_pids()))
    return res


def render_guest(g: dict[str, Any], host_floor_ms: float | None = None) -> str:
    """The guest section; ``host_floor_ms`` (the host bench's ``subprocess.run(['true'])`` p50)
    scales goals given in milliseconds for hardware by how much slower TCG runs the same floor."""
    ex, load, idle = g["exec_true"], g["load"], g["ping_idle"]
    ratio = ex["shipped"]["p50_ms"] / ex["plain"]["p50_ms"]
    info = g["guest"]
    lines = [
        "",
        "## In the QEMU guest (TCG)",
        "",
        f"Generated by `python -m bench.run --guest` on {g['generated']}: the baked test image under QEMU/TCG "
        f"(-smp 2, Linux {info['kernel']}, Python {info['python']}), measured from inside the guest by "
        "bench/guest_probe.py (run with guestd-python), so the virtio-serial link is not in the figures. "
        "Two guestds besides the image's own, each on a Unix socket with `[code] pool = 0`: *shipped* "
        "(the shipped `[workload]` table, cgroup `/sys/fs/cgroup/gship-workload`, workload user `nobody`) and "
        "*no settings* (root, no workload user, no workload cgroup). Client on guest CPU "
        f"{info['client_cpus']}, guestds and their children on {info['server_cpus']}; the probe and the "
        "guestds run in a sibling cgroup of the workload at the default cpu.weight (as guestd does in "
        "production), not in the image guestd's workload cgroup. A third guestd with the shipped `[workload]` "
        "table (its own cgroup `/sys/fs/cgroup/gstart-workload`) is started and stopped first, in rounds "
        "interleaved with the floor server (bench/floor_server.py, from its compiled module on guestd's own "
        "Python), for the start, idle round trip and idle RSS rows. Under TCG every figure is milliseconds, and "
        "a ratio to a floor is not what hardware gives: TCG slows guestd's longer path more than the floors' "
        "(exec and the round trip measured higher ratios here than on the host with the same code, "
        "2026-12-05); the host bench's ratios are the hardware's.",
        "",
        "| target | shipped | no settings | floor | ratio | goal | verdict |",
        "|---|---|---|---|---|---|---|",
        f"| exec `true` p50, shipped vs no settings | {ex['shipped']['p50_ms']:.2f} ms "
        f"| {ex['plain']['p50_ms']:.2f} ms "
        f"| {ex['floor']['p50_ms']:.2f} ms (`subprocess.run`) | {ratio:.2f}x | <= {SHIPPED_VS_PLAIN_GOAL}x "
        f"| {verdict(ratio <= SHIPPED_VS_PLAIN_GOAL)} |",
    ]
    floor_ms = ex["floor"]["p50_ms"]
    for name, label in (("shipped", "shipped"), ("plain", "no settings")):
        r = ex[name]["p50_ms"] / floor_ms
        cells = [f"{ex[name]['p50_ms']:.2f} ms", "-"] if name == "shipped" else ["-", f"{ex[name]['p50_ms']:.2f} ms"]
        lines.append(
            f"| exec `true` p50 vs `subprocess.run`, {label} | {cells[0]} | {cells[1]} "
            f"| {floor_ms:.2f} ms (`subprocess.run`) | {r:.2f}x | <= {EXEC_FLOOR_GOAL}x "
            f"| {verdict(r <= EXEC_FLOOR_GOAL)} |"
        )
    lines += start_rows(g.get("starts"))
    for name, label in (("shipped", "shipped"), ("plain", "no settings")):
        p99 = load[name]["ping_under_load"]["p99_ms"]
        cells = [f"{p99:.1f} ms", "-"] if name == "shipped" else ["-", f"{p99:.1f} ms"]
        lines.append(
            f"| ping p99 while {load[name]['clients']} clients loop `exec true`, {label} | {cells[0]} | {cells[1]} "
            f"| - | - | <= {PING_UNDER_LOAD_GOAL_MS:.0f} ms | {verdict(p99 <= PING_UNDER_LOAD_GOAL_MS)} |"
        )
    restore = g.get("restore")
    if restore is not None:
        r50 = restore["in_guest"]["p50_ms"]
        if host_floor_ms:  # TCG emulates every instruction: a millisecond goal for hardware scales with it
            slowdown = ex["floor"]["p50_ms"] / host_floor_ms
            goal_ms = RESTORE_GOAL_MS * slowdown
            goal = f"< {goal_ms:.0f} ms ({RESTORE_GOAL_MS:.0f} ms x {slowdown:.0f}, TCG's slowdown of the floor)"
        else:
            goal_ms, goal = RESTORE_GOAL_MS, f"< {RESTORE_GOAL_MS:.0f} ms"
        lines.append(
            f"| restore with {restore['contexts']} live contexts, p50 (guestd's own duration) | - | {r50:.2f} ms "
            f"| {ex['floor']['p50_ms']:.2f} ms (`subprocess.run`) | {r50 / ex['floor']['p50_ms']:.2f}x | {goal} "
            f"| {verdict(r50 < goal_ms)} |"
        )
    starts = g.get("starts")
    start_details = (
        (
            ("start to first reply, floor server (spawn -> first ping reply)", starts["floor"]["first_reply"]),
            ("start to first reply, shipped (spawn -> hello -> first ping reply)", starts["shipped"]["first_reply"]),
            ("ping after start, floor server", starts["floor"]["ping"]),
            ("ping after start, shipped", starts["shipped"]["ping"]),
        )
        if starts is not None
        else ()
    )
    lines += [
        "",
        "| in the guest | p50 ms | p99 ms | max ms | n |",
        "|---|---|---|---|---|",
        *(
            f"| {label} | {s['p50_ms']:.2f} | {s['p99_ms']:.2f} | {s['max_ms']:.2f} | {s['n']} |"
            for label, s in (
                ("floor: `subprocess.run(['true'])` in the probe", ex["floor"]),
                ("exec `true`, no settings", ex["plain"]),
                ("exec `true`, shipped", ex["shipped"]),
                ("ping, idle, no settings", idle["plain"]),
                ("ping, idle, shipped", idle["shipped"]),
                (f"ping under {load['plain']['clients']} exec loops, no settings", load["plain"]["ping_under_load"]),
                (f"ping under {load['shipped']['clients']} exec loops, shipped", load["shipped"]["ping_under_load"]),
                *start_details,
                *(
                    (
                        (f"restore, {restore['contexts']} contexts, round trip, no settings", restore["rtt"]),
                        (f"restore, {restore['contexts']} contexts, in guestd, no settings", restore["in_guest"]),
                        (f"restore, re-seeding {restore['contexts']} contexts (within it)", restore["reseeding"]),
                    )
                    if restore is not None
                    else ()
                ),
            )
        ),
        "",
        f"Throughput under the loops: {load['shipped']['execs_per_s']:.0f} execs/s shipped, "
        f"{load['plain']['execs_per_s']:.0f} execs/s without settings. guestd reported spawn "
        f"`{g['daemons']['shipped']['spawn']}` / `{g['daemons']['plain']['spawn']}` and workload cgroup "
        f"`{g['daemons']['shipped']['workload_cgroup']}` / `{g['daemons']['plain']['workload_cgroup']}`. "
        f"cgroup2 mount: `{'; '.join(info['cgroup2_mount'])}`.",
        "",
        "The shipped workload cgroup has cpu.weight 10 against the daemons' default 100 (this VM has the cpu "
        "controller; the host bench's cgroup has none): under the loops guestd wins the CPU, so ping stays low and "
        "the children wait, which is why the shipped guestd completes fewer execs per second than the one without "
        "settings, whose children compete with it at equal weight.",
    ]
    if g.get("other_qemu_pids"):
        lines += [
            "",
            f"Another test run's QEMU ({len(g['other_qemu_pids'])} process(es)) ran on this 2-core host during "
            "this run; each TCG vCPU thread competes with the bench VM's, so these figures are slower and "
            "noisier than on an idle host.",
        ]
    return "\n".join(lines) + "\n"


def start_rows(starts: dict[str, Any] | None) -> list[str]:
    """Rows of the shipped guestd against the floor server, both started in rounds on guestd's own
    Python in the guest: the idle round trip, start to first reply, idle RSS."""
    if starts is None:
        return []
    floor, shipped = starts["floor"], starts["shipped"]
    rows = []
    for what, key, goal in (
        ("ping round trip p50 (after start)", "ping", PING_RTT_GOAL),
        ("start to first reply p50 (spawn -> first ping reply; a hello first for guestd)", "first_reply", START_GOAL),
    ):
        mine, base = shipped[key]["p50_ms"], floor[key]["p50_ms"]
        rows.append(
            f"| {what}, shipped | {mine:.2f} ms | - | {base:.2f} ms (bare uvloop+msgpack server) "
            f"| {mine / base:.2f}x | <= {goal}x | {verdict(mine / base <= goal)} |"
        )
    rss, base_rss = shipped["idle_rss_kib"] / 1024, floor["idle_rss_kib"] / 1024
    rows.append(
        f"| idle RSS (after a hello and the pings, then 1 s), shipped | {rss:.1f} MiB | - "
        f"| {base_rss:.1f} MiB (bare uvloop+msgpack server) | {rss / base_rss:.2f}x | <= {IDLE_RSS_GOAL}x "
        f"| {verdict(rss / base_rss <= IDLE_RSS_GOAL)} |"
    )
    return rows


def main() -> None:
    from bench.run import main as run_main

    sys.argv = [sys.argv[0], "--guest", *sys.argv[1:]]
    run_main()


if __name__ == "__main__":
    main()
