"""The README's module map, from the modules themselves: every module of guestd/ with the first
sentence of its docstring, package by package, written between the README's
``<!-- modules:begin -->`` and ``<!-- modules:end -->`` markers.

    python scripts/readme_layout.py          # rewrite the section
    python scripts/readme_layout.py --check  # exit 1 when it is not current

tests/test_readme_layout.py holds it current: a module added, moved or re-described without
running this fails there, with this command in the message.
"""

from __future__ import annotations

import ast
import os
import re
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
BEGIN, END = "<!-- modules:begin -->", "<!-- modules:end -->"
WIDTH = 104  # a line of the map, path column included
PATH_COLUMN = 36


def first_sentence(doc: str) -> str:
    """The docstring's first sentence (to its first '. ' or blank line), on one line."""
    paragraph = doc.strip().split("\n\n", 1)[0]
    text = " ".join(paragraph.split())
    match = re.search(r"(?<=[.!?])\s", text)
    sentence = text[: match.start()] if match else text
    return sentence.rstrip(":;")


def describe(path: Path) -> str:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    doc = ast.get_docstring(tree)
    if doc:
        return first_sentence(doc)
    if path.name == "__main__.py":
        return "python -m " + ".".join(path.relative_to(REPO).parent.parts)
    return "(no docstring)"


def _entry(shown: str, text: str) -> list[str]:
    """The module's line(s): its path, then its sentence wrapped under the sentence column."""
    wrapped = textwrap.wrap(text, WIDTH - PATH_COLUMN, break_on_hyphens=False) or [""]
    first = f"{shown:<{PATH_COLUMN - 1}} {wrapped[0]}".rstrip()
    return [first, *(" " * PATH_COLUMN + rest for rest in wrapped[1:])]


def render() -> str:
    lines: list[str] = []
    for folder, dirs, files in os.walk(REPO / "guestd"):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files, key=lambda n: (n != "__init__.py", n)):
            if not name.endswith(".py"):
                continue
            path = Path(folder) / name
            shown = str(path.relative_to(REPO))
            if name == "__init__.py":
                shown = shown.removesuffix("__init__.py")
            lines.extend(_entry(shown, describe(path)))
    return "\n".join(["```", *lines, "```"])


def with_section(readme: str, section: str) -> str:
    head, found, rest = readme.partition(BEGIN)
    _old, found_end, tail = rest.partition(END)
    if not found or not found_end:
        raise SystemExit(f"README.md has no {BEGIN} ... {END} section")
    return f"{head}{BEGIN}\n{section}\n{END}{tail}"


def main(argv: list[str]) -> int:
    current = README.read_text(encoding="utf-8")
    wanted = with_section(current, render())
    if "--check" in argv:
        if wanted != current:
            print("README.md's module map is not current: run python scripts/readme_layout.py")
            return 1
        return 0
    if wanted != current:
        README.write_text(wanted, encoding="utf-8")
        print("rewrote README.md's module map")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
