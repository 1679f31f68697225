"""The gateway's grammar compiler, as a child process: a spec that takes too long to compile
is stopped by killing the process (a thread cannot be stopped), and torch and xgrammar stay out
of the gateway's own memory.

    python -m structured.check_process TOKENIZER_JSON

It imports its compiler (seconds: torch and xgrammar) before it needs the model's vocabulary, so
the gateway starts it before any worker has said the vocabulary's size. Its first line on stdin
is {"vocab_size": n, "eos_token_ids": [...]}; it says {"ready": true} once that vocabulary is
loaded. Then it reads one JSON object a line, {"id": n, "kind", "value", "choices",
"any_whitespace"}, and answers each with {"id": n, "error": null or the compiler's reason,
"seconds": s}. Its stdin is its parent's pipe, never a socket.

It dies with the gateway, even one that was SIGKILLed (which closes no pipe the child would
notice mid-compile): PR_SET_PDEATHSIG, set first thing, and a check that the gateway that
started it (PARENT_ENV) is still its parent, for a gateway that died before the prctl ran."""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

# Small: the gateway keeps every verdict (gateway/grammar_check.py) and asks a child only about
# specs it has none for, so compiled grammars are seldom asked for again here.
CACHE_BYTES = 32 << 20


def die_with_parent() -> None:
    from launch.lifetime import PARENT_ENV, die_with_parent as prctl_pdeathsig
    parent = os.environ.pop(PARENT_ENV, "")
    prctl_pdeathsig(signal.SIGKILL)
    if parent.isdigit() and os.getppid() != int(parent):
        sys.exit(0)  # the gateway died before the prctl: nobody is left to ask


def main() -> None:
    die_with_parent()
    from structured.compiler import GrammarCache, fast_tokenizer, vocabulary_info
    from structured.spec import Spec, SpecError
    tokenizer = fast_tokenizer(Path(sys.argv[1]))
    vocabulary = json.loads(sys.stdin.readline() or "{}")
    cache = GrammarCache(vocabulary_info(tokenizer, int(vocabulary["vocab_size"]),
                                         [int(i) for i in vocabulary["eos_token_ids"]]),
                         max_bytes=CACHE_BYTES)
    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        started = time.perf_counter()
        error, msg = None, {}
        try:
            msg = json.loads(line)
            if not isinstance(msg, dict):
                raise TypeError("not an object")
            spec = Spec(str(msg["kind"]), str(msg.get("value", "")),
                        tuple(str(c) for c in msg.get("choices", ())),
                        bool(msg.get("any_whitespace", False)))
            cache.get(spec)
        except SpecError as e:
            error = str(e)
        except (ValueError, KeyError, TypeError) as e:
            msg, error = (msg if isinstance(msg, dict) else {}), f"malformed check: {e}"
        out.write(json.dumps({"id": msg.get("id"), "error": error,
                              "seconds": time.perf_counter() - started}) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
