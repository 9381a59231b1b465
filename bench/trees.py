"""Trees and search (issue 18) against floors measured in the same run.

    .venv/bin/python -m bench.trees [--files N]

- tree upload / download of a real repository checkout (a local clone of this repository with
  its .git, plus the CPython standard library beside it, so there are thousands of files), in
  files/s and MB/s, against ``tar -c | <unix socket> | tar -x`` (up) and
  ``tar -c | <unix socket> | cat > /dev/null`` (down), best of 3, interleaved;
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
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time

from guestd.testing import start_guestd

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=50_000)
    ap.add_argument("--grep-only", action="store_true", help="only the grep rows (printed, TREES.md left alone)")
    ns = ap.parse_args()
    load_before = os.getloadavg()[0]  # other work on the machine skews every figure: stated with them
    top = tempfile.mkdtemp(prefix="guestd-bench-trees-")
    os.chmod(top, 0o755)
    ws = f"{top}/ws"
    os.makedirs(ws)
    config = f'workspace = "{ws}"\n'
    if os.geteuid() == 0:
        config += '[policy]\nworkload_user = "nobody"\n'
    with open(f"{top}/guestd.toml", "w") as f:
        f.write(config)
    g = start_guestd(top, "--config", f"{top}/guestd.toml")
    rows: list[str] = []
    try:
        with g.client() as c:
            n = [0]

            def up_guestd() -> float:
                n[0] += 1
                t0 = time.perf_counter()
                c.upload_tree(src, f"{ws}/up{n[0]}")
                return time.perf_counter() - t0

            def up_floor() -> float:
                n[0] += 1
                os.makedirs(f"{ws}/floor{n[0]}")
                return tar_through_socket(src, ["tar", "-C", f"{ws}/floor{n[0]}", "-xf", "-"])

            def down_guestd() -> float:
                t0 = time.perf_counter()
                c.download_tree(f"{ws}/up1", max_bytes=1 << 34)
                return time.perf_counter() - t0

            def down_floor() -> float:
                return tar_through_socket(f"{ws}/up1", ["cat"])

            up_g: list[float] = []
            up_f: list[float] = []
            down_g: list[float] = []
            down_f: list[float] = []
            src = "" if ns.grep_only else make_checkout(top)
            files, size = (0, 0) if ns.grep_only else tree_size(src)
            for _ in range(0 if ns.grep_only else 3):  # interleaved
                up_g.append(up_guestd())
                up_f.append(up_floor())
                down_g.append(down_guestd())
                down_f.append(down_floor())
            for label, guest, floor in (
                ("tree upload", min(up_g, default=0), min(up_f, default=0)),
                ("tree download", min(down_g, default=0), min(down_f, default=0)),
            ):
                if ns.grep_only:
                    break
                rows.append(
                    f"| {label} ({files} entries, {size / MB:.0f} MB) | {files / floor:,.0f} files/s, "
                    f"{size / MB / floor:,.0f} MB/s | {files / guest:,.0f} files/s, {size / MB / guest:,.0f} MB/s "
                    f"| {floor / guest:.0%} |"
                )
            search = f"{ws}/search"
            make_search_tree(search, ns.files)
            os.chmod(ws, 0o755)
            rg = shutil.which("rg")

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

            if rg is not None:
                for label, pattern, want in (
                    ("no line matches", "no_such_marker", 0),
                    ("one line in 50 files", "needle_marker", (ns.files + 49) // 50),
                    ("one line in every file", "value_29 =", ns.files),
                ):
                    floors, guests = [], []
                    for _ in range(3):  # interleaved
                        floors.append(rg_direct(pattern))
                        guests.append(via(pattern, want))
                    floor, t = min(floors), min(guests)
                    rows.append(
                        f"| grep, {ns.files:,} files, {label} | rg directly: {floor * 1000:.0f} ms "
                        f"| {t * 1000:.0f} ms | {t / floor:.2f}x (goal <= 2x{', met' if t <= 2 * floor else ''}) |"
                    )
    finally:
        g.stop()
        shutil.rmtree(top, ignore_errors=True)
    report = "\n".join(
        [
            "# Trees and search benchmark (bench/trees.py)",
            "",
            "guestd in its own process (workspace, workload user nobody), the client here, one machine"
            f" ({os.cpu_count()} CPUs, load average {load_before:.1f} before the run, {os.getloadavg()[0]:.1f} after).",
            "Floors measured in the same run, interleaved, best of 3: `tar -c | unix socket | tar -x` for",
            "uploads, `tar -c | unix socket | cat` for downloads, `rg` run directly for grep (the printer",
            "guestd asks rg for, into a pipe; guestd: rg as a workload process, each line an event to the client).",
            "",
            "| measure | floor | guestd | guestd / floor |",
            "|---|---|---|---|",
            *rows,
            "",
        ]
    )
    if not ns.grep_only:
        with open(os.path.join(HERE, "TREES.md"), "w") as f:
            f.write(report)
    sys.stdout.write(report)


if __name__ == "__main__":
    main()
