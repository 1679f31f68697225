"""Compiled grammars for one tokenizer, cached by spec (the gateway's check and every worker
keep their own). xgrammar precomputes each grammar's token masks at compile time, so a step
costs a mask lookup (bench/grammar_backends.py; docs/design.md says why xgrammar)."""
from __future__ import annotations

from pathlib import Path

from structured.lru import BytesLru
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
    # Each matcher takes its request's stop tokens instead (worker/grammar/matchers.py); these are only
    # xgrammar's default.
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                              stop_token_ids=list(eos_token_ids))


# Compiled grammars kept per compiler: one can take megabytes (a long bounded repetition), so
# the bytes bound what a client's distinct specs can make a worker hold.
CACHE_BYTES = 256 << 20
CACHE_ENTRIES = 256


class GrammarCache:
    def __init__(self, info, max_entries: int = CACHE_ENTRIES, threads: int = 1,
                 max_bytes: int = CACHE_BYTES) -> None:
        import xgrammar as xgr
        # xgrammar's own cache is off: this one is bounded by bytes and entries, and is the only one.
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self.info = info
        self.vocab_size = info.vocab_size
        # A worker compiles on threads of its own while its loop reads hits (worker/grammar/matchers.py):
        # the LRU's lock covers the entries, never a compile.
        self._compiled: BytesLru[object] = BytesLru(max_bytes, max_entries)

    def get(self, spec: Spec):
        """The spec's CompiledGrammar; SpecError when it does not compile."""
        key = spec.key()
        compiled = self._compiled.get(key)
        if compiled is not None:
            return compiled
        compiled = spec.compile(self.compiler)
        self._compiled.put(key, compiled, compiled.memory_size_bytes + len(key))
        return compiled

    def cached(self, spec: Spec) -> bool:
        return spec.key() in self._compiled

    @property
    def bytes(self) -> int:
        return self._compiled.bytes

    def __len__(self) -> int:
        return len(self._compiled)
