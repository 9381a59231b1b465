"""guestd.testing's fake Services: a capability's handlers driven without a daemon, in
milliseconds (the files capability here, over a temporary directory), and what the fake
cannot give fails loudly, naming what to use instead."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from guestd.exec import handlers as exec_handlers
from guestd.files import handlers as files_handlers
from guestd.testing.services import FakeRequest, RecordingRegistry, call, fake_services
from guestd.wire.errors import GuestdError

if TYPE_CHECKING:
    from guestd.services import Request  # a shape for type checkers only


def test_the_files_capability_runs_on_fake_services(tmp_path: Path) -> None:
    services = fake_services(tmp_path / "rt")
    files_handlers.register(services)
    registry = services.ops
    assert isinstance(registry, RecordingRegistry)
    assert "file.read" in registry.ops() and "file.read" in registry.bulk_reply
    target = tmp_path / "a.txt"

    async def main() -> None:
        written = await call(services, "file.write", {"path": str(target), "data": b"hello\n"})
        assert written["size"] == 6
        read = await call(services, "file.read", {"path": str(target)})
        assert read["data"] == b"hello\n" and read["eof"] is True
        listed = await call(services, "file.list", {"path": str(tmp_path)})
        assert "a.txt" in [e["name"] for e in listed["entries"]]
        with pytest.raises(GuestdError) as missing:
            await call(services, "file.stat", {"path": str(tmp_path / "nope")})
        assert missing.value.code == "not_found"
        with pytest.raises(GuestdError) as bad:  # the schema's checks run as in the server
            await call(services, "file.read", {"path": str(target), "offset": -1})
        assert bad.value.code == "bad_request" and bad.value.details["field"] == "offset"

    asyncio.run(main())
    assert target.read_bytes() == b"hello\n"


def test_a_streamed_download_goes_out_within_the_credit_the_test_grants(tmp_path: Path) -> None:
    services = fake_services(tmp_path / "rt")
    files_handlers.register(services)
    (tmp_path / "big").write_bytes(os.urandom(300_000))

    async def main() -> bytes:
        request = FakeRequest(credit=100_000)
        task = asyncio.ensure_future(call(services, "file.download", {"path": str(tmp_path / "big")}, request))
        # bounded (30 s): the handler reads in an I/O thread, which a loaded machine may run late
        for _ in range(3000):
            if request.credit == 0:
                break
            await asyncio.sleep(0.01)
        assert not task.done() and len(request.data("data")) == 100_000
        request.grant(1 << 20)
        await asyncio.wait_for(task, 30)
        return request.data("data")

    assert asyncio.run(main()) == (tmp_path / "big").read_bytes()


def test_what_the_fake_cannot_give_fails_naming_the_real_tests(tmp_path: Path) -> None:
    services = fake_services(tmp_path / "rt")
    exec_handlers.register(services)
    with pytest.raises(AssertionError, match="child-process component"):
        asyncio.run(call(services, "exec", {"argv": ["true"]}))

    async def nothing(ctx: Request, args: dict[str, Any]) -> dict[str, Any]:
        return {}

    with pytest.raises(AssertionError, match="not an op of the schema"):
        services.ops.add("no.such.op", nothing)
