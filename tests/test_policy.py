"""Policy: peer uids (SO_PEERCRED), op allow/deny lists, write roots, the workload user."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from guestd.client import GuestdError
from guestd.testing import Guestd
from guestd.testing.rawwire import RawPeer
from guestd.wire.frames import Kind, encode_frame


def with_config(fresh_guestd: Callable[..., Guestd], text: str) -> Guestd:
    import tempfile

    fd, path = tempfile.mkstemp(suffix=".toml")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return fresh_guestd("--config", path)


def denied(fn: Callable[[], object]) -> dict[str, object]:
    with pytest.raises(GuestdError) as ei:
        fn()
    assert ei.value.code == "permission_denied", ei.value
    return ei.value.details


def test_unix_peer_uid_must_be_allowed(fresh_guestd: Callable[..., Guestd]) -> None:
    g = with_config(fresh_guestd, "[policy]\nallowed_uids = [54321]\n")
    p = RawPeer(g.raw_socket())
    try:  # guestd refuses at accept: its error and close may come before our hello is written
        p.send_bytes(encode_frame(Kind.HELLO, 0, {"versions": [1]}))
    except (BrokenPipeError, ConnectionResetError):
        pass
    kind, rid, body = p.recv()
    assert (kind, rid, body["code"]) == (Kind.ERROR, 0, "permission_denied")
    assert body["details"]["policy"] == "allowed_uids" and p.closed()
    ok = with_config(fresh_guestd, f"[policy]\nallowed_uids = [{os.geteuid()}]\n")
    with ok.client() as c:
        assert c.ping() > 0


def test_op_allow_and_deny_lists(fresh_guestd: Callable[..., Guestd]) -> None:
    g = with_config(fresh_guestd, '[policy]\ndeny_ops = ["file.*", "code.*"]\n')
    with g.client() as c:
        assert denied(lambda: c.read_file("/etc/hostname")) == {"policy": "deny_ops", "op": "file.read"}
        denied(lambda: c.code_list())
        assert c.exec(["true"]).exit_code == 0
    g = with_config(fresh_guestd, '[policy]\nallow_ops = ["ping", "info", "exec"]\n')
    with g.client() as c:
        assert c.exec(["true"]).exit_code == 0
        assert denied(lambda: c.stat("/"))["policy"] == "allow_ops"


def test_writes_are_confined_to_write_roots(fresh_guestd: Callable[..., Guestd], tmp_path: object) -> None:
    ws = f"{tmp_path}/ws"
    os.makedirs(ws)
    os.symlink("/tmp", f"{ws}/escape")
    g = with_config(fresh_guestd, f'[policy]\nwrite_roots = ["{ws}"]\n')
    with g.client() as c:
        c.write_file(f"{ws}/ok.txt", b"fine")
        c.mkdir(f"{ws}/sub/deeper")
        c.rename(f"{ws}/ok.txt", f"{ws}/sub/ok.txt")
        assert denied(lambda: c.write_file(f"{tmp_path}/outside.txt", b"x"))["policy"] == "write_roots"
        denied(lambda: c.write_file(f"{ws}/escape/x.txt", b"x"))  # a symlink out of the root
        denied(lambda: c.upload(b"x", f"{ws}/../up.txt"))
        denied(lambda: c.rename(f"{ws}/sub/ok.txt", f"{tmp_path}/moved.txt"))
        denied(lambda: c.remove(f"{tmp_path}", recursive=True))
        assert c.read_file(f"{ws}/sub/ok.txt") == b"fine"  # reads are not confined
    assert not os.path.exists(f"{tmp_path}/outside.txt")


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to a workload user needs root")
def test_workload_runs_as_the_configured_user(fresh_guestd: Callable[..., Guestd]) -> None:
    g = with_config(fresh_guestd, '[policy]\nworkload_user = "nobody"\n')
    with g.client() as c:
        assert c.exec(["id", "-u"], cwd="/").stdout == b"65534\n"
        sid = c.shell_create(cwd="/tmp").id
        assert c.shell_run(sid, "id -u").stdout == b"65534\n"
        assert c.shell_run(sid, "cat", input=b"readable").stdout == b"readable"
        p = c.process_start(["id", "-u"], cwd="/")
        c.process_wait(p.id, timeout_s=10)
        assert c.process_output(p.id).stdout == b"65534\n"
        assert c.info().raw["pid"] and os.stat(f"/proc/{c.info().raw['pid']}").st_uid == 0  # guestd stays root


@pytest.mark.skipif(os.geteuid() != 0, reason="giving files to another user needs root")
def test_files_the_host_creates_in_the_workspace_belong_to_the_workload_user(
    fresh_guestd: Callable[..., Guestd],
) -> None:
    import tempfile

    top = tempfile.mkdtemp(prefix="guestd-owner-")
    os.chmod(top, 0o755)  # the workload user must be able to reach its workspace
    ws, outside = f"{top}/ws", f"{top}/outside"
    os.mkdir(outside)
    g = with_config(fresh_guestd, f'workspace = "{ws}"\n[policy]\nworkload_user = "nobody"\n')
    try:
        with g.client() as c:
            c.write_file(f"{ws}/pkg/mod.py", "x = 1\n", parents=True)
            c.mkdir(f"{ws}/a/b", parents=True)
            c.write_file(f"{ws}/log.txt", "one\n", flag="append")
            c.upload(b"blob", f"{ws}/up/blob.bin", parents=True)
            with open(f"{ws}/hosts-own.txt", "w") as f:  # an existing file keeps its owner
                f.write("v1")
            c.write_file(f"{ws}/hosts-own.txt", "v2")
            c.write_file(f"{outside}/etc-like.conf", "k = v\n")
            os.symlink(outside, f"{ws}/escape")
            c.write_file(f"{ws}/escape/through-link.txt", "no\n")
            for path in ("ws", "ws/pkg", "ws/pkg/mod.py", "ws/a", "ws/a/b", "ws/log.txt", "ws/up", "ws/up/blob.bin"):
                assert os.stat(f"{top}/{path}").st_uid == 65534, path
            for path in ("ws/hosts-own.txt", "outside/etc-like.conf", "outside/through-link.txt"):
                assert os.stat(f"{top}/{path}").st_uid == 0, path
            # What the host wrote, the workload can change, next to it too.
            script = "echo 'y = 2' >> pkg/mod.py && touch pkg/new a/b/c up/more && echo two >> log.txt"
            r = c.exec(["sh", "-c", script], timeout_s=30)
            assert r.exit_code == 0, r.stderr
    finally:
        import shutil

        shutil.rmtree(top, ignore_errors=True)
