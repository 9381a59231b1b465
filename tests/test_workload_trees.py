"""``tree.upload`` resolves symlink targets through the links the archive itself made (issue 29,
defect 8) against a real guestd: a link that leads out of the tree by way of another link, in
either order, through a missing name or a chain, is refused by name and leaves nothing at or
beside the target; links that stay inside, however they chain, are extracted as they are."""

from __future__ import annotations

import os

import pytest

from guestd.client import Client
from guestd.files.tarlinks import MAX_LINK_HOPS
from guestd.testing import Guestd
from guestd.wire.errors import GuestdError
from tests.helpers import tar_of


def chain(length: int) -> list[tuple[str, str | bytes]]:
    """A file and ``length`` links to it, each through the one before: l0 -> file, l1 -> l0..."""
    links: list[tuple[str, str | bytes]] = [("file", b"end\n"), ("l0", "file")]
    return links + [(f"l{i}", f"l{i - 1}") for i in range(1, length)]


def refused(c: Client, ws: str, data: bytes, target: str) -> GuestdError:
    before = sorted(os.listdir(ws))
    with pytest.raises(GuestdError) as err:
        c.upload_tree(data, f"{ws}/{target}")
    assert err.value.code == "bad_request"
    assert sorted(os.listdir(ws)) == before  # nothing at the target, no temp directory beside it
    return err.value


def test_a_link_out_through_a_link_the_archive_made_is_refused(
    workspace_client: Client, workspace_env: tuple[Guestd, str]
) -> None:
    """Defect 8's reproduction: was accepted, and esc pointed three levels above the tree."""
    data = tar_of(("a/b/c/up", "../.."), ("a/b/c/esc", "up/../../../.."))
    err = refused(workspace_client, workspace_env[1], data, "t1")
    assert err.details == {"entry": "a/b/c/esc", "reason": "link_out"}


def test_the_same_links_in_the_other_order_are_refused_too(
    workspace_client: Client, workspace_env: tuple[Guestd, str]
) -> None:
    """esc comes first, when up does not exist yet: the check runs once every link is in."""
    data = tar_of(("a/b/c/esc", "up/../../../.."), ("a/b/c/up", "../.."))
    err = refused(workspace_client, workspace_env[1], data, "t2")
    assert err.details == {"entry": "a/b/c/esc", "reason": "link_out"}


def test_a_link_out_through_a_missing_name_after_a_link_is_refused(
    workspace_client: Client, workspace_env: tuple[Guestd, str]
) -> None:
    """up/missing/.. is up while missing is missing, or once the workload makes it: either way
    four levels up from a leaves the tree."""
    data = tar_of(("a/b/c/up", "../.."), ("a/b/c/esc", "up/missing/../../../.."))
    err = refused(workspace_client, workspace_env[1], data, "t3")
    assert err.details == {"entry": "a/b/c/esc", "reason": "link_out"}


def test_a_link_out_through_a_link_to_a_link_is_refused(
    workspace_client: Client, workspace_env: tuple[Guestd, str]
) -> None:
    data = tar_of(
        ("x/y/z/top", "../../.."),  # the tree's root
        ("x/y/to_top", "z/top"),  # a link to that link
        ("x/y/esc", "to_top/.."),  # the root's parent
    )
    err = refused(workspace_client, workspace_env[1], data, "t4")
    assert err.details == {"entry": "x/y/esc", "reason": "link_out"}


def test_loops_and_chains_longer_than_the_kernel_follows_are_refused(
    workspace_client: Client, workspace_env: tuple[Guestd, str]
) -> None:
    err = refused(workspace_client, workspace_env[1], tar_of(("p", "q"), ("q", "p")), "loop")
    assert err.details == {"entry": "p", "reason": "link_loop"}
    err = refused(workspace_client, workspace_env[1], tar_of(*chain(MAX_LINK_HOPS + 1)), "long")
    assert err.details == {"entry": f"l{MAX_LINK_HOPS}", "reason": "link_loop"}


def test_links_that_stay_inside_are_extracted_however_they_chain(
    workspace_client: Client, workspace_env: tuple[Guestd, str]
) -> None:
    ws = workspace_env[1]
    links = chain(MAX_LINK_HOPS)
    data = tar_of(
        ("a/b/c/data.txt", b"inside\n"),
        ("a/b/c/up", "../.."),  # a
        ("a/b/c/in", "up/b/c/data.txt"),  # through up, back down
        ("a/b/c/root", "up/.."),  # the tree's root, exactly
        ("a/b/c/dangling", "up/missing/x"),  # missing, but inside wherever it is made
        *links,  # MAX_LINK_HOPS links: as many as the kernel follows
    )
    up = workspace_client.upload_tree(data, f"{ws}/inside")
    assert up.entries == 5 + len(links)
    assert open(f"{ws}/inside/a/b/c/in", "rb").read() == b"inside\n"
    assert os.path.realpath(f"{ws}/inside/a/b/c/root") == os.path.realpath(f"{ws}/inside")
    assert open(f"{ws}/inside/l{MAX_LINK_HOPS - 1}", "rb").read() == b"end\n"  # the kernel follows it


def test_a_link_replaced_by_a_later_file_no_longer_counts(
    workspace_client: Client, workspace_env: tuple[Guestd, str]
) -> None:
    """tar's rule: a later entry of the same name wins. Once up is a file, up/../.. is a/b."""
    ws = workspace_env[1]
    data = tar_of(("a/b/c/up", "../.."), ("a/b/c/up", b"now a file\n"), ("a/b/c/esc", "up/../../../.."))
    workspace_client.upload_tree(data, f"{ws}/replaced")
    assert os.readlink(f"{ws}/replaced/a/b/c/esc") == "up/../../../.."
    data = tar_of(("a/b/c/up", "."), ("a/b/c/up", "../.."), ("a/b/c/esc", "up/../../../.."))
    err = refused(workspace_client, ws, data, "relinked")  # and a later link's target is the one checked
    assert err.details == {"entry": "a/b/c/esc", "reason": "link_out"}


def test_a_link_target_too_long_for_the_kernel_is_refused_by_name(
    workspace_client: Client, workspace_env: tuple[Guestd, str]
) -> None:
    err = refused(workspace_client, workspace_env[1], tar_of(("ok", "x"), ("long", "a/" * 2048)), "long-target")
    assert err.details == {"entry": "long", "reason": "link_long"}
