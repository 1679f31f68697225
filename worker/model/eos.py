"""Which token ids end a sequence, read from the model files: the worker announces them in its
hello and the scheduler stops on them (one source of truth for the whole cluster).

Three places can name an end token, and chat models need all of them: the model config
(config.json, or GGUF's tokenizer.ggml.eos_token_id / eot_token_id), generation_config.json
(which transformers' generate stops on), and the tokenizer's end-of-turn token: a chat template
closes every turn with a special token such as <|im_end|> or <|eot_id|>, and an instruct model
ends its answer with it even where the config names another EOS.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterable

# Special tokens that close a turn or a text. Only those that also occur in the chat template
# count as end-of-turn, so a vocabulary that merely contains such a token changes nothing.
_END_MARKER = re.compile(r"end|eot|eos|</s>", re.IGNORECASE)


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def end_of_turn_ids(template: str | None, special_tokens: dict[str, int]) -> list[int]:
    """The special tokens written by the chat template that mark an end (by name)."""
    if not template:
        return []
    return [i for text, i in special_tokens.items() if _END_MARKER.search(text) and text in template]


def eos_token_ids(model_path: Path, config_eos: Iterable[int]) -> list[int]:
    """Every id that ends a sequence for this model, config first, without repeats."""
    model_path = Path(model_path)
    found = list(config_eos)
    if model_path.is_dir():
        found += _hf_dir(model_path)
    # A GGUF file's ids are in its config already (ModelConfig.from_gguf reads the metadata once).
    return list(dict.fromkeys(found))


def _hf_dir(folder: Path) -> list[int]:
    found: list[int] = []
    gen = folder / "generation_config.json"
    if gen.exists():
        found += _ids(json.loads(gen.read_text()).get("eos_token_id"))
    special: dict[str, int] = {}
    tok_file = folder / "tokenizer.json"
    if tok_file.exists():
        for tok in json.loads(tok_file.read_text()).get("added_tokens", []):
            if tok.get("special"):
                special[tok["content"]] = int(tok["id"])
    cfg_file = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
    for key, tok in (cfg.get("added_tokens_decoder") or {}).items():
        if isinstance(tok, dict) and tok.get("special"):
            special.setdefault(tok["content"], int(key))
    eos = cfg.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if isinstance(eos, str) and eos in special:
        found.append(special[eos])
    template = cfg.get("chat_template")
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        template = jinja.read_text()
    if isinstance(template, list):
        template = " ".join(t.get("template", "") for t in template if isinstance(t, dict))
    found += end_of_turn_ids(template if isinstance(template, str) else None, special)
    return found


def gguf_special_tokens(tokens: list[str] | None, types: list[int] | None) -> dict[str, int]:
    """llama.cpp's token types 3 (control) and 4 (user-defined) are the special tokens."""
    if tokens is None or types is None:
        return {}
    return {t: i for i, (t, kind) in enumerate(zip(tokens, types)) if kind in (3, 4)}
