"""proto/columns.py and proto/codec.py: int32 byte columns and the gateway's view of them."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, strategies as st

from proto import internal_pb2 as pb
from proto.codec import expand_deltas
from proto.columns import pack, unpack, unpack_list
from scheduler.outbox import Outbox

int32s = st.lists(st.integers(-2 ** 31, 2 ** 31 - 1), max_size=300)


@given(int32s)
def test_pack_unpack_round_trip(values):
    assert unpack_list(pack(values)) == values
    assert unpack_list(pack(np.array(values, dtype=np.int64))) == values
    assert len(pack(values)) == 4 * len(values)


def test_a_column_of_odd_length_is_an_error():
    with pytest.raises(ValueError, match="int32"):
        unpack(b"\x01\x02\x03")


@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 3),
                          st.lists(st.integers(0, 50000), min_size=1, max_size=4)), max_size=30))
def test_outbox_entries_arrive_in_order(entries):
    """The gateway must see a stream's tokens in the order the scheduler added them."""
    box = Outbox()
    for offset, (rid, index, tokens) in enumerate(entries):
        box.add(rid, index, tokens, offset)
    msg = pb.SchedulerMessage.FromString(box.to_message().SerializeToString())
    got = [(d.request_id, d.index, list(d.token_ids), d.offset) for d in expand_deltas(msg)]
    assert got == [(rid, index, tokens, offset) for offset, (rid, index, tokens) in enumerate(entries)]


def test_misaligned_columns_are_refused():
    msg = pb.SchedulerMessage(request_ids=["a", "b"], indices=pack([0, 0]), num_tokens=pack([1, 2]),
                              token_ids=pack([5, 6]), offsets=pack([0, 0]))
    with pytest.raises(ValueError, match="line up"):
        expand_deltas(msg)
