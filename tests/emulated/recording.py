"""Kernel calls recorded on this machine for tests/emulated/runner.c to replay: each call goes
through the kernel's own Python wrapper with the library's entry point swapped for a recorder,
so the guest receives exactly the arguments a worker passes; pointers are mapped to the
runner's buffers (tensors by their data, ctypes structures with their pointer fields
relocated)."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Callable

import torch

from pagoda.kernels import cbuild
from tests.emulated import bochs

THREADS = (1, 2, 3)


@dataclass
class Case:
    tag: str
    out_shape: tuple[int, int]
    out_dtype: torch.dtype
    judge: Callable[[torch.Tensor], float]  # worst error over the bound (<= 1 agrees)



def record(module, call: Callable[[], torch.Tensor | None], tensors: list[torch.Tensor], calls: bochs.Calls,
           buffers: dict[int, str], tag: str, out: torch.Tensor | None = None,
           structs: tuple = ()) -> torch.Tensor:
    """Runs `call` (a kernel wrapper) with the kernel's fn recording instead of computing, and
    adds the recorded call to `calls`: pointers, as arguments or in a structure's fields, must
    point at `tensors` (which the wrapper passes where they lie), at the output (`out`, else
    what `call` returns, a buffer of zeros) or at `structs` (ctypes structures or arrays of
    them the caller built); a pointer to a structure argument (byref) takes the structure along;
    float arguments stay floats. Returns the output tensor."""
    seen = []
    real = module._kernel.fn
    module._kernel.fn = lambda *args: seen.append(args)
    try:
        returned = call()
    finally:
        module._kernel.fn = real
    out = returned if out is None else out
    pointers = {t.data_ptr(): buffers[id(t)] for t in tensors}
    if out.data_ptr() not in pointers:
        pointers[out.data_ptr()] = calls.buffer(out.numel() * out.element_size())
    for struct in structs:
        pointers[ctypes.addressof(struct)] = struct_buffer(calls, struct, pointers, tag)
    args = []
    for arg, kind in zip(seen[0], module._kernel.argtypes):
        if kind is ctypes.c_void_p:
            if arg not in pointers:
                raise ValueError(f"{tag}: the wrapper passed a pointer to a copy, not to a given tensor")
            args.append(pointers[arg])
        elif kind in (ctypes.c_float, ctypes.c_double):
            if kind is ctypes.c_double:
                raise ValueError("the runner passes floats, not doubles")
            args.append(f"f{float(arg)!r}")
        elif isinstance(kind, type) and issubclass(kind, ctypes._Pointer):
            args.append(struct_buffer(calls, arg._obj, pointers, tag))
        else:
            args.append(int(arg))
    calls.call(tag, module._kernel.fn_symbol, pointers[out.data_ptr()], *args)
    return out


def struct_buffer(calls: bochs.Calls, struct, pointers: dict[int, str], tag: str) -> str:
    """A buffer holding a ctypes structure (or an array of them) whose pointer fields (c_void_p)
    the guest sets to the buffers of `pointers` (address -> buffer); NULL stays NULL."""
    items = struct if isinstance(struct, ctypes.Array) else [struct]
    name = calls.buffer(bytes(struct))
    for i, item in enumerate(items):
        for field, kind in item._fields_:
            if kind is ctypes.c_void_p:
                address = getattr(item, field)
                if address is None:
                    continue
                if address not in pointers:
                    raise ValueError(f"{tag}: {type(item).__name__}.{field} points at no given tensor or structure")
                calls.pointer(name, i * ctypes.sizeof(item) + getattr(type(item), field).offset, pointers[address])
            elif not issubclass(kind, (ctypes.c_int, ctypes.c_int64, ctypes.c_float)):
                raise ValueError(f"{tag}: {field}: the recorder relocates only c_void_p pointers")
    return name


def use_library(calls: bochs.Calls, module) -> None:
    """Later calls go to module's library; the guest prints which path its CPU offers."""
    calls.library(cbuild.build(module.SOURCE, module.FLAGS))
    module.available()  # types fn, so that the recorder replaces a real entry point
    calls.value(f"isa:{module.__name__}", module._kernel.isa_symbol)


def path_name(module, isa: int) -> str:
    """The path's name as a tag holds it (the runner's spec is split on spaces)."""
    return module.ISA_NAMES[isa].replace(" ", "_")


def paths(module, here: bool) -> list[int]:
    """Every path of the kernel, best first; here: those this CPU has."""
    return module.supported_isas() if here else sorted(module.ISA_NAMES, reverse=True)


def within(want: torch.Tensor, tol: float) -> Callable[[torch.Tensor], float]:
    """An attention kernel's judge: its largest error over tol, inf where a NaN got through."""
    return lambda got: float("inf") if got.isnan().any() else float((got.double() - want).abs().max()) / tol


def into_nan(calls: bochs.Calls, buffers: dict[int, str], keep: list[torch.Tensor], module, tag: str,
             shared: list[torch.Tensor], q: torch.Tensor, judge, call: Callable[[torch.Tensor], None]) -> Case:
    """An attention call recorded with an output like q that starts as NaN (a row the kernel
    leaves unwritten shows)."""
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)
    add_inputs(calls, buffers, out)
    keep.append(out)
    record(module, lambda: call(out), shared + [out], calls, buffers, tag, out=out)
    return Case(tag, tuple(out.shape), q.dtype, judge)


def add_inputs(calls: bochs.Calls, buffers: dict[int, str], *tensors: torch.Tensor) -> None:
    for t in tensors:
        buffers[id(t)] = calls.buffer(t.contiguous().view(torch.uint8).numpy().tobytes())
