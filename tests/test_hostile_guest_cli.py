"""guestctl and the examples against a compromised guest (issue 22 defects 1, 4, 6, 7, 8 and issue 21
defect 9): a fake guestd (guestd/testing/fakeguest.py) answers with hostile names, messages and
output; guestctl runs as people run it, under a pty where a terminal is the point."""

from __future__ import annotations

import base64
import json
import os
import pty
import select
import subprocess
import sys
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from examples.openhands_runtime import (
    CmdRunAction,
    ErrorObservation,
    FileReadAction,
    GuestdRuntime,
    IPythonRunCellAction,
)
from examples.swe_agent_driver import SweTools
from guestd.cli import main as guestctl_main
from guestd.cli.terminal import RESET_MODES
from guestd.client import Client
from guestd.testing import REPO
from guestd.testing.fakeguest import (
    FakeGuest,
    answers,
    code_reply,
    exec_reply,
    info_reply,
    send_download,
    shell_reply,
    stat_reply,
)
from guestd.testing.rawwire import RawPeer
from guestd.wire.frames import Kind

MiB = 1024 * 1024
# Control sequences a workload would like to reach the operator's terminal with.
OSC52 = "\x1b]52;c;cm0gLXJmIH4K\x07"  # write the clipboard
TITLE = "\x1b]0;owned\x1b\\"
LINK = "\x1b]8;;http://evil.example\x1b\\click\x1b]8;;\x1b\\"
CLEAR = "\x1b[2J"
HOSTILE = f"name{OSC52}{TITLE}{LINK}{CLEAR}"
DANGEROUS = ("\x1b]52", "\x1b]0;", "\x1b]8;", "\x1b[2J")


def guestctl(address: str, *args: str, tty: bool = False, timeout: float = 60) -> tuple[int, bytes, bytes]:
    """(exit code, stdout, stderr) of guestctl; with ``tty`` both go to one pty (returned as stdout)."""
    cmd = [sys.executable, "-m", "guestd.cli", "--connect", address, *args]
    env = {**os.environ, "PYTHONPATH": REPO}
    if not tty:
        r = subprocess.run(cmd, capture_output=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)
        return r.returncode, r.stdout, r.stderr
    master, slave = pty.openpty()
    proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    out = bytearray()
    try:
        while True:
            ready, _, _ = select.select([master], [], [], timeout)
            if not ready:
                proc.kill()
                pytest.fail(f"guestctl {args} still running after {timeout} s: {bytes(out)!r}")
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the last holder of the pty's other side is gone
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(master)
    return proc.wait(timeout), bytes(out), b""


# ----------------------------------------------------------------------------- defect 1


def test_save_images_names_come_from_the_host(fake_guest: Callable[..., FakeGuest], tmp_path: Path) -> None:
    """The file names were built from the guest's ``context``: ``../`` wrote outside DIR; one reply
    with many images made one file each (279,604 in 12 s). Now: inside DIR, at most 64."""
    png = b"\x89PNG fake"
    results = [{"kind": "display", "data": {"image/png": png}} for _ in range(500)]
    g = fake_guest(answers({"code.run": code_reply(context="../../escaped", results=results)}))
    images = tmp_path / "a" / "b" / "images"
    code, out, err = guestctl(g.address, "--json", "code", "run", "--save-images", str(images), "x")
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file() and p.suffix == ".png") == sorted(
        os.listdir(images)
    )
    report = json.loads(out)
    assert len(os.listdir(images)) == 64 == len(report["saved_images"]) and report["images_not_saved"] == 436
    assert all(os.path.dirname(p) == str(images) for p in report["saved_images"])


def test_save_images_never_follows_a_link_nor_overwrites(fake_guest: Callable[..., FakeGuest], tmp_path: Path) -> None:
    """A name in DIR that is a symlink to a host file: the host file received the guest's bytes."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"host data")
    images = tmp_path / "images"
    images.mkdir()
    (images / "default-1-0.png").symlink_to(victim)
    (images / "default-1-1.png").write_bytes(b"mine")
    results = [{"kind": "display", "data": {"image/png": b"guest bytes"}} for _ in range(2)]
    g = fake_guest(answers({"code.run": code_reply(results=results)}))
    code, out, _ = guestctl(g.address, "--json", "code", "run", "--save-images", str(images), "x")
    report = json.loads(out)  # a taken name skips that image; the run's result is still reported
    assert code == 0 and report["saved_images"] == [] and report["images_not_saved"] == 2
    assert report["images_name_taken"] == [str(images / "default-1-0.png"), str(images / "default-1-1.png")]
    assert victim.read_bytes() == b"host data" and (images / "default-1-1.png").read_bytes() == b"mine"
    (images / "default-1-1.png").unlink()
    code, out, err = guestctl(g.address, "code", "run", "--save-images", str(images), "x")
    assert code == 0 and b"default-1-0.png exists, kept" in err and b"saved " in out, (out, err)
    assert (images / "default-1-1.png").read_bytes() == b"guest bytes" and victim.read_bytes() == b"host data"
    code, _, err = guestctl(g.address, "code", "run", "--save-images", str(images), "--overwrite-images", "x")
    assert code == 0, err
    assert victim.read_bytes() == b"host data"  # the link itself was replaced, never followed
    assert (images / "default-1-0.png").read_bytes() == b"guest bytes" and not (images / "default-1-0.png").is_symlink()
    (images / "default-1-1.png").unlink()
    (images / "default-1-1.png").mkdir()  # a directory is never replaced, even with --overwrite-images
    argv = ["--json", "code", "run", "--save-images", str(images), "--overwrite-images", "x"]
    code, out, err = guestctl(g.address, *argv)
    report = json.loads(out)
    assert code == 0 and report["images_name_taken"] == [str(images / "default-1-1.png")], (out, err)
    assert sorted(os.listdir(images)) == ["default-1-0.png", "default-1-1.png"]  # no temp file left


# ----------------------------------------------------------------------------- defect 4


BAD_FOR_GUESTCTL: list[tuple[str, dict[str, Any], list[str]]] = [
    ("info", {"info": info_reply(limits={"max_frame": float("inf")}, memory={"k": b"\xff"})}, ["info"]),
    ("restore", {"info": info_reply(snapshot={"generation": float("inf")})}, ["restore"]),
    ("restore-missing", {"info": info_reply(snapshot={})}, ["restore"]),
    ("code-bytes-key", {"code.run": code_reply(results=[{"kind": "result", "data": {b"k": 1}}])}, ["code", "run", "x"]),
    ("ls", {"file.list": {"entries": [{"name": 5}], "truncated": False, "total": 1}}, ["ls", ":/"]),
    ("exec", {"exec": {**exec_reply(), "pid": "x"}}, ["exec", "--", "true"]),
    ("ps", {"process.list": {"processes": [{"id": 1}]}}, ["ps"]),
    ("cat", {"file.download": {"bytes": 1, "size": 1}}, ["cat", ":/f"]),
]


@pytest.mark.parametrize(
    "answer,argv", [(a, v) for _, a, v in BAD_FOR_GUESTCTL], ids=[n for n, _, _ in BAD_FOR_GUESTCTL]
)
def test_guestctl_reports_every_failure_as_one_json_object(
    fake_guest: Callable[..., FakeGuest], answer: dict[str, Any], argv: list[str]
) -> None:
    """Malformed replies killed guestctl with a traceback and no JSON under --json (11 of 11)."""
    g = fake_guest(answers(answer))
    code, out, err = guestctl(g.address, "--json", *argv)
    assert b"Traceback" not in err, err
    obj = json.loads(out)  # exactly one JSON object
    assert code == (0 if "error" not in obj else 1), (code, obj)
    if code:
        assert set(obj["error"]) >= {"code", "message"}
    code, out, err = guestctl(g.address, *argv)
    assert b"Traceback" not in err and (code == 0 or len(err.strip().splitlines()) == 1), err


def test_openhands_runtime_never_raises(fake_guest: Callable[..., FakeGuest]) -> None:
    """The runtime is documented never to raise from run_action; a hostile guest made it TypeError."""
    g = fake_guest(
        answers(
            {
                "shell.run": {**shell_reply(), "cwd": 5},
                "code.run": code_reply(results=[{"kind": "result", "data": {"image/png": 5}}]),
                "file.stat": stat_reply(10),
                "file.read": {"data": b"x" * 100},
            }
        )
    )
    with Client(g.address) as c:
        rt = GuestdRuntime(guest=SimpleNamespace(workspace="/w"), client=c)
        rt.shell_id, rt.context_id = "s1", "c1"
        for action in (CmdRunAction("ls"), IPythonRunCellAction("1"), FileReadAction("/f")):
            assert isinstance(rt.run_action(action), ErrorObservation)
        rt.closed = True


# ----------------------------------------------------------------------------- defect 6


def test_cp_stops_at_the_size_stat_announced(fake_guest: Callable[..., FakeGuest], tmp_path: Path) -> None:
    """stat said 10 bytes, the download brought 1 GiB, exit 0, "size verified"."""

    def download(p: RawPeer, rid: int, args: dict[str, Any]) -> None:
        send_download(p, rid, b"x" * (8 * MiB))

    g = fake_guest(answers({"file.stat": stat_reply(10), "file.download": download}))
    dst = tmp_path / "out"
    dst.mkdir()
    code, out, err = guestctl(g.address, "cp", ":/f", str(dst / "f"))
    assert code == 1 and b"guestctl: error [protocol_error]" in err, (out, err)
    assert os.listdir(dst) == []


def test_cat_json_streams(
    fake_guest: Callable[..., FakeGuest], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``guestctl --json cat`` held the file three times over (256 MiB -> 3.9 GiB peak)."""
    data = (b"line \xff\x1b]52;c;x\x07\n" * 4096)[: 32 * MiB]
    data = data * (32 * MiB // len(data))

    def download(p: RawPeer, rid: int, args: dict[str, Any]) -> None:
        send_download(p, rid, data)

    g = fake_guest(answers({"file.download": download}))
    out = tmp_path / "out.json"
    with open(out, "w") as f:
        monkeypatch.setattr(sys, "stdout", f)
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            assert guestctl_main(["--connect", g.address, "--json", "cat", ":/f"]) == 0
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
    obj = json.loads(out.read_text())
    # Not UTF-8, so base64 (issue 31's one JSON contract), still streamed out of the spool.
    assert obj["bytes"] == len(data) and base64.b64decode(obj["data"]["base64"]) == data
    assert peak < len(data) // 2, peak  # was three copies and more


# ----------------------------------------------------------------------------- defect 7 / issue 21 defect 9


def hostile_guest_answers() -> dict[str, Any]:
    def download(p: RawPeer, rid: int, args: dict[str, Any]) -> None:
        send_download(p, rid, HOSTILE.encode())

    def attach(p: RawPeer, rid: int, args: dict[str, Any]) -> None:
        data = f"\x1b[?1049h\x1b[?25l{HOSTILE}\x1b[21t".encode()
        p.send(Kind.EVENT, rid, {"ev": "stdout", "data": data, "offset": 0})
        p.send(
            Kind.RESPONSE,
            rid,
            {"state": "exited", "exit_code": 0, "signal": None, "stdout_offset": len(data), "stderr_offset": 0},
        )

    entry = {"name": HOSTILE, "type": "file", "size": 1, "mode": 0o644, "mtime_ns": 0}
    proc = {"id": HOSTILE, "pid": 1, "command": HOSTILE, "state": "running", "pty": False, "started_at": 0.0,
            "stdout_offset": 0, "stderr_offset": 0}  # fmt: skip
    shell = {"id": HOSTILE, "name": HOSTILE, "pid": 1, "cwd": HOSTILE, "busy": False, "alive": True, "commands": 0,
             "restarts": 0, "stray_bytes": 0}  # fmt: skip
    context = {"id": HOSTILE, "name": HOSTILE, "state": "idle", "queued": 0, "restarts": 0}
    return {
        "file.list": {"entries": [entry], "truncated": False, "total": 1},
        "file.stat": {"code": "x"},
        "file.remove": lambda p, rid, a: p.send(Kind.ERROR, rid, {"code": HOSTILE, "message": HOSTILE}),
        "info": info_reply(hostname=HOSTILE, version=HOSTILE),
        "process.list": {"processes": [proc]},
        "process.start": {"id": HOSTILE, "pid": 1},
        "process.attach": attach,
        "shell.list": {"sessions": [shell]},
        "shell.create": {"id": HOSTILE, "pid": 1},
        "shell.run": shell_reply(stdout=HOSTILE.encode()),
        "code.list": {"contexts": [context], "pool_ready": 0},
        "code.create": {"id": HOSTILE, "name": None, "pid": 1, "pooled": False, "existing": False},
        "code.run": code_reply(
            stdout=HOSTILE.encode(),
            results=[{"kind": "result", "data": {"text/plain": HOSTILE}}],
            error={"ename": HOSTILE, "evalue": HOSTILE, "traceback": [HOSTILE]},
            status="error",
        ),
        "exec": exec_reply(stdout=HOSTILE.encode(), stderr=HOSTILE.encode()),
        "file.download": download,
    }


TERMINAL_PATHS = [
    ["ls", ":/"],
    ["rm", "-r", ":/x"],  # -r: straight to file.remove (a plain rm asks file.stat first, as rm(1) does)
    ["info"],
    ["ps"],
    ["shell", "ls"],
    ["shell", "new"],
    ["shell", "run", "s", "x"],
    ["code", "ls"],
    ["code", "new"],
    ["code", "run", "x"],
    ["exec", "--detach", "--", "x"],
    ["exec", "--", "x"],
    ["sh", "x"],
    ["cat", ":/f"],
    ["attach", "p1"],
    ["exec", "--pty", "--", "x"],
]


@pytest.mark.parametrize("argv", TERMINAL_PATHS, ids=[" ".join(a[:2]) for a in TERMINAL_PATHS])
def test_guest_strings_reach_a_terminal_neutralized(fake_guest: Callable[..., FakeGuest], argv: list[str]) -> None:
    """OSC 52, titles, hyperlinks and screen clears from names, ids, messages and workload output
    reached the terminal raw on 11 of 12 paths (issue 22) and through exec, sh and exec --pty
    (issue 21); shown escaped now (the pty bridge drops them), and ``--pty`` leaves the
    terminal's modes as it found them."""
    g = fake_guest(answers(hostile_guest_answers()))
    _, out, _ = guestctl(g.address, *argv, tty=True)
    text = out.decode("utf-8", "replace")
    # A full-screen program on a pty may clear its screen; nothing else may pass anywhere.
    dangerous = [seq for seq in DANGEROUS if not ("--pty" in argv and seq == CLEAR)]
    assert not any(seq in text for seq in dangerous), repr(text)
    assert "name" in text, repr(text)  # the hostile string was printed, neutralized
    if "--pty" in argv:
        assert out.endswith(RESET_MODES) or RESET_MODES in out[out.rindex(b"\x1b[?1049h") :], repr(out)
        assert b"\x1b[21t" not in out


def test_raw_keeps_workload_bytes(fake_guest: Callable[..., FakeGuest]) -> None:
    g = fake_guest(answers(hostile_guest_answers()))
    _, out, _ = guestctl(g.address, "--raw", "exec", "--", "x", tty=True)
    assert OSC52.encode() in out


# ----------------------------------------------------------------------------- defect 8


def test_swe_agent_patch_is_capped_by_max_patch_bytes(fake_guest: Callable[..., FakeGuest]) -> None:
    """stat said the patch was small; the download brought 64 MiB under an 8 MiB bound."""

    def download(p: RawPeer, rid: int, args: dict[str, Any]) -> None:
        send_download(p, rid, b"+" * (4 * MiB))

    g = fake_guest(
        answers(
            {
                "exec": exec_reply(),
                "file.stat": stat_reply(100),
                "file.download": download,
                "file.remove": {"removed": 1},
            }
        )
    )
    with Client(g.address) as c:
        tools = SweTools.__new__(SweTools)
        tools.client, tools.repo, tools.env, tools.timeout_s, tools.max_patch_bytes = c, "/r", {}, 10.0, 1 * MiB
        with pytest.raises(RuntimeError, match="could not be read whole"):
            tools.submit()
