"""No test module imports another test module: what two of them share lives in a helper module
(tests/helpers.py, tests/terminal.py, tests/private_fs.py, ...) or a conftest fixture. Importing
a test module runs its module-level code and binds the importer to whatever else that file holds,
and pytest would see its fixtures and tests under two names."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _is_test_module(dotted: str) -> bool:
    """A module of tests/ named test_*: ``tests.test_x``, ``tests.qemu.test_y``, or a bare
    ``test_x`` (what pytest's rootdir-relative imports would find)."""
    parts = dotted.split(".")
    return parts[-1].startswith("test_") and (parts[0] == "tests" or len(parts) == 1)


def imported_test_modules(source: str, module: str) -> list[str]:
    """The test modules that ``source`` (the module ``module``, dotted) imports anywhere in it,
    at the top or inside a function, absolutely or relatively."""
    package = module.split(".")[:-1]
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            parts = package[: len(package) - node.level + 1] if node.level else []
            base = ".".join([*parts, *(node.module.split(".") if node.module else [])])
            # "from tests import test_x" names the module in the alias; "from tests.test_x import y" in the base.
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        found += [name for name in names if _is_test_module(name)]
    return found


def test_the_checker_finds_each_way_of_importing_a_test_module() -> None:
    source = """
import os
import tests.test_a
from tests.test_b import Helper
from tests import test_c, helpers
from . import test_d
from .test_e import thing
from tests.helpers import write

def late():
    from tests.qemu.test_f import g
"""
    assert imported_test_modules(source, "tests.qemu.test_here") == [
        "tests.test_a",
        "tests.test_b",
        "tests.test_c",
        "tests.qemu.test_d",
        "tests.qemu.test_e",
        "tests.qemu.test_f",
    ]
    assert imported_test_modules("from tests.terminal import LocalTerminal\nimport unittest\n", "tests.test_x") == []


def test_no_module_of_tests_imports_a_test_module() -> None:
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        module = ".".join(path.relative_to(TESTS.parent).with_suffix("").parts)
        for imported in imported_test_modules(path.read_text(), module):
            offenders.append(f"{path.relative_to(TESTS.parent)} imports {imported}")
    assert offenders == [], "move what they share into a helper module of tests/:\n" + "\n".join(offenders)
