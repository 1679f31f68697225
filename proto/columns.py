"""Integer columns in internal messages: `bytes` fields of little-endian int32 (see StepPlan).

A repeated uint32 field costs a Python-level loop on each side for every element; a column is
one memcpy into and out of numpy, which keeps a 256-sequence step's plan and result at a few
microseconds to encode and decode."""
from __future__ import annotations

from typing import Iterable

import numpy as np

DTYPE = np.dtype("<i4")
F32 = np.dtype("<f4")  # logprobs


def pack(values: Iterable[int] | np.ndarray, dtype: np.dtype = DTYPE) -> bytes:
    """ints (a list, a range or an array) as a column."""
    if isinstance(values, np.ndarray):
        return values.astype(dtype, copy=False).tobytes()
    return np.fromiter(values, dtype=dtype).tobytes()


def unpack(data: bytes, dtype: np.dtype = DTYPE) -> np.ndarray:
    """A column as a read-only array (no copy)."""
    if len(data) % dtype.itemsize:
        raise ValueError(f"a column of {len(data)} bytes is not a whole number of {dtype.name} values")
    return np.frombuffer(data, dtype=dtype)


def unpack_list(data: bytes) -> list[int]:
    return unpack(data).tolist()


def pack_f32(values: Iterable[float] | np.ndarray) -> bytes:
    return pack(values, F32)


def unpack_f32(data: bytes) -> np.ndarray:
    return unpack(data, F32)
