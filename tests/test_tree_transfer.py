"""What the fast tree paths (issue 34: hand-made tar headers both ways, credit granted in
batches, pieces made ahead) must keep meaning, against a real guestd: a local tree's hard
links, exclusions, sub-second mtimes, a guest whose input window is smaller than a batch, and
a compressed archive."""

from __future__ import annotations

import gzip
import io
import os
import re
import tarfile
from decimal import Decimal

from guestd.client import Client
from guestd.testing import Guestd, workspace_guestd


def test_a_local_tree_with_hard_links_uploads_each_name_as_a_file(
    workspace_client: Client, workspace_env: tuple[Guestd, str], tmp_path: str
) -> None:
    """tarfile.add wrote a second name of one inode as a hard link entry, which the guest
    refuses (bad_request, hard_link): a local git clone (objects hard-linked) could not be
    uploaded at all. Each name now goes as a file of its own."""
    src = f"{tmp_path}/src"
    os.makedirs(f"{src}/objects")
    with open(f"{src}/objects/pack", "wb") as f:
        f.write(b"packed" * 1000)
    os.link(f"{src}/objects/pack", f"{src}/objects/pack-again")
    os.link(f"{src}/objects/pack", f"{src}/same")
    dst = f"{workspace_env[1]}/hardlinked"
    workspace_client.upload_tree(src, dst)
    for name in ("objects/pack", "objects/pack-again", "same"):
        with open(f"{dst}/{name}", "rb") as f:
            assert f.read() == b"packed" * 1000
    assert os.stat(f"{dst}/same").st_ino != os.stat(f"{dst}/objects/pack").st_ino


def test_exclude_leaves_out_files_and_whole_directories_on_upload(
    workspace_client: Client, workspace_env: tuple[Guestd, str], tmp_path: str
) -> None:
    src = f"{tmp_path}/src"
    os.makedirs(f"{src}/node_modules/pkg")
    os.makedirs(f"{src}/src")
    for name in ("node_modules/pkg/index.js", "src/a.py", "src/a.pyc", "top.pyc", "keep.txt"):
        with open(f"{src}/{name}", "w") as f:
            f.write(name)
    dst = f"{workspace_env[1]}/excluded"
    workspace_client.upload_tree(src, dst, exclude=["node_modules", "*.pyc"])
    got = sorted(os.path.relpath(os.path.join(d, n), dst) for d, ds, fs in os.walk(dst) for n in ds + fs)
    assert got == ["keep.txt", "src", "src/a.py"]


def test_sub_second_mtimes_go_both_ways(
    workspace_client: Client, workspace_env: tuple[Guestd, str], tmp_path: str
) -> None:
    """Up: to tarfile's float (a microsecond or better); down: the pax record is exact."""
    src = f"{tmp_path}/src"
    os.makedirs(src)
    with open(f"{src}/f", "w") as f:
        f.write("x")
    os.utime(f"{src}/f", ns=(1_700_000_000_123_456_789,) * 2)
    dst = f"{workspace_env[1]}/mtimes"
    workspace_client.upload_tree(src, dst)
    assert abs(os.stat(f"{dst}/f").st_mtime_ns - 1_700_000_000_123_456_789) < 1000
    os.utime(f"{dst}/f", ns=(1_600_000_000_987_654_321,) * 2)
    data = workspace_client.download_tree(dst)
    records = re.findall(rb"\d+ mtime=([0-9.]+)\n", data)
    assert Decimal("1600000000.987654321") in [Decimal(r.decode()) for r in records]
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        assert abs(tar.getmember("f").mtime - 1_600_000_000.987654321) < 1e-6


def test_an_upload_completes_when_the_guests_window_is_smaller_than_a_grant_batch(tmp_path: str) -> None:
    """Credit goes back in batches (256 KiB), and all that was consumed before the extractor
    waits for more: with a 16 KiB window a batch never fills, and without that rule the client
    would wait for credit while guestd waits for data."""
    src = f"{tmp_path}/src"
    os.makedirs(src)
    for i in range(20):
        with open(f"{src}/f{i}", "wb") as f:
            f.write(os.urandom(50_000 + i))
    small = "stream_window = 16384\nmax_chunk = 16384\n"
    with workspace_guestd("guestd-tree-window-", limits=small) as (g, ws), g.client() as c:
        r = c.upload_tree(src, f"{ws}/small-window", progress_timeout=60)
        assert r.entries == 21 and r.bytes == sum(50_000 + i for i in range(20))
        data = c.download_tree(f"{ws}/small-window")
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        assert sorted(tar.getnames()) == sorted(f"f{i}" for i in range(20))


def test_a_gzip_archive_given_as_bytes_is_extracted(
    workspace_client: Client, workspace_env: tuple[Guestd, str]
) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        info = tarfile.TarInfo("d/" + "long" * 40)  # a GNU long name
        info.size = 5
        tar.addfile(info, io.BytesIO(b"hello"))
    dst = f"{workspace_env[1]}/gz"
    workspace_client.upload_tree(gzip.compress(buf.getvalue()), dst)
    with open(f"{dst}/d/{'long' * 40}", "rb") as f:
        assert f.read() == b"hello"
