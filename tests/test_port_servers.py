"""The test servers' WebSocket handshake is RFC 6455's, so a real client would accept it (the
GUID had two groups of digits swapped; the tests used the same constant on both ends)."""

from __future__ import annotations

from tests.port_servers import ws_accept


def test_the_websocket_accept_matches_rfc_6455s_worked_example() -> None:
    # https://www.rfc-editor.org/rfc/rfc6455#section-1.3
    assert ws_accept("dGhlIHNhbXBsZSBub25jZQ==") == "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
