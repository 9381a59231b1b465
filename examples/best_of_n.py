"""Best-of-N over snapshot clones: warm one guest, snapshot it, try N candidate patches in N clones.

1. Warm: boot a guest, create the task repository (a real failing test), install what the
   tests need (pytest, unpacked from this machine), run the suite once to confirm it fails,
   and open a Python context (its PRNG state will be in the snapshot).
2. ``snapshot.prepare``, then save the whole VM to one file and end the parent.
3. Restore N clones from that one file, in parallel. First thing in each: ``restore`` with
   fresh entropy and a new identity (sandbox id, hostname), which re-seeds the kernel CRNG
   and every PRNG in the guest, so the clones stop sharing the parent's random state.
4. In each clone: apply that clone's candidate patch (``git apply``), run the tests, report.

On this machine the VMs are QEMU/TCG guests of the baked test image (guestd/testing/qemu.py):
the snapshot is QMP ``stop`` + ``migrate`` to a file, each clone a new QEMU process with
``-incoming defer`` + ``migrate-incoming`` + ``cont``, and the host talks to guestd over
virtio-serial.

With Firecracker the same flow is (its snapshot API and what a restore does to vsock are
Firecracker's, documented in
https://github.com/firecracker-microvm/firecracker/blob/main/docs/snapshotting/snapshot-support.md
and .../docs/vsock.md; not run here):

- parent: ``guestd.snapshot_prepare()``; ``PATCH /vm {"state": "Paused"}``;
  ``PUT /snapshot/create {"snapshot_type": "Full", "snapshot_path": ..., "mem_file_path": ...}``;
- each clone: a new firecracker process (its own jailer chroot, so the vsock ``uds_path``
  stored in the snapshot resolves to a per-clone socket);
  ``PUT /snapshot/load {"snapshot_path": ..., "mem_backend": {"backend_type": "File",
  "backend_path": ...}, "resume_vm": true}`` (or a ``Uffd`` backend to share the parent's memory
  pages copy-on-write across many clones);
- the host connects with ``Client("fc:<chroot>/v.sock:10700")`` (Firecracker resets vsock
  connections on restore, so every clone gets a fresh one) and calls ``restore(...)`` before
  anything else, exactly as below. A VMGenID device, where the kernel has it, re-seeds the CRNG
  too; ``restore`` still re-seeds the processes' PRNGs, the clock and the identity.

Run it (boots 1 + N VMs under TCG; a few minutes on 2 cores):

    .venv/bin/python -m examples.best_of_n --n 3
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from examples import demo_repo
from examples.guests import QemuGuest
from guestd.client import Client

GUEST_PYTHON = "/usr/local/bin/guestd-python"  # the minimal image's only Python
REPO = "/workspace/textstats"


@dataclass
class Warm:
    env: dict[str, str]  # what the tests need (PYTHONPATH of the unpacked pytest)
    context: str  # a Python context that lives on in every clone
    baseline: str  # the failing test summary in the parent


@dataclass
class CandidateResult:
    name: str
    clone: str
    applied: bool
    passed: bool
    summary: str  # last line of pytest's output, or why the patch did not apply
    hostname: str
    crng: str  # the restore report's CRNG step: "done" when re-seeded
    random_draw: str  # random.getrandbits(64) in the context from before the snapshot
    seconds: float


def warm(c: Client, python: str = GUEST_PYTHON, repo: str = REPO) -> Warm:
    demo_repo.create(c, repo)
    env = demo_repo.ensure_pytest(c, python)
    r = c.exec([python, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=repo, env=env, timeout_s=600)
    if r.exit_code == 0:
        raise RuntimeError("the task's tests already pass before any candidate: nothing to choose")
    ctx = c.code_create(cwd=repo, deadline=300).id
    c.code_run("import random", context=ctx, timeout_s=300)
    return Warm(env, ctx, r.stdout.decode(errors="replace").strip().splitlines()[-1])


def try_candidate(
    c: Client, index: int, name: str, patch: str, w: Warm, python: str = GUEST_PYTHON, repo: str = REPO
) -> CandidateResult:
    t0 = time.monotonic()
    tag = f"candidate-{index}"
    rep = c.restore(entropy=os.urandom(64), sandbox_id=f"best-of-n-{index}-{os.urandom(4).hex()}", hostname=tag)
    draw = c.code_run("random.getrandbits(64)", context=w.context, timeout_s=300).text or ""
    hostname = c.exec(["hostname"], timeout_s=60).stdout.decode().strip()
    c.write_file("/tmp/candidate.patch", patch)
    applied = c.exec(["git", "apply", "/tmp/candidate.patch"], cwd=repo, timeout_s=60)
    if applied.exit_code != 0:
        summary = "patch does not apply: " + applied.stderr.decode(errors="replace").strip()
        return CandidateResult(name, tag, False, False, summary, hostname, rep.crng, draw, time.monotonic() - t0)
    test = c.exec(
        [python, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=repo, env=w.env, timeout_s=600, idle_timeout_s=300
    )
    lines = test.stdout.decode(errors="replace").strip().splitlines()
    return CandidateResult(
        name,
        tag,
        True,
        test.exit_code == 0,
        lines[-1] if lines else f"exit {test.exit_code}",
        hostname,
        rep.crng,
        draw,
        time.monotonic() - t0,
    )


def best_of_n(
    candidates: dict[str, str], workdir: str, image: tuple[str, str] | None = None
) -> tuple[Warm, list[CandidateResult]]:
    """Warm one guest, snapshot it, and try each candidate in its own clone (in parallel).
    ``image``: (kernel, initramfs) to boot; baked into ``workdir`` when not given."""
    kernel, initrd = image or QemuGuest.image(workdir)
    snapshot = os.path.join(workdir, "warm.snapshot")
    parent = QemuGuest.boot(workdir, kernel, initrd, tag="parent")
    try:
        with parent.connect() as c:
            w = warm(c)
            c.snapshot_prepare()
        parent.save(snapshot)
    finally:
        parent.stop()

    def run(index: int, name: str, patch: str) -> CandidateResult:
        clone = QemuGuest.restore(snapshot, workdir, kernel, initrd, tag=f"clone{index}")
        try:
            with clone.connect() as c:
                return try_candidate(c, index, name, patch, w)
        finally:
            clone.stop()

    with ThreadPoolExecutor(max_workers=len(candidates)) as pool:
        futures = [pool.submit(run, i, name, patch) for i, (name, patch) in enumerate(candidates.items())]
        return w, [f.result() for f in futures]


def report(w: Warm, results: list[CandidateResult]) -> str:
    rows = [f"baseline (parent, before any patch): {w.baseline}"]
    for r in results:
        verdict = "PASS" if r.passed else "fail"
        rows.append(
            f"{verdict}  {r.name:<22} {r.clone} (hostname {r.hostname}, crng {r.crng}, "
            f"random draw {r.random_draw}, {r.seconds:.1f} s): {r.summary}"
        )
    winners = [r.name for r in results if r.passed]
    rows.append(f"passing: {', '.join(winners) if winners else 'none'}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="best_of_n", description=__doc__.split("\n", 1)[0])
    p.add_argument("--n", type=int, default=len(demo_repo.CANDIDATES), help="how many candidates (clones)")
    p.add_argument("--keep", action="store_true", help="keep the work directory (snapshot, console logs)")
    ns = p.parse_args(argv)
    names = list(demo_repo.CANDIDATES)[: max(1, ns.n)]
    work = tempfile.mkdtemp(prefix="best-of-n-")
    try:
        w, results = best_of_n({k: demo_repo.CANDIDATES[k] for k in names}, work)
        print(report(w, results))
        return 0 if any(r.passed for r in results) else 1
    finally:
        if ns.keep:
            print(f"work directory: {shlex.quote(work)}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
