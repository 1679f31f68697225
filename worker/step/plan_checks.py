"""Range checks on a StepPlan before the worker runs it.

A block id past the cache would read or write another sequence's KV (on CUDA, an out-of-bounds
index in a Triton kernel is not even an error), and a token id past the embedding table is one
too. The scheduler is authenticated, but a bug there must fail one step, not corrupt the cache:
a plan that fails is answered with StepResult.error and nothing of it runs.
"""
from __future__ import annotations

import numpy as np

from proto import internal_pb2
from proto.columns import unpack
from proto.sizes import MAX_LIST, MAX_STRUCTURED_OUTPUT


def _ids_below(name: str, ids, limit: int) -> str | None:
    if not len(ids):
        return None
    lo, hi = (int(ids.min()), int(ids.max())) if isinstance(ids, np.ndarray) else (min(ids), max(ids))
    if lo < 0 or hi >= limit:
        return f"{name} holds {lo if lo < 0 else hi}, outside [0, {limit})"
    return None


def check_plan(plan: internal_pb2.StepPlan, num_blocks: int, num_cpu_blocks: int,
               vocab_size: int) -> str | None:
    try:
        slots, counts = unpack(plan.running_slots), unpack(plan.running_num_tokens)
        block_slots, block_ids = unpack(plan.new_block_slots), unpack(plan.new_block_ids)
        next_slots, next_ids = unpack(plan.next_token_slots), unpack(plan.next_token_ids)
    except ValueError as e:
        return str(e)
    if len(slots) != len(counts) or len(block_slots) != len(block_ids) or \
            len(next_slots) != len(next_ids):
        return "running, new-block or next-token columns of different lengths"
    if len(np.unique(next_slots)) != len(next_slots):
        return "next_token_slots names a slot twice"
    checks = [_ids_below("new_block_ids", block_ids, num_blocks),
              _ids_below("next_token_ids", next_ids, vocab_size),
              _ids_below("running_num_tokens", counts, 1 << 20)]
    for c in plan.copy:
        checks.append(_ids_below("copy", (c.src, c.dst), num_blocks))
    for c in plan.swap_out:
        checks += [_ids_below("swap_out.src", (c.src,), num_blocks),
                   _ids_below("swap_out.dst", (c.dst,), num_cpu_blocks)]
    for c in plan.swap_in:
        checks += [_ids_below("swap_in.src", (c.src,), num_cpu_blocks),
                   _ids_below("swap_in.dst", (c.dst,), num_blocks)]
    for s in plan.new_seqs:
        checks += [_ids_below(f"new_seqs[{s.seq_id[:64]}].block_ids", s.block_ids, num_blocks),
                   _ids_below(f"new_seqs[{s.seq_id[:64]}].token_ids", s.token_ids, vocab_size)]
        if s.num_computed_tokens + s.num_new_tokens > len(s.token_ids):
            checks.append(f"new_seqs[{s.seq_id[:64]}] computes past its {len(s.token_ids)} tokens")
    return next((c for c in checks if c is not None), None)


def check_compile(msg: internal_pb2.CompileGrammars) -> str | None:
    """What the scheduler asks a worker to compile: few, small, named by a digest."""
    if len(msg.grammars) > MAX_LIST:
        return f"{len(msg.grammars)} grammars in one message (at most {MAX_LIST})"
    for g in msg.grammars:
        if not 0 < len(g.key) <= 128:
            return f"a grammar key of {len(g.key)} characters"
        if g.structured_output.ByteSize() > MAX_STRUCTURED_OUTPUT:
            return (f"grammar {g.key[:16]} is {g.structured_output.ByteSize()} bytes "
                    f"(at most {MAX_STRUCTURED_OUTPUT})")
    return None
