"""Our fixture shim for SWE-ReX's own ``tests/test_execution.py`` (downloaded from its pinned
sdist when the test runs: tests/upstream.py, tests/test_integrations_swerex.py; never stored here).

What that file needs from the conftest beside it is an interface: fixtures named
``remote_runtime`` and ``runtime_with_default_session``, and the names ``_Action`` and
``_Command`` (a BashAction and a Command whose timeout defaults to 5 s), as in upstream's
https://github.com/SWE-agent/SWE-ReX/blob/v1.4.0/tests/conftest.py. The conftest written beside
it at test time imports them from this module. ``remote_runtime`` is a GuestdRuntime on a real
local guestd, or with SWEREX_RUNTIME=local SWE-ReX's own LocalRuntime (the baseline, run side
by side in the same test)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import AsyncIterator, Iterator

import pytest
from swerex.runtime.abstract import (
    AbstractRuntime,
    BashAction,
    CloseBashSessionRequest,
    Command,
    CreateBashSessionRequest,
)

from guestd.integrations.swerex import GuestdRuntime
from guestd.testing.local import start_guestd

UPSTREAM_DEFAULT_TIMEOUT_S = 5.0


@pytest.fixture(scope="session")
def guestd_address() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="guestd-swerex-") as d:
        g = start_guestd(d, ready_timeout_s=60)
        try:
            yield g.address
        finally:
            g.stop()


@pytest.fixture
async def remote_runtime(request: pytest.FixtureRequest) -> AsyncIterator[AbstractRuntime]:
    runtime: AbstractRuntime
    if os.environ.get("SWEREX_RUNTIME") == "local":
        from swerex.runtime.local import LocalRuntime

        runtime = LocalRuntime()
    else:
        runtime = GuestdRuntime(request.getfixturevalue("guestd_address"))
    try:
        yield runtime
    finally:
        await runtime.close()


@pytest.fixture
async def runtime_with_default_session(remote_runtime: AbstractRuntime) -> AsyncIterator[AbstractRuntime]:
    """The runtime with its session named "default" open (the name both runtimes use when the
    test's actions name none)."""
    await remote_runtime.create_session(CreateBashSessionRequest())
    try:
        yield remote_runtime
    finally:
        await remote_runtime.close_session(CloseBashSessionRequest())


class _Action(BashAction):
    timeout: float | None = UPSTREAM_DEFAULT_TIMEOUT_S


class _Command(Command):
    timeout: float | None = UPSTREAM_DEFAULT_TIMEOUT_S
