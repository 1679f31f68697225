"""Waiting for a ZeroMQ message: spin briefly, then block.

A blocked process that a message wakes up costs tens of microseconds more than one that is
polling (the kernel, and on a VM the hypervisor, must wake the sleeping CPU). Between a worker's
result and the next plan the scheduler needs well under a millisecond, so both ends spin for
--busy-poll-us after their message goes out before they sleep, as vLLM's shared-memory queue does.
"""
from __future__ import annotations

import os
import time

import zmq

# Spinning pays only where a core is free for it: on a machine with fewer cores the spinner takes
# one from the worker's forward (torch uses every core) or from ZeroMQ's I/O thread.
SPIN_MIN_CORES = 4
DEFAULT_BUSY_POLL_US = 500.0


def resolve_busy_poll_us(flag: float | None) -> float:
    """The --busy-poll-us flag, or when unset: spin where there are cores to spare."""
    if flag is not None:
        return flag
    return DEFAULT_BUSY_POLL_US if len(os.sched_getaffinity(0)) >= SPIN_MIN_CORES else 0.0


def poll(target: zmq.Socket | zmq.Poller, timeout_ms: float, busy_us: float = 0.0):
    """target.poll(timeout_ms), spinning with non-blocking polls for the first busy_us."""
    if busy_us > 0:
        deadline = time.perf_counter() + busy_us * 1e-6
        while True:
            events = target.poll(0)
            if events:
                return events
            if time.perf_counter() >= deadline:
                break
            # ZeroMQ moves bytes on its own I/O thread: on a machine with few cores a spinner
            # that never yields can keep that thread, and so the very message, waiting.
            os.sched_yield()
        timeout_ms -= busy_us / 1000
    return target.poll(max(0, int(timeout_ms)))


def receive(sock: zmq.Socket, timeout_ms: float, busy_us: float = 0.0) -> list[bytes] | None:
    """The next message's frames, or None after timeout_ms. With a plan ahead, the next plan is
    usually queued already when a step ends: it is taken without a poll, which on a machine
    with few cores costs a system call and often a reschedule (measured: bench_scheduler.py)."""
    try:
        return sock.recv_multipart(zmq.NOBLOCK)
    except zmq.Again:
        pass
    if not poll(sock, timeout_ms, busy_us):
        return None
    return sock.recv_multipart()
