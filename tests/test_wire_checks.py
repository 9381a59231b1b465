"""The receivers' checks made cheap for the common case must refuse exactly what the full ones
refuse (issue 34: of an exec reply, the decoded-size walk took 5.5 us and validate 8.8 us in
the client; the length bound takes 0.6 us and validate 4.4 us).

- ``bounded_by_length`` lets a reply skip ``decoded_size``'s walk only when the walk could not
  have refused it: for any bytes at all, never for a frame that decodes past the limit or nests
  beyond MAX_DEPTH.
- ``validate`` with its per-field ``FieldCheck`` gives, for every field of every op and record
  and a spread of values, the value or the error that ``check_value`` and the constraints give.
"""

from __future__ import annotations

from collections.abc import Callable

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from guestd.wire.errors import GuestdError
from guestd.wire.messages import (
    LENGTH_BOUND_MAX,
    MAX_DEPTH,
    OBJECT_COST,
    bounded_by_length,
    decode_body,
    decoded_size,
)
from guestd.wire.schema import OPS, RECORDS, F, FieldCheck, _check_constraints, check_value, validate
from tests.strategies import msgpack_values


def _walk_refuses(payload: bytes, limit: int) -> bool:
    try:
        decoded_size(payload, limit)
    except GuestdError:
        return True
    return False


@settings(max_examples=3000, deadline=None)
@given(st.binary(max_size=400), st.integers(min_value=0, max_value=40_000))
def test_the_length_bound_never_passes_what_the_walk_refuses_any_bytes(payload: bytes, limit: int) -> None:
    if bounded_by_length(payload, limit):
        assert not _walk_refuses(payload, limit)


@settings(max_examples=1500, deadline=None)
@given(st.dictionaries(st.text(max_size=8), msgpack_values, max_size=6), st.integers(min_value=0, max_value=20_000))
def test_the_length_bound_never_passes_what_the_walk_refuses_msgpack(body: dict[str, object], limit: int) -> None:
    payload = msgpack.packb(body)
    if bounded_by_length(payload, limit):
        assert not _walk_refuses(payload, limit)


def test_nesting_past_the_depth_is_never_taken_on_length_alone() -> None:
    deep: object = 1
    for _ in range(MAX_DEPTH):  # with the top-level map: one level more than MAX_DEPTH
        deep = [deep]
    payload = msgpack.packb({"v": deep})
    assert not bounded_by_length(payload, 1 << 30)
    assert _walk_refuses(payload, 1 << 30)
    shallow: object = 1
    for _ in range(MAX_DEPTH - 1):
        shallow = [shallow]
    payload = msgpack.packb({"v": shallow})  # the top-level map is a level too
    assert bounded_by_length(payload, 1 << 30) and not _walk_refuses(payload, 1 << 30)


def test_a_frame_that_could_decode_past_the_limit_is_walked() -> None:
    empty_maps = b"\x80" * 1000  # each 1 byte that decodes to a 64-byte dict
    payload = b"\xdc" + len(empty_maps).to_bytes(2, "big") + empty_maps
    limit = 1000 * OBJECT_COST  # the walk counts the list too: 1001 objects
    assert not bounded_by_length(payload, limit)
    assert _walk_refuses(payload, limit)


def _all_fields() -> list[F]:
    fields: list[F] = []
    for spec in OPS:
        fields += [*spec.args, *spec.result, *spec.events, *spec.input]
    for record in RECORDS.values():
        fields += record
    return fields


class _Limits:
    def __getattr__(self, name: str) -> int:
        return 1000


_SAMPLES: list[object] = [
    None, True, False, 0, 1, -1, 7, 10**6, 2**64, 0.5, -2.5, float("inf"), float("nan"), "", "x", "SIGTERM",
    "kill", "utf-8", b"", b"\xff", [], ["a"], [1, 2], [-1], [b"p"], [{}], {}, {"a": "b"}, {"a": 1}, {1: 2},
    [{"path": "p", "kind": "file"}],
]  # fmt: skip


def _reference(f: F, value: object, limits: object) -> object:
    """What validate gave before FieldCheck: check_value, then the constraints."""
    checked = check_value(f.name, f.type, value)
    if checked is not None:
        _check_constraints(f, checked, limits)
    return checked


def _validated(f: F, body: dict[str, object], limits: object) -> object:
    return validate((f,), body, limits)


def _outcome(call: Callable[..., object], *args: object) -> tuple[object, ...]:
    try:
        return ("ok", repr(call(*args)))
    except GuestdError as err:
        return ("error", err.code, err.message, err.details)


@pytest.mark.parametrize("limits", [None, _Limits()], ids=["no limits", "limits"])
def test_validate_gives_what_check_value_and_the_constraints_give(limits: object) -> None:
    fields = _all_fields()
    assert len(fields) > 300
    for f in fields:
        for value in _SAMPLES:
            got = _outcome(_validated, f, {f.name: value}, limits)
            want = _outcome(lambda f, value: {f.name: _reference(f, value, limits)}, f, value)
            assert got == want, (f, value)
        absent = _outcome(_validated, f, {}, limits)
        if f.required:
            assert absent[0] == "error" and "missing required field" in str(absent[2])
        else:
            assert absent == ("ok", repr({f.name: f.default}))


def _decoding_peak(payload: bytes) -> int:
    """What decode_body's unpackb allocates at most for ``payload`` (tracemalloc sees msgpack's
    lists and objects: they come from Python's allocators), whether it decodes or fails."""
    import tracemalloc

    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        try:
            decode_body(payload)
        except GuestdError:
            pass  # truncated: the point is what it held before it gave up
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize(
    "depth, claim, size",
    [(63, 4000, 4096), (30, 2000, 2048), (8, 4000, 4096), (63, 8000, 8192), (63, 20000, 20000), (1, 60000, 60000)],
)
def test_lists_sized_from_their_headers_are_in_the_estimate(depth: int, claim: int, size: int) -> None:
    """A few KiB of nested array32 headers, each claiming up to the payload's length and then
    cut short: msgpack sizes each list from its header before any item, so the walk must count
    those slots (it counted 0.5 MiB where decoding held ~4 MiB: a helper's review)."""
    payload = b"\x81\xa1v" + (b"\xdd" + claim.to_bytes(4, "big")) * depth
    payload += b"\x00" * (size - len(payload))
    estimate = decoded_size(payload, 1 << 40)
    assert _decoding_peak(payload) <= estimate
    assert not bounded_by_length(payload, estimate - 1)
    with pytest.raises(GuestdError, match="decodes to more than"):
        decoded_size(payload, estimate - 1)


def test_a_field_stays_picklable_and_equal_once_its_check_is_cached() -> None:
    import pickle

    fields = [f for f in _all_fields() if f.type.rstrip("?") in RECORDS or f.type.startswith(("list<", "enum"))]
    assert len(fields) > 20
    for f in fields:
        _outcome(_validated, f, {f.name: 12345}, None)  # makes and keeps its FieldCheck
        assert isinstance(f.check, FieldCheck)
        copy = pickle.loads(pickle.dumps(f))
        assert copy == f  # (a field whose default is a list has no hash, as before)


def test_a_long_reply_is_walked_not_scanned() -> None:
    """The length bound looks at every byte; the walk steps over a str or bin whole. A reply
    carrying data (file.read's) is walked: scanning 256 KiB cost 370 us where the walk costs 2."""
    data = msgpack.packb({"data": b"a" * (LENGTH_BOUND_MAX + 1)})
    assert not bounded_by_length(data, 1 << 40)
    assert bounded_by_length(msgpack.packb({"data": b"a" * (LENGTH_BOUND_MAX - 20)}), 1 << 40)


@pytest.mark.parametrize(
    "last, limit",
    [(b"\xdd\x00\x00\x10\x00", 200), (b"\xd9\x50" + b"s" * 0x50, 250)],
    ids=["a list's slots", "a str's bytes"],
)
def test_what_the_last_object_adds_is_held_to_the_limit(last: bytes, limit: int) -> None:
    """The walk checks the limit as each object starts; what the object then adds (its content,
    a list's slots) was not checked when it was the payload's last (a helper's review)."""
    payload = b"\x81\xa1v" + last
    assert limit > 3 * OBJECT_COST  # the three objects alone are within it
    with pytest.raises(GuestdError, match="decodes to more than"):
        decoded_size(payload, limit)


def test_content_past_the_payloads_end_is_not_charged() -> None:
    """A str or bin claiming more bytes than the payload holds is refused by the decoder, never
    built: only the bytes present count (else a 5-byte claim of 4 GiB would read as 4 GiB)."""
    for claim in (b"\xdb\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff", b"\xc9\xff\xff\xff\xff\x01"):
        assert decoded_size(b"\x81\xa1v" + claim, 1 << 20) <= 4 * OBJECT_COST
