"""Trees and search (issue 18) against floors measured in the same run.

    .venv/bin/python -m bench.trees [--files N]

- tree upload / download of a real repository checkout (a local clone of this repository with
  its .git, plus the CPython standard library beside it, so there are thousands of files), in
  files/s and MB/s, against ``tar -c | <unix socket> | tar -x`` (up) and
  ``tar -c | <unix socket> | cat > /dev/null`` (down), interleaved rounds (``--rounds``, 5):
  the median of each side and the ratio of the medians, the range of the rounds' own ratios
  (a shared machine moves both sides), and CPU seconds (guestd's process and this client
  against tar's and cat's), which other work on the machine moves less than wall time; in the
  system's temp directory and again in tmpfs (/dev/shm), where the disk's inode allocator
  (which other work creating and removing files makes slow for both sides) is left out;
- ``file.grep`` (ripgrep, spawned by guestd as a workload process and its lines streamed as
  events) on a generated tree of N files (default 50,000) against ``rg`` run directly on the
  same tree with the same printer (target: within 2x): no match (the cost of starting rg as a
  workload process), one line in 50 files, and one line in every file (N events: the cost of
  one event per line).

guestd runs as a separate process with a workspace and (as root) the workload user nobody, as
it is shipped. Writes bench/TREES.md.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from typing import Any

from guestd.testing import Guestd, start_guestd

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MB = 1e6


def tree_size(root: str) -> tuple[int, int]:
    files = size = 0
    for d, dirs, names in os.walk(root):
        files += len(names) + len(dirs)
        for n in names:
            size += os.lstat(os.path.join(d, n)).st_size
    return files, size


def tar_through_socket(src: str, sink: list[str]) -> float:
    """``tar -c`` into one end of a unix socket pair, ``sink`` reading the other; seconds."""
    a, b = socket.socketpair()
    t0 = time.perf_counter()
    writer = subprocess.Popen(["tar", "-C", src, "-cf", "-", "."], stdout=a.fileno())
    reader = subprocess.Popen(sink, stdin=b.fileno(), stdout=subprocess.DEVNULL)
    a.close()
    b.close()
    writer.wait()
    reader.wait()
    return time.perf_counter() - t0


def fs_type(path: str) -> str:
    """The file system type of the mount holding ``path`` (from /proc/self/mounts)."""
    best, kind = "", "?"
    with open("/proc/self/mounts") as f:
        for line in f:
            _, mount, fstype = line.split()[:3]
            if path.startswith(mount.rstrip("/") + "/") and len(mount) > len(best):
                best, kind = mount, fstype
    return kind


def children_cpu() -> float:
    """CPU seconds of this process's waited-for children (the floors' tar and cat)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def own_cpu() -> float:
    """CPU seconds of this process, all its threads (the client)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def process_cpu(pid: int) -> float:
    """CPU seconds of another process so far (guestd), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def make_checkout(top: str) -> str:
    src = f"{top}/checkout"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", REPO, src], check=True)
    stdlib = sysconfig.get_paths()["stdlib"]
    shutil.copytree(
        stdlib, f"{src}/stdlib", symlinks=True, ignore=shutil.ignore_patterns("__pycache__", "site-packages")
    )
    return src


def make_search_tree(root: str, n: int) -> None:
    """``n`` files of ~1.5 KB in 100-file directories; one line in 50 files matches."""
    body = "".join(f"    value_{i} = compute(value_{i - 1}, {i})  # line {i}\n" for i in range(30))
    for i in range(n):
        d = f"{root}/d{i // 1000:03d}/s{(i // 100) % 10}"
        if i % 100 == 0:
            os.makedirs(d, exist_ok=True)
        with open(f"{d}/f{i}.py", "w") as f:
            f.write(body + ("needle_marker = True\n" if i % 50 == 0 else ""))


def start_workspace_guestd(where: str | None) -> tuple[Guestd, str, str]:
    """A guestd with a workspace in a new directory under ``where`` (as shipped: workload user
    nobody when root); returns it, the top directory and the workspace."""
    top = tempfile.mkdtemp(prefix="guestd-bench-trees-", dir=where)
    os.chmod(top, 0o755)
    ws = f"{top}/ws"
    os.makedirs(ws)
    config = f'workspace = "{ws}"\n'
    if os.geteuid() == 0:
        config += '[policy]\nworkload_user = "nobody"\n'
    with open(f"{top}/guestd.toml", "w") as f:
        f.write(config)
    return start_guestd(top, "--config", f"{top}/guestd.toml"), top, ws


def measure_trees(where: str | None, rounds: int) -> list[str]:
    """The upload and download rows, the trees in a new directory under ``where``."""
    return [tree_row(t) for t in tree_figures(where, rounds)]


def tree_row(t: dict[str, Any]) -> str:
    """One TREES.md row of :func:`tree_figures`' ``t``."""
    files, size, floor, guest = t["files"], t["bytes"], t["floor_s"], t["guestd_s"]
    return (
        f"| {t['label']} ({files} entries, {size / MB:.0f} MB, {t['fs']}) | {files / floor:,.0f} files/s, "
        f"{size / MB / floor:,.0f} MB/s; CPU {t['floor_cpu_s']:.2f} s | {files / guest:,.0f} files/s, "
        f"{size / MB / guest:,.0f} MB/s; CPU {t['guestd_cpu_s']:.2f} s (guestd {t['guestd_own_cpu_s']:.2f}) "
        f"| {floor / guest:.0%} (rounds {t['ratio_min']:.0%}-{t['ratio_max']:.0%}; "
        f"CPU {t['floor_cpu_s'] / t['guestd_cpu_s']:.0%}) |"
    )


def tree_figures(where: str | None, rounds: int) -> list[dict[str, Any]]:
    """Tree upload and download against tar's floor (``label``, ``files``, ``bytes``, ``fs``,
    medians ``floor_s`` and ``guestd_s``, the rounds' ratio range, CPU seconds), the trees in a
    new directory under ``where``."""
    g, top, ws = start_workspace_guestd(where)
    figures: list[dict[str, Any]] = []
    try:
        with g.client() as c:
            n = [0]
            src = make_checkout(top)
            files, size = tree_size(src)

            def timed(transfer: Callable[[], None]) -> tuple[float, float, float]:
                """Wall seconds, CPU seconds (guestd + this client, or tar + cat) and guestd's share
                of them, of one transfer."""
                guestd0 = process_cpu(g.proc.pid)
                cpu0 = guestd0 + own_cpu() + children_cpu()
                t0 = time.perf_counter()
                transfer()
                wall = time.perf_counter() - t0
                guestd1 = process_cpu(g.proc.pid)
                return wall, guestd1 + own_cpu() + children_cpu() - cpu0, guestd1 - guestd0

            def up_guestd() -> None:
                n[0] += 1
                c.upload_tree(src, f"{ws}/up{n[0]}")

            def up_floor() -> None:
                n[0] += 1
                os.makedirs(f"{ws}/floor{n[0]}")
                tar_through_socket(src, ["tar", "-C", f"{ws}/floor{n[0]}", "-xf", "-"])

            def down_guestd() -> None:
                c.download_tree(f"{ws}/up1", max_bytes=1 << 34)

            def down_floor() -> None:
                tar_through_socket(f"{ws}/up1", ["cat"])

            runs: dict[str, list[tuple[float, float, float]]] = {"up_g": [], "up_f": [], "down_g": [], "down_f": []}
            for _ in range(rounds):  # interleaved
                for key, transfer in (
                    ("up_g", up_guestd),
                    ("up_f", up_floor),
                    ("down_g", down_guestd),
                    ("down_f", down_floor),
                ):
                    runs[key].append(timed(transfer))
            for label, key in (("tree upload", "up"), ("tree download", "down")):
                guest_runs, floor_runs = runs[f"{key}_g"], runs[f"{key}_f"]
                guest = statistics.median(w for w, _, _ in guest_runs)
                floor = statistics.median(w for w, _, _ in floor_runs)
                ratios = sorted(f / g_ for (g_, _, _), (f, _, _) in zip(guest_runs, floor_runs, strict=True))
                guest_cpu = statistics.median(c_ for _, c_, _ in guest_runs)
                guestd_cpu = statistics.median(d for _, _, d in guest_runs)
                floor_cpu = statistics.median(c_ for _, c_, _ in floor_runs)
                figures.append(
                    {
                        "label": label,
                        "files": files,
                        "bytes": size,
                        "fs": fs_type(top),
                        "floor_s": floor,
                        "guestd_s": guest,
                        "ratio": floor / guest,
                        "ratio_min": ratios[0],
                        "ratio_max": ratios[-1],
                        "floor_cpu_s": floor_cpu,
                        "guestd_cpu_s": guest_cpu,
                        "guestd_own_cpu_s": guestd_cpu,
                    }
                )
    finally:
        g.stop()
        shutil.rmtree(top, ignore_errors=True)
    return figures


def measure_grep(files: int) -> list[str]:
    """The grep rows: guestd's file.grep against rg run directly on a generated tree."""
    rg = shutil.which("rg")
    if rg is None:
        return []
    g, top, ws = start_workspace_guestd(None)
    rows: list[str] = []
    try:
        with g.client() as c:
            search = f"{ws}/search"
            make_search_tree(search, files)
            os.chmod(ws, 0o755)

            def rg_direct(pattern: str) -> float:
                assert rg is not None
                t0 = time.perf_counter()
                subprocess.run(  # the printer guestd asks for (search.rg_command), into a pipe; 1: no match
                    [
                        rg,
                        "--null",
                        "--with-filename",
                        "--line-number",
                        "--no-heading",
                        "--max-columns",
                        "4096",
                        "--max-columns-preview",
                        "--no-messages",
                        "--",
                        pattern,
                        ".",
                    ],
                    cwd=search,
                    stdout=subprocess.PIPE,
                    check=pattern != "no_such_marker",
                )
                return time.perf_counter() - t0

            def via(pattern: str, want: int) -> float:
                t0 = time.perf_counter()
                r = c.grep(search, pattern, max_matches=1_000_000, timeout_s=600)
                assert r.matches == want and r.engine == "rg", r.matches
                return time.perf_counter() - t0

            for label, pattern, want in (
                ("no line matches", "no_such_marker", 0),
                ("one line in 50 files", "needle_marker", (files + 49) // 50),
                ("one line in every file", "value_29 =", files),
            ):
                floors, guests = [], []
                for _ in range(3):  # interleaved
                    floors.append(rg_direct(pattern))
                    guests.append(via(pattern, want))
                floor, t = min(floors), min(guests)
                rows.append(
                    f"| grep, {files:,} files, {label} | rg directly: {floor * 1000:.0f} ms "
                    f"| {t * 1000:.0f} ms | {t / floor:.2f}x (goal <= 2x{', met' if t <= 2 * floor else ''}) |"
                )
    finally:
        g.stop()
        shutil.rmtree(top, ignore_errors=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=50_000)
    ap.add_argument("--grep-only", action="store_true", help="only the grep rows (printed, TREES.md left alone)")
    ap.add_argument("--trees-only", action="store_true", help="only the tree rows (printed, TREES.md left alone)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the tree transfers")
    ap.add_argument(
        "--tmp",
        default=None,
        help="where the trees go (default: the system's temp directory, and /dev/shm too when it exists)",
    )
    ap.add_argument(
        "--note",
        action="append",
        default=[],
        help="a paragraph for TREES.md (what else ran on the machine, earlier figures); repeatable",
    )
    ns = ap.parse_args()
    load_before = os.getloadavg()[0]  # other work on the machine skews every figure: stated with them
    rows: list[str] = []
    if not ns.grep_only:
        # The system's temp directory (a disk here) and tmpfs: on a disk shared with other work the
        # file system's own allocator moves both sides by several times; tmpfs leaves it out.
        places = [ns.tmp] if ns.tmp is not None else [None, *(["/dev/shm"] if os.path.isdir("/dev/shm") else [])]
        for where in places:
            rows += measure_trees(where, ns.rounds)
    if not ns.trees_only:
        rows += measure_grep(ns.files)
    report = "\n".join(
        [
            "# Trees and search benchmark (bench/trees.py)",
            "",
            "guestd in its own process (workspace, workload user nobody), the client here, one machine"
            f" ({os.cpu_count()} CPUs, load average {load_before:.1f} before the run, {os.getloadavg()[0]:.1f} after).",
            f"Trees: {ns.rounds} interleaved rounds against `tar -c | unix socket | tar -x` (upload) and",
            "`tar -c | unix socket | cat` (download): medians of each side and the ratio of the medians, the",
            "range of the rounds' own ratios, and CPU seconds (guestd's process and the client; tar and cat),",
            "in the system's temp directory and in tmpfs (the file system type is in each row); guestd's",
            "own share of the CPU in brackets.",
            "Grep: best of 3 against `rg` run directly (the printer guestd asks rg for, into a pipe; guestd:",
            "rg as a workload process, each line an event to the client).",
            "",
            "| measure | floor | guestd | guestd / floor |",
            "|---|---|---|---|",
            *rows,
            "",
            *(line for note in ns.note for line in (note, "")),
        ]
    )
    if not ns.grep_only and not ns.trees_only:
        with open(os.path.join(HERE, "TREES.md"), "w") as f:
            f.write(report)
    sys.stdout.write(report)


if __name__ == "__main__":
    main()
