"""Kernelspecs: the kernels installed in the guest that a context may name besides guestd's
own Python kernel (a foreign kernel, SECURITY.md "foreign kernels"), and the command that
starts one. The interpreter guestd's own kernel runs on is resolved in guestd.code.python."""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass

from guestd.wire.errors import ErrorCode, GuestdError

PYTHON_KERNEL = "python"  # guestd's own kernel (guestd.code.kernel); any other name is a kernelspec

_import_lock = threading.Lock()


def import_jupyter_client() -> None:
    """Import the jupyter_client (and zmq) modules the daemon uses, one thread at a time.

    Blocking (a few hundred ms the first time): callers on the event loop run it in the IO
    pool. Two threads importing the package at once (a pool kernel's start beside a foreign
    kernel's kernelspec lookup) make CPython hand one of them the half-initialised package:
    "cannot import name 'AsyncKernelManager' from partially initialized module"."""
    with _import_lock:
        import jupyter_client.kernelspec
        import jupyter_client.manager  # noqa: F401
        import zmq.asyncio  # noqa: F401


@dataclass(frozen=True)
class ForeignSpec:
    """An installed kernelspec: what guestd needs of it to start one."""

    name: str
    argv: list[str]
    env: dict[str, str]
    resource_dir: str
    interrupt_mode: str  # "signal" (SIGINT to the kernel's process group) or "message" (control channel)


def find_kernelspec(name: str) -> ForeignSpec:
    """The kernelspec ``name`` on jupyter's search path as guestd's user sees it (JUPYTER_PATH,
    guestd's user data directory, sys.prefix, /usr/local/share and /usr/share/jupyter), or
    not_found listing every kernel that can be named. Blocking (it reads a few directories)."""
    import_jupyter_client()
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    ksm = KernelSpecManager()
    try:
        spec = ksm.get_kernel_spec(name)
    except NoSuchKernel:
        installed = sorted({PYTHON_KERNEL, *ksm.find_kernel_specs()})
        raise GuestdError(
            ErrorCode.NOT_FOUND,
            f"no kernel {name!r} in the guest; installed: {', '.join(installed)}",
            details={"field": "kernel", "kernel": name, "installed": installed},
        ) from None
    argv = [str(a) for a in spec.argv]
    if not argv:
        raise GuestdError(
            ErrorCode.UNAVAILABLE, f"kernelspec {name!r} has no command", details={"stage": "start", "kernel": name}
        )
    mode = "message" if spec.interrupt_mode == "message" else "signal"
    env = {str(k): str(v) for k, v in (spec.env or {}).items()}
    return ForeignSpec(name, argv, env, str(spec.resource_dir), mode)


def foreign_command(spec: ForeignSpec, connection_file: str) -> list[str]:
    """The kernelspec's argv with its placeholders filled: ``{connection_file}``,
    ``{resource_dir}`` and ``{prefix}``, the ones the kernelspec format defines
    (https://jupyter-client.readthedocs.io/en/stable/kernels.html#kernel-specs); any other
    brace text is the kernel's own and stays. A bare ``python`` (or ``python3``,
    ``python3.N``) as the program is guestd's own interpreter."""
    own_names = {"python", f"python{sys.version_info[0]}", f"python{sys.version_info[0]}.{sys.version_info[1]}"}
    filled = {"{connection_file}": connection_file, "{resource_dir}": spec.resource_dir, "{prefix}": sys.prefix}
    command = [sys.executable if i == 0 and word in own_names else word for i, word in enumerate(spec.argv)]
    for placeholder, value in filled.items():
        command = [word.replace(placeholder, value) for word in command]
    return command
