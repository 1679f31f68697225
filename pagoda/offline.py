"""The offline API: `LLM(model=..., **engine flags).generate(prompts, SamplingParams(...))`.

An LLM starts a scheduler and workers as child processes (the ones `make run` starts) and
talks to them over the same ZeroMQ contract as a gateway, with the gateway's own code in this
process: the SchedulerClient, validation, detokenizing and stop strings of GenerationServicer,
on an event loop in a background thread. Outputs are therefore exactly what the servers give.
The children die with this process (PR_SET_PDEATHSIG), even when it is killed.
"""
from __future__ import annotations

import asyncio
import argparse
import atexit
import functools
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Sequence

from tqdm import tqdm

from launch.children import Child, module_command, spawn, stop_in_order
from process_life.flag_errors import FlagError
from launch.flag_routing import check_flags, process_parsers, route_flags
from pagoda.outputs import RequestOutput, collect
from pagoda.params import BeamSearchParams, SamplingParams, generate_request, one_prompt, prompt_fields
from proto.auth import create_keys

# The scheduler's waiting queue is bounded; this many requests are in flight at most.
MAX_IN_FLIGHT = 512


def _flags(engine: dict) -> list[str]:
    argv: list[str] = []
    for key, value in engine.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif isinstance(value, dict):  # a JSON flag: --speculative-config
            argv += [flag, json.dumps(value)]
        elif value is not False and value is not None:
            argv += [flag, str(value)]
    return argv


class LLM:
    """Engine flags are the servers' own, as keywords: LLM(model=path, max_num_seqs=32,
    dtype="float32", num_gpu_blocks_override=512). num_workers starts that many workers."""

    def __init__(self, model: str = "", *, num_workers: int = 1, log_file: str | None = None,
                 start_timeout: float = 600.0, **engine) -> None:
        from gateway.gateway_flags import add_gateway_args
        from gateway.validation.limits import limits_from_args

        self._procs: list[subprocess.Popen] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        # Closed before the interpreter's teardown, where __del__ came too late: the loop's
        # thread no longer ran, close() waited 10 s for it and printed a traceback at exit.
        self._at_exit = functools.partial(_close_if_alive, weakref.ref(self))
        atexit.register(self._at_exit)
        self._own_keys: Path | None = None  # removed by close(): secret keys left in /tmp otherwise
        if not engine.get("zmq_keys_dir") and not engine.get("insecure"):
            # Authenticated, as `make run` is: a key set of its own for this engine's sockets.
            self._own_keys = create_keys(tempfile.mkdtemp(prefix="pagoda-llm-keys-"))
            engine["zmq_keys_dir"] = str(self._own_keys)
        ports = [_free_port(), _free_port()]
        argv = _flags({"model": model, **engine,
                       "scheduler_gateway_address": f"tcp://127.0.0.1:{ports[0]}",
                       "scheduler_worker_address": f"tcp://127.0.0.1:{ports[1]}",
                       "scheduler_metrics_port": 0})
        parsers = process_parsers()
        try:
            routed = route_flags(argv, parsers)
            check_flags(routed, parsers)
        except FlagError as e:  # a library raises, where the launcher exits 2
            raise ValueError(str(e)) from None
        gateway_args = add_gateway_args(argparse.ArgumentParser()).parse_args(routed["gateway"])
        self.log_path = Path(log_file or tempfile.mkstemp(prefix="pagoda-llm-", suffix=".log")[1])
        log = open(self.log_path, "ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        commands = [("scheduler", module_command("scheduler.main", routed["scheduler"]))]
        commands += [(f"worker{i}", module_command("worker.main", routed["worker"]))
                     for i in range(num_workers)]
        try:
            for name, cmd in commands:
                # Their own process group (a Ctrl-C reaches this process, whose close() stops
                # them in order), and SIGTERM when this process dies, however it dies.
                proc = spawn(cmd, env, stdout=log, stderr=subprocess.STDOUT)
                self._procs.append(Child(name, cmd, proc))
            self._start_loop(gateway_args, limits_from_args(gateway_args, 0, 0))
            self._wait_ready(num_workers, start_timeout)
        except BaseException:
            self.close()
            raise
        finally:
            log.close()

    # ------------------------------------------------------------------ the public API

    def generate(self, prompts: str | dict | Sequence[int] | Sequence[str | dict] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Outputs in the order of the prompts (one, or a list): strings, token-id lists, or vLLM's
        TextPrompt / TokensPrompt dicts ({"prompt": ...} or {"prompt_token_ids": ...}, with an
        optional "cache_salt")."""
        if one_prompt(prompts):
            prompts = [prompts]
        return self._run([prompt_fields(p) for p in prompts], sampling_params, use_tqdm)

    def beam_search(self, prompts: str | dict | Sequence[int] | Sequence[str | dict] | Sequence[Sequence[int]],
                    params: BeamSearchParams, use_tqdm: bool = False) -> list[RequestOutput]:
        """Beam search (as vLLM's LLM.beam_search): each output holds params.beam_width
        completions, best first, each with its cumulative_logprob."""
        if one_prompt(prompts):
            prompts = [prompts]
        return self._run([prompt_fields(p) for p in prompts], params, use_tqdm)

    def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """One conversation ([{"role", "content"}, ...]) or a list of them, through the model's
        chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self._run([{"messages": list(c)} for c in conversations], sampling_params, use_tqdm)

    def close(self) -> None:
        """Stops the children and the background loop; safe to call twice."""
        atexit.unregister(self._at_exit)
        if self._loop is not None:
            loop, self._loop = self._loop, None
            asyncio.run_coroutine_threadsafe(self._client.close(), loop).result(10)
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(10)
        children, self._procs = self._procs, []
        stop_in_order(children, gateway_grace=0.0)
        if self._own_keys is not None:
            shutil.rmtree(self._own_keys, ignore_errors=True)
            self._own_keys = None

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_procs", None):
            self.close()

    # ------------------------------------------------------------------ plumbing

    def _start_loop(self, gateway_args, limits) -> None:
        from gateway.scheduler_link.scheduler_client import SchedulerClient
        from gateway.generation.server import GenerationServicer
        from gateway.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(gateway_args.model, gateway_args.chat_template)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="pagoda-llm", daemon=True)
        self._thread.start()

        async def start():
            client = SchedulerClient(gateway_args.scheduler_gateway_address,
                                     gateway_args.max_message_bytes, keys_dir=gateway_args.zmq_keys_dir,
                                     model=self.tokenizer.name)
            await client.start()
            return client
        self._client = asyncio.run_coroutine_threadsafe(start(), self._loop).result(30)
        self._servicer = GenerationServicer(self.tokenizer, self._client, limits)

    def _wait_ready(self, num_workers: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            info = self._client.info
            if info is not None and info.num_workers >= num_workers:
                return
            dead = [c for c in self._procs if c.proc.poll() is not None]
            if dead or time.monotonic() > deadline:
                tail = self.log_path.read_text(errors="replace")[-3000:]
                why = f"exited with {dead[0].proc.returncode}" if dead else f"not ready after {timeout:.0f}s"
                raise RuntimeError(f"pagoda: a child process {why}; log {self.log_path}:\n{tail}")
            time.sleep(0.2)

    def _run(self, fields: list[dict], sampling_params, use_tqdm: bool) -> list[RequestOutput]:
        if self._loop is None:
            raise RuntimeError("this LLM is closed")
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else \
            [sampling_params or SamplingParams()] * len(fields)
        if len(params) != len(fields):
            raise ValueError(f"{len(params)} sampling_params for {len(fields)} prompts")
        requests = [generate_request(f, p) for f, p in zip(fields, params)]
        bar = tqdm(total=len(requests), desc="generating", unit="req", disable=not use_tqdm)
        try:
            return asyncio.run_coroutine_threadsafe(self._all(requests, bar), self._loop).result()
        finally:
            bar.close()

    async def _all(self, requests, bar) -> list[RequestOutput]:
        gate = asyncio.Semaphore(MAX_IN_FLIGHT)

        async def one(i: int, request) -> RequestOutput:
            async with gate:
                out = await collect(self._servicer, self.tokenizer, request, str(i))
            bar.update()
            return out
        tasks = [asyncio.ensure_future(one(i, r)) for i, r in enumerate(requests)]
        try:
            return list(await asyncio.gather(*tasks))
        finally:  # one failure (or a KeyboardInterrupt upstream) aborts the rest
            for t in tasks:
                t.cancel()


def _close_if_alive(ref: "weakref.ref[LLM]") -> None:
    llm = ref()
    if llm is not None:
        llm.close()


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
