"""guestd/libc.py: becoming the subreaper and malloc's tuning work through the clone3 extension
(the daemon's case) and through ctypes (the host client's, GUESTD_NATIVE_SPAWN=0, no extension
built). Each case runs in a fresh interpreter: becoming a subreaper is for good."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest

_CASE = """
import ctypes, json, sys
if sys.argv[1] == "extension":
    import guestd.children._clone  # loaded, as the daemon has it by start
from guestd import libc
libc.become_subreaper()
flag = ctypes.c_int(0)
ctypes.CDLL(None).prctl(37, ctypes.byref(flag), 0, 0, 0)  # PR_GET_CHILD_SUBREAPER
print(json.dumps({"subreaper": flag.value, "mallopt": libc.mallopt(-3, 8 * 1024 * 1024),
                  "extension": "guestd.children._clone" in sys.modules}))
"""


def _extension_built() -> bool:
    try:
        importlib.import_module("guestd.children._clone")
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("path", ["extension", "ctypes"])
def test_become_subreaper_and_mallopt_take_effect(path: str) -> None:
    if path == "extension" and not _extension_built():
        pytest.skip("the clone3 extension was not built here")
    done = subprocess.run([sys.executable, "-c", _CASE, path], capture_output=True, text=True, check=True)
    out = json.loads(done.stdout)
    assert out["subreaper"] == 1
    assert out["mallopt"] is True  # glibc, as in the guest
    assert out["extension"] is (path == "extension")


def test_the_host_client_loads_neither_ctypes_nor_the_daemons_children_package() -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import sys, guestd.client; print(sorted(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
    )
    loaded = done.stdout
    assert "'ctypes'" not in loaded
    assert "guestd.children" not in loaded  # memtune once pulled in eight of its modules
