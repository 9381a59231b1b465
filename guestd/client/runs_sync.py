"""Kept runs from the blocking client: :func:`guestd.client.runs.start_kept` on the
:class:`~guestd.client.sync.Client`'s loop; ``Client.run_get`` / ``run_wait`` / ``run_list``
fetch the result, :func:`~guestd.client.runs.result_of` types it::

    rid = start_kept(client, "code.run", {"code": "import time; time.sleep(3); 42"})
    ...  # disconnect, reconnect
    print(result_of(client2.run_wait(rid, timeout_s=30)).text)  # '42'
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from guestd.client import runs
from guestd.client.runs import result_of

if TYPE_CHECKING:
    from guestd.client.sync import Client

__all__ = ["result_of", "start_kept"]


def start_kept(client: Client, op: str, args: dict[str, Any], timeout: float = 30.0) -> str:
    """Start ``op`` (shell.run or code.run) with ``keep: true``; its run id once the guest has kept it."""
    return client._run(runs.start_kept(client.aio, op, args, timeout))
