"""``file.apply_patch`` is all or nothing (issue 29, defect 7) against a real guestd: a patch that
names a file twice is merged in order or refused before anything is written, errors name the
file as the patch does, a commit step that fails puts back every file it already changed, and
hunk placement on workload-shaped files stays within its scan budget."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess

import pytest

from guestd.client import Client
from guestd.client.replies import PatchedFile
from guestd.files.patch import MAX_PLACEMENT_SCAN
from guestd.wire.errors import GuestdError
from tests.helpers import read, write


def tree(root: str) -> dict[str, tuple[str, bytes | None, int]]:
    """Every entry below ``root``: kind, content (files) and inode."""
    out: dict[str, tuple[str, bytes | None, int]] = {}
    for d, dirs, files in os.walk(root):
        for name in dirs:
            p = os.path.join(d, name)
            out[os.path.relpath(p, root)] = ("dir", None, os.lstat(p).st_ino)
        for name in files:
            p = os.path.join(d, name)
            out[os.path.relpath(p, root)] = ("file", read(p), os.lstat(p).st_ino)
    return out


def delete(name: str, old: bytes) -> bytes:
    lines = old.splitlines(keepends=True)
    return f"--- a/{name}\n+++ /dev/null\n@@ -1,{len(lines)} +0,0 @@\n".encode() + b"".join(b"-" + x for x in lines)


def create(name: str, new: bytes) -> bytes:
    lines = new.splitlines(keepends=True)
    return f"--- /dev/null\n+++ b/{name}\n@@ -0,0 +1,{len(lines)} @@\n".encode() + b"".join(b"+" + x for x in lines)


def modify(name: str, line: int, old: bytes, new: bytes) -> bytes:
    return f"--- a/{name}\n+++ b/{name}\n@@ -{line} +{line} @@\n".encode() + b"-" + old + b"+" + new


# --------------------------------------------------------------------------- a file named twice


def test_a_patch_that_deletes_one_file_twice_is_refused_naming_it_and_changes_nothing(
    workspace_client: Client, workspace_dir: str
) -> None:
    """Defect 7's reproduction: was ``not_found`` "b'b.txt'" with a.txt and b.txt already gone."""
    write(f"{workspace_dir}/a.txt", b"a\n")
    write(f"{workspace_dir}/b.txt", b"b\n")
    before = tree(workspace_dir)
    with pytest.raises(GuestdError) as err:
        workspace_client.apply_patch(
            workspace_dir, delete("a.txt", b"a\n") + delete("b.txt", b"b\n") + delete("b.txt", b"b\n")
        )
    assert err.value.code == "bad_request"
    assert err.value.details["path"] == "b.txt" and "b.txt" in err.value.message
    assert tree(workspace_dir) == before


def test_a_patch_that_creates_one_file_twice_is_refused_naming_it_and_creates_nothing(
    workspace_client: Client, workspace_dir: str
) -> None:
    """Defect 7's reproduction: was ``exists`` naming /proc/self/fd/N with n1.txt and n2.txt made."""
    with pytest.raises(GuestdError) as err:
        workspace_client.apply_patch(
            workspace_dir, create("n1.txt", b"n\n") + create("n2.txt", b"n\n") + create("n2.txt", b"m\n")
        )
    assert err.value.code == "bad_request"
    assert err.value.details["path"] == "n2.txt" and "n2.txt" in err.value.message
    assert "/proc/" not in err.value.message
    assert os.listdir(workspace_dir) == []


def test_two_sections_for_one_file_apply_in_order_and_report_once(workspace_client: Client, workspace_dir: str) -> None:
    """Defect 7's reproduction: both sections reported "modify" and the first change was lost.
    The second section is written against the result of the first (its context is "one")."""
    write(f"{workspace_dir}/m.txt", b"1\n2\n3\n")
    second = b"--- a/m.txt\n+++ b/m.txt\n@@ -1,3 +1,3 @@\n one\n 2\n-3\n+three\n"
    files = workspace_client.apply_patch(workspace_dir, modify("m.txt", 1, b"1\n", b"one\n") + second)
    assert files == [PatchedFile(path="m.txt", action="modify", hunks=2)]
    assert read(f"{workspace_dir}/m.txt") == b"one\n2\nthree\n"


def test_delete_then_create_of_one_file_replaces_it_and_a_change_after_deletion_is_refused(
    workspace_client: Client, workspace_dir: str
) -> None:
    write(f"{workspace_dir}/r.txt", b"old\n")
    files = workspace_client.apply_patch(workspace_dir, delete("r.txt", b"old\n") + create("r.txt", b"new\n"))
    assert files == [PatchedFile(path="r.txt", action="modify", hunks=2)]
    assert read(f"{workspace_dir}/r.txt") == b"new\n"
    with pytest.raises(GuestdError) as err:
        workspace_client.apply_patch(workspace_dir, delete("r.txt", b"new\n") + modify("r.txt", 1, b"new\n", b"x\n"))
    assert err.value.code == "bad_request" and err.value.details["path"] == "r.txt"
    assert read(f"{workspace_dir}/r.txt") == b"new\n"


def test_two_names_for_one_file_through_a_symlinked_directory_are_refused(
    workspace_client: Client, workspace_dir: str
) -> None:
    os.makedirs(f"{workspace_dir}/real")
    os.symlink("real", f"{workspace_dir}/alias")
    write(f"{workspace_dir}/real/f.txt", b"1\n")
    with pytest.raises(GuestdError) as err:
        workspace_client.apply_patch(
            workspace_dir, modify("real/f.txt", 1, b"1\n", b"2\n") + modify("alias/f.txt", 1, b"2\n", b"3\n")
        )
    assert err.value.code == "bad_request" and err.value.details["path"] == "alias/f.txt"
    assert read(f"{workspace_dir}/real/f.txt") == b"1\n"


def test_a_file_that_exists_is_named_as_the_patch_names_it(workspace_client: Client, workspace_dir: str) -> None:
    write(f"{workspace_dir}/a.txt", b"a\n")
    write(f"{workspace_dir}/there.txt", b"x\n")
    with pytest.raises(GuestdError) as err:
        workspace_client.apply_patch(workspace_dir, modify("a.txt", 1, b"a\n", b"A\n") + create("there.txt", b"y\n"))
    assert err.value.code == "exists" and err.value.details["path"] == "there.txt"
    assert "/proc/" not in err.value.message and "there.txt" in err.value.message
    assert read(f"{workspace_dir}/a.txt") == b"a\n"
    with pytest.raises(GuestdError) as missing:
        workspace_client.apply_patch(workspace_dir, modify("nope/gone.txt", 1, b"a\n", b"A\n"))
    assert missing.value.code == "not_found" and missing.value.details["path"] == "nope/gone.txt"


def test_a_failed_hunk_after_a_new_file_in_new_directories_leaves_no_directory(
    workspace_client: Client, workspace_dir: str
) -> None:
    write(f"{workspace_dir}/f.txt", b"keep\n")
    with pytest.raises(GuestdError) as err:
        workspace_client.apply_patch(
            workspace_dir, create("new/deeper/x.py", b"x\n") + modify("f.txt", 1, b"other\n", b"y\n")
        )
    assert err.value.code == "conflict"
    assert sorted(os.listdir(workspace_dir)) == ["f.txt"]


# --------------------------------------------------------------------------- rollback


def _chattr(flag: str, path: str) -> None:
    done = subprocess.run(["chattr", flag, path], capture_output=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"chattr {flag} is not possible here: {done.stderr.decode().strip()}")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("chattr") is None, reason="chattr needs root")
@pytest.mark.parametrize("failing", ["modify", "delete"])
def test_a_commit_step_that_fails_puts_back_every_file_already_committed(
    workspace_client: Client, workspace_dir: str, failing: str
) -> None:
    """The last step fails at commit time (an immutable file can be read, and its new content
    staged beside it, but it cannot be exchanged or renamed away): the modification, creation
    (in new directories) and deletion committed before it are undone; the same inodes are back
    at the same names, the new directories are gone and no temp file is left."""
    write(f"{workspace_dir}/a.txt", b"a1\na2\n")
    write(f"{workspace_dir}/gone.txt", b"bye\n")
    write(f"{workspace_dir}/locked.txt", b"l\n")
    last = modify("locked.txt", 1, b"l\n", b"L\n") if failing == "modify" else delete("locked.txt", b"l\n")
    patch = modify("a.txt", 2, b"a2\n", b"A2\n") + create("src/pkg/new.py", b"new\n") + delete("gone.txt", b"bye\n")
    before = tree(workspace_dir)
    _chattr("+i", f"{workspace_dir}/locked.txt")
    try:
        with pytest.raises(GuestdError) as err:
            workspace_client.apply_patch(workspace_dir, patch + last)
    finally:
        subprocess.run(["chattr", "-i", f"{workspace_dir}/locked.txt"], check=False)
    assert err.value.code == "permission_denied"
    assert err.value.details["path"] == "locked.txt" and "locked.txt" in err.value.message
    assert "not_restored" not in err.value.details
    assert tree(workspace_dir) == before  # contents, inodes, no src/, no temp file


def test_a_failed_patch_leaves_nothing_even_in_a_new_directory_of_the_workspace_root(
    workspace_client: Client, workspace_dir: str
) -> None:
    """The directories made for a new file go with the patch (here the whole chain)."""
    with pytest.raises(GuestdError):
        workspace_client.apply_patch(
            workspace_dir, create("d1/d2/d3/x", b"x\n") + create("d1/y", b"y\n") + modify("missing", 1, b"a\n", b"b\n")
        )
    assert os.listdir(workspace_dir) == []


# --------------------------------------------------------------------------- workload-shaped input


def test_many_hunks_that_miss_their_line_stop_at_the_scan_budget_and_change_nothing(
    workspace_client: Client, workspace_dir: str
) -> None:
    """Each hunk states a wrong line and its old text is nowhere, so each searches the rest of
    a 4 MiB file: 2,000 of them would look at 8 GiB; the budget stops the search (hunks then
    fail with reason ``search_budget``) and the reply says which."""
    big = b"x\n" * (2 << 20)
    write(f"{workspace_dir}/big.txt", big)
    hunks = b"".join(b"@@ -%d +%d @@\n-absent %d\n+y\n" % (i + 1, i + 1, i) for i in range(2000))
    with pytest.raises(GuestdError) as err:
        workspace_client.apply_patch(workspace_dir, b"--- a/big.txt\n+++ b/big.txt\n" + hunks)
    assert err.value.code == "conflict"
    reasons = [h["reason"] for h in err.value.details["hunks"]]
    assert len(reasons) == 100 and "2000 hunk(s)" in err.value.message
    searched = reasons.count("context_mismatch")
    assert 0 < searched <= MAX_PLACEMENT_SCAN // len(big) + 1
    assert reasons[searched:] == ["search_budget"] * (100 - searched)
    assert read(f"{workspace_dir}/big.txt") == big


def test_a_hunk_header_with_a_huge_number_and_a_malformed_one_are_bad_requests(
    workspace_client: Client, workspace_dir: str
) -> None:
    write(f"{workspace_dir}/a.txt", b"a\n")
    for header in (b"@@ -" + b"9" * 5000 + b" +1 @@\n", b"@@ -1 +1\n", b"@@ -x +1 @@\n"):
        with pytest.raises(GuestdError) as err:
            workspace_client.apply_patch(workspace_dir, b"--- a/a.txt\n+++ b/a.txt\n" + header + b"-a\n+b\n")
        assert err.value.code == "bad_request", header[:20]
    assert read(f"{workspace_dir}/a.txt") == b"a\n"


def test_a_three_mib_patch_of_tiny_lines_and_a_file_of_newlines_apply_exactly(
    workspace_client: Client, workspace_dir: str
) -> None:
    """Linear parse and placement on the shapes that make per-line work the most: 1.5 M lines
    in the patch, 1 M empty lines in the file, hunks at the far end located by counting."""
    lines = 1_500_000
    with contextlib.suppress(FileNotFoundError):
        os.unlink(f"{workspace_dir}/made.txt")
    files = workspace_client.apply_patch(workspace_dir, create("made.txt", b"\n" * lines))
    assert files == [PatchedFile(path="made.txt", action="create", hunks=1)]
    assert read(f"{workspace_dir}/made.txt") == b"\n" * lines
    write(f"{workspace_dir}/nl.txt", b"\n" * 1_000_000 + b"end\n")
    patch = b"--- a/nl.txt\n+++ b/nl.txt\n@@ -999999,3 +999999,3 @@\n \n \n-end\n+END\n"
    workspace_client.apply_patch(workspace_dir, patch)
    assert read(f"{workspace_dir}/nl.txt") == b"\n" * 1_000_000 + b"END\n"
