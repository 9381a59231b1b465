r"""SWE-ReX on guestd: ``GuestdRuntime`` (an ``AbstractRuntime``) and ``GuestdDeployment``
(an ``AbstractDeployment``). ``pip install guestd[swerex]``.

Each SWE-ReX bash session is a guestd shell session: ``run_in_session`` is one
``shell.run`` with ``check_syntax`` (a syntax error raises ``BashIncorrectSyntaxError``
before anything runs), ``merge_stderr`` (the output is what a terminal would show) and the
action's timeout enforced in the guest. A timed-out command is interrupted by guestd and
the session is back at its prompt when the reply arrives, with its cwd and variables: no
``BashInterruptAction`` is needed afterwards (it is accepted and answers at once).
``execute`` is one ``exec`` (``merge_output_streams`` is ``merge_stderr``; ``env``
replaces the environment as ``subprocess.run(env=...)`` does). Files go through
``file.read``/``file.write``/``file.upload`` and ``tree.upload`` for directories.

Interactive commands (``is_interactive_command``/``is_interactive_quit``, with ``expect``
patterns) run in the session itself, on its terminal: ``shell.run {pty: true}`` through
:class:`guestd.client.expect.Expect`, so the program sees the session's cwd, variables,
functions and venv. What is typed goes to it (echoed, as a terminal does; the echo and
``\r`` are removed from the output) until the quit action, whose output is returned once
the program has exited; ``BashInterruptAction`` is ctrl-C to it. While it runs, the
session runs nothing else: a normal action raises ``SessionBusyError`` at once.
``expect`` of a non-interactive action is not used: the command runs to its end (or its
timeout), as guestd knows when a session command ends without matching a prompt.

SWE-ReX 1.4.0 ``tests/test_execution.py`` (50 tests; downloaded from the pinned sdist when
tests/test_integrations_swerex.py runs, with our fixture shim tests/swerex_fixtures.py), run on
both runtimes in the same run on the same machine, 2026-12-03:

- ``TERM`` unset (as SWE-ReX's own CI runs it): guestd and SWE-ReX ``LocalRuntime`` (in
  process, the shim's ``SWEREX_RUNTIME=local``) each 48 passed, 1 failed
  (``test_interrupt_pager``), 1 xfailed (upstream marks it xfail) (``EXPECTED_PASSES``);
- ``TERM=xterm``: guestd the same; LocalRuntime 33 passed, 16 failed, 1 xfailed: its pexpect
  bash then echoes and adds ``\r\n`` (``'\r\nasdf\n\r\n\r\n'`` for ``asdf\n``) in 15 output
  comparisons. guestd returns exactly what the command wrote under any ``TERM``. The test
  asserts guestd's passes >= LocalRuntime's with ``TERM`` unset, and that guestd's outcome does
  not change with ``TERM``.

The difference left, by design:

- ``test_interrupt_pager`` runs ``echo 'blargh' | less -+F`` as a normal (not interactive)
  action with a 0.1 s timeout, expects ``CommandTimeoutError``, and then expects the output
  of the next command, ``echo 'asdf'``, to contain ``kill``. Two reasons it fails here:
  (1) a normal command has no terminal (its stdout is a pipe, so the output is exactly what
  it wrote: the 15 output comparisons LocalRuntime fails pass for that), so ``less`` copies
  its input and exits at once: no timeout. Which command wants a terminal is not known
  before it runs, and running every command on one would give up those exact outputs.
  (2) Even on the session's terminal (``shell.run {pty: true}``, tried: the pager times out
  and is interrupted, exit 130) the next command's output is ``asdf\n`` and nothing else.
  The ``kill`` the test looks for is bash's job notice (``[1]+ Killed ...``) left by
  LocalRuntime's recovery (ctrl-Z, ``kill -9 %1``) in the *next* command's output; guestd
  ends a timed-out command itself and does not leak one command's notices into another's
  output (tests/test_integrations_swerex.py checks that), so printing one would be made up.
- ``test_server_dead`` builds SWE-ReX's own ``RemoteRuntime`` for an unresolvable host: it
  passes whatever runtime the fixture provides.

Deployment: ``GuestdDeployment`` starts a guest on ``start`` and ends it on ``stop``; three
ways to get one:

- ``GuestdDeployment()``: a local guestd in a temporary directory (development: the same
  daemon a VM runs, without the VM's isolation).
- ``GuestdDeployment(start_guest=qemu_guest)`` (``from guestd.testing.qemu import
  qemu_guest``): the QEMU test image, for tests. It bakes the image, boots it under QEMU
  (TCG here: about 35 s to a ready guestd) and connects over virtio-serial: the address is
  ``unix:`` on QEMU's chardev socket, each connection a new host session. ``stop`` kills the
  VM and removes its work dir. Needs qemu-system-x86_64, busybox, cpio (see tests/qemu).
- ``GuestdDeployment(start_guest=hook)``: the hook for a Firecracker (or any VM) host.
  ``hook()`` runs in a thread on ``start``, boots a microVM whose image runs guestd, returns
  once guestd answers (``start`` checks once, 30 s) and gives ``(address, stop)``; ``stop()``
  is called on ``stop``. For Firecracker the address is its hybrid vsock, ``fc:UDS:PORT``::

      def firecracker_guest() -> tuple[str, Callable[[], None]]:
          vm = subprocess.Popen(["firecracker", "--no-api", "--config-file", "vm.json"])
          # vm.json: "vsock": {"guest_cid": 3, "uds_path": "/run/vm/v.sock"}
          address = "fc:/run/vm/v.sock:10700"
          ...  # retry Client(address) until it connects (guestd is up)
          return address, lambda: (vm.kill(), vm.wait())

  ``GuestdDeployment(address=...)`` only connects: someone else starts and ends that guest.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shlex
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from swerex.deployment.abstract import AbstractDeployment
from swerex.deployment.hooks.abstract import CombinedDeploymentHook, DeploymentHook
from swerex.exceptions import (
    BashIncorrectSyntaxError,
    CommandTimeoutError,
    DeploymentNotStartedError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
    SessionExistsError,
    SwerexException,
)
from swerex.runtime.abstract import (
    AbstractRuntime,
    BashAction,
    BashInterruptAction,
    BashObservation,
    CloseBashSessionRequest,
    CloseBashSessionResponse,
    CloseResponse,
    Command,
    CommandResponse,
    CreateBashSessionRequest,
    CreateBashSessionResponse,
    IsAliveResponse,
    ReadFileRequest,
    ReadFileResponse,
    UploadRequest,
    UploadResponse,
    WriteFileRequest,
    WriteFileResponse,
)

from guestd.client import AsyncClient, GuestdError
from guestd.client.expect import Expect, ExpectEOF

__all__ = ["EXPECTED_PASSES", "GuestdDeployment", "GuestdRuntime", "SessionBusyError", "StartGuest"]

EXPECTED_PASSES = 48  # SWE-ReX 1.4.0 tests/test_execution.py on guestd (see the module docs)

NO_TIMEOUT_S = 365 * 24 * 3600.0

StartGuest = Callable[[], tuple[str, Callable[[], None]]]


class SessionBusyError(SwerexException, RuntimeError):
    """A normal command for a session whose terminal an interactive program holds."""


@dataclass
class _Session:
    guest_id: str
    interactive: Expect | None = None  # the interactive program running on the session's terminal


def _text(data: bytes) -> str:
    return data.decode(errors="backslashreplace")


def _clean(output: bytes, action: BashAction) -> str:
    """Terminal output as SWE-ReX returns it: newlines, without the echoed input."""
    text = _text(output).replace("\r\n", "\n")
    return text.lstrip().removeprefix(action.command.strip()).strip()


def _wait_s(action: BashAction) -> float:
    """How long to wait for an interactive program: the action's timeout; none means none
    (SWE-ReX's ``timeout=None``), here a year."""
    return action.timeout if action.timeout is not None else NO_TIMEOUT_S


def _timeout(action: BashAction) -> CommandTimeoutError:
    return CommandTimeoutError(f"timeout after {action.timeout} seconds while running command {action.command!r}")


class GuestdRuntime(AbstractRuntime):
    """A SWE-ReX runtime whose commands run in the guestd guest at ``address``."""

    def __init__(self, address: str, *, token: str | None = None, connect_timeout: float = 10.0) -> None:
        self.address = address
        self._token = token
        self._connect_timeout = connect_timeout
        self._client: AsyncClient | None = None
        self._sessions: dict[str, _Session] = {}

    async def _guest(self) -> AsyncClient:
        if self._client is None:
            self._client = await AsyncClient.connect(
                self.address, token=self._token, connect_timeout=self._connect_timeout
            )
        return self._client

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        try:
            async with asyncio.timeout(timeout):
                await (await self._guest()).ping(deadline=timeout)
        except (OSError, GuestdError, TimeoutError) as e:
            return IsAliveResponse(is_alive=False, message=f"guestd at {self.address}: {e}")
        return IsAliveResponse(is_alive=True)

    # -- sessions ---------------------------------------------------------------------------
    async def create_session(self, request: Any) -> CreateBashSessionResponse:
        assert isinstance(request, CreateBashSessionRequest)
        if request.session in self._sessions:
            raise SessionExistsError(f"session {request.session} already exists")
        client = await self._guest()
        info = await client.shell_create()
        self._sessions[request.session] = _Session(str(info.id))
        output = ""
        for path in request.startup_source:
            r = await client.shell_run(
                str(info.id), f"source {shlex.quote(path)}", timeout_s=request.startup_timeout, merge_stderr=True
            )
            output += r.stdout.decode(errors="backslashreplace")
        return CreateBashSessionResponse(output=output)

    def _session(self, name: str) -> _Session:
        try:
            return self._sessions[name]
        except KeyError:
            raise SessionDoesNotExistError(f"session {name!r} does not exist") from None

    async def run_in_session(self, action: Any) -> BashObservation:
        session = self._session(action.session)
        if isinstance(action, BashInterruptAction):
            return await self._interrupt(session)
        assert isinstance(action, BashAction)
        if action.is_interactive_command or action.is_interactive_quit:
            return await self._run_interactive(session, action)
        if session.interactive is not None:
            raise SessionBusyError(
                f"session {action.session!r} is running an interactive program: send it input "
                "(is_interactive_command), end it (is_interactive_quit) or interrupt it (BashInterruptAction)"
            )
        obs = await self._run_normal(session, action)
        if action.check == "raise" and obs.exit_code != 0:
            msg = f"Command {action.command!r} failed with exit code {obs.exit_code}. Output:\n{obs.output!r}"
            raise NonZeroExitCodeError(f"{action.error_msg}: {msg}" if action.error_msg else msg)
        return obs

    async def _run_normal(self, session: _Session, action: BashAction) -> BashObservation:
        if not action.command.strip():
            return BashObservation(output="", exit_code=0)
        client = await self._guest()
        try:
            r = await client.shell_run(
                session.guest_id,
                action.command,
                timeout_s=action.timeout,
                merge_stderr=True,
                check_syntax=True,
            )
        except GuestdError as e:
            if e.code == "bad_request" and (e.details or {}).get("stage") == "syntax":
                message = str((e.details or {}).get("message", e.message))
                raise BashIncorrectSyntaxError(
                    f"Error ({message}) while checking bash command {action.command!r}",
                    extra_info={"bash_stdout": "", "bash_stderr": message},
                ) from e
            raise
        output = _text(r.stdout)
        if r.timed_out is not None:
            raise CommandTimeoutError(
                f"timeout after {action.timeout} seconds while running command {action.command!r}"
            )
        exit_code = None if action.check == "ignore" else r.exit_code
        return BashObservation(output=output, exit_code=exit_code)

    async def _interrupt(self, session: _Session) -> BashObservation:
        """A timed-out command was already interrupted by guestd; an interactive program
        gets ctrl-C on its terminal (SIGINT to its process group)."""
        if session.interactive is not None:
            await session.interactive.interrupt()
        return BashObservation(output="", exit_code=0)

    async def _run_interactive(self, session: _Session, action: BashAction) -> BashObservation:
        client = await self._guest()
        if session.interactive is None:
            if action.is_interactive_quit:
                return BashObservation(output="", exit_code=0)
            # No guest timeout: the program lives across actions; each action's timeout bounds its wait.
            session.interactive = Expect.start(client, session.guest_id, action.command)
        else:
            await session.interactive.sendline(action.command.rstrip("\n"))
        e = session.interactive
        if action.is_interactive_quit or not action.expect:
            try:
                r = await e.wait(timeout=_wait_s(action))
            except GuestdError as err:
                if err.code != "timeout":
                    raise
                raise _timeout(action) from None
            session.interactive = None
            await e.close()
            return BashObservation(output=_clean(bytes(e.buffer), action), exit_code=r.exit_code)
        rx = re.compile("|".join(f"(?:{p})" for p in action.expect).encode())
        try:
            m = await e.expect(rx, timeout=_wait_s(action))
        except ExpectEOF:  # the program ended before the pattern: it is gone, as in a terminal
            r = await e.wait(timeout=_wait_s(action))
            session.interactive = None
            await e.close()
            return BashObservation(output=_clean(bytes(e.buffer), action), exit_code=r.exit_code)
        except GuestdError as err:
            if err.code != "timeout":
                raise
            raise _timeout(action) from None
        return BashObservation(output=_clean(e.before, action), exit_code=0, expect_string=_text(m.group(0)))

    async def close_session(self, request: Any) -> CloseBashSessionResponse:
        session = self._session(request.session)
        del self._sessions[request.session]
        client = await self._guest()
        if session.interactive is not None:
            await session.interactive.close()
        await client.shell_close(session.guest_id)
        return CloseBashSessionResponse()

    # -- commands and files -----------------------------------------------------------------
    async def execute(self, command: Command) -> CommandResponse:
        client = await self._guest()
        cmd: list[str] | str
        if command.shell:
            cmd = command.command if isinstance(command.command, str) else ["/bin/sh", "-c", *command.command]
        else:
            cmd = [command.command] if isinstance(command.command, str) else list(command.command)
        r = await client.exec(
            cmd,
            cwd=command.cwd,
            env=command.env,
            replace_env=command.env is not None,
            timeout_s=command.timeout,
            merge_stderr=command.merge_output_streams,
        )
        if r.timed_out is not None:
            raise CommandTimeoutError(f"Timeout ({command.timeout}s) exceeded while running command")
        exit_code = r.shell_exit_code()
        out = CommandResponse(stdout=_text(r.stdout), stderr=_text(r.stderr), exit_code=exit_code)
        if command.check and exit_code != 0:
            msg = (
                f"Command {command.command!r} failed with exit code {exit_code}. "
                f"Stdout:\n{out.stdout!r}\nStderr:\n{out.stderr!r}"
            )
            raise NonZeroExitCodeError(f"{command.error_msg}: {msg}" if command.error_msg else msg)
        return out

    async def read_file(self, request: ReadFileRequest) -> ReadFileResponse:
        try:
            data = await (await self._guest()).read_file(request.path)
        except GuestdError as e:
            if e.code == "not_found":
                raise FileNotFoundError(request.path) from e
            raise
        return ReadFileResponse(content=data.decode(request.encoding or "utf-8", request.errors or "strict"))

    async def write_file(self, request: WriteFileRequest) -> WriteFileResponse:
        await (await self._guest()).write_file(request.path, request.content, parents=True)
        return WriteFileResponse()

    async def upload(self, request: UploadRequest) -> UploadResponse:
        client = await self._guest()
        if os.path.isdir(request.source_path):
            await client.upload_tree(request.source_path, request.target_path, parents=True)
        else:
            await client.upload(request.source_path, request.target_path, parents=True)
        return UploadResponse()

    async def close(self) -> CloseResponse:
        for name in list(self._sessions):
            try:
                await self.close_session(CloseBashSessionRequest(session=name))
            except (OSError, GuestdError):
                pass
        if self._client is not None:
            await self._client.close()
            self._client = None
        return CloseResponse()


class GuestdDeployment(AbstractDeployment):
    """Starts (or connects to) a guest and gives SWE-ReX a :class:`GuestdRuntime` on it.

    - no arguments: a local guestd in a temporary directory (development; no isolation
      beyond guestd's own);
    - ``address``: a guest already running (``unix:PATH``, ``vsock:CID:PORT``, ``fc:UDS:PORT``);
    - ``start_guest``: called on ``start`` to boot a guest whose image runs guestd and
      return ``(address, stop)``: ``guestd.testing.qemu.qemu_guest`` (the QEMU test image)
      or a Firecracker host's hook (see the module docs).
    """

    def __init__(
        self, *, address: str | None = None, start_guest: StartGuest | None = None, token: str | None = None
    ) -> None:
        self._address = address
        self._start_guest = start_guest
        self._token = token
        self._runtime: GuestdRuntime | None = None
        self._stop: Callable[[], None] | None = None
        self._hooks = CombinedDeploymentHook()
        self.logger = logging.getLogger(__name__)  # AbstractDeployment.__del__ logs to it

    def add_hook(self, hook: DeploymentHook) -> None:
        self._hooks.add_hook(hook)

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        if self._runtime is None:
            return IsAliveResponse(is_alive=False, message="Runtime is None.")
        return await self._runtime.is_alive(timeout=timeout)

    async def start(self) -> None:
        if self._address is not None:
            address = self._address
        else:
            address, self._stop = await _start_owned(self._start_guest or _local_guestd)
        self._runtime = GuestdRuntime(address, token=self._token)
        if not await self._runtime.is_alive(timeout=30):
            await self.stop()
            raise DeploymentNotStartedError(f"guestd at {address} did not answer")  # type: ignore[no-untyped-call]

    async def stop(self) -> None:
        if self._runtime is not None:
            await self._runtime.close()
            self._runtime = None
        if self._stop is not None:
            stop, self._stop = self._stop, None
            await asyncio.to_thread(stop)

    @property
    def runtime(self) -> GuestdRuntime:
        if self._runtime is None:
            raise DeploymentNotStartedError()  # type: ignore[no-untyped-call]
        return self._runtime


async def _start_owned(start_guest: StartGuest) -> tuple[str, Callable[[], None]]:
    """``start_guest()`` in a thread; if the caller is cancelled meanwhile (a timeout), the guest
    it goes on to boot is stopped once it is up, not left for nobody to stop."""
    booting = asyncio.ensure_future(asyncio.to_thread(start_guest))
    try:
        return await asyncio.shield(booting)
    except asyncio.CancelledError:

        def stop_unwanted(t: asyncio.Future[tuple[str, Callable[[], None]]]) -> None:
            if not t.cancelled() and t.exception() is None:
                threading.Thread(target=t.result()[1], name="guestd-stop-unwanted", daemon=True).start()

        booting.add_done_callback(stop_unwanted)
        raise


def _local_guestd() -> tuple[str, Callable[[], None]]:
    from guestd.testing.local import start_guestd

    workdir = tempfile.TemporaryDirectory(prefix="guestd-swerex-")
    g = start_guestd(workdir.name, ready_timeout_s=60)

    def stop() -> None:
        g.stop()
        workdir.cleanup()

    return g.address, stop
