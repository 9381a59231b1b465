"""Our fixture shim for SWE-ReX's own ``tests/test_execution.py`` (downloaded from its pinned
sdist when the test runs: tests/upstream.py, tests/test_integrations_swerex.py; never stored here).

That file takes a ``remote_runtime`` and a ``runtime_with_default_session`` fixture and imports
``_Action``/``_Command`` (actions with 5 s default timeouts) from the conftest beside it; the
conftest written beside it at test time imports them from this module. ``remote_runtime`` is a
GuestdRuntime on a real local guestd; with SWEREX_RUNTIME=local it is SWE-ReX's own
LocalRuntime, with SWEREX_RUNTIME=remote SWE-ReX's HTTP server in a thread with a LocalRuntime
behind it and a RemoteRuntime to it (the baselines, run side by side in the same test)."""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator

import pytest
from swerex.runtime.abstract import AbstractRuntime, BashAction, CloseSessionRequest, Command, CreateSessionRequest

from guestd.integrations.swerex import GuestdRuntime
from guestd.testing.local import start_guestd


@pytest.fixture(scope="session")
def guestd_address() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="guestd-swerex-") as d:
        g = start_guestd(d, ready_timeout_s=60)
        try:
            yield g.address
        finally:
            g.stop()


@pytest.fixture(scope="session")
def swerex_server_port() -> int:
    import uvicorn
    from swerex.server import app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    threading.Thread(
        target=lambda: uvicorn.run(app, host="127.0.0.1", port=port, log_level="error"), daemon=True
    ).start()
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return port
        except OSError:
            time.sleep(0.1)
    pytest.fail("the SWE-ReX server did not start")


@pytest.fixture
async def remote_runtime(request: pytest.FixtureRequest) -> AsyncIterator[AbstractRuntime]:
    r: AbstractRuntime
    if os.environ.get("SWEREX_RUNTIME") == "local":
        from swerex.runtime.local import LocalRuntime

        r = LocalRuntime()
    elif os.environ.get("SWEREX_RUNTIME") == "remote":
        from swerex.runtime.remote import RemoteRuntime

        r = RemoteRuntime(host="http://127.0.0.1", port=request.getfixturevalue("swerex_server_port"), auth_token="")
    else:
        r = GuestdRuntime(request.getfixturevalue("guestd_address"))
    yield r
    await r.close()


@pytest.fixture
async def runtime_with_default_session(remote_runtime: AbstractRuntime) -> AsyncIterator[AbstractRuntime]:
    r = await remote_runtime.create_session(CreateSessionRequest())  # type: ignore[operator]
    assert r.success if hasattr(r, "success") else True
    yield remote_runtime
    await remote_runtime.close_session(CloseSessionRequest())  # type: ignore[operator]


class _Action(BashAction):
    timeout: float | None = 5


class _Command(Command):
    timeout: float | None = 5
