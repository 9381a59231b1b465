"""Host-side client for guestd: asyncio (:class:`AsyncClient`) and blocking (:class:`Client`)."""

from guestd.client.address import ConnectError
from guestd.client.aio import AsyncClient, Connecting, ExecStream
from guestd.client.connection import ConnectionClosed, GuestProtocolError
from guestd.client.ports import Listener, PortForward, PortList, PortWait, PortWatch, ReverseForward
from guestd.client.ports_sync import PortForwarder, ReverseForwarder
from guestd.client.results import (
    CodeError,
    CodeResult,
    DirEntry,
    DirListing,
    ExecResult,
    FileStat,
    Info,
    ShellResult,
)
from guestd.client.streaming import DERIVED
from guestd.client.sync import Client
from guestd.memtune import tune_malloc
from guestd.wire.errors import ErrorCode, GuestdError

__all__ = [
    "DERIVED",
    "AsyncClient",
    "Client",
    "CodeError",
    "CodeResult",
    "ConnectError",
    "Connecting",
    "ConnectionClosed",
    "DirEntry",
    "DirListing",
    "ErrorCode",
    "ExecResult",
    "ExecStream",
    "FileStat",
    "GuestProtocolError",
    "GuestdError",
    "Info",
    "Listener",
    "PortForward",
    "PortForwarder",
    "PortList",
    "PortWait",
    "PortWatch",
    "ReverseForward",
    "ReverseForwarder",
    "ShellResult",
    "tune_malloc",
]
