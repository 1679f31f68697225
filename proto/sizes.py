"""The largest valid message of each kind on the internal sockets, computed from the receiving
process's config, so each ZeroMQ socket's ZMQ_MAXMSGSIZE refuses nothing valid and lets nothing
much larger in (a larger frame makes ZeroMQ drop the connection; the peer reconnects).

Protobuf sizes: a length-delimited field costs 1-2 tag bytes + a varint length + its bytes; a
varint at most 5 bytes (10 for 64-bit); a column entry 4; a float 4. Each function counts every
field at the most the checks of the receiver (scheduler/message_checks.py,
worker/step/plan_checks.py, gateway/scheduler_link/scheduler_checks.py) let through, and `with_margin` adds MARGIN
for what is counted loosely.
"""
from __future__ import annotations

MAX_ID_BYTES = 1024           # request ids, worker ids, salts, model names
MAX_LIST = 4096               # stop ids, eos ids, abort lists, logit_bias entries, logprobs
# Sequences of one request on the internal links (AddRequest.n, an abort's indices): far above
# what a client may ask for (gateway/validation/limits.py MAX_N, MAX_BEAM_WIDTH below).
MAX_REQUEST_SEQUENCES = 256
MAX_BEAM_WIDTH = 16           # beams of one search: the public bound, checked by both ends
MAX_LEN = 1 << 20             # max_model_len, max_tokens, positions, token counts, vocab size
MAX_LOGPROBS = 64             # alternatives per position: the scheduler refuses more
MAX_TEMPERATURE = 1e6         # sampling: the scheduler refuses more, the gateway refuses it first
# Presence and frequency (either sign), repetition: likewise; far above the public bound for
# presence and frequency (gateway/validation/validate.py MAX_PENALTY, 2).
MAX_PENALTY_INTERNAL = 1000.0
MAX_TOP_K = 1 << 20           # likewise
MAX_TEXT = 4096               # error and refusal messages to a gateway
MAX_WORKERS = 1024            # registered with one scheduler at once
MAX_STRUCTURED_OUTPUT = 64 << 10  # bytes of one SamplingConfig.structured_output (its spec)
MAX_SPECULATIVE_TOKENS = 16   # proposals a worker may verify per sequence and step
DEFAULT_MAX_MODEL_LEN = 8192  # the longest a worker takes without --max-model-len
# The scheduler cuts what it sends a gateway into messages of at most this many bytes of
# entries (scheduler/outbox.py), and logprobs into entries of at most this many positions.
DELTA_BATCH_BYTES = 1 << 20
LOGPROBS_POSITIONS = 512
MARGIN = 64 << 10             # plus a quarter: scalars, tags and varint widths counted loosely
_SCALARS = 256                # the scalar fields of any one message


def worker_load_bytes() -> int:
    """One GetLoads WorkerLoad: an id, five counters and a double, three 64-bit counters, the
    accepted count at each draft position and two doubles (the speculation's)."""
    return _field(MAX_ID_BYTES) + 5 * 6 + 9 + 3 * 11 + _field(10 * MAX_SPECULATIVE_TOKENS) + 2 * 9


def with_margin(n: int) -> int:
    return n + n // 4 + MARGIN


def _varint(n: int) -> int:
    return max(1, (n.bit_length() + 6) // 7)


def _field(payload: int) -> int:
    """A length-delimited field of `payload` bytes."""
    return 2 + _varint(payload) + payload


def _ids(count: int) -> int:
    """A packed repeated uint32 of `count` values."""
    return _field(5 * count)


def largest_sampling() -> int:
    """A SamplingConfig at scheduler/message_checks.py's limits: MAX_LIST logit_bias entries
    (each an entry message of a uint32 key and a float) and stop ids, a structured output spec,
    and its scalars. (A choice list of n strings costs up to 3 bytes each more than its text.)"""
    spec = _field(MAX_STRUCTURED_OUTPUT + 3 * MAX_LIST)
    return _field(MAX_LIST * _field(1 + 5 + 1 + 4) + _ids(MAX_LIST) + spec + _SCALARS)


def largest_gateway_message(max_model_len: int) -> int:
    """A GatewayMessage, as the scheduler receives it: an AddRequest of max_model_len prompt
    tokens, a Call aborting MAX_LIST ids, or an AbortRequest, whichever is largest."""
    add = (_ids(max_model_len) + largest_sampling() + _ids(MAX_LIST)
           + 3 * _field(MAX_ID_BYTES) + _SCALARS)
    call = _field(MAX_LIST * _field(MAX_ID_BYTES)) + _SCALARS
    abort = _field(MAX_ID_BYTES) + _ids(MAX_REQUEST_SEQUENCES)
    return with_margin(_field(max(add, call, abort)))


def largest_logprobs(positions: int, k: int) -> int:
    """A Logprobs entry of `positions` positions with k alternatives each."""
    return _field(_field(MAX_ID_BYTES) + 3 * _field(4 * positions) + 2 * _field(4 * positions * k)
                  + _SCALARS)


def largest_worker_message(max_num_seqs: int, max_num_batched_tokens: int, max_logprobs: int) -> int:
    """A WorkerMessage, as the scheduler receives it: a StepResult of max_num_seqs sampled tokens,
    each with logprobs, plus prompt logprobs for every token of the step, and a 64 KiB error; or
    a hello, whichever is largest."""
    columns = 2 * _field(4 * max_num_seqs)
    logprobs = (max_num_seqs * largest_logprobs(1, max_logprobs)
                + max_num_seqs * largest_logprobs(0, 0)
                + largest_logprobs(max_num_batched_tokens, max_logprobs))
    result = columns + logprobs + _field(1 << 16) + _SCALARS
    hello = 4 * _field(MAX_ID_BYTES) + _ids(MAX_LIST) + _SCALARS
    return with_margin(_field(max(result, hello)))


def largest_step_plan(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                      block_size: int, num_cpu_blocks: int) -> int:
    """A SchedulerToWorker, as the worker receives it: a StepPlan whose max_num_seqs sequences
    are all new to it, each carrying a context of max_model_len tokens and its whole block
    table; the running and new-block columns full; every slot dropped; every CPU block swapped
    both ways; a copy per sequence."""
    blocks = -(-max_model_len // block_size)
    new_seq = _field(_field(MAX_ID_BYTES + 16) + _ids(max_model_len) + largest_sampling()
                     + _ids(blocks) + _SCALARS)
    copy = _field(2 * 6)
    plan = (max_num_seqs * new_seq + 2 * _field(4 * max_num_seqs)
            + 2 * _field(4 * (max_num_batched_tokens // block_size + 2 * max_num_seqs))
            + _ids(2 * max_num_seqs) + 2 * num_cpu_blocks * copy + max_num_seqs * copy + _SCALARS)
    return with_margin(_field(plan))


def largest_scheduler_message(max_logprobs: int, context_bound: int) -> int:
    """A SchedulerMessage, as a gateway receives it. The scheduler cuts its batches at
    DELTA_BATCH_BYTES (one update may pass it: a token entry of up to context_bound tokens with
    the delta that continues it, a delta with an error, or logprobs of LOGPROBS_POSITIONS
    positions at the gateway's max_logprobs), or it is a reply to a call (MAX_LIST aborted ids,
    or the loads of MAX_WORKERS workers) or cluster info, whichever is largest."""
    token_entry = _field(MAX_ID_BYTES) + 4 * (3 + context_bound)
    news = _field(_field(MAX_ID_BYTES) + _SCALARS)  # usage and a finish: no error joins tokens
    delta = _field(_field(MAX_ID_BYTES) + _field(_field(32) + _field(MAX_TEXT)) + _SCALARS)
    item = max(token_entry + news, delta, largest_logprobs(LOGPROBS_POSITIONS, max_logprobs))
    reply = max(_field(MAX_LIST * _field(MAX_ID_BYTES)),
                MAX_WORKERS * _field(worker_load_bytes() + _SCALARS))
    info = _field(_field(MAX_ID_BYTES) + _ids(MAX_LIST) + _SCALARS)
    return with_margin(max(DELTA_BATCH_BYTES + item, reply) + info + _field(MAX_TEXT) + _SCALARS)
