"""The task every example works on: a small git repository with a real bug and a failing pytest.

``textstats.word_count`` splits on single spaces, so runs of whitespace count as words and
``word_count("")`` is 1. The fix is ``text.split()``. ``CANDIDATES`` holds candidate patches
(unified diffs made with difflib, applied with ``git apply``) of which exactly one is right.

Everything is created through the guestd client, so the same code sets the task up in a
local guestd, a QEMU guest, or a Firecracker VM.
"""

from __future__ import annotations

import difflib
import importlib.metadata as md
import io
import os
import shlex
import tarfile

from packaging.markers import default_environment
from packaging.requirements import Requirement

from guestd.client import Client

BUGGY = '''"""Tiny text statistics."""


def word_count(text: str) -> int:
    """Number of whitespace-separated words."""
    return len(text.split(" "))


def average_word_length(text: str) -> float:
    words = text.split(" ")
    return sum(len(w) for w in words) / len(words)
'''

FIXED = BUGGY.replace('text.split(" ")', "text.split()").replace(
    "    return sum(len(w) for w in words) / len(words)",
    "    return sum(len(w) for w in words) / len(words) if words else 0.0",
)

TESTS = """from textstats import average_word_length, word_count


def test_simple() -> None:
    assert word_count("a b c") == 3


def test_runs_of_whitespace() -> None:
    assert word_count("  hello   world \\n") == 2


def test_empty() -> None:
    assert word_count("") == 0


def test_average() -> None:
    assert average_word_length("ab  abcd") == 3.0
    assert average_word_length("") == 0.0
"""

FILES = {
    "textstats.py": BUGGY,
    "test_textstats.py": TESTS,
    "README.md": "# textstats\n\nWord statistics. Run the tests with `python -m pytest -q`.\n",
    ".gitignore": "__pycache__/\n.pytest_cache/\n",
}

GIT_ID = ["-c", "user.name=guestd example", "-c", "user.email=agent@example.invalid"]


def diff(path: str, old: str, new: str) -> str:
    """A unified diff ``git apply`` accepts (a/ and b/ prefixes)."""
    lines = difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True), f"a/{path}", f"b/{path}")
    return "".join(lines)


# Candidate fixes, as a model sampled N times might propose them. Only "split-on-whitespace" is right.
CANDIDATES: dict[str, str] = {
    "strip-first": diff("textstats.py", BUGGY, BUGGY.replace('len(text.split(" "))', 'len(text.strip().split(" "))')),
    "split-on-whitespace": diff("textstats.py", BUGGY, FIXED),
    "drop-empty-words": diff(
        "textstats.py", BUGGY, BUGGY.replace('len(text.split(" "))', 'len([w for w in text.split(" ") if w])')
    ),
}


def create(c: Client, repo: str, *, timeout: float = 120) -> None:
    """Write the files and commit them as the repository's first commit."""
    for name, text in FILES.items():
        c.write_file(f"{repo}/{name}", text, parents=True)
    git = shlex.join(["git", *GIT_ID])
    script = f"git init -q && {git} add -A && {git} commit -q -m 'textstats: word statistics'"
    r = c.exec(["sh", "-c", script], cwd=repo, timeout_s=timeout)
    if r.exit_code != 0:
        raise RuntimeError(f"creating the repository failed: {r.stderr.decode(errors='replace')}")


def pytest_bundle() -> bytes:
    """pytest and its pure-Python dependencies from this machine, as a tar.gz to unpack on a path."""
    env = {k: str(v) for k, v in default_environment().items()}
    todo, seen = ["pytest"], set()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        while todo:
            name = todo.pop()
            dist = md.distribution(name)
            key = (dist.metadata["Name"] or name).lower()
            if key in seen:
                continue
            seen.add(key)
            for f in dist.files or []:
                parts = f.parts
                if parts and (parts[0].endswith(".dist-info") or parts[0] == ".." or "__pycache__" in parts):
                    continue
                src = str(f.locate())
                if os.path.isfile(src):
                    tar.add(src, arcname=str(f))
            for req in dist.requires or []:
                r = Requirement(req)
                if r.marker is None or r.marker.evaluate({**env, "extra": ""}):
                    todo.append(r.name)
    return buf.getvalue()


def ensure_pytest(c: Client, python: str, *, deps_dir: str = "/tmp/agent-deps", timeout: float = 300) -> dict[str, str]:
    """Make ``python -m pytest`` work in the guest: nothing to do when it already imports, else
    unpack this machine's pytest into ``deps_dir`` (as the workload: under /tmp by default, so it
    works when the workload runs as an unprivileged user). Returns the env the workload needs."""
    if c.exec([python, "-c", "import pytest"], timeout_s=timeout).exit_code == 0:
        return {}
    c.upload(pytest_bundle(), "/tmp/agent-deps.tar.gz")
    d = shlex.quote(deps_dir)
    r = c.exec(["sh", "-c", f"mkdir -p {d} && {python} -m tarfile -e /tmp/agent-deps.tar.gz {d}"], timeout_s=timeout)
    if r.exit_code != 0:
        raise RuntimeError(f"installing pytest in the guest failed: {r.stderr.decode(errors='replace')}")
    env = {"PYTHONPATH": deps_dir}
    if c.exec([python, "-c", "import pytest"], env=env, timeout_s=timeout).exit_code != 0:
        raise RuntimeError("pytest does not import in the guest after unpacking it")
    return env
