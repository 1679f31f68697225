"""xgrammar against llguidance on pagoda's tokenizer: the numbers behind the choice of backend
in docs/design.md ("Structured outputs").

For each of N JSON schemas of the shapes users send (nested objects, arrays with maxItems,
enums, bounded numbers, optional fields, maxLength), each backend compiles the schema (cold,
then again for the cache), then walks an answer token by token: the mask of allowed tokens,
then the token. The walk picks, among the allowed tokens, the one a fixed random ranking of
the vocabulary likes best, so both backends walk answers of the same kind and every walk ends.

    .venv/bin/python -m bench.grammar_backends --schemas 64
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from gateway.tokenizer import load_tokenizer


def schema(i: int) -> dict:
    return {"type": "object", "additionalProperties": False, "properties": {
        f"name_{i}": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": -1, "maximum": 1},
        "kind": {"enum": ["cat", "dog", f"kind{i}"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "home": {"type": "object", "additionalProperties": False,
                 "properties": {"city": {"type": "string", "maxLength": 10},
                                "zip": {"type": "integer"}}, "required": ["city"]},
        "ok": {"type": "boolean"}},
        "required": [f"name_{i}", "age", "kind"]}


class XGrammar:
    name = "xgrammar"

    def __init__(self, hf_tokenizer, vocab_size: int) -> None:
        import xgrammar as xgr
        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def compile(self, text: str):
        return self.compiler.compile_json_schema(text, any_whitespace=False)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def mask(self, m) -> torch.Tensor:
        m.fill_next_token_bitmask(self.bitmask)
        return self.bitmask[0]

    def accept(self, m, token: int) -> bool:
        return m.accept_token(token)

    def done(self, m) -> bool:
        return m.is_terminated()


class LLGuidance:
    name = "llguidance"

    def __init__(self, hf_tokenizer, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.ll = llguidance
        self.tok = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)
        self.fill = llguidance.torch.fill_next_token_bitmask

    def compile(self, text: str):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(
            text, defaults={"whitespace_flexible": False})
        m = self.ll.LLMatcher(self.tok, grammar)  # the lexer is built lazily, as tokens come
        assert not m.is_error(), m.get_error()
        return grammar

    def matcher(self, compiled):
        return self.ll.LLMatcher(self.tok, compiled)

    def mask(self, m) -> torch.Tensor:
        self.fill(m, self.bitmask, 0)
        return self.bitmask[0]

    def accept(self, m, token: int) -> bool:
        return m.consume_token(token)

    def done(self, m) -> bool:
        return m.is_stopped()


def allowed(bitmask: torch.Tensor, vocab_size: int) -> np.ndarray:
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


def walk(backend, compiled, rank: np.ndarray, eos: int, vocab_size: int, limit: int = 256):
    m = backend.matcher(compiled)
    mask_s, tokens = [], []
    for _ in range(limit):
        started = time.perf_counter()
        bitmask = backend.mask(m)
        mask_s.append(time.perf_counter() - started)
        ids = allowed(bitmask, vocab_size)
        token = int(ids[np.argmin(rank[ids])])
        if token == eos:
            break
        assert backend.accept(m, token)
        tokens.append(token)
        if backend.done(m):
            break
    return tokens, mask_s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schemas", type=int, default=64)
    p.add_argument("--model", default="")
    args = p.parse_args()
    from transformers import PreTrainedTokenizerFast
    text_tok = load_tokenizer(args.model)
    hf = PreTrainedTokenizerFast(tokenizer_object=text_tok.tokenizer)
    vocab = text_tok.vocab_size
    eos = text_tok.eos_token_ids[0]
    rank = np.random.default_rng(0).permutation(vocab)
    import jsonschema
    for cls in (XGrammar, LLGuidance):
        started = time.perf_counter()
        backend = cls(hf, vocab)
        setup = time.perf_counter() - started
        cold, warm, masks, lengths, valid = [], [], [], [], 0
        for i in range(args.schemas):
            text = json.dumps(schema(i))
            t0 = time.perf_counter()
            compiled = backend.compile(text)
            cold.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            backend.compile(text)
            warm.append(time.perf_counter() - t0)
            tokens, mask_s = walk(backend, compiled, rank, eos, vocab)
            masks += mask_s
            lengths.append(len(tokens))
            try:
                jsonschema.validate(json.loads(text_tok.decode(tokens)), schema(i))
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
        ms = lambda xs: f"{1e3 * statistics.median(xs):.2f} ms (p90 {1e3 * sorted(xs)[int(0.9 * len(xs))]:.2f})"
        print(f"{backend.name}: tokenizer setup {setup:.2f} s; compile cold {ms(cold)}, cached "
              f"{ms(warm)}; mask {ms(masks)} over {len(masks)} steps; answers "
              f"{statistics.mean(lengths):.0f} tokens, {valid}/{args.schemas} valid")


if __name__ == "__main__":
    main()
