"""Connecting (issue 30): a failure names the address and what to do; AsyncClient.connect is
both awaitable and an async context manager; default_timeout_s bounds exec where a call does not."""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import uuid
from pathlib import Path

import pytest

from guestd.client import AsyncClient, Client, ConnectError
from guestd.client.address import connect_hint
from guestd.testing import Guestd, live_procs_with


def test_no_socket_names_the_address_and_the_fix(tmp_path: Path) -> None:
    address = f"unix:{tmp_path}/nope.sock"
    with pytest.raises(ConnectError) as ei:
        Client(address)
    assert str(ei.value) == f"no socket at {address}: is guestd running? set GUESTD_CONNECT or --connect"
    assert isinstance(ei.value, OSError) and ei.value.address == address  # old `except OSError` still works


def test_refused_names_the_address_and_the_fix(tmp_path: Path) -> None:
    path = f"{tmp_path}/stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)  # bound, never listening: what a dead guestd's socket file does
    try:
        with pytest.raises(ConnectError) as ei:
            Client(f"unix:{path}")
    finally:
        s.close()
    assert str(ei.value).startswith(f"connection refused at unix:{path}: nothing listens there")
    assert "GUESTD_CONNECT or --connect" in str(ei.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root opens any socket")
def test_permission_denied_names_the_address(tmp_path: Path) -> None:
    path = f"{tmp_path}/private.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.listen(1)
    os.chmod(path, 0)
    try:
        with pytest.raises(ConnectError) as ei:
            Client(f"unix:{path}")
    finally:
        s.close()
    assert str(ei.value).startswith(f"permission denied on unix:{path}")


@pytest.mark.parametrize(
    ("err", "start"),
    [
        (errno.EACCES, "permission denied on unix:/x.sock: run as a user allowed to open that socket"),
        (errno.ECONNRESET, "connection reset by unix:/x.sock: is a guestd (not something else) listening"),
        (errno.ENODEV, "cannot reach unix:/x.sock (No such device): is the VM running"),
        (errno.ENOTSOCK, "cannot connect to unix:/x.sock: Socket operation on non-socket; set GUESTD_CONNECT"),
    ],
)
def test_every_connect_failure_has_a_hint(err: int, start: str) -> None:
    e = connect_hint("unix:/x.sock", OSError(err, os.strerror(err)))
    assert str(e).startswith(start) and e.errno == err and e.address == "unix:/x.sock"
    assert str(e).endswith("set GUESTD_CONNECT or --connect")


def test_guestctl_prints_the_hint(guestd: Guestd, tmp_path: Path) -> None:
    address = f"unix:{tmp_path}/nope.sock"
    done = guestd.guestctl("--connect", address, "ping")
    assert done.returncode == 1
    assert done.stderr.decode().strip() == (
        f"guestctl: no socket at {address}: is guestd running? set GUESTD_CONNECT or --connect"
    )


def test_async_connect_is_awaitable_and_a_context_manager_with_one_await(guestd: Guestd) -> None:
    async def main() -> None:
        async with AsyncClient.connect(guestd.address) as c:
            assert (await c.exec(["echo", "one await"])).stdout == b"one await\n"
        assert c._conn.closed
        c2 = await AsyncClient.connect(guestd.address)
        try:
            assert (await c2.exec(["true"])).exit_code == 0
        finally:
            await c2.close()

    asyncio.run(main())


def test_default_timeout_s_bounds_exec_unless_a_call_sets_its_own(guestd: Guestd) -> None:
    token = f"60.{uuid.uuid4().int % 10**9:09d}"
    with Client(guestd.address, default_timeout_s=0.5) as c:
        r = c.exec(["sleep", token])
        assert r.timed_out == "wall" and not live_procs_with(token)
        assert c.exec(["sh", "-c", "sleep 1; echo done"], timeout_s=30).stdout == b"done\n"
