"""The blocking Process handle follows a background process's output as it comes (issue 30:
the streaming calls were async only), with the callbacks in the caller's thread."""

from __future__ import annotations

import threading

from guestd.client import Client
from guestd.testing import Guestd


def test_a_blocking_attach_delivers_output_in_the_callers_thread_until_exit(guestd: Guestd) -> None:
    chunks: list[bytes] = []
    threads: set[int] = set()

    def took(data: bytes) -> None:
        chunks.append(data)
        threads.add(threading.get_ident())

    with Client(guestd.address) as c, c.process_start("for i in 1 2 3; do echo out$i; echo err$i >&2; done") as p:
        errors: list[bytes] = []
        final = p.attach(on_stdout=took, on_stderr=errors.append)
        assert b"".join(chunks) == b"out1\nout2\nout3\n" and b"".join(errors) == b"err1\nerr2\nerr3\n"
        assert threads == {threading.get_ident()}
        assert final.state == "exited" and final.exit_code == 0 and final.stdout_offset == 15
        again: list[bytes] = []
        p.attach(on_stdout=again.append, stdout_from=10)  # from an offset: the rest
        assert b"".join(again) == b"out3\n"
