"""files against a real guestd: every op, typed errors, atomicity under failure, large streams."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import random
import subprocess
import threading
import time
from collections.abc import Callable

import pytest

from guestd.client import AsyncClient, Client, GuestdError
from guestd.testing import NO_DAC, Guestd, fsize_limit


def err_code(fn: Callable[[], object]) -> str:
    with pytest.raises(GuestdError) as ei:
        fn()
    return ei.value.code


def test_write_read_stat_roundtrip(client: Client, tmp_path: object) -> None:
    p = f"{tmp_path}/a.bin"
    data = bytes(range(256)) * 100
    assert client.write_file(p, data) == len(data)
    assert client.read_file(p) == data
    assert client.read_file(p, offset=10, length=5) == data[10:15]
    st = client.stat(p)
    assert (st.type, st.size, st.mode) == ("file", len(data), 0o644)
    assert client.write_file(p, b"!!", flag="append") == len(data) + 2
    assert client.read_file(p)[-2:] == b"!!"


def test_write_modes_perm_and_parents(client: Client, tmp_path: object) -> None:
    p = f"{tmp_path}/deep/er/file"
    assert err_code(lambda: client.write_file(p, b"x")) == "not_found"
    client.write_file(p, b"x", parents=True, perm=0o600)
    assert client.stat(p).mode == 0o600
    assert err_code(lambda: client.write_file(p, b"y", flag="create")) == "exists"
    client.write_file(p, b"new")  # overwrite keeps the permission bits
    assert client.stat(p).mode == 0o600 and client.read_file(p) == b"new"
    assert not [n for n in os.listdir(os.path.dirname(p)) if "guestd-tmp" in n]


def test_typed_errors(client: Client, tmp_path: object) -> None:
    d = str(tmp_path)
    open(f"{d}/f", "w").close()
    assert err_code(lambda: client.read_file(f"{d}/missing")) == "not_found"
    assert err_code(lambda: client.read_file(d)) == "is_a_directory"
    assert err_code(lambda: client.write_file(d, b"x")) == "is_a_directory"
    assert err_code(lambda: client.write_file(f"{d}/f/sub", b"x")) == "not_a_directory"
    assert err_code(lambda: client.listdir(f"{d}/f")) == "not_a_directory"
    assert err_code(lambda: client.mkdir(f"{d}/f", parents=False)) == "exists"
    assert err_code(lambda: client.remove(f"{d}/nope")) == "not_found"
    assert err_code(lambda: client.read_file("bad\0path")) == "bad_request"
    assert err_code(lambda: client.rename(f"{d}/nope", f"{d}/x")) == "not_found"


def test_read_cap_is_too_large_with_limit_name(client: Client, tmp_path: object) -> None:
    p = f"{tmp_path}/big"
    with open(p, "wb") as f:
        f.truncate(client.aio.limits["max_read"] + 1)
    with pytest.raises(GuestdError) as ei:
        client.read_file(p)
    assert ei.value.code == "too_large" and ei.value.details["limit"] == "max_read"
    assert len(client.read_file(p, length=100)) == 100


def test_list_mkdir_remove_rename(client: Client, tmp_path: object) -> None:
    d = f"{tmp_path}/tree"
    assert client.mkdir(f"{d}/a/b") is True
    assert client.mkdir(f"{d}/a/b") is False
    client.write_file(f"{d}/a/b/f1", b"1")
    client.write_file(f"{d}/z", b"22")
    os.symlink("z", f"{d}/link")
    names = [(e.name, e.type) for e in client.listdir(d).entries]
    assert names == [("a", "dir"), ("link", "symlink"), ("z", "file")]
    listing = client.listdir(d, max_entries=1)
    assert listing.truncated and len(listing.entries) == 1
    assert client.stat(f"{d}/link", follow=False).target == "z"
    assert err_code(lambda: client.remove(f"{d}/a")) == "not_empty"
    assert client.remove(f"{d}/a", recursive=True) == 3
    client.rename(f"{d}/z", f"{d}/y")
    assert client.read_file(f"{d}/y") == b"22"
    client.write_file(f"{d}/w", b"w")
    assert err_code(lambda: client.rename(f"{d}/w", f"{d}/y", overwrite=False)) == "exists"
    assert client.remove(f"{d}/link") == 1
    assert os.path.exists(f"{d}/y")  # removing a symlink never touches its target


def test_permission_denied(fresh_guestd: Callable[..., Guestd]) -> None:
    g = fresh_guestd(wrapper=NO_DAC) if os.geteuid() == 0 else fresh_guestd()
    with g.client() as c:
        locked = os.path.join(g.workdir, "locked")
        os.mkdir(locked, 0o000)
        secret = os.path.join(g.workdir, "secret")
        with open(secret, "w") as f:
            f.write("s")
        os.chmod(secret, 0o000)
        assert err_code(lambda: c.read_file(secret)) == "permission_denied"
        assert err_code(lambda: c.write_file(f"{locked}/f", b"x")) == "permission_denied"
        assert err_code(lambda: c.listdir(locked)) == "permission_denied"
        assert err_code(lambda: c.download(secret)) == "permission_denied"
        with pytest.raises(GuestdError) as ei:
            c.exec(["true"], cwd=locked + "/x")
        assert ei.value.code == "permission_denied" and ei.value.details["stage"] == "cwd"
        os.chmod(locked, 0o700)


def test_atomic_write_under_a_real_write_failure(fresh_guestd: Callable[..., Guestd]) -> None:
    # The daemon runs with RLIMIT_FSIZE = 1 MiB: a 2 MiB write fails with EFBIG halfway.
    g = fresh_guestd(preexec=fsize_limit(1 << 20))
    target = os.path.join(g.workdir, "precious")
    with g.client() as c:
        c.write_file(target, b"old content")
        attempts: list[Callable[[], object]] = [
            lambda: c.write_file(target, b"n" * (2 << 20)),
            lambda: c.upload(b"u" * (3 << 20), target),
        ]
        for attempt in attempts:
            with pytest.raises(GuestdError) as ei:
                attempt()
            assert ei.value.code == "too_large" and ei.value.errno == 27  # EFBIG
            assert c.read_file(target) == b"old content"
        assert [n for n in os.listdir(g.workdir) if "guestd-tmp" in n] == []


def test_upload_size_mismatch_and_drop_keep_old_file(guestd: Guestd, tmp_path: object) -> None:
    target = f"{tmp_path}/keep"
    with open(target, "wb") as f:
        f.write(b"original")

    async def go() -> None:
        c = await AsyncClient.connect(guestd.address)
        call = c._conn.start("file.upload", {"path": target, "size": 100})
        await call.send_input({"data": b"x" * 10})
        await call.send_input({"eof": True})
        with pytest.raises(GuestdError) as ei:
            await c._conn.wait(call, 10)
        assert ei.value.code == "bad_request"
        call = c._conn.start("file.upload", {"path": target})
        await call.send_input({"data": b"y" * 1000})
        await c.close()  # connection dropped mid-upload

    asyncio.run(go())
    # The daemon notices the dropped connection asynchronously, and may not even have made the
    # temp file yet: wait until there has been none for 0.3 s.
    deadline = time.monotonic() + 10
    clear_since = time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - clear_since < 0.3:
        if [n for n in os.listdir(str(tmp_path)) if "guestd-tmp" in n]:
            clear_since = time.monotonic()
        time.sleep(0.02)
    assert open(target, "rb").read() == b"original"
    assert [n for n in os.listdir(str(tmp_path)) if "guestd-tmp" in n] == []


def test_concurrent_readers_never_see_a_partial_file(client: Client, tmp_path: object) -> None:
    p = f"{tmp_path}/swap"
    a, b = b"A" * 1_500_000, b"B" * 1_500_000
    client.write_file(p, a)
    stop = threading.Event()
    bad: list[int] = []

    def reader() -> None:
        while not stop.is_set():
            with open(p, "rb") as f:
                data = f.read()
            if data not in (a, b):
                bad.append(len(data))

    t = threading.Thread(target=reader)
    t.start()
    for i in range(20):
        client.write_file(p, b if i % 2 == 0 else a)
    stop.set()
    t.join()
    assert bad == []


@pytest.mark.parametrize("size", [0, 1, 1 << 20, 64 << 20])
def test_upload_download_roundtrip_with_checksum(client: Client, tmp_path: object, size: int) -> None:
    src = f"{tmp_path}/src"
    with open(src, "wb") as f:
        f.write(os.urandom(min(size, 1 << 20)) * max(1, size >> 20) if size else b"")
    want = hashlib.sha256(open(src, "rb").read()).hexdigest()
    remote = f"{tmp_path}/remote/file"
    assert client.upload(src, remote, parents=True) == size
    back = f"{tmp_path}/back"
    assert client.download(remote, back) == size
    assert hashlib.sha256(open(back, "rb").read()).hexdigest() == want
    part = client.download(remote, offset=size // 3, length=1000)
    assert part == open(src, "rb").read()[size // 3 : size // 3 + 1000]


def test_download_of_a_file_not_in_the_page_cache(client: Client, tmp_path: object) -> None:
    # Chunks the page cache holds are read on the loop (RWF_NOWAIT), the others in an I/O
    # thread: dropping the file's pages first sends the download down the second path.
    data = os.urandom(3 << 20)
    src = f"{tmp_path}/cold"
    with open(src, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    assert client.download(src) == data


def test_upload_failing_mid_stream_is_typed_and_leaves_nothing(client: Client, tmp_path: object) -> None:
    # Writes run in batches while the next chunks arrive: a batch that fails (a full disk)
    # must end the upload with its typed error, the old file kept and no temp file left.
    d = os.path.join(str(tmp_path), "small")
    os.mkdir(d)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", d]).returncode:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        with open(f"{d}/target", "wb") as f:
            f.write(b"old")
        with pytest.raises(GuestdError) as ei:
            client.upload(os.urandom(8 << 20), f"{d}/target")
        assert ei.value.code == "no_space"
        assert sorted(os.listdir(d)) == ["target"]
        assert open(f"{d}/target", "rb").read() == b"old"
    finally:
        subprocess.run(["umount", "--lazy", d], check=True)  # guestd may close its fd there a moment later


def test_download_errors_are_typed(client: Client, tmp_path: object) -> None:
    assert err_code(lambda: client.download(f"{tmp_path}/none")) == "not_found"
    assert err_code(lambda: client.download(str(tmp_path))) == "is_a_directory"


def test_upload_abandoned_at_any_moment_leaves_no_temp_file(guestd: Guestd, tmp_path: object) -> None:
    from guestd.testing.rawwire import RawPeer
    from guestd.wire.frames import Kind

    target = f"{tmp_path}/raced"
    for i in range(40):
        p = RawPeer(guestd.raw_socket())
        p.hello()
        p.request(1, "file.upload", {"path": target})
        if i % 2:
            p.send(Kind.INPUT, 1, {"data": b"z" * 100})
        p.sock.close()  # gone while the temp file may still be being created
    deadline = time.monotonic() + 10
    while [n for n in os.listdir(str(tmp_path)) if "guestd-tmp" in n] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [n for n in os.listdir(str(tmp_path)) if "guestd-tmp" in n] == []
    assert not os.path.exists(target)


def test_no_space_is_typed(client: Client, tmp_path: object) -> None:
    # A 16 KiB tmpfs is a full disk soon enough (/dev/full is a device, not a file: not_a_file).
    d = os.path.join(str(tmp_path), "small")
    os.mkdir(d)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", d]).returncode:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        for flag in ("append", "overwrite"):
            with pytest.raises(GuestdError) as ei:
                client.write_file(f"{d}/big-{flag}", b"x" * 100_000, flag=flag)
            assert ei.value.code == "no_space" and ei.value.errno == 28
        with pytest.raises(GuestdError) as ei:
            client.write_file("/dev/full", b"x", flag="append")
        assert ei.value.code == "not_a_file"
    finally:
        subprocess.run(["umount", d], check=True)


@pytest.mark.parametrize(
    "err, code",
    [(30, "read_only"), (5, "io_error"), (122, "no_space"), (2, "not_found"), (39, "not_empty"), (27, "too_large")],
)
def test_errno_mapping(err: int, code: str) -> None:
    e = GuestdError.from_os_error(OSError(err, os.strerror(err), "/x"))
    assert (e.code, e.errno) == (code, err) and "/x" in e.message


def test_read_pseudo_files_that_report_size_zero(client: Client) -> None:
    data = client.read_file("/proc/self/status")  # guestd's own status: size 0 in stat, content on read
    assert data.startswith(b"Name:") and len(data) > 100
    assert client.read_file("/proc/self/cmdline", length=4) != b""


# --------------------------------------------------------------------------- names that are not UTF-8

BAD = b"bad\xff"  # a legal Linux name that is not UTF-8: it travels as msgpack bin


def test_names_that_are_not_utf8_round_trip(client: Client, tmp_path: object) -> None:
    d = os.fsencode(str(tmp_path))
    with open(d + b"/" + BAD, "wb") as f:
        f.write(b"made on the host")
    # The defect: the reply naming it could not be encoded, so none came (the client waited).
    listing = client.listdir(str(tmp_path), deadline=10)
    assert [e.name for e in listing.entries] == [BAD]
    p = d + b"/" + BAD
    assert client.stat(p, deadline=10).size == 16
    assert client.stat(os.fsdecode(p), deadline=10).size == 16  # an os str names the same bytes
    assert client.read_file(p, deadline=10) == b"made on the host"
    assert client.write_file(p, b"written", deadline=10) == 7
    assert client.upload(b"u" * 100_000, p, progress_timeout=10) == 100_000
    assert client.download(p, progress_timeout=10) == b"u" * 100_000
    os.symlink(BAD, d + b"/link")
    assert client.stat(d + b"/link", follow=False, deadline=10).target == BAD
    sub = d + b"/dir\xfe"
    assert client.mkdir(sub + b"/deeper\xfd", deadline=10) is True
    assert client.stat(sub, deadline=10).type == "dir"
    assert [e.name for e in client.listdir(sub, deadline=10).entries] == [b"deeper\xfd"]
    client.rename(p, sub + b"/moved\xfc", deadline=10)
    assert sorted(os.listdir(sub)) == [b"deeper\xfd", b"moved\xfc"]
    # Errors naming such a path are answered too: escaped in the message, exact in details.
    with pytest.raises(GuestdError) as ei:
        client.read_file(sub, deadline=10)
    assert ei.value.code == "is_a_directory" and ei.value.details["path"] == sub
    assert "dir\\xfe" in ei.value.message
    with pytest.raises(GuestdError) as ei:
        client.read_file(sub + b"/missing\xff", deadline=10)
    assert ei.value.code == "not_found" and "missing\\xff" in ei.value.message
    assert client.remove(sub, recursive=True, deadline=10) == 3
    assert client.exec(["pwd"], cwd=d + b"/", deadline=10).stdout == d + b"\n"
    os.mkdir(sub)
    assert client.exec(["pwd"], cwd=sub, deadline=10).stdout == sub + b"\n"
    proc = client.process_start(["pwd"], cwd=sub, deadline=10)
    assert client.process_output(proc.id).stdout == sub + b"\n"


def test_a_bin_path_in_a_raw_request(guestd: Guestd, tmp_path: object) -> None:
    from guestd.testing.rawwire import RawPeer
    from guestd.wire.frames import Kind

    d = os.fsencode(str(tmp_path))
    with open(d + b"/" + BAD, "wb") as f:
        f.write(b"xyz")
    open(d + b"/plain", "wb").close()
    p = RawPeer(guestd.raw_socket())
    p.hello()
    p.request(1, "file.stat", {"path": d + b"/" + BAD})
    kind, body = p.recv_final(1)
    assert kind == Kind.RESPONSE and body["size"] == 3, body
    p.request(2, "file.list", {"path": d})  # bin although it is UTF-8: both forms are accepted
    kind, body = p.recv_final(2)
    assert kind == Kind.RESPONSE
    assert [e["name"] for e in body["entries"]] == [BAD, "plain"]  # bin only where str cannot be
    p.request(3, "file.stat", {"path": 7})
    kind, body = p.recv_final(3)
    assert kind == Kind.ERROR and body["code"] == "bad_request" and body["details"]["field"] == "path"


def test_a_truncated_list_is_the_first_entries_by_name_bytes(client: Client, tmp_path: object) -> None:
    d = os.fsencode(str(tmp_path))
    # "\ue000" is b"\xee\x80\x80": before b"\xff" as bytes, after it as an os str ("\udcff").
    names = [b"%03d" % i for i in range(200)] + [b"\xff", "\ue000".encode()]
    random.Random(13).shuffle(names)
    for n in names:
        open(d + b"/" + n, "wb").close()
    ordered = sorted(names)

    def as_bytes(name: str | bytes) -> bytes:
        return name if isinstance(name, bytes) else name.encode()

    listing = client.listdir(str(tmp_path), max_entries=10)
    assert [as_bytes(e.name) for e in listing.entries] == ordered[:10]
    assert (listing.total, listing.truncated) == (202, True)
    full = client.listdir(str(tmp_path))
    assert [as_bytes(e.name) for e in full.entries] == ordered
    assert (full.total, full.truncated) == (202, False)
    none = client.listdir(str(tmp_path), max_entries=0)
    assert (none.entries, none.total, none.truncated) == ([], 202, True)


def test_mkdir_parents_two_thousand_levels_deep(client: Client, tmp_path: object) -> None:
    base = str(tmp_path)
    deep = base + "/d" * 2000  # under PATH_MAX (4096) with one-letter names
    assert len(deep) < 4096 - 10
    try:
        assert client.mkdir(deep) is True  # was `internal` (RecursionError)
        assert os.path.isdir(deep)
        assert client.mkdir(deep) is False
        assert client.write_file(deep + "/x/y", b"deep", parents=True) == 4
        with pytest.raises(GuestdError) as ei:
            client.mkdir(deep + "/d" * 60)  # beyond PATH_MAX
        assert (ei.value.code, ei.value.errno) == ("bad_request", errno.ENAMETOOLONG)
        assert os.listdir(deep) == ["x"]  # nothing of it was made
    finally:
        _remove_deep(base + "/d")


def _remove_deep(top: str) -> None:
    """rm -r of a tree too deep for shutil.rmtree (which recurses): down to a leaf, remove, repeat."""
    at = top
    while os.path.isdir(at):
        inside = os.listdir(at)
        if inside:
            child = os.path.join(at, inside[0])
            if os.path.isdir(child) and not os.path.islink(child):
                at = child
            else:
                os.unlink(child)
            continue
        os.rmdir(at)
        if at == top:
            return
        at = os.path.dirname(at)


def test_remove_recursive_of_a_tree_deeper_than_python_recursion(client: Client, tmp_path: object) -> None:
    base = str(tmp_path)
    deep = base
    for _ in range(1500):  # os.makedirs recurses too
        deep += "/r"
        os.mkdir(deep)
    outside = f"{base}/keep"
    os.makedirs(outside)
    with open(f"{outside}/precious", "w") as f:
        f.write("x")
    os.symlink(outside, f"{base}/r/r/link")  # a symlink inside the tree is removed, never followed
    with open(f"{deep}/leaf", "w") as f:
        f.write("leaf")
    try:
        removed = client.remove(base + "/r", recursive=True)  # was `internal` (RecursionError)
        assert removed == 1500 + 2  # the directories, the leaf file and the symlink
        assert not os.path.exists(base + "/r")
        assert os.listdir(outside) == ["precious"]
    finally:
        _remove_deep(base + "/r")


def test_a_write_queued_behind_an_abort_never_lands_in_a_file_that_reuses_the_fd(tmp_path: object) -> None:
    # An upload cancelled while its write waits for an I/O thread: abort closes the temp
    # file's fd, the next open (another upload) gets the same number, then the stale write
    # runs. Before the fix it wrote into that other file (seen: 8192 bytes in a 4096-byte upload).
    from guestd.files.atomic import AtomicFile
    from guestd.files.fs import FileSystem

    first = AtomicFile(FileSystem().place(f"{tmp_path}/first"), "overwrite", None)
    stale_fd = first.fd
    first.abort()  # closes the temp file's fd and its directory's
    spare = os.open(f"{tmp_path}/spare", os.O_WRONLY | os.O_CREAT, 0o600)  # takes the lower number
    other = os.open(f"{tmp_path}/other", os.O_WRONLY | os.O_CREAT, 0o600)
    os.close(spare)
    try:
        assert other == stale_fd  # the number was reused, as it is under load
        with pytest.raises(GuestdError) as ei:
            first.write(b"x" * 4096)
        assert ei.value.code == "cancelled"
        with pytest.raises(GuestdError):
            first.commit()
        assert os.path.getsize(f"{tmp_path}/other") == 0
        assert not os.path.exists(f"{tmp_path}/first")
    finally:
        os.close(other)
