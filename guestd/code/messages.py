"""A kernel's messages as guestd reads them: decoded defensively, sanitised and bounded.

Pure: no I/O of its own and no daemon. A run's state (:class:`RunState`) is fed the decoded
iopub, shell and stdin messages of its cell; where a streamed run's events go and the kernel
whose input requests it answers are handed in (:class:`EventSink`, :class:`KernelInput`).

Every kernel is the workload's (its cells hold the session key: they can send any message
guestd will read), so nothing here trusts a message's shape: a header, parent header or
content that is not a map makes the message undecodable (dropped), fields the protocol types
as str are made str, integers msgpack cannot carry become floats, lone surrogates become
U+FFFD, bundles nesting deeper than a client accepts are dropped and counted, the work on a
message is linear in its size, and what a run keeps is bounded by the request's limits
(SECURITY.md, "code contexts").
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from itertools import compress, repeat
from typing import TYPE_CHECKING, Any, Protocol

import msgpack

from guestd.output.capture import OutputCapture
from guestd.wire.messages import MAX_DEPTH

if TYPE_CHECKING:  # the generated message types: annotations only, never imported at run time
    from guestd.wire.types import CodeErrorRecord, CodeOutputKind, CodeOutputRecord, CodeRunReply, CodeRunStatus

ANSI = re.compile(r"\x1b\[[0-9;?]*+[ -/]*+[@-~]")  # possessive: linear on an unterminated run
MAX_RESULTS = 64
DROPPED_MIME = "application/vnd.guestd.dropped+json"  # guestd.code.kernel: a bundle it did not send
REPLY_SLACK = 1024  # bytes of a reply's frame beyond its measured fields
MAX_ENAME = 1024  # bytes of an error's name
# A bundle (the MIME map counted) nests at most this deep: the deepest frame one travels in,
# run.get's (body, run, result, results, record), adds 5 levels, and a client refuses any
# frame nesting deeper than MAX_DEPTH (guestd.wire.messages) whole, with its connection.
MAX_BUNDLE_NESTING = MAX_DEPTH - 8


def kernel_content_cap(limits: Any) -> int:
    """Bytes of one message content a kernel sends as is (guestd.code.kernel makes larger ones
    small): twice a run's result budget (JSON carries images as base64), and room for a
    stream piece (256 Ki characters) or an echoed cell."""
    return 2 * int(limits.max_output) + 2 * 1024 * 1024


def kernel_max_message(limits: Any) -> int:
    """ZMQ_MAXMSGSIZE of guestd's kernel sockets: a message part larger than this (only a
    forged one can be) is refused by libzmq before guestd holds it; its connection resets."""
    return max(kernel_content_cap(limits), int(limits.max_frame)) + 1024 * 1024


def encoded_size(value: Any) -> int | None:
    """Bytes ``value`` takes in a msgpack frame; None when msgpack cannot carry it at all."""
    try:
        return len(msgpack.packb(value, use_bin_type=True))
    except (TypeError, ValueError, OverflowError):
        return None


def cap_text(text: str, limit: int) -> str:
    """At most ``limit`` UTF-8 bytes of ``text`` (its start), cut at a character boundary."""
    if len(text) <= limit // 4:
        return text
    data = text.encode("utf-8")
    return text if len(data) <= limit else data[:limit].decode("utf-8", "ignore")


def strip_ansi(text: str) -> str:
    return ANSI.sub("", text)


class EventSink(Protocol):
    """Where a streamed run's events go: the request (guestd.services.Request has these)."""

    async def send_event(self, body: dict[str, Any]) -> None: ...

    async def send_data_event(self, fields: Mapping[str, Any], data: bytes | bytearray) -> None: ...


class KernelInput(Protocol):
    """What a run needs of its kernel to answer ``input()``: a line, or an interrupt."""

    def send_input(self, line: str) -> None: ...

    def interrupt(self) -> None: ...


@dataclass
class RunState:
    """One cell's run as its kernel's messages build it: kept (or streamed) output within the
    request's bounds, its error, its count, and ``done`` once both its shell reply and the
    kernel's idle status have arrived (in either order)."""

    msg_id: str
    stdout: OutputCapture
    stderr: OutputCapture
    strip: bool
    stream: EventSink | None  # None: output is kept for the reply
    input_lines: list[str] | None
    limits: Any
    results: list[CodeOutputRecord] = field(default_factory=list)
    result_sizes: list[int] = field(default_factory=list)  # encoded bytes of each kept result
    results_dropped: int = 0
    results_bytes: int = 0
    error: CodeErrorRecord | None = None
    execution_count: int | None = None
    reply_status: str | None = None
    iopub_idle: bool = False
    replied: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)
    stdin_exhausted: bool = False
    max_frame: int = 1 << 62  # the client's: the reply and every event must fit it

    async def on_iopub(self, msg: dict[str, Any]) -> None:
        mtype = msg["msg_type"]
        content = msg["content"]
        if mtype == "stream":
            await self._on_stream(content)
        elif mtype in ("execute_result", "display_data"):
            await self._on_bundle("result" if mtype == "execute_result" else "display", content.get("data"))
        elif mtype == "error":
            await self._on_error(content)
        elif mtype == "execute_input":
            self._on_count(content.get("execution_count"))
        elif mtype == "status" and content.get("execution_state") == "idle":
            self.iopub_idle = True
            if self.replied:
                self.done.set()

    async def _on_stream(self, content: dict[str, Any]) -> None:
        text = content.get("text", "")
        if not isinstance(text, str):
            return  # a forged stream message: nothing a cell printed
        if self.strip:
            text = strip_ansi(text)
        data = text.encode("utf-8")  # cannot fail: decode replaced lone surrogates
        name = "stderr" if content.get("name") == "stderr" else "stdout"
        cap = self.stderr if name == "stderr" else self.stdout
        if self.stream is not None:
            cap.total += len(data)
            for i in range(0, len(data), self.limits.max_chunk):
                await self.stream.send_data_event({"ev": name}, data[i : i + self.limits.max_chunk])
        else:
            cap.feed(data)

    async def _on_bundle(self, kind: CodeOutputKind, data: Any) -> None:
        """A result or display: streamed or kept when it fits, else counted as dropped."""
        if not isinstance(data, dict) or DROPPED_MIME in data:
            self.results_dropped += 1  # the kernel sent only its size: too large to carry
            return
        if nesting(data, MAX_BUNDLE_NESTING) > MAX_BUNDLE_NESTING:
            self.results_dropped += 1  # deeper than a client accepts: it would refuse the whole frame
            return
        bundle = _bundle(data)
        size = encoded_size(bundle)  # what it really takes in the reply, not a guess
        if size is None:
            self.results_dropped += 1  # nothing msgpack can carry (guestd converts what it can)
        elif self.stream is not None:
            if size + REPLY_SLACK <= min(self.limits.max_chunk, self.max_frame):
                await self.stream.send_event({"ev": kind, "bundle": bundle})
            else:
                self.results_dropped += 1
        elif len(self.results) >= MAX_RESULTS or self.results_bytes + size > self.limits.max_output:
            self.results_dropped += 1
        else:
            self.results.append({"kind": kind, "data": bundle})
            self.result_sizes.append(size)
            self.results_bytes += size

    async def _on_error(self, content: dict[str, Any]) -> None:
        # An error never crowds out the status and the streams: a quarter of the output budget.
        self.error = error_record(content, self.strip, self.limits.max_output // 4)
        if self.stream is not None:
            await self.stream.send_event({"ev": "error", **self.error})

    def _on_count(self, value: Any) -> None:
        if _is_count(value):
            self.execution_count = value

    def on_shell(self, msg: dict[str, Any]) -> None:
        content = msg["content"]
        self.reply_status = content.get("status")
        self._on_count(content.get("execution_count"))
        self.replied = True
        if self.iopub_idle:
            self.done.set()

    def on_stdin(self, msg: dict[str, Any], kernel: KernelInput) -> None:
        if msg["msg_type"] != "input_request":
            return
        if self.input_lines:
            kernel.send_input(self.input_lines.pop(0))
        else:
            # No (more) lines: end the cell instead of letting input() wait forever. No reply
            # is sent, so a later input() can never receive a stale one.
            self.stdin_exhausted = True
            kernel.interrupt()

    def finish(self, *, interrupted: bool, foreign: bool) -> CodeRunStatus:
        """The status of a cell whose reply and idle status arrived. ``interrupted``: code.interrupt
        was asked during it; ``foreign``: a kernelspec's kernel, whose interrupted cell need not
        raise KeyboardInterrupt. A cell that ran out of input lines is an EOFError."""
        status: CodeRunStatus = "error" if (self.reply_status == "error" or self.error) else "ok"
        if self.reply_status in ("aborted", "abort"):  # "abort": bash_kernel's word for an interrupted cell
            status = "error"
        if interrupted and (
            (self.error and self.error["ename"] == "KeyboardInterrupt") or (foreign and self.reply_status != "ok")
        ):
            status = "interrupted"
        if self.stdin_exhausted:
            status = "error"
            self.error = {
                "ename": "EOFError",
                "evalue": "input() was called but the request supplied no more input lines",
                "traceback": self.error["traceback"] if self.error else [],
            }
        return status


def error_record(content: dict[str, Any], strip: bool, room: int) -> CodeErrorRecord:
    """An error message's content as the reply's error: every field str, the evalue and the
    traceback within ``room`` bytes (the traceback's last lines are kept: where it was raised)."""
    lines = content.get("traceback")
    tb = [_as_str(t) for t in lines] if isinstance(lines, list) else []
    if strip:
        tb = [strip_ansi(t) for t in tb]
    # Linear: a cell decides how many lines its traceback has (IPython's _render_traceback_).
    total, first = sum(map(len, tb)), 0
    while first < len(tb) and total > room:
        total -= len(tb[first])
        first += 1
    return {
        "ename": cap_text(_as_str(content.get("ename")), MAX_ENAME),
        "evalue": cap_text(_as_str(content.get("evalue")), room),
        "traceback": tb[first:],
    }


def decode(session: Any, frames: list[bytes]) -> dict[str, Any]:
    """Verify and decode one Jupyter wire message (header, parent, content only).

    Every str in the content encodes as UTF-8 (see ``_replace_surrogates``), so whatever the
    cell printed, raised or displayed, the replies and events built from it can be sent.
    """
    _, parts = session.feed_identities(frames)
    signature, header, parent, _metadata, content = parts[:5]
    if session.auth is not None and not hmac.compare_digest(signature, session.sign(parts[1:5])):
        raise ValueError("bad message signature")
    h, p, c = json.loads(header), json.loads(parent), load_content(content)
    if not (isinstance(h, dict) and isinstance(p, dict) and isinstance(c, dict)):
        raise ValueError("a message's header, parent header and content are maps")  # forged
    return {"msg_type": h.get("msg_type"), "parent_header": p, "content": c}


def load_content(raw: bytes) -> Any:
    try:
        # Our kernels write lone surrogates as 'surrogatepass' bytes (guestd.code.kernel.pack_message).
        text = raw.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        text = raw.decode("utf-8", "replace")  # any other invalid UTF-8: U+FFFD, not a dropped message
    content = json.loads(text)
    # A lone surrogate can only come from the bytes ED A0..ED BF or a \uD800..\uDFFF escape;
    # without either (a memchr-speed test) the walk is skipped.
    if b"\xed" in raw or b"\\ud" in raw or b"\\uD" in raw:
        content = _replace_surrogates(content)
    return content


_SURROGATE = re.compile("[\ud800-\udfff]")


def _valid_str(text: str) -> str:
    if text.isascii():  # O(1) in CPython
        return text
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text)


def _replace_surrogates(value: Any) -> Any:
    """Replace each lone surrogate in a decoded JSON value's strings (keys too) by U+FFFD.

    Python str allows lone surrogates (``print('\\ud800')``, os.fsdecode of a non-UTF-8
    name); UTF-8, and so msgpack str, does not. U+FFFD is what a UTF-8 reader shows for
    bytes it cannot read; it keeps stream bytes valid UTF-8 (unlike 'surrogatepass', which
    strict host decoders reject) and unambiguous (unlike 'backslashreplace', which reads
    like text the cell printed). Byte counts stay exact: they count the bytes sent.
    Iterative, so nesting as deep as json.loads accepts costs no recursion. In place.
    """
    return _map_leaves(value, lambda v: _valid_str(v) if isinstance(v, str) else v)


def _fit_msgpack_ints(value: Any) -> Any:
    """Integers beyond msgpack's 64 bits (``JSON({'n': 2**70})``) as floats, the way a JSON
    reader such as JSON.parse takes them; past the float range, +-inf. In place.

    msgpack cannot encode them, and one in a result would make the whole reply unsendable.
    Tried first with msgpack itself: C speed for the usual bundle, which has none.
    """
    try:
        msgpack.packb(value)
        return value
    except OverflowError:
        return _map_leaves(value, _int_as_float)


def _int_as_float(value: Any) -> Any:
    if not isinstance(value, int) or -(2**63) <= value < 2**64:
        return value
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _map_leaves(value: Any, fix: Callable[[Any], Any]) -> Any:
    """Apply ``fix`` to every str and number of a decoded JSON value, map keys too, in place.

    Iterative, so nesting as deep as json.loads accepts costs no recursion.
    """
    if not isinstance(value, (list, dict)):
        return fix(value)
    pending: list[list[Any] | dict[Any, Any]] = [value]
    while pending:
        node = pending.pop()
        if isinstance(node, list):
            for i, item in enumerate(node):
                if isinstance(item, (list, dict)):
                    pending.append(item)
                else:
                    node[i] = fix(item)
        else:
            for key, item in node.items():
                if isinstance(item, (list, dict)):
                    pending.append(item)
                else:
                    node[key] = fix(item)  # same key: no resize while iterating
            for key in [k for k in node if fix(k) is not k]:
                node[fix(key)] = node.pop(key)
    return value


def _as_str(value: Any) -> str:
    """A field the protocol types as str; real kernels send str, forged messages anything."""
    if isinstance(value, str):
        return value
    return "" if value is None else _valid_str(str(value))


def _is_count(value: Any) -> bool:
    # Not a bool (an int in Python): the reply's schema types the count as an integer.
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


def nesting(value: Any, limit: int) -> int:
    """How deep ``value``'s lists and maps nest (a scalar 0, ``[]`` or ``{}`` 1), counted up to
    ``limit + 1`` at most. Level by level, the items of each container tested in C: linear
    in the value's size, and no recursion however deep it is."""
    level = [value] if isinstance(value, (list, dict)) else []
    depth = 0
    while level and depth <= limit:
        depth += 1
        below: list[Any] = []
        for node in level:
            items = node.values() if isinstance(node, dict) else node
            below.extend(compress(items, map(isinstance, items, repeat(_CONTAINERS))))
        level = below
    return depth


_CONTAINERS = (list, dict)


def _bundle(data: dict[str, Any]) -> dict[str, Any]:
    """Jupyter MIME bundle -> wire bundle: images as raw bytes, JSON as maps, text as str."""
    out: dict[str, Any] = {}
    for mime, value in data.items():
        if mime.startswith("image/") and mime != "image/svg+xml" and isinstance(value, str):
            try:
                out[mime] = base64.b64decode(value)
                continue
            except ValueError:
                pass
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            value = "".join(value)
        out[mime] = value if isinstance(value, str) else _fit_msgpack_ints(value)
    return out


def fit_reply(reply: CodeRunReply, st: RunState) -> CodeRunReply:
    """Keep the results, in order, that fit the client's max_frame beside everything else; the
    rest are dropped and counted, so the status and the streams always arrive."""
    if not reply["results"]:
        return reply
    rest = encoded_size({**reply, "results": []})
    room = st.max_frame - (rest if rest is not None else st.max_frame) - REPLY_SLACK
    kept: list[CodeOutputRecord] = []
    for record, size in zip(st.results, st.result_sizes, strict=True):
        if size + 16 > room:  # 16: the record's own keys
            break
        kept.append(record)
        room -= size + 16
    reply["results_dropped"] += len(st.results) - len(kept)
    reply["results"] = kept
    return reply
