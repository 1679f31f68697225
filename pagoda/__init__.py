"""`from pagoda import LLM, SamplingParams`: the offline API (pagoda/offline.py), by the name users
import it under. The engine itself lives in the packages of the repository's top level.

The names are imported on first use, not here: a worker that imports pagoda.kernels runs this file
too, and must not start the gateway's code and the launcher with it.

pagoda.kernels is the repository's kernels/ folder. Its import name is not `kernels`, which is
Hugging Face's package, imported by transformers when installed: a top-level `kernels` of ours
would shadow it from the checkout's root. A wheel puts the folder inside pagoda/ (pyproject.toml's
package-dir); in the checkout, and in an editable install of it, the finder below maps that one
name to the folder beside this one, and nothing else of the repository's top level."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent


class _CheckoutKernels(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != "pagoda.kernels":
            return None
        spec = importlib.machinery.ModuleSpec(fullname, None, is_package=True)
        spec.submodule_search_locations = [str(_HERE.parent / "kernels")]
        return spec


if not (_HERE / "kernels").is_dir():
    sys.meta_path.insert(0, _CheckoutKernels())  # before an editable install of another checkout

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
