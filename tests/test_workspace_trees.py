"""tree.upload / tree.download / file.write_many, file.watch, file.changes and report_changes
(issue 18) against a real guestd: a round trip keeps what a tree is, every tar-slip entry kind is
refused by name and leaves nothing behind, and the change feed sees what happened."""

from __future__ import annotations

import asyncio
import io
import os
import stat
import subprocess
import tarfile

import pytest

from guestd.client import AsyncClient, Client
from guestd.testing import Guestd
from guestd.wire.errors import GuestdError


def snapshot(root: str) -> dict[bytes, tuple[object, ...]]:
    """What a tree is: each entry's type, permission bits, mtime (s), content or link target."""
    out: dict[bytes, tuple[object, ...]] = {}
    base = os.fsencode(root)
    for d, dirs, files in os.walk(base):
        for name in dirs + files:
            p = os.path.join(d, name)
            s = os.lstat(p)
            rel = os.path.relpath(p, base)
            if stat.S_ISLNK(s.st_mode):
                out[rel] = ("link", os.readlink(p))
            elif stat.S_ISDIR(s.st_mode):
                out[rel] = ("dir", stat.S_IMODE(s.st_mode), int(s.st_mtime))
            else:
                with open(p, "rb") as f:
                    digest = __import__("hashlib").sha256(f.read()).hexdigest()
                out[rel] = ("file", stat.S_IMODE(s.st_mode), int(s.st_mtime), digest)
    return out


def test_a_tree_round_trips_with_links_modes_mtimes_empty_dirs_a_50mb_file_and_raw_names(
    workspace_client: Client, workspace_env: tuple[Guestd, str], tmp_path: str
) -> None:
    src = f"{tmp_path}/src"
    os.makedirs(f"{src}/empty/deeper")
    os.makedirs(f"{src}/bin")
    with open(f"{src}/bin/run.sh", "w") as f:
        f.write("#!/bin/sh\necho hi\n")
    os.chmod(f"{src}/bin/run.sh", 0o750)
    with open(f"{src}/big.bin", "wb") as f:
        f.write(os.urandom(1 << 20) * 50)  # 50 MiB
    with open(os.fsencode(src) + b"/caf\xe9-latin1.txt", "wb") as f:
        f.write(b"raw name\n")
    os.symlink("bin/run.sh", f"{src}/link")
    os.symlink("missing/target", f"{src}/dangling")
    os.chmod(f"{src}/empty", 0o711)
    os.utime(f"{src}/bin/run.sh", (1_600_000_000, 1_600_000_000))
    os.utime(f"{src}/empty/deeper", (1_500_000_000, 1_500_000_000))
    dst = f"{workspace_env[1]}/round"
    seen: list[int] = []
    up = workspace_client.upload_tree(src, dst, progress=seen.append)
    assert up.entries >= 8 and up.bytes == 50 * (1 << 20) + len("#!/bin/sh\necho hi\n") + len("raw name\n")
    assert sum(seen) > up.bytes
    assert snapshot(dst) == snapshot(src)
    if os.geteuid() == 0:  # in the workspace: the workload's
        assert os.lstat(f"{dst}/bin/run.sh").st_uid == 65534 and os.lstat(f"{dst}/link").st_uid == 65534
    back = f"{tmp_path}/back"
    workspace_client.download_tree(dst, back)
    assert snapshot(back) == snapshot(src)
    listing = tarfile.open(fileobj=io.BytesIO(workspace_client.download_tree(dst, include=["*.sh"]))).getnames()
    assert "bin/run.sh" in listing and "big.bin" not in listing
    with pytest.raises(GuestdError) as exists:
        workspace_client.upload_tree(src, dst)
    assert exists.value.code == "exists"
    small = f"{tmp_path}/small"
    os.makedirs(small)
    with open(f"{small}/only.txt", "w") as f:
        f.write("new\n")
    workspace_client.upload_tree(small, dst, replace=True)
    assert os.listdir(dst) == ["only.txt"]
    assert [n for n in os.listdir(workspace_env[1]) if "guestd-tree" in n] == []  # the old tree is gone


def tar_with(*members: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def entry(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    return info


SLIPS = {
    "absolute": (entry("/tmp/guestd-slip-abs"), b"x"),
    "dotdot": (entry("a/../../guestd-slip-up"), b"x"),
    "link_out": (entry("up", tarfile.SYMTYPE, "../.."), None),
    "link_abs": (entry("etc", tarfile.SYMTYPE, "/etc"), None),
    "hard_link": (entry("hard", tarfile.LNKTYPE, "/etc/passwd"), None),
    "device": (entry("dev", tarfile.CHRTYPE), None),
    "fifo": (entry("pipe", tarfile.FIFOTYPE), None),
}


@pytest.mark.parametrize("kind", sorted(SLIPS))
def test_each_tar_slip_entry_is_refused_by_name_and_leaves_nothing(
    workspace_client: Client, workspace_env: tuple[Guestd, str], kind: str
) -> None:
    ws = workspace_env[1]
    good = (entry("ok/first.txt"), b"fine\n")
    archive = tar_with(good, SLIPS[kind])
    before = set(os.listdir(ws))
    with pytest.raises(GuestdError) as err:
        workspace_client.upload_tree(archive, f"{ws}/slip-{kind}")
    assert err.value.code == "bad_request"
    assert err.value.details["entry"] == SLIPS[kind][0].name
    assert set(os.listdir(ws)) == before  # no target, no temp directory
    assert not os.path.lexists("/tmp/guestd-slip-abs") and not os.path.lexists(f"{os.path.dirname(ws)}/guestd-slip-up")


def test_a_path_through_an_archived_symlink_is_refused(
    workspace_client: Client, workspace_env: tuple[Guestd, str]
) -> None:
    """A link inside the tree (allowed) must not become a way out for a later entry."""
    archive = tar_with((entry("d", tarfile.SYMTYPE, "."), None), (entry("d/x"), b"x"))
    with pytest.raises(GuestdError) as err:
        workspace_client.upload_tree(archive, f"{workspace_env[1]}/via-link")
    assert err.value.details == {"entry": "d/x", "reason": "through_link"}


def test_download_never_opens_a_fifo_and_archives_links_as_links(
    workspace_client: Client, workspace_env: tuple[Guestd, str], tmp_path: str
) -> None:
    d = f"{workspace_env[1]}/special"
    os.makedirs(d)
    os.mkfifo(f"{d}/fifo")
    os.symlink("/etc/passwd", f"{d}/passwd")
    data = workspace_client.download_tree(d)
    assert isinstance(data, bytes)
    members = {m.name: m for m in tarfile.open(fileobj=io.BytesIO(data))}
    assert "fifo" not in members and members["passwd"].issym() and members["passwd"].linkname == "/etc/passwd"


def test_write_many_is_all_or_nothing(workspace_client: Client, workspace_env: tuple[Guestd, str]) -> None:
    ws = workspace_env[1]
    assert workspace_client.write_files({f"{ws}/wm/a.txt": "a", f"{ws}/wm/sub/b.txt": b"b"}, parents=True) == 2
    assert open(f"{ws}/wm/sub/b.txt").read() == "b"
    os.makedirs(f"{ws}/wm/dir")
    with pytest.raises(GuestdError):
        workspace_client.write_files({f"{ws}/wm/c.txt": "c", f"{ws}/wm/nope/x/y": "y"})  # no parents: the second fails
    assert not os.path.exists(f"{ws}/wm/c.txt")
    assert [n for n in os.listdir(f"{ws}/wm") if "guestd-tmp" in n] == []


# --------------------------------------------------------------------------- change feed


async def next_change(it: object, want: tuple[str, bytes]) -> list[tuple[str, bytes]]:
    seen: list[tuple[str, bytes]] = []
    while True:
        ch = await asyncio.wait_for(it.__anext__(), 10)  # type: ignore[attr-defined]
        seen.append((ch.kind, ch.path))
        if (ch.kind, ch.path) == want:
            return seen


def test_watch_sees_create_modify_move_delete_in_new_nested_directories(workspace_env: tuple[Guestd, str]) -> None:
    root = f"{workspace_env[1]}/watched"
    os.makedirs(root)

    async def main() -> None:
        c = await AsyncClient.connect(workspace_env[0].address)
        w = c.watch(root, latency_s=0)
        await w.wait_ready()
        it = w.__aiter__()
        os.makedirs(f"{root}/a/b/c")
        await next_change(it, ("created", b"a/b/c"))
        with open(f"{root}/a/b/c/f.txt", "w") as f:
            f.write("x")
        await next_change(it, ("created", b"a/b/c/f.txt"))
        with open(f"{root}/a/b/c/f.txt", "a") as f:
            f.write("y")
        await next_change(it, ("modified", b"a/b/c/f.txt"))
        os.rename(f"{root}/a/b/c/f.txt", f"{root}/a/b/g.txt")
        seen = await next_change(it, ("created", b"a/b/g.txt"))
        assert ("deleted", b"a/b/c/f.txt") in seen
        os.rename(f"{root}/a/b", f"{root}/moved")  # a watched directory moved: followed at its new path
        await next_change(it, ("created", b"moved"))
        os.unlink(f"{root}/moved/g.txt")
        await next_change(it, ("deleted", b"moved/g.txt"))
        await w.close()
        await c.close()

    asyncio.run(main())


def test_watch_reports_overflow_when_its_client_does_not_read(workspace_env: tuple[Guestd, str]) -> None:
    """Credit runs out (64 KiB of paths), then 10,000 more paths wait; beyond that: overflow."""
    root = f"{workspace_env[1]}/flood"
    os.makedirs(root)

    async def main() -> None:
        c = await AsyncClient.connect(workspace_env[0].address, stream_window=65536)
        w = c.watch(root, latency_s=0)
        await w.wait_ready()
        for i in range(16_000):
            with open(f"{root}/file-number-{i:06d}", "w"):
                pass
        kinds: list[str] = []
        it = w.__aiter__()
        while "overflow" not in kinds:  # bounded: at most 16,000 creations and their modifications
            kinds.append((await asyncio.wait_for(it.__anext__(), 10)).kind)
        assert len(kinds) < 16_000  # some were lost, and that was said
        await w.close()
        await c.close()

    asyncio.run(main())


def test_report_changes_of_a_git_checkout_touch_and_rm(
    workspace_client: Client, workspace_env: tuple[Guestd, str]
) -> None:
    repo = f"{workspace_env[1]}/repo"
    os.makedirs(repo)
    git = "git -c user.email=t@t -c user.name=t -c init.defaultBranch=main"
    subprocess.run(
        f"{git} init -q && echo b > b && {git} add b && {git} commit -qm b", shell=True, cwd=repo, check=True
    )
    if os.geteuid() == 0:
        subprocess.run(["chown", "-R", "nobody:nogroup", repo], check=True)
    reply = workspace_client.call(
        "exec",
        {"shell": f"{git} checkout -q -b x && touch a && rm b", "cwd": repo, "report_changes": True},
    )
    assert reply["exit_code"] == 0, reply
    ch = reply["changes"]

    def outside_git(paths: list[str]) -> list[str]:  # report paths are relative to the workspace
        return [p.removeprefix("repo/") for p in paths if not p.startswith("repo/.git/")]

    assert outside_git(ch["created"]) == ["a"]
    assert outside_git(ch["deleted"]) == ["b"]
    assert outside_git(ch["modified"]) == []
    assert "repo/.git/refs/heads/x" in ch["created"]
    assert "repo/.git/HEAD" in ch["modified"]  # replaced by a rename of HEAD.lock: a modification
    assert not any(p.endswith(".lock") for p in ch["created"] + ch["modified"] + ch["deleted"])
    assert ch["overflow"] is False and ch["total"] == len(ch["created"]) + len(ch["modified"]) + len(ch["deleted"])
    after = workspace_client.changes()
    assert workspace_client.changes(after.cursor).total == 0
