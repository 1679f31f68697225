"""proto/columns.py and proto/token_stream.py: int32 byte columns, and the token stream's one
encoder and decoder."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, strategies as st

from proto import internal_pb2 as pb
from proto.columns import pack, unpack, unpack_list
from proto.token_stream import Columns, Writer, updates

int32s = st.lists(st.integers(-2 ** 31, 2 ** 31 - 1), max_size=300)


@given(int32s)
def test_pack_unpack_round_trip(values):
    assert unpack_list(pack(values)) == values
    assert unpack_list(pack(np.array(values, dtype=np.int64))) == values
    assert len(pack(values)) == 4 * len(values)


def test_a_column_of_odd_length_is_an_error():
    with pytest.raises(ValueError, match="int32"):
        unpack(b"\x01\x02\x03")


def wire(box: Writer) -> pb.SchedulerMessage:
    return pb.SchedulerMessage.FromString(box.to_message().SerializeToString())


@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 3),
                          st.lists(st.integers(0, 50000), min_size=1, max_size=4)), max_size=30))
def test_entries_arrive_in_order(entries):
    """The gateway must see a stream's tokens in the order the scheduler added them."""
    box = Writer()
    for offset, (rid, index, tokens) in enumerate(entries):
        box.add(rid, index, tokens, offset)
    got = [(u.request_id, u.index, u.token_ids, u.offset, u.news) for u in updates(wire(box))]
    assert got == [(rid, index, tokens, offset, None)
                   for offset, (rid, index, tokens) in enumerate(entries)]


def test_a_delta_joins_the_tokens_it_continues():
    box = Writer()
    box.add("a", 0, [5, 6], 0)
    box.add("b", 0, [9], 4)
    box.add("f", 0, [3], 0)
    box.add("c", 1, [1, 2, 3], 0)  # a beam's whole output, then its finish
    box.add("e", 0, [8], 0)  # tokens alone
    box.deltas += [pb.TokenDelta(request_id="a", offset=2, finish=pb.LENGTH, prompt_tokens=3),
                   pb.TokenDelta(request_id="b", offset=7, finish=pb.STOP),  # not b's end: alone
                   pb.TokenDelta(request_id="c", index=1, offset=3, finish=pb.LENGTH),
                   pb.TokenDelta(request_id="d", finish=pb.ERROR, error=pb.Error(code="INTERNAL")),
                   # An error stays after the tokens it follows (they are shown first).
                   pb.TokenDelta(request_id="f", offset=1, finish=pb.ERROR,
                                 error=pb.Error(code="INTERNAL"))]
    got = [(u.request_id, u.index, u.offset, u.token_ids, u.finish) for u in updates(wire(box))]
    assert got == [("a", 0, 0, [5, 6], pb.LENGTH), ("b", 0, 4, [9], pb.NOT_FINISHED),
                   ("f", 0, 0, [3], pb.NOT_FINISHED), ("c", 1, 0, [1, 2, 3], pb.LENGTH),
                   ("e", 0, 0, [8], pb.NOT_FINISHED), ("b", 0, 7, [], pb.STOP),
                   ("d", 0, 0, [], pb.ERROR), ("f", 0, 1, [], pb.ERROR)]


def test_misaligned_columns_are_refused():
    msg = pb.SchedulerMessage(request_ids=["a", "b"], indices=pack([0, 0]), num_tokens=pack([1, 2]),
                              token_ids=pack([5, 6]), offsets=pack([0, 0]))
    with pytest.raises(ValueError, match="line up"):
        updates(msg)


def test_negative_entries_are_named_and_can_be_skipped():
    msg = pb.SchedulerMessage(request_ids=["a", "b", "c"], indices=pack([0, 0, 0]),
                              num_tokens=pack([1, 1, 0]), token_ids=pack([5, -6]),
                              offsets=pack([0, 0, -1]))
    columns = Columns(msg)
    bad = columns.negative()
    assert sorted(bad) == [1, 2] and "negative" in bad[1]
    assert [u.request_id for u in updates(msg, columns, bad)] == ["a"]
    assert columns.entry_max().tolist() == [5, -6, -1]
