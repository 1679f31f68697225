"""Integer columns in internal messages: `bytes` fields of little-endian int32 (see StepPlan).

A repeated uint32 field costs a Python-level loop on each side for every element; a column is
one memcpy into and out of numpy, which keeps a 256-sequence step's plan and result at a few
microseconds to encode and decode."""
from __future__ import annotations

from typing import Iterable

import numpy as np

DTYPE = np.dtype("<i4")


def pack(values: Iterable[int] | np.ndarray) -> bytes:
    """ints (a list, a range or an array) as a column."""
    if isinstance(values, np.ndarray):
        return values.astype(DTYPE, copy=False).tobytes()
    return np.fromiter(values, dtype=DTYPE).tobytes()


def unpack(data: bytes) -> np.ndarray:
    """A column as a read-only int32 array (no copy)."""
    if len(data) % DTYPE.itemsize:
        raise ValueError(f"a column of {len(data)} bytes is not a whole number of int32 values")
    return np.frombuffer(data, dtype=DTYPE)


def unpack_list(data: bytes) -> list[int]:
    return unpack(data).tolist()


F32 = np.dtype("<f4")


def pack_f32(values: Iterable[float] | np.ndarray) -> bytes:
    """floats as a float32 column (logprobs)."""
    if isinstance(values, np.ndarray):
        return values.astype(F32, copy=False).tobytes()
    return np.fromiter(values, dtype=F32).tobytes()


def unpack_f32(data: bytes) -> np.ndarray:
    if len(data) % F32.itemsize:
        raise ValueError(f"a column of {len(data)} bytes is not a whole number of float32 values")
    return np.frombuffer(data, dtype=F32)
