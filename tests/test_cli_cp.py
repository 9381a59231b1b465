"""guestctl cp case by case against ``docker cp``'s rules (guestd/cli/cp.py's table), both ways,
through guestctl as a subprocess on a real guestd; and rm/ls/cat/view/grep as people type them
(issue 31 items 3, 6, 7). Guest and host share this machine's filesystem here, so each case
builds its source and destination the same way for either direction."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
from dataclasses import dataclass, field

import pytest

from guestd.testing import REPO, Guestd

A, B, OLD = b"alpha\n", b"beta\n", b"old\n"


def guestctl(
    g: Guestd, *args: str, cwd: str | None = None, stdin: bytes | None = None
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        g.guestctl_argv(*args),
        input=stdin,
        capture_output=True,
        timeout=120,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": REPO},
        check=False,
    )


def build(root: str, layout: dict[str, bytes | None]) -> None:
    """Files (bytes) and directories (None) under ``root``."""
    for rel, data in layout.items():
        path = os.path.join(root, rel)
        if data is None:
            os.makedirs(path, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)


def snapshot(root: str) -> dict[str, bytes | None]:
    out: dict[str, bytes | None] = {}
    for here, dirs, names in os.walk(root):
        for d in dirs:
            out[os.path.relpath(os.path.join(here, d), root)] = None
        for n in names:
            with open(os.path.join(here, n), "rb") as f:
                out[os.path.relpath(os.path.join(here, n), root)] = f.read()
    return out


TREE: dict[str, bytes | None] = {"d": None, "d/a.txt": A, "d/sub": None, "d/sub/b.txt": B}


@dataclass(frozen=True)
class Case:
    name: str
    src: str  # relative to the source root
    dst: str  # relative to the destination root ("" is the root itself)
    dst_before: dict[str, bytes | None] = field(default_factory=dict)
    dst_after: dict[str, bytes | None] | None = None  # None: an error
    error: str = ""  # the error code, and a hint its message holds ("code|hint")
    flags: tuple[str, ...] = ()


CASES = [
    Case("file to a new name", "a.txt", "new.txt", dst_after={"new.txt": A}),
    Case("file to a missing dir/", "a.txt", "nodir/", error="not_found|--parents"),
    Case(
        "file to a missing dir/ with --parents",
        "a.txt",
        "nodir/",
        {},
        {"nodir": None, "nodir/a.txt": A},
        flags=("--parents",),
    ),
    Case("file over a file", "a.txt", "old.txt", {"old.txt": OLD}, {"old.txt": A}),
    Case("file into an existing dir", "a.txt", "dir", {"dir": None}, {"dir": None, "dir/a.txt": A}),
    Case("file into an existing dir/", "a.txt", "dir/", {"dir": None}, {"dir": None, "dir/a.txt": A}),
    Case("file onto file/", "a.txt", "old.txt/", {"old.txt": OLD}, error="not_a_directory|"),
    Case("file with a missing parent", "a.txt", "no/such/x.txt", error="not_found|--parents"),
    Case("file onto a dir of its name", "a.txt", "dir", {"dir/a.txt": None}, error="is_a_directory|"),
    Case(
        "dir to a missing name",
        "d",
        "copy",
        dst_after={"copy": None, "copy/a.txt": A, "copy/sub": None, "copy/sub/b.txt": B},
    ),
    Case(
        "dir into an existing dir",
        "d",
        "dir",
        {"dir": None},
        {"dir": None, "dir/d": None, "dir/d/a.txt": A, "dir/d/sub": None, "dir/d/sub/b.txt": B},
    ),
    Case(
        "dir merged into the same name there",
        "d",
        "dir",
        {"dir/d/a.txt": OLD, "dir/d/keep.txt": OLD},
        {"dir": None, "dir/d": None, "dir/d/a.txt": A, "dir/d/keep.txt": OLD, "dir/d/sub": None, "dir/d/sub/b.txt": B},
    ),
    Case(
        "dir/. into an existing dir (its contents)",
        "d/.",
        "dir",
        {"dir/x.txt": OLD},
        {"dir": None, "dir/x.txt": OLD, "dir/a.txt": A, "dir/sub": None, "dir/sub/b.txt": B},
    ),
    Case("dir onto a file", "d", "old.txt", {"old.txt": OLD}, error="not_a_directory|"),
    Case(
        "dir with -r (accepted, the same)",
        "d",
        "copy",
        {},
        {"copy": None, "copy/a.txt": A, "copy/sub": None, "copy/sub/b.txt": B},
        flags=("-r",),
    ),
    Case(
        "dir with --exclude",
        "d",
        "copy",
        {},
        {"copy": None, "copy/a.txt": A},
        flags=("--exclude", "sub", "--exclude", "*.log"),
    ),
]


@pytest.mark.parametrize("direction", ["up", "down"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_cp_as_docker_cp(workspace_env: tuple[Guestd, str], tmp_path: str, case: Case, direction: str) -> None:
    g, ws = workspace_env
    tag = f"{direction}-{CASES.index(case)}"
    local, guest = os.path.join(str(tmp_path), "local"), os.path.join(ws, tag)
    src_root, dst_root = (local, guest) if direction == "up" else (guest, local)
    build(
        src_root,
        {"a.txt": A, **TREE, "d/x.log": b"log\n"} if case.flags[:1] == ("--exclude",) else {"a.txt": A, **TREE},
    )
    os.makedirs(dst_root, exist_ok=True)
    build(dst_root, case.dst_before)
    before = snapshot(dst_root)
    src_arg = os.path.join(src_root, case.src)
    dst_arg = dst_root + "/" + case.dst if case.dst else dst_root
    src_arg, dst_arg = (src_arg, ":" + dst_arg) if direction == "up" else (":" + src_arg, dst_arg)
    r = guestctl(g, "--json", "cp", *case.flags, src_arg, dst_arg)
    if case.dst_after is None:
        code, hint = case.error.split("|")
        assert r.returncode == 1, (r.stdout, r.stderr)
        err = json.loads(r.stdout)["error"]
        assert err["code"] == code and hint in err["message"], err
        assert snapshot(dst_root) == before  # nothing written
        return
    assert r.returncode == 0, (r.stdout, r.stderr)
    out = json.loads(r.stdout)
    assert snapshot(dst_root) == case.dst_after
    assert out["direction"] == ("upload" if direction == "up" else "download")
    # Content bytes, a tree's as a file's: a.txt alone, or a.txt and sub/b.txt.
    copied = len(A) if case.src == "a.txt" or "sub" in case.flags else len(A) + len(B)
    assert out["bytes"] == copied, out
    assert not [n for n in os.listdir(dst_root) if n.startswith(".guestctl-cp-")]


def test_tree_bytes_mean_content_both_ways(workspace_env: tuple[Guestd, str], tmp_path: str) -> None:
    """The same figure up and down: the files' bytes (the tar stream is larger)."""
    g, ws = workspace_env
    build(str(tmp_path), {"t/one": b"x" * 1000, "t/two/three": b"y" * 234})
    up = json.loads(guestctl(g, "--json", "cp", f"{tmp_path}/t", f":{ws}/bytes-t").stdout)
    down = json.loads(guestctl(g, "--json", "cp", f":{ws}/bytes-t", f"{tmp_path}/back").stdout)
    assert up["bytes"] == down["bytes"] == 1234 and up["entries"] == down["entries"] == 3


def test_dot_and_workspace_as_destinations(workspace_env: tuple[Guestd, str], tmp_path: str) -> None:
    g, ws = workspace_env
    build(ws, {"dotsrc/f.txt": A, "one.txt": B})
    here = f"{tmp_path}/here"
    os.makedirs(here)
    # `cp -r :/dir .` (was: File exists: '.')
    r = guestctl(g, "cp", "-r", f":{ws}/dotsrc", ".", cwd=here)
    assert r.returncode == 0, r.stderr
    assert snapshot(here) == {"dotsrc": None, "dotsrc/f.txt": A}
    r = guestctl(g, "cp", ":one.txt", ".", cwd=here)  # a relative guest path starts at the workspace
    assert r.returncode == 0 and open(f"{here}/one.txt", "rb").read() == B, r.stderr
    # `cp a.txt :` is the workspace (was: an empty path)
    build(here, {"to-ws.txt": A})
    r = guestctl(g, "cp", "to-ws.txt", ":", cwd=here)
    assert r.returncode == 0 and open(f"{ws}/to-ws.txt", "rb").read() == A, r.stderr
    # Both sides or neither written :PATH: a usage error naming :PATH.
    r = guestctl(g, "cp", "to-ws.txt", "elsewhere", cwd=here)
    assert r.returncode != 0 and b":PATH" in (r.stderr + r.stdout)


def test_rm_as_coreutils_rm(workspace_env: tuple[Guestd, str]) -> None:
    g, ws = workspace_env
    build(ws, {"rm/f1": A, "rm/f2": A, "rm/empty": None, "rm/full/x": A})
    r = guestctl(g, "rm", ":rm/f1", "rm/f2")  # several paths, the colon optional
    assert r.returncode == 0, r.stderr
    assert not os.path.exists(f"{ws}/rm/f1") and not os.path.exists(f"{ws}/rm/f2")
    r = guestctl(g, "rm", "rm/empty")  # a directory needs -d or -r, even empty
    assert r.returncode == 1 and b"is a directory" in r.stderr and b"-r" in r.stderr and os.path.isdir(f"{ws}/rm/empty")
    assert guestctl(g, "rm", "-d", "rm/empty").returncode == 0 and not os.path.exists(f"{ws}/rm/empty")
    r = guestctl(g, "rm", "-d", "rm/full")
    assert r.returncode == 1 and b"not empty" in r.stderr
    r = guestctl(g, "rm", "rm/missing")
    assert r.returncode == 1 and b"rm/missing" in r.stderr
    r = guestctl(g, "--json", "rm", "-f", "rm/missing")  # -f: missing is not an error
    assert r.returncode == 0 and json.loads(r.stdout) == {"removed": 0}
    r = guestctl(g, "--json", "rm", "-rf", "rm/full", "rm/missing")
    assert r.returncode == 0 and json.loads(r.stdout) == {"removed": 2}, r
    r = guestctl(g, "--json", "rm", "rm/nope1", "rm/nope2")
    err = json.loads(r.stdout)["error"]
    assert r.returncode == 1 and err["code"] == "not_found" and len(err["details"]["failed"]) == 2


def test_ls_mkdir_find_without_colon(workspace_env: tuple[Guestd, str]) -> None:
    g, _ = workspace_env
    r = guestctl(g, "--json", "mkdir", "-p", "mk/a/b", ":mk/c")
    assert r.returncode == 0 and json.loads(r.stdout) == {"created": 2}, r
    names = {e["name"] for e in json.loads(guestctl(g, "--json", "ls").stdout)["entries"]}  # the workspace
    assert "mk" in names
    assert [e["name"] for e in json.loads(guestctl(g, "--json", "ls", "mk").stdout)["entries"]] == ["a", "c"]
    assert guestctl(g, "mkdir", "mk/c").returncode == 1  # without -p an existing directory is an error


def test_view_lines_and_grep_flags(workspace_env: tuple[Guestd, str]) -> None:
    g, ws = workspace_env
    build(ws, {"g/one.txt": b"foo\nfoobar\nx\ny\nz\nw\nfoo end\n", "g/two.txt": b"nothing\n"})
    assert guestctl(g, "view", "g/one.txt", "--lines", "3").stdout == b"     3\tx\n"
    assert guestctl(g, "view", ":g/one.txt", "--lines", "2:3").stdout == b"     2\tfoobar\n     3\tx\n"
    r = guestctl(g, "grep", "-w", "-n", "foo", "g")
    assert r.stdout == b"one.txt:1:foo\none.txt:7:foo end\n", r
    r = guestctl(g, "grep", "-l", "o", "g")
    assert r.stdout.splitlines() == [b"one.txt", b"two.txt"], r
    r = guestctl(g, "grep", "-C", "1", "-w", "foo", "g")
    assert r.stdout == b"one.txt:1:foo\none.txt-2-foobar\n--\none.txt-6-w\none.txt:7:foo end\n", r
    r = guestctl(g, "grep", "-F", "-w", "foo end", "g")
    assert r.stdout == b"one.txt:7:foo end\n", r
    lines = [json.loads(x) for x in guestctl(g, "--json", "grep", "-w", "foo", "g").stdout.splitlines()]
    assert [x["kind"] for x in lines] == ["match", "match", "summary"] and lines[0]["text"] == "foo\n", lines


def test_cat_binary_and_json(workspace_env: tuple[Guestd, str]) -> None:
    g, ws = workspace_env
    build(ws, {"c/bin": b"\x89PNG\x00\xff\xfe", "c/text.txt": "h\u00e9\n".encode()})
    assert guestctl(g, "cat", "c/bin").stdout == b"\x89PNG\x00\xff\xfe"  # piped: the bytes
    assert json.loads(guestctl(g, "--json", "cat", "c/text.txt").stdout)["data"] == "h\u00e9\n"
    data = json.loads(guestctl(g, "--json", "cat", "c/bin").stdout)["data"]
    assert data == {"base64": "iVBORwD//g=="}


def on_terminal(g: Guestd, *args: str) -> tuple[int, bytes]:
    """guestctl with stdout and stderr on one pty: (exit code, what the terminal got)."""
    master, slave = pty.openpty()
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.Popen(g.guestctl_argv(*args), stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    out = bytearray()
    try:
        while select.select([master], [], [], 60)[0]:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: guestctl has closed its side
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(master)
    return proc.wait(60), bytes(out)


def test_trees_and_binary_files_on_a_terminal(workspace_env: tuple[Guestd, str], tmp_path: str) -> None:
    """A tree's progress bar on a terminal (a counter: its total is unknown) ended the copy with
    'bool() undefined' before it was checked here; cat of binary data prints a note there."""
    g, ws = workspace_env
    build(str(tmp_path), {"tty/sub/big": b"z" * (2 << 20)})
    code, out = on_terminal(g, "cp", f"{tmp_path}/tty", ":tty-up")
    assert code == 0 and b"1 entries" not in out and b"2097152 bytes (upload)" in out, out
    code, out = on_terminal(g, "cp", ":tty-up", f"{tmp_path}/tty-down")
    assert code == 0 and b"2097152 bytes (download)" in out, out
    build(ws, {"tty.bin": b"\x00\x01\x02binary\xff"})
    code, out = on_terminal(g, "cat", "tty.bin")
    assert code == 0 and b"binary data, 10 bytes, not shown on a terminal" in out and b"\x00" not in out, out
