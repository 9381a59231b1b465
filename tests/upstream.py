"""Fetch a framework's own test file from its pinned source distribution, when the tests run.

Nothing of another project's suite is stored in this repository: the sdist named in
``scripts/upstream-suites.txt`` (a pip requirements file with a sha256 per line) is downloaded
into a temporary directory by pip with ``--require-hashes``, its digest is checked again here,
and the wanted member is extracted next to our own fixture shim. Where PyPI cannot be reached
the caller skips with the reason (:class:`UpstreamUnavailable`); a digest that does not match
the pin is a failure (:class:`UpstreamMismatch`), never a skip.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

PINS = Path(__file__).resolve().parent.parent / "scripts" / "upstream-suites.txt"
DOWNLOAD_TIMEOUT_S = 300
# What pip prints when the index cannot be reached at all (only these make a skip).
NETWORK_FAILURES = (
    "NewConnectionError", "Failed to establish a new connection", "Temporary failure in name resolution",
    "Name or service not known", "ConnectTimeoutError", "ReadTimeoutError", "Connection refused", "ProxyError",
    "Network is unreachable",
)  # fmt: skip


class UpstreamUnavailable(Exception):
    """The sdist could not be downloaded (no network, PyPI unreachable): skip, with this reason."""


class UpstreamMismatch(Exception):
    """What was downloaded is not what was pinned: fail."""


@dataclass(frozen=True)
class Pin:
    project: str
    version: str
    sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.project}=={self.version} --hash=sha256:{self.sha256}"


def read_pin(project: str, pins: Path = PINS) -> Pin:
    """The pin of ``project`` in the pins file (``name==version --hash=sha256:HEX`` lines)."""
    for raw in pins.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        spec, _, digest = line.partition(" --hash=sha256:")
        name, _, version = spec.partition("==")
        if name.strip().lower() == project.lower():
            if not version or len(digest.strip()) != 64:
                raise ValueError(f"{pins}: {raw!r} is not 'name==version --hash=sha256:<64 hex>'")
            return Pin(name.strip(), version.strip(), digest.strip().lower())
    raise KeyError(f"{project} is not pinned in {pins}")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_sdist(pin: Pin, into: Path) -> Path:
    """Download ``pin``'s sdist into ``into`` and return its path, its digest checked."""
    reqs = into / "requirements.txt"
    reqs.write_text(pin.requirement + "\n")
    cmd = [
        sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps",
        "--no-binary", ":all:", "--require-hashes", "-r", str(reqs), "-d", str(into),
    ]  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise UpstreamUnavailable(
            f"pip download {pin.project}=={pin.version}: no answer in {DOWNLOAD_TIMEOUT_S} s"
        ) from None
    if "THESE PACKAGES DO NOT MATCH THE HASHES" in proc.stderr:
        raise UpstreamMismatch(f"{pin.project}=={pin.version}: the sdist's sha256 is not the pinned one\n{proc.stderr}")
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-3:])
        if any(marker in proc.stderr for marker in NETWORK_FAILURES):
            raise UpstreamUnavailable(f"pip download {pin.project}=={pin.version}: PyPI unreachable: {tail}")
        # Anything else (a build backend that fails, a pin PyPI no longer serves) fails the test.
        raise UpstreamMismatch(f"pip download {pin.project}=={pin.version} failed:\n{proc.stderr}")
    archives = [p for p in into.iterdir() if p.name.endswith((".tar.gz", ".zip"))]
    if len(archives) != 1:
        raise UpstreamMismatch(f"expected one sdist in {into}, found {sorted(p.name for p in archives)}")
    got = sha256_of(archives[0])
    if got != pin.sha256:
        raise UpstreamMismatch(f"{archives[0].name}: sha256 {got}, pinned {pin.sha256}")
    return archives[0]


def extract_member(sdist: Path, member: str, dest: Path) -> Path:
    """Write the sdist's ``<top>/<member>`` (e.g. ``tests/test_execution.py``) to ``dest``."""
    with tarfile.open(sdist) as tar:
        wanted = [m for m in tar.getmembers() if m.isfile() and m.name.split("/", 1)[-1] == member]
        if len(wanted) != 1:
            raise UpstreamMismatch(f"{sdist.name} holds {len(wanted)} regular files named {member}")
        source = tar.extractfile(wanted[0])
        assert source is not None  # a regular file
        dest.write_bytes(source.read())
    return dest


def fetch_test_file(project: str, member: str, into: Path) -> Path:
    """The pinned sdist of ``project`` downloaded into ``into``, and ``member`` extracted from it
    into ``into / "suite"`` (a package, so that the file's relative imports of its conftest work)."""
    sdist = fetch_sdist(read_pin(project), into)
    suite = into / "suite"
    suite.mkdir()
    (suite / "__init__.py").write_text("")
    return extract_member(sdist, member, suite / Path(member).name)
