"""The blocking client's port methods: forwards as context managers, run on the client's loop."""

from __future__ import annotations

from guestd.client._blocking import ClientBase, PortForwarder, ReverseForwarder
from guestd.client.ports import REVERSE_CONNECT_TIMEOUT, PortList, PortWait

__all__ = ["PortForwarder", "ReverseForwarder", "SyncPortsAPI"]


class SyncPortsAPI(ClientBase):
    """:class:`~guestd.client.Client`'s port methods."""

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
