"""Cells whose output is shaped against guestd or its client, on a real guestd and kernel.

Each was a defect found while splitting guestd/code/contexts.py (issue 33): the message layer's
unit tests (tests/test_code_messages.py) pin the rule, these show the effect end to end.
"""

from __future__ import annotations

from guestd.client import Client
from guestd.code.kernel_process import MAX_LOGGED_DROPS
from guestd.code.messages import MAX_BUNDLE_NESTING
from guestd.testing import Guestd


def test_a_forged_message_whose_parent_header_is_not_a_map_does_not_stop_the_run(client: Client) -> None:
    # Code in the kernel holds its session key. Before: the iopub reader ended on the list's
    # missing .get, so the cell's idle status never arrived: status timeout, kernel restarted.
    code = (
        "k = get_ipython().kernel\n"
        "m = k.session.msg('stream', {'name': 'stdout', 'text': 'forged'})\n"
        "m['parent_header'] = ['not', 'a', 'map']\n"
        "k.session.send(k.iopub_socket, m, ident=b'stream')\n"
        "print('real')\n"
    )
    r = client.code_run(code, timeout_s=10, deadline=60)
    assert (r.status, r.timeout_action, r.stdout) == ("ok", None, b"real\n")
    assert client.code_run("print('next')", timeout_s=10).stdout == b"next\n"


def nested_display(lists: int) -> str:
    """A cell displaying JSON whose bundle nests ``lists`` + 2 deep (the MIME map, {"v": ...})."""
    return (
        "from IPython.display import JSON, display\n"
        f"v = 'leaf'\nfor _ in range({lists}): v = [v]\n"
        "display(JSON({'v': v}))\nprint('after')\n"
    )


def test_a_display_nested_deeper_than_a_client_accepts_is_dropped_not_the_connection(client: Client) -> None:
    # Before: the reply nested past the client's 64 levels, and the client ended the whole
    # connection (PeerViolation "payload nests deeper than 64"), every request on it with it.
    too_deep, fits = nested_display(80), nested_display(MAX_BUNDLE_NESTING - 2)
    streamed: list[dict[str, object]] = []
    for code, dropped in ((too_deep, 1), (fits, 0)):
        plain = client.code_run(code, deadline=30)
        assert (plain.status, plain.stdout, len(plain.results), plain.results_dropped) == (
            "ok",
            b"after\n",
            1 - dropped,
            dropped,
        )
        streamed.clear()
        live = client.code_run(code, on_result=streamed.append, deadline=30)
        assert (live.status, live.results_dropped, len(streamed)) == ("ok", dropped, 1 - dropped)
        kept = client.code_run(code, keep=True, deadline=30)  # run.get carries it one level deeper
        assert kept.run_id is not None
        info = client.run_get(kept.run_id)
        assert info.state == "done" and info.result is not None
    assert client.ping() >= 0  # the connection is still there


def test_a_traceback_of_a_quarter_million_lines_is_trimmed_in_linear_time(client: Client) -> None:
    # IPython shows what _render_traceback_ returns. Before: trimming it to its room summed the
    # remaining lines once per line dropped; 60,000 lines held guestd's event loop (every client,
    # every capability) for 100 s, these 250,000 for hours: the deadline below failed.
    code = "class E(Exception):\n    def _render_traceback_(self):\n        return ['x' * 10] * 250_000\nraise E()\n"
    r = client.code_run(code, deadline=60)
    assert r.status == "error" and r.error is not None and r.error.ename == "E"
    room = (1024 * 1024) // 4  # a quarter of guestd's max_output: the last lines that fit
    assert r.error.traceback == ["x" * 10] * (room // 10)


def test_messages_guestd_cannot_use_are_logged_only_a_few_times_per_kernel(client: Client, guestd: Guestd) -> None:
    # Before: a log line for each, so a cell wrote guestd's log as fast as it could send.
    def logged() -> int:
        return guestd.log().count("undecodable iopub message dropped")

    before = logged()
    code = (
        "k = get_ipython().kernel\n"
        "for _ in range(300):  # signed with the wrong key\n"
        "    k.iopub_socket.send_multipart([b'<IDS|MSG>', b'0' * 64, b'{}', b'{}', b'{}', b'{}'])\n"
        "print('sent')\n"
    )
    r = client.code_run(code, timeout_s=20, deadline=60)
    assert (r.status, r.stdout) == ("ok", b"sent\n")  # its idle status came after all 300
    assert 0 < logged() - before <= MAX_LOGGED_DROPS
