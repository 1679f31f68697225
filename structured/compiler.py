"""Compiled grammars for one tokenizer, cached by spec (the gateway's check and every worker
keep their own). xgrammar precomputes each grammar's token masks at compile time, so a step
costs a mask lookup (bench/grammar_backends.py; docs/design.md says why xgrammar)."""
from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

from structured.spec import Spec


def tokenizer_info(tokenizer_json: Path, vocab_size: int, eos_token_ids: list[int]):
    """xgrammar's view of a tokenizer.json: every token's bytes, for a vocabulary of vocab_size
    rows (the model's, which may be padded past the tokenizer's)."""
    return vocabulary_info(fast_tokenizer(tokenizer_json), vocab_size, eos_token_ids)


def fast_tokenizer(tokenizer_json: Path):
    """The tokenizer.json as transformers' fast tokenizer, with xgrammar imported: the seconds of
    a grammar compiler's start (torch included) that need not know the model's vocabulary size."""
    import xgrammar  # noqa: F401
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(tokenizer_json)))


def vocabulary_info(tokenizer, vocab_size: int, eos_token_ids: list[int]):
    import xgrammar as xgr
    # Each matcher takes its request's stop tokens instead (worker/grammar.py); these are only
    # xgrammar's default.
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                              stop_token_ids=list(eos_token_ids))


class GrammarCache:
    def __init__(self, info, max_entries: int = 256, threads: int = 1) -> None:
        import xgrammar as xgr
        # xgrammar's own cache is off: this one is bounded by entries, and is the only one.
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self.vocab_size = info.vocab_size
        self.max_entries = max_entries
        self._compiled: OrderedDict[str, object] = OrderedDict()
        # A worker compiles on a thread of its own while its loop reads hits (worker/grammar.py):
        # the lock covers the entries, never a compile.
        self._lock = threading.Lock()

    def get(self, spec: Spec):
        """The spec's CompiledGrammar; SpecError when it does not compile."""
        key = spec.key()
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                return compiled
        compiled = spec.compile(self.compiler)
        with self._lock:
            self._compiled[key] = compiled
            if len(self._compiled) > self.max_entries:
                self._compiled.popitem(last=False)
        return compiled

    def __len__(self) -> int:
        return len(self._compiled)
