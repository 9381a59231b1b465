"""Guest paths on guestctl's command line: ``:PATH`` where both sides can be meant (``cp``), and
the colon optional where only the guest's side makes sense (``ls``, ``cat``, ``rm``, ``view``...)."""

from __future__ import annotations


def guest_only(arg: str) -> str:
    """The guest path of an argument of a command that takes only guest paths: ``:PATH`` or
    ``PATH`` alike; empty (``:`` or nothing) is ``.``, the workspace (guestd's working directory,
    where relative paths start)."""
    path = arg[1:] if arg.startswith(":") else arg
    return path or "."
