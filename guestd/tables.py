"""A bounded table of live things a client names (code contexts, shell sessions), by id or name.

Both capabilities keep one with the same rules: an item is found by its id, else by its name;
the table holds at most a configured number; an item counts from the moment its start begins
(so concurrent creates cannot pass the limit) and leaves again if that start fails.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from guestd.wire.errors import ErrorCode, GuestdError, limit_error

if TYPE_CHECKING:
    from guestd.services import Services


class Named(Protocol):
    @property
    def id(self) -> str: ...

    @property
    def name(self) -> str | None: ...


Item = TypeVar("Item", bound=Named)


class NamedTable(Generic[Item]):
    """Items by id (the table's, random) and by name (the client's, optional). A client may
    name an item by either, so a lookup tries the id first, then the name."""

    what: str  # an item in messages: "code context"
    field: str  # the error details key that names one: "context"
    limit: str  # the Limits field that bounds the table, as LIMIT errors name it: "max_contexts"

    def __init__(self, services: Services) -> None:
        self.services = services
        self.by_id: dict[str, Item] = {}

    def find(self, ref: str) -> Item:
        """The item with the id ``ref``, else the one named ``ref``; NOT_FOUND when there is none."""
        item = self.by_id.get(ref)
        if item is None:
            item = self.named(ref)
        if item is None:
            raise GuestdError(ErrorCode.NOT_FOUND, f"no {self.what} {ref!r}", details={self.field: ref})
        return item

    def named(self, name: str) -> Item | None:
        for item in self.by_id.values():
            if item.name == name:
                return item
        return None

    def check_room(self) -> None:
        """LIMIT when the table is full (its ``limit`` in guestd's configured limits)."""
        most: int = getattr(self.services.config.limits, self.limit)
        if len(self.by_id) >= most:
            raise limit_error(self.limit, most, f"at most {most} {self.what}s")

    @contextmanager
    def reserved(self, item: Item) -> Iterator[None]:
        """``item`` is in the table while the block starts it, so that concurrent creates count
        it against the limit; it leaves the table when its start fails or is cancelled."""
        self.by_id[item.id] = item
        try:
            yield
        except BaseException:
            self.by_id.pop(item.id, None)
            raise

    def remove(self, ref: str) -> Item:
        """Take the item ``ref`` names out of the table (NOT_FOUND when there is none)."""
        item = self.find(ref)
        del self.by_id[item.id]
        return item
