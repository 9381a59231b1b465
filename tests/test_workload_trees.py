"""``tree.upload`` resolves symlink targets through the links the archive itself made (issue 29,
defect 8) against a real guestd: a link that leads out of the tree by way of another link, in
either order, through a missing name or a chain, is refused by name and leaves nothing at or
beside the target; links that stay inside, however they chain, are extracted as they are."""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Iterator

import pytest

from guestd.client import Client
from guestd.files.trees import MAX_LINK_HOPS
from guestd.testing import Guestd, workspace_guestd
from guestd.wire.errors import GuestdError


@pytest.fixture(scope="module")
def env() -> Iterator[tuple[Guestd, str]]:
    with workspace_guestd("guestd-links-") as env:
        yield env


@pytest.fixture
def c(env: tuple[Guestd, str]) -> Iterator[Client]:
    with env[0].client() as client:
        yield client


def archive(*members: tuple[str, str | bytes]) -> bytes:
    """A tar of (name, link target) symlinks and (name, bytes) files, in this order."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, what in members:
            info = tarfile.TarInfo(name)
            if isinstance(what, str):
                info.type, info.linkname = tarfile.SYMTYPE, what
                tf.addfile(info)
            else:
                info.size = len(what)
                tf.addfile(info, io.BytesIO(what))
    return buf.getvalue()


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


def test_a_link_out_through_a_link_the_archive_made_is_refused(c: Client, env: tuple[Guestd, str]) -> None:
    """Defect 8's reproduction: was accepted, and esc pointed three levels above the tree."""
    data = archive(("a/b/c/up", "../.."), ("a/b/c/esc", "up/../../../.."))
    err = refused(c, env[1], data, "t1")
    assert err.details == {"entry": "a/b/c/esc", "reason": "link_out"}


def test_the_same_links_in_the_other_order_are_refused_too(c: Client, env: tuple[Guestd, str]) -> None:
    """esc comes first, when up does not exist yet: the check runs once every link is in."""
    data = archive(("a/b/c/esc", "up/../../../.."), ("a/b/c/up", "../.."))
    err = refused(c, env[1], data, "t2")
    assert err.details == {"entry": "a/b/c/esc", "reason": "link_out"}


def test_a_link_out_through_a_missing_name_after_a_link_is_refused(c: Client, env: tuple[Guestd, str]) -> None:
    """up/missing/.. is up while missing is missing, or once the workload makes it: either way
    four levels up from a leaves the tree."""
    data = archive(("a/b/c/up", "../.."), ("a/b/c/esc", "up/missing/../../../.."))
    err = refused(c, env[1], data, "t3")
    assert err.details == {"entry": "a/b/c/esc", "reason": "link_out"}


def test_a_link_out_through_a_link_to_a_link_is_refused(c: Client, env: tuple[Guestd, str]) -> None:
    data = archive(
        ("x/y/z/top", "../../.."),  # the tree's root
        ("x/y/to_top", "z/top"),  # a link to that link
        ("x/y/esc", "to_top/.."),  # the root's parent
    )
    err = refused(c, env[1], data, "t4")
    assert err.details == {"entry": "x/y/esc", "reason": "link_out"}


def test_loops_and_chains_longer_than_the_kernel_follows_are_refused(c: Client, env: tuple[Guestd, str]) -> None:
    err = refused(c, env[1], archive(("p", "q"), ("q", "p")), "loop")
    assert err.details == {"entry": "p", "reason": "link_loop"}
    err = refused(c, env[1], archive(*chain(MAX_LINK_HOPS + 1)), "long")
    assert err.details == {"entry": f"l{MAX_LINK_HOPS}", "reason": "link_loop"}


def test_links_that_stay_inside_are_extracted_however_they_chain(c: Client, env: tuple[Guestd, str]) -> None:
    ws = env[1]
    links = chain(MAX_LINK_HOPS)
    data = archive(
        ("a/b/c/data.txt", b"inside\n"),
        ("a/b/c/up", "../.."),  # a
        ("a/b/c/in", "up/b/c/data.txt"),  # through up, back down
        ("a/b/c/root", "up/.."),  # the tree's root, exactly
        ("a/b/c/dangling", "up/missing/x"),  # missing, but inside wherever it is made
        *links,  # MAX_LINK_HOPS links: as many as the kernel follows
    )
    up = c.upload_tree(data, f"{ws}/inside")
    assert up.entries == 5 + len(links)
    assert open(f"{ws}/inside/a/b/c/in", "rb").read() == b"inside\n"
    assert os.path.realpath(f"{ws}/inside/a/b/c/root") == os.path.realpath(f"{ws}/inside")
    assert open(f"{ws}/inside/l{MAX_LINK_HOPS - 1}", "rb").read() == b"end\n"  # the kernel follows it


def test_a_link_replaced_by_a_later_file_no_longer_counts(c: Client, env: tuple[Guestd, str]) -> None:
    """tar's rule: a later entry of the same name wins. Once up is a file, up/../.. is a/b."""
    ws = env[1]
    data = archive(("a/b/c/up", "../.."), ("a/b/c/up", b"now a file\n"), ("a/b/c/esc", "up/../../../.."))
    c.upload_tree(data, f"{ws}/replaced")
    assert os.readlink(f"{ws}/replaced/a/b/c/esc") == "up/../../../.."
    data = archive(("a/b/c/up", "."), ("a/b/c/up", "../.."), ("a/b/c/esc", "up/../../../.."))
    err = refused(c, ws, data, "relinked")  # and a later link's target is the one checked
    assert err.details == {"entry": "a/b/c/esc", "reason": "link_out"}


def test_a_link_target_too_long_for_the_kernel_is_refused_by_name(c: Client, env: tuple[Guestd, str]) -> None:
    err = refused(c, env[1], archive(("ok", "x"), ("long", "a/" * 2048)), "long-target")
    assert err.details == {"entry": "long", "reason": "link_long"}
