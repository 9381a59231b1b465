"""Entry point of a code-context kernel process: ``python -m guestd.code.kernel --connection-from-guestd``
in guestd's own Python, the same file loaded by path in the workload's Python (guestd.code.python:
nothing here may import guestd), or, for a kernelspec installed in the guest,
``python -m guestd.code.kernel --exec ARGV...``.

Runs inside the kernel, before ipykernel starts:
- takes its connection info and session key from guestd over fd 0 once it is non-dumpable,
  so the key is never on disk or anywhere the workload's processes can read it;
- keeps that channel as the re-seed side channel: a thread re-seeds ``random`` (and numpy's
  global state) from the seeds guestd sends after a snapshot restore and confirms each one,
  without going through the kernel's message loop, so a cell that is running (a
  ``time.sleep``, a loop) does not hold the re-seed up (``_reseed_from_guestd``);
- asks the Linux kernel to SIGKILL this process when guestd (its parent) dies, so
  a crashed guestd never leaves orphan kernels behind (start-up reaping covers the rest);
- packs its messages with ``pack_message`` (below), so that text holding lone surrogates
  still reaches guestd, and a content larger than guestd takes is made small here (a bundle
  becomes a note of its size); long stream writes go out in pieces;
- then hands over to ipykernel's normal launcher.

With ``--exec`` (a foreign kernel) only the PR_SET_PDEATHSIG part applies (it survives the
exec); then the kernelspec's own command replaces this process (see ``exec_foreign``).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import sys
from typing import Any

PR_SET_PDEATHSIG = 1
NO_IPYKERNEL = 86  # exit status: this Python cannot run a kernel (guestd.code.python.missing_ipykernel)
PRIVATE_NAME = "_guestd_kernel"  # this module's name in sys.modules, wherever it was loaded from
PR_SET_DUMPABLE = 4
MAX_CONNECTION_INFO = 64 * 1024
# The re-seed side channel (guestd.code.reseed): guestd sends SEED_TAG + token + seed, one
# SOCK_SEQPACKET message; the kernel answers with the token once the seed is applied.
SEED_TAG = b"S"
SEED_TOKEN_BYTES = 8
SEED_BYTES = 32
SEED_MESSAGE_BYTES = len(SEED_TAG) + SEED_TOKEN_BYTES + SEED_BYTES


STREAM_PIECE = 256 * 1024  # characters of stream text per message (a 100 MB print: 400 messages)
DROPPED_MIME = "application/vnd.guestd.dropped+json"  # a bundle too large to send: its size instead
_max_content = 0  # bytes of one message's content; 0: no cap (set by main from GUESTD_KERNEL_MAX_CONTENT)


def pack_message(obj: Any) -> bytes:
    """The same JSON as jupyter_client's default packer (``json_packer`` in
    https://github.com/jupyter/jupyter_client/blob/main/jupyter_client/session.py: what the
    frontend expects to read), except for how lone surrogates are written.

    Python str allows lone surrogates (``print('\\ud800')``, or a non-UTF-8 file name from
    os.fsdecode) and UTF-8 does not: the stock packer raises, and the stream text, the
    error or the display is never sent. Here they go out as 'surrogatepass' bytes, which
    json.loads in guestd reads back; guestd then replaces them (guestd.code.messages).
    """
    from jupyter_client.jsonutil import json_clean, json_default

    try:
        text = json.dumps(obj, default=json_default, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):  # not JSON as it stands: clean it, like the stock packer
        text = json.dumps(json_clean(obj), default=json_default, ensure_ascii=False, allow_nan=False)
    out = text.encode("utf-8", "surrogatepass")
    if _max_content and len(out) > _max_content and isinstance(obj, dict):
        return _capped(obj, len(out)) or out
    return out


def _capped(content: dict[str, Any], size: int) -> bytes | None:
    """A message content over the cap, made small: guestd would drop it anyway, and must never
    hold it whole. A bundle (display, result) becomes a note of its size, which guestd counts
    in ``results_dropped``; an error keeps the ends of its text."""
    if isinstance(content.get("data"), dict):
        small = {**content, "data": {DROPPED_MIME: {"bytes": size}}, "metadata": {}}
    elif "traceback" in content or "evalue" in content:
        room = _max_content // 4
        lines = content.get("traceback")
        tb = [str(t)[-room:] for t in lines[-32:]] if isinstance(lines, list) else []
        while tb and sum(len(t) for t in tb) > room:
            tb.pop(0)
        small = {**content, "evalue": str(content.get("evalue", ""))[:room], "traceback": tb}
    elif isinstance(content.get("code"), str):  # execute_input echoes the cell; guestd reads only the count
        small = {**content, "code": ""}
    else:
        return None  # nothing honest is this large; guestd's socket refuses what exceeds its limit
    return json.dumps(small, ensure_ascii=True, default=str).encode()


def _split_long_streams() -> None:
    """Send a long stream write as pieces of STREAM_PIECE characters: what guestd holds while it
    decodes one message stays bounded (one 100 MB print was one 100 MB message)."""
    from jupyter_client.session import Session

    original = Session.send

    def send(self: Session, stream: Any, msg_or_type: Any, *args: Any, **kw: Any) -> Any:
        if isinstance(msg_or_type, dict) and msg_or_type.get("msg_type") == "stream":
            content = msg_or_type.get("content") or {}
            text = content.get("text")
            if isinstance(text, str) and len(text) > STREAM_PIECE:
                sent = None
                for i in range(0, len(text), STREAM_PIECE):
                    piece = self.msg(
                        "stream",
                        {**content, "text": text[i : i + STREAM_PIECE]},
                        parent=msg_or_type.get("parent_header"),
                    )
                    sent = original(self, stream, piece, *args, **kw)
                return sent
        return original(self, stream, msg_or_type, *args, **kw)

    Session.send = send  # type: ignore[method-assign]


def _iopub_waits_instead_of_dropping() -> None:
    """XPUB_NODROP on the iopub socket: when guestd reads slower than a cell writes, the kernel's
    output thread waits (and the cell's writes queue in the kernel, the workload's memory)
    instead of dropping messages. guestd keeps only a few messages queued (RCVHWM), so what
    it holds stays bounded and nothing is lost."""
    import zmq
    from ipykernel.kernelapp import IPKernelApp

    original = IPKernelApp.init_iopub

    def init_iopub(self: IPKernelApp, context: zmq.Context[Any]) -> None:
        context.setsockopt(zmq.XPUB_NODROP, 1)  # applies to the sockets made next: iopub's
        try:
            original(self, context)  # type: ignore[no-untyped-call]
        finally:
            context.sockopts.pop(zmq.XPUB_NODROP, None)

    IPKernelApp.init_iopub = init_iopub  # type: ignore[method-assign]


def _connection_from_guestd() -> tuple[dict[str, Any], socket.socket]:
    """The connection info (with the session key) from guestd over fd 0, a socketpair, never a
    file. This process runs as the workload user, and so do the workload's processes: a key on
    disk or in this process's environment they could read. First this process turns
    non-dumpable (its /proc files become root's: no ptrace, no /proc/<pid>/mem, environ or fd
    from the workload's processes, for the kernel's whole life), then it asks; guestd checks
    that and that nothing traces it before it answers, in one message (SOCK_SEQPACKET). fd 0
    becomes /dev/null again; the channel itself stays open (close-on-exec) for re-seeding."""
    ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    channel = socket.socket(fileno=os.dup(0))
    try:
        channel.sendall(b"ready\n")
        data = channel.recv(MAX_CONNECTION_INFO + 1)
    except BaseException:
        channel.close()
        raise
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    info: dict[str, Any] = json.loads(data)
    return info, channel


def _reseed(seed: bytes) -> None:
    """Fresh user-space random state from ``seed``: the ``random`` module's, numpy's global
    one when numpy is loaded (all 256 bits: MT19937 seeded by array), and the name sequence
    ``tempfile`` made from the parent's state (it makes a new one from os.urandom, which the
    restore's CRNG re-seed made fresh)."""
    import random

    random.seed(seed)
    numpy = sys.modules.get("numpy")
    try:
        if numpy is not None:
            numpy.random.seed([int.from_bytes(seed[i : i + 4], "big") for i in range(0, len(seed), 4)])
    except Exception:  # numpy half imported (by the running cell), or a cell replaced it
        pass
    tempfile = sys.modules.get("tempfile")
    if tempfile is not None and hasattr(tempfile, "_name_sequence"):
        tempfile._name_sequence = None  # type: ignore[attr-defined]  # private, made again on use


def _reseed_from_guestd(channel: socket.socket) -> None:
    """The re-seed thread: blocks in recv (without the GIL), applies each seed guestd sends and
    answers with its token. Not the message loop: it runs while a cell runs, as soon as the
    interpreter lets a thread run (at once during a sleep or I/O; within the switch interval
    of a pure-Python loop; when a C call holding the GIL returns). Ends when guestd closes
    its end (the kernel is being shut down) or the channel fails."""
    while True:
        try:
            message = channel.recv(SEED_MESSAGE_BYTES + 1)
        except OSError:
            return
        if not message:
            return
        if len(message) != SEED_MESSAGE_BYTES or not message.startswith(SEED_TAG):
            continue
        token = message[len(SEED_TAG) : len(SEED_TAG) + SEED_TOKEN_BYTES]
        try:
            _reseed(message[len(SEED_TAG) + SEED_TOKEN_BYTES :])
        except Exception:
            continue  # no confirmation: guestd re-seeds with a hidden cell before the next one
        try:
            channel.send(token)
        except OSError:
            return


def _start_reseeding(channel: socket.socket) -> None:
    import threading

    threading.Thread(target=_reseed_from_guestd, args=(channel,), name="guestd-reseed", daemon=True).start()


def _connection_without_a_file(info: dict[str, Any]) -> None:
    """ipykernel reads its connection info from a file and writes it back once bound: here it
    takes the info guestd handed over and writes nothing."""
    from ipykernel.kernelapp import IPKernelApp

    def init_connection_file(self: IPKernelApp) -> None:
        self.load_connection_info(info)  # type: ignore[arg-type]

    def write_connection_file(self: IPKernelApp, **kwargs: Any) -> None:
        pass

    IPKernelApp.init_connection_file = init_connection_file  # type: ignore[method-assign]
    IPKernelApp.write_connection_file = write_connection_file  # type: ignore[method-assign]


def exec_foreign(argv: list[str]) -> None:
    """Become a kernelspec's command (a foreign kernel). guestd's private environment (what its
    own Python needs, ``GUESTD_KERNEL_DROP_ENV``) is dropped unless the command is guestd's own
    Python (a kernelspec's ``python`` means that, as in jupyter_client); then the kernelspec's
    env and the context's (``GUESTD_KERNEL_ENV``, JSON) apply, to the command only."""
    drop = os.environ.pop("GUESTD_KERNEL_DROP_ENV", "")
    late = os.environ.pop("GUESTD_KERNEL_ENV", "")
    if argv and argv[0] != sys.executable:
        for name in drop.split(","):
            os.environ.pop(name, None)
    if late:
        os.environ.update({str(k): str(v) for k, v in json.loads(late).items()})
    if not argv:
        sys.exit(2)
    try:
        os.execvp(argv[0], argv)
    except OSError:
        sys.exit(127)  # guestd reports "exited with status 127" as the start failure


def _cwd_last_on_the_path(app: Any) -> None:
    """Cells import modules from their cwd (``""`` on sys.path, as in any notebook), but the
    kernel runs with ``-P`` and gets ``""`` last, after the standard library and site-packages,
    not where IPython puts it (before site-packages; Python's ``-m`` puts the cwd first): the
    cwd is the workload's to write, and a module there must never stand in for one the kernel
    imports, before the key hand-over or after (SECURITY.md, "code contexts")."""

    def init_path(self: Any) -> None:
        if "" not in sys.path:
            sys.path.append("")

    app.init_path = init_path


def _missing_kernel_packages() -> list[str]:
    """What this interpreter lacks of what the launcher imports (a workload's Python may have
    no ipykernel): looked up, not imported, so it costs a few stat calls."""
    from importlib.util import find_spec

    return [name for name in ("ipykernel", "jupyter_client", "zmq") if find_spec(name) is None]


def main() -> None:
    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    expected = os.environ.pop("GUESTD_PARENT_PID", "")
    if expected and os.getppid() != int(expected):
        sys.exit(1)  # guestd died before the prctl took effect: nobody owns us
    global _max_content
    _max_content = int(os.environ.pop("GUESTD_KERNEL_MAX_CONTENT", "0") or 0)
    # The packer is imported by name (--Session.packer): this module under a name of its own, as
    # it runs (python -m as __main__, which IPython then replaces with the cells' namespace; or
    # loaded by path into a workload's Python, which has no guestd package: guestd.code.python).
    sys.modules[PRIVATE_NAME] = sys.modules[__name__]
    argv = sys.argv[1:]
    if argv[:1] == ["--exec"]:
        exec_foreign(argv[1:])
    if _missing_kernel_packages():
        sys.exit(NO_IPYKERNEL)  # guestd says which Python lacks it and how to fix it
    if argv[:1] == ["--connection-from-guestd"]:
        info, channel = _connection_from_guestd()
        _connection_without_a_file(info)
        _start_reseeding(channel)
        argv = argv[1:]
    _split_long_streams()
    _iopub_waits_instead_of_dropping()
    from ipykernel import kernelapp

    _cwd_last_on_the_path(kernelapp.IPKernelApp)
    kernelapp.launch_new_instance(argv=[*argv, f"--Session.packer={PRIVATE_NAME}.pack_message"])


if __name__ == "__main__":
    main()
