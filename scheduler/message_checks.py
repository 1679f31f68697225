"""Range checks on every message the scheduler receives, in one place.

Peers are authenticated (proto/auth.py), but a buggy or compromised gateway or worker must not be
able to crash the scheduler or poison other requests: each function returns why a message is
unacceptable (naming the field), or None. The server logs and drops what fails; an AddRequest
that fails is answered INVALID_ARGUMENT. The bounds are far above any real deployment's and far
below what would exhaust memory (a block pool is three lists of num_blocks entries).
"""
from __future__ import annotations

import math

from proto import internal_pb2 as pb
from proto.auth import PROTOCOL_VERSION
from proto.columns import unpack
from proto.sizes import (MAX_BEAM_WIDTH, MAX_ID_BYTES, MAX_LEN, MAX_LIST, MAX_LOGPROBS,
                         MAX_PENALTY_INTERNAL, MAX_REQUEST_SEQUENCES, MAX_SPECULATIVE_TOKENS,
                         MAX_STRUCTURED_OUTPUT, MAX_TEMPERATURE, MAX_TOP_K)

MAX_BLOCKS = 1 << 21          # per pool, device or CPU
MAX_BLOCK_SIZE = 2048


def _text(name: str, value: str, limit: int = MAX_ID_BYTES, required: bool = False) -> str | None:
    size = len(value.encode())
    if required and not size:
        return f"{name} is empty"
    if size > limit:
        return f"{name} is {size} bytes (at most {limit})"
    return None


def _int(name: str, value: int, lo: int, hi: int) -> str | None:
    return None if lo <= value <= hi else f"{name} = {value} is outside [{lo}, {hi}]"


def _float(name: str, value: float, lo: float, hi: float) -> str | None:
    if not math.isfinite(value) or not lo <= value <= hi:
        return f"{name} = {value} is outside [{lo:g}, {hi:g}]"
    return None


def _tokens(name: str, ids, vocab_size: int, limit: int = MAX_LEN) -> str | None:
    if len(ids) > limit:
        return f"{name} has {len(ids)} entries (at most {limit})"
    if vocab_size and ids and max(ids) >= vocab_size:
        return f"{name} holds token {max(ids)}, outside the vocabulary of {vocab_size}"
    return None


def _first(*whys: str | None) -> str | None:
    return next((w for w in whys if w is not None), None)


def check_version(who: str, version: int) -> str | None:
    if version != PROTOCOL_VERSION:
        return (f"protocol_version: {who} speaks version {version}, this scheduler "
                f"{PROTOCOL_VERSION}; run the same release on both")
    return None


def check_worker_hello(h: pb.WorkerHello) -> str | None:
    return _first(
        check_version("the worker", h.protocol_version),
        _text("worker_id", h.worker_id, required=True), _text("model", h.model),
        _text("device", h.device),
        _int("num_blocks", h.num_blocks, 1, MAX_BLOCKS),
        _int("num_cpu_blocks", h.num_cpu_blocks, 0, MAX_BLOCKS),
        _int("block_size", h.block_size, 1, MAX_BLOCK_SIZE),
        _int("max_model_len", h.max_model_len, 1, MAX_LEN),
        _int("vocab_size", h.vocab_size, 1, MAX_LEN),
        _int("max_num_batched_tokens", h.max_num_batched_tokens, 0, MAX_LEN),
        _int("bytes_per_block", h.bytes_per_block, 0, 1 << 40),
        _float("swap_bytes_per_s", h.swap_bytes_per_s, 0.0, 1e15),
        _float("prefill_tokens_per_s", h.prefill_tokens_per_s, 0.0, 1e12),
        _int("num_speculative_tokens", h.num_speculative_tokens, 0, MAX_SPECULATIVE_TOKENS),
        _int("speculative_disable_by_batch_size", h.speculative_disable_by_batch_size, 0, 1 << 16),
        _tokens("eos_token_ids", h.eos_token_ids, h.vocab_size, MAX_LIST))


def check_gateway_hello(h: pb.GatewayHello, cluster_model: str) -> str | None:
    if why := _first(check_version("the gateway", h.protocol_version), _text("model", h.model)):
        return why
    if h.model and cluster_model and h.model != cluster_model:
        return f"the gateway tokenizes for model {h.model!r}, the workers serve {cluster_model!r}"
    return None


def check_sampling(s: pb.SamplingConfig, vocab_size: int, max_logprobs: int = MAX_LOGPROBS) -> str | None:
    top = min(max_logprobs, vocab_size or max_logprobs)
    return _first(
        _float("sampling.temperature", s.temperature, 0.0, MAX_TEMPERATURE),
        _float("sampling.top_p", s.top_p, 0.0, 1.0),
        _int("sampling.top_k", s.top_k, 0, MAX_TOP_K),
        _float("sampling.min_p", s.min_p, 0.0, 1.0),
        _float("sampling.presence_penalty", s.presence_penalty, -MAX_PENALTY_INTERNAL,
               MAX_PENALTY_INTERNAL),
        _float("sampling.frequency_penalty", s.frequency_penalty, -MAX_PENALTY_INTERNAL,
               MAX_PENALTY_INTERNAL),
        _float("sampling.repetition_penalty", s.repetition_penalty, 0.0, MAX_PENALTY_INTERNAL),
        _tokens("sampling.logit_bias", list(s.logit_bias), vocab_size, MAX_LIST),
        next((f"sampling.logit_bias[{k}] = {v} is not finite"
              for k, v in s.logit_bias.items() if not math.isfinite(v)), None),
        _int("sampling.logprobs", s.logprobs, 0, top)
        if s.HasField("logprobs") else None,
        _int("sampling.prompt_logprobs", s.prompt_logprobs, 0, top)
        if s.HasField("prompt_logprobs") else None,
        _int("sampling.min_tokens", s.min_tokens, 0, MAX_LEN),
        _tokens("sampling.stop_token_ids", s.stop_token_ids, vocab_size, MAX_LIST),
        _int("sampling.structured_output (bytes)", s.structured_output.ByteSize(), 0,
             MAX_STRUCTURED_OUTPUT) if s.HasField("structured_output") else None)


def check_add(add: pb.AddRequest, vocab_size: int, max_logprobs: int = MAX_LOGPROBS) -> str | None:
    """vocab_size: the cluster's (0 while no worker is registered: token ids are checked
    against it once one is, by the router's admission and again here on the next request)."""
    return _first(
        _text("public_id", add.public_id), _text("cache_salt", add.cache_salt),
        _text("tenant", add.tenant),
        _tokens("prompt_token_ids", add.prompt_token_ids, vocab_size),
        _int("n", add.n, 0, MAX_REQUEST_SEQUENCES), _int("max_tokens", add.max_tokens, 0, MAX_LEN),
        _tokens("stop_token_ids", add.stop_token_ids, vocab_size, MAX_LIST),
        check_sampling(add.sampling, vocab_size, max_logprobs),
        _int("beam_search.beam_width", add.beam_search.beam_width, 0, MAX_BEAM_WIDTH),
        _float("beam_search.length_penalty", add.beam_search.length_penalty, -MAX_LEN, MAX_LEN),
        None if add.beam_search.early_stopping in ("", "true", "false", "never") else
        f"beam_search.early_stopping = {add.beam_search.early_stopping[:16]!r} is not one of "
        "true, false, never",
        None if not add.beam_search.beam_width or add.n <= 1 else "n > 1 with beam_search",
        # The scheduler sets it on a beam search's sequences; from a gateway it would break one.
        _int("sampling.beam_candidates", add.sampling.beam_candidates, 0, 0))


def check_request_id(request_id: str) -> str | None:
    return _text("request_id", request_id, required=True)


def check_abort(abort: pb.AbortRequest) -> str | None:
    return _first(check_request_id(abort.request_id),
                  _int("abort.indices (count)", len(abort.indices), 0, MAX_REQUEST_SEQUENCES))


def check_call(call: pb.Call) -> str | None:
    if call.WhichOneof("kind") == "abort":
        ids = call.abort.request_ids
        return _first(_int("call.abort.request_ids (count)", len(ids), 0, MAX_LIST),
                      *(_text("call.abort.request_ids[]", r) for r in ids))
    return None


def check_compiled(c: pb.GrammarsCompiled) -> str | None:
    """A worker's answer about grammars: keys are Spec.key() hex digests."""
    return _first(_int("ready (count)", len(c.ready), 0, MAX_LIST),
                  _int("failed (count)", len(c.failed), 0, MAX_LIST),
                  *(_text("ready[]", k) for k in c.ready),
                  *(_text("failed[].key", f.key) for f in c.failed),
                  *(_text("failed[].reason", f.reason) for f in c.failed))


def check_result(r: pb.StepResult, vocab_size: int) -> str | None:
    """Tokens a worker samples go straight into users' streams: each must be in the vocabulary."""
    try:
        slots, tokens = unpack(r.slots), unpack(r.token_ids)
    except ValueError as e:
        return str(e)
    if r.num_tokens or r.num_drafts:  # rows that speculated: each row's run of tokens
        if why := _runs(r, len(slots), len(tokens)):
            return why
    elif len(slots) != len(tokens):
        return f"{len(slots)} slots but {len(tokens)} tokens"
    if len(tokens) and (tokens.min() < 0 or tokens.max() >= vocab_size):
        return f"a sampled token is outside the vocabulary of {vocab_size}"
    if len(slots) and slots.min() < 0:
        return "a negative slot"
    return _first(_int("logprobs (count)", len(r.logprobs), 0, MAX_LIST),
                  _text("error", r.error, limit=1 << 16),
                  _int("failed (count)", len(r.failed), 0, MAX_LIST),
                  *(_text("failed[].reason", f.reason) for f in r.failed))


def _runs(r: pb.StepResult, num_slots: int, num_tokens: int) -> str | None:
    try:
        counts, drafts = unpack(r.num_tokens), unpack(r.num_drafts)
    except ValueError as e:
        return str(e)
    if len(counts) != num_slots or len(drafts) != num_slots:
        return f"{num_slots} slots but {len(counts)} num_tokens and {len(drafts)} num_drafts"
    if num_slots and (counts.min() < 1 or drafts.min() < 0 or (counts - 1 > drafts).any()):
        return "a row's num_tokens is not 1 + its accepted proposals (at most num_drafts)"
    if int(counts.sum()) != num_tokens:
        return f"num_tokens add up to {int(counts.sum())}, but there are {num_tokens} tokens"
    return None
