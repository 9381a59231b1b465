"""guestd-bake on the host: the tree it writes, and an ext4 image of it (booting is tests/qemu)."""

from __future__ import annotations

import importlib.util
import marshal
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from guestd.testing import REPO


@pytest.mark.skipif(shutil.which("mkfs.ext4") is None, reason="needs mkfs.ext4")
def test_bake_writes_a_complete_tree_and_an_ext4_image(tmp_path: object) -> None:
    root = f"{tmp_path}/root"
    img = f"{tmp_path}/root.ext4"
    subprocess.run(
        [sys.executable, "-m", "guestd.bake", root, "--ext4", img, "--size-mb", "512"],
        check=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO},
        capture_output=True,
        preexec_fn=lambda: os.umask(0),  # a careless baker: nothing bake makes may be writable to others
    )
    writable = []
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            st = os.lstat(os.path.join(d, name))
            if not stat.S_ISLNK(st.st_mode) and st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
                writable.append(os.path.join(d, name)[len(root) :])
    assert not writable, writable[:10]  # before: /usr/local/bin and /opt/guestd/python were 0777 (red team)
    for path in (
        "/usr/local/bin/guestd",
        "/usr/local/bin/guestctl",
        "/sbin/guestd-init",
        "/etc/guestd/guestd.toml",
        "/etc/systemd/system/guestd.service",
        "/etc/modules-load.d/guestd.conf",
        "/etc/sysctl.d/50-guestd.conf",
        "/opt/guestd/python/bin/python3",
    ):
        assert os.path.exists(root + path), path
    site = f"{root}/opt/guestd/python/lib/python3.{sys.version_info.minor}/site-packages"
    for pkg in ("guestd", "msgpack", "uvloop", "psutil", "jupyter_client", "ipykernel"):
        assert os.path.isdir(f"{site}/{pkg}"), pkg
    # Byte-compiled in the image (before: compiled from source at every start, ~250 ms), with
    # the image's paths in the code objects, not the baking machine's.
    for source in (
        f"{site}/guestd/__main__.py",
        f"{site}/msgpack/__init__.py",
        f"{os.path.dirname(site)}/asyncio/events.py",
    ):
        cached = importlib.util.cache_from_source(source)
        assert os.path.isfile(cached), cached
        with open(cached, "rb") as f:
            code = marshal.loads(f.read()[16:])
        assert code.co_filename == source[len(root) :], code.co_filename
    with open(root + "/etc/passwd") as f:
        assert any(line.startswith("sandbox:x:1000:1000:") for line in f)  # the default workload user
    with open(root + "/usr/local/bin/guestd") as f:
        wrapper = f.read()
    assert "GUESTD_PRIVATE_ENV=LD_LIBRARY_PATH" in wrapper and "-m guestd" in wrapper
    assert os.path.getsize(img) == 512 << 20
    if shutil.which("debugfs"):
        out = subprocess.run(["debugfs", "-R", "stat /usr/local/bin/guestd", img], capture_output=True, text=True)
        assert "Type: regular" in out.stdout


def test_default_config_is_valid_and_every_key_documented() -> None:
    from guestd.config import Config, load_config_file

    path = os.path.join(REPO, "rootfs-overlay", "etc", "guestd", "guestd.toml")
    cfg = load_config_file(path, Config())
    assert cfg.listen == ["vsock:10700", "serial:/dev/virtio-ports/org.guestd.0"] and cfg.allowed_cids == {2}
    assert cfg.policy.workload_user == "sandbox" and cfg.workload.cgroup == "/sys/fs/cgroup/guestd-workload"
    with open(path) as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        if "=" in line and not line.lstrip().startswith("#") and not line.startswith("["):
            documented = "#" in line or (i > 0 and lines[i - 1].lstrip().startswith("#"))
            assert documented, f"undocumented key: {line}"


def test_bad_config_is_a_clear_error(tmp_path: object) -> None:
    from guestd.config import Config, ConfigError, load_config_file

    for text in ('listen = "vsock:1"', "nonsense = 1", "[limits]\nmax_frame = 'big'", "[code]\npool = true"):
        p = f"{tmp_path}/bad.toml"
        with open(p, "w") as f:
            f.write(text)
        with pytest.raises(ConfigError):
            load_config_file(p, Config())
    r = subprocess.run(
        [sys.executable, "-m", "guestd", "--config", p],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": REPO},
        timeout=60,
    )
    assert r.returncode == 2 and "pool" in r.stderr


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git on this machine")
def test_add_copies_a_program_with_its_libraries(tmp_path: object) -> None:
    from guestd.bake import add_paths, needed_libs

    git = os.path.realpath(shutil.which("git") or "")
    root = f"{tmp_path}/root"
    add_paths(root, [git])
    assert os.access(root + git, os.X_OK)
    libs = needed_libs([git])
    assert libs  # git links at least libc and zlib
    for lib in libs:
        if not lib.startswith(sys.base_prefix):
            assert os.path.exists(root + lib), lib
    with pytest.raises(SystemExit, match="no such file"):
        add_paths(root, [f"{tmp_path}/missing"])


def test_a_config_of_ones_own_without_in_guest_is_warned_about(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """guestd-bake --config FILE: a config that does not say in_guest = true makes every clone of
    the image only simulate restore's re-seed (issue 30): bake says so."""
    from guestd.bake import warn_unless_in_guest

    mine = tmp_path / "mine.toml"
    mine.write_text('workspace = "/workspace"\n')
    warn_unless_in_guest(str(mine))
    assert "does not say in_guest = true" in capsys.readouterr().err
    mine.write_text('in_guest = true\nworkspace = "/workspace"\n')
    warn_unless_in_guest(str(mine))
    assert capsys.readouterr().err == ""
    warn_unless_in_guest(f"{REPO}/rootfs-overlay/etc/guestd/guestd.toml")  # the shipped config says it
    assert capsys.readouterr().err == ""
