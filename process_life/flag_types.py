"""argparse types for numeric flags, shared by every process's parser: a value out of its range
stops the start with one line naming the flag (exit 2, before the launcher starts anything),
where a plain int took it and something later went wrong: --port 70000 served on 4464 (gRPC
takes the port modulo 2^16), --max-num-seqs 0 served nothing, --max-num-seqs -5 restarted a
worker forever on a protobuf ValueError, --zmq-hwm 0 made ZeroMQ's queues unbounded."""
from __future__ import annotations

import argparse


def int_at_least(minimum: int, maximum: int | None = None, name: str = "int"):
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(
                f"must be >= {minimum}, got {value}" if maximum is None
                else f"must be in [{minimum}, {maximum}], got {value}")
        return value
    parse.__name__ = name  # argparse names the type in its error message
    return parse


def float_at_least(minimum: float, name: str = "number", strict: bool = False):
    """A finite float >= minimum (> with strict)."""
    def parse(text: str) -> float:
        value = float(text)
        if not (value > minimum if strict else value >= minimum) or value == float("inf"):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {minimum:g}, got {text}")
        return value
    parse.__name__ = name
    return parse


PORT = int_at_least(0, 65535, "port")                    # 0: the system picks one
POSITIVE_SECONDS = float_at_least(0.0, "seconds", strict=True)
SECONDS = float_at_least(0.0, "seconds")                 # 0 allowed (off, or at once)
COUNT = int_at_least(1)                                  # a bound: at least one
MICROSECONDS = float_at_least(0.0, "microseconds")


def fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value
