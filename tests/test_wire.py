"""The sans-I/O codec against the checked-in contract: golden vectors, schema snapshot, properties."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from guestd.output.capture import OutputCapture
from guestd.wire.errors import GuestdError
from guestd.wire.frames import (
    HEADER_SIZE,
    READ_SIZE,
    Frame,
    FrameDecoder,
    FramingError,
    Kind,
    OversizeFrame,
    encode_frame,
)
from guestd.wire.messages import decode_body
from guestd.wire.schema import OPS, OPS_BY_NAME, schema_json, validate, validate_args
from guestd.wire.vectors import document, from_json_value
from tests.strategies import msgpack_values

PROTOCOL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "protocol")


def load(rel: str) -> Any:
    with open(os.path.join(PROTOCOL, rel)) as f:
        return json.load(f)


VECTORS = load("vectors/v1.json")


def test_schema_snapshot_matches_the_code() -> None:
    with open(os.path.join(PROTOCOL, "schema/v1.json")) as f:
        assert f.read() == schema_json(), "run: python -m guestd.wire.schema > protocol/schema/v1.json"


def test_vectors_file_matches_the_generator() -> None:
    assert json.loads(json.dumps(document())) == VECTORS


@pytest.mark.parametrize("vec", VECTORS["frames"], ids=lambda v: v["name"])
def test_vector_decodes_to_its_meaning(vec: dict[str, Any]) -> None:
    raw = bytes.fromhex(vec["hex"])
    dec = FrameDecoder()
    for i in range(len(raw)):  # byte by byte: the worst split
        dec.feed(raw[i : i + 1])
        if i < len(raw) - 1:
            assert dec.next_frame() is None
    frame = dec.next_frame()
    assert isinstance(frame, Frame)
    assert frame.kind == Kind[vec["kind"].upper()] and frame.id == vec["id"]
    assert decode_body(frame.payload) == from_json_value(vec["body"])


@pytest.mark.parametrize("vec", VECTORS["frames"], ids=lambda v: v["name"])
def test_vector_encodes_to_its_bytes(vec: dict[str, Any]) -> None:
    body = from_json_value(vec["body"])
    assert encode_frame(Kind[vec["kind"].upper()], vec["id"], body).hex() == vec["hex"]


@pytest.mark.parametrize("vec", VECTORS["bad_streams"], ids=lambda v: v["name"])
def test_bad_streams(vec: dict[str, Any]) -> None:
    dec = FrameDecoder(vec.get("max_frame", 4 << 20))
    dec.feed(bytes.fromhex(vec["hex"]))
    if vec["expect"] == "framing_error":
        with pytest.raises(FramingError):
            dec.next_frame()
        return
    frame = dec.next_frame()
    if vec["expect"] == "oversize":
        assert frame == OversizeFrame(Kind.REQUEST, vec["id"], vec["length"])
        return
    assert isinstance(frame, Frame) and frame.id == vec["id"]
    with pytest.raises(GuestdError) as ei:
        decode_body(frame.payload)
    assert ei.value.code == "bad_request"
    if "details" in vec:
        assert ei.value.details == vec["details"]


@pytest.mark.parametrize("vec", VECTORS["accepted"], ids=lambda v: v["name"])
def test_accepted_frames_decode_to_their_meaning_and_validate(vec: dict[str, Any]) -> None:
    """Frames guestd never writes but must take (float32 for a float field, issue 32 rule 4)."""
    dec = FrameDecoder()
    dec.feed(bytes.fromhex(vec["hex"]))
    frame = dec.next_frame()
    assert isinstance(frame, Frame) and frame.id == vec["id"] and frame.kind == Kind[vec["kind"].upper()]
    body = decode_body(frame.payload)
    assert body == from_json_value(vec["body"])
    spec = OPS_BY_NAME[body["op"]]
    assert validate_args(spec, body["args"]) == validate_args(spec, from_json_value(vec["body"])["args"])
    assert encode_frame(frame.kind, frame.id, body).hex() != vec["hex"]  # guestd itself sends float64


def test_oversize_body_is_skipped_without_buffering() -> None:
    dec = FrameDecoder(max_frame=1000)
    big = encode_frame(Kind.REQUEST, 3, {"op": "x", "pad": b"z" * 5000})
    after = encode_frame(Kind.REQUEST, 4, {"op": "ping"})
    dec.feed(big[:100])
    assert isinstance(dec.next_frame(), OversizeFrame)
    for i in range(100, len(big), 64):
        dec.feed(big[i : i + 64])
        assert dec.next_frame() is None
        assert dec.buffered == 0  # nothing of the oversize body is kept
    dec.feed(after)
    frame = dec.next_frame()
    assert isinstance(frame, Frame) and frame.id == 4


def test_serial_resync_finds_the_next_header() -> None:
    dec = FrameDecoder()
    good = encode_frame(Kind.HELLO, 0, {"versions": [1]})
    dec.feed(b"noise\x00\xffGD" + good)
    with pytest.raises(FramingError):
        dec.next_frame()
    while True:
        dec.resync()
        try:
            frame = dec.next_frame()
            break
        except FramingError:
            continue
    assert isinstance(frame, Frame) and frame.kind == Kind.HELLO


@settings(max_examples=200, deadline=None)
@given(
    frames=st.lists(
        st.tuples(
            st.sampled_from(list(Kind)),
            st.integers(0, 2**32 - 1),
            st.dictionaries(st.text(max_size=8), msgpack_values, max_size=5),
        ),
        min_size=1,
        max_size=6,
    ),
    cuts=st.lists(st.integers(1, 50), max_size=30),
)
def test_frames_round_trip_across_arbitrary_splits(
    frames: list[tuple[Kind, int, dict[str, Any]]], cuts: list[int]
) -> None:
    stream = b"".join(encode_frame(k, i, b) for k, i, b in frames)
    dec = FrameDecoder()
    out = []
    pos = 0
    for c in [*cuts, len(stream)]:
        dec.feed(stream[pos : pos + c])
        pos += c
        while (f := dec.next_frame()) is not None:
            assert isinstance(f, Frame)
            out.append((f.kind, f.id, decode_body(f.payload)))
    dec.feed(stream[pos:])
    while (f := dec.next_frame()) is not None:
        assert isinstance(f, Frame)
        out.append((f.kind, f.id, decode_body(f.payload)))
    assert out == [(int(k), i, b) for k, i, b in frames]


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.sampled_from([0, 5, 1000, 70_000, 200_000, 300_000]), min_size=1, max_size=8),
    reads=st.lists(st.integers(1, 150_000), max_size=40),
)
def test_frames_read_into_the_decoder_buffer(sizes: list[int], reads: list[int]) -> None:
    # The BufferedProtocol path: reads land in get_buffer's view, capped at arbitrary sizes
    # (a socket returns what it has). Frames above max_frame are skipped, those after them
    # arrive intact, and no payload is ever a frame's neighbour's bytes.
    max_frame = 250_000
    bodies = [{"n": i, "data": bytes([i % 251]) * n} for i, n in enumerate(sizes)]
    stream = b"".join(encode_frame(Kind.EVENT, i + 1, b) for i, b in enumerate(bodies))
    dec = FrameDecoder(max_frame)
    out: list[object] = []
    pos = 0
    cuts = iter(reads)
    while pos < len(stream):
        view = dec.get_buffer()
        assert len(view) > 0
        k = min(len(view), next(cuts, 150_000), len(stream) - pos)
        view[:k] = stream[pos : pos + k]
        pos += k
        dec.buffer_updated(k)
        assert dec.buffered <= max_frame + HEADER_SIZE + READ_SIZE
        while (f := dec.next_frame_view()) is not None:
            out.append(f.id if isinstance(f, OversizeFrame) else decode_body(f.payload))
    expected = [
        i + 1 if len(encode_frame(Kind.EVENT, 0, b)) - HEADER_SIZE > max_frame else b for i, b in enumerate(bodies)
    ]
    assert out == expected
    assert dec.buffered == 0


@settings(max_examples=300, deadline=None)
@given(
    chunks=st.lists(st.binary(max_size=300), max_size=40),
    limit=st.integers(0, 700),
    mode=st.sampled_from(["tail", "head_tail"]),
)
def test_capture_keeps_exact_ends_and_counts(chunks: list[bytes], limit: int, mode: str) -> None:
    cap = OutputCapture(limit, mode)
    for c in chunks:
        cap.feed(c)
    full = b"".join(chunks)
    data = cap.data()
    assert cap.total == len(full)
    assert len(data) == min(limit, len(full))
    assert cap.dropped == len(full) - len(data)
    if cap.dropped == 0:
        assert data == full and cap.gap_at is None
    else:
        gap = cap.gap_at
        assert gap is not None
        assert data[:gap] == full[:gap]
        assert data[gap:] == full[len(full) - (len(data) - gap) :]
        assert gap == (limit // 2 if mode == "head_tail" else 0)


def test_validate_fills_defaults_and_ignores_unknown_fields() -> None:
    spec = {op.name: op for op in OPS}["exec"]
    args = validate(spec.args, {"argv": ["true"], "from_the_future": 1})
    assert args["max_output"] == 65536 and args["capture"] == "tail" and "from_the_future" not in args
    with pytest.raises(GuestdError) as ei:
        validate(spec.args, {"argv": ["true"], "max_output": True})
    assert ei.value.details["field"] == "max_output"


def test_every_op_documents_its_args_and_results() -> None:
    for op in OPS:
        assert op.doc and op.capability
        for f in (*op.args, *op.result, *op.events, *op.input):
            assert f.doc, f"{op.name}.{f.name} has no doc"


def test_protocol_md_op_reference_is_current() -> None:
    from guestd.wire.docs import render_into

    with open(os.path.join(PROTOCOL, "PROTOCOL.md")) as f:
        text = f.read()
    assert text == render_into(text), "run: python -m guestd.wire.docs"


@settings(max_examples=300, deadline=None)
@given(
    chunks=st.lists(st.binary(min_size=0, max_size=120), max_size=40),
    capacity=st.integers(1, 200),
    reads=st.lists(st.tuples(st.integers(0, 3000), st.integers(1, 300)), max_size=10),
)
def test_ring_holds_exactly_the_last_bytes_by_offset(
    chunks: list[bytes], capacity: int, reads: list[tuple[int, int]]
) -> None:
    from guestd.output.capture import OutputRing

    ring = OutputRing(capacity)
    for c in chunks:
        ring.write(c)
    full = b"".join(chunks)
    assert ring.total == len(full) and ring.start == max(0, len(full) - capacity)
    for offset, limit in reads:
        data, at, lost = ring.read(offset, limit)
        start = max(0, len(full) - capacity)
        assert lost == max(0, start - offset)
        assert at == min(max(offset, start), len(full))
        assert data == full[at : at + limit]


def test_generated_types_are_current() -> None:
    from guestd.wire.codegen import render, types_path

    with open(types_path()) as f:
        assert f.read() == render(), "run: python -m guestd.wire.codegen"


def _generated_classes() -> dict[str, tuple[list[str], dict[str, bool], bool]]:
    """Every class of the generated types: (its TypedDict bases, its own fields -> required, closed)."""
    import ast

    from guestd.wire.codegen import render

    out = {}
    for node in ast.walk(ast.parse(render())):  # the closed types under TYPE_CHECKING included
        if isinstance(node, ast.ClassDef):
            bases = [b.id for b in node.bases if isinstance(b, ast.Name) and b.id != "TypedDict"]
            own = {
                s.target.id: not ast.unparse(s.annotation).startswith("NotRequired[")
                for s in node.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            }
            closed = any(k.arg == "closed" and ast.literal_eval(k.value) is True for k in node.keywords)
            out[node.name] = (bases, own, closed)
    return out


def test_generated_types_through_their_group_bases_are_each_message_with_its_required_ness() -> None:
    """Each reply, event, input and record type, its group bases' fields included, has exactly the
    message's fields, NotRequired where the schema's field is not required; a group's fields come
    only from its base (the reply composes from the group's producer); args types list every
    field, all present. The runtime cannot show this (3.11 reads NotRequired only from evaluated
    annotations, and the module's are strings), so the generated source is read."""
    from guestd.wire.codegen import camel, group_base
    from guestd.wire.schema import GROUPS, RECORDS, F, groups_of

    classes = _generated_classes()

    def flat(name: str) -> dict[str, bool]:
        bases, own, _ = classes[name]
        out: dict[str, bool] = {}
        for base in bases:
            inherited = flat(base)
            assert not set(inherited) & set(out), f"{name}: bases overlap"
            out.update(inherited)
        assert not set(own) & set(out), f"{name} declares again a field of its bases"
        return {**out, **own}

    def check(name: str, fields: tuple[F, ...], bases: list[str]) -> None:
        assert flat(name) == {f.name: f.required for f in fields}, name
        assert classes[name][0] == bases, name

    messages = [(f"{camel(n)}Record", fields) for n, fields in RECORDS.items()]
    for op in OPS:
        messages += [(f"{camel(op.name)}Reply", op.result)]
        messages += [(f"{camel(op.name)}Event", op.events)] if op.events else []
        messages += [(f"{camel(op.name)}Input", op.input)] if op.input else []
        assert flat(f"{camel(op.name)}Args") == {f.name: True for f in op.args}
    for name, fields in messages:
        check(name, fields, [group_base(g) for g in groups_of(name, fields)])
    assert {g for _, fields in messages for f in fields if (g := f.group)} == set(GROUPS)  # each one used
    for name, group in GROUPS.items():
        check(group_base(name), group.fields, [])
        assert classes[camel(name)] == ([group_base(name)], {}, True)  # alone: closed, nothing added
    assert flat("ExecReply")["stdout"] and not flat("ExecReply")["killed_by"]  # required-ness through a base


def test_a_message_has_a_group_whole_and_a_group_has_one_shape() -> None:
    from guestd.wire.schema import GROUPS, F, Group, groups_of

    figures = GROUPS["run_figures"].fields
    untagged = tuple(f.with_group(None) for f in figures)
    assert groups_of("whole", (F("pid", "int", "", True), *figures)) == ("run_figures",)
    with pytest.raises(AssertionError, match="part of group run_figures"):
        groups_of("part", figures[:2])
    with pytest.raises(AssertionError, match="declared twice"):
        Group("run_figures", GROUPS["run_figures"].doc, untagged[:2])  # another shape, the same name
    with pytest.raises(AssertionError, match="already in group"):
        Group("nested", "", figures)
    assert list(GROUPS) == [
        "run_figures",
        "ring_starts",
        "spill_files",
        "captured_output",
        "reported_changes",
        "kept_run_id",
    ]


@pytest.mark.parametrize(("op", "args"), [("exec", {"argv": ["true"]}), ("shell.run", {"id": "s", "command": "true"})])
def test_spill_with_stream_is_refused_by_the_schema_naming_spill(op: str, args: dict[str, Any]) -> None:
    """The rule the exec and shell.run handlers checked by hand, as the ops' exclusive: refused in
    validate_args, before any handler (the error frame is the same: bad_request, field spill)."""
    spec = OPS_BY_NAME[op]
    assert ("stream", "spill") in spec.exclusive
    with pytest.raises(GuestdError) as ei:
        validate_args(spec, {**args, "spill": True, "stream": True})
    assert (ei.value.code, ei.value.details) == ("bad_request", {"field": "spill"})
    for alone in (
        {"spill": True},
        {"stream": True},
        {"spill": True, "stream": False},
        {"spill": False, "stream": True},
    ):
        validate_args(spec, {**args, **alone})
