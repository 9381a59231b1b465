"""The blocking client's port methods: forwards as context managers, run on the client's loop."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from guestd.client.ports import REVERSE_CONNECT_TIMEOUT, PortForward, PortList, PortWait, ReverseForward

if TYPE_CHECKING:
    from guestd.client.aio import AsyncClient

T = TypeVar("T")


class PortForwarder:
    """A running :class:`~guestd.client.ports.PortForward`: ``with client.port_forward(8000) as f:``
    then connect to ``f.local_port`` on this host."""

    def __init__(self, ports: SyncPortsAPI, forward: PortForward) -> None:
        self._ports = ports
        self.forward = forward

    @property
    def local_address(self) -> str:
        return self.forward.local_address

    @property
    def local_port(self) -> int:
        return self.forward.local_port

    @property
    def guest_port(self) -> int:
        return self.forward.guest_port

    def close(self) -> None:
        self._ports._run(self.forward.close())

    def __enter__(self) -> PortForwarder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ReverseForwarder:
    """A running :class:`~guestd.client.ports.ReverseForward`: the guest reaches ``destination``
    by connecting to ``guest_port`` on its loopback until ``close()``."""

    def __init__(self, ports: SyncPortsAPI, forward: ReverseForward) -> None:
        self._ports = ports
        self.forward = forward

    @property
    def guest_port(self) -> int:
        return self.forward.guest_port

    @property
    def destination(self) -> tuple[str, int]:
        return self.forward.destination

    def close(self) -> None:
        self._ports._run(self.forward.close())

    def __enter__(self) -> ReverseForwarder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SyncPortsAPI:
    """:class:`~guestd.client.Client`'s port methods (a mixin over its ``_aio`` and ``_run``)."""

    _aio: AsyncClient

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        raise NotImplementedError

    def port_forward(
        self,
        guest_port: int,
        *,
        local_port: int = 0,
        local_address: str = "127.0.0.1",
        address: str | None = None,
        connect_timeout_s: float | None = None,
    ) -> PortForwarder:
        """See :meth:`AsyncClient.port_forward`; use it as a context manager."""
        forward = self._run(
            self._aio.port_forward(
                guest_port,
                local_port=local_port,
                local_address=local_address,
                address=address,
                connect_timeout_s=connect_timeout_s,
            )
        )
        return PortForwarder(self, forward)

    def reverse_forward(
        self,
        guest_port: int,
        destination: tuple[str, int],
        *,
        address: str | None = None,
        accept_timeout_s: float | None = None,
        connect_timeout: float = REVERSE_CONNECT_TIMEOUT,
        deadline: float | None = 30.0,
    ) -> ReverseForwarder:
        """See :meth:`AsyncClient.reverse_forward`; use it as a context manager."""
        forward = self._run(
            self._aio.reverse_forward(
                guest_port,
                destination,
                address=address,
                accept_timeout_s=accept_timeout_s,
                connect_timeout=connect_timeout,
                deadline=deadline,
            )
        )
        return ReverseForwarder(self, forward)

    def port_list(self, *, ports: list[int] | None = None, deadline: float | None = 30.0) -> PortList:
        return self._run(self._aio.port_list(ports=ports, deadline=deadline))

    def port_wait(
        self,
        port: int,
        *,
        address: str | None = None,
        timeout_s: float | None = None,
        http: bool | None = None,
        path: str | None = None,
        deadline: float | None = None,
    ) -> PortWait:
        return self._run(
            self._aio.port_wait(port, address=address, timeout_s=timeout_s, http=http, path=path, deadline=deadline)
        )
