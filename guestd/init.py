"""guestd-init: a minimal PID 1 for images without systemd (Firecracker-style rootfs, initramfs).

As PID 1 it mounts the basics, sizes the RAM-backed file systems (``size_ram_mounts``),
loads the modules guestd needs, names the virtio serial ports (no udev), then supervises
guestd: restarts it whenever it exits (with a short backoff), reaps every orphan re-parented
to PID 1, and powers the VM off cleanly on SIGTERM or SIGUSR2 (reboots on SIGINT, i.e.
ctrl-alt-del), and tells guestd it runs in a guest (``--in-guest``: restore may set the clock,
hostname and machine-id). Not as PID 1 (under another init or in a test) it only supervises.
``guestd-init --size-ram-mounts`` only sizes the mounts (systemd images run it once at boot:
rootfs-overlay's guestd-ram-mounts.service).
"""

from __future__ import annotations

import ctypes
import errno
import glob
import os
import signal
import subprocess
import sys
import time

GUESTD = os.environ.get("GUESTD_BIN", "/usr/local/bin/guestd")
CONFIG = os.environ.get("GUESTD_CONFIG", "/etc/guestd/guestd.toml")
MODULE_LIST = "/etc/guestd/modules.list"  # insmod order written by guestd-bake
RB_POWER_OFF = 0x4321FEDC
RB_AUTOBOOT = 0x01234567

_libc = ctypes.CDLL(None, use_errno=True)


def log(msg: str) -> None:
    sys.stderr.write(f"guestd-init: {msg}\n")
    sys.stderr.flush()


def mount(source: str, target: str, fstype: str, flags: int = 0, data: str = "") -> None:
    os.makedirs(target, exist_ok=True)
    if _libc.mount(source.encode(), target.encode(), fstype.encode(), flags, data.encode() or None) != 0:
        err = ctypes.get_errno()
        if err != errno.EBUSY:  # already mounted is fine
            log(f"mount {fstype} on {target}: {os.strerror(err)}")


def mount_basics() -> None:
    for src, target, fstype, data in (
        ("proc", "/proc", "proc", ""),
        ("sysfs", "/sys", "sysfs", ""),
        ("devtmpfs", "/dev", "devtmpfs", "mode=0755"),
        ("devpts", "/dev/pts", "devpts", "gid=5,mode=620,ptmxmode=666"),
        ("tmpfs", "/dev/shm", "tmpfs", "mode=1777"),
        ("tmpfs", "/run", "tmpfs", "mode=0755"),
        ("tmpfs", "/tmp", "tmpfs", "mode=1777"),
    ):
        if not os.path.ismount(target):
            mount(src, target, fstype, 0, data)
    if os.path.exists("/sys/fs/cgroup") and not os.path.ismount("/sys/fs/cgroup"):
        mount("cgroup2", "/sys/fs/cgroup", "cgroup2")


# The workload's RAM-backed file systems (the initramfs's root, a tmpfs holding the workspace
# and $HOME; /tmp; /dev/shm) are sized once at boot as shares of what the workload may hold:
# MemAvailable less guestd's [workload] memory_reserve, the share memory_max "auto" gives it.
# The kernel's defaults (50% of RAM each, 100% and more together) let files alone pin the
# guest's memory: tmpfs pages are freed by no OOM kill. Together 75%: a workload filling them
# meets ENOSPC before its memory.max, a quarter of its share stays for its processes (an
# earlier shell, a code kernel), and with memory_max "max" files still cannot take the
# system's share. "/" gets free space on top of the image's own files. On a RAM root, /tmp
# becomes a tmpfs of its own (as guestd-init mounts it, and Debian 13 does): a full workspace
# leaves programs their temp directory (a starting Python kernel needs one).
RAM_MOUNT_SHARES = {"/": 0.45, "/tmp": 0.15, "/dev/shm": 0.15}
RAM_FS_TYPES = ("tmpfs", "rootfs")
_MS_NOSUID, _MS_NODEV, _MS_REMOUNT = 2, 4, 32
# statvfs f_flag -> mount flag: a remount keeps nosuid, nodev, noexec... only when it passes them.
_KEEP_FLAGS = {
    os.ST_RDONLY: 1,
    os.ST_NOSUID: 2,
    os.ST_NODEV: 4,
    os.ST_NOEXEC: 8,
    os.ST_SYNCHRONOUS: 16,
    os.ST_MANDLOCK: 64,
    os.ST_NOATIME: 1024,
    os.ST_NODIRATIME: 2048,
    os.ST_RELATIME: 1 << 21,
}


def ram_mounts(mountinfo: str = "/proc/self/mountinfo") -> dict[str, str]:
    """{mount point: file system type} of the RAM-backed mounts RAM_MOUNT_SHARES names (the
    last mount at a point is the visible one)."""
    found: dict[str, str] = {}
    with open(mountinfo) as f:
        for line in f:
            left, _, right = line.partition(" - ")
            point, fstype = left.split()[4], right.split()[0]
            if point in RAM_MOUNT_SHARES:
                found[point] = fstype
    return {p: t for p, t in found.items() if t in RAM_FS_TYPES}


def ram_mount_sizes(share: int, mounts: dict[str, str], used_by_root: int, page: int = 4096) -> dict[str, int]:
    """Each mount's size= in bytes: its fraction of ``share`` (/tmp's goes to "/" when /tmp is
    no mount of its own), and "/" on top of what the image already uses there."""
    fractions = {p: f for p, f in RAM_MOUNT_SHARES.items() if p in mounts}
    if "/" in fractions and "/tmp" not in fractions:
        fractions["/"] += RAM_MOUNT_SHARES["/tmp"]
    sizes = {p: int(share * f) for p, f in fractions.items()}
    if "/" in sizes:
        sizes["/"] += used_by_root
    return {p: max(page, -(-size // page) * page) for p, size in sizes.items()}


def size_ram_mounts(config: str = CONFIG, meminfo: str = "/proc/meminfo") -> dict[str, int]:
    """Remount the workload's RAM-backed file systems with their sizes (see RAM_MOUNT_SHARES);
    returns what was applied. A mount the kernel refuses to resize (a ramfs root) is logged."""
    from guestd.children.cgroups import DEFAULT_MEMORY_RESERVE, auto_memory_max
    from guestd.config import Config, ConfigError, load_config_file

    reserve = DEFAULT_MEMORY_RESERVE
    if os.path.exists(config):
        try:
            reserve = load_config_file(config, Config()).workload.memory_reserve
        except ConfigError as exc:
            log(f"{exc}: sizing RAM mounts with the default reserve")
    share = auto_memory_max(reserve, meminfo).limit
    mounts = ram_mounts()
    root = os.statvfs("/") if "/" in mounts else None
    used = (root.f_blocks - root.f_bfree) * root.f_frsize if root is not None else 0
    applied: dict[str, int] = {}
    new_tmp = "/" in mounts and "/tmp" not in mounts and not os.path.ismount("/tmp")
    if new_tmp:  # before the others: if it fails, its share stays with "/"
        size = ram_mount_sizes(share, {"/tmp": "tmpfs"}, 0)["/tmp"]
        os.makedirs("/tmp", exist_ok=True)
        data = f"mode=1777,size={size}".encode()
        if _libc.mount(b"tmpfs", b"/tmp", b"tmpfs", _MS_NOSUID | _MS_NODEV, data) == 0:
            mounts["/tmp"], applied["/tmp"] = "tmpfs", size
        else:
            log(f"mount a tmpfs on /tmp: {os.strerror(ctypes.get_errno())}")
    for point, size in ram_mount_sizes(share, mounts, used).items():
        if point in applied:
            continue
        flags = _MS_REMOUNT
        for st_flag, ms_flag in _KEEP_FLAGS.items():
            if os.statvfs(point).f_flag & st_flag:
                flags |= ms_flag
        if _libc.mount(None, point.encode(), None, flags, f"size={size}".encode()) != 0:
            log(f"size {point} ({mounts[point]}) to {size >> 20} MiB: {os.strerror(ctypes.get_errno())}")
            continue
        applied[point] = size
    log("RAM-backed mounts: " + ", ".join(f"{p} {b >> 20} MiB" for p, b in applied.items()))
    return applied


# The kernel's defaults (0) let the workload hard-link a root file where the host will write
# and plant FIFOs or files for root to open in sticky directories; systemd sets these too.
LINK_PROTECTIONS = {
    "protected_hardlinks": "1",
    "protected_symlinks": "1",
    "protected_fifos": "1",
    "protected_regular": "1",
}


def protect_links() -> None:
    for name, value in LINK_PROTECTIONS.items():
        try:
            with open(f"/proc/sys/fs/{name}", "w") as f:
                f.write(value)
        except OSError as exc:
            log(f"fs.{name}: {exc}")


def load_modules() -> None:
    names: list[str] = []
    if os.path.exists(MODULE_LIST):
        with open(MODULE_LIST) as f:
            names = [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")]
        for path in names:  # already in dependency order, as files
            _insmod(path)
        return
    for conf in sorted(glob.glob("/etc/modules-load.d/*.conf")):
        with open(conf) as f:
            names += [ln.split("#")[0].strip() for ln in f if ln.split("#")[0].strip()]
    for name in names:
        try:
            subprocess.run(["modprobe", "-q", name], timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            log(f"modprobe {name}: {exc}")


def _insmod(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        log(f"module {path}: {exc}")
        return
    try:
        # finit_module(fd, "", 0): no userspace tools needed.
        if _libc.syscall(313, fd, b"", 0) != 0 and ctypes.get_errno() != errno.EEXIST:
            log(f"finit_module {path}: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)


def link_virtio_ports() -> None:
    os.makedirs("/dev/virtio-ports", exist_ok=True)
    for name_file in glob.glob("/sys/class/virtio-ports/*/name"):
        with open(name_file) as f:
            name = f.read().strip()
        if not name:
            continue
        dev = "/dev/" + os.path.basename(os.path.dirname(name_file))
        link = f"/dev/virtio-ports/{name}"
        if not os.path.lexists(link):
            os.symlink(dev, link)


def set_hostname() -> None:
    try:
        with open("/etc/hostname") as f:
            name = f.read().strip()
    except OSError:
        return
    if name:
        _libc.sethostname(name.encode(), len(name.encode()))


def loopback_up() -> None:
    """Bring ``lo`` up: a guest with no network device still serves on 127.0.0.1 (what the port
    relay reaches), and the kernel leaves ``lo`` down until someone raises it (systemd does)."""
    import fcntl
    import socket
    import struct

    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            req = struct.pack("16sH14x", b"lo", 0)
            flags = struct.unpack("16sH14x", fcntl.ioctl(s, siocgifflags, req))[1]
            if not flags & iff_up:
                fcntl.ioctl(s, siocsifflags, struct.pack("16sH14x", b"lo", flags | iff_up))
    except OSError as exc:
        log(f"loopback: {exc}")


class Supervisor:
    def __init__(self, argv: list[str]) -> None:
        self.argv = argv
        self.child: subprocess.Popen[bytes] | None = None
        self.stopping: str | None = None
        self.backoff = 0.2

    def start(self) -> None:
        try:
            # What guestd starts gets a normal OOM score back (see guestd.children.launch: OOM_RESET).
            env = {**os.environ, "GUESTD_CHILD_OOM_SCORE_ADJ": "0"}
            self.child = subprocess.Popen(self.argv, start_new_session=True, env=env)
            log(f"started {' '.join(self.argv)} (pid {self.child.pid})")
        except OSError as exc:
            log(f"cannot start guestd: {exc}")
            self.child = None
            return
        try:
            with open(f"/proc/{self.child.pid}/oom_score_adj", "w") as f:
                f.write("-1000")  # the agent must outlive any workload (as OOMScoreAdjust does under systemd)
        except OSError as exc:
            log(f"cannot protect guestd from the OOM killer: {exc}")

    def on_signal(self, signum: int, _frame: object) -> None:
        self.stopping = "reboot" if signum == signal.SIGINT else "poweroff"

    def reap(self) -> None:
        """Reap every exited child (orphans included); restart guestd when it is one of them."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if self.child is not None and pid == self.child.pid:
                self.child.returncode = os.waitstatus_to_exitcode(status)
                log(f"guestd exited ({self.child.returncode})")
                self.child = None

    def run(self) -> str:
        for sig in (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT):
            signal.signal(sig, self.on_signal)
        started_at = 0.0
        while self.stopping is None:
            if self.child is None:
                if time.monotonic() - started_at < 5:
                    time.sleep(self.backoff)  # crash loop: back off up to 5 s
                    self.backoff = min(5.0, self.backoff * 2)
                else:
                    self.backoff = 0.2
                started_at = time.monotonic()
                self.start()
            time.sleep(0.1)
            self.reap()
        return self.stopping

    def stop(self, grace: float = 10.0) -> None:
        if self.child is not None:
            self.child.terminate()
            deadline = time.monotonic() + grace
            while self.child is not None and time.monotonic() < deadline:
                time.sleep(0.05)
                self.reap()


def shutdown(action: str) -> None:
    log(f"{action}: stopping every process")
    os.kill(-1, signal.SIGTERM)
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                time.sleep(0.05)
        except ChildProcessError:
            break
    os.kill(-1, signal.SIGKILL)
    os.sync()
    _libc.reboot(RB_AUTOBOOT if action == "reboot" else RB_POWER_OFF)


def main() -> None:
    if sys.argv[1:] == ["--size-ram-mounts"]:
        size_ram_mounts()
        return
    pid1 = os.getpid() == 1
    for name in os.environ.pop("GUESTD_PRIVATE_ENV", "").split(","):
        if name:
            os.environ.pop(name, None)  # guestd's wrapper sets its own; the workload must not see it
    if pid1:
        os.environ["PATH"] = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        os.environ.setdefault("HOME", "/root")
        mount_basics()
        size_ram_mounts()
        protect_links()
        load_modules()
        link_virtio_ports()
        set_hostname()
        loopback_up()
    argv = [GUESTD, "--config", CONFIG] if os.path.exists(CONFIG) else [GUESTD]
    if pid1:
        argv.append("--in-guest")  # the init of this machine: a guest VM guestd may re-identify on restore
    sup = Supervisor(argv)
    action = sup.run()
    sup.stop()
    if pid1:
        shutdown(action)


if __name__ == "__main__":
    main()
