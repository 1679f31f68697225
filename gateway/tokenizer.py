"""The gateway's tokenizer: encode, decode, chat template, special tokens.

Runtime work goes through the Rust `tokenizers.Tokenizer` loaded from a tokenizer.json, and chat
templates are rendered with jinja2 the way transformers does it, so the gateway starts in well
under a second and never imports transformers on the hot path. transformers is needed only once
per GGUF file, to convert its embedded vocabulary into tokenizer.json (cached under
cache_dir(model, "tokenizer")).
"""
from __future__ import annotations

import json
import re
from array import array
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Sequence

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from gateway.chat.chat_literals import encode_with_literals, literal_segments
from gateway.piece_encoding import PieceEncoder
from gateway.chat.chat_templates import TOOLS_TEMPLATE, reads_tools, wants_tools
from modelfiles.resolve import model_display_name, tokenizer_folder

ROLES = ("system", "user", "assistant", "tool")

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table: each byte as a printable character, which is how ByteLevel vocabularies
    spell their tokens (a space is 'Ġ', a newline 'Ċ')."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = list(bs)  # printable bytes stand for themselves
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


def _decoder_types(node) -> set[str]:
    """Every decoder type in a decoder's JSON, looking into Sequence decoders."""
    if isinstance(node, list):
        return set().union(*(_decoder_types(x) for x in node)) if node else set()
    if not isinstance(node, dict):
        return set()
    out = {node["type"]} if isinstance(node.get("type"), str) else set()
    if node.get("type") == "Replace" and node.get("pattern") == {"String": "\u2581"} \
            and node.get("content") == " ":
        out.add("Metaspace")  # Llama-style: the Replace decoder is what turns ▁ into a space
    return out | _decoder_types(node.get("decoders"))


def _special_token(config: dict, key: str) -> str | None:
    value = config.get(key)
    if isinstance(value, dict):  # older configs store an AddedToken dict
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(folder: Path, config: dict) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _environment() -> ImmutableSandboxedEnvironment:
    # The same environment settings as transformers' apply_chat_template, so templates written
    # for it (whitespace control, raise_exception, tojson) render identically here.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, sort_keys=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)  # Llama 3 templates
    return env


def _compile_template(source: str) -> jinja2.Template:
    return _environment().from_string(source)


# Inputs longer than this go to the batch encoders: their Rust code runs with the GIL released
# (tokenizers' bindings wrap encode_batch and decode_batch in py.allow_threads / detach, not
# encode), so a large input tokenized on a thread leaves the event loop its time. Shorter ones
# take the plain calls, which cost the same there.
_UNLOCKED_FROM = 4096


class _Unlocked:
    """A tokenizers.Tokenizer's encode, through encode_batch for long texts."""
    __slots__ = ("tok",)

    def __init__(self, tok: Tokenizer | None):
        self.tok = tok

    def encode(self, text: str, add_special_tokens: bool = True):
        if len(text) > _UNLOCKED_FROM:
            return self.tok.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        return self.tok.encode(text, add_special_tokens=add_special_tokens)


@dataclass
class TextTokenizer:
    """Everything the gateway needs to turn text into ids and back."""
    tokenizer: Tokenizer
    name: str
    bos_token: str | None = None
    eos_token: str | None = None
    chat_template: str | None = None  # the model's, or --chat-template's
    eos_token_ids: list[int] = field(default_factory=list)
    source: Path | None = None  # the tokenizer.json it was loaded from, if any
    _template: jinja2.Template | None = field(default=None, repr=False)
    # Logprobs ask for the text and bytes of every sampled and top-k token; the answer per id
    # never changes, so each is computed once.
    _bytes_cache: dict[int, bytes] = field(default_factory=dict, repr=False, compare=False)
    _text_cache: dict[int, str] = field(default_factory=dict, repr=False, compare=False)
    _decoders: set[str] | None = field(default=None, repr=False, compare=False)
    _added: dict[int, str] | None = field(default=None, repr=False, compare=False)
    # The same vocabulary, reading special-token text as plain text (gateway/chat/chat_literals.py);
    # a copy, because the switch is the tokenizer's own state and encoding runs on threads too.
    _literal: Tokenizer | None = field(default=None, repr=False, compare=False)
    _specials: frozenset[str] | None = field(default=None, repr=False, compare=False)
    # gateway/chat/chat_templates.py: the shipped tool template, for tool requests when the active
    # template never reads `tools`.
    _reads_tools: bool = field(default=False, repr=False, compare=False)
    _tools_template: jinja2.Template | None = field(default=None, repr=False, compare=False)
    _pieces: PieceEncoder | None = field(default=None, repr=False, compare=False)
    _literal_pieces: PieceEncoder | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.chat_template:
            self._template = _compile_template(self.chat_template)
            self._reads_tools = reads_tools(_environment(), self.chat_template)

    @property
    def vocab_size(self) -> int:
        # Added tokens count: their ids are valid input and output.
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return _Unlocked(self.tokenizer).encode(text, add_special_tokens=add_special_tokens).ids

    def encode_with_offsets(self, text: str, add_special_tokens: bool = True,
                            literal: Sequence[tuple[int, int]] = ()
                            ) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and each one's (start, end) in code points of `text`; tokens the post-processor
        added (a BOS) span nothing, e.g. (0, 0). A token holding part of a character spans all of it.
        Special-token text inside the `literal` spans is read as plain text."""
        if not literal:  # tokenizers' own list: no copy (a million offsets are 60 MB of tuples)
            enc = _Unlocked(self.tokenizer).encode(text, add_special_tokens=add_special_tokens)
            return enc.ids, enc.offsets
        return encode_with_literals(_Unlocked(self.tokenizer), _Unlocked(self._literal_tokenizer()), text,
                                    literal, add_special_tokens)

    def encode_bounded(self, text: str, add_special_tokens: bool, max_tokens: int,
                       literal: Sequence[tuple[int, int]] = ()) -> tuple[array, array]:
        """(ids, offsets) as encode_with_offsets, in arrays (offsets: start and end per id,
        interleaved), encoded in pieces so that memory follows the tokens kept, not the text;
        raises piece_encoding.TooManyTokens past max_tokens."""
        if self._pieces is None:
            self._pieces = PieceEncoder(self.tokenizer)
        if not literal:
            return self._pieces.encode(text, add_special_tokens, max_tokens)
        if self._literal_pieces is None:
            self._literal_pieces = PieceEncoder(self._literal_tokenizer())
        ids, offsets = array("I"), array("I")
        for is_literal, start, end in literal_segments(literal, len(text)):
            encoder = self._literal_pieces if is_literal else self._pieces
            part_ids, part_offsets = encoder.encode(text[start:end], False, max_tokens - len(ids))
            ids.extend(part_ids)
            offsets.extend(start + x for x in part_offsets)
        return ids, offsets

    def _literal_tokenizer(self) -> Tokenizer:
        if self._literal is None:
            self._literal = Tokenizer.from_str(self.tokenizer.to_str())
            self._literal.encode_special_tokens = True
        return self._literal

    @property
    def special_texts(self) -> frozenset[str]:
        """The text of every special added token (<|im_start|>, ...)."""
        if self._specials is None:
            self._specials = frozenset(t.content for t in self.tokenizer.get_added_tokens_decoder().values()
                                       if t.special and t.content)
        return self._specials

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes the token stands for, which can be part of a UTF-8 character (byte-level
        BPE, byte fallback): concatenating a sequence's token_bytes gives its text's UTF-8."""
        cached = self._bytes_cache.get(token_id)
        if cached is None:
            cached = self._bytes_cache[token_id] = self._token_bytes(token_id)
        return cached

    def token_text(self, token_id: int) -> str:
        """The token alone as text; U+FFFD where it holds only part of a character."""
        cached = self._text_cache.get(token_id)
        if cached is None:
            cached = self._text_cache[token_id] = self.token_bytes(token_id).decode("utf-8", "replace")
        return cached

    def _token_bytes(self, token_id: int) -> bytes:
        if self._decoders is None:
            decoder = self.tokenizer.decoder
            self._decoders = _decoder_types(json.loads(decoder.__getstate__())) if decoder else set()
            self._added = {i: t.content for i, t in self.tokenizer.get_added_tokens_decoder().items()}
        if token_id in self._added:
            # Added tokens are stored verbatim, never in the model's byte spelling.
            return self._added[token_id].encode()
        token = self.tokenizer.id_to_token(token_id)
        if token is None:
            return b""
        if "ByteLevel" in self._decoders and all(c in _UNICODE_TO_BYTE for c in token):
            return bytes(_UNICODE_TO_BYTE[c] for c in token)
        if "ByteFallback" in self._decoders and (m := _BYTE_FALLBACK.fullmatch(token)):
            return bytes([int(m.group(1), 16)])
        if "Metaspace" in self._decoders:
            # Not decode(): its Strip/prepend rule drops the leading space of a lone first token,
            # and that space is part of what the token contributes mid-text.
            return token.replace("\u2581", " ").encode()
        return self.decode([token_id], skip_special_tokens=False).encode()

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if len(ids) > _UNLOCKED_FROM:  # decode_batch releases the GIL, as encode_batch does
            return self.tokenizer.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        return self.tokenizer.id_to_token(token_id) or ""

    def template_for(self, messages: Sequence[dict], tools: Sequence[dict] | None) -> jinja2.Template:
        if wants_tools(messages, tools) and not self._reads_tools:
            if self._tools_template is None:
                self._tools_template = _compile_template(TOOLS_TEMPLATE.read_text())
            return self._tools_template
        if self._template is None:
            raise ValueError(f"model {self.name} has no chat template; send a prompt instead")
        return self._template

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                    tools: Sequence[dict] | None = None) -> str:
        """tools: OpenAI's tool objects ({"type": "function", "function": {...}}), as
        transformers passes them; None when the request has none."""
        return self.template_for(messages, tools).render(
            messages=list(messages), tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def encode_chat(self, messages: Sequence[dict]) -> list[int]:
        # The template already writes every special token it wants (as transformers does with
        # tokenize=True), so the post-processor must not add a BOS of its own.
        return self.encode(self.render_chat(messages), add_special_tokens=False)


def load_tokenizer(model: str = "", chat_template: str | None = None) -> TextTokenizer:
    """chat_template: a template's text that replaces the model's (--chat-template)."""
    path, folder = tokenizer_folder(model)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    eos = _special_token(config, "eos_token")
    eos_ids = [i for i in [tok.token_to_id(eos)] if i is not None] if eos else []
    return TextTokenizer(
        tokenizer=tok, name=model_display_name(path),
        bos_token=_special_token(config, "bos_token"), eos_token=eos,
        chat_template=chat_template or _chat_template(folder, config), eos_token_ids=eos_ids,
        source=folder / "tokenizer.json")
