"""`from pagoda import LLM, SamplingParams`: the offline API (pagoda/offline.py), by the name users
import it under. The engine itself lives in the packages of the repository's top level.

The names are imported on first use, not here: a worker that imports pagoda.kernels runs this file
too, and must not start the gateway's code and the launcher with it."""
from __future__ import annotations

import importlib

_EXPORTS = {"LLM": "pagoda.offline",
            "SamplingParams": "pagoda.params", "BeamSearchParams": "pagoda.params",
            "StructuredOutputsParams": "pagoda.params",
            "RequestOutput": "pagoda.outputs", "CompletionOutput": "pagoda.outputs",
            "Logprob": "pagoda.outputs", "GenerationError": "pagoda.outputs"}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pagoda' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
