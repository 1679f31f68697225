"""An in-process worker for scheduler tests: it executes StepPlans against a KV "cache" that
stores token ids instead of tensors, and a deterministic "model" whose next token depends on the
whole context read back through the block table. A wrong block table, a stale prefix hit or a
lost token changes the output, so tests can compare against a run with no cache at all."""
from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

import numpy as np

from modelfiles.resolve import DEFAULT_MODEL
from proto import internal_pb2 as pb
from proto.auth import PROTOCOL_VERSION
from proto.columns import pack, pack_f32, unpack_list

VOCAB = 1000
EOS = 0
# A prompt that starts with [EOS_MARK, k] ends with EOS as its k-th output token (k >= 1), or as
# the first token min_tokens allows; any other prompt never samples EOS.
EOS_MARK = 999
# A prompt that starts with [POISON_MARK, k] fails every step that computes it once it has k
# output tokens (k = 0: from its first step), as a sequence that breaks the model would: the
# worker answers that step with StepResult.error, as worker/runner.py does.
POISON_MARK = 997
# A prompt that starts with [HANG_MARK, k] hangs the step that computes it once it has k output
# tokens, as a deadlocked forward would, on a worker process started with --hang-on-mark
# (tests/fake_worker_main.py); its heartbeat thread beats on. Elsewhere it is a plain token.
HANG_MARK = 996
# A prompt that starts with [DIE_MARK, k] kills the worker process whose step computes it once it
# has k output tokens, as a crashing kernel would, on a worker process started with --die-on-mark
# (tests/fake_worker_main.py). Elsewhere it is a plain token.
DIE_MARK = 995


class Poisoned(RuntimeError):
    pass


def is_poisoned(tokens: list[int], num_prompt_tokens: int) -> bool:
    return (num_prompt_tokens >= 2 and tokens[0] == POISON_MARK
            and len(tokens) - num_prompt_tokens >= tokens[1])


def hangs(plan: pb.StepPlan, seqs: dict, mark: int = HANG_MARK) -> bool:
    """Whether the plan computes a sequence marked so (HANG_MARK, DIE_MARK); seqs: the worker's."""
    held = (seqs[s] for s in unpack_list(plan.running_slots) if s in seqs)
    return any(len(t) >= 2 and t[0] == mark and len(t) - p >= t[1] for t, p in (
        *((list(s.token_ids), s.num_prompt_tokens) for s in plan.new_seqs),
        *((s.tokens, s.num_prompt_tokens) for s in held)))


def eos_index(prompt: list[int], min_tokens: int = 0) -> int | None:
    """The output index (0-based) at which the fake model samples EOS, if any."""
    if len(prompt) >= 2 and prompt[0] == EOS_MARK and prompt[1] >= 1:
        return max(prompt[1] - 1, min_tokens)
    return None


def next_token(context: list[int], seed: int = 0, num_prompt_tokens: int | None = None,
               min_tokens: int = 0) -> int:
    at, produced = None, len(context)
    if num_prompt_tokens is not None:
        at = eos_index(context[:num_prompt_tokens], min_tokens)
        produced -= num_prompt_tokens
    return _sample(_fold(_FNV_BASIS ^ seed, context), at, produced)


_FNV_BASIS = 1469598103934665603


def _fold(h: int, tokens) -> int:
    """FNV-1a over token ids: the fake model's whole state, so a context can be extended."""
    for t in tokens:
        h = ((h ^ t) * 1099511628211) & (2 ** 64 - 1)
    return h


def _sample(h: int, eos_at: int | None, produced: int) -> int:
    """The token after `produced` output tokens whose context folds to h."""
    return EOS if produced == eos_at else 1 + h % (VOCAB - 2)  # else never EOS nor EOS_MARK


def reference_output(prompt: list[int], max_tokens: int, seed: int = 0, min_tokens: int = 0,
                     stop_token_ids=(), ignore_eos: bool = False) -> list[int]:
    """What a correct scheduler streams: up to and including the first stop token that
    min_tokens allows (EOS unless ignore_eos, or a stop id), else max_tokens tokens."""
    # next_token, with the context folded one token at a time.
    out, h, at = [], _fold(_FNV_BASIS ^ seed, prompt), eos_index(prompt, min_tokens)
    stops = set(stop_token_ids) | (set() if ignore_eos else {EOS})
    for _ in range(max_tokens):
        t = _sample(h, at, len(out))
        h = _fold(h, (t,))
        out.append(t)
        if t in stops and len(out) > min_tokens:
            break
    return out


def beam_distribution(context: list[int]) -> list[tuple[int, float]]:
    """Beam search's "model": 40 next tokens with float32 logprobs, best first, EOS among them,
    drawn from the whole context (as read back through the block table); every other token
    has probability 0. Distinct values, so rankings have no ties."""
    rng = random.Random(_fold(_FNV_BASIS, context))
    tokens = [EOS] + rng.sample(range(1, VOCAB - 1), 39)
    values = np.float32(-np.array([rng.uniform(0.05, 9.0) for _ in tokens]))
    order = np.argsort(-values, kind="stable")
    return [(tokens[i], float(values[i])) for i in order]


@dataclass
class Seq:
    tokens: list[int]
    blocks: list[int]
    num_computed: int
    seed: int = 0
    num_prompt_tokens: int = 0
    min_tokens: int = 0
    beam_k: int = 0  # SamplingConfig.beam_candidates
    logprobs_k: int = -1  # SamplingConfig.logprobs; -1: unset (prompt_logprobs are not sent)


class FakeWorker:
    def __init__(self, num_blocks: int, block_size: int = 4, worker_id: str = "fake",
                 num_cpu_blocks: int = 0, num_speculative_tokens: int = 0,
                 always_wrong: bool = False, disable_by_batch_size: int = 0,
                 paced_by_worker: bool = False) -> None:
        self.num_blocks, self.block_size, self.worker_id = num_blocks, block_size, worker_id
        self.num_speculative_tokens = num_speculative_tokens
        self.always_wrong = always_wrong  # its proposer is never right (text that never repeats)
        self.disable_by_batch_size = disable_by_batch_size
        self.paced_by_worker = paced_by_worker  # as method suffix: the scheduler never pauses it
        self.drafts = self.accepted = 0  # proposals made, proposals accepted
        self.num_cpu_blocks = num_cpu_blocks
        self.cache = [-1] * (num_blocks * block_size)
        self.cpu_cache = [-1] * (num_cpu_blocks * block_size)
        self.copies = 0
        self.seqs: dict[str, Seq] = {}
        self.steps = 0
        self.inbox: deque[pb.StepPlan] = deque()  # plans sent to it and not executed yet
        self.lenient = False  # the last step failed (see execute)

    def hello(self, max_model_len: int = 4096) -> pb.WorkerHello:
        # It stands in for the default model, whose tokenizer the gateways load.
        return pb.WorkerHello(worker_id=self.worker_id, model=DEFAULT_MODEL, num_blocks=self.num_blocks,
                              block_size=self.block_size, max_model_len=max_model_len,
                              vocab_size=VOCAB, eos_token_ids=[EOS], device="cpu",
                              num_cpu_blocks=self.num_cpu_blocks, bytes_per_block=1000,
                              swap_bytes_per_s=1e9, prefill_tokens_per_s=1e3,
                              protocol_version=PROTOCOL_VERSION,
                              num_speculative_tokens=self.num_speculative_tokens,
                              speculative_disable_by_batch_size=self.disable_by_batch_size,
                              speculative_paced_by_worker=self.paced_by_worker)

    def forget_all(self) -> None:
        """A new scheduler knows none of our sequences (worker.main calls it on reregister)."""
        self.seqs.clear()

    def execute(self, plan: pb.StepPlan) -> pb.StepResult:
        # Only the model's failure becomes an error result: a broken plan still fails the test.
        # The one exception is the plan sent before the scheduler saw a failure: it counted on
        # the failed step's tokens, so it may fail in any way (the scheduler drops its result).
        lenient, self.lenient = self.lenient, False
        try:
            return self._execute(plan)
        except Poisoned as e:
            self.lenient = True
            return pb.StepResult(step_id=plan.step_id, error=f"{type(e).__name__}: {e}")
        except (AssertionError, KeyError, IndexError) as e:
            if not lenient:
                raise
            return pb.StepResult(step_id=plan.step_id, error=f"{type(e).__name__}: {e}")

    def _execute(self, plan: pb.StepPlan) -> pb.StepResult:
        self.steps += 1
        bs = self.block_size
        for slot in plan.dropped_slots:
            self.seqs.pop(slot, None)
        for c in plan.swap_out:
            self.cpu_cache[c.dst * bs:(c.dst + 1) * bs] = self.cache[c.src * bs:(c.src + 1) * bs]
        for c in plan.swap_in:
            self.cache[c.dst * bs:(c.dst + 1) * bs] = self.cpu_cache[c.src * bs:(c.src + 1) * bs]
        for c in plan.copy:
            self.copies += 1
            self.cache[c.dst * bs:(c.dst + 1) * bs] = self.cache[c.src * bs:(c.src + 1) * bs]
        work = []
        for s in plan.new_seqs:
            assert s.slot not in self.seqs, f"slot {s.slot} ({s.seq_id}) is still live"
            seq = Seq(list(s.token_ids), list(s.block_ids), s.num_computed_tokens,
                      s.sampling.seed if s.sampling.has_seed else 0, s.num_prompt_tokens,
                      s.sampling.min_tokens, s.sampling.beam_candidates,
                      s.sampling.logprobs if s.sampling.HasField("logprobs") else -1)
            self.seqs[s.slot] = seq
            work.append((s.slot, seq, s.num_new_tokens))
        for slot, block in zip(unpack_list(plan.new_block_slots), unpack_list(plan.new_block_ids)):
            self.seqs[slot].blocks.append(block)
        for slot, token in zip(unpack_list(plan.next_token_slots), unpack_list(plan.next_token_ids)):
            self.seqs[slot].tokens.append(token)
        for slot, n in zip(unpack_list(plan.running_slots), unpack_list(plan.running_num_tokens)):
            work.append((slot, self.seqs[slot], n))
        for sid, seq, n in work:
            if is_poisoned(seq.tokens, seq.num_prompt_tokens):
                raise Poisoned(f"slot {sid} broke the forward of step {plan.step_id}")
        spec = dict(zip(unpack_list(plan.spec_slots), unpack_list(plan.spec_num_tokens)))
        assert not spec or self.num_speculative_tokens, "a plan speculates on a worker that does not"
        slots, tokens, logprobs, runs, drafts = [], [], [], [], []
        for sid, seq, n in work:
            assert n >= 1 and seq.num_computed + n <= len(seq.tokens), (sid, n, seq.num_computed)
            assert len(seq.blocks) * bs >= seq.num_computed + n, f"{sid}: too few blocks"
            for p in range(seq.num_computed, seq.num_computed + n):
                self.cache[seq.blocks[p // bs] * bs + p % bs] = seq.tokens[p]
            seq.num_computed += n
            if seq.num_computed == len(seq.tokens):
                context = [self.cache[seq.blocks[p // bs] * bs + p % bs] for p in range(len(seq.tokens))]
                if seq.beam_k:  # candidates; the plan names the next token
                    top = beam_distribution(context)[:seq.beam_k]
                    tok = top[0][0]
                    logprobs.append(pb.SlotLogprobs(
                        slot=sid, first_position=len(seq.tokens), token_ids=pack([tok]),
                        logprobs=pack_f32([top[0][1]]), ranks=pack([1]), k=len(top),
                        top_token_ids=pack([t for t, _ in top]),
                        top_logprobs=pack_f32([v for _, v in top])))
                    run, p = [tok], 0
                elif sid in spec:
                    run, p = self._speculate(sid, seq, n, spec.pop(sid))
                else:
                    tok = next_token(context, seq.seed, seq.num_prompt_tokens, seq.min_tokens)
                    if seq.logprobs_k >= 0:  # made-up values: what is kept is the point
                        k = seq.logprobs_k
                        logprobs.append(pb.SlotLogprobs(
                            slot=sid, first_position=len(seq.tokens), token_ids=pack([tok]),
                            logprobs=pack_f32([-0.5]), ranks=pack([1]), k=k,
                            top_token_ids=pack([1 + (tok + j) % (VOCAB - 2) for j in range(k)]),
                            top_logprobs=pack_f32([-0.5 - j for j in range(k)])))
                    seq.tokens.append(tok)
                    run, p = [tok], 0
                slots.append(sid)
                tokens += run
                runs.append(len(run))
                drafts.append(p)
        assert not spec, f"slots {sorted(spec)} speculate but compute no decode token"
        result = pb.StepResult(step_id=plan.step_id, slots=pack(slots), token_ids=pack(tokens),
                               logprobs=logprobs)
        if any(drafts):
            result.num_tokens, result.num_drafts = pack(runs), pack(drafts)
        return result

    def _speculate(self, sid: int, seq: Seq, n: int, k: int) -> tuple[list[int], int]:
        """A decode row that may verify up to k proposals. The fake proposer is right for the
        first j of them (j from the context's hash, 0..k) and wrong after, and proposes nothing
        at all for some contexts; the proposals are computed into the cache as a verification
        forward computes them, and accepted while each equals the model's next token read back
        through the block table. Returns the run (accepted proposals, then the model's token) and
        the number proposed."""
        bs = self.block_size
        assert n == 1 and not seq.beam_k and 1 <= k <= self.num_speculative_tokens, (sid, n, k)
        h = _fold(_FNV_BASIS, seq.tokens)
        p = 0 if h % 5 == 0 else k  # some rows find no n-gram
        right = 0 if self.always_wrong else h % (p + 1)
        known, truth = len(seq.tokens), []
        for _ in range(p):
            truth.append(next_token(seq.tokens + truth, seq.seed, seq.num_prompt_tokens, seq.min_tokens))
        draft = truth[:right] + [t % (VOCAB - 2) + 1 for t in truth[right:]]  # 1..VOCAB-2, never t
        assert len(seq.blocks) * bs >= known + p, f"{sid}: no lookahead slots for {p} proposals"
        for i, t in enumerate(draft):  # the verification forward writes their KV
            self.cache[seq.blocks[(known + i) // bs] * bs + (known + i) % bs] = t
        run = []
        for i in range(p + 1):
            m = known + i
            context = [self.cache[seq.blocks[q // bs] * bs + q % bs] for q in range(m)]
            tok = next_token(context, seq.seed, seq.num_prompt_tokens, seq.min_tokens)
            run.append(tok)
            if i == p or draft[i] != tok:
                break
        self.drafts += p
        self.accepted += len(run) - 1
        seq.tokens += run
        seq.num_computed = len(seq.tokens) - 1
        return run, p
