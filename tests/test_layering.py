"""The house's layering, checked on the source: a capability package imports nothing above
itself (the daemon, the server, the composition root, the client, the CLI, test helpers) and no
other capability; the layers below the capabilities import none of them; the server imports no
capability (guestd/capabilities.py composes them into it) and its modules form no import cycle.
Type-only imports count too."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest

from guestd.testing import REPO

CAPABILITIES = ("exec", "files", "processes", "shells", "code", "snapshot", "system", "ports", "metrics")
ABOVE = (
    "guestd.server",
    "guestd.capabilities",
    "guestd.client",
    "guestd.cli",
    "guestd.testing",
    "guestd.integrations",
)
BELOW = (
    "guestd/children",
    "guestd/wire",
    "guestd/services.py",
    "guestd/config.py",
    "guestd/policy.py",
    "guestd/output",
    "guestd/tables.py",
)


def imports_of(path: str) -> set[str]:
    return set(_all_imports()[path])


# Parsed in a fresh interpreter: CPython 3.11's AST constructor can fail with "recursion depth
# mismatch" (gh-106905) after hypothesis has changed the recursion limit in this process.
_PARSER = """
import ast, json, sys
out = {}
for path in sys.argv[1:]:
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(node.module + "." + a.name for a in node.names)
    out[path] = sorted(m for m in found if m.startswith("guestd"))
print(json.dumps(out))
"""


@functools.cache
def _all_imports() -> dict[str, list[str]]:
    paths = modules_under("guestd")
    done = subprocess.run([sys.executable, "-c", _PARSER, *paths], capture_output=True, check=True, text=True)
    result: dict[str, list[str]] = json.loads(done.stdout)
    return result


def modules_under(rel: str) -> list[str]:
    root = os.path.join(REPO, rel)
    if root.endswith(".py"):
        return [root]
    return sorted(os.path.join(d, f) for d, _, files in os.walk(root) for f in files if f.endswith(".py"))


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_a_capability_imports_nothing_above_it_and_no_other_capability(capability: str) -> None:
    others = [f"guestd.{c}" for c in CAPABILITIES if c != capability]
    bad = {
        (os.path.relpath(path, REPO), m)
        for path in modules_under(f"guestd/{capability}")
        for m in imports_of(path)
        if any(_within(m, p) for p in (*ABOVE, *others))
    }
    assert not bad, sorted(bad)


def test_the_run_output_engine_sits_below_the_services() -> None:
    """guestd/output (pump, capture, spill, shaping) is what services and the capabilities
    build on: it sees a request only as output/stream.py's narrow shape, never Services."""
    bad = {
        (os.path.relpath(path, REPO), m)
        for path in modules_under("guestd/output")
        for m in imports_of(path)
        if _within(m, "guestd.services")
    }
    assert not bad, sorted(bad)


def test_the_layers_below_import_no_capability_and_nothing_above() -> None:
    forbidden = (*ABOVE, *(f"guestd.{c}" for c in CAPABILITIES))
    bad = {
        (os.path.relpath(path, REPO), m)
        for rel in BELOW
        for path in modules_under(rel)
        for m in imports_of(path)
        if any(_within(m, p) for p in forbidden)
    }
    assert not bad, sorted(bad)


def test_the_daemon_does_not_load_test_helpers_or_the_cli() -> None:
    host_side = ("guestd.testing", "guestd.cli", "guestd.client", "guestd.integrations")
    bad = {
        (os.path.relpath(path, REPO), m)
        for path in modules_under("guestd/server")
        for m in imports_of(path)
        if any(_within(m, p) for p in host_side)
    }
    assert not bad, sorted(bad)


def test_the_server_imports_no_capability() -> None:
    """Connections, dispatch, admission and the daemon serve whatever is composed into them
    (guestd/capabilities.py); a capability hooks into admission from its own register()."""
    capabilities = tuple(f"guestd.{c}" for c in CAPABILITIES)
    bad = {
        (os.path.relpath(path, REPO), m)
        for path in modules_under("guestd/server")
        for m in imports_of(path)
        if any(_within(m, p) for p in capabilities)
    }
    assert not bad, sorted(bad)


def test_the_servers_modules_import_each_other_without_a_cycle() -> None:
    modules = {_module_name(path): path for path in modules_under("guestd/server")}
    edges = {
        name: {m for m in imports_of(path) if m in modules and m != name and m != "guestd.server"}
        for name, path in modules.items()
    }
    cycles = []
    done: set[str] = set()

    def visit(name: str, trail: list[str]) -> None:
        if name in trail:
            cycles.append([*trail[trail.index(name) :], name])
            return
        if name in done:
            return
        for nxt in sorted(edges[name]):
            visit(nxt, [*trail, name])
        done.add(name)

    for name in sorted(modules):
        visit(name, [])
    assert not cycles, cycles


def _module_name(path: str) -> str:
    name = os.path.relpath(path, REPO).removesuffix(".py").replace(os.sep, ".")
    return name.removesuffix(".__init__")
