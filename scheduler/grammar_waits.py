"""One worker's sequences that wait for a grammar (structured outputs), as vLLM's WAITING_FOR_FSM.

A sequence with a grammar is admitted only once its worker has compiled the grammar, so that no
step of that worker waits for a compile (a cold one takes milliseconds to seconds; the first one
also loads the vocabulary). The scheduler asks the worker for each grammar once, whatever number
of sequences wait for it (CompileGrammars), and admits them all when the worker says it is done
(GrammarsCompiled); a grammar the worker has cached is done at once. A grammar that does not
compile ends its sequences with INVALID_ARGUMENT and the compiler's reason.

Keys are structured/spec.py's: equal specs are one grammar. The waiting groups are named by
their handle's seq_id, as the queues know them (scheduler/queues.py not_ready).
"""
from __future__ import annotations

from proto import internal_pb2 as pb
from structured.spec import Spec

# One grammar a message: the worker's socket bound is its largest plan, which holds at least one
# sequence's sampling with the largest spec, but perhaps not two.
MAX_GRAMMARS_PER_MESSAGE = 1


class GrammarWaits:
    def __init__(self) -> None:
        self.waiting: dict[str, list[str]] = {}  # grammar key -> the seq_ids waiting for it
        self._unsent: dict[str, pb.GrammarSpec] = {}  # asked of the worker at the next send

    def need(self, seq_id: str, sampling: pb.SamplingConfig) -> bool:
        """Whether the group known by seq_id must wait for a grammar; if so it waits here, and
        the grammar is asked for unless it already is."""
        if not sampling.HasField("structured_output"):
            return False
        spec = Spec.from_proto(sampling.structured_output)
        if spec is None:
            return False
        key = spec.key()
        if key not in self.waiting:
            self.waiting[key] = []
            self._unsent[key] = pb.GrammarSpec(key=key, structured_output=sampling.structured_output)
        self.waiting[key].append(seq_id)
        return True

    def take_requests(self) -> list[pb.CompileGrammars]:
        """What to send the worker now (nothing, most of the time)."""
        if not self._unsent:
            return []
        specs = list(self._unsent.values())
        self._unsent.clear()
        return [pb.CompileGrammars(grammars=specs[i:i + MAX_GRAMMARS_PER_MESSAGE])
                for i in range(0, len(specs), MAX_GRAMMARS_PER_MESSAGE)]

    def compiled(self, msg: pb.GrammarsCompiled) -> tuple[list[str], list[tuple[str, str]]]:
        """(seq_ids now ready, (seq_id, why) that cannot run) for the worker's answer. A key no
        sequence waits for any more (all aborted, or answered before) is ignored."""
        ready = [s for key in msg.ready for s in self.waiting.pop(key, [])]
        failed = [(s, f.reason) for f in msg.failed for s in self.waiting.pop(f.key, [])]
        return ready, failed
