"""mini-swe-agent on guestd: ``GuestdEnvironment``. ``pip install guestd[minisweagent]``.

mini-swe-agent's environment contract is ``execute(action, cwd="", *, timeout=None)``
returning ``{"output", "returncode", "exception_info"}``, with every command in a fresh
shell (no state carries over, as in its ``LocalEnvironment``). Here each command is one
guestd ``exec`` of ``bash -c`` with stdout and stderr merged, the timeout enforced in the
guest (the whole process tree ends), ``cwd`` and the config's ``env`` applied in the guest.
A timeout reports ``returncode -1`` with the output so far and ``exception_info``, as
``LocalEnvironment`` does; a first output line ``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`` of
a successful command raises ``Submitted`` with the rest of the output.

Use it from Python::

    env = GuestdEnvironment(address="unix:/run/guestd.sock", cwd="/work/repo")
    agent = DefaultAgent(model, env, **config["agent"])

or from a config: ``environment: {environment_class:
guestd.integrations.minisweagent.GuestdEnvironment, address: "vsock:3:1024", cwd: ...}``.

Tested by tests/test_integrations_minisweagent.py: mini-swe-agent's default agent loop
(``DefaultAgent`` with its built-in ``mini.yaml`` config and its ``DeterministicModel``)
end to end on a real guestd, and the contract cases of ``LocalEnvironment``.
"""

from __future__ import annotations

from typing import Any

from minisweagent.exceptions import Submitted
from minisweagent.utils.serialize import recursive_merge
from pydantic import BaseModel

from guestd.client import Client

__all__ = ["GuestdEnvironment", "GuestdEnvironmentConfig"]

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
UNAME_FIELDS = ("system", "node", "release", "version", "machine")


class GuestdEnvironmentConfig(BaseModel):
    address: str
    """guestd's address: ``unix:/path``, ``vsock:CID:PORT``, ``tcp:HOST:PORT``."""
    token: str | None = None
    cwd: str = ""
    """Default directory of commands (empty: guestd's default)."""
    env: dict[str, str] = {}
    """Set for every command, on top of the guest's environment."""
    timeout: int = 30


class GuestdEnvironment:
    """Runs mini-swe-agent's commands in the guestd guest at ``address``."""

    def __init__(self, *, config_class: type[GuestdEnvironmentConfig] = GuestdEnvironmentConfig, **kwargs: Any):
        self.config = config_class(**kwargs)
        self._client = Client(self.config.address, token=self.config.token)
        self._uname: dict[str, str] | None = None

    def execute(self, action: dict[str, Any], cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        command = str(action.get("command", ""))
        limit = timeout or self.config.timeout
        try:
            r = self._client.exec(
                ["bash", "-c", command],
                cwd=cwd or self.config.cwd or None,
                env=self.config.env or None,
                timeout_s=limit,
                merge_stderr=True,
            )
        except Exception as e:  # the agent shows the error to the model, as LocalEnvironment does
            output: dict[str, Any] = {
                "output": "",
                "returncode": -1,
                "exception_info": f"An error occurred while executing the command: {e}",
                "extra": {"exception_type": type(e).__name__, "exception": str(e)},
            }
        else:
            text = r.stdout.decode(errors="replace")
            if r.timed_out is not None:
                message = f"Command '{command}' timed out after {limit} seconds"
                output = {
                    "output": text,
                    "returncode": -1,
                    "exception_info": f"An error occurred while executing the command: {message}",
                    "extra": {"exception_type": "TimeoutExpired", "exception": message},
                }
            else:
                output = {"output": text, "returncode": r.shell_exit_code(), "exception_info": ""}
        self._check_finished(output)
        return output

    def _check_finished(self, output: dict[str, Any]) -> None:
        lines = str(output.get("output", "")).lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT_MARKER and output["returncode"] == 0:
            submission = "".join(lines[1:])
            raise Submitted(
                {
                    "role": "exit",
                    "content": submission,
                    "extra": {"exit_status": "Submitted", "submission": submission},
                }
            )

    def _guest_uname(self) -> dict[str, str]:
        if self._uname is None:
            r = self._client.exec(["uname", "-s", "-n", "-r", "-v", "-m"], timeout_s=10)
            parts = r.stdout.decode(errors="replace").split()
            values = [*parts[:3], " ".join(parts[3:-1]), parts[-1]] if len(parts) >= 5 else [""] * 5
            self._uname = dict(zip(UNAME_FIELDS, values, strict=True))
        return self._uname

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        """The config, the guest's ``uname`` (system, release, machine...) and ``kwargs``."""
        merged: dict[str, Any] = recursive_merge(self.config.model_dump(), self._guest_uname(), kwargs)
        return merged

    def serialize(self) -> dict[str, Any]:
        return {
            "info": {
                "config": {
                    "environment": self.config.model_dump(mode="json", exclude={"token"}),
                    "environment_type": f"{self.__class__.__module__}.{self.__class__.__name__}",
                }
            }
        }

    def close(self) -> None:
        self._client.close()
