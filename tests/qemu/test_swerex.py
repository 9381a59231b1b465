"""SWE-ReX on a real QEMU guest: ``GuestdDeployment(start_guest=qemu_guest)`` bakes the test
image, boots it, and SWE-ReX's runtime calls go to guestd inside the VM over virtio-serial;
``stop`` kills the VM and removes its work dir. Needs swe-rex: runs in the integration venv
(scripts/test.sh); one VM boot.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path

import psutil
import pytest

pytest.importorskip("swerex")

from swerex.exceptions import CommandTimeoutError
from swerex.runtime.abstract import (
    BashAction,
    Command,
    CreateBashSessionRequest,
    ReadFileRequest,
    UploadRequest,
    WriteFileRequest,
)

from guestd.integrations.swerex import GuestdDeployment
from guestd.testing.qemu import qemu_guest
from tests.qemu.harness import ARTIFACTS, require_qemu

pytestmark = [pytest.mark.qemu, pytest.mark.timeout(600)]  # bake + a TCG boot + the guest's slow CPU


def vm_children(sock: str) -> list[psutil.Process]:
    """This test's QEMU processes serving ``sock`` (the deployment's address)."""
    return [p for p in psutil.Process().children() if any(sock in a for a in p.cmdline())]


async def test_swerex_deployment_on_a_qemu_guest(tmp_path: Path) -> None:
    require_qemu()
    d = GuestdDeployment(start_guest=qemu_guest)
    started = time.monotonic()
    await d.start()
    sock = d.runtime.address.removeprefix("unix:")
    try:
        print(f"bake + boot + guestd ready: {time.monotonic() - started:.1f} s")
        [vm] = vm_children(sock)
        assert await d.is_alive()
        r = d.runtime
        await r.create_session(CreateBashSessionRequest())
        obs = await r.run_in_session(BashAction(command="cat /proc/cmdline", timeout=60))
        assert "rdinit=/init" in obs.output and obs.exit_code == 0  # the VM's kernel, not this machine's
        await r.run_in_session(BashAction(command="mkdir -p /workspace/w && cd /workspace/w && X=5", timeout=60))
        obs = await r.run_in_session(BashAction(command="echo $X; pwd", timeout=60))
        assert obs.output == "5\n/workspace/w\n" and obs.exit_code == 0
        with pytest.raises(CommandTimeoutError):
            await r.run_in_session(BashAction(command="sleep 60", timeout=1))
        assert (await r.run_in_session(BashAction(command="echo $X", timeout=60))).output == "5\n"

        await r.write_file(WriteFileRequest(path="/workspace/w/notes/a.txt", content="héllo\n"))
        assert (await r.read_file(ReadFileRequest(path="/workspace/w/notes/a.txt"))).content == "héllo\n"
        obs = await r.run_in_session(BashAction(command="cat notes/a.txt; wc -c < notes/a.txt", timeout=60))
        assert obs.output == "héllo\n7\n"
        (tmp_path / "src" / "pkg").mkdir(parents=True)
        (tmp_path / "src" / "pkg" / "m.py").write_text("V = 1\n")
        await r.upload(UploadRequest(source_path=str(tmp_path / "src"), target_path="/workspace/up"))
        out = await r.execute(Command(command="cat /workspace/up/pkg/m.py; echo err >&2", shell=True, timeout=60))
        assert (out.stdout, out.stderr, out.exit_code) == ("V = 1\n", "err\n", 0)

        greet = "greet() { read -p 'name? ' n; echo \"hi $n $X $PWD\"; }"
        await r.run_in_session(BashAction(command=greet, timeout=60))
        obs = await r.run_in_session(
            BashAction(command="greet", is_interactive_command=True, expect=[r"name\? "], timeout=60)
        )
        assert obs.expect_string == "name? "
        obs = await r.run_in_session(BashAction(command="bob", is_interactive_quit=True, timeout=60))
        assert obs.output == "hi bob 5 /workspace/w" and obs.exit_code == 0
    except BaseException:
        with contextlib.suppress(OSError):  # the console log, before stop removes it
            os.makedirs(ARTIFACTS, exist_ok=True)
            shutil.copy(os.path.join(os.path.dirname(sock), "vm-console.log"), os.path.join(ARTIFACTS, "swerex.log"))
        raise
    finally:
        await d.stop()
    assert not await d.is_alive()
    assert not psutil.pid_exists(vm.pid) and vm_children(sock) == []  # killed and reaped
    assert not os.path.exists(os.path.dirname(sock))  # its work dir is gone
