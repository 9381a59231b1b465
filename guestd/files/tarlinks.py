"""What an uploaded tar entry may name: its name stays below the tree (no absolute name, no
``..``), and a symlink's target stays in the tree both read as text and resolved through the
links the archive itself made (:class:`Links`, checked once every entry is in).
"""

from __future__ import annotations

from guestd.wire.errors import ErrorCode, GuestdError

MAX_LINK_HOPS = 40  # links followed in one resolution, as the kernel's MAXSYMLINKS


def refused(entry: str, reason: str, what: str) -> GuestdError:
    return GuestdError(
        ErrorCode.BAD_REQUEST,
        f"tar entry {entry!r} refused: {what}",
        details={"entry": entry, "reason": reason},
    )


def entry_parts(name: str) -> list[str]:
    """An entry's name as components, or refused (absolute, ``..``)."""
    if name.startswith("/"):
        raise refused(name, "absolute", "absolute name")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise refused(name, "dotdot", "'..' in the name")
    return parts


def link_stays_inside(parts: list[str], target: str) -> bool:
    if not target or target.startswith("/"):
        return False
    where = list(parts[:-1])
    for comp in target.split("/"):
        if comp in ("", "."):
            continue
        if comp == "..":
            if not where:
                return False
            where.pop()
        else:
            where.append(comp)
    return True


class _LinkNode:
    """A name on the path of a link the archive made (the link itself, or a directory above)."""

    __slots__ = ("children", "name", "parent", "resolved", "target")

    def __init__(self, parent: _LinkNode | None, name: str) -> None:
        self.parent = parent
        self.name = name
        self.children: dict[str, _LinkNode] | None = None
        self.target: str | None = None  # set while a link of the archive is at this name
        self.resolved: tuple[_LinkNode, int, int] | None = None  # see Links._resolve


class _LeavesTree(Exception):
    pass


class _TooManyLinks(Exception):
    pass


class Links:
    """The symlinks an archive made, as a trie of their paths, to check at the end that every
    link's target, followed through the others, stays in the tree.

    Resolution is lexical over the trie: ``..`` goes to the parent (above the root: out), a
    name that is a link of the archive is followed (at most MAX_LINK_HOPS in one resolution),
    and any other name counts as a directory, whether it exists or not (a link that leaves
    the tree once the workload makes a missing directory is refused now). Each link is
    resolved once and remembered, so the check is linear in the bytes of the link targets."""

    def __init__(self) -> None:
        self.root = _LinkNode(None, "")
        self.order: list[_LinkNode] = []  # the links in archive order (one node per name)

    def add(self, parts: list[str], target: str) -> int:
        """A link at ``parts``; returns how many names the trie grew by."""
        node, grew = self.root, 0
        for name in parts:
            if node.children is None:
                node.children = {}
            child = node.children.get(name)
            if child is None:
                child = node.children[name] = _LinkNode(node, name)
                grew += 1
            node = child
        if node.target is None:
            self.order.append(node)
        node.target = target
        return grew

    def remove(self, parts: list[str]) -> None:
        """The link at ``parts`` was replaced by a file."""
        node: _LinkNode | None = self.root
        for name in parts:
            node = node.children.get(name) if node is not None and node.children else None
        if node is not None:
            node.target = None

    def check(self) -> None:
        """Refuse the first link (in archive order) that leads out or loops."""
        for node in self.order:
            if node.target is None:
                continue
            try:
                self._resolve(node, 0)
            except _LeavesTree:
                raise refused(
                    self._entry(node), "link_out", f"symlink to {node.target!r} leads out of the tree"
                ) from None
            except _TooManyLinks:
                raise refused(
                    self._entry(node),
                    "link_loop",
                    f"symlink to {node.target!r} goes through more than {MAX_LINK_HOPS} links or loops",
                ) from None

    @staticmethod
    def _entry(node: _LinkNode) -> str:
        names: list[str] = []
        at: _LinkNode | None = node
        while at is not None and at.parent is not None:
            names.append(at.name)
            at = at.parent
        return "/".join(reversed(names))

    def _resolve(self, link: _LinkNode, depth: int) -> tuple[_LinkNode, int, int]:
        """Where ``link``'s target leads: (the trie node reached, names below it that hold no
        link, links followed to get there, itself included, as the kernel counts them)."""
        if link.resolved is not None:
            if link.resolved[0] is link:  # being resolved: a loop
                raise _TooManyLinks
            return link.resolved
        assert link.target is not None and link.parent is not None
        link.resolved = (link, 0, 0)
        where, below, hops = link.parent, 0, 1
        for name in link.target.split("/"):
            if name in ("", "."):
                continue
            if name == "..":
                if below:
                    below -= 1
                elif where.parent is None:
                    raise _LeavesTree
                else:
                    where = where.parent
                continue
            child = where.children.get(name) if not below and where.children else None
            if child is None:
                below += 1
            elif child.target is None:
                where = child
            else:
                if depth >= MAX_LINK_HOPS:
                    raise _TooManyLinks
                where, below, used = self._resolve(child, depth + 1)
                hops += used
                if hops > MAX_LINK_HOPS:
                    raise _TooManyLinks
        link.resolved = (where, below, hops)
        return link.resolved
