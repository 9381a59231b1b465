"""The README's module map lists every module of guestd/ with its docstring's first sentence,
and is current (scripts/readme_layout.py writes it)."""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

from guestd.testing import REPO


def _layout() -> ModuleType:
    spec = importlib.util.spec_from_file_location("readme_layout", os.path.join(REPO, "scripts", "readme_layout.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_lists_every_module_as_its_docstring_describes_it() -> None:
    layout = _layout()
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    assert readme == layout.with_section(readme, layout.render()), (
        "README.md's module map is not current: run python scripts/readme_layout.py"
    )
    listed = readme.partition(layout.BEGIN)[2].partition(layout.END)[0]
    for folder, dirs, files in os.walk(os.path.join(REPO, "guestd")):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if name.endswith(".py") and name != "__init__.py":
                assert os.path.relpath(os.path.join(folder, name), REPO) in listed, name


def test_a_first_sentence_ends_at_its_stop_not_inside_a_name() -> None:
    first = _layout().first_sentence
    stop = "Atomic writes: a temp file beside the target."
    assert first(stop + "\n\nMore.") == stop
    assert first("guestd.files.fs holds it. Then more") == "guestd.files.fs holds it."
    assert first("One line, no stop") == "One line, no stop"
