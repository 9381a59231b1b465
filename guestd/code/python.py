"""Which Python the "python" kernel runs: guestd's own, or the workload's (``[code] python``).

guestd's own Python is private (a baked image's /opt/guestd/python): the workload cannot
install into it, so cells there could never import what the workload installs. The shipped
config names the workload's Python instead ("auto": python3 on the PATH runs get, guestd's own environment's), and the
kernel runs there. The two meet through one file: guestd's kernel launcher
(``guestd/code/kernel.py``, standard library only at import) is loaded by path into the
workload's interpreter by :data:`BOOTSTRAP`; from the workload's site-packages it needs
ipykernel and what ipykernel brings (jupyter_client, pyzmq), nothing of guestd. guestd itself
never imports anything from the workload's site-packages: it only starts that interpreter as
the workload user, in the kernel's own cgroup.
"""

from __future__ import annotations

import itertools
import os
import shutil
import stat
import sys
from dataclasses import dataclass

from guestd.wire.errors import ErrorCode, GuestdError

OWN = "guestd"  # [code] python: guestd's own interpreter
AUTO = "auto"  # [code] python: python3 on guestd's PATH (the one runs get), else guestd's own
LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernel.py")

# python -c BOOTSTRAP LAUNCHER ARGS...: the launcher loaded by path under a private module name
# (the workload's Python has no guestd package). First the cwd ("" from -c) leaves sys.path: a
# module the workload put there must not stand in for one the launcher imports before the key
# hand-over (cells get "" back, last: kernel._cwd_last_on_the_path). No bytecode is written
# beside the launcher (guestd's directory is not the workload's to write).
BOOTSTRAP = (
    "import sys\n"
    "sys.path[:] = [p for p in sys.path if p]\n"
    "from importlib.util import module_from_spec, spec_from_file_location\n"
    "spec = spec_from_file_location('_guestd_kernel', sys.argv.pop(1))\n"
    "launcher = module_from_spec(spec)\n"
    "sys.modules[spec.name] = launcher\n"
    "sys.dont_write_bytecode, keep = True, sys.dont_write_bytecode\n"
    "spec.loader.exec_module(launcher)\n"
    "sys.dont_write_bytecode = keep\n"
    "launcher.main()\n"
)


@dataclass(frozen=True, slots=True)
class KernelPython:
    """The interpreter a "python" kernel starts: ``executable`` (absolute), ``own`` when it is
    guestd's own, ``setting`` the ``[code] python`` it came from."""

    executable: str
    own: bool
    setting: str

    def argv(self) -> list[str]:
        if self.own:
            # -P: not the context's cwd as sys.path[0] (the workload's modules there would run in
            # the kernel before the key hand-over); ipykernel adds "" for cells once it starts.
            return [self.executable, "-P", "-m", "guestd.code.kernel", "--connection-from-guestd"]
        return [self.executable, "-c", BOOTSTRAP, LAUNCHER, "--connection-from-guestd"]

    def describe(self) -> dict[str, str | bool]:
        return {"name": "python", "python": self.executable, "own": self.own, "setting": self.setting}


def resolve(setting: str, path: str | None) -> KernelPython:
    """``[code] python`` made an interpreter, looking names up on ``path`` (the PATH the kernel
    gets: the workload's). A name or path that is not there: ``unavailable`` naming it and the
    fix. Cheap (a few stat calls): done for each kernel start, so a venv made later counts."""
    if setting == OWN:
        return KernelPython(sys.executable, True, setting)
    found = shutil.which("python3" if setting == AUTO else setting, path=path or os.defpath)
    if found is None and setting == AUTO:
        return KernelPython(sys.executable, True, setting)  # an image without a Python of its own
    if found is None:
        raise GuestdError(
            ErrorCode.UNAVAILABLE,
            f"the code kernel's Python {setting!r} ([code] python in guestd's config) is not an executable "
            + ("file" if os.sep in setting else f"on guestd's PATH ({path or os.defpath})")
            + ': install it, or set [code] python to "auto", "guestd" or an interpreter that exists',
            details={"stage": "start", "reason": "no_python", "python": setting},
        )
    return KernelPython(os.path.abspath(found), False, setting)


def missing_ipykernel(python: KernelPython) -> GuestdError:
    """The start failure of a workload Python without ipykernel: what is missing, where, and
    the fix (the launcher exits with kernel.NO_IPYKERNEL before it asks for its key)."""
    return GuestdError(
        ErrorCode.UNAVAILABLE,
        f"the code kernel's Python {python.executable} has no ipykernel: install it there "
        f"({python.executable} -m pip install ipykernel; guestd-bake does it for an image's Python) "
        "or set [code] python in guestd's config to one that has it (\"guestd\": guestd's own)",
        details={"stage": "start", "reason": "no_ipykernel", "python": python.executable},
    )


MAX_KERNELSPECS = 32  # kernelspecs info lists
MAX_SPEC_BYTES = 64 * 1024  # of one kernel.json
MAX_SCANNED = 1024  # entries of one kernels directory looked at (a directory of millions costs no more)


def _spec_names(kernels_dir: str) -> list[str]:
    """The first MAX_KERNELSPECS names (sorted) among at most MAX_SCANNED entries of
    ``kernels_dir``: info runs on guestd's loop, so the cost of a huge directory is capped."""
    with os.scandir(kernels_dir) as entries:
        names = [entry.name for entry in itertools.islice(entries, MAX_SCANNED) if entry.is_dir()]
    return sorted(names)[:MAX_KERNELSPECS]


def _read_spec(path: str) -> bytes:
    """At most MAX_SPEC_BYTES of the kernel.json at ``path``, only if it is a regular file: info
    runs on guestd's loop, and a FIFO planted as kernel.json (in a directory the workload can
    write) would block a plain open() for ever. O_NONBLOCK: opening a FIFO returns at once (then
    it is refused as not a regular file); a device is refused before it is opened."""
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise OSError(f"{path}: not a regular file")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped since the stat
            raise OSError(f"{path}: not a regular file")
        return os.read(fd, MAX_SPEC_BYTES)
    finally:
        os.close(fd)


def kernels_info(setting: str) -> list[dict[str, str | bool]]:
    """``info.kernels``: the program each kernel runs. The "python" kernel's interpreter as a
    start now would resolve it (a missing one: its setting, with ``missing``), then the
    kernelspecs in jupyter's system directories and JUPYTER_PATH (argv[0] of each kernel.json;
    at most MAX_KERNELSPECS, each a regular file read to MAX_SPEC_BYTES: a few small reads, no
    import; a directory of millions of entries or a FIFO as kernel.json costs no more)."""
    import json

    try:
        kernels: list[dict[str, str | bool]] = [resolve(setting, os.environ.get("PATH")).describe()]
    except GuestdError:
        kernels = [{"name": "python", "python": setting, "own": False, "setting": setting, "missing": True}]
    roots = [p for p in os.environ.get("JUPYTER_PATH", "").split(os.pathsep) if p]
    roots += [os.path.join(sys.prefix, "share", "jupyter"), "/usr/local/share/jupyter", "/usr/share/jupyter"]
    seen = {"python"}
    for root in roots:
        try:
            names = _spec_names(os.path.join(root, "kernels"))
        except OSError:
            continue
        for name in names:
            if name.lower() in seen or len(kernels) > MAX_KERNELSPECS:
                continue
            seen.add(name.lower())
            try:
                argv = json.loads(_read_spec(os.path.join(root, "kernels", name, "kernel.json"))).get("argv") or [""]
                program = str(argv[0])
            except (OSError, ValueError, AttributeError, TypeError, IndexError):
                continue
            own = program in ("python", f"python{sys.version_info[0]}") or program == sys.executable
            kernels.append({"name": name, "python": program, "own": own, "setting": "kernelspec"})
    return kernels
