"""Two figures at N running decodes.

1. The scheduler's time per iteration, synchronous (one plan at a time): schedule, plan
   encoding, a ZeroMQ round trip to a null worker in another process, decoding the result,
   updating state and encoding the gateway's tokens. Its own time is all of that but the
   round trip.
2. The step period with one plan ahead: the real scheduler loop (scheduler/server.py) against a
   null worker whose forward lasts --forward-ms from a plan's arrival and ends on time, standing
   in for a GPU. With the plan ahead, the scheduler's work hides behind the forward and the
   period approaches max(forward, the scheduler's own time).

    .venv/bin/python -m bench.bench_scheduler [--seqs 256] [--steps 3000] [--repeats 5] [--profile]
        [--forward-ms 5,1]

Each repeat starts a fresh null worker and router. In the same repeat it also times a bare
ZeroMQ ping-pong with messages of the same sizes and the same polling, so that the ratio of the
two says what the scheduler adds over the transport on this machine at this moment (a shared
VM's speed drifts by half between runs).
"""
from __future__ import annotations

import argparse
import cProfile
import ctypes
import gc
import multiprocessing as mp
import pstats
import statistics
import time

import numpy as np
import zmq

from proto import internal_pb2 as pb
from proto.auth import PROTOCOL_VERSION
from proto.columns import pack, unpack
from proto.polling import poll, receive
from scheduler.router import Router, RouterConfig


def null_worker(address: str, busy_poll_us: float, forward_s: float = 0.0, stamps=None,
                max_plans: int = 0) -> None:
    """Answers every plan at once: one token for each sequence that reaches its end. State lives
    in arrays indexed by slot, so that its own time stays small next to the scheduler's. It waits
    for plans as worker/main.py does (proto.polling.receive). A plan whose step_id is 0 is a
    ping: it is answered with the previous reply's bytes, unparsed. With stamps, it reports for
    each plan when it arrived, when its forward ended, and whether it was already waiting in the
    socket when the worker turned to it (the scheduler was ahead)."""
    sock = zmq.Context().socket(zmq.DEALER)
    sock.connect(address)
    num_tokens = np.zeros(1 << 16, dtype=np.int64)
    num_computed = np.zeros(1 << 16, dtype=np.int64)
    sevens = np.full(1 << 16, 7, dtype=np.int32)
    sock.send(pb.WorkerMessage(hello=pb.WorkerHello(
        worker_id="null", model="null", num_blocks=65536, block_size=16, max_model_len=8192,
        vocab_size=50000, eos_token_ids=[0], protocol_version=PROTOCOL_VERSION)).SerializeToString())
    busy_us, reply, times, ends, ready = 0.0, b"", [], [], []
    if forward_s:
        tighten_timer_slack()
    while True:
        waiting = bool(sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)
        frames = receive(sock, 1000, busy_us)
        if frames is None:
            continue
        busy_us = busy_poll_us
        data = frames[-1]
        if data[:4] == b"ping":
            sock.send(reply)
            continue
        msg = pb.SchedulerToWorker.FromString(data)
        if msg.WhichOneof("kind") == "shutdown":
            if stamps is not None:
                stamps.put((times, ends, ready))
            return
        plan = msg.plan
        start = time.perf_counter()
        times.append(start)
        ready.append(waiting)
        if len(times) == max_plans:  # enough: report the stamps and stop answering
            stamps.put((times, ends, ready))
            return
        slots = unpack(plan.running_slots).astype(np.int64)
        counts = unpack(plan.running_num_tokens)
        if plan.new_seqs:
            for s in plan.new_seqs:
                num_tokens[s.slot] = len(s.token_ids)
                num_computed[s.slot] = s.num_computed_tokens
            slots = np.concatenate([[s.slot for s in plan.new_seqs], slots]).astype(np.int64)
            counts = np.concatenate([[s.num_new_tokens for s in plan.new_seqs], counts])
        num_computed[slots] += counts
        sampled = slots[num_computed[slots] == num_tokens[slots]]
        num_tokens[sampled] += 1
        result = pb.StepResult(step_id=plan.step_id, slots=pack(sampled),
                               token_ids=pack(sevens[:len(sampled)]))
        reply = pb.WorkerMessage(result=result).SerializeToString()
        if forward_s:  # the forward: a GPU busy for forward_s from the plan's arrival
            wait_until(start + forward_s)
        ends.append(time.perf_counter())
        sock.send(reply)


# The null worker's forward ends on time, as a GPU's does: a worker thread waiting on a CUDA
# stream spins by default (cudaDeviceScheduleAuto with a core per context), so it sees the end
# at once. A plain sleep here overshoots by 0.1-0.2 ms (the kernel's 50 us timer slack, then the
# wake-up), which the step period would charge to the scheduler.
SPIN_S = 200e-6


def tighten_timer_slack() -> None:
    """This thread's timer slack down to 1 ns (Linux's prctl PR_SET_TIMERSLACK)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(29, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the sleep is coarser, and the period figures say so


def wait_until(deadline: float) -> None:
    time.sleep(max(0.0, deadline - SPIN_S - time.perf_counter()))
    while time.perf_counter() < deadline:
        pass


def run_once(opts) -> dict:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    proc = mp.get_context("spawn").Process(target=null_worker,
                                           args=(f"tcp://127.0.0.1:{port}", opts.busy_poll_us))
    proc.start()
    ident, data = sock.recv_multipart()
    router = Router(RouterConfig(max_num_seqs=opts.seqs, max_num_batched_tokens=8192))
    router.register(ident, pb.WorkerMessage.FromString(data).hello)
    for i in range(opts.seqs):
        # Staggered lengths, so that sequences cross block boundaries on different steps.
        length = opts.prompt_len + i % 16
        router.add(b"gw", pb.AddRequest(request_id=f"r{i}", max_tokens=4096, ignore_eos=True,
                                        prompt_token_ids=[(i * 31 + j) % 50000 + 1 for j in range(length)],
                                        sampling=pb.SamplingConfig()))

    phases = {"schedule": [], "encode + decode": [], "round trip": [], "update + stream": []}
    sizes = [0, 0]

    def iteration() -> int:
        t0 = time.perf_counter()
        plans = router.plans()
        t1 = time.perf_counter()
        for wid, plan in plans:
            frame = pb.SchedulerToWorker(plan=plan).SerializeToString()
            ta = time.perf_counter()
            sock.send_multipart([wid, frame])
            poll(sock, 1000, opts.busy_poll_us)  # as scheduler/server.py waits for a result
            _, reply = sock.recv_multipart()
            tb = time.perf_counter()
            result = pb.WorkerMessage.FromString(reply).result
            t2 = time.perf_counter()
            router.on_result(wid, result)
            sizes[:] = len(frame), len(reply)
        for msg in router.take_outbox().values():
            msg.SerializeToString()
        t3 = time.perf_counter()
        if plans:
            for key, took in zip(phases, (t1 - t0, (ta - t1) + (t2 - tb), tb - ta, t3 - t2)):
                phases[key].append(took)
        return len(plans)

    sched = router.workers[ident].scheduler
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.requests.values()):
        iteration()  # prefill until every sequence decodes
    for v in phases.values():
        v.clear()
    if opts.no_gc:
        gc.collect()
        gc.freeze()
        gc.disable()
    running = len(sched.running)
    profiler = cProfile.Profile() if opts.profile else None
    times = []
    if profiler:
        profiler.enable()
    for _ in range(opts.steps):
        t0 = time.perf_counter()
        iteration()
        times.append(time.perf_counter() - t0)
    if profiler:
        profiler.disable()
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)
    # The bare transport: a plan-sized frame out, the last result's bytes back, same polling.
    ping = b"ping" + b"\0" * max(0, sizes[0] - 4)
    pings = []
    for _ in range(opts.steps):
        t0 = time.perf_counter()
        sock.send_multipart([ident, ping])
        poll(sock, 1000, opts.busy_poll_us)
        sock.recv_multipart()
        pings.append(time.perf_counter() - t0)
    sock.send_multipart([ident, pb.SchedulerToWorker(shutdown=True).SerializeToString()])
    proc.join(5)
    sock.close(0)
    ctx.term()
    if opts.no_gc:
        gc.enable()
        gc.unfreeze()
    times.sort()
    return {"running": running, "median": statistics.median(times),
            "p90": times[int(0.9 * len(times))], "ping": statistics.median(pings), "sizes": sizes,
            **{k: statistics.median(v) for k, v in phases.items()}}


def gateway(address: str, seqs: int, prompt_len: int) -> None:
    """Sends the requests as a gateway does, then reads (and drops) their token deltas."""
    sock = zmq.Context().socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, b"gw")
    sock.connect(address)
    time.sleep(0.2)
    for i in range(seqs):
        length = prompt_len + i % 16
        sock.send(pb.GatewayMessage(add=pb.AddRequest(
            request_id=f"r{i}", max_tokens=8000 - length, ignore_eos=True, sampling=pb.SamplingConfig(),
            prompt_token_ids=[(i * 31 + j) % 50000 + 1 for j in range(length)])).SerializeToString())
    while True:
        sock.recv()


def run_pipelined(opts, forward_s: float) -> dict:
    """The real scheduler loop, one plan ahead, against a worker that sleeps forward_s per step."""
    import argparse as ap
    import threading

    import scheduler.server
    from scheduler.server import SchedulerServer

    from tests.cluster import free_port
    ports = [free_port(), free_port()]
    from scheduler.scheduler_flags import add_scheduler_args
    # The scheduler's own flags: loopback without CURVE, and no lease or liveness deadline to
    # trip over, since the transport and the loop are what is measured.
    args = add_scheduler_args(ap.ArgumentParser()).parse_args([
        "--scheduler-gateway-address", f"tcp://127.0.0.1:{ports[0]}",
        "--scheduler-worker-address", f"tcp://127.0.0.1:{ports[1]}", "--max-num-seqs", str(opts.seqs),
        "--max-num-batched-tokens", "8192", "--max-waiting-requests", str(1 << 20),
        "--busy-poll-us", str(opts.busy_poll_us), "--insecure", "--zmq-hwm", "100000",
        "--worker-timeout", "60", "--gateway-timeout", "1e9", "--no-worker-timeout", "1e9",
        "--no-async-scheduling" if opts.sync else "--async-scheduling"])
    server = SchedulerServer(args)
    spawn = mp.get_context("spawn")
    stamps = spawn.Queue()
    warmup = 50
    worker = spawn.Process(target=null_worker, args=(args.scheduler_worker_address, opts.busy_poll_us,
                                                     forward_s, stamps, warmup + opts.steps))
    gw = spawn.Process(target=gateway, args=(args.scheduler_gateway_address, opts.seqs, opts.prompt_len),
                       daemon=True)
    worker.start()
    gw.start()
    got = []
    # The loop's own time: everything but its waits in poll, counted between the warm-up's end
    # and the last plan (the worker reports arrival stamps; the loop stops soon after the last).
    waits = [(time.perf_counter(), 0.0)]  # (when a wait ended, total waited until then)

    def timed_poll(*a):
        t0 = time.perf_counter()
        try:
            return poll(*a)
        finally:
            t1 = time.perf_counter()
            waits.append((t1, waits[-1][1] + t1 - t0))

    scheduler.server.poll = timed_poll

    def stop() -> None:
        got.append(stamps.get())
        server.stop()

    threading.Thread(target=stop, daemon=True).start()
    profiler = cProfile.Profile() if opts.profile else None
    if profiler:
        profiler.enable()
    server.serve()
    # The loop may stop before another wait ends after the last plan: its end closes the count.
    waits.append((time.perf_counter(), waits[-1][1]))
    if profiler:
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(20)
    scheduler.server.poll = poll
    worker.join(5)
    gw.terminate()
    arrived, ended, ready = got[0]
    periods = sorted(b - a for a, b in zip(arrived[warmup:], arrived[warmup + 1:]))
    # From a forward's end to the next plan's arrival: the worker's own turn-around, when the
    # plan was already waiting.
    turns = [arrived[i + 1] - ended[i] for i in range(warmup, len(arrived) - 1) if ready[i + 1]]
    # Busy = wall minus waits, between the arrivals of the first measured and the last plan
    # (perf_counter is CLOCK_MONOTONIC, shared by the two processes).
    first, last = arrived[warmup], arrived[-1]
    w0 = next(w for t, w in waits if t >= first)
    t1, w1 = next((t, w) for t, w in waits if t >= last)
    return {"period": statistics.median(periods), "p90": periods[int(0.9 * len(periods))],
            "busy": ((t1 - first) - (w1 - w0)) / (len(arrived) - warmup - 1),
            "ready": sum(ready[warmup + 1:]) / len(ready[warmup + 1:]),
            "turn": statistics.median(turns) if turns else float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--no-gc", action="store_true")
    ap.add_argument("--busy-poll-us", type=float, default=500.0,
                    help="as the scheduler's and the worker's flag (their default)")
    ap.add_argument("--forward-ms", default="5,1",
                    help="the null worker's forward times for the step-period runs ('' = none)")
    ap.add_argument("--sync", action="store_true", help="the period runs without the plan ahead")
    opts = ap.parse_args()
    ms = lambda x: f"{x * 1e3:.3f}"  # noqa: E731
    print("| repeat | median ms | p90 ms | schedule | encode + decode | round trip | update + stream "
          "| bare ping-pong | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    runs = []
    for i in range(opts.repeats):
        r = run_once(opts)
        runs.append(r)
        print(f"| {i + 1} | {ms(r['median'])} | {ms(r['p90'])} | {ms(r['schedule'])} | "
              f"{ms(r['encode + decode'])} | {ms(r['round trip'])} | {ms(r['update + stream'])} | "
              f"{ms(r['ping'])} | {r['median'] / r['ping']:.2f} |", flush=True)
    med = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
    print(f"\n{runs[0]['running']} running sequences, {opts.steps} steps per repeat, plan "
          f"{runs[0]['sizes'][0]} B, result {runs[0]['sizes'][1]} B, "
          f"busy poll {opts.busy_poll_us:.0f} us{', gc frozen' if opts.no_gc else ''}")
    print(f"median over repeats: {ms(med('median'))} ms per iteration, bare ping-pong "
          f"{ms(med('ping'))} ms, ratio {statistics.median(r['median'] / r['ping'] for r in runs):.2f}")
    # Everything the scheduler computes for a step; only the wait for the worker is left out.
    own = med("schedule") + med("encode + decode") + med("update + stream")
    print(f"the scheduler's own time per step (schedule, encode, decode, update): {ms(own)} ms")
    for forward in [float(f) / 1e3 for f in opts.forward_ms.split(",") if f]:
        r = run_pipelined(opts, forward)
        floor = max(forward, own)
        print(f"forward {ms(forward)} ms, {'synchronous' if opts.sync else 'one plan ahead'}: step "
              f"period median {ms(r['period'])} ms (p90 {ms(r['p90'])}), "
              f"{r['period'] / floor:.3f}x max(forward, own time); the loop busy "
              f"{ms(r['busy'])} ms per step (all but its waits in poll); the next plan was "
              f"already waiting at {100 * r['ready']:.1f}% of forward ends, and then arrived "
              f"{ms(r['turn'])} ms after the end (median)", flush=True)


if __name__ == "__main__":
    main()
