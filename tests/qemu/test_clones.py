"""A real snapshot and two real clones: without `restore` the clones' PRNGs are identical
(the control), after `restore` with different entropy they diverge, their clocks are
right, the work that was running survives, and the workload hears of it (the generation
file, and the signal to the process that asked for one).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator

import pytest

from guestd.client import Client
from guestd.testing.qemu import GuestVM, bake_initramfs, ensure_kernel
from tests.qemu.harness import ARTIFACTS, require_qemu

pytestmark = pytest.mark.qemu


@pytest.fixture(scope="module")
def images() -> Iterator[tuple[str, str, str]]:
    require_qemu()
    vmlinux, kdir = ensure_kernel()
    work = tempfile.mkdtemp(prefix="guestd-clones-")
    try:
        yield work, vmlinux, bake_initramfs(work, kdir)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def observe(c: Client, ctx: str, sid: str) -> dict[str, object]:
    return {
        "random": c.code_run("random.random()", context=ctx, timeout_s=300).text,
        "bash": c.shell_run(sid, "echo $RANDOM", timeout_s=60).stdout,
    }


def test_clones_diverge_only_after_restore(images: tuple[str, str, str], request: pytest.FixtureRequest) -> None:
    work, vmlinux, initrd = images
    snap = os.path.join(work, "snap.bin")
    vms: list[GuestVM] = []
    try:
        src = GuestVM(work, vmlinux, initrd, qmp=True, tag="src", timeout_s=900)
        vms.append(src)
        with src.client() as c:
            ctx = c.code_create(deadline=300).id
            assert c.code_run("import random\nkept = 'state from before the snapshot'", context=ctx, timeout_s=300).ok
            sid = c.shell_create().id
            c.shell_run(sid, "cd /tmp && export BEFORE=1")
            proc = c.process_start("i=0; while :; do i=$((i+1)); echo $i; sleep 0.2; done").id
            # Issue 19: a workload server that asked to hear of restores (and one of its children).
            listener = c.process_start(
                "trap 'echo $$ >> /tmp/restored' USR2; while :; do sleep 0.2; done", env={"GUESTD_ON_RESTORE": "USR2"}
            )
            time.sleep(1.0)
            # Under TCG the guest clock keeps following the host's across the save, so make the
            # parent's clock an hour stale (inside the guest) to see restore fix it in each clone.
            assert c.exec(["date", "-s", f"@{int(time.time()) - 3600}"], timeout_s=60).exit_code == 0
            prep = c.snapshot_prepare()
            assert prep.synced and proc in prep.running["processes"]
        src.save(snap)
        time.sleep(2.0)  # the clones wake up with a wall clock this much (and the restore time) behind

        clones = []
        for tag in ("cloneA", "cloneB"):
            vm = GuestVM.clone(snap, work, vmlinux, initrd, tag=tag, timeout_s=900)
            vms.append(vm)
            clones.append(vm)

        control, after, urandom, skew = [], [], [], []
        for i, vm in enumerate(clones):
            with vm.client() as c:
                control.append(observe(c, ctx, sid))  # no restore yet: the parent's PRNG states
                # The handshake carried the host's clock: guestd already fixed the hour-stale clock
                # and flags a suspected restore (the fallback for hosts that forget `restore`).
                assert c.info().raw["snapshot"]["suspected_restore"]
                rep = c.restore(entropy=bytes([i + 1]) * 64, sandbox_id=f"clone-{i}", hostname=f"clone-{i}")
                assert rep.crng == "done" and rep.contexts_reseeded == [ctx] and rep.shells_reseeded == [sid]
                assert rep.clock in ("done", "kept") and abs(rep.clock_skew_s) < 5
                assert rep.signalled == [listener.pid]  # not its sleep: no handler there
                published = json.loads(c.read_file(rep.generation_file))
                assert (published["generation"], published["hostname"]) == (rep.generation, f"clone-{i}")
                deadline = time.monotonic() + 60
                while not c.exists("/tmp/restored"):
                    assert time.monotonic() < deadline, "the registered process never got its signal"
                    time.sleep(0.2)
                assert c.read_file("/tmp/restored") == f"{listener.pid}\n".encode()
                after.append(observe(c, ctx, sid))
                urandom.append(c.exec("head -c 32 /dev/urandom | od -An -tx1", timeout_s=60).stdout)
                guest_now = float(c.code_run("import time; time.time()", context=ctx, timeout_s=300).text or "0")
                skew.append(abs(guest_now - time.time()))
                assert c.code_run("kept", context=ctx, timeout_s=300).text == "'state from before the snapshot'"
                assert c.shell_run(sid, "pwd; echo $BEFORE").stdout == b"/tmp\n1\n"
                assert c.exec(["hostname"]).stdout == f"clone-{i}\n".encode()
                listed = {p.id: p for p in c.process_list()}
                assert listed[proc].state == "running"
                collected = c.process_output(proc, follow=False)
                out = collected.stdout
                numbers = [int(n) for n in out.split()]
                assert numbers == list(range(1, len(numbers) + 1)) and len(numbers) >= 5  # nothing lost

        assert control[0] == control[1], "control: clones without restore share PRNG states"
        assert after[0]["random"] != after[1]["random"]
        assert after[0]["bash"] != after[1]["bash"]
        assert urandom[0] != urandom[1]
        assert max(skew) < 1.0, skew
    finally:
        if request.session.testsfailed:
            os.makedirs(ARTIFACTS, exist_ok=True)
            for vm in vms:
                shutil.copy(vm.console_log, ARTIFACTS)
        for vm in vms:
            vm.kill()
