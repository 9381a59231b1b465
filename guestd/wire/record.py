"""A small immutable-by-contract record type, cheap to declare on guestd's start path.

A NamedTuple class costs ~0.1-0.15 ms to declare (a tuple class built per record) and a frozen
dataclass ~1 ms (its methods are compiled from source at import); a plain class with
``__slots__`` costs ~0.01 ms, and its ``__init__`` is a plain one instead of a frozen
dataclass's ``object.__setattr__`` per field (start to first reply). A record
subclass lists its fields in ``__slots__``, assigns them in ``__init__`` and annotates them
``Final`` so mypy keeps them unchanged; it gets equality, hash and repr over those fields, as
a NamedTuple or frozen dataclass has (no tuple behaviour: none of guestd's records is unpacked
or indexed).
"""

from __future__ import annotations

from typing import Any


class Record:
    __slots__: tuple[str, ...] = ()

    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self.__slots__)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        assert isinstance(other, Record)
        return self._values() == other._values()

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        inner = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__)
        return f"{type(self).__qualname__}({inner})"
