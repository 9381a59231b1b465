"""scripts/demo.sh (issue 31 item 8): the commands it echoes can be pasted back into a shell
(was: quoting lost, ``sh echo "hello from $(hostname)..."`` printed bare), and run without a
terminal it either keeps guestd running (``--keep``, saying how to reach and stop it) or says
that it stopped it (was: killed the guestd it had just said was serving)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

from guestd.testing import REPO

TRICKY = ["plain", "two words", "it's", 'say "$(id)"', "a\\b", "", "*", "x;y&z", "tab\there", "new\nline"]


def quote_function() -> str:
    text = Path(REPO, "scripts/demo.sh").read_text()
    found = re.search(r"^quote\(\) \{\n.*?\n\}\n", text, re.S | re.M)
    assert found is not None
    return found.group()


def test_each_argument_is_quoted_so_bash_reads_it_back() -> None:
    script = quote_function() + 'for a in "$@"; do eval "set -- $(quote "$a")"; printf "%s\\0" "$1"; done'
    r = subprocess.run(["bash", "-c", script, "demo", *TRICKY], capture_output=True, check=True, timeout=30)
    assert r.stdout.split(b"\0")[:-1] == [a.encode() for a in TRICKY]


def fake_checkout(tmp_path: Path) -> Path:
    """The demo's files beside a .venv whose installation stamp is current, so bootstrap.sh
    installs nothing (the real .venv is shared) and .venv/bin/guestd is this checkout's."""
    top = tmp_path / "checkout"
    (top / "scripts").mkdir(parents=True)
    (top / "guestd/children").mkdir(parents=True)
    (top / ".venv/bin").mkdir(parents=True)
    for name in ("scripts/demo.sh", "scripts/bootstrap.sh", "pyproject.toml", "setup.py", "guestd/children/_clone.c"):
        shutil.copy(Path(REPO, name), top / name)
    os.symlink(Path(REPO, ".venv/bin/python"), top / ".venv/bin/python")
    for tool, module in (("guestd", "guestd.server.daemon"), ("guestctl", "guestd.cli")):
        (top / ".venv/bin" / tool).write_text(f'#!/bin/sh\nexec {REPO}/.venv/bin/python -m {module} "$@"\n')
        (top / ".venv/bin" / tool).chmod(0o755)
    (top / ".venv/.guestd-installed").touch()
    return top


def test_echoed_commands_paste_back_and_keep_leaves_guestd_running(tmp_path: Path) -> None:
    top = fake_checkout(tmp_path)
    env = {**os.environ, "PYTHONPATH": REPO}
    r = subprocess.run(
        ["bash", "scripts/demo.sh", "--keep"],
        cwd=top,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        env=env,
        timeout=300,
    )
    out = r.stdout.decode()
    assert r.returncode == 0, (out, r.stderr)
    pid = int(re.findall(r"kill (\d+)", out)[-1])
    try:
        assert "It keeps running" in out
        os.kill(pid, 0)  # still there after the script ended
        export = re.search(r"^\$ export (GUESTD_CONNECT=.*)$", out, re.M)
        hello = re.search(r"^\$ (\.venv/bin/guestctl sh .*hello from.*)$", out, re.M)
        assert export is not None and hello is not None, out
        assert hello.group(1).endswith("""sh 'echo "hello from $(hostname) as $(id -un), pid $$"; uname -sr'""")
        pasted = subprocess.run(
            ["bash", "-c", f"export {export.group(1)}; {hello.group(1)}"], cwd=top, capture_output=True, env=env
        )
        assert pasted.returncode == 0 and pasted.stdout.startswith(b"hello from "), pasted
    finally:
        os.kill(pid, signal.SIGTERM)
