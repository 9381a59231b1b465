"""guestd-bake: install guestd into a root filesystem directory and emit it as an image.

    guestd-bake ROOT [--busybox] [--kernel-modules KDIR] [--config FILE] [--add PATH ...]
                     [--initramfs OUT.cpio] [--ext4 OUT.img --size-mb N]

What lands in ROOT:
- /opt/guestd/python: this Python (interpreter, libpython, stdlib) with guestd and its
  dependencies in its own site-packages, so the image needs no Python of its own and
  guestd never mixes with the workload's packages;
- the shared libraries those binaries need that ROOT lacks (from this machine);
- /usr/local/bin/{guestd,guestctl,guestd-python} and /sbin/guestd-init wrappers;
- rootfs-overlay/ (systemd unit, default config, modules-load list, sysctl.d link protections);
- ipykernel in the image's own Python (``--workload-python``, default the python3 ROOT has),
  when it lacks it: code contexts run there ([code] python = "auto" in the shipped config),
  so cells import what the workload installs; guestd's own Python stays private. pip
  installs it (``--target``) into that Python's local site directory (Debian:
  /usr/local/lib/python3.X/dist-packages), for that Python's version;
- the Debian packages guestd's ops run (GUEST_PACKAGES: ripgrep, for file.grep) when ROOT
  lacks their program: the package from Debian (``apt-get download`` + ``dpkg -x`` into
  ROOT, plus the shared libraries it needs that ROOT lacks), else this machine's program;
- with --busybox, a static busybox as /bin/sh and friends when ROOT has no /bin/sh;
- with --kernel-modules, the virtio/vsock modules of that kernel tree plus
  /etc/guestd/modules.list (load order for guestd-init);
- with --add PATH (repeatable), that file or directory from this machine at the same path,
  plus the shared libraries of any ELF program in it (e.g. `--add /usr/bin/git` for the
  agent examples' minimal guest).

The image builder must match this machine's architecture and libc generation.
"""

from __future__ import annotations

import argparse
import os
import shutil
import stat
import subprocess
import sys
import sysconfig

PREFIX = "/opt/guestd/python"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OVERLAY = os.path.join(REPO, "rootfs-overlay")
RUNTIME_DEPS = ["msgpack", "uvloop", "psutil", "jupyter_client", "ipykernel", "tqdm"]
# Debian packages whose program guestd runs in the guest: package -> (program, what needs it).
GUEST_PACKAGES = {"ripgrep": ("rg", "file.grep")}
MODULES = ["virtio_pci", "virtio_console", "virtio-rng", "vsock", "vmw_vsock_virtio_transport", "vsock_loopback"]
STDLIB_SKIP = {
    "site-packages",
    "test",
    "tests",
    "idlelib",
    "tkinter",
    "turtledemo",
    "ensurepip",
    "lib2to3",
    "__pycache__",
}

WRAPPER = """#!/bin/sh
# guestd's private Python: its libpython is not on the image's library path.
LD_LIBRARY_PATH={prefix}/lib GUESTD_PRIVATE_ENV=LD_LIBRARY_PATH exec {prefix}/bin/python3 {args}"$@"
"""


def log(msg: str) -> None:
    print(f"guestd-bake: {msg}", file=sys.stderr)


def copy_python(root: str) -> str:
    src = sys.base_prefix
    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    dst = root + PREFIX
    os.makedirs(f"{dst}/bin", exist_ok=True)
    os.makedirs(f"{dst}/lib", exist_ok=True)
    interpreter = f"{src}/bin/{ver}" if os.path.isfile(f"{src}/bin/{ver}") else os.path.realpath(sys.executable)
    shutil.copy2(interpreter, f"{dst}/bin/{ver}")
    if not os.path.lexists(f"{dst}/bin/python3"):
        os.symlink(ver, f"{dst}/bin/python3")
    libdir = sysconfig.get_config_var("LIBDIR") or f"{src}/lib"
    for name in os.listdir(libdir):
        if name.startswith("libpython") and ".so" in name:
            shutil.copy2(os.path.join(libdir, name), f"{dst}/lib/{name}", follow_symlinks=True)
    stdlib = os.path.join(src, "lib", ver)

    def ignore(d: str, names: list[str]) -> set[str]:
        return {
            n for n in names if n in STDLIB_SKIP or n.startswith("config-") or n.endswith((".opt-1.pyc", ".opt-2.pyc"))
        }

    shutil.copytree(stdlib, f"{dst}/lib/{ver}", ignore=ignore, dirs_exist_ok=True)
    return f"{dst}/lib/{ver}/site-packages"


def pip_install_into(target: str, *options: str) -> list[str]:
    """The command line of this Python's pip installing into the directory ``target``, quietly."""
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    return [*pip, *options, "--target", target]


def install_packages(site: str) -> None:
    os.makedirs(site, exist_ok=True)
    cmd = [*pip_install_into(site, "--no-compile"), *RUNTIME_DEPS]
    log("pip install --target " + site)
    subprocess.run(cmd, check=True)
    pkg = os.path.join(REPO, "guestd")
    shutil.copytree(pkg, os.path.join(site, "guestd"), dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    import glob

    if not glob.glob(os.path.join(pkg, "children", "_clone*.so")):
        # The image would work, but every spawn would go through the slower popen fallback.
        log(
            "WARNING: guestd/children/_clone was not built (pip install -e . with gcc builds it): "
            "the image's guestd will spawn through subprocess (info.spawn = popen)"
        )


def byte_compile(root: str, lib: str) -> None:
    """Compile guestd's private Python (stdlib, dependencies, guestd) into __pycache__ now: the
    copies skip the build machine's caches and pip runs with --no-compile, so every start in the
    image compiled its ~200 modules from source (about 250 ms, more than the whole start), and
    on a read-only root at every start. The paths inside the .pyc files are the image's."""
    log("byte-compiling " + lib[len(root) :])
    cmd = [sys.executable, "-m", "compileall", "-q", "-j", "0", "-s", root, "-p", "/", lib]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def needed_libs(paths: list[str]) -> set[str]:
    libs: set[str] = set()
    for p in paths:
        try:
            out = subprocess.run(["ldd", p], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            continue
        for line in out.splitlines():
            parts = line.split()
            if "=>" in parts and len(parts) >= 3 and parts[2].startswith("/"):
                libs.add(parts[2])
            elif parts and parts[0].startswith("/"):
                libs.add(parts[0])
    return libs


def copy_libs(root: str, extra: list[str] | None = None) -> None:
    binaries = list(extra or [])
    for d, _, files in os.walk(root + PREFIX):
        for f in files:
            if f.endswith(".so") or ".so." in f or f.startswith("python3."):
                binaries.append(os.path.join(d, f))
    for lib in sorted(needed_libs(binaries)):
        if lib.startswith(sys.base_prefix):
            continue  # libpython: already in PREFIX/lib
        target = root + lib
        if not os.path.exists(target):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copy2(lib, target, follow_symlinks=True)


def _program_in(root: str, program: str) -> str | None:
    for d in ("/usr/bin", "/usr/local/bin", "/bin"):
        if os.path.isfile(f"{root}{d}/{program}"):
            return f"{d}/{program}"
    return None


def add_guest_packages(root: str, packages: dict[str, tuple[str, str]] = GUEST_PACKAGES) -> None:
    """Each package whose program ROOT lacks: Debian's package unpacked into ROOT (no
    maintainer scripts run; these packages have none that matter), with the libraries its
    program needs; without apt-get, this machine's program (``--add``); else a warning."""
    import tempfile

    for package, (program, needed_by) in packages.items():
        if _program_in(root, program) is not None:
            continue
        if shutil.which("apt-get") and shutil.which("dpkg"):
            with tempfile.TemporaryDirectory(prefix="guestd-bake-deb-") as tmp:
                got = subprocess.run(["apt-get", "download", package], cwd=tmp, capture_output=True, text=True)
                debs = [f for f in os.listdir(tmp) if f.endswith(".deb")]
                if got.returncode == 0 and debs:
                    subprocess.run(["dpkg", "-x", os.path.join(tmp, debs[0]), root], check=True)
                    found = _program_in(root, program)
                    if found is not None:
                        copy_libs(root, [root + found])
                        log(f"{package} from Debian ({debs[0]}): {found}")
                        continue
                log(f"apt-get download {package} failed: {got.stderr.strip()[-300:]}")
        here = shutil.which(program)
        if here is not None:
            add_paths(root, [here])
            log(f"{package}: this machine's {here}")
            continue
        log(f"WARNING: no {package} for the image ({program} not on this machine either): {needed_by} is unavailable")


def _in_root(root: str, path: str) -> str | None:
    """``path`` of the image with its symlinks followed inside ROOT (not this machine's), or None."""
    for _ in range(40):
        full = root + path
        if not os.path.islink(full):
            return path if os.path.exists(full) else None
        target = os.readlink(full)
        path = os.path.normpath(os.path.join(os.path.dirname(path), target))
    return None


def workload_python(root: str, name: str = "python3") -> tuple[str, str] | None:
    """(the image's path of its Python ``name``, "3.N") or None when ROOT has none. A name is
    looked for in /usr/local/bin, /usr/bin, /bin; a path is taken as it is."""
    candidates = [name] if name.startswith("/") else [f"{d}/{name}" for d in ("/usr/local/bin", "/usr/bin", "/bin")]
    for path in candidates:
        real = _in_root(root, path)
        if real is None:
            continue
        base = os.path.basename(real)
        if base.startswith("python3."):
            return path, base.removeprefix("python")
        cfg = os.path.join(root + os.path.dirname(os.path.dirname(path)), "pyvenv.cfg")  # a venv's bin/python
        if os.path.isfile(cfg):
            with open(cfg) as f:
                for line in f:
                    key, _, value = line.partition("=")
                    if key.strip() in ("version", "version_info"):
                        return path, ".".join(value.strip().split(".")[:2])
    return None


def workload_site_dirs(root: str, python: str, version: str) -> list[str]:
    """Where that Python finds packages (image paths): a venv's site-packages, or the system's
    (Debian's dist-packages, then the upstream layout); the first is where local installs go."""
    prefix = os.path.dirname(os.path.dirname(python))
    if os.path.isfile(root + prefix + "/pyvenv.cfg"):
        return [f"{prefix}/lib/python{version}/site-packages"]
    if os.path.isdir(root + "/usr/lib/python3/dist-packages"):
        return [f"/usr/local/lib/python{version}/dist-packages", "/usr/lib/python3/dist-packages"]
    return [f"/usr/local/lib/python{version}/site-packages", f"/usr/lib/python{version}/site-packages"]


def add_workload_ipykernel(root: str, name: str = "python3") -> None:
    """ipykernel in the image's own Python when it lacks it (pip ``--target`` its local site
    directory, wheels for its version). Code contexts run there (guestd.code.python)."""
    found = workload_python(root, name)
    if found is None:
        log(f"no {name} in the image: code contexts run on guestd's own Python ([code] python = auto)")
        return
    python, version = found
    sites = workload_site_dirs(root, python, version)
    if any(os.path.isdir(root + d + "/ipykernel") for d in sites):
        log(f"{python} (Python {version}) has ipykernel: code contexts run there")
        return
    cmd = pip_install_into(root + sites[0])
    if version != f"{sys.version_info[0]}.{sys.version_info[1]}":
        cmd += ["--only-binary=:all:", "--python-version", version, "--implementation", "cp"]
    log(f"pip install ipykernel --target {sites[0]} (for {python}, Python {version})")
    subprocess.run([*cmd, "ipykernel"], check=True)


def write_wrappers(root: str) -> None:
    scripts = {
        "/usr/local/bin/guestd": "-P -m guestd",  # -P: no cwd on sys.path for its lazy imports
        "/usr/local/bin/guestctl": "-m guestd.cli",
        "/usr/local/bin/guestd-python": "",
        "/sbin/guestd-init": "-m guestd.init",
    }
    for path, args in scripts.items():
        os.makedirs(os.path.dirname(root + path), exist_ok=True)
        with open(root + path, "w") as f:
            f.write(WRAPPER.format(prefix=PREFIX, args=args + " " if args else ""))
        os.chmod(root + path, 0o755)


def add_busybox(root: str) -> None:
    if os.path.exists(root + "/bin/sh"):
        return
    bb = shutil.which("busybox")
    if bb is None:
        raise SystemExit("guestd-bake: --busybox needs busybox on this machine (apt-get install busybox-static)")
    os.makedirs(root + "/bin", exist_ok=True)
    shutil.copy2(bb, root + "/bin/busybox")
    applets = subprocess.run([bb, "--list"], capture_output=True, text=True, check=True).stdout.split()
    for a in applets:
        if a != "busybox" and not os.path.lexists(f"{root}/bin/{a}"):
            os.symlink("busybox", f"{root}/bin/{a}")
    for d in ("proc", "sys", "dev", "run", "tmp", "root", "etc", "sbin", "usr/bin", "var/tmp"):
        os.makedirs(f"{root}/{d}", exist_ok=True)
    if not os.path.exists(root + "/etc/passwd"):
        with open(root + "/etc/passwd", "w") as f:
            f.write("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n")
    if not os.path.exists(root + "/etc/group"):
        with open(root + "/etc/group", "w") as f:
            f.write("root:x:0:\ntty:x:5:\nnogroup:x:65534:\n")


def add_workload_user(root: str, name: str = "sandbox", uid: int = 1000) -> None:
    """The unprivileged user the default config runs the workload as, when the image lacks it."""
    passwd = root + "/etc/passwd"
    existing = ""
    if os.path.exists(passwd):
        with open(passwd) as f:
            existing = f.read()
    if any(line.split(":")[0] == name for line in existing.splitlines()):
        return
    os.makedirs(root + "/etc", exist_ok=True)
    with open(passwd, "a") as f:
        f.write(f"{name}:x:{uid}:{uid}:guestd workload:/home/{name}:/bin/bash\n")
    with open(root + "/etc/group", "a") as f:
        f.write(f"{name}:x:{uid}:\n")
    os.makedirs(f"{root}/home/{name}", exist_ok=True)
    if os.geteuid() == 0:
        os.chown(f"{root}/home/{name}", uid, uid)


def add_paths(root: str, paths: list[str]) -> None:
    """Copy host files/directories into ROOT at the same absolute path, with their ELF programs' libraries."""
    elves: list[str] = []
    for src in paths:
        src = os.path.abspath(src)
        if not os.path.exists(src):
            raise SystemExit(f"guestd-bake: --add {src}: no such file or directory")
        dst = root + src
        if os.path.isdir(src):
            shutil.copytree(src, dst, symlinks=True, dirs_exist_ok=True)
            found = [os.path.join(d, f) for d, _, fs in os.walk(src) for f in fs]
        else:
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copy2(src, dst, follow_symlinks=True)
            found = [src]
        for f in found:
            try:
                with open(f, "rb") as fh:
                    if fh.read(4) == b"\x7fELF":
                        elves.append(f)
            except OSError:
                continue
    copy_libs(root, elves)
    log(f"added {len(paths)} path(s), {len(elves)} ELF file(s)")


def add_modules(root: str, kdir: str) -> None:
    kver = os.listdir(os.path.join(kdir, "lib", "modules"))[0]
    order: list[str] = []
    for m in MODULES:
        out = subprocess.run(
            ["modprobe", "-d", kdir, "-S", kver, "--show-depends", m], capture_output=True, text=True, check=False
        ).stdout
        for line in out.splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "insmod" and parts[1] not in order:
                order.append(parts[1])
    os.makedirs(root + "/etc/guestd", exist_ok=True)
    with open(root + "/etc/guestd/modules.list", "w") as f:
        for src in order:
            rel = src[len(kdir) :] if src.startswith(kdir) else src
            os.makedirs(os.path.dirname(root + rel), exist_ok=True)
            shutil.copy2(src, root + rel)
            f.write(rel + "\n")
    log(f"{len(order)} kernel modules for {kver}")


def emit_initramfs(root: str, out: str) -> None:
    if not os.path.lexists(root + "/init"):
        os.symlink("/sbin/guestd-init", root + "/init")
    with open(out, "wb") as f:
        find = subprocess.Popen(["find", ".", "-print0"], cwd=root, stdout=subprocess.PIPE)
        subprocess.run(
            ["cpio", "--null", "-o", "-H", "newc", "--quiet"], cwd=root, stdin=find.stdout, stdout=f, check=True
        )
        find.wait()
    log(f"initramfs {out}: {os.path.getsize(out) >> 20} MiB")


def emit_ext4(root: str, out: str, size_mb: int) -> None:
    subprocess.run(["mkfs.ext4", "-q", "-F", "-d", root, out, f"{size_mb}M"], check=True)
    log(f"ext4 image {out}: {size_mb} MiB")


def warn_unless_in_guest(config: str) -> None:
    """A config of the image owner's own that does not say ``in_guest = true``: guestd in that
    image will only simulate restore's privileged steps (clones not re-seeded)."""
    import tomllib

    try:
        with open(config, "rb") as f:
            in_guest = tomllib.load(f).get("in_guest") is True
    except (OSError, tomllib.TOMLDecodeError) as exc:
        print(f"guestd-bake: warning: cannot read {config}: {exc}", file=sys.stderr)
        return
    if not in_guest:
        print(
            f"guestd-bake: warning: {config} does not say in_guest = true: guestd in this image will only "
            "simulate restore's privileged steps (CRNG re-seed, clock, hostname, machine-id), so clones "
            "will share their random state; add in_guest = true (README, 'Run the daemon')",
            file=sys.stderr,
        )


def bake(
    root: str,
    *,
    overlay: str = DEFAULT_OVERLAY,
    busybox: bool = False,
    kernel_modules: str | None = None,
    config: str | None = None,
    add: list[str] | None = None,
    workload_python_name: str = "python3",
) -> None:
    # What bake makes is never group- or other-writable, whatever the baker's umask: systemd runs
    # /usr/local/bin/guestd and /opt/guestd/python as root, and the workload must not swap them.
    old_umask = os.umask(0o022)
    try:
        _bake(root, overlay, busybox, kernel_modules, config, add, workload_python_name)
        # Copies keep their source's modes (a checkout made under umask 000): cleared here too.
        overlay_paths = [
            os.path.relpath(os.path.join(d, n), overlay) for d, ds, fs in os.walk(overlay) for n in ds + fs
        ]
        harden(root, ["opt/guestd", "usr/local/bin", "sbin/guestd-init", *overlay_paths])
    finally:
        os.umask(old_umask)


def harden(root: str, paths: list[str]) -> None:
    """Clear group and other write bits on ``paths`` under ``root`` and everything below them
    (symlinks are left alone; a sticky directory such as /tmp keeps its mode)."""
    for rel in paths:
        top = os.path.join(root, rel)
        entries = [top] + [os.path.join(d, n) for d, ds, fs in os.walk(top) for n in ds + fs]
        for path in entries:
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            if stat.S_ISLNK(st.st_mode) or st.st_mode & stat.S_ISVTX or not st.st_mode & 0o022:
                continue
            os.chmod(path, stat.S_IMODE(st.st_mode) & ~0o022)


def _bake(
    root: str,
    overlay: str,
    busybox: bool,
    kernel_modules: str | None,
    config: str | None,
    add: list[str] | None,
    workload_python_name: str,
) -> None:
    os.makedirs(root, exist_ok=True)
    site = copy_python(root)
    install_packages(site)
    byte_compile(root, os.path.dirname(site))
    copy_libs(root)
    write_wrappers(root)
    shutil.copytree(overlay, root, dirs_exist_ok=True)
    if config is not None:
        shutil.copy2(config, root + "/etc/guestd/guestd.toml")
        warn_unless_in_guest(config)
    if busybox:
        add_busybox(root)
        if not os.path.exists(root + "/bin/bash"):
            # Shell sessions need bash; busybox's ash is not enough. Take this machine's.
            shutil.copy2("/bin/bash", root + "/bin/bash")
            copy_libs(root, ["/bin/bash"])
    add_workload_user(root)
    if workload_python_name != "none":
        add_workload_ipykernel(root, workload_python_name)
    add_guest_packages(root)
    if add:
        add_paths(root, add)
    if kernel_modules is not None:
        add_modules(root, kernel_modules)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="guestd-bake", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("root", help="root filesystem directory (created if missing)")
    p.add_argument("--overlay", default=DEFAULT_OVERLAY)
    p.add_argument("--config", default=None, help="use this guestd.toml instead of the overlay's")
    p.add_argument("--busybox", action="store_true", help="add busybox when ROOT has no /bin/sh (minimal rootfs)")
    p.add_argument(
        "--kernel-modules", default=None, metavar="KDIR", help="unpacked kernel package (dpkg -x) to take modules from"
    )
    p.add_argument(
        "--add",
        action="append",
        default=[],
        metavar="PATH",
        help="also copy this host file or directory (and its programs' libraries); repeatable",
    )
    p.add_argument(
        "--workload-python",
        default="python3",
        metavar="NAME|PATH",
        help="the image's Python code contexts run in (given ipykernel when it lacks it); none: leave it be",
    )
    p.add_argument("--initramfs", default=None, metavar="OUT", help="also write ROOT as a newc cpio initramfs")
    p.add_argument("--ext4", default=None, metavar="OUT", help="also write ROOT as an ext4 image")
    p.add_argument("--size-mb", type=int, default=1024, help="ext4 image size")
    ns = p.parse_args(argv)
    bake(
        ns.root,
        overlay=ns.overlay,
        busybox=ns.busybox,
        kernel_modules=ns.kernel_modules,
        config=ns.config,
        add=ns.add,
        workload_python_name=ns.workload_python,
    )
    if ns.initramfs:
        emit_initramfs(ns.root, ns.initramfs)
    if ns.ext4:
        emit_ext4(ns.root, ns.ext4, ns.size_mb)
    return 0


if __name__ == "__main__":
    sys.exit(main())
