"""The gateway's grammar compiler, as a child process: a spec that takes too long to compile
is stopped by killing the process (a thread cannot be stopped), and torch and xgrammar stay out
of the gateway's own memory.

    python -m structured.check_process TOKENIZER_JSON VOCAB_SIZE EOS_ID[,EOS_ID...]

Reads one JSON object a line on stdin, {"id": n, "kind", "value", "choices", "any_whitespace"},
and answers each with {"id": n, "error": null or the compiler's reason, "seconds": s}. It says
{"ready": true} once the vocabulary is loaded. Its stdin is its parent's pipe, never a socket."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main() -> None:
    path, vocab, eos = sys.argv[1], int(sys.argv[2]), [int(x) for x in sys.argv[3].split(",") if x]
    from structured.compiler import GrammarCache, tokenizer_info
    from structured.spec import Spec, SpecError
    cache = GrammarCache(tokenizer_info(Path(path), vocab, eos))
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
