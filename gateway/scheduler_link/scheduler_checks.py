"""Range checks on every message the gateway receives from the scheduler, in one place (as
scheduler/message_checks.py and worker/step/plan_checks.py are for theirs).

The scheduler is authenticated (proto/auth.py), but a bug there, or a frame from a wrong build,
must not crash the gateway's one read loop, nor hang or garble a stream: each function returns
why a message or one of its parts is unacceptable (naming the field), or None. The read loop
(gateway/scheduler_link/scheduler_client.py) drops a bad message whole when its envelope is bad (nothing in it
can be trusted to belong to anyone), and otherwise drops only the bad part: a stream whose own
token entry, delta or logprobs failed ends with INTERNAL and a short message, every other
stream goes on.
"""
from __future__ import annotations

import math

import grpc

from proto import internal_pb2 as pb
from proto.columns import unpack, unpack_f32
from proto.sizes import MAX_ID_BYTES, MAX_LEN, MAX_LIST, MAX_TEXT
from proto.token_stream import Columns, Update

MAX_COUNT = 1 << 20        # preemptions
MAX_EPOCH = 1 << 63        # the scheduler draws its epoch from [1, 2**63]
MAX_SEQ = 1 << 62
_FINISHES = frozenset(pb.Finish.values())
_CODES = frozenset(c.name for c in grpc.StatusCode if c != grpc.StatusCode.OK)


def _int(name: str, value: int, lo: int, hi: int) -> str | None:
    return None if lo <= value <= hi else f"{name} = {value} is outside [{lo}, {hi}]"


def _text(name: str, value: str, limit: int) -> str | None:
    size = len(value.encode())
    return None if size <= limit else f"{name} is {size} bytes (at most {limit})"


def _first(*whys: str | None) -> str | None:
    return next((w for w in whys if w is not None), None)


def _ids(name: str, ids, vocab_size: int) -> str | None:
    if not len(ids):
        return None
    lo, hi = min(ids), max(ids)
    if lo < 0 or (vocab_size and hi >= vocab_size):
        return f"{name} holds token {lo if lo < 0 else hi}, outside the vocabulary of {vocab_size}"
    return None


def check_envelope(msg: pb.SchedulerMessage) -> str | None:
    """What makes the whole message untrustworthy: its numbering, its cluster info, its refusal."""
    return _first(_int("epoch", msg.epoch, 1, MAX_EPOCH), _int("seq", msg.seq, 1, MAX_SEQ),
                  _text("refused", msg.refused, MAX_TEXT),
                  check_info(msg.info) if msg.HasField("info") else None,
                  _int("request_ids (count)", len(msg.request_ids), 0, MAX_LEN))


def check_info(info: pb.ClusterInfo) -> str | None:
    if not info.num_workers:
        return None  # nothing else is meaningful without a worker
    return _first(_text("info.model", info.model, MAX_ID_BYTES),
                  _int("info.max_model_len", info.max_model_len, 1, MAX_LEN),
                  _int("info.block_size", info.block_size, 1, 1 << 11),
                  _int("info.vocab_size", info.vocab_size, 1, MAX_LEN),
                  _int("info.eos_token_ids (count)", len(info.eos_token_ids), 0, 4096),
                  _ids("info.eos_token_ids", info.eos_token_ids, info.vocab_size))


def check_columns(columns: Columns, vocab_size: int, max_model_len: int) -> dict[int, str]:
    """The token columns' entries that are malformed (entry -> why): negative fields, tokens
    outside the vocabulary, counts or offsets past max_model_len. One pass over each column;
    only a message that fails one looks for the entries to blame."""
    bad = columns.negative()
    if not len(columns):
        return bad
    tops = columns.entry_max()
    if (vocab_size and tops.max() >= vocab_size) or columns.num_tokens.max() > max_model_len \
            or columns.offsets.max() > max_model_len:
        for i in range(len(columns)):
            why = _first(_int("token_ids (count)", int(columns.num_tokens[i]), 0, max_model_len),
                         _int("offset", int(columns.offsets[i]), 0, max_model_len),
                         f"token_ids holds token {tops[i]}, outside the vocabulary of {vocab_size}"
                         if vocab_size and tops[i] >= vocab_size else None)
            if why is not None:
                bad.setdefault(i, why)
    return bad


def check_update(u: Update, n: int, vocab_size: int, max_model_len: int) -> str | None:
    """One stream's update, its tokens already checked with the columns (check_columns); n: the
    request's sequences."""
    return _first(_int("index", u.index, 0, n - 1),
                  check_news(u.news, max_model_len) if u.news is not None else None)


def check_news(d: pb.TokenDelta, max_model_len: int) -> str | None:
    """A delta: usage, finish and error within range (it holds no tokens: they travel in the
    columns)."""
    error = d.HasField("error")
    return _first(
        None if d.finish in _FINISHES else f"finish = {d.finish} is not a Finish",
        _int("offset", d.offset, 0, max_model_len),
        _int("prompt_tokens", d.prompt_tokens, 0, max_model_len),
        _int("cached_prompt_tokens", d.cached_prompt_tokens, 0, max(d.prompt_tokens, max_model_len)),
        _int("num_preemptions", d.num_preemptions, 0, MAX_COUNT),
        None if math.isfinite(d.queue_time_s) and d.queue_time_s >= 0
        else f"queue_time_s = {d.queue_time_s} is not a duration",
        "finish = ERROR without an error" if d.finish == pb.ERROR and not error else None,
        "an error without finish = ERROR" if error and d.finish != pb.ERROR else None,
        (None if d.error.code in _CODES else f"error.code {d.error.code[:32]!r} is not a status")
        if error else None,
        _text("error.message", d.error.message, MAX_TEXT))


def check_logprobs(lp: pb.Logprobs, n: int, vocab_size: int, max_model_len: int) -> str | None:
    """Columns that line up, tokens in the vocabulary, logprobs <= 0, ranks >= 1."""
    try:
        ids, values, ranks = unpack(lp.token_ids), unpack_f32(lp.logprobs), unpack(lp.ranks)
        top_ids, top_values = unpack(lp.top_token_ids), unpack_f32(lp.top_logprobs)
    except ValueError as e:
        return f"logprobs: {e}"
    if why := _first(_int("logprobs.index", lp.index, 0, n - 1),
                     _int("logprobs.k", lp.k, 0, vocab_size or MAX_LEN),
                     _int("logprobs.first_position", lp.first_position, 0, max_model_len),
                     _int("logprobs (count)", len(ids), 0, max_model_len)):
        return why
    if not len(ids) == len(values) == len(ranks) or not len(top_ids) == len(ids) * lp.k == len(top_values):
        return (f"logprobs columns of {len(ids)} tokens, {len(values)} logprobs, {len(ranks)} ranks, "
                f"{len(top_ids)} top ids and {len(top_values)} top logprobs for k = {lp.k}")
    bad_value = lambda v: len(v) and not (v <= 0).all()  # noqa: E731 - NaN fails too
    return _first(_ids("logprobs.token_ids", ids.tolist(), vocab_size),
                  _ids("logprobs.top_token_ids", top_ids.tolist(), vocab_size),
                  "logprobs.ranks holds a rank below 1" if len(ranks) and ranks.min() < 1 else None,
                  "logprobs.logprobs holds a value above 0 or NaN" if bad_value(values) else None,
                  "logprobs.top_logprobs holds a value above 0 or NaN" if bad_value(top_values) else None)


def check_reply(reply: pb.CallReply) -> str | None:
    return _first(_int("replies.abort.request_ids (count)", len(reply.abort.request_ids), 0, MAX_LIST),
                  *(_text("replies.abort.request_ids[]", r, MAX_ID_BYTES)
                    for r in reply.abort.request_ids))


