"""kernels/ is imported as pagoda.kernels, and no top-level `kernels` of ours is left to win the
search: `kernels` is Hugging Face's package, which transformers imports when it is installed
(integrations/hub_kernels.py, at model load). From the checkout's root, ours was found first and
that import failed: "cannot import name 'CUDAProperties' from 'kernels'"."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.cluster import ROOT

# What transformers imports from Hugging Face's `kernels`, doing nothing: installed beside the
# checkout as the real one would be, with a version transformers accepts (5.24: >= 0.18.2, < 0.19).
STAND_IN = '''"""A stand-in for Hugging Face's kernels."""
import contextlib
import enum


class Mode(enum.Flag):
    INFERENCE = 1
    TRAINING = 2
    TORCH_COMPILE = 4
    FALLBACK = 8


class _Described:
    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


class CUDAProperties(_Described): pass
class ROCMProperties(_Described): pass
class Device(_Described): pass
class LayerRepository(_Described): pass
class LocalLayerRepository(_Described): pass
class KernelizeFallback(_Described): pass


def register_kernel_mapping(*args, **kwargs): pass
def replace_kernel_forward_from_hub(*args, **kwargs): pass
def use_kernel_mapping(*args, **kwargs): return contextlib.nullcontext()
def get_kernel(*args, **kwargs): raise RuntimeError("a stand-in")
def kernelize(model, *args, **kwargs): return model
def use_kernel_forward_from_hub(layer_name): return lambda cls: cls
def use_kernelized_func(*functions): return lambda cls: cls
'''

PROBE = """
import json, sys
import pagoda.kernels.cbuild  # a worker's first kernel import, before torch
started = sorted({m.split(".")[0] for m in sys.modules} & {"gateway", "launch", "scheduler", "worker"})
offline = "pagoda.offline" in sys.modules
from transformers import LlamaConfig, LlamaForCausalLM
import transformers.integrations.hub_kernels as hub
import kernels
import pagoda.kernels.cpu_kv_layout as ours
LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, vocab_size=64))
print(json.dumps({"theirs": kernels.__file__, "ours": ours.__file__, "started": started,
                  "offline": offline, "transformers_took_theirs": hub.CUDAProperties is kernels.CUDAProperties}))
"""


def test_transformers_imports_hugging_faces_kernels_from_the_checkouts_root(tmp_path):
    """The stand-in installed on PYTHONPATH, the probe run from the checkout's root (on sys.path
    first, as `python -c` and `python -m` put it): transformers takes the stand-in, pagoda its own
    kernels under pagoda.kernels, and importing those starts none of the processes' code."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text(STAND_IN)
    (tmp_path / "kernels-0.18.2.dist-info").mkdir()
    (tmp_path / "kernels-0.18.2.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: kernels\nVersion: 0.18.2\n")
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env={**os.environ, "PYTHONPATH": path},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert found == {"theirs": str(tmp_path / "kernels" / "__init__.py"),
                     "ours": str(ROOT / "kernels" / "cpu_kv_layout.py"),
                     "started": [], "offline": False, "transformers_took_theirs": True}
