"""file.glob and file.grep (issue 18) against a real guestd: grep (always ripgrep, run by guestd as a
workload process) equal to ripgrep run directly, glob equal to find; symlinks out, a FIFO, binary and
huge-line files in the searched tree; a workload swapping a directory for a symlink out while
searches run. The attacks of issue 29 on grep are in tests/test_workload_grep.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from collections.abc import Iterator

import pytest

from guestd.client import Client
from guestd.testing import Guestd, workspace_guestd

HAVE_RG = shutil.which("rg") is not None
need_rg = pytest.mark.skipif(not HAVE_RG, reason="grep needs ripgrep (scripts/test.sh installs it)")


@pytest.fixture(scope="module")
def env() -> Iterator[tuple[Guestd, str, str]]:
    """(guestd, a generated tree in its workspace, a directory outside holding SECRET)."""

    def prepare(top: str, ws: str) -> None:
        outside = f"{top}/outside"
        os.makedirs(outside)
        with open(f"{outside}/s.txt", "w") as f:
            f.write("needle SECRET\n")
        os.chmod(outside, 0o700)  # nothing the workload may read
        make_tree(f"{ws}/tree", outside)

    with workspace_guestd("guestd-search-", prepare=prepare) as (g, ws):
        yield g, f"{ws}/tree", f"{os.path.dirname(ws)}/outside"


def make_tree(tree: str, outside: str) -> None:
    """~300 files over nested directories, with the cases grep must get right."""
    for d in range(6):
        for e in range(5):
            base = f"{tree}/pkg{d}/mod{e}"
            os.makedirs(base)
            for k in range(8):
                lines = [f"line {n} of {d}.{e}.{k}" for n in range(1, 30)]
                if (d + e + k) % 3 == 0:
                    lines[(k * 7) % 29] = f"needle here {d} {e} {k}"
                if k == 2:
                    lines[5] = "NEEDLE upper"
                ext = ("py", "txt", "log", "md")[k % 4]
                with open(f"{base}/f{k}.{ext}", "w") as f:
                    f.write("\n".join(lines) + "\n")
    os.makedirs(f"{tree}/build")
    with open(f"{tree}/build/out.py", "w") as f:
        f.write("needle in build\n")
    with open(f"{tree}/.gitignore", "w") as f:
        f.write("build/\n*.log\n!keep.log\n")
    with open(f"{tree}/keep.log", "w") as f:
        f.write("needle kept\n")
    os.makedirs(f"{tree}/.cache")
    with open(f"{tree}/.cache/c.py", "w") as f:
        f.write("needle hidden\n")
    with open(f"{tree}/bin.dat", "wb") as f:
        f.write(b"\0\1needle binary\n")
    with open(f"{tree}/huge.txt", "w") as f:
        f.write("needle" + "x" * 10_000 + "\n")
    with open(os.fsencode(tree) + b"/name-\xff.py", "w") as f:
        f.write("needle in a name that is not UTF-8\n")
    os.mkfifo(f"{tree}/fifo.py")
    os.symlink(f"{outside}/s.txt", f"{tree}/link.py")  # symlinks out: never followed
    os.symlink(outside, f"{tree}/linkdir")
    os.chmod(tree, 0o755)
    for root, dirs, files in os.walk(tree):
        for name in dirs + files:
            p = os.path.join(root, name)
            if not os.path.islink(p):
                os.chmod(p, 0o755 if os.path.isdir(p) else 0o644)


@pytest.fixture
def c(env: tuple[Guestd, str, str]) -> Iterator[Client]:
    with env[0].client() as client:
        yield client


Key = tuple[str, bytes, int, bytes]


def reference(tree: str, pattern: str, flags: list[str]) -> set[Key]:
    """What ripgrep itself finds (run directly, as root, nothing racing it)."""
    import base64
    import json

    out = subprocess.run(
        [
            "rg",
            "--json",
            "--no-config",
            "--no-require-git",
            "--no-ignore-parent",
            "--glob",
            "!.git",
            *flags,
            "--regexp",
            pattern,
            "--",
            ".",
        ],
        cwd=tree,
        capture_output=True,
        check=False,
    ).stdout
    found: set[Key] = set()
    for line in out.splitlines():
        rec = json.loads(line)
        if rec["type"] not in ("match", "context"):
            continue
        d = rec["data"]
        p = d["path"]
        path = p["text"].encode() if "text" in p else base64.b64decode(p["bytes"])
        text = d["lines"]["text"].encode() if "text" in d["lines"] else base64.b64decode(d["lines"]["bytes"])
        found.add((rec["type"], path.removeprefix(b"./"), d["line_number"], text[:4096]))
    return found


def got(c: Client, tree: str, pattern: str, **kw: object) -> set[Key]:
    r = c.grep(tree, pattern, max_matches=100_000, **kw)  # type: ignore[arg-type]
    assert r.engine == "rg" and not r.timed_out and not r.truncated
    out = {(line.kind, os.fsencode(line.path), line.line, line.text) for line in r.lines}
    assert len(out) == len(r.lines)  # no line twice
    return out


@need_rg
def test_grep_equals_ripgrep_run_directly(c: Client, env: tuple[Guestd, str, str]) -> None:
    tree = env[1]
    plain = got(c, tree, "needle")
    assert plain == reference(tree, "needle", [])
    paths = {p for _, p, _, _ in plain}
    assert b"keep.log" in paths and b"name-\xff.py" in paths  # a negation, a name that is not UTF-8
    assert not {b"build/out.py", b"bin.dat", b"link.py", b".cache/c.py", b"fifo.py"} & paths
    assert not any(p.startswith(b"linkdir") or b"SECRET" in t for _, p, _, t in plain)
    huge = [t for _, p, _, t in plain if p == b"huge.txt"]
    assert len(huge) == 1 and len(huge[0]) == 4096  # cut to 4096 bytes
    cut = [line for line in c.grep(tree, "needle", max_matches=100_000).lines if line.path == "huge.txt"]
    assert [line.truncated for line in cut] == [True]
    for kw, flags in (
        ({"ignore_case": True, "context": 2}, ["--ignore-case", "--context", "2"]),
        ({"literal": True, "hidden": True, "gitignore": False}, ["--fixed-strings", "--hidden", "--no-ignore-vcs"]),
        ({"globs": ["*.py", "!pkg1/**"]}, ["--glob", "*.py", "--glob", "!pkg1/**"]),
    ):
        pattern = "needle h.re" if not kw.get("literal") else "needle here 1"
        assert got(c, tree, pattern, **kw) == reference(tree, pattern, flags), kw


@need_rg
def test_grep_bounds_matches_and_reports_it(c: Client, env: tuple[Guestd, str, str]) -> None:
    r = c.grep(env[1], "line", max_matches=50)
    assert r.truncated and r.matches == 50 and len(r.lines) == 50


@need_rg
def test_grep_bad_regex_is_bad_request(c: Client, env: tuple[Guestd, str, str]) -> None:
    from guestd.wire.errors import GuestdError

    with pytest.raises(GuestdError) as err:
        c.grep(env[1], "(unclosed")
    assert err.value.code == "bad_request" and err.value.details["field"] == "pattern"


def test_the_python_engine_is_gone(c: Client, env: tuple[Guestd, str, str]) -> None:
    """One regex dialect in every deployment (issue 29): engine python is refused, naming the field."""
    from guestd.wire.errors import GuestdError

    with pytest.raises(GuestdError) as err:
        c.grep(env[1], "needle", engine="python")  # type: ignore[arg-type]
    assert err.value.code == "bad_request" and "engine" in err.value.message


def test_glob_equals_find(c: Client, env: tuple[Guestd, str, str]) -> None:
    tree = env[1]
    find = subprocess.run(["find", ".", "-name", "*.py"], cwd=tree, capture_output=True, check=True).stdout
    want = sorted(p.removeprefix(b"./") for p in find.split(b"\n") if p)
    r = c.glob(tree, "**/*.py")
    assert sorted(os.fsencode(p) for p in r.paths) == want and r.total == len(want) and not r.truncated
    assert b"link.py" in want and not any(p.startswith(b"linkdir/") for p in want)  # links listed, not followed
    assert [os.fsencode(p) for p in c.glob(tree, "pkg2/*/f0.py").paths] == [b"pkg2/mod%d/f0.py" % e for e in range(5)]
    limited = c.glob(tree, "**", max_results=7)
    assert limited.truncated and len(limited.paths) == 7 and limited.total > 7
    ignored = {os.fsencode(p) for p in c.glob(tree, "**/*", gitignore=True).paths}
    assert b"build" not in ignored and b"keep.log" in ignored and b"pkg0/mod0/f2.log" not in ignored


@need_rg
def test_a_workload_swapping_a_directory_for_a_symlink_out_never_redirects_a_search(
    c: Client, env: tuple[Guestd, str, str]
) -> None:
    """A directory in the tree is swapped for a symlink to a directory outside (holding SECRET)
    and back, as fast as the workload can, while searches run: no result ever comes from outside."""
    tree, outside = env[1], env[2]
    victim = f"{tree}/swap"
    os.makedirs(f"{victim}-real")
    with open(f"{victim}-real/a.txt", "w") as f:
        f.write("needle inside\n")
    os.symlink(outside, f"{victim}-evil")
    stop = threading.Event()

    def swapper() -> None:
        while not stop.is_set():
            for src in (f"{victim}-real", f"{victim}-evil"):
                try:
                    os.rename(src, victim)
                    os.rename(victim, src)
                except OSError:
                    pass

    t = threading.Thread(target=swapper, daemon=True)
    t.start()
    try:
        for _ in range(20):
            r = c.grep(tree, "needle", max_matches=100_000)
            assert not any(b"SECRET" in line.text for line in r.lines)
    finally:
        stop.set()
        t.join(5)
        for p in (f"{victim}-real", f"{victim}-evil", victim):
            if os.path.islink(p):
                os.unlink(p)
            elif os.path.isdir(p):
                shutil.rmtree(p)
