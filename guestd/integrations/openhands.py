"""The OpenHands software-agent SDK on guestd: ``GuestdWorkspace``, a ``BaseWorkspace``.
``pip install guestd[openhands]`` (openhands-sdk 1.58.2, which needs Python >= 3.12).

``BaseWorkspace`` (``openhands.sdk.workspace``) is the SDK's interface to where an agent's
work happens: ``execute_command``, ``file_upload``, ``file_download``, ``git_changes``,
``git_diff``. ``GuestdWorkspace`` implements it on guestd's client, in the guest at
``address``, with the semantics of the SDK's own ``LocalWorkspace``:

- ``execute_command(command, cwd, timeout)`` is one guestd ``exec`` of ``bash -c``
  (``LocalWorkspace`` uses ``sh -c``), in ``cwd`` or else ``working_dir``, with the SDK's
  ``AI_AGENT=openhands`` added to the guest's environment as ``LocalWorkspace`` adds it;
  stdout and stderr apart, each kept up to ``max_output`` bytes (the tail). A timeout is
  enforced in the guest and ends the command's whole process tree; it reports ``exit_code
  -1``, ``timeout_occurred`` and the output so far (``LocalWorkspace`` kills only the shell,
  and waits for any background child still holding its pipes). A command killed by signal N
  reports ``-N``, as ``subprocess`` does. When the guest cannot run it (no such ``cwd``, the
  connection lost) the result is ``exit_code -1`` with the reason in ``stderr``, as
  ``RemoteWorkspace`` reports a failed request.
- ``file_upload(host path, guest path)`` and ``file_download(guest path, host path)`` stream
  the file (``file.upload``/``file.download``), create the destination's parent directories,
  keep the file's permission bits (``LocalWorkspace`` uses ``shutil.copy2``), and report
  failures in the ``FileOperationResult`` instead of raising, as both SDK workspaces do.
- ``git_changes(path)`` and ``git_diff(path)`` return what ``LocalWorkspace`` returns for that
  path, for the files in the guest: worked out on the host from git processes guestd runs in
  the guest (``guestd/integrations/_openhands_git.py``; the guest needs ``git`` and ``bash``),
  with exact file names (newlines, quotes, bytes that are not UTF-8) where the SDK's own code
  quotes or refuses them. Errors are the SDK's ``GitRepositoryError``, ``GitCommandError`` and
  ``GitPathError``, never another type; what git prints is bounded and checked, since the
  workload can stand in for git.
- Relative guest paths (``cwd``, upload destinations, download sources, git paths) are
  relative to ``working_dir``, as ``RemoteWorkspace`` joins them.

What it is not: an OpenHands ``Conversation`` runs its agent's tools either in the
conversation's own process (``LocalWorkspace``: ``LocalConversation`` accepts no other
kind) or through an agent server it talks HTTP to (``RemoteWorkspace``, which the Docker,
Apptainer and cloud workspaces of openhands-workspace start). A ``GuestdWorkspace`` serves
code that drives a workspace through its API (setup and evaluation scripts, the diff view,
a custom tool); ``pause``/``resume`` are not offered (``NotImplementedError``, the base's).

tests/test_integrations_openhands.py (in ``.venv-oh``, with the real openhands-sdk) runs
the same cases through ``LocalWorkspace`` and ``GuestdWorkspace`` on a real guestd and
compares the SDK's result objects.
"""

from __future__ import annotations

import os
import posixpath
import stat
from pathlib import Path
from typing import Any

from openhands.sdk.git.models import GitChange, GitDiff
from openhands.sdk.workspace import BaseWorkspace, CommandResult, FileOperationResult
from pydantic import Field, PrivateAttr

from guestd.client import Client, GuestdError
from guestd.integrations import _openhands_git as guest_git

__all__ = ["GuestdWorkspace"]


def _text(data: bytes) -> str:
    return data.decode(errors="replace")


class GuestdWorkspace(BaseWorkspace):
    """An OpenHands workspace whose commands and files are in the guestd guest at ``address``."""

    address: str = Field(description="guestd's address: unix:/path, vsock:CID:PORT, tcp:HOST:PORT.")
    token: str | None = Field(default=None, exclude=True, description="guestd's token, if it wants one.")
    connect_timeout: float = Field(default=10.0, description="Seconds to connect and shake hands.")
    max_output: int = Field(
        default=1024 * 1024, description="Bytes of stdout and of stderr kept per command (the tail)."
    )
    git: str = Field(default="git", description="The guest's git program, for git_changes and git_diff.")

    _client: Client | None = PrivateAttr(default=None)

    def _guest(self) -> Client:
        if self._client is None:
            self._client = Client(self.address, token=self.token, connect_timeout=self.connect_timeout)
        return self._client

    def _path(self, path: str | Path) -> str:
        return posixpath.join(self.working_dir, os.fspath(path))

    def close(self) -> None:
        """Close the connection (the guest and its files stay)."""
        if self._client is not None:
            client, self._client = self._client, None
            client.close()

    def __enter__(self) -> GuestdWorkspace:
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        self._send_completion_callback(exc_type, exc_val)
        self.close()

    # -- commands ---------------------------------------------------------------------------
    def execute_command(self, command: str, cwd: str | Path | None = None, timeout: float = 30.0) -> CommandResult:
        try:
            r = self._guest().exec(
                ["bash", "-c", command],
                cwd=self._path(cwd) if cwd is not None else self.working_dir,
                env={"AI_AGENT": "openhands"},
                timeout_s=timeout,
                max_output=self.max_output,
            )
        except (GuestdError, OSError) as e:
            return CommandResult(
                command=command, exit_code=-1, stdout="", stderr=f"guestd: {e}", timeout_occurred=False
            )
        if r.timed_out is not None:
            exit_code = -1
        elif r.signal is not None:
            exit_code = -r.signal
        else:
            exit_code = r.exit_code if r.exit_code is not None else -1
        return CommandResult(
            command=command,
            exit_code=exit_code,
            stdout=_text(r.stdout),
            stderr=_text(r.stderr),
            timeout_occurred=r.timed_out is not None,
        )

    # -- files ------------------------------------------------------------------------------
    def file_upload(self, source_path: str | Path, destination_path: str | Path) -> FileOperationResult:
        source, destination = str(source_path), self._path(destination_path)
        try:
            perm = stat.S_IMODE(os.stat(source).st_mode)
            size = self._guest().upload(source, destination, perm=perm, parents=True)
        except (GuestdError, OSError) as e:
            return FileOperationResult(success=False, source_path=source, destination_path=destination, error=str(e))
        return FileOperationResult(success=True, source_path=source, destination_path=destination, file_size=size)

    def file_download(self, source_path: str | Path, destination_path: str | Path) -> FileOperationResult:
        source, destination = self._path(source_path), Path(destination_path)
        try:
            client = self._guest()
            mode = stat.S_IMODE(client.stat(source).mode)
            destination.parent.mkdir(parents=True, exist_ok=True)
            size = client.download(source, str(destination))
            os.chmod(destination, mode)
        except (GuestdError, OSError) as e:
            return FileOperationResult(
                success=False, source_path=source, destination_path=str(destination), error=str(e)
            )
        assert isinstance(size, int)
        return FileOperationResult(success=True, source_path=source, destination_path=str(destination), file_size=size)

    # -- git --------------------------------------------------------------------------------
    def git_changes(self, path: str | Path) -> list[GitChange]:
        with guest_git.git_failures(self.git):
            return guest_git.changes(self._guest(), self.git, self._path(path))

    def git_diff(self, path: str | Path) -> GitDiff:
        with guest_git.git_failures(self.git):
            return guest_git.diff(self._guest(), self.git, self._path(path))
