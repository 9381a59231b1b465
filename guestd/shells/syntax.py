"""shell.run check_syntax: ``bash -n`` on the command text before it runs."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from guestd.children import DEVNULL, PIPE, exit_info
from guestd.children.tree import read_chunk, write_all
from guestd.wire.errors import ErrorCode, GuestdError

if TYPE_CHECKING:
    from guestd.services import Services

SYNTAX_TIMEOUT_S = 10.0
SYNTAX_MESSAGE_MAX = 64 * 1024


async def check_syntax(services: Services, command: str) -> None:
    """``bash -n`` on the command text in a run of its own (never the session's bash, which
    would run it): a syntax error is ``bad_request`` with bash's message (details.stage
    ``syntax``). extglob is on, so a pattern the session may allow is not rejected; aliases
    of the session are not known to it (PROTOCOL.md 10)."""
    child = await services.children.spawn(
        ["bash", "--noprofile", "--norc", "-O", "extglob", "-n"], kind="exec", stdin=PIPE, stdout=DEVNULL
    )
    loop = asyncio.get_running_loop()
    message = bytearray()
    ended = loop.create_future()
    fd = child.stderr
    assert fd is not None and child.stdin is not None

    def on_err() -> None:
        data = read_chunk(fd, 65536)
        if data is None:
            return
        if not data:
            loop.remove_reader(fd)
            if not ended.done():
                ended.set_result(None)
            return
        message.extend(data[: max(0, SYNTAX_MESSAGE_MAX - len(message))])

    loop.add_reader(fd, on_err)
    child.watch(poll_s=0.01)
    try:
        async with asyncio.timeout(SYNTAX_TIMEOUT_S):
            await write_all(loop, child.stdin, command.encode("utf-8", "surrogateescape"))
            child.close_fd("stdin")
            await ended
            await child.exited
    except TimeoutError:
        raise GuestdError(
            ErrorCode.TIMEOUT,
            f"bash -n did not finish within {SYNTAX_TIMEOUT_S:g} s",
            details={"stage": "syntax"},
        ) from None
    finally:
        loop.remove_reader(fd)
        if child.running:
            child.kill_now()
        child.release()
    code = exit_info(child.status)["exit_code"]
    if code != 0:
        text = bytes(message).decode("utf-8", "replace")
        first = text.split("\n", 1)[0]
        raise GuestdError(
            ErrorCode.BAD_REQUEST,
            f"syntax error: {first}" if first else "bash -n rejected the command",
            details={"stage": "syntax", "message": text, "field": "command"},
        )
