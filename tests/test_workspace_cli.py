"""guestctl's workspace commands (issue 18) as a user runs them: cp -r both ways, find, grep, view,
edit and its undo, apply-patch from stdin, each with --json where it prints."""

from __future__ import annotations

import json
import os

from guestd.testing import Guestd


def test_guestctl_workspace_commands(guestd: Guestd, tmp_path: str) -> None:
    src = f"{tmp_path}/src"
    os.makedirs(f"{src}/pkg")
    with open(f"{src}/pkg/a.py", "w") as f:
        f.write("x = 1\nNeedle = 2\n")
    os.symlink("pkg/a.py", f"{src}/link")
    guest = f"{tmp_path}/guest"
    r = guestd.guestctl("--json", "cp", "-r", src, f":{guest}")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["direction"] == "upload" and os.readlink(f"{guest}/link") == "pkg/a.py"

    r = guestd.guestctl("--json", "find", f":{guest}", "--glob", "**/*.py")
    assert json.loads(r.stdout)["paths"] == ["pkg/a.py"]
    r = guestd.guestctl("grep", "-i", "-F", "needle", f":{guest}")
    assert r.returncode == 0 and r.stdout == b"pkg/a.py:2:Needle = 2\n"
    assert guestd.guestctl("grep", "nothing-matches-this", f":{guest}").returncode == 1

    r = guestd.guestctl("view", f":{guest}/pkg/a.py", "--lines", "2:2")
    assert r.stdout == b"     2\tNeedle = 2\n"
    r = guestd.guestctl("--json", "edit", f":{guest}/pkg/a.py", "--old", "x = 1", "--new", "x = 10")
    assert r.returncode == 0 and json.loads(r.stdout)["undo_depth"] == 1
    assert guestd.guestctl("edit", f":{guest}/pkg/a.py", "--undo").returncode == 0
    with open(f"{guest}/pkg/a.py") as f:
        assert f.read() == "x = 1\nNeedle = 2\n"
    r = guestd.guestctl("--json", "edit", f":{guest}/pkg/a.py", "--old", "nope", "--new", "y")
    assert r.returncode == 1 and json.loads(r.stdout)["error"]["code"] == "conflict"

    patch = b"--- a/pkg/a.py\n+++ b/pkg/a.py\n@@ -1,2 +1,2 @@\n-x = 1\n+x = 3\n Needle = 2\n"
    r = guestd.guestctl("--json", "apply-patch", f":{guest}", stdin=patch)
    assert r.returncode == 0 and json.loads(r.stdout)["files"][0]["action"] == "modify"

    back = f"{tmp_path}/back"
    r = guestd.guestctl("cp", "-r", f":{guest}", back)
    assert r.returncode == 0, r.stderr
    with open(f"{back}/pkg/a.py") as f:
        assert f.read() == "x = 3\nNeedle = 2\n"
    assert os.readlink(f"{back}/link") == "pkg/a.py"
