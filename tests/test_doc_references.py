"""The documents name code and tests that exist: every `guestd/...py` path, `path::Symbol` and
test name in SECURITY.md, README.md, protocol/*.md and bench/*.md (a module split or a renamed
test otherwise leaves the boundary table pointing at nothing)."""

from __future__ import annotations

import glob
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["SECURITY.md", "README.md", *sorted(glob.glob("protocol/*.md", root_dir=REPO))]
DOCS += sorted(glob.glob("bench/*.md", root_dir=REPO))
CODE_REF = re.compile(r"\b((?:guestd|tests|bench|scripts)/[A-Za-z0-9_/]+\.py)(?:::([A-Za-z_][A-Za-z0-9_.]*))?")
# an example path in the README's set-up text, and SWE-ReX's own test file (fetched when its tests run)
EXAMPLES_AND_THEIRS = {"tests/test_x.py", "tests/test_execution.py"}
TEST_NAME = re.compile(r"(?:`|::)(test_[a-z0-9_]+)\b(?!\.py)")


def read(path: str) -> str:
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        return f.read()


def defines(source: str, symbol: str) -> bool:
    """``symbol`` (``Name`` or ``Name.attr``) is defined at some level of ``source``: a def, a
    class or an assignment of its last part (a method or an attribute of the class)."""
    last = symbol.rsplit(".", 1)[-1]
    pattern = rf"^\s*(?:async def|def|class)\s+{last}\b|^\s*(?:self\.)?{last}\b\s*[:=]"
    return re.search(pattern, source, re.M) is not None


def all_test_sources() -> str:
    parts = []
    for path in glob.glob("tests/**/*.py", root_dir=REPO, recursive=True):
        parts.append(read(path))
    return "\n".join(parts)


@pytest.mark.parametrize("doc", DOCS)
def test_every_code_path_and_symbol_a_document_names_exists(doc: str) -> None:
    missing = []
    for m in CODE_REF.finditer(read(doc)):
        path, symbol = m.group(1), m.group(2)
        if path in EXAMPLES_AND_THEIRS:
            continue
        if not os.path.exists(os.path.join(REPO, path)):
            missing.append(path)
        elif symbol and not defines(read(path), symbol):
            missing.append(f"{path}::{symbol}")
    assert not missing, f"{doc} names code that is not there: {sorted(set(missing))}"


@pytest.mark.parametrize("doc", ["SECURITY.md", "README.md"])
def test_every_test_a_document_names_exists(doc: str) -> None:
    """Ours, or a framework's own test our tests name (an expected failure of its suite)."""
    sources = all_test_sources()
    names = set(TEST_NAME.findall(read(doc)))
    missing = [
        n
        for n in sorted(names)
        if not os.path.exists(os.path.join(REPO, "tests", f"{n}.py")) and not re.search(rf"\b{n}\b", sources)
    ]
    assert not missing, f"{doc} names tests that are not there: {missing}"
