"""guestd under its shipped settings on this host: a workload user and a workload cgroup.

rootfs-overlay/etc/guestd/guestd.toml ships ``[policy] workload_user`` and a ``[workload]``
cgroup; the bench runs a guestd with that ``[workload]`` table, its cgroup moved into a scratch
sub-tree of this host's cgroup v2 (the hybrid layout's /sys/fs/cgroup/unified: no controllers,
so the limits are not applied, but leaves, clone3 CLONE_INTO_CGROUP and cgroup.kill work), and
"nobody" as the workload user (the image's "sandbox" does not exist here). The scratch sub-tree
is created by ``scratch_cgroup`` and removed with everything in it afterwards.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import tomllib
from collections.abc import Iterator
from typing import Any

from guestd.testing.cgroups import UNIFIED, make_scratch, remove_tree

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SHIPPED_CONFIG = os.path.join(REPO, "rootfs-overlay", "etc", "guestd", "guestd.toml")
WORKLOAD_USER = "nobody"  # 65534 exists everywhere; the image's "sandbox" (uid 1000) does not exist here
EXEC_LOOPS = 64  # clients looping `exec true` while another one pings (issue 14's load)
SHIPPED_VS_ROOT_GOAL = 1.3
EXEC_FLOOR_GOAL = 1.3  # issue 34: exec `true` p50 against subprocess.run, in the shipped config as well as root
PING_RTT_GOAL = 1.5  # x the bare uvloop+msgpack echo's round trip
IDLE_RSS_GOAL = 1.15  # x the bare uvloop+msgpack server's idle RSS (issue 34)
START_GOAL = 1.1  # x the same server's spawn -> first reply


def shipped_workload_table() -> dict[str, Any]:
    with open(SHIPPED_CONFIG, "rb") as f:
        table: dict[str, Any] = tomllib.load(f).get("workload", {})
    return table


def toml_value(value: object) -> str:
    """The few TOML scalars a config uses (a JSON string is a TOML basic string for ASCII text)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, str) and value.isascii():
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    raise ValueError(f"cannot write {value!r} as TOML here")


def shipped_config_text(cgroup: str, user: str = WORKLOAD_USER, head: str = "") -> str:
    """The shipped ``[workload]`` table with ``cgroup`` in place of its path, and ``user`` as the
    workload user; ``head`` goes first (top-level keys such as ``listen``)."""
    workload = {**shipped_workload_table(), "cgroup": cgroup}
    lines = [head.rstrip("\n")] if head else []
    lines += ["[policy]", f"workload_user = {toml_value(user)}", "[workload]"]
    lines += [f"{key} = {toml_value(value)}" for key, value in workload.items()]
    return "\n".join(lines) + "\n"


def cgroup_unusable() -> str | None:
    """Why this host cannot run the shipped config (None when it can)."""
    if os.geteuid() != 0:
        return "not root (the workload user and the cgroup need root)"
    if not os.path.exists(os.path.join(UNIFIED, "cgroup.controllers")):
        return f"no cgroup v2 at {UNIFIED}"
    if not os.access(os.path.join(UNIFIED, "cgroup.procs"), os.W_OK):
        return f"{UNIFIED} is not writable"
    return None


@contextlib.contextmanager
def scratch_cgroup() -> Iterator[str]:
    """A fresh sub-tree of the host's cgroup v2 for the shipped guestd, removed afterwards."""
    path = make_scratch("guestd-bench")
    try:
        yield path
    finally:
        remove_tree(path)


@contextlib.contextmanager
def shared_dir(prefix: str) -> Iterator[str]:
    """A 0755 directory (the bench's own temp dir is 0700, which the workload user cannot enter)."""
    path = tempfile.mkdtemp(prefix=prefix)
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def other_qemu_pids() -> list[int]:
    """QEMU processes running on this machine that the bench did not start (they skew timings)."""
    out = subprocess.run(["ps", "-eo", "pid=,ppid=,comm="], capture_output=True, text=True, check=False).stdout
    me = os.getpid()
    pids = []
    for line in out.splitlines():
        parts = line.split(None, 2)
        if len(parts) == 3 and parts[2].startswith("qemu-system") and int(parts[1]) != me:
            pids.append(int(parts[0]))
    return pids


# --------------------------------------------------------------------------- report


def verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def target_rows(floor: dict[str, Any], g: dict[str, Any]) -> list[str]:
    """The Targets rows for exec under the shipped config and ping under the exec load."""
    s = g.get("shipped")
    if not s or "exec_true" not in s:
        note = (s or {}).get("skipped", "not measured")
        label = "exec `true` shipped config p50 vs root without settings p50"
        return [f"| {label} | skipped: {note} | - | - | <= {SHIPPED_VS_ROOT_GOAL}x | - |"]
    root_p50, ship_p50 = g["exec_true"]["p50_ms"], s["exec_true"]["p50_ms"]
    ratio = ship_p50 / root_p50
    floor_ratio = ship_p50 / floor["subprocess_true"]["p50_ms"]
    rows = [
        f"| exec `true` shipped config p50 vs root without settings p50 | {ship_p50:.3f} ms "
        f"(workload user {s['user']}, a leaf cgroup per run) | {root_p50:.3f} ms (guestd as root, no workload "
        f"settings) | {ratio:.2f}x | <= {SHIPPED_VS_ROOT_GOAL}x | {verdict(ratio <= SHIPPED_VS_ROOT_GOAL)} |",
        f"| exec `true` shipped config p50 vs the floor | {ship_p50:.3f} ms "
        f"| {floor['subprocess_true']['p50_ms']:.3f} ms (`subprocess.run(['true'])`) | {floor_ratio:.2f}x "
        f"| <= {EXEC_FLOOR_GOAL}x | {verdict(floor_ratio <= EXEC_FLOOR_GOAL)} |",
    ]
    for label, cc in (("shipped config", s.get("concurrency")), ("root without settings", g.get("concurrency"))):
        if cc is None:
            continue
        p99 = cc["ping_under_load"]["p99_ms"]
        # The pinger shares its event loop (and CPU) with the load clients here, so its own
        # loop's lag is in the figure: context; the goal is judged by bench/load.py's rows.
        rows.append(
            f"| ping p99 while {cc['clients']} clients loop `exec true` in the pinger's own process, {label} "
            f"| {p99:.2f} ms ({cc['execs_per_s']:.0f} execs/s) | {g['ping']['p99_ms']:.3f} ms (idle ping p99) | - "
            f"| (context: the pinger's loop runs the load too) | - |"
        )
    return rows


def detail_rows(g: dict[str, Any]) -> list[str]:
    s = g.get("shipped") or {}
    if "exec_true" not in s:
        return []
    e = s["exec_true"]
    label = "guestd shipped config: `exec ['true']` (same rounds)"
    return [f"| {label} | {e['p50_ms']:.3f} | {e['p99_ms']:.3f} | {e['n']} |"]


def notes(res: dict[str, Any]) -> list[str]:
    s = res["guestd"].get("shipped") or {}
    lines = []
    if "exec_true" in s:
        lines.append(
            f"- **Shipped config on this host**: `[workload]` of rootfs-overlay's guestd.toml with its cgroup in a "
            f"scratch sub-tree `{s['cgroup']}` (removed afterwards; no controllers there, so limits are not "
            f"applied), workload user `{s['user']}`. guestd reported spawn `{s['spawn']}`, workload cgroup "
            f"`{s['workload_cgroup']}`; a run there sees `{' '.join(s.get('child_sees', []))}`. The root guestd "
            f"reported spawn `{res['guestd'].get('spawn', '?')}`."
        )
    others = res.get("other_qemu_pids") or []
    if others:
        lines.append(
            f"- **Shared machine**: {len(others)} QEMU process(es) of another test run were running during this "
            "run (pids " + ", ".join(map(str, others)) + "); under TCG each keeps a core busy, so figures here "
            "are slower and noisier than on an idle machine."
        )
    return lines
