"""Editor ops and apply_patch (issue 18) against a real guestd: exact bytes, owner and mode kept,
typed conflicts, undo byte for byte, all-or-nothing patches, and the file-system layer's
guarantees (a planted symlink or FIFO is refused, never followed or opened)."""

from __future__ import annotations

import os
import stat
import subprocess
import tempfile

import pytest

from guestd.client import Client
from guestd.wire.errors import GuestdError
from tests.helpers import read, write

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="ownership and a workload user need root")


def test_view_numbers_lines_and_ranges(workspace_client: Client, workspace_dir: str) -> None:
    write(f"{workspace_dir}/a.txt", b"".join(b"line %d\n" % i for i in range(1, 11)))
    v = workspace_client.view(f"{workspace_dir}/a.txt", start_line=3, end_line=4)
    assert v.content == "     3\tline 3\n     4\tline 4\n"
    assert (v.kind, v.start_line, v.end_line, v.total_lines, v.truncated) == ("file", 3, 4, 10, False)
    os.makedirs(f"{workspace_dir}/d/e/f")
    write(f"{workspace_dir}/d/x.py", b"")
    write(f"{workspace_dir}/.hidden", b"")
    listing = workspace_client.view(workspace_dir).content.splitlines()
    assert listing == ["a.txt", "d/", "d/e/", "d/x.py"]  # two levels, hidden left out, d/e/f not shown


def test_str_replace_with_zero_one_and_two_matches(workspace_client: Client, workspace_dir: str) -> None:
    path = f"{workspace_dir}/m.py"
    original = b"a = 1\nb = 2\na = 1\n"
    write(path, original)
    os.chmod(path, 0o640)
    with pytest.raises(GuestdError) as none:
        workspace_client.str_replace(path, "zzz", "y")
    assert none.value.code == "conflict" and none.value.details["matches"] == 0
    assert none.value.details["reason"] == "no_match"
    with pytest.raises(GuestdError) as two:
        workspace_client.str_replace(path, "a = 1", "a = 9")
    assert two.value.code == "conflict"
    assert (two.value.details["matches"], two.value.details["lines"]) == (2, [1, 3])
    assert read(path) == original  # refused edits change nothing
    r = workspace_client.str_replace(path, "b = 2", "b = 3\nc = 4")
    assert read(path) == b"a = 1\nb = 3\nc = 4\na = 1\n"
    assert "     2\tb = 3\n     3\tc = 4\n" in r.snippet and r.start_line == 1 and r.undo_depth == 1
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640  # mode kept by the atomic replace


def test_insert_replace_lines_and_undo_restore_bytes_exactly(workspace_client: Client, workspace_dir: str) -> None:
    path = f"{workspace_dir}/u.txt"
    original = b"one\ntwo\r\nthree\xff\nfour"  # CRLF, a byte that is not UTF-8, no final newline
    write(path, original)
    workspace_client.insert(path, 0, "zero")
    workspace_client.insert(path, 2, "one-and-a-half\n")
    workspace_client.replace_lines(path, 6, 6, "FOUR")
    assert read(path) == b"zero\none\none-and-a-half\ntwo\r\nthree\xff\nFOUR"
    workspace_client.str_replace(path, "FOUR", "")
    for left in (3, 2, 1, 0):
        assert workspace_client.undo(path).undo_depth == left
    assert read(path) == original
    with pytest.raises(GuestdError) as none:
        workspace_client.undo(path)
    assert none.value.details["reason"] == "no_history"


def test_undo_refuses_to_revert_someone_elses_change(workspace_client: Client, workspace_dir: str) -> None:
    path = f"{workspace_dir}/s.txt"
    write(path, b"x = 1\n")
    workspace_client.str_replace(path, "x = 1", "x = 2")
    write(path, b"x = 2\ny = 7\n")  # the workload changed the file after the edit
    with pytest.raises(GuestdError) as changed:
        workspace_client.undo(path)
    assert changed.value.details["reason"] == "changed_since"
    assert read(path) == b"x = 2\ny = 7\n"


@root_only
def test_edits_keep_the_owner_and_never_follow_a_planted_symlink_or_open_a_fifo(
    workspace_client: Client, workspace_dir: str
) -> None:
    path = f"{workspace_dir}/owned.txt"
    write(path, b"v = 1\n")
    os.chown(path, 65534, 65534)
    workspace_client.str_replace(path, "v = 1", "v = 2")
    assert (os.stat(path).st_uid, os.stat(path).st_gid) == (65534, 65534)
    outside = tempfile.NamedTemporaryFile(delete=False)
    outside.write(b"secret = 1\n")
    outside.close()
    os.symlink(outside.name, f"{workspace_dir}/link.txt")
    with pytest.raises(GuestdError) as link:
        workspace_client.str_replace(f"{workspace_dir}/link.txt", "secret = 1", "secret = 2")
    assert link.value.code == "bad_request" and link.value.errno == 40  # ELOOP: refused, not followed
    assert read(outside.name) == b"secret = 1\n"
    os.unlink(outside.name)
    os.mkfifo(f"{workspace_dir}/fifo")
    with pytest.raises(GuestdError) as fifo:
        workspace_client.insert(f"{workspace_dir}/fifo", 0, "x")  # answered at once: a FIFO is never opened
    assert fifo.value.code == "not_a_file"


def make_patch(tmp: str, before: dict[str, bytes], after: dict[str, bytes]) -> bytes:
    for side, files in (("a", before), ("b", after)):
        os.makedirs(f"{tmp}/{side}")
        for name, data in files.items():
            os.makedirs(os.path.dirname(f"{tmp}/{side}/{name}"), exist_ok=True)
            write(f"{tmp}/{side}/{name}", data)
    return subprocess.run(["diff", "-ruN", "a", "b"], cwd=tmp, capture_output=True, check=False).stdout


def test_apply_patch_across_files_matches_patch_1(workspace_client: Client, workspace_dir: str, tmp_path: str) -> None:
    big = b"".join(b"line %d\n" % i for i in range(1, 60))
    before = {"f.txt": big, "src/g.py": b"alpha\nbeta", "gone.txt": b"bye\n"}
    after = {
        "f.txt": big.replace(b"line 3\n", b"line three\n").replace(b"line 50\n", b"line 50\nextra\n"),
        "src/g.py": b"alpha\nBETA",
        "src/new.py": b"new\n",
    }
    diff = make_patch(str(tmp_path), before, after)
    for name, data in before.items():
        os.makedirs(os.path.dirname(f"{workspace_dir}/{name}"), exist_ok=True)
        write(f"{workspace_dir}/{name}", data)
    files = workspace_client.apply_patch(workspace_dir, diff)
    assert {f.path: f.action for f in files} == {
        "f.txt": "modify",
        "src/g.py": "modify",
        "gone.txt": "delete",
        "src/new.py": "create",
    }
    for name, data in after.items():
        assert read(f"{workspace_dir}/{name}") == data, name
    assert not os.path.exists(f"{workspace_dir}/gone.txt")


def test_apply_patch_with_one_failing_hunk_changes_nothing(
    workspace_client: Client, workspace_dir: str, tmp_path: str
) -> None:
    big = b"".join(b"line %d\n" % i for i in range(1, 60))
    before = {"f.txt": big, "g.txt": b"keep\n"}
    after = {"f.txt": big.replace(b"line 3\n", b"3\n").replace(b"line 40\n", b"40\n"), "g.txt": b"changed\n"}
    diff = make_patch(str(tmp_path), before, after)
    drifted = big.replace(b"line 40\n", b"line forty\n")  # the second hunk's context is gone
    write(f"{workspace_dir}/f.txt", drifted)
    write(f"{workspace_dir}/g.txt", b"keep\n")
    with pytest.raises(GuestdError) as err:
        workspace_client.apply_patch(workspace_dir, diff)
    assert err.value.code == "conflict"
    assert err.value.details["hunks"] == [{"path": "f.txt", "hunk": 2, "line": 37, "reason": "context_mismatch"}]
    assert read(f"{workspace_dir}/f.txt") == drifted and read(f"{workspace_dir}/g.txt") == b"keep\n"  # nothing applied
    assert sorted(os.listdir(workspace_dir)) == ["f.txt", "g.txt"]  # and no temp file left


def test_apply_patch_refuses_names_out_of_its_directory(workspace_client: Client, workspace_dir: str) -> None:
    evil = b"--- a/../x\n+++ b/../x\n@@ -0,0 +1 @@\n+pwned\n"
    with pytest.raises(GuestdError) as err:
        workspace_client.apply_patch(workspace_dir, evil)
    assert err.value.code == "bad_request"
    assert not os.path.exists(os.path.join(os.path.dirname(workspace_dir), "x"))
