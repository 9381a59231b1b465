"""The QEMU guest suite's harness: skipping without the tools, a booted VM per test module with
its console log kept on failure, and the Debian + systemd image. The VM launcher itself (GuestVM,
the kernel, the baked initramfs) is guestd/testing/qemu.py, shared with the examples.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from guestd.testing.qemu import CACHE, CMDLINE, GuestVM, ensure_kernel, guestd_bake

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARTIFACTS = os.path.join(REPO, "qemu-artifacts")  # console logs of failed tests land here


def missing_tools() -> list[str]:
    return [t for t in ("qemu-system-x86_64", "cpio", "busybox", "apt-get", "dpkg", "modprobe") if not shutil.which(t)]


def require_qemu(*extra: str) -> None:
    """Skip the calling test without the tools (and ``extra`` ones), but fail under CI (.ci/run
    installs them)."""
    import pytest

    missing = missing_tools() + [t for t in extra if not shutil.which(t)]
    if missing and os.environ.get("CI"):
        pytest.fail(f"QEMU suite needs {missing} (.ci/run installs them)")
    if missing:
        pytest.skip(f"QEMU suite needs {missing}")


@contextmanager
def running_vm(
    request: Any, build_initrd: Callable[[str, str], str], *, prefix: str, artifact: str, **vm_kw: Any
) -> Iterator[GuestVM]:
    """A booted VM for a test module: kernel, an initramfs from ``build_initrd(workdir, kdir)``,
    the console log copied to ARTIFACTS/``artifact`` if a test failed, everything removed after."""
    vmlinux, kdir = ensure_kernel()
    work = tempfile.mkdtemp(prefix=prefix)
    try:
        guest = GuestVM(work, vmlinux, build_initrd(work, kdir), **vm_kw)
        failed = request.session.testsfailed
        try:
            yield guest
        finally:
            if request.session.testsfailed > failed:
                os.makedirs(ARTIFACTS, exist_ok=True)
                shutil.copy(guest.console_log, os.path.join(ARTIFACTS, artifact))
            guest.kill()
    finally:
        shutil.rmtree(work, ignore_errors=True)


# systemd, udev, kmod: the init; python3 and the scientific stack: the workload's own Python, which
# code contexts run in, for the README's pandas/matplotlib cells. With Debian's ipykernel: one that
# pip would add (guestd-bake does when the Python lacks it) brings matplotlib-inline 0.1.7+, which
# needs matplotlib 3.7 (Debian's is 3.6: plt.plot fails "no attribute '_get'").
DEBIAN_PACKAGES = (
    *("systemd", "udev", "kmod"),
    *("python3", "python3-ipykernel", "python3-numpy", "python3-pandas", "python3-matplotlib"),
    # virtual packages debootstrap does not resolve: what provides them (pyzmq's cffi API, gdb's regex)
    *("python3-cffi-backend", "libboost-regex1.74.0"),
)
# debootstrap takes the first of each "a | b" and no package can be left out, so fonttools'
# "python3-scipy | python3-munkres" and its sympy bring scipy, pythran, gcc, boost headers (1.3 GB
# in all, an initramfs in 2 GiB of RAM): purged after (dpkg --force-depends), what cells never load;
# so is gdb (debugpy's pydevd attaches with it; guestd's kernels never do).
DEBIAN_PURGE = (
    r"python3-(scipy|sympy|mpmath|pythran|beniget|gast|ply|dev|all-dev|lxml|tk|pil\.imagetk)|blt|tk8\.6.*|libtk8\.6"
    r"|python3\.11-dev|lib.*-dev|linux-libc-dev|(g\+\+|gcc|cpp)(-12)?|binutils.*|libasan8|libtsan2|liblsan0|libubsan1"
    r"|libitm1|libcc1-0|unicode-data|libicu72|libboost.*|libopenblas.*-dev|gdb|libsource-highlight.*|libbabeltrace.*|libipt2|libdebuginfod.*"
)


def debian_systemd_initramfs(workdir: str, kdir: str) -> str:
    """The README's "Debian image with systemd" path: debootstrap bookworm (minbase + systemd,
    udev, kmod, python3 with numpy/pandas/matplotlib; cached), guestd-bake with the *shipped*
    config, `systemctl enable guestd`, the test kernel's modules (depmod'ed, for
    systemd-modules-load). Boot with SYSTEMD_CMDLINE."""
    # The cache is named by its package list: a changed list builds a new one beside the old.
    pristine = os.path.join(
        CACHE, "bookworm-systemd-" + hashlib.sha256(",".join([*DEBIAN_PACKAGES, DEBIAN_PURGE]).encode()).hexdigest()[:8]
    )
    if not os.path.exists(os.path.join(pristine, ".complete")):
        shutil.rmtree(pristine, ignore_errors=True)
        r = subprocess.run(
            ["debootstrap", "--variant=minbase", "--include=" + ",".join(DEBIAN_PACKAGES), "bookworm", pristine],
            capture_output=True,
            text=True,
            timeout=900,
        )
        if r.returncode != 0:
            raise RuntimeError(f"debootstrap failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        trim_debian(pristine)
        for junk in ("var/cache/apt", "var/lib/apt/lists", "usr/share/doc", "usr/share/locale", "usr/share/man"):
            shutil.rmtree(os.path.join(pristine, junk), ignore_errors=True)
        open(os.path.join(pristine, ".complete"), "w").close()
    root = os.path.join(workdir, "debian-root")
    subprocess.run(["cp", "-a", pristine, root], check=True)
    guestd_bake(root, "--kernel-modules", kdir)
    kver = os.listdir(os.path.join(kdir, "lib", "modules"))[0]
    subprocess.run(["/sbin/depmod", "-b", root, kver], check=True, capture_output=True)
    # The image's own systemctl, as an image build would run it.
    subprocess.run(["chroot", root, "systemctl", "enable", "guestd.service"], check=True, capture_output=True)
    out = os.path.join(workdir, "debian-initramfs.cpio")
    from guestd.bake import emit_initramfs

    emit_initramfs(root, out)
    shutil.rmtree(root, ignore_errors=True)
    return out


def trim_debian(root: str) -> None:
    """Purge DEBIAN_PURGE's packages from the debootstrap'ed ``root`` (see DEBIAN_PURGE)."""
    import re

    listed = subprocess.run(
        ["chroot", root, "dpkg-query", "-W", "-f", "${Package}\\n"], capture_output=True, text=True, check=True
    ).stdout.split()
    purge = [p for p in listed if re.fullmatch(DEBIAN_PURGE, p.split(":")[0])]
    if purge:
        subprocess.run(
            ["chroot", root, "dpkg", "--purge", "--force-depends", *purge], capture_output=True, text=True, check=True
        )


SYSTEMD_CMDLINE = CMDLINE.replace("rdinit=/init", "rdinit=/lib/systemd/systemd")
