"""The fake worker process (tests/fake_worker_main.py) answering canned token ids: for tests of
how the gateway reads an answer (tool calls), where what the model says must be chosen.

    python -m tests.fake_worker_canned --canned FILE [--vocab-size N] [the fake worker's flags]

FILE is JSON: {"<seed>": [token ids], ...}. A sequence whose sampling seed is listed (seed +
index for n > 1, as the scheduler seeds each index) outputs those ids, then EOS; any other
sequence gets the fake model's own tokens. --vocab-size is the vocabulary it registers with
(the fake's VOCAB unless told): a chat prompt rendered by the real tokenizer needs the real
one's, or the scheduler refuses its token ids. Spell a text with the tokenizer's one-byte tokens
(`byte_tokens`)."""
from __future__ import annotations

import argparse
import json
import sys

from tests import fake_worker, fake_worker_main


def byte_tokens(tok, text: str) -> list[int]:
    """text as one token per UTF-8 byte, ids the fake model can emit, which decode back to it."""
    from gateway.tokenizer import _bytes_to_unicode
    spelling = _bytes_to_unicode()
    ids = [tok.tokenizer.token_to_id(spelling[b]) for b in text.encode()]
    assert all(i is not None and 0 < i < fake_worker.VOCAB for i in ids), text
    return ids


def _canned(answers: dict[int, list[int]], model):
    def next_token(context, seed=0, num_prompt_tokens=None, min_tokens=0):
        answer = answers.get(seed)
        if answer is None or num_prompt_tokens is None:
            return model(context, seed, num_prompt_tokens, min_tokens)
        produced = len(context) - num_prompt_tokens
        return answer[produced] if produced < len(answer) else fake_worker.EOS
    return next_token


def main(argv: list[str] | None = None) -> int:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--canned", required=True)
    own.add_argument("--vocab-size", type=int, default=fake_worker.VOCAB)
    args, rest = own.parse_known_args(argv)
    fake_worker.VOCAB = args.vocab_size  # read at each hello and step
    with open(args.canned) as f:
        answers = {int(seed): ids for seed, ids in json.load(f).items()}
    # FakeWorker looks next_token up in its module at each step.
    fake_worker.next_token = _canned(answers, fake_worker.next_token)
    return fake_worker_main.main(rest)


if __name__ == "__main__":
    sys.exit(main())
