"""Hypothesis strategies more than one test module draws from."""

from __future__ import annotations

from hypothesis import strategies as st

# Any value msgpack packs and decode_body gives back: nil, bools, 64-bit ints, floats, str, bin,
# and lists and str-keyed maps of them.
msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=64),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
