"""Red team of the issue-30 changes, as the hostile workload: code running as the workload user
inside the sandbox, planting files and FIFOs where guestd looks.

info.kernels (guestd.code.python.kernels_info) runs inline on guestd's event loop and reads each
kernelspec's kernel.json in JUPYTER_PATH and jupyter's system directories. A directory there that
the workload can write (a JUPYTER_PATH pointing into the workload's own tree, as a development
guestd inherits it) let the workload plant a FIFO as kernel.json: open() waited for a writer for
ever, on the loop, so that info, and every request after it (ping included), never answered.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from guestd.client import Client
from guestd.testing.local import NOBODY, Guestd, start_guestd


@pytest.fixture
def guestd_with_a_workload_jupyter_path() -> Iterator[tuple[Guestd, str]]:
    """(guestd, a JUPYTER_PATH directory in its environment that the workload user owns)."""
    top = tempfile.mkdtemp(prefix="guestd-rt30-")
    os.chmod(top, 0o755)
    jupyter = f"{top}/jupyter"
    os.makedirs(f"{jupyter}/kernels/honest")
    with open(f"{jupyter}/kernels/honest/kernel.json", "w") as f:
        f.write('{"argv": ["/opt/honest/bin/kernel", "{connection_file}"], "display_name": "h", "language": "x"}')
    ws = f"{top}/ws"
    os.makedirs(ws)
    config = f'workspace = "{ws}"\n'
    if os.geteuid() == 0:
        for d in (ws, f"{jupyter}/kernels"):
            os.chown(d, NOBODY, NOBODY)
        config += '[policy]\nworkload_user = "nobody"\n'
    with open(f"{top}/guestd.toml", "w") as f:
        f.write(config)
    g = start_guestd(top, "--config", f"{top}/guestd.toml", "--runtime-dir", f"{top}/rt", env={"JUPYTER_PATH": jupyter})
    try:
        yield g, jupyter
    finally:
        # Before the fix guestd sits in open() on the FIFO: a writer lets that open return.
        fifo = f"{jupyter}/kernels/evil/kernel.json"
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        g.stop()
        shutil.rmtree(top, ignore_errors=True)


def test_a_fifo_kernelspec_the_workload_plants_never_blocks_info(
    guestd_with_a_workload_jupyter_path: tuple[Guestd, str],
) -> None:
    g, jupyter = guestd_with_a_workload_jupyter_path
    with Client(g.address) as c:
        # The workload (as the workload user, through exec) plants a kernelspec whose kernel.json is
        # a FIFO nobody writes, and one that is a symlink to a FIFO.
        planted = c.exec(
            [
                "sh",
                "-c",
                f"mkdir {jupyter}/kernels/evil {jupyter}/kernels/evil2 && mkfifo {jupyter}/kernels/evil/kernel.json"
                f" && ln -s {jupyter}/kernels/evil/kernel.json {jupyter}/kernels/evil2/kernel.json",
            ],
            timeout_s=30,
        )
        assert planted.exit_code == 0, planted
        # Before: the client's deadline ran out (guestd's loop blocked in open() for ever).
        kernels = c.info(deadline=30).raw["kernels"]
        names = [k["name"] for k in kernels]
        assert "evil" not in names and "evil2" not in names
        honest = next(k for k in kernels if k["name"] == "honest")
        assert honest["python"] == "/opt/honest/bin/kernel"
        c.ping()
