"""Entry point of a code-context kernel process: ``python -m guestd.code.kernel -f CONNECTION_FILE``.

Runs inside the kernel, before ipykernel starts:
- asks the Linux kernel to SIGKILL this process when guestd (its parent) dies, so
  a crashed guestd never leaves orphan kernels behind (start-up reaping covers the rest);
- packs its messages with ``pack_message`` (below), so that text holding lone surrogates
  still reaches guestd;
- then hands over to ipykernel's normal launcher.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
from typing import Any

PR_SET_PDEATHSIG = 1


def pack_message(obj: Any) -> bytes:
    """jupyter_client's json_packer, except for how lone surrogates are written.

    Python str allows lone surrogates (``print('\\ud800')``, or a non-UTF-8 file name from
    os.fsdecode) and UTF-8 does not: the stock packer raises, and the stream text, the
    error or the display is never sent. Here they go out as 'surrogatepass' bytes, which
    json.loads in guestd reads back; guestd then replaces them (guestd.code.contexts).
    """
    from jupyter_client.jsonutil import json_clean, json_default

    try:
        text = json.dumps(obj, default=json_default, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):  # not JSON as it stands: clean it, like the stock packer
        text = json.dumps(json_clean(obj), default=json_default, ensure_ascii=False, allow_nan=False)
    return text.encode("utf-8", "surrogatepass")


def main() -> None:
    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    expected = os.environ.pop("GUESTD_PARENT_PID", "")
    if expected and os.getppid() != int(expected):
        sys.exit(1)  # guestd died before the prctl took effect: nobody owns us
    from ipykernel import kernelapp

    kernelapp.launch_new_instance(argv=[*sys.argv[1:], "--Session.packer=guestd.code.kernel.pack_message"])


if __name__ == "__main__":
    main()
