"""grep against a hostile workload (issue 29, defects 2, 4, 5, 6), on a real guestd.

grep is ripgrep in every deployment, spawned through ``guestd.children`` like every workload
process: a pattern that backtracks forever in Python's ``re`` answers at once and never stops
guestd answering others; a pattern rg refuses (look-around) is the same typed error in every
deployment; a match at the end of a 20 MiB line is reported, cut and flagged; rg runs in a
run leaf of the workload cgroup, as the workload user (nobody where guestd is root without
one), with OOM score 0 and the fd limit guestd was given, and is killed by the request's
timeout and cancel; grep works while guestd's fd numbers are above 1024 (no select()).

rg's memory under the workload's memory limit (a 200 MiB line) needs a memory controller this
host's cgroup v2 lacks: tests/qemu/test_systemd.py.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

import psutil
import pytest

from guestd.client import AsyncClient, GuestdError
from guestd.testing import Guestd, start_guestd, workspace_guestd
from guestd.testing.cgroups import contained_config
from guestd.testing.local import live_procs_with

pytestmark = pytest.mark.skipif(shutil.which("rg") is None, reason="grep needs ripgrep (scripts/test.sh installs it)")

REDOS = "(a+)+b"  # exponential in a backtracking engine over a line of a's without a b
LINE_OF_AS = "a" * 40 + "\n"
CHILD_OOM = "321"  # what guestd sets on every process it starts (0 by default; marked here)


def _tree(top: str) -> str:
    """A tree everyone may read (rg runs as nobody in these guestds)."""
    tree = os.path.join(top, "tree")
    os.makedirs(tree)
    with open(f"{tree}/redos.txt", "w") as f:
        f.write(LINE_OF_AS * 3)
    with open(f"{tree}/look.txt", "w") as f:
        f.write("foobar\nfoobaz\n")
    with open(f"{tree}/plain.txt", "w") as f:
        f.write("one needle here\nnothing\n")
    for root, _dirs, files in os.walk(top):
        os.chmod(root, 0o755)
        for name in files:
            os.chmod(os.path.join(root, name), 0o644)
    return tree


@pytest.fixture
def as_root_without_user() -> Iterator[tuple[Guestd, str]]:
    """guestd as root with no workload user: where the old code picked the Python engine."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the deployment without a workload user is guestd as root")
    d = tempfile.mkdtemp(prefix="guestd-grep-root-")
    try:
        tree = _tree(d)
        g = start_guestd(d, "--runtime-dir", f"{d}/rt")
        try:
            yield g, tree
        finally:
            g.stop()
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def contained_grep(scratch: str) -> Iterator[tuple[Guestd, str, str]]:
    """(guestd in the shipped configuration, a tree, its workload cgroup): workload user nobody,
    a workload cgroup in ``scratch``, started with a soft fd limit of 1024 (guestd raises its
    own). GUESTD_CHILD_OOM_SCORE_ADJ marks what guestd's children get (the shipped unit starts
    guestd at -1000 and its children at 0; this host refuses a score below 0)."""

    def preexec() -> None:
        import resource

        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))

    d = tempfile.mkdtemp(prefix="guestd-grep-contained-")
    try:
        tree = _tree(d)
        os.mkfifo(f"{tree}/fifo", 0o666)
        os.chmod(f"{tree}/fifo", 0o666)
        workload = os.path.join(scratch, "workload")
        g = start_guestd(
            d, "--config", contained_config(d, workload), preexec=preexec, env={"GUESTD_CHILD_OOM_SCORE_ADJ": CHILD_OOM}
        )
        try:
            yield g, tree, workload
        finally:
            g.stop()
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _rg_of(marker: str) -> psutil.Process:
    """The rg process whose command line holds ``marker`` (a pattern no other process uses)."""
    for _ in range(500):
        found = [p for p in live_procs_with(marker) if os.path.basename(p.info["cmdline"][0]) == "rg"]
        if found:
            assert len(found) == 1
            return found[0]
        time.sleep(0.02)
    raise AssertionError(f"no rg with {marker!r} started")


def _soft_nofile(pid: int) -> int:
    with open(f"/proc/{pid}/limits") as f:
        line = next(ln for ln in f if ln.startswith("Max open files"))
    return int(line.split()[3])


def _wait_gone(proc: psutil.Process) -> None:
    for _ in range(500):
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.02)
    raise AssertionError(f"rg {proc.pid} still runs")


def test_a_backtracking_pattern_answers_and_guestd_keeps_answering(as_root_without_user: tuple[Guestd, str]) -> None:
    """`(a+)+b` over lines of 40 a's: the old Python engine (root, no workload user) held the
    GIL for hours and answered no ping; rg is linear."""
    g, tree = as_root_without_user

    async def main() -> None:
        async with await AsyncClient.connect(g.address) as searcher, await AsyncClient.connect(g.address) as other:
            search = asyncio.ensure_future(searcher.grep(tree, REDOS, timeout_s=20, deadline=60))
            await other.ping(deadline=30)  # answered meanwhile (bounded: a frozen guestd fails here)
            r = await search
            assert r.matches == 0 and not r.timed_out and r.engine == "rg"
            assert (await other.grep(f"{tree}/redos.txt", "(a+)+$", deadline=60)).matches == 3

    asyncio.run(main())


@pytest.mark.parametrize("deployment", ["root-without-user", "workload-user"])
def test_lookahead_is_the_same_typed_error_in_every_deployment(request: pytest.FixtureRequest, deployment: str) -> None:
    """One dialect: Python's re matched `foo(?=bar)` where rg refuses it."""
    if deployment == "root-without-user":
        g, tree = request.getfixturevalue("as_root_without_user")
    else:
        g, tree, _ = request.getfixturevalue("contained_grep")
    with g.client() as c, pytest.raises(GuestdError) as err:
        c.grep(tree, "foo(?=bar)", deadline=60)
    assert err.value.code == "bad_request" and err.value.details["field"] == "pattern"
    assert "look-around" in err.value.message


def test_a_match_at_the_end_of_a_20_mib_line_is_reported_cut(contained_grep: tuple[Guestd, str, str]) -> None:
    """rg --json wrote the whole line as one record; records over 16 MiB were dropped:
    `matches 0, truncated false`."""
    g, tree, _ = contained_grep
    with open(f"{tree}/long.txt", "wb") as f:
        f.write(b"x" * (20 * 1024 * 1024) + b"NEEDLE\nshort NEEDLE\n")
    os.chmod(f"{tree}/long.txt", 0o644)
    with g.client() as c:
        r = c.grep(f"{tree}/long.txt", "NEEDLE", deadline=120)
        assert r.matches == 2 and not r.truncated and not r.timed_out
        long, short = r.lines
        assert (long.line, long.truncated, long.text) == (1, True, b"x" * 4096)
        assert (short.line, short.truncated, short.text) == (2, False, b"short NEEDLE\n")
        assert c.grep(tree, "NEEDLE", deadline=120).matches == 2  # the same in a directory walk


def test_rg_is_a_workload_process(contained_grep: tuple[Guestd, str, str]) -> None:
    """rg in a run leaf of the workload cgroup, as the workload user, the OOM score of guestd's
    children (not guestd's own), the fd limit guestd was started with; killed by the request's
    timeout_s. (It reads a FIFO no one writes: it waits there until it is killed.)"""
    g, tree, workload = contained_grep
    marker = "marker-timeout-" + os.urandom(4).hex()

    async def main() -> None:
        async with await AsyncClient.connect(g.address) as c:
            search = asyncio.ensure_future(c.grep(f"{tree}/fifo", marker, timeout_s=3, deadline=60))
            rg = await asyncio.to_thread(_rg_of, marker)
            with open(f"/proc/{rg.pid}/cgroup") as f:
                cgroup = f.read()
            with open(f"/proc/{rg.pid}/oom_score_adj") as f:
                oom = f.read().strip()
            status = rg.status()
            uids = rg.uids()
            soft, guestd_soft = _soft_nofile(rg.pid), _soft_nofile(g.pid)
            r = await search
            assert r.timed_out and r.matches == 0
            await asyncio.to_thread(_wait_gone, rg)
            leaf = cgroup.strip().split("::", 1)[1]
            assert leaf.startswith(workload.removeprefix("/sys/fs/cgroup/unified") + "/grep-"), (cgroup, status)
            assert oom == CHILD_OOM
            assert (uids.real, uids.effective) == (65534, 65534)
            assert soft == 1024 and guestd_soft > 1024
            assert await c.ping() > 0

    asyncio.run(main())


def test_a_cancelled_grep_kills_rg(contained_grep: tuple[Guestd, str, str]) -> None:
    g, tree, _ = contained_grep
    marker = "marker-cancel-" + os.urandom(4).hex()

    async def main() -> None:
        async with await AsyncClient.connect(g.address) as c:
            search = asyncio.ensure_future(c.grep(f"{tree}/fifo", marker, timeout_s=600, deadline=600))
            rg = await asyncio.to_thread(_rg_of, marker)
            search.cancel()
            with pytest.raises(asyncio.CancelledError):
                await search
            await asyncio.to_thread(_wait_gone, rg)
            assert (await c.grep(tree, "needle", deadline=60)).matches == 1  # the connection goes on

    asyncio.run(main())


def test_a_directory_the_workload_user_may_not_enter_is_permission_denied(
    contained_grep: tuple[Guestd, str, str],
) -> None:
    """rg reads only what the workload user may: guestd (root) resolved the directory, rg may
    not enter it, and the error says so (not /proc/self/fd/N)."""
    g, tree, _ = contained_grep
    os.makedirs(f"{tree}/private")
    with open(f"{tree}/private/a.txt", "w") as f:
        f.write("needle\n")
    os.chmod(f"{tree}/private", 0o700)
    with g.client() as c:
        for path in (f"{tree}/private", f"{tree}/private/a.txt"):
            if os.environ.get("GUESTD_NATIVE_SPAWN") == "0":
                # subprocess changes directory before the drop to the workload user (Children's
                # fallback, every run alike): rg starts there and reads nothing of it
                assert c.grep(path, "needle", deadline=60).matches == 0
                continue
            with pytest.raises(GuestdError) as err:
                c.grep(path, "needle", deadline=60)
            assert err.value.code == "permission_denied" and "directory searched" in err.value.message
        assert c.grep(tree, "needle", deadline=60).matches == 1  # the rest of the tree: plain.txt


def test_rg_runs_as_nobody_where_guestd_is_root_without_a_workload_user(
    as_root_without_user: tuple[Guestd, str],
) -> None:
    """Never as root (rg opens paths by name: a link swapped in mid-walk must gain nothing)."""
    g, tree = as_root_without_user
    fifo = f"{tree}/fifo-root"
    os.mkfifo(fifo, 0o666)
    os.chmod(fifo, 0o666)
    marker = "marker-user-" + os.urandom(4).hex()

    async def main() -> None:
        async with await AsyncClient.connect(g.address) as c:
            search = asyncio.ensure_future(c.grep(fifo, marker, timeout_s=3, deadline=60))
            uids = (await asyncio.to_thread(_rg_of, marker)).uids()
            assert (await search).timed_out
            assert (uids.real, uids.effective) == (65534, 65534)

    asyncio.run(main())


def test_grep_works_while_guestds_fds_are_above_1024(scratch: str) -> None:
    """1,100 idle connections take guestd's fd numbers past 1024: the old select() answered
    bad_request "filedescriptor out of range in select()"."""
    d = tempfile.mkdtemp(prefix="guestd-grep-fds-")
    socks: list[socket.socket] = []
    try:
        tree = _tree(d)
        config = contained_config(d, os.path.join(scratch, "workload"))
        with open(config, "a") as f:
            f.write("[limits]\nmax_connections = 2000\nhello_timeout_s = 600.0\n")
        g = start_guestd(d, "--config", config)
        try:
            for _ in range(1100):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(g.sock_path)
                socks.append(s)
            for _ in range(500):
                if psutil.Process(g.pid).num_fds() > 1100:
                    break
                time.sleep(0.02)
            assert psutil.Process(g.pid).num_fds() > 1100
            with g.client() as c:
                r = c.grep(tree, "needle", deadline=60)
                assert (r.matches, r.files, [line.path for line in r.lines]) == (1, 1, ["plain.txt"])
                assert c.grep(f"{tree}/plain.txt", "needle", context=1, deadline=60).matches == 1
        finally:
            for s in socks:
                s.close()
            g.stop()
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_bake_puts_ripgrep_in_an_image_that_lacks_it(tmp_path: object) -> None:
    """guestd-bake adds Debian's ripgrep (or this machine's rg) and the libraries it needs."""
    import subprocess

    from guestd.bake import add_guest_packages

    root = f"{tmp_path}/root"
    os.makedirs(root)
    add_guest_packages(root)
    rg = next(p for p in ("/usr/bin/rg", "/usr/local/bin/rg", "/bin/rg") if os.access(root + p, os.X_OK))
    if os.geteuid() == 0:
        out = subprocess.run(["chroot", root, rg, "--version"], capture_output=True, text=True, check=True)
        assert out.stdout.startswith("ripgrep ")


def _rg_json(tree: str, pattern: str, *flags: str) -> set[tuple[str, bytes, int, bytes]]:
    """ripgrep's own --json answer: (kind, path, line, the line and a newline, cut to 4096)."""
    import base64
    import json
    import subprocess

    out = subprocess.run(
        ["rg", "--json", "--no-config", *flags, "--regexp", pattern, "--", "."], cwd=tree, capture_output=True
    ).stdout
    found = set()
    for raw in out.splitlines():
        rec = json.loads(raw)
        if rec["type"] in ("match", "context"):
            d = rec["data"]

            def text(obj: dict[str, str]) -> bytes:
                return obj["text"].encode() if "text" in obj else base64.b64decode(obj["bytes"])

            line = text(d["lines"])
            line = line if line.endswith(b"\n") else line + b"\n"
            found.add((rec["type"], text(d["path"]).removeprefix(b"./"), d["line_number"], line[:4096]))
    return found


def test_rg_lines_reads_rgs_printer_as_rg_json_does(tmp_path: object) -> None:
    """The parser of rg's standard printer against rg's --json on names with newlines, colons
    and NUL-free lookalikes of rg's binary notice, binary files that stop after a match, a line
    ending like rg's cut marker, and long lines; fed whole and byte by byte."""
    import subprocess

    from guestd.files.search import OMITTED, GrepQuery, RgLines, rg_command

    tree = f"{tmp_path}/t"
    os.makedirs(tree)
    names = [b"plain.txt", b"new\nline.txt", b"colon:1:x.txt", b"late.dat: WARNING: x", b"\xffbad.txt"]
    for name in names:
        with open(os.path.join(os.fsencode(tree), name), "wb") as f:
            f.write(b"one needle\nnothing\nneedle two\n")
    with open(f"{tree}/late.dat", "wb") as f:  # a NUL after the first buffer: rg stops after the match
        f.write(b"needle first\n" + b"filler line\n" * 200_000 + b"\0needle after\n")
    with open(f"{tree}/marker.txt", "wb") as f:  # short lines that end like rg's cut marker
        f.write(b"needle" + OMITTED + b"\n" + b"x" * 5000 + b"needle" + OMITTED + b"\n")
    with open(f"{tree}/long.txt", "wb") as f:
        f.write("é".encode() * 3000 + b"needle\n" + b"y" * 4095 + b"needle\n" + b"z" * 4089 + b"needle\n")
    for flags in ([], ["--context", "1"]):
        argv = rg_command("rg", GrepQuery("needle", context=1 if flags else 0), ".")
        out = subprocess.run(argv, cwd=tree, capture_output=True, check=True).stdout
        assert b"WARNING: stopped searching binary file" in out  # the notice is there to be taken off
        whole = RgLines(None).feed(out)
        bytewise = RgLines(None)
        assert [hit for i in range(len(out)) for hit in bytewise.feed(out[i : i + 1])] == whole
        assert {(k, p, n, t) for k, p, n, t, _cut in whole} == _rg_json(tree, "needle", *flags)
        cut = {(p, n) for _k, p, n, _t, c in whole if c}
        assert cut == {(b"long.txt", 1), (b"long.txt", 2), (b"marker.txt", 2)}  # longer than 4096 bytes, only


def test_a_file_named_like_rgs_binary_notice_is_reported_as_itself() -> None:
    """A workload file named ``A: binary file matches (found zz)`` + newline + ``REAL.txt``
    next to a file ``A``: the reply names the files that are there, never ``REAL.txt`` (the
    parser took the name for a notice on A and its rest for a path: 19 of 20 replies; found by
    a red-team pass)."""
    fake = "A: binary file matches (found zz)\nREAL.txt"

    def plant(top: str, ws: str) -> None:
        os.makedirs(f"{ws}/t")
        for name, text in (("A", "needle in A\n"), (fake, "needle in the oddly named file\n")):
            with open(f"{ws}/t/{name}", "w") as f:
                f.write(text)
        if os.geteuid() == 0:
            subprocess.run(["chown", "-R", "65534:65534", f"{ws}/t"], check=True)

    with workspace_guestd("guestd-grep-notice-", prepare=plant) as (g, ws), g.client() as c:
        for _ in range(10):
            reply = c.grep(f"{ws}/t", "needle", deadline=60)
            paths = sorted(os.fsdecode(h.path) if isinstance(h.path, bytes) else str(h.path) for h in reply.lines)
            assert paths == sorted(["A", fake]), paths
