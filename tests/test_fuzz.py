"""A bounded atheris (libFuzzer) run over decoder + validation + dispatch of a real server object,
seeded with the golden vectors and the committed corpus (tests/fuzz/corpus: inputs a long run
kept for new coverage, minimized with -merge=1). Longer runs: see SECURITY.md."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from guestd.testing import REPO

pytest.importorskip("atheris")


def test_fuzz_server_bounded(tmp_path: object) -> None:
    corpus = f"{tmp_path}/corpus"
    os.makedirs(corpus)
    work = f"{tmp_path}/work"
    os.makedirs(work)
    with open(os.path.join(REPO, "protocol", "vectors", "v1.json")) as f:
        vectors = json.load(f)
    for i, v in enumerate(vectors["frames"]):
        with open(f"{corpus}/v{i}", "wb") as out:
            out.write(b"\x01" + bytes.fromhex(v["hex"]))  # first byte: FuzzedDataProvider's ConsumeBool
    committed = os.path.join(REPO, "tests", "fuzz", "corpus")
    for name in os.listdir(committed):  # copied: the run adds to its corpus, the repository's stays as is
        shutil.copy(os.path.join(committed, name), corpus)
    assert len(os.listdir(corpus)) > len(vectors["frames"])
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "tests", "fuzz", "fuzz_server.py"),
            "-runs=20000",
            "-max_len=4096",
            "-timeout=10",
            corpus,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=str(tmp_path),
        env={**os.environ, "PYTHONPATH": REPO, "GUESTD_FUZZ_WORK": str(work)},
    )
    assert r.returncode == 0, r.stderr[-4000:]
    assert "Done 20000 runs" in r.stderr
