"""guestctl as people and scripts use it: exit codes, --json fields, cp/cat/ls/rm."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys

from guestd.testing import REPO, Guestd, scratch_guestd


def test_ping_and_info(guestd: Guestd) -> None:
    r = guestd.guestctl("ping")
    assert r.returncode == 0 and r.stdout.startswith(b"pong")
    info = json.loads(guestd.guestctl("--json", "info").stdout)
    assert info["pid"] == guestd.pid and "exec" in info["capabilities"]


def test_exec_exit_codes_and_json(guestd: Guestd) -> None:
    r = guestd.guestctl("exec", "--", "sh", "-c", "echo out; echo err >&2; exit 5")
    assert (r.returncode, r.stdout, r.stderr) == (5, b"out\n", b"err\n")
    r = guestd.guestctl("--json", "exec", "--max-output", "4", "--env", "A=b", "--", "sh", "-c", "echo $A-12345")
    obj = json.loads(r.stdout)
    for key in (
        "exit_code",
        "signal",
        "timed_out",
        "stdout",
        "stderr",
        "stdout_bytes",
        "stderr_bytes",
        "stdout_dropped",
        "stderr_dropped",
        "duration_s",
    ):
        assert key in obj
    assert obj["stdout"] == "345\n" and obj["stdout_bytes"] == 8 and obj["stdout_dropped"] == 4
    assert r.returncode == 0


def test_timeout_exits_124(guestd: Guestd) -> None:
    r = guestd.guestctl("--json", "sh", "--timeout", "0.3", "echo partial; sleep 30")
    obj = json.loads(r.stdout)
    assert r.returncode == 124 and obj["timed_out"] == "wall" and obj["stdout"] == "partial\n"
    r = guestd.guestctl("sh", "--idle-timeout", "0.3", "sleep 30")
    assert r.returncode == 124 and b"idle timeout" in r.stderr


def test_could_not_start_is_an_error(guestd: Guestd) -> None:
    r = guestd.guestctl("--json", "exec", "--cwd", "/nonexistent", "--", "true")
    assert r.returncode == 1
    err = json.loads(r.stdout)["error"]
    assert err["code"] == "not_found" and err["details"]["stage"] == "cwd"


def test_cp_both_ways_cat_ls_rm(guestd: Guestd, tmp_path: object) -> None:
    src = f"{tmp_path}/local.bin"
    data = os.urandom(3 << 20)
    with open(src, "wb") as f:
        f.write(data)
    remote = f"{tmp_path}/guest/dir/remote.bin"
    r = guestd.guestctl("--json", "cp", "--parents", src, f":{remote}")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["bytes"] == len(data)
    back = f"{tmp_path}/back.bin"
    assert guestd.guestctl("cp", f":{remote}", back).returncode == 0
    assert open(back, "rb").read() == data
    assert guestd.guestctl("cat", f":{remote}").stdout == data
    ls = json.loads(guestd.guestctl("--json", "ls", f":{tmp_path}/guest/dir").stdout)
    assert [e["name"] for e in ls["entries"]] == ["remote.bin"]
    r = guestd.guestctl("rm", f":{tmp_path}/guest")  # as rm(1): a directory needs -r
    assert r.returncode == 1 and b"is a directory (-r" in r.stderr
    assert guestd.guestctl("rm", "-r", f":{tmp_path}/guest").returncode == 0
    assert not os.path.exists(f"{tmp_path}/guest")
    r = guestd.guestctl("cp", src, back)
    assert r.returncode != 0 and b":PATH" in r.stderr


def test_names_that_are_not_utf8(guestd: Guestd, tmp_path: object) -> None:
    bad = os.fsencode(str(tmp_path)) + b"/bad\xff"
    with open(bad, "wb") as f:
        f.write(b"content")
    r = guestd.guestctl("ls", f":{tmp_path}")
    assert r.returncode == 0 and r.stdout.rstrip().endswith(b" bad\\xff"), r  # a visible escape
    ls = json.loads(guestd.guestctl("--json", "ls", f":{tmp_path}").stdout)
    [entry] = ls["entries"]
    assert (base64.b64decode(entry["name"]["base64"]), ls["total"]) == (b"bad\xff", 1)  # bytes: str or {"base64"}
    # A path given on the command line reaches the guest as the same bytes.
    r = guestd.guestctl("cat", os.fsdecode(b":" + bad))
    assert (r.returncode, r.stdout) == (0, b"content"), r


def test_stdin_is_forwarded(guestd: Guestd) -> None:
    r = guestd.guestctl("exec", "--stdin", "--", "wc", "-c", stdin=b"12345")
    assert r.stdout.strip() == b"5"


def test_unreachable_address_is_a_clean_error(tmp_path: object) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "guestd.cli", "--connect", f"unix:{tmp_path}/none.sock", "ping"],
        capture_output=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    assert r.returncode == 1 and b"guestctl:" in r.stderr and b"Traceback" not in r.stderr


def test_code_commands(tmp_path: object) -> None:
    with scratch_guestd("guestd-cli-code-", "--code-pool", "0") as g:
        r = g.guestctl("code", "run", "x = 6")
        assert r.returncode == 0, r.stderr
        r = g.guestctl("--json", "code", "run", "x * 7")
        obj = json.loads(r.stdout)
        for key in ("status", "stdout", "stderr", "results", "error", "execution_count", "duration_s"):
            assert key in obj
        assert obj["status"] == "ok" and obj["results"][0]["data"]["text/plain"] == "42"
        r = g.guestctl("code", "run", "-", stdin=b"print('from stdin')\n1/0")
        assert r.returncode == 1 and r.stdout == b"from stdin\n" and b"ZeroDivisionError" in r.stderr
        r = g.guestctl("code", "run", "--timeout", "0.5", "while True: pass")
        assert r.returncode == 124 and b"timeout" in r.stderr
        r = g.guestctl("--json", "code", "new", "--name", "too-quick", "--start-timeout", "0.001")
        assert r.returncode != 0 and json.loads(r.stdout)["error"]["details"]["reason"] == "start_timeout", r.stdout
        new = json.loads(g.guestctl("--json", "code", "new", "--name", "cli", "--start-timeout", "120").stdout)
        png = (
            "import base64\nfrom IPython.display import Image, display\n"
            "display(Image(data=base64.b64decode("
            "'iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC')))"
        )
        out_dir = f"{tmp_path}/imgs"
        r = g.guestctl("--json", "code", "run", "--context", new["id"], "--save-images", out_dir, png)
        obj = json.loads(r.stdout)
        assert obj["status"] == "ok" and len(obj["saved_images"]) == 1
        with open(obj["saved_images"][0], "rb") as f:
            assert f.read().startswith(b"\x89PNG")
        assert "base64" in obj["results"][0]["data"]["image/png"]
        ls = json.loads(g.guestctl("--json", "code", "ls").stdout)["contexts"]
        assert {c["name"] for c in ls} == {"default", "cli"}
        assert g.guestctl("code", "restart", "cli").returncode == 0
        assert g.guestctl("code", "interrupt", "cli").returncode == 0
        assert g.guestctl("code", "rm", "cli").returncode == 0
        r = g.guestctl("code", "rm", "cli")
        assert r.returncode == 1 and b"not_found" in r.stderr


def test_process_and_shell_commands(guestd: Guestd) -> None:
    r = guestd.guestctl("exec", "--detach", "--", "sh", "-c", "echo one; echo two >&2; sleep 0.3; exit 4")
    assert r.returncode == 0
    process_id = r.stdout.decode().strip()
    assert process_id.startswith("p")
    ps = json.loads(guestd.guestctl("--json", "ps").stdout)["processes"]
    assert process_id in [p["id"] for p in ps]
    assert guestd.guestctl("wait", process_id).returncode == 4
    r = guestd.guestctl("attach", process_id)
    assert (r.returncode, r.stdout) == (4, b"one\n") and r.stderr.startswith(b"two\n")
    r = guestd.guestctl("attach", process_id, "--from", "2")
    assert r.stdout == b"e\n"
    r = guestd.guestctl("exec", "--detach", "--", "sleep", "30")
    sid = r.stdout.decode().strip()
    assert guestd.guestctl("kill", sid, "KILL").returncode == 0
    assert guestd.guestctl("wait", sid).returncode == 137
    r = guestd.guestctl("exec", "--pty", "--", "sh", "-c", "test -t 0 && stty size && exit 6")
    assert r.returncode == 6 and b"24 80" in r.stdout  # not a terminal here: the default size
    s = guestd.guestctl("shell", "new", "--cwd", "/tmp").stdout.decode().strip()
    assert guestd.guestctl("shell", "run", s, "cd /etc; Z=9").returncode == 0
    r = guestd.guestctl("shell", "run", s, "pwd; echo $Z; exit 5")
    assert (r.returncode, r.stdout) == (5, b"/etc\n9\n")
    r = guestd.guestctl("--json", "shell", "run", "--stdin", s, "cat", stdin=b"fed")
    obj = json.loads(r.stdout)
    assert obj["stdout"] == "fed" and obj["cwd"] == "/etc"
    assert guestd.guestctl("shell", "run", s, "sleep 30", "--timeout", "0.3").returncode == 124
    assert s in guestd.guestctl("shell", "ls").stdout.decode()
    assert guestd.guestctl("shell", "rm", s).returncode == 0


def test_exec_detach_spill_and_wait_name_what_the_ring_dropped(guestd: Guestd) -> None:
    r = guestd.guestctl("exec", "--detach", "--spill", "--", "seq", "1", "300000")  # ~2 MB > the 1 MiB ring
    assert r.returncode == 0
    pid = r.stdout.decode().strip()
    r = guestd.guestctl("wait", pid)
    assert r.returncode == 0
    full = "".join(f"{i}\n" for i in range(1, 300001)).encode()
    start = len(full) - 1024 * 1024
    assert f"stdout before offset {start} is no longer in the ring".encode() in r.stderr
    w = json.loads(guestd.guestctl("--json", "wait", pid).stdout)
    assert w["stdout_ring_start"] == start and w["stdout_spill"]["bytes"] == len(full)
    assert w["stdout_spill"]["path"].encode() in r.stderr
    with open(w["stdout_spill"]["path"], "rb") as f:  # this guest is this machine
        assert f.read() == full
