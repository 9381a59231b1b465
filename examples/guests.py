"""Where an example's guest comes from: one guest per agent session, owned and torn down by it.

- ``LocalGuest``: a real guestd process on a private Unix socket on this machine (the same
  daemon that runs in a VM, minus the VM). Used by the host tests and the default demos.
- ``QemuGuest``: a QEMU/TCG microVM booted from the guestd-baked test image (guestd/testing/qemu.py),
  reached over virtio-serial; it can be saved to a file and restored as clones.

An agent runtime only needs ``connect()`` and ``stop()``; a production host daemon would
implement the same two against Firecracker (``fc:/path/to/v.sock:10700`` addresses).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Protocol

from guestd.client import Client
from guestd.testing import start_guestd
from guestd.testing.qemu import GuestVM, bake_initramfs, ensure_kernel


class Guest(Protocol):
    workspace: str

    def connect(self) -> Client: ...

    def stop(self) -> None: ...


class LocalGuest:
    """guestd as a child process on ``unix:<tmpdir>/guestd.sock`` (``guestd.testing``);
    ``stop`` ends and reaps it."""

    def __init__(self, *, workspace: str | None = None, ready_timeout_s: float = 30.0) -> None:
        self.dir = tempfile.mkdtemp(prefix="guestd-session-")
        self.workspace = workspace or os.path.join(self.dir, "workspace")
        os.makedirs(self.workspace, exist_ok=True)
        try:
            self.guestd = start_guestd(
                self.dir,
                *("--workspace", self.workspace, "--runtime-dir", os.path.join(self.dir, "run"), "--code-pool", "0"),
                cwd=self.workspace,
                ready_timeout_s=ready_timeout_s,
            )
        except BaseException:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise
        self.address = self.guestd.address
        self.proc = self.guestd.proc

    def log(self) -> str:
        return self.guestd.log()

    def connect(self) -> Client:
        return self.guestd.client()

    def alive(self) -> bool:
        return self.guestd.alive()

    def stop(self) -> None:
        self.guestd.stop(grace_s=15)  # guestd ends its kernels, shells and processes on SIGTERM
        shutil.rmtree(self.dir, ignore_errors=True)


class QemuGuest:
    """A microVM from the baked test image (needs qemu-system-x86_64; see guestd/testing/qemu.py)."""

    workspace = "/workspace"

    def __init__(self, vm: GuestVM) -> None:
        self.vm = vm

    @staticmethod
    def image(workdir: str) -> tuple[str, str]:
        """(kernel, initramfs): Debian's generic kernel and a guestd image with git added."""
        vmlinux, kdir = ensure_kernel()
        git = os.path.realpath(shutil.which("git") or "/usr/bin/git")
        add = [git] + [p for p in ("/usr/share/git-core/templates",) if os.path.isdir(p)]
        return vmlinux, bake_initramfs(workdir, kdir, add=add)

    @classmethod
    def boot(cls, workdir: str, kernel: str, initrd: str, *, tag: str = "vm", timeout_s: float = 900) -> QemuGuest:
        return cls(GuestVM(workdir, kernel, initrd, qmp=True, tag=tag, timeout_s=timeout_s))

    @classmethod
    def restore(
        cls, snapshot: str, workdir: str, kernel: str, initrd: str, *, tag: str, timeout_s: float = 900
    ) -> QemuGuest:
        """A clone: a new VM process resumed from ``snapshot`` (see ``save``)."""
        return cls(GuestVM.clone(snapshot, workdir, kernel, initrd, tag=tag, timeout_s=timeout_s))

    def connect(self) -> Client:
        return self.vm.client()

    def save(self, path: str) -> None:
        """Pause the VM, write its full state to ``path`` and end it."""
        self.vm.save(path)

    def console(self) -> str:
        return self.vm.console()

    def stop(self) -> None:
        self.vm.kill()
