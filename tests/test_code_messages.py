"""The kernel message layer (guestd.code.messages) on its own: no daemon, no kernel.

A run's state is fed crafted iopub, shell and stdin messages, as a kernel (or a cell forging
messages with its kernel's key) could send them; each test checks what guestd keeps, streams
or refuses, and the bounds on it. Where a streamed run's events go is a recording sink.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Mapping
from typing import Any

import msgpack
import pytest

from guestd.code.messages import (
    DROPPED_MIME,
    MAX_BUNDLE_NESTING,
    MAX_ENAME,
    MAX_RESULTS,
    REPLY_SLACK,
    RunState,
    cap_text,
    decode,
    encoded_size,
    error_record,
    fit_reply,
    load_content,
    nesting,
)
from guestd.config import Limits
from guestd.output.capture import OutputCapture

MSG_ID = "m1"


def limits(**overrides: int) -> Limits:
    """guestd's default limits with ``overrides``."""
    chosen = Limits()
    for name, value in overrides.items():
        setattr(chosen, name, value)
    return chosen


class Sink:
    """The request a streamed run sends its events to, recording them."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.data: list[tuple[dict[str, Any], bytes]] = []

    async def send_event(self, body: dict[str, Any]) -> None:
        self.events.append(body)

    async def send_data_event(self, fields: Mapping[str, Any], data: bytes | bytearray) -> None:
        self.data.append((dict(fields), bytes(data)))


class Kernel:
    """The kernel a run answers input() of, recording what it was told."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.interrupts = 0

    def send_input(self, line: str) -> None:
        self.lines.append(line)

    def interrupt(self) -> None:
        self.interrupts += 1


def run_state(
    *,
    strip: bool = False,
    stream: Sink | None = None,
    lines: list[str] | None = None,
    bounds: Limits | None = None,
    max_output: int = 1 << 20,
) -> RunState:
    return RunState(
        MSG_ID,
        OutputCapture(max_output),
        OutputCapture(max_output),
        strip,
        stream,
        lines,
        bounds or Limits(),
    )


def feed(st: RunState, *messages: tuple[str, Any]) -> RunState:
    async def go() -> None:
        for mtype, content in messages:
            await st.on_iopub({"msg_type": mtype, "parent_header": {"msg_id": MSG_ID}, "content": content})

    asyncio.run(go())
    return st


# -- streams ----------------------------------------------------------------------------------


def test_stream_text_is_kept_per_stream_and_an_unknown_name_is_stdout() -> None:
    st = feed(
        run_state(),
        ("stream", {"name": "stdout", "text": "out\n"}),
        ("stream", {"name": "stderr", "text": "err\n"}),
        ("stream", {"name": ["stderr"], "text": "odd\n"}),  # not the str "stderr": stdout
        ("stream", {"text": "nameless\n"}),
    )
    assert st.stdout.data() == b"out\nodd\nnameless\n"
    assert st.stderr.data() == b"err\n"


def test_strip_ansi_removes_escape_sequences_only_when_asked() -> None:
    text = "\x1b[31mred\x1b[0m \x1b[1;2;3"  # the last one unterminated: kept, and linear
    assert feed(run_state(strip=True), ("stream", {"text": text})).stdout.data() == b"red \x1b[1;2;3"
    assert feed(run_state(), ("stream", {"text": text})).stdout.data() == text.encode()


def test_kept_output_is_bounded_and_counts_every_byte() -> None:
    st = feed(run_state(max_output=10), *[("stream", {"text": "0123456789"})] * 100)
    assert st.stdout.data() == b"0123456789"
    assert st.stdout.total == 1000


def test_streamed_output_goes_out_in_pieces_of_max_chunk_and_is_counted() -> None:
    sink = Sink()
    st = feed(run_state(stream=sink, bounds=limits(max_chunk=4)), ("stream", {"name": "stderr", "text": "abcdefghij"}))
    assert sink.data == [({"ev": "stderr"}, b"abcd"), ({"ev": "stderr"}, b"efgh"), ({"ev": "stderr"}, b"ij")]
    assert (st.stderr.total, st.stderr.data()) == (10, b"")


def test_a_stream_message_whose_text_is_not_a_string_is_dropped() -> None:
    # A forged message (real kernels send str). Before: AttributeError, logged with a traceback.
    st = feed(run_state(), *[("stream", {"text": t}) for t in (5, None, ["a"], {"t": "a"})])
    assert (st.stdout.total, st.stderr.total) == (0, 0)


# -- results and displays ---------------------------------------------------------------------


def test_results_and_displays_are_kept_in_order_as_wire_bundles() -> None:
    png = b"\x89PNG\r\n"
    st = feed(
        run_state(),
        ("display_data", {"data": {"image/png": base64.b64encode(png).decode(), "text/plain": ["a", "b"]}}),
        ("execute_result", {"data": {"image/svg+xml": "<svg/>", "application/json": {"k": [1, 2]}}}),
        ("display_data", {"data": {"image/png": "not base64!"}}),  # kept as the str it is
    )
    assert st.results == [
        {"kind": "display", "data": {"image/png": png, "text/plain": "ab"}},
        {"kind": "result", "data": {"image/svg+xml": "<svg/>", "application/json": {"k": [1, 2]}}},
        {"kind": "display", "data": {"image/png": "not base64!"}},
    ]
    assert st.result_sizes == [encoded_size(r["data"]) for r in st.results]
    assert st.results_bytes == sum(st.result_sizes)
    assert st.results_dropped == 0


def test_integers_beyond_64_bits_become_floats_so_the_reply_stays_encodable() -> None:
    st = feed(run_state(), ("display_data", {"data": {"application/json": {"a": 2**70, "b": [-(10**400), 2**63]}}}))
    assert st.results[0]["data"] == {"application/json": {"a": float(2**70), "b": [float("-inf"), 2**63]}}


def test_bundles_the_kernel_could_not_send_or_that_are_not_maps_are_counted_as_dropped() -> None:
    st = feed(
        run_state(),
        ("display_data", {"data": {DROPPED_MIME: {"bytes": 10**9}}}),
        ("display_data", {"data": ["not", "a", "map"]}),
        ("execute_result", {"data": None}),
        ("execute_result", {}),
    )
    assert (st.results, st.results_dropped) == ([], 4)


def test_at_most_max_results_are_kept_and_the_rest_counted() -> None:
    st = feed(run_state(), *[("display_data", {"data": {"text/plain": str(i)}}) for i in range(MAX_RESULTS + 6)])
    assert (len(st.results), st.results_dropped) == (MAX_RESULTS, 6)


def test_kept_results_stay_within_the_output_budget() -> None:
    bounds = limits(max_output=10_000)
    st = feed(run_state(bounds=bounds), *[("display_data", {"data": {"text/plain": "x" * 3000}})] * 5)
    assert (len(st.results), st.results_dropped) == (3, 2)
    assert st.results_bytes <= bounds.max_output


def test_a_streamed_bundle_is_sent_when_it_fits_a_chunk_and_the_clients_frame() -> None:
    sink = Sink()
    st = run_state(stream=sink, bounds=limits(max_chunk=REPLY_SLACK + 100))
    st.max_frame = REPLY_SLACK + 50
    feed(
        st,
        ("display_data", {"data": {"text/plain": "small"}}),
        ("display_data", {"data": {"text/plain": "x" * 60}}),  # fits the chunk, not the frame
        ("execute_result", {"data": {"text/plain": "x" * 200}}),
    )
    assert sink.events == [{"ev": "display", "bundle": {"text/plain": "small"}}]
    assert (st.results, st.results_dropped) == ([], 2)


def deep(levels: int) -> Any:
    value: Any = "leaf"
    for _ in range(levels):
        value = [value]
    return value


def test_a_bundle_nesting_deeper_than_a_client_accepts_is_dropped_and_counted() -> None:
    # A client refuses a frame nesting deeper than 64 whole, connection and all. Before, a cell's
    # display(JSON(...)) nested 80 deep ended the client's connection (tests/test_code_hostile_output.py).
    fits = deep(MAX_BUNDLE_NESTING - 1)  # the MIME map is one level
    st = feed(
        run_state(),
        ("display_data", {"data": {"application/json": fits}}),
        ("display_data", {"data": {"application/json": deep(MAX_BUNDLE_NESTING)}}),
        ("display_data", {"data": {"application/json": json.loads("[" * 900 + "]" * 900)}}),
    )
    assert [r["data"]["application/json"] for r in st.results] == [fits]
    assert st.results_dropped == 2
    sink = Sink()
    feed(run_state(stream=sink), ("display_data", {"data": {"application/json": deep(MAX_BUNDLE_NESTING)}}))
    assert sink.events == []


def test_nesting_counts_levels_of_lists_and_maps_and_stops_past_its_limit() -> None:
    values: list[Any] = [1, "s", [], {}, [1, [2]], {"a": {"b": [{}]}}]
    assert [nesting(v, 10) for v in values] == [0, 0, 1, 1, 2, 4]
    assert nesting(deep(10_000), 5) == 6  # stops: no recursion, no walk of the rest


# -- errors -----------------------------------------------------------------------------------


def test_an_error_is_kept_and_streamed_with_ansi_stripped() -> None:
    sink = Sink()
    content = {"ename": "ValueError", "evalue": "bad", "traceback": ["\x1b[31mTraceback\x1b[0m", "line"]}
    st = feed(run_state(strip=True, stream=sink), ("error", content))
    assert st.error == {"ename": "ValueError", "evalue": "bad", "traceback": ["Traceback", "line"]}
    assert sink.events == [{"ev": "error", **st.error}]


def test_error_fields_of_any_type_become_strings() -> None:
    st = feed(run_state(), ("error", {"ename": 2**70, "evalue": None, "traceback": [2**64, "x", None, ["y"]]}))
    assert st.error == {"ename": str(2**70), "evalue": "", "traceback": [str(2**64), "x", "", "['y']"]}
    st = feed(run_state(), ("error", {"traceback": "not a list"}))
    assert st.error == {"ename": "", "evalue": "", "traceback": []}


def test_an_errors_name_value_and_traceback_are_bounded() -> None:
    bounds = limits(max_output=4000)
    room = bounds.max_output // 4
    content = {"ename": "é" * 5000, "evalue": "v" * 10_000, "traceback": [f"{i:04}" for i in range(1000)]}
    st = feed(run_state(bounds=bounds), ("error", content))
    assert st.error is not None
    assert len(st.error["ename"].encode()) <= MAX_ENAME and set(st.error["ename"]) == {"é"}  # whole characters
    assert len(st.error["evalue"].encode()) <= room
    tb = st.error["traceback"]
    assert sum(map(len, tb)) <= room < sum(map(len, tb)) + 4
    assert tb[-1] == "0999" and tb == [f"{i:04}" for i in range(1000 - len(tb), 1000)]  # where it was raised


class CountedStr(str):
    """A str that counts how often its length is asked: the work done on a traceback."""

    asked = 0

    def __len__(self) -> int:
        CountedStr.asked += 1
        return super().__len__()


def test_trimming_a_traceback_is_linear_in_its_lines() -> None:
    # A cell decides how many lines its traceback has (IPython's _render_traceback_): before,
    # trimming summed the remaining lines once per line dropped, so 60,000 lines held guestd's
    # event loop (every client, every capability) for 100 s, and 800,000 for hours.
    n, room = 4000, 1000
    CountedStr.asked = 0
    record = error_record({"traceback": [CountedStr("ab")] * n}, False, room)
    assert len(record["traceback"]) == room // 2
    assert CountedStr.asked <= 3 * n  # before: ~6,000,000 for these 4,000 lines


# -- counts, replies, idle --------------------------------------------------------------------


def test_execution_counts_are_taken_only_when_they_are_plain_integers_in_range() -> None:
    for bad in (True, False, -1, 2**63, "3", 3.0, None, [3]):
        assert feed(run_state(), ("execute_input", {"execution_count": bad})).execution_count is None, bad
        st = run_state()
        st.on_shell({"msg_type": "execute_reply", "content": {"status": "ok", "execution_count": bad}})
        assert st.execution_count is None, bad
    assert feed(run_state(), ("execute_input", {"execution_count": 7})).execution_count == 7


def test_a_run_is_done_once_both_its_reply_and_idle_have_arrived_in_either_order() -> None:
    st = feed(run_state(), ("status", {"execution_state": "busy"}), ("status", {"execution_state": "idle"}))
    assert not st.done.is_set()
    st.on_shell({"msg_type": "execute_reply", "content": {"status": "ok", "execution_count": 3}})
    assert st.done.is_set() and (st.reply_status, st.execution_count) == ("ok", 3)

    st = run_state()
    st.on_shell({"msg_type": "execute_reply", "content": {"status": "error"}})
    assert not st.done.is_set()
    feed(st, ("status", {"execution_state": "idle"}))
    assert st.done.is_set() and st.reply_status == "error"


def test_input_requests_take_the_requests_lines_then_end_the_cell() -> None:
    st, kernel = run_state(lines=["a", "b"]), Kernel()
    for mtype in ("input_request", "other", "input_request", "input_request"):
        st.on_stdin({"msg_type": mtype, "content": {}}, kernel)
    assert (kernel.lines, kernel.interrupts, st.stdin_exhausted) == (["a", "b"], 1, True)
    st, kernel = run_state(), Kernel()  # no input_lines at all
    st.on_stdin({"msg_type": "input_request", "content": {}}, kernel)
    assert (kernel.lines, kernel.interrupts, st.stdin_exhausted) == ([], 1, True)


@pytest.mark.parametrize(
    ("reply_status", "ename", "interrupted", "foreign", "status"),
    [
        ("ok", None, False, False, "ok"),
        ("error", None, False, False, "error"),
        ("ok", "ValueError", False, False, "error"),
        ("aborted", None, False, False, "error"),
        ("abort", None, False, False, "error"),  # bash_kernel's word
        ("error", "KeyboardInterrupt", True, False, "interrupted"),
        ("error", "KeyboardInterrupt", False, False, "error"),  # not asked for: an error like any
        ("abort", None, True, True, "interrupted"),  # a foreign kernel need not raise KeyboardInterrupt
        ("ok", None, True, True, "ok"),
        (None, None, False, False, "ok"),
    ],
)
def test_the_status_of_a_cell_that_ran_to_its_end(
    reply_status: str | None, ename: str | None, interrupted: bool, foreign: bool, status: str
) -> None:
    st = run_state()
    st.reply_status = reply_status
    if ename is not None:
        st.error = {"ename": ename, "evalue": "", "traceback": []}
    assert st.finish(interrupted=interrupted, foreign=foreign) == status


def test_a_cell_that_ran_out_of_input_lines_is_an_eof_error_keeping_its_traceback() -> None:
    st = run_state()
    st.stdin_exhausted = True
    st.error = {"ename": "KeyboardInterrupt", "evalue": "", "traceback": ["tb"]}
    assert st.finish(interrupted=False, foreign=False) == "error"
    assert st.error is not None and (st.error["ename"], st.error["traceback"]) == ("EOFError", ["tb"])


def test_fit_reply_keeps_results_in_order_within_the_clients_frame_and_counts_the_rest() -> None:
    st = feed(run_state(), *[("display_data", {"data": {"text/plain": str(i) * 1000}}) for i in range(10)])
    reply: Any = {"context": "c", "status": "ok", "results": st.results, "results_dropped": 1}
    rest = encoded_size({**reply, "results": []})
    assert rest is not None
    st.max_frame = rest + REPLY_SLACK + 3 * (st.result_sizes[0] + 16)
    fitted = fit_reply(reply, st)
    assert [r["data"]["text/plain"][0] for r in fitted["results"]] == ["0", "1", "2"]
    assert fitted["results_dropped"] == 1 + 7
    assert len(msgpack.packb(fitted, use_bin_type=True)) <= st.max_frame


# -- decoding ---------------------------------------------------------------------------------


def session() -> Any:
    from jupyter_client.session import Session

    return Session(key=b"0123456789abcdef")


HEADER = {"msg_id": "k1", "msg_type": "stream", "session": "s", "username": "u", "date": "", "version": "5.3"}
PARENT = {"msg_id": MSG_ID}
CONTENT = {"name": "stdout", "text": "hi"}


def frames(s: Any, *, header: Any = HEADER, parent: Any = PARENT, content: Any = CONTENT) -> list[bytes]:
    """A signed wire message as a kernel sends it (any JSON value in each part, as forged ones)."""
    chosen: tuple[Any, ...] = (header, parent, {}, content)  # {}: the metadata
    parts = [json.dumps(part).encode() for part in chosen]
    return [b"<IDS|MSG>", s.sign(parts), *parts]


def test_decode_verifies_the_signature_and_reads_header_parent_and_content() -> None:
    s = session()
    assert decode(s, frames(s)) == {"msg_type": "stream", "parent_header": PARENT, "content": CONTENT}
    ours = s.serialize(s.msg("stream", CONTENT, parent={"header": PARENT}))  # as jupyter_client makes one
    assert decode(s, ours) == {"msg_type": "stream", "parent_header": PARENT, "content": CONTENT}
    forged = frames(s)
    forged[-1] = b'{"name": "stdout", "text": "changed"}'
    with pytest.raises(ValueError, match="signature"):
        decode(s, forged)


def test_a_message_whose_header_parent_or_content_is_not_a_map_is_undecodable() -> None:
    # Before, a parent header that was a list reached the channel's reader, which ended on it:
    # the run in progress never saw its idle status and timed out (tests/test_code_hostile_output.py).
    s = session()
    for shape in ([], ["a"], "text", 5, None):
        for where in ("parent", "content", "header"):
            with pytest.raises(ValueError):
                decode(s, frames(s, **{where: shape}))


def test_content_with_lone_surrogates_or_invalid_utf8_decodes_to_valid_text() -> None:
    assert load_content('{"t": ["a\udcff"], "k\ud800": 1}'.encode("utf-8", "surrogatepass")) == {
        "t": ["a\ufffd"],
        "k\ufffd": 1,
    }
    assert load_content(b'{"t": "\\uDFFF\\ud800 x", "ok": "\\u00e9\\ud83d\\ude00"}') == {
        "t": "\ufffd\ufffd x",
        "ok": "\u00e9\U0001f600",
    }
    assert load_content(b'{"t": "bad \x80 byte"}') == {"t": "bad \ufffd byte"}
    deep_json = b"[" * 900 + b'"\\ud800"' + b"]" * 900  # walked without recursion
    value = load_content(deep_json)
    for _ in range(900):
        value = value[0]
    assert value == "\ufffd"


def test_cap_text_cuts_at_a_character_boundary() -> None:
    assert cap_text("abc", 10) == "abc"
    assert cap_text("é" * 10, 5) == "éé"
    assert cap_text("€" * 100, 8) == "€€"


def test_encoded_size_is_none_for_what_msgpack_cannot_carry() -> None:
    assert encoded_size({"a": b"xy"}) == len(msgpack.packb({"a": b"xy"}, use_bin_type=True))
    assert encoded_size({"a": object()}) is None
    assert encoded_size(2**70) is None
