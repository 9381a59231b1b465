"""Issue 34, memory and start: what guestd does before its first reply.

Capabilities are declared at start and registered at their first request, so start-up imports
none of their engines; the hello still lists every op, a capability that needs another one
(exec's ``report_changes`` needs the files capability's change feed, ``on_timeout: "detach"``
the process table) registers it on use, and ``snapshot.prepare`` registers all of them, so a
guest restored from the snapshot pays no first-use import. Checked on a real guestd over a
Unix socket, and in a fresh interpreter for the module list (no timing here: bench/run.py
measures start to first reply and idle RSS against their floors)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil
import pytest

from guestd.testing import REPO, Guestd, StartGuestd
from guestd.wire.schema import OPS_BY_NAME

# Engines a first ping needs none of: the files capability's tree and workspace modules, the
# exec engine, the port relays (hashlib, OpenSSL), psutil, jupyter_client and what they pull in.
NOT_AT_START = (
    "tarfile",
    "hashlib",
    "psutil",
    "jupyter_client",
    "guestd.files.workspace",
    "guestd.files.trees",
    "guestd.files.fs",
    "guestd.exec.run",
    "guestd.ports.relay",
    "guestd.processes.handlers",
    "guestd.shells.session",
    "guestd.metrics.sampler",
    "guestd.code.contexts",
    "shutil",  # argparse's default help formatter asks it for the terminal's width
    "argparse",  # a plain command line is read without it (guestd/server/options.py)
    "guestd.memtune",  # malloc's tuning for bulk transfers waits for the first reply
    "guestd.wire.types",  # the generated TypedDicts (~15 ms, ~0.8 MiB): for type checkers and the client
    "guestd.wire.session.client",  # the client's half of the session core
    "json",  # ~1.8 ms, 0.14 MiB: the restore's generation file imports it (snapshot.prepare loads it first)
    "ctypes",  # ~1 ms: becoming the subreaper and malloc's tuning go through the clone3 extension
    # A run's handle, its exit records and the tree's helpers (and termios) load with the first spawn
    "guestd.children.child",
    "guestd.children.records",
    "guestd.children.tree",
    "termios",
    # What snapshot.prepare and restore need beyond the gate and the clock loads at prepare
    "guestd.snapshot.inputs",
    "guestd.snapshot.notify",
    "guestd.snapshot.hazards",
    "guestd.children.options",
    "pwd",
    # The request's data-event shape: services' Protocols are for type checkers only
    "guestd.output.stream",
)

_START_PATH = """
import sys
from guestd.config import Config
from guestd.server.daemon import Daemon
from guestd.server.options import parse_command_line
parse_command_line(["--listen", "unix:/nowhere.sock"])
cfg = Config()
cfg.runtime_dir = sys.argv[1]
daemon = Daemon(cfg)
declared = daemon.dispatcher.ops()
loaded = sorted(sys.modules)
daemon.require_all()
import json  # only now: json is one of the modules the start path must not import
print(json.dumps({"loaded": loaded, "declared": declared, "registered": sorted(daemon.dispatcher.routes),
                  "capabilities": daemon.dispatcher.capabilities()}))
"""


def test_constructing_the_daemon_imports_no_capability_engine(tmp_path: object) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _START_PATH, f"{tmp_path}/rt"], capture_output=True, text=True, check=True
    )
    out = json.loads(done.stdout)
    assert [m for m in NOT_AT_START if m in out["loaded"]] == []
    # Declared ops are exactly the ops registered once every capability is loaded: the schema's.
    assert out["declared"] == out["registered"] == sorted(OPS_BY_NAME)
    assert out["capabilities"] == sorted({spec.capability for spec in OPS_BY_NAME.values()})


_RECORD_CLASSES = """
import sys
from guestd.config import Config
from guestd.server.daemon import Daemon
from guestd.server.options import parse_command_line
parse_command_line(["--listen", "unix:/nowhere.sock"])
cfg = Config()
cfg.runtime_dir = sys.argv[1]
Daemon(cfg)
found = []
for name, module in sorted(sys.modules.items()):
    if not name.startswith("guestd"):
        continue
    for value in list(vars(module).values()):
        if isinstance(value, type) and value.__module__ == name:
            if hasattr(value, "__dataclass_fields__") or (issubclass(value, tuple) and hasattr(value, "_fields")):
                found.append(name + "." + value.__qualname__)
print("\\n".join(found + ["module:dataclasses"] * ("dataclasses" in sys.modules)))
"""


def test_the_start_path_declares_no_dataclass_or_namedtuple(tmp_path: object) -> None:
    """Declaring a dataclass compiles its methods (~1-2 ms each, plus a frozen __init__ per
    instance) and a NamedTuple builds a tuple class (~0.1-0.15 ms): the wire, the snapshot
    capability, the server and the spawner declare plain classes with __slots__
    (guestd/wire/record.py), and nothing on the path imports dataclasses."""
    done = subprocess.run(
        [sys.executable, "-c", _RECORD_CLASSES, f"{tmp_path}/rt"], capture_output=True, text=True, check=True
    )
    found = done.stdout.split()
    assert found == []


def _mapped(g: Guestd, name: str) -> bool:
    with open(f"/proc/{g.pid}/maps") as f:
        return name in f.read()


def test_a_pinged_guestd_has_loaded_no_engine_and_its_hello_lists_every_op(
    fresh_guestd: StartGuestd, tmp_path: object
) -> None:
    # its own runtime dir: the shared one may hold the records of a killed guestd's writes,
    # whose cleanup is start-up work of the files capability
    g = fresh_guestd("--runtime-dir", f"{tmp_path}/rt")
    with g.client() as c:
        assert sorted(c._aio.server_hello["ops"]) == sorted(OPS_BY_NAME)
        c.ping()
        info = c.info()
        assert sorted(info.raw["ops"]) == sorted(OPS_BY_NAME)
        assert "snapshot" in info.raw and "kernels" in info.raw  # contributions of the capabilities at start
        # Extension modules show in the process's maps: OpenSSL's hashlib came with the port relays.
        assert not _mapped(g, "_hashlib")
        assert c.exec(["true"]).exit_code == 0  # the exec capability registers at its first request
        assert c.exec(["true"]).exit_code == 0


# A heavy package shows in a process's maps by an extension module it loads (the pure-Python
# ones, difflib say, cannot be seen from outside; test_constructing_the_daemon_... covers those):
# package -> a file name part of the .so its import maps.
HEAVY_EXTENSIONS = {
    "jupyter_client": "zmq",  # pyzmq's _zmq and libzmq: the code capability's kernels
    "psutil": "_psutil_linux",
    "hashlib": "_hashlib",  # OpenSSL's hashes: the port relays, a configured token
    "tarfile": "_lzma",  # shutil's compressors, which tarfile (the files capability's trees) imports
}


def _maps_of(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


def test_the_heavy_packages_are_told_by_their_extension_modules() -> None:
    """The needles of HEAVY_EXTENSIONS are right: importing each package maps its .so, so the
    test below cannot pass for looking for a name no import maps."""
    for package, needle in HEAVY_EXTENSIONS.items():
        probe = f"import {package}; print({needle!r} in open('/proc/self/maps').read())"
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120)
        assert done.stdout.strip() == "True", (package, needle)


def test_a_guestd_that_served_only_pings_maps_no_heavy_package(fresh_guestd: StartGuestd, tmp_path: object) -> None:
    g = fresh_guestd("--runtime-dir", f"{tmp_path}/rt")
    with g.client() as c:
        c.ping()
        c.ping()  # the first request's after-first-reply work (Daemon.settle) has run by now
        maps = _maps_of(g.pid)
        assert [p for p, needle in HEAVY_EXTENSIONS.items() if needle in maps] == []


def test_guestd_is_the_subreaper_of_what_its_runs_leave_behind(fresh_guestd: StartGuestd, tmp_path: object) -> None:
    """Becoming the subreaper went from ctypes to the clone3 extension (ctypes is off the start
    path): a background process whose shell has exited is re-parented to guestd, which reaps it."""
    g = fresh_guestd("--runtime-dir", f"{tmp_path}/rt")
    with g.client() as c:
        reply = c.exec(["sh", "-c", "sleep 30 >/dev/null 2>&1 & echo $!"])
        orphan = int(reply.stdout)
        try:
            with open(f"/proc/{orphan}/status") as f:
                ppid = next(int(line.split()[1]) for line in f if line.startswith("PPid:"))
            assert ppid == g.pid
        finally:
            os.kill(orphan, 9)
        for _ in range(1000):  # reaped by guestd's sweep: the pid disappears
            if not os.path.exists(f"/proc/{orphan}"):
                break
            time.sleep(0.01)
        assert not os.path.exists(f"/proc/{orphan}")


def test_a_first_exec_gets_what_other_capabilities_provide(fresh_guestd: StartGuestd, tmp_path: object) -> None:
    g = fresh_guestd("--workspace", f"{tmp_path}/ws", "--runtime-dir", f"{tmp_path}/rt")
    with g.client() as c:
        # report_changes: the files capability's change feed, registered by exec's use of it
        reply = c.call("exec", {"shell": "echo x > made-by-exec", "report_changes": True})
        assert reply["exit_code"] == 0
        assert "made-by-exec" in json.dumps(reply["changes"])
    g2 = fresh_guestd("--runtime-dir", f"{tmp_path}/rt2")
    with g2.client() as c:
        # on_timeout "detach": the process table, registered by exec's use of it
        r = c.exec(["sleep", "30"], timeout_s=0.2, on_timeout="detach")
        assert r.detached is not None
        assert r.detached in [p["id"] for p in c.call("process.list")["processes"]]


def test_snapshot_prepare_registers_every_capability_first(fresh_guestd: StartGuestd, tmp_path: object) -> None:
    g = fresh_guestd("--runtime-dir", f"{tmp_path}/rt")
    with g.client() as c:
        c.ping()
        assert not _mapped(g, "_hashlib")
        prepared = c.call("snapshot.prepare", {})
        # the running work of every capability is reported, none missing for not being loaded yet
        assert set(prepared["running"]) >= {"processes", "busy_shells", "busy_contexts"}, prepared
        assert _mapped(g, "_hashlib")  # the port relays are loaded in the snapshot's image
        c.snapshot_resume()
        assert c.exec(["true"]).exit_code == 0


def test_a_killed_guestds_write_records_still_go_at_the_next_start(fresh_guestd: StartGuestd, tmp_path: object) -> None:
    """The files capability is not loaded at start, but its start-up cleanup still runs when a
    guestd that is gone left records of writes in progress (tests/test_fs_interrupted.py kills
    one mid-write; here a record of a pid that is no guestd stands for it)."""
    runtime = f"{tmp_path}/rt"
    dead = f"{runtime}/pending-writes/999999999"
    os.makedirs(dead)
    g = fresh_guestd("--runtime-dir", runtime)
    assert not os.path.exists(dead)
    with g.client() as c:
        c.ping()


def test_the_prewarmed_kernel_pool_fills_after_the_first_reply(fresh_guestd: StartGuestd, tmp_path: object) -> None:
    """--code-prewarm keeps its warm pool: its kernel starts with no request but a ping (the
    ordering itself, after the first reply rather than as the loop starts, is timing: the bench
    measures start to first reply)."""
    g = fresh_guestd("--runtime-dir", f"{tmp_path}/rt", "--code-prewarm", "--code-pool", "1")
    # Read as soon as guestd says it listens (the pool waits for a reply, or a second without one).
    assert not _mapped(g, "zmq")
    with g.client() as c:
        c.ping()
        for _ in range(1200):  # bounded: a kernel start takes ~1 s here, much longer on a busy machine
            kernels = [p for p in psutil.Process(g.pid).children() if "guestd.code.kernel" in p.cmdline()]
            if kernels:
                break
            time.sleep(0.05)
        assert kernels, "the pool never started its kernel"
        assert _mapped(g, "zmq")


_SERVE_ENABLES_GC = """
import asyncio, gc, os, sys, threading
gc.disable()  # as guestd/__main__.py does for the start-up
from guestd.config import Config
from guestd.server.daemon import Daemon
cfg = Config()
cfg.listen = ["unix:" + sys.argv[1] + "/g.sock"]
cfg.runtime_dir = sys.argv[1] + "/rt"
daemon = Daemon(cfg)
r, w = os.pipe()


def report() -> None:  # once guestd says it listens
    os.read(r, 16)
    print(gc.isenabled(), flush=True)
    os._exit(0)


threading.Thread(target=report, daemon=True).start()
asyncio.run(daemon.serve(w))
"""


def test_serving_turns_garbage_collection_back_on(tmp_path: object) -> None:
    """guestd/__main__.py turns the collector off while start-up imports; once guestd listens
    (and has frozen what start-up made) it must collect again, or every cycle would leak."""
    done = subprocess.run(
        [sys.executable, "-c", _SERVE_ENABLES_GC, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert done.stdout.strip() == "True", done.stderr[-2000:]


_CONSOLE_SCRIPT = """
import gc, importlib, sys, tomllib
with open(sys.argv[1], "rb") as f:
    entry = tomllib.load(f)["project"]["scripts"]["guestd"]
module, _, function = entry.partition(":")
seen = []


class Watch:  # notes whether the collector is on when the daemon's module is imported
    def find_spec(self, name, path=None, target=None):
        if name == "guestd.server.daemon":
            seen.append(gc.isenabled())
        return None


sys.meta_path.insert(0, Watch())
main = getattr(importlib.import_module(module), function)  # what pip's console script does
sys.argv = ["guestd", "--no-such-option"]  # the daemon is imported, then the command line refused
try:
    main()
except SystemExit:
    pass
print(seen)
"""


def test_the_console_script_starts_as_python_m_guestd_does() -> None:
    """pip's ``guestd`` script enters at guestd.__main__:main, which turns the collector off
    before the daemon's imports as ``python -m guestd`` does (before: guestd.server.daemon:main,
    imported with the collector on)."""
    done = subprocess.run(
        [sys.executable, "-c", _CONSOLE_SCRIPT, os.path.join(REPO, "pyproject.toml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout.strip() == "[False]", (done.stdout, done.stderr[-2000:])


def test_the_baked_guestd_wrapper_puts_no_cwd_on_sys_path(tmp_path: object) -> None:
    """guestd imports most of itself at first use, after the workload has run: the image's
    launcher runs ``python3 -P -m guestd``, so a module the workload plants in the directory
    guestd was started from is never on its import path (plain -m puts the cwd first)."""
    from guestd.bake import write_wrappers

    write_wrappers(str(tmp_path))
    with open(f"{tmp_path}/usr/local/bin/guestd") as f:
        launcher = f.read().splitlines()[-1]
    assert " -P -m guestd " in launcher, launcher


def _imported_in_functions(path: str) -> set[str]:
    """Modules a file imports inside its functions (the lazy imports of a path off the start)."""
    import ast

    with open(os.path.join(REPO, path)) as f:
        tree = ast.parse(f.read())
    found: set[str] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and node.module:
                    found.add(node.module)
                elif isinstance(node, ast.Import):
                    found.update(alias.name for alias in node.names)
    return found


_RESTORE_IMPORTS = """
import json, sys
from guestd.snapshot.state import load_restore_imports
load_restore_imports()
print(json.dumps(sorted(sys.modules)))
"""


def test_snapshot_prepare_loads_what_a_restore_imports_later() -> None:
    """A guest restored from a snapshot must import nothing: every module the snapshot state and
    the restore's notices import inside a function is loaded by load_restore_imports, which
    snapshot.prepare calls (the modules are off the start path: the test above)."""
    lazy = _imported_in_functions("guestd/snapshot/state.py") | _imported_in_functions("guestd/snapshot/notify.py")
    assert {"guestd.snapshot.inputs", "guestd.snapshot.notify", "json"} <= lazy  # the scan sees them
    done = subprocess.run([sys.executable, "-c", _RESTORE_IMPORTS], capture_output=True, text=True, check=True)
    loaded = set(json.loads(done.stdout))
    assert sorted(lazy - loaded) == []


def test_the_children_package_names_each_load_from_their_module() -> None:
    """guestd.children gives its names on first use (PEP 562), so importing one of its modules
    on the start path does not import the rest; each name is the defining module's object."""
    import importlib

    import guestd.children as children

    table = children._DEFINED_IN
    assert sorted(children.__all__) == sorted(table)
    for name, module in table.items():
        assert getattr(children, name) is getattr(importlib.import_module(f"guestd.children.{module}"), name)
    with pytest.raises(ImportError):
        from guestd.children import no_such_name  # noqa: F401


def test_a_restore_after_prepare_imports_nothing(fresh_guestd: StartGuestd, tmp_path: object) -> None:
    """End to end, as a restored clone runs it: after snapshot.prepare, the restore (re-seeds,
    identity, generation file, signals), a clock check and a new connection's hello import no
    module (Python's own import trace, in guestd's log, has no line after prepare)."""
    g = fresh_guestd("--runtime-dir", f"{tmp_path}/rt", env={"PYTHONPROFILEIMPORTTIME": "1"})
    with g.client() as c:
        c.ping()
        c.call("snapshot.prepare", {})
        mark = os.path.getsize(g.log_path)
        identity = {"sandbox_id": "clone-1", "hostname": "clone-1", "env": {"CLONE": "1"}}
        restore = {"generation": 1, "nonce": "n1", "entropy": os.urandom(32), "time_ns": time.time_ns(), **identity}
        assert c.call("snapshot.restore", restore)["generation"] == 1
    with g.client() as c:  # the restore dropped the connections from before it
        c.call("clock.check", {"time_ns": time.time_ns() + 5 * 10**9})  # 5 s off: the clock is stepped (recorded)
        c.ping()
    with open(g.log_path) as f:
        f.seek(mark)
        after = [line for line in f if line.startswith("import time:")]
    assert after == []
    with open(g.log_path) as f:  # the trace is on: prepare's own imports are in the log
        assert any(line.startswith("import time:") and "guestd.snapshot.inputs" in line for line in f)
