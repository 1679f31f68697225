"""Hypothesis strategies for protobuf messages, built from their descriptors (no kept library
does this: hypothesis-protobuf and hypothesis-pb were last released in 2015 and 2019, for
protobuf 3). Every field of every kind: numbers over their whole range with their edges
(0, -1, the extremes; NaN, the infinities and -0.0 for floats), text over all of Unicode but
surrogates (a proto string is UTF-8: the client library refuses them before sending), open
enums with numbers no value has, oneofs with one member or none, maps, nested messages to a
depth, and now and then a huge string or list, within gRPC's message size.

    messages(pb.GenerateRequest, Sizes(huge=1 << 16),
             {"pagoda.v1.GenerateRequest.prompt_token_ids": st.lists(st.integers(0, 999))})

An override replaces the value strategy of the field it names (its full name) and sets it
always, or with None leaves it unset. Tame messages set each field one time in eight instead of one in two,
with small numbers and printable text. Both steer some of the requests past the first checks,
deeper into the server."""
from __future__ import annotations

from dataclasses import dataclass, replace

from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import strategies as st

F = FieldDescriptor


@dataclass(frozen=True)
class Sizes:
    items: int = 4         # entries of a repeated field or a map, usually
    text: int = 24         # characters of a string, bytes of a bytes field, usually
    huge: int = 1 << 12    # now and then a string or list this long (at most)
    depth: int = 3         # nested messages; deeper ones are left empty
    tame: bool = False     # few fields, small values


_INT_RANGES = {
    F.TYPE_INT32: (-(1 << 31), (1 << 31) - 1), F.TYPE_SINT32: (-(1 << 31), (1 << 31) - 1),
    F.TYPE_SFIXED32: (-(1 << 31), (1 << 31) - 1), F.TYPE_UINT32: (0, (1 << 32) - 1),
    F.TYPE_FIXED32: (0, (1 << 32) - 1), F.TYPE_INT64: (-(1 << 63), (1 << 63) - 1),
    F.TYPE_SINT64: (-(1 << 63), (1 << 63) - 1), F.TYPE_SFIXED64: (-(1 << 63), (1 << 63) - 1),
    F.TYPE_UINT64: (0, (1 << 64) - 1), F.TYPE_FIXED64: (0, (1 << 64) - 1),
}
_CHARACTERS = st.characters(exclude_categories=("Cs",))


def _integers(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = sorted({v for v in (0, 1, -1, 2, lo, lo + 1, hi, hi - 1, (1 << 31) - 1,
                                (1 << 32) - 1, 1 << 31) if lo <= v <= hi})
    small = st.integers(max(lo, -1000), min(hi, 1000))
    return st.one_of(st.sampled_from(edges), small, st.integers(lo, hi))


def _text(sizes: Sizes) -> st.SearchStrategy[str]:
    short = st.text(_CHARACTERS, max_size=sizes.text)
    huge = st.builds(lambda piece, n: (piece * n)[:sizes.huge],
                     st.text(_CHARACTERS, min_size=1, max_size=3), st.integers(1, sizes.huge))
    return st.one_of(short, short, short, huge)


def _binary(sizes: Sizes) -> st.SearchStrategy[bytes]:
    return st.one_of(st.binary(max_size=sizes.text),
                     st.builds(lambda n: b"\xff" * n, st.integers(0, sizes.huge)))


def _tame(field: FieldDescriptor) -> st.SearchStrategy | None:
    if field.type in _INT_RANGES:
        return st.integers(max(-1, _INT_RANGES[field.type][0]), 64)
    if field.type in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        return st.floats(-0.5, 2.0)
    if field.type == F.TYPE_STRING:
        return st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=12)
    return None


def _scalar(field: FieldDescriptor, sizes: Sizes) -> st.SearchStrategy:
    tame = _tame(field) if sizes.tame else None
    if tame is not None:
        return tame
    if field.type in _INT_RANGES:
        return _integers(*_INT_RANGES[field.type])
    if field.type == F.TYPE_FLOAT:
        return st.one_of(st.sampled_from([0.0, -0.0, 1.0, -1.0, float("nan"), float("inf"),
                                          float("-inf"), 3.4028234663852886e38]),
                         st.floats(width=32))
    if field.type == F.TYPE_DOUBLE:
        return st.one_of(st.sampled_from([0.0, -0.0, float("nan"), float("inf"), float("-inf")]),
                         st.floats())
    if field.type == F.TYPE_BOOL:
        return st.booleans()
    if field.type == F.TYPE_STRING:
        return _text(sizes)
    if field.type == F.TYPE_BYTES:
        return _binary(sizes)
    if field.type == F.TYPE_ENUM:  # proto3 enums are open: any int32 travels
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]),
                         _integers(-(1 << 31), (1 << 31) - 1))
    raise TypeError(f"no strategy for {field.full_name} (type {field.type})")


def _lists(element: st.SearchStrategy, sizes: Sizes, short: st.SearchStrategy | None
           ) -> st.SearchStrategy[list]:
    """short: the elements of a huge list (no huge list of huge strings), None: never huge."""
    usual = st.lists(element, max_size=sizes.items)
    if short is None:
        return usual
    many = st.builds(lambda items, n: (items * n)[:sizes.huge],
                     st.lists(short, min_size=1, max_size=3), st.integers(1, sizes.huge))
    return st.one_of(usual, usual, usual, many)


def _is_map(field: FieldDescriptor) -> bool:
    return field.type == F.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


def _value(field: FieldDescriptor, sizes: Sizes, overrides: dict, depth: int) -> st.SearchStrategy:
    """The strategy for what the field holds: a list for a repeated one, a dict for a map."""
    if field.full_name in overrides:
        return overrides[field.full_name]
    if _is_map(field):
        key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
        return st.dictionaries(_scalar(key, sizes), _single(value, sizes, overrides, depth),
                               max_size=sizes.items)
    one = _single(field, sizes, overrides, depth)
    if field.is_repeated:
        return _lists(one, sizes, None if field.type == F.TYPE_MESSAGE else
                      _scalar(field, replace(sizes, huge=sizes.text)))
    return one


def _single(field: FieldDescriptor, sizes: Sizes, overrides: dict, depth: int) -> st.SearchStrategy:
    if field.type == F.TYPE_MESSAGE:
        return _message(field.message_type, sizes, overrides, depth + 1)
    return _scalar(field, sizes)


def _set(msg, field: FieldDescriptor, value) -> None:
    target = getattr(msg, field.name)
    if _is_map(field):
        if field.message_type.fields_by_name["value"].type == F.TYPE_MESSAGE:
            for k, v in value.items():
                target[k].CopyFrom(v)
        else:
            target.update(value)
    elif field.is_repeated:
        target.extend(value)
    elif field.type == F.TYPE_MESSAGE:
        target.CopyFrom(value)
    else:
        setattr(msg, field.name, value)


def _message(desc: Descriptor, sizes: Sizes, overrides: dict, depth: int) -> st.SearchStrategy:
    cls = message_factory.GetMessageClass(desc)
    if depth > sizes.depth:
        return st.just(cls())
    # proto3 `optional` fields sit in a oneof of their own, "_name": free fields here
    oneofs = [o for o in desc.oneofs if not (len(o.fields) == 1 and o.name == f"_{o.fields[0].name}")]
    in_oneof = {f.name for o in oneofs for f in o.fields}
    # deferred: a message may hold itself, and strategies are only built when drawn from
    free = [(f, st.deferred(lambda f=f: _value(f, sizes, overrides, depth)))
            for f in desc.fields if f.name not in in_oneof and overrides.get(f.full_name, 1) is not None]
    presence = st.integers(0, 7).map(lambda k: k == 0) if sizes.tame else st.booleans()
    groups = [[(f, st.deferred(lambda f=f: _value(f, sizes, overrides, depth))) for f in o.fields]
              for o in oneofs]

    @st.composite
    def build(draw):
        msg = cls()
        for field, values in free:
            if field.full_name in overrides or draw(presence):
                _set(msg, field, draw(values))
        for group in groups:
            k = draw(st.integers(-1, len(group) - 1))
            if k >= 0:
                _set(msg, group[k][0], draw(group[k][1]))
        return msg

    return build()


def messages(cls, sizes: Sizes = Sizes(), overrides: dict | None = None) -> st.SearchStrategy:
    """Messages of the class cls (a generated protobuf class)."""
    return _message(cls.DESCRIPTOR, sizes, overrides or {}, 0)
