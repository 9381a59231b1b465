"""Code contexts run in the workload's Python ([code] python), not guestd's own (issue 30).

A scratch venv stands in for an image's workload Python: made over the system's python3 with
this venv's packages readable through a .pth (ipykernel, pip; guestd.testing.workload_python),
its own site-packages the workload user's to install into. The workload installs a wheel built
here (no network) and the next cell of a running kernel imports it. A Python without ipykernel,
or none at all, fails code.create at once with a typed error that names it and the fix.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import tempfile
import zipfile
from collections.abc import Iterator
from typing import Any

import pytest

from guestd.client import Client, GuestdError
from guestd.testing.local import NOBODY, Guestd, start_guestd

PROBE = "guestd_probe_pkg"


def _ref(created: Any, key: str = "id") -> Any:
    """A field of a client result, dict or typed (the client's return types are changing)."""
    return created[key] if isinstance(created, dict) else getattr(created, key)


def build_wheel(directory: str, name: str = PROBE, value: int = 42) -> str:
    """A minimal pure-Python wheel (one module), built with zipfile: no network, no build tools."""
    dist = f"{name}-1.0.dist-info"
    files = {
        f"{name}/__init__.py": f"VALUE = {value}\n".encode(),
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: guestd-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = ""
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record += f"{path},sha256={digest},{len(data)}\n"
    record += f"{dist}/RECORD,,\n"
    path = os.path.join(directory, f"{name}-1.0-py3-none-any.whl")
    with zipfile.ZipFile(path, "w") as whl:
        for member, data in files.items():
            whl.writestr(member, data)
        whl.writestr(f"{dist}/RECORD", record)
    os.chmod(path, 0o644)
    return path


def _config(top: str, python: str) -> str:
    ws = f"{top}/ws"
    os.makedirs(ws, exist_ok=True)
    text = f'workspace = "{ws}"\n[code]\npython = "{python}"\npool = 1\n'
    if os.geteuid() == 0:
        os.chown(ws, NOBODY, NOBODY)
        text = text.replace("[code]", '[policy]\nworkload_user = "nobody"\n[code]')
    path = f"{top}/guestd-{os.path.basename(os.path.dirname(os.path.dirname(python)))}.toml"
    with open(path, "w") as f:
        f.write(text)
    return path


@pytest.fixture(scope="module")
def workload() -> Iterator[tuple[Guestd, str, str]]:
    """(guestd, the workload venv's python, a scratch directory the workload can read)."""
    from guestd.testing import workload_python

    top = tempfile.mkdtemp(prefix="guestd-wlpython-")
    os.chmod(top, 0o755)
    try:
        python = workload_python(f"{top}/venv")
        if python is None:
            pytest.skip("no system python3 of this version to make a workload venv over")
        site = subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        if os.geteuid() == 0:
            os.chown(site, NOBODY, NOBODY)  # the workload's venv: the workload installs into it
        g = start_guestd(top, "--config", _config(top, python), "--runtime-dir", f"{top}/rt")
        try:
            yield g, python, top
        finally:
            g.stop()
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_the_kernel_runs_the_workload_python_and_info_says_so(workload: tuple[Guestd, str, str]) -> None:
    g, python, _ = workload
    with Client(g.address) as c:
        kernels = c.info().raw["kernels"]
        python_kernel = next(k for k in kernels if k["name"] == "python")
        assert {k: python_kernel[k] for k in ("python", "own", "setting")} == {
            "python": python,
            "own": False,
            "setting": python,
        }
        first = _ref(c.code_create(deadline=300))
        assert c.code_run("import sys; sys.executable", context=first, timeout_s=300).text == repr(python)
        # The pool's kernel (started after the first create) runs the same Python.
        second = c.code_create(deadline=300)
        assert c.code_run("import sys; sys.executable", context=_ref(second), timeout_s=300).text == repr(python)
        # guestd's own process never imports the workload's packages: the probe is not in it.
        c.code_close(first)
        c.code_close(_ref(second))


def test_a_package_the_workload_installs_is_importable_in_the_next_cell(workload: tuple[Guestd, str, str]) -> None:
    g, python, top = workload
    wheel = build_wheel(top)
    with Client(g.address) as c:
        ctx = _ref(c.code_create(deadline=300))
        before = c.code_run(f"import {PROBE}", context=ctx, timeout_s=300)
        assert before.error is not None and before.error.ename == "ModuleNotFoundError"
        # The workload installs it, from outside the kernel (a shell, an agent's exec) ...
        r = c.exec(
            [python, "-m", "pip", "install", "--no-index", "--no-deps", "--no-cache-dir", "--quiet", wheel],
            env={"PIP_DISABLE_PIP_VERSION_CHECK": "1"},
            timeout_s=300,
        )
        assert r.exit_code == 0, r
        # ... and the running kernel's next cell imports it: the venv's site-packages is on its path.
        after = c.code_run(f"import {PROBE}; {PROBE}.VALUE", context=ctx, timeout_s=300)
        assert after.error is None and after.text == "42", after
        c.code_close(ctx)


def test_a_python_without_ipykernel_fails_create_at_once_naming_it(tmp_path: Any) -> None:
    system = shutil.which("python3", path="/usr/bin:/usr/local/bin")
    if system is None:
        pytest.skip("no system python3")
    top = tempfile.mkdtemp(prefix="guestd-noipk-")
    os.chmod(top, 0o755)
    try:
        bare = f"{top}/bare"  # a venv of its own: nothing but the standard library
        subprocess.run([system, "-m", "venv", "--without-pip", bare], check=True, capture_output=True)
        for here, dirs, files in os.walk(top):
            for entry in dirs + files:
                if not os.path.islink(os.path.join(here, entry)):
                    os.chmod(os.path.join(here, entry), 0o755)
        g = start_guestd(top, "--config", _config(top, f"{bare}/bin/python"), "--runtime-dir", f"{top}/rt")
        try:
            with Client(g.address) as c:
                with pytest.raises(GuestdError) as caught:
                    c.code_create(deadline=120)  # not the 30 s no-progress wait: the launcher exits
                err = caught.value
                assert err.code == "unavailable" and err.details["reason"] == "no_ipykernel", err
                assert err.details["python"] == f"{bare}/bin/python" and "pip install ipykernel" in str(err)
                assert c.exec(["true"], timeout_s=60).exit_code == 0  # guestd itself is fine
        finally:
            g.stop()
        missing = f"{top}/nowhere/bin/python3"
        g = start_guestd(top, "--config", _config(top, missing), "--runtime-dir", f"{top}/rt2")
        try:
            with Client(g.address) as c, pytest.raises(GuestdError) as caught:
                c.code_create(deadline=60)
            assert caught.value.code == "unavailable" and caught.value.details["reason"] == "no_python"
            assert missing in str(caught.value)
        finally:
            g.stop()
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _fake_image_python(root: str, version: str, *, ipykernel: bool) -> None:
    """An image's Debian-style python3 (a link to python3.N; never run) and its dist-packages."""
    os.makedirs(f"{root}/usr/bin")
    open(f"{root}/usr/bin/python{version}", "w").close()
    os.symlink(f"python{version}", f"{root}/usr/bin/python3")
    os.makedirs(f"{root}/usr/lib/python3/dist-packages" + ("/ipykernel" if ipykernel else ""))


def test_bake_finds_the_images_python_and_its_site_directories(tmp_path: Any) -> None:
    from guestd.bake import add_workload_ipykernel, workload_python, workload_site_dirs

    root = f"{tmp_path}/debian"
    _fake_image_python(root, "3.11", ipykernel=True)
    assert workload_python(root) == ("/usr/bin/python3", "3.11")
    assert workload_site_dirs(root, "/usr/bin/python3", "3.11") == [
        "/usr/local/lib/python3.11/dist-packages",
        "/usr/lib/python3/dist-packages",
    ]
    add_workload_ipykernel(root)  # Debian's ipykernel is there: nothing is added
    assert not os.path.exists(f"{root}/usr/local")
    os.makedirs(f"{root}/opt/venv/bin")  # a venv the image owner made: its own site-packages
    os.symlink("/usr/bin/python3", f"{root}/opt/venv/bin/python")
    with open(f"{root}/opt/venv/pyvenv.cfg", "w") as f:
        f.write("home = /usr/bin\nversion = 3.11.2\n")
    assert workload_python(root, "/opt/venv/bin/python") == ("/opt/venv/bin/python", "3.11")
    assert workload_site_dirs(root, "/opt/venv/bin/python", "3.11") == ["/opt/venv/lib/python3.11/site-packages"]
    assert workload_python(f"{tmp_path}/empty") is None
    add_workload_ipykernel(f"{tmp_path}/empty")  # no Python of its own: guestd's serves ("auto")


def test_bake_gives_an_images_python_without_ipykernel_one(tmp_path: Any) -> None:
    import sys

    from guestd.bake import add_workload_ipykernel

    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    root = f"{tmp_path}/debian"
    _fake_image_python(root, version, ipykernel=False)
    add_workload_ipykernel(root)  # pip, like guestd's own dependencies (its cache or index)
    site = f"{root}/usr/local/lib/python{version}/dist-packages"
    for package in ("ipykernel", "jupyter_client", "zmq"):  # what guestd's launcher needs there
        assert os.path.isdir(f"{site}/{package}"), package


def test_the_workloads_cwd_never_stands_in_for_what_the_launcher_imports(workload: tuple[Guestd, str, str]) -> None:
    """python -c puts the cwd (the context's, the workload's to write) first on sys.path: a
    ctypes.py there would run inside the kernel before its key hand-over. The bootstrap takes
    the cwd off first; cells get it back last, after the standard library."""
    g, _, top = workload
    planted = f"{top}/ws/planted"
    os.makedirs(planted, exist_ok=True)
    with open(f"{planted}/ctypes.py", "w") as f:
        f.write(f"open({planted + '/RAN'!r}, 'w').close()\nraise ImportError('planted')\n")
    if os.geteuid() == 0:
        os.chown(planted, NOBODY, NOBODY)
    with Client(g.address) as c:
        ctx = _ref(c.code_create(cwd=planted, deadline=300))
        c.code_restart(ctx, deadline=300)  # a fresh kernel started in that cwd (not a pooled one)
        r = c.code_run("import ctypes, os; (os.getcwd(), ctypes.__file__.startswith(os.getcwd()))", context=ctx)
        assert r.text == repr((planted, False)), r
        assert not os.path.exists(f"{planted}/RAN")
        c.code_close(ctx)
