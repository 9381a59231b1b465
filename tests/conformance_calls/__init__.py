"""Client drivers for the conformance transcripts (protocol/conformance/transcripts/).

Each module here has ``CALLS: dict[str, ClientCall]`` keyed by transcript stem: the driver
makes guestd's own :class:`~guestd.client.AsyncClient` produce that transcript's client
frames against run.py's fake server (tests/test_conformance.py, client mode). A driver
returns what the call returned; when the transcript's final frame is an error, the call
raises guestd's typed error and the driver lets it propagate.

The client is already connected with the hello options of the transcript's client hello
(max_frame, stream_window, token); ``CallContext.tmp`` is what ``${TMP}`` stands for.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from guestd.client import AsyncClient


@dataclass
class CallContext:
    tmp: str  # the directory ${TMP} names in the transcript


ClientCall = Callable[[AsyncClient, CallContext], Awaitable[object]]


def load_calls() -> dict[str, ClientCall]:
    """Every module's CALLS merged; a transcript with drivers in two modules is an error."""
    merged: dict[str, ClientCall] = {}
    owner: dict[str, str] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        calls: dict[str, ClientCall] = getattr(module, "CALLS", {})
        for stem, call in calls.items():
            if stem in merged:
                raise ValueError(f"transcript {stem!r} has a driver in {owner[stem]} and in {info.name}")
            merged[stem] = call
            owner[stem] = info.name
    return merged
