"""Issue 35, defects 1 and 2 on the host: each run's share of the workload cgroup (pids.max and
an equal cpu.weight per leaf), memory_max "auto", the [workload] keys, and the boot-time sizes
of the RAM-backed mounts. The numbers come from real files (a /proc/meminfo, a memory.stat, a
mountinfo written here); the cgroup tests use a scratch sub-tree of this host's cgroup v2 (see
tests/test_containment.py), which here has no controllers: leaves must come as before.
The shares themselves are enforced in the QEMU systemd suite (tests/qemu/test_systemd.py).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import tomllib

import pytest

from guestd.children.cgroups import (
    MIB,
    WorkloadCgroup,
    WorkloadConfig,
    auto_memory_max,
    read_meminfo,
    run_pids_limit,
)
from guestd.config import Config, ConfigError, load_config_file
from guestd.init import RAM_MOUNT_SHARES, ram_mount_sizes, ram_mounts
from guestd.testing import REPO, start_guestd
from guestd.testing.cgroups import UNIFIED, cgroup_usable

SHIPPED = os.path.join(REPO, "rootfs-overlay", "etc", "guestd", "guestd.toml")
needs_cgroup = pytest.mark.skipif(not cgroup_usable(), reason="needs root and cgroup v2 at " + UNIFIED)


def _meminfo(tmp_path: object, total_mib: int, available_mib: int) -> str:
    path = f"{tmp_path}/meminfo"
    with open(path, "w") as f:  # the kernel's layout: kB (KiB), padded
        f.write(
            f"MemTotal:       {total_mib * 1024} kB\nMemFree:        {available_mib * 1024 - 4096} kB\n"
            f"MemAvailable:   {available_mib * 1024} kB\nHugePages_Total:       0\nHugepagesize:       2048 kB\n"
        )
    return path


def test_read_meminfo_gives_bytes_and_leaves_counts_alone(tmp_path: object) -> None:
    info = read_meminfo(_meminfo(tmp_path, 2048, 1500))
    assert info["MemTotal"] == 2048 * MIB and info["MemAvailable"] == 1500 * MIB
    assert info["HugePages_Total"] == 0 and info["Hugepagesize"] == 2 * MIB


def test_auto_is_what_is_free_at_start_less_the_reserve(tmp_path: object) -> None:
    # The shipped 2 GiB QEMU image, as measured there: 1967 MiB total, 1502 MiB available.
    auto = auto_memory_max(256 * MIB, _meminfo(tmp_path, 1967, 1502))
    assert (auto.total, auto.in_use, auto.reserve) == (1967 * MIB, 465 * MIB, 256 * MIB)
    assert auto.limit == 1246 * MIB
    assert auto.describe() == "auto: MemTotal 1967 MiB - 465 MiB in use at start - 256 MiB reserve"


def test_auto_counts_what_the_workload_already_holds_as_its_own(tmp_path: object) -> None:
    """A guestd that starts again finds the workload's tmpfs files and dying processes charged
    to the workload cgroup: theirs to keep, not the system's (else each restart shrinks the
    limit below what the workload holds, and the write reclaims or OOM-kills at once)."""
    workload = f"{tmp_path}/workload"
    os.mkdir(workload)
    with open(f"{workload}/memory.stat", "w") as f:  # a memory.stat's layout (bytes); file is reclaimable
        f.write(f"anon {100 * MIB}\nfile {50 * MIB}\nkernel_stack 0\nshmem {300 * MIB}\nfile_mapped 0\n")
    auto = auto_memory_max(256 * MIB, _meminfo(tmp_path, 1967, 1102), workload)
    assert auto.limit == (1102 + 400 - 256) * MIB and auto.in_use == 465 * MIB
    assert auto_memory_max(256 * MIB, _meminfo(tmp_path, 1967, 1102), f"{tmp_path}/none").limit == 846 * MIB


def test_a_small_guest_keeps_half_of_what_is_free(tmp_path: object) -> None:
    auto = auto_memory_max(256 * MIB, _meminfo(tmp_path, 512, 300))
    assert (auto.reserve, auto.limit) == (150 * MIB, 150 * MIB)  # the reserve shrinks, and says so
    assert "150 MiB reserve" in auto.describe()


def test_run_pids_share(tmp_path: object) -> None:
    threads_max = f"{tmp_path}/threads-max"
    with open(threads_max, "w") as f:
        f.write("15707\n")
    assert run_pids_limit("25%", "8192", threads_max) == "2048"
    assert run_pids_limit("25%", "max", threads_max) == "3926"  # of the kernel's own ceiling
    assert run_pids_limit("1%", "50", threads_max) == "1"  # never 0: a run must start
    assert run_pids_limit("1000", "8192", threads_max) == "1000"
    assert run_pids_limit("max", "8192", threads_max) == "max"


def _load(tmp_path: object, workload: str) -> WorkloadConfig:
    path = f"{tmp_path}/guestd.toml"
    with open(path, "w") as f:
        f.write("[workload]\n" + workload)
    return load_config_file(path, Config()).workload


def test_workload_keys_parse_and_refuse_what_the_kernel_would(tmp_path: object) -> None:
    wl = _load(tmp_path, 'memory_max = "auto"\nmemory_reserve = 134217728\nrun_pids_max = "50%"\npids_max = 4096\n')
    assert (wl.memory_max, wl.memory_reserve, wl.run_pids_max, wl.pids_max) == ("auto", 128 * MIB, "50%", "4096")
    wl = _load(tmp_path, 'memory_max = 536870912\nrun_pids_max = 300\ncpu_weight = 5\npids_max = "max"\n')
    assert (wl.memory_max, wl.run_pids_max, wl.cpu_weight, wl.pids_max) == ("536870912", "300", 5, "max")
    assert WorkloadConfig().memory_max == "auto" and WorkloadConfig().run_pids_max == "25%"  # the defaults
    for bad in (
        'memory_max = "lots"',
        "memory_max = 0",
        'memory_max = "50%"',
        'pids_max = "auto"',
        'run_pids_max = "0%"',
        'run_pids_max = "101%"',
        'run_pids_max = "%"',
        'run_pids_max = "auto"',
        "memory_reserve = -1",
        'memory_reserve = "auto"',
        "cpu_weight = 0",
        "cpu_weight = 10001",
        "run_pid_max = 10",
    ):
        with pytest.raises(ConfigError):
            _load(tmp_path, bad + "\n")


def test_the_shipped_config_limits_memory_and_shares_per_run() -> None:
    wl = load_config_file(SHIPPED, Config()).workload
    assert wl.memory_max == "auto" and wl.memory_reserve == 256 * MIB
    assert run_pids_limit(wl.run_pids_max, wl.pids_max) == "2048" and wl.pids_max == "8192"


def test_ram_mounts_are_found_in_mountinfo(tmp_path: object) -> None:
    path = f"{tmp_path}/mountinfo"
    with open(path, "w") as f:  # the shipped systemd image's, trimmed; a second /tmp hides the first
        f.write(
            "1 1 0:2 / / rw shared:1 - rootfs rootfs rw,size=869072k,nr_inodes=217268,inode64\n"
            "22 1 0:20 / /proc rw,nosuid,nodev,noexec,relatime shared:5 - proc proc rw\n"
            "24 23 0:22 / /dev/shm rw,nosuid,nodev shared:3 - tmpfs tmpfs rw,inode64\n"
            "25 1 0:23 / /run rw,nosuid,nodev shared:10 - tmpfs tmpfs rw,size=402836k,mode=755,inode64\n"
            "30 1 0:30 / /tmp rw shared:12 - tmpfs tmpfs rw,inode64\n"
            "31 1 8:1 / /tmp rw shared:13 - ext4 /dev/vda1 rw\n"
        )
    assert ram_mounts(path) == {"/": "rootfs", "/dev/shm": "tmpfs"}


def test_ram_mount_sizes_leave_the_workload_a_quarter_of_its_share() -> None:
    share, image = 1200 * MIB, 303 * MIB
    with_tmp = ram_mount_sizes(share, {"/": "rootfs", "/tmp": "tmpfs", "/dev/shm": "tmpfs"}, image)
    without = ram_mount_sizes(share, {"/": "rootfs", "/dev/shm": "tmpfs"}, image)
    assert sum(RAM_MOUNT_SHARES.values()) == 0.75
    for sizes in (with_tmp, without):  # files the workload can write: 75% of its share
        assert sum(sizes.values()) - image == pytest.approx(0.75 * share, abs=3 * 4096)
        assert all(size % 4096 == 0 for size in sizes.values())
    assert without["/"] - image == pytest.approx(0.60 * share, abs=4096)  # /tmp lives on "/" then
    assert ram_mount_sizes(share, {"/dev/shm": "tmpfs"}, 0) == {"/dev/shm": 180 * MIB}  # an ext4 root


def _workload_section(cgroup: str) -> str:
    """The shipped [workload] table with the cgroup moved into the scratch tree."""
    with open(SHIPPED, "rb") as f:
        shipped = tomllib.load(f)["workload"]
    shipped["cgroup"] = cgroup
    return "[workload]\n" + "".join(f"{k} = {v!r}\n".replace("'", '"') for k, v in shipped.items())


@needs_cgroup
def test_the_shipped_workload_section_on_a_cgroup_without_controllers(scratch: str) -> None:
    """This host's cgroup v2 has no controllers (they sit on v1): no share can be set, and every
    run still gets its leaf. On a host with them, each leaf carries the shipped share."""
    cgroup = os.path.join(scratch, "shares")
    d = tempfile.mkdtemp(prefix="guestd-shares-")
    os.chmod(d, 0o755)
    try:
        with open(f"{d}/guestd.toml", "w") as f:
            f.write(_workload_section(cgroup))
        g = start_guestd(d, "--config", f"{d}/guestd.toml")
        try:
            with g.client() as c:
                status = c.info().raw["workload_cgroup"]
                r = c.exec(["sh", "-c", "grep ^0:: /proc/self/cgroup | cut -d: -f3"])
            leaf = "/sys/fs/cgroup/unified" + r.stdout.decode().strip()
            assert os.path.dirname(leaf) == cgroup and os.path.basename(leaf).startswith("exec-"), leaf
            with open(os.path.join(cgroup, "cgroup.controllers")) as f:
                controllers = f.read().split()
            if "pids" in controllers:
                assert "pids.max=2048" in status, status
            else:
                assert status.startswith(f"active: {cgroup} (memory.max=auto, pids.max=8192"), status
                assert "no memory/pids/cpu controller; a cgroup per run)" in status, status
                assert not os.path.exists(os.path.join(cgroup, "pids.max"))
        finally:
            g.stop()
    finally:
        shutil.rmtree(d, ignore_errors=True)


@needs_cgroup
def test_leaves_without_controllers_come_as_before(scratch: str) -> None:
    """WorkloadCgroup itself on the scratch tree: setup, a leaf per run, its removal."""
    wl = WorkloadCgroup(WorkloadConfig(cgroup=os.path.join(scratch, "direct"), pids_max="100", run_pids_max="10%"))
    wl.setup()
    assert wl.path is not None and wl.status.startswith("active:"), wl.status
    leaf = wl.new_run("exec", "t1")
    assert leaf is not None and os.path.isdir(leaf.path) and leaf.fd >= 0
    with open(os.path.join(wl.path, "cgroup.controllers")) as f:
        has_pids = "pids" in f.read().split()
    assert (wl.run_pids_max, os.path.exists(os.path.join(leaf.path, "pids.max"))) == (
        ("10", True) if has_pids else (None, False)
    )
    if has_pids:
        with open(os.path.join(leaf.path, "pids.max")) as f:
            assert f.read().strip() == "10"
    assert leaf.remove() and not os.path.exists(leaf.path)
