"""Each held sequence's grammar matcher (structured outputs), by slot: the mask of the tokens
its grammar allows next, applied to the logits after the logits processors, and the sampled
token fed back. The worker holds every token it samples (the plan ahead needs no scheduler
round trip for it), so the matcher advances here, after the step that sampled the token.

A matcher is always where its sequence's output tokens say: a sequence added to the batch
(first placement, recompute after preemption, another worker's sequence after a loss) replays
its output tokens into a fresh matcher, and a dropped or failed step advances nothing.

Compiling happens off the worker's loop: the scheduler asks for a grammar before it admits the
sequences that need it (scheduler/grammar_waits.py), one background thread compiles it (the
first also loads the vocabulary, seconds), and the loop answers between steps once it is done
(compile, finished). A sequence whose grammar the cache has since evicted compiles it when it
is added, on the loop: the cache holds far more grammars than a batch.

A compile has a bound (COMPILE_TIMEOUT_S; the gateway's check refuses slow specs long before,
so this is the backstop): past it the grammar is answered as failed, its sequences end with
the reason, and the compiles queued behind it go on at once on a fresh thread. The thread of
the slow one cannot be stopped (xgrammar releases the GIL while it compiles, so it takes a core,
not the loop); while MAX_ABANDONED of them still run, a grammar the cache lacks is refused at
once rather than started beside them.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence

import numpy as np
import torch

from pagoda.kernels import grammar_mask
from proto import internal_pb2
from structured.spec import Spec, SpecError

MAX_REASON_BYTES = 1000  # a compiler's reason, cut to what the scheduler accepts
MAX_ANSWERS = 256  # per message: well inside the scheduler's bound on a worker's message
COMPILE_TIMEOUT_S = 30.0
MAX_ABANDONED = 2  # compiles past the bound whose threads still run


class GrammarRows:
    def __init__(self, make_cache: Callable[[], object], timeout_s: float = COMPILE_TIMEOUT_S) -> None:
        self._make_cache = make_cache  # built on first use: loading the vocabulary takes seconds
        self._cache = None
        self._cache_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self.timeout_s = timeout_s
        self._compiling: dict[str, Future] = {}  # key -> its compile, until finished() says
        self._specs: dict[str, Spec | None] = {}  # key -> its spec, while compiling
        self._began: dict[str, float] = {}  # key -> when its thread took it up (monotonic)
        self._refused: dict[str, str] = {}  # key -> why, answered at the next finished()
        self._abandoned: list[Future] = []  # compiles past the bound, still on their threads
        self.matchers: dict[int, object] = {}  # slot -> xgrammar GrammarMatcher
        self.failed: dict[int, str] = {}       # slot -> why it cannot go on
        # Slots whose matcher ends at a stop token (the request has some); without, it ends when
        # the grammar is complete and its mask then allows nothing: a conflict, not an end.
        self.stoppable: set[int] = set()

    @property
    def cache(self):
        with self._cache_lock:  # the compile thread may be building it
            if self._cache is None:
                self._cache = self._make_cache()
            return self._cache

    # ---------------------------------------------------------------- compiling, off the loop

    def warm(self) -> Future:
        """Builds the cache on the compile thread now, so that the first structured request does
        not wait for the vocabulary to load (about 0.8 s for SmolLM2 on a Zen 2 EPYC). A cache
        that fails to build is built again, and its error reported, by the first compile."""
        return self._thread().submit(lambda: self.cache)

    def _thread(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        return self._pool

    def compile(self, grammars: Sequence[internal_pb2.GrammarSpec]) -> None:
        """Start compiling what the scheduler asks for (each key once)."""
        self._abandoned = [f for f in self._abandoned if not f.done()]
        for g in grammars:
            if g.key in self._compiling or g.key in self._refused:
                continue
            spec = Spec.from_proto(g.structured_output)
            if len(self._abandoned) >= MAX_ABANDONED and not self._cached(spec):
                self._refused[g.key] = (f"the worker's grammar compiler is still busy with "
                                        f"{len(self._abandoned)} grammars that took longer than "
                                        f"{self.timeout_s:g} s; retry later")
                continue
            self._submit(g.key, spec)

    def _submit(self, key: str, spec: Spec | None) -> None:
        self._specs[key] = spec
        self._compiling[key] = self._thread().submit(self._compile_one, key, spec)

    def _cached(self, spec: Spec | None) -> bool:
        return spec is not None and self._cache is not None and self._cache.cached(spec)

    def _compile_one(self, key: str, spec: Spec | None) -> None:
        self._began[key] = time.monotonic()
        if spec is None:
            raise SpecError("it names no kind")
        self.cache.get(spec)

    @property
    def compiling(self) -> bool:
        return bool(self._compiling or self._refused)

    def _give_up_slow(self) -> None:
        """Answers a compile past the bound as failed, and moves the compiles queued behind it
        to a fresh thread."""
        now = time.monotonic()
        slow = [key for key, f in self._compiling.items() if not f.done()
                and now - self._began.get(key, now) > self.timeout_s]
        if not slow or self._pool is None:
            return
        for key in slow:
            self._abandoned.append(self._compiling.pop(key))
            self._specs.pop(key, None)
            self._began.pop(key, None)
            self._refused[key] = f"compiling it took longer than {self.timeout_s:g} s on the worker"
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool = None
        for key, f in list(self._compiling.items()):
            if f.cancelled():
                self._submit(key, self._specs[key])

    def finished(self) -> internal_pb2.GrammarsCompiled | None:
        """The compiles done since the last call, as the answer to the scheduler; None if none."""
        if not self._compiling and not self._refused:  # the worker's loop asks every turn
            return None
        self._give_up_slow()
        done = [key for key, f in self._compiling.items() if f.done()][:MAX_ANSWERS]
        refused = list(self._refused)[:MAX_ANSWERS - len(done)]
        if not done and not refused:
            return None
        msg = internal_pb2.GrammarsCompiled()
        for key in done:
            self._specs.pop(key, None)
            self._began.pop(key, None)
            error = self._compiling.pop(key).exception()
            if error is None:
                msg.ready.append(key)
            else:
                why = str(error) if isinstance(error, SpecError) else f"{type(error).__name__}: {error}"
                why = why.encode()[:MAX_REASON_BYTES].decode(errors="ignore")
                msg.failed.add(key=key, reason=why)
        for key in refused:
            msg.failed.add(key=key, reason=self._refused.pop(key))
        return msg

    def add(self, slot: int, sampling, output_tokens: Sequence[int]) -> None:
        """A sequence enters the batch: a matcher replayed to its output so far."""
        self.drop((slot,))
        if not sampling.HasField("structured_output"):
            return
        spec = Spec.from_proto(sampling.structured_output)
        if spec is None:
            return
        import xgrammar as xgr
        try:
            compiled = self.cache.get(spec)
        except SpecError as e:  # the gateway compiled it; a worker's refusal still ends it cleanly
            self.failed[slot] = f"structured_output does not compile: {e}"
            return
        # The request's stop ids (EOS unless ignore_eos, and its stop_token_ids) end a complete
        # answer; without any, a complete grammar leaves no token allowed (a conflict, reported).
        stops = [int(t) for t in sampling.stop_token_ids]
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops or None,
                                     terminate_without_stop_token=not stops)
        for token in output_tokens:
            if not matcher.accept_token(int(token)):
                self.failed[slot] = "its output so far does not match structured_output"
                return
        self.matchers[slot] = matcher
        if stops:
            self.stoppable.add(slot)

    def drop(self, slots) -> None:
        for slot in slots:
            self.matchers.pop(int(slot), None)
            self.failed.pop(int(slot), None)
            self.stoppable.discard(int(slot))

    def _past_stop_token(self, slot: int) -> bool:
        matcher = self.matchers.get(slot)
        return slot in self.stoppable and matcher is not None and matcher.is_terminated()

    def constrained(self, slots: Sequence[int]) -> list[int]:
        """Rows (indices into slots) that have a matcher."""
        if not self.matchers:
            return []
        return [i for i, s in enumerate(slots) if s in self.matchers]

    def mask(self, slots: Sequence[int], rows: list[int], vocab_size: int) -> torch.Tensor:
        """xgrammar's int32 bitmask [len(rows), ceil(V / 32)]: bit j of word w set when the
        row's grammar allows token 32w + j next."""
        import xgrammar as xgr
        bitmask = xgr.allocate_token_bitmask(len(rows), vocab_size)  # every token allowed
        for j, i in enumerate(rows):
            matcher = self.matchers[slots[i]]
            # A stop token ended it in the last step, and the plan ahead was made before the
            # scheduler knew: the row's token is thrown away, so any will do (xgrammar refuses
            # to fill a mask after its stop token, which failed the whole step).
            if not self._past_stop_token(slots[i]):
                matcher.fill_next_token_bitmask(bitmask, j)
        return bitmask

    def draft_masks(self, slot: int, draft: Sequence[int], vocab_size: int):
        """For a row that speculates: the bitmask at each proposal's position and the one after,
        as if the proposals before it had been sampled, for the leading proposals the grammar
        accepts: (bitmask [m + 1, words], m). None for a row without a matcher. The matcher is
        rolled back: it advances only by what is accepted (advance, then accept)."""
        matcher = self.matchers.get(slot)
        if matcher is None:
            return None
        import xgrammar as xgr
        bitmask = xgr.allocate_token_bitmask(len(draft) + 1, vocab_size)
        m = 0
        for i in range(len(draft) + 1):
            if matcher.is_terminated():  # a stop token ended it: nothing may follow
                bitmask[i] = 0
                break
            matcher.fill_next_token_bitmask(bitmask, i)
            if i == len(draft) or not matcher.accept_token(int(draft[i])):
                break
            m += 1
        if m:
            matcher.rollback(m)
        return bitmask[:m + 1], m

    def advance(self, slot: int, tokens: Sequence[int]) -> None:
        """A speculating row's accepted proposals (its last token comes through accept)."""
        matcher = self.matchers.get(slot)
        for token in tokens if matcher is not None else ():
            if not matcher.accept_token(int(token)):
                self.matchers.pop(slot)
                self.failed[slot] = f"token {token} does not match structured_output"
                return

    def accept(self, slots: np.ndarray, tokens: np.ndarray) -> None:
        """The step's sampled tokens, for the rows that have a matcher."""
        if not self.matchers:
            return
        for slot, token in zip(slots.tolist(), tokens.tolist()):
            matcher = self.matchers.get(slot)
            if matcher is None or self._past_stop_token(slot):  # a plan ahead's row: thrown away
                continue
            if not matcher.accept_token(int(token)):
                # Only a bug gets here: the token was sampled under this matcher's mask.
                self.matchers.pop(slot)
                self.failed[slot] = f"token {token} does not match structured_output"


def apply_grammar_mask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> torch.Tensor:
    """-inf on the tokens each constrained row's grammar forbids (a new tensor: the raw logits
    stay as they were, for logprobs); kernels/grammar_mask.py on the CPU, xgrammar's elsewhere."""
    if not rows:
        return logits
    return grammar_mask.masked(logits, rows, bitmask)


def why_no_token(sampling, num_output_tokens: int) -> str:
    """The conflict that left a constrained row no token: a grammar alone always allows one
    (its stop tokens once complete), so the request's other settings took them away."""
    if num_output_tokens < sampling.min_tokens:
        return (f"structured_output allows no token after {num_output_tokens} output tokens: "
                f"the answer is complete, and min_tokens ({sampling.min_tokens}) masks the stop "
                "tokens that would end it")
    if not sampling.stop_token_ids:
        return ("structured_output allows no token: the answer is complete, and ignore_eos "
                "leaves no stop token to end it (add a stop_token_ids entry, or unset ignore_eos)")
    return "structured_output allows no token here: logit_bias or a penalty masked every token it allows"
