"""Boot the guestd-baked image under QEMU/TCG: Debian's generic kernel (downloaded, unpacked,
never installed) and an initramfs whose /init is rootfs-overlay's guestd-init, exactly as in
production. Used by tests/qemu, by the examples' ``QemuGuest`` and, as the ``qemu_guest`` hook, by
the framework deployments (``guestd.integrations.swerex.GuestdDeployment``).

Host <-> guest traffic is virtio-serial only (this machine has no vhost-vsock, and the host
side must never touch vsock); AF_VSOCK is exercised inside the guest over vsock_loopback.
"""

from __future__ import annotations

import json
import lzma
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from guestd.client import Client, GuestdError
from guestd.testing.local import REPO

CACHE = os.environ.get("GUESTD_QEMU_CACHE", os.path.join(tempfile.gettempdir(), "guestd-qemu-cache"))
CMDLINE = (
    "console=ttyS0 panic=-1 quiet lpj=7353518 tsc=reliable clocksource=tsc mitigations=off nokaslr "
    "no_timer_check rdinit=/init"
)
GUEST_CONFIG = """
listen = ["vsock:10700", "serial:/dev/virtio-ports/org.guestd.0"]
in_guest = true         # restore really sets the clock, hostname and machine-id (test_clones checks)
allowed_cids = [1, 2]   # 1: the guest itself over vsock_loopback (the test runner); 2: the host
workspace = "/workspace"
runtime_dir = "/run/guestd"
log_level = "INFO"
[code]
pool = 0
[workload]
cgroup = "/sys/fs/cgroup/guestd-workload"
memory_max = 268435456   # 256 MiB: a memory hog is OOM-killed inside the cgroup
pids_max = 256           # a fork bomb stops here, and one run's at 64 (run_pids_max: 25% by default)
cpu_weight = 1
"""


def ensure_kernel() -> tuple[str, str]:
    """(vmlinux, unpacked package dir). Cached; the package is never installed on this machine."""
    kdir = os.path.join(CACHE, "kgen")
    vmlinux = os.path.join(CACHE, "vmlinux")
    if os.path.exists(vmlinux) and os.path.isdir(kdir):
        return vmlinux, kdir
    os.makedirs(CACHE, exist_ok=True)
    out = subprocess.run(
        ["apt-cache", "depends", "linux-image-amd64"], capture_output=True, text=True, check=True
    ).stdout
    pkg = next(ln.split()[-1] for ln in out.splitlines() if "Depends: linux-image-6" in ln).removesuffix("-unsigned")
    subprocess.run(["apt-get", "download", pkg], cwd=CACHE, check=True, capture_output=True)
    deb = next(f for f in os.listdir(CACHE) if f.startswith(pkg) and f.endswith(".deb"))
    shutil.rmtree(kdir, ignore_errors=True)
    subprocess.run(["dpkg", "-x", os.path.join(CACHE, deb), kdir], check=True)
    kver = os.listdir(os.path.join(kdir, "lib", "modules"))[0]
    subprocess.run(["/sbin/depmod", "-b", kdir, kver], check=True)
    with open(os.path.join(kdir, "boot", f"vmlinuz-{kver}"), "rb") as f:
        data = f.read()
    # The uncompressed ELF has a PVH note: QEMU boots it directly (~4 s faster under TCG).
    elf = lzma.LZMADecompressor().decompress(data[data.find(b"\xfd7zXZ\x00") :])
    with open(vmlinux + ".tmp", "wb") as out_f:
        out_f.write(elf)
    os.replace(vmlinux + ".tmp", vmlinux)
    return vmlinux, kdir


def guestd_bake(root: str, *args: str) -> None:
    """Run guestd-bake from this checkout; pip's chatter stays out of the way unless it fails."""
    r = subprocess.run(
        [sys.executable, "-m", "guestd.bake", root, *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO},
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        raise RuntimeError(f"guestd-bake failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}")


def bake_initramfs(workdir: str, kdir: str, add: Sequence[str] = ()) -> str:
    """Bake the test image; ``add``: host paths copied in too (``guestd-bake --add``)."""
    root = os.path.join(workdir, "root")
    cfg = os.path.join(workdir, "guestd.toml")
    with open(cfg, "w") as f:
        f.write(GUEST_CONFIG)
    out = os.path.join(workdir, "initramfs.cpio")
    guestd_bake(
        root,
        "--busybox",
        "--kernel-modules",
        kdir,
        "--config",
        cfg,
        "--initramfs",
        out,
        *[a for path in add for a in ("--add", path)],
    )
    return out


def _drain(sock: socket.socket, quiet_s: float, limit_s: float) -> None:
    """Read and drop what ``sock`` delivers until it has been quiet ``quiet_s`` (``limit_s`` at most)."""
    end = time.monotonic() + limit_s
    sock.settimeout(quiet_s)
    try:
        while time.monotonic() < end and sock.recv(65536):
            pass
    except TimeoutError:
        pass
    finally:
        sock.settimeout(None)


class GuestVM:
    """One QEMU process with a console log and a virtio-serial port exposed as a host Unix socket."""

    def __init__(
        self,
        workdir: str,
        vmlinux: str,
        initrd: str,
        *,
        mem_mb: int = 1536,
        timeout_s: float = 600,
        qmp: bool = False,
        incoming: bool = False,
        tag: str = "vm",
        cmdline: str = CMDLINE,
    ) -> None:
        self.workdir = workdir
        self.serial_sock = os.path.join(workdir, f"{tag}-port.sock")
        self.console_log = os.path.join(workdir, f"{tag}-console.log")
        self.qmp_sock = os.path.join(workdir, f"{tag}-qmp.sock") if qmp else None
        argv = [
            "qemu-system-x86_64",
            "-accel",
            "tcg",
            "-M",
            "pc",
            "-cpu",
            "max",
            "-m",
            str(mem_mb),
            "-smp",
            "2",
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
            "-serial",
            f"file:{self.console_log}",
            "-monitor",
            "none",
            "-no-reboot",
            "-kernel",
            vmlinux,
            "-initrd",
            initrd,
            "-append",
            cmdline,
            "-device",
            "virtio-rng-pci",
            "-device",
            "virtio-serial-pci,id=vser0",
            "-chardev",
            f"socket,id=ch0,path={self.serial_sock},server=on,wait=off",
            "-device",
            "virtserialport,bus=vser0.0,chardev=ch0,name=org.guestd.0",
        ]
        if self.qmp_sock:
            argv += ["-qmp", f"unix:{self.qmp_sock},server=on,wait=off"]
        if incoming:
            argv += ["-incoming", "defer"]
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        # A hard ceiling: QEMU never outlives its test, whatever the test does.
        self._killer = threading.Timer(timeout_s, self.kill)
        self._killer.daemon = True
        self._killer.start()

    def console(self) -> str:
        try:
            with open(self.console_log, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def connect_serial(self, timeout_s: float = 120.0) -> socket.socket:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"QEMU exited ({self.proc.returncode}):\n{self.console()[-3000:]}")
            try:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(self.serial_sock)
                return s
            except OSError:
                s.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def client(self, timeout_s: float = 180.0) -> Client:
        """A host session over the virtio-serial port (retried while guestd is still starting)."""
        deadline = time.monotonic() + timeout_s
        handshake_s = 3.0  # short while guestd may not be up yet (a hello sent then is dropped)
        while True:
            sock = self.connect_serial()
            if handshake_s > 3.0:
                # An earlier attempt's hello may still be answered (a slow guest under load): that
                # reply must not be taken for this attempt's, or this one's comes as a second hello.
                _drain(sock, quiet_s=1.0, limit_s=5.0)
            try:
                return Client("serial", sock=sock, connect_timeout=handshake_s)
            except GuestdError:
                sock.close()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"guestd never answered on the serial port:\n{self.console()[-3000:]}") from None
                handshake_s = min(handshake_s * 2, 30.0)

    def save(self, path: str) -> None:
        """Pause, write the whole VM state to ``path`` (QMP migrate to a file) and quit."""
        if self.qmp_sock is None:
            raise RuntimeError("save needs a VM started with qmp=True")
        q = QMP(self.qmp_sock)
        try:
            q.cmd("stop")
            q.cmd("migrate-set-parameters", **{"max-bandwidth": 8 << 30})
            q.migrate("migrate", f"exec:cat > {path}")
            q.cmd("quit")
        finally:
            q.close()
        self.proc.wait(60)
        self._killer.cancel()

    @classmethod
    def clone(cls, snapshot: str, workdir: str, vmlinux: str, initrd: str, *, tag: str, **kw: Any) -> GuestVM:
        """A new QEMU process resumed from a state ``save`` wrote (same kernel/initrd/memory size)."""
        vm = cls(workdir, vmlinux, initrd, qmp=True, incoming=True, tag=tag, **kw)
        try:
            assert vm.qmp_sock is not None
            q = QMP(vm.qmp_sock)
            try:
                q.migrate("migrate-incoming", f"exec:cat {snapshot}")
                q.cmd("cont")
            finally:
                q.close()
        except BaseException:
            vm.kill()
            raise
        return vm

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self._killer.cancel()


def qemu_guest(
    *, add: Sequence[str] = (), mem_mb: int = 1536, timeout_s: float = 3600, ready_timeout_s: float = 300
) -> tuple[str, Callable[[], None]]:
    """Bake the test image into a new work dir, boot one VM from it and wait until its guestd
    answers; returns ``(address, stop)``, the ``start_guest`` hook of the framework deployments
    (``GuestdDeployment(start_guest=qemu_guest)``). The address is ``unix:`` on QEMU's chardev
    server socket behind the virtio-serial port: each connection to it is a new host session
    (guestd starts over on a new hello), so any client connects with the address alone, one
    at a time (QEMU serves one connection; a second waits until the first closes).
    ``stop`` kills the VM and removes the work dir; ``timeout_s`` is the VM's hard ceiling."""
    vmlinux, kdir = ensure_kernel()
    work = tempfile.mkdtemp(prefix="guestd-qemu-guest-")
    vm: GuestVM | None = None

    def stop() -> None:
        if vm is not None:
            vm.kill()
        shutil.rmtree(work, ignore_errors=True)

    try:
        vm = GuestVM(work, vmlinux, bake_initramfs(work, kdir, add=add), mem_mb=mem_mb, timeout_s=timeout_s)
        vm.client(timeout_s=ready_timeout_s).close()
    except BaseException:
        stop()
        raise
    return f"unix:{vm.serial_sock}", stop


class QMP:
    """Just enough of QEMU's machine protocol: commands and their replies (events are skipped)."""

    def __init__(self, path: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.connect(path)
                break
            except OSError:
                self.sock.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self.sock.settimeout(timeout_s)
        self.file = self.sock.makefile("rb")
        self.file.readline()  # greeting
        self.cmd("qmp_capabilities")

    def cmd(self, name: str, **args: object) -> dict[str, object]:
        msg = {"execute": name, **({"arguments": args} if args else {})}
        self.sock.sendall(json.dumps(msg).encode() + b"\n")
        while True:
            line = self.file.readline()
            if not line:
                raise RuntimeError("QMP connection closed")
            reply = json.loads(line)
            if "return" in reply:
                return reply["return"] if isinstance(reply["return"], dict) else {}
            if "error" in reply:
                raise RuntimeError(f"QMP {name}: {reply['error']}")

    def wait_migration(self, timeout_s: float = 300.0) -> dict[str, object]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            st = self.cmd("query-migrate")
            if st.get("status") in ("completed", "failed", "cancelled"):
                return st
            time.sleep(0.05)
        raise TimeoutError("migration did not finish")

    def migrate(self, command: str, uri: str) -> None:
        """``migrate`` (save) or ``migrate-incoming`` (load) and wait until it completed."""
        self.cmd(command, uri=uri)
        st = self.wait_migration()
        if st.get("status") != "completed":
            raise RuntimeError(f"{command} {uri}: {st}")

    def close(self) -> None:
        self.sock.close()
