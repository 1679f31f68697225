"""The gateway's grammar compiler, as a child process: torch and xgrammar stay out of the
gateway's own memory, and a spec that takes too long to compile is stopped by killing a process
(a thread cannot be stopped).

    python -m structured.check_process TOKENIZER_JSON

It imports its compiler (seconds: torch and xgrammar) before it needs the model's vocabulary, so
the gateway starts it before any worker has said the vocabulary's size. Its first line on stdin
is {"vocab_size": n, "eos_token_ids": [...], "timeout_s": s}; it says {"ready": true} once that
vocabulary is loaded. Then it reads one JSON object a line, {"id": n, "kind", "value",
"choices", "any_whitespace"}, and answers each with {"id": n, "error": null or the compiler's
reason, "timed_out": bool, "seconds": s}. Its stdin is its parent's pipe, never a socket.

Each spec compiles in a fork of this process (copy-on-write: tens of milliseconds, the
vocabulary already loaded), killed past timeout_s: a timeout costs no restart of this process
(seconds of CPU to import and load the vocabulary again), and what a compile allocated goes with
its fork. The gateway's own timeout, a little longer, is the backstop for a wedged child.

It dies with the gateway, even one that was SIGKILLed (which closes no pipe the child would
notice mid-compile): PR_SET_PDEATHSIG, set first thing, and a check that the gateway that
started it (PARENT_ENV) is still its parent, for a gateway that died before the prctl ran; each
fork dies with this process the same way."""
from __future__ import annotations

import json
import os
import select
import signal
import sys
import time
from pathlib import Path

FAILED = "the grammar compiler failed on it"  # a fork that died without an answer (memory)


def die_with_parent() -> None:
    from process_life.lifetime import PARENT_ENV, die_with_parent as prctl_pdeathsig
    parent = os.environ.pop(PARENT_ENV, "")
    prctl_pdeathsig(signal.SIGKILL)
    if parent.isdigit() and os.getppid() != int(parent):
        sys.exit(0)  # the gateway died before the prctl: nobody is left to ask


def compile_in_fork(compiler, spec, timeout_s: float) -> tuple[str | None, bool]:
    """(the compiler's reason or None, whether it ran past timeout_s), compiled in a fork."""
    from process_life.lifetime import die_with_parent as prctl_pdeathsig
    from structured.spec import SpecError
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the fork: compile, answer through the pipe, and go without any cleanup
        os.close(read)
        prctl_pdeathsig(signal.SIGKILL)
        try:
            spec.compile(compiler)
            error = None
        except SpecError as e:
            error = str(e)
        except BaseException as e:  # noqa: BLE001 - whatever it was, the parent answers
            error = f"{FAILED} ({type(e).__name__})"
        # One write under PIPE_BUF (a reason is at most 500 characters): read whole or not at all.
        os.write(write, json.dumps({"error": error and error[:1000]}).encode())
        os._exit(0)
    os.close(write)
    try:
        if not select.select([read], [], [], timeout_s)[0]:
            os.kill(pid, signal.SIGKILL)
            return None, True
        data = os.read(read, 8192)
        try:
            return json.loads(data)["error"], False
        except (ValueError, KeyError, TypeError):  # it died before its answer: nothing came
            return FAILED, False
    finally:
        os.close(read)
        os.waitpid(pid, 0)


def main() -> None:
    die_with_parent()
    from structured.compiler import fast_tokenizer, vocabulary_info
    from structured.spec import Spec
    import xgrammar as xgr
    tokenizer = fast_tokenizer(Path(sys.argv[1]))
    vocabulary = json.loads(sys.stdin.readline() or "{}")
    info = vocabulary_info(tokenizer, int(vocabulary["vocab_size"]),
                           [int(i) for i in vocabulary["eos_token_ids"]])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    timeout_s = float(vocabulary.get("timeout_s", 5.0))
    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()  # nothing buffered when it forks: a fork never writes to this pipe
    for line in sys.stdin:
        started = time.perf_counter()
        error, timed_out, msg = None, False, {}
        try:
            msg = json.loads(line)
            if not isinstance(msg, dict):
                raise TypeError("not an object")
            spec = Spec(str(msg["kind"]), str(msg.get("value", "")),
                        tuple(str(c) for c in msg.get("choices", ())),
                        bool(msg.get("any_whitespace", False)))
        except (ValueError, KeyError, TypeError) as e:
            msg, error = (msg if isinstance(msg, dict) else {}), f"malformed check: {e}"
        else:
            error, timed_out = compile_in_fork(compiler, spec, timeout_s)
        out.write(json.dumps({"id": msg.get("id"), "error": error, "timed_out": timed_out,
                              "seconds": time.perf_counter() - started}) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
