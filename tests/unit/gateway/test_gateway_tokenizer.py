"""The gateway's tokenizer (tokenizers + jinja2) agrees with transformers on the same files, and
gives each token's offsets, text and raw bytes (what logprobs and Tokenize report)."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from gateway.tokenizer import TextTokenizer, load_tokenizer
from modelfiles.resolve import tokenizer_folder

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "naïve 😀 日本語"}, {"role": "assistant", "content": "ok"},
     {"role": "tool", "content": '{"x": 1}'}, {"role": "user", "content": ""}],
]


@pytest.fixture(scope="module")
def both():
    transformers = pytest.importorskip("transformers")
    _, folder = tokenizer_folder("")
    return load_tokenizer(""), transformers.AutoTokenizer.from_pretrained(str(folder))


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_transformers(both, messages):
    ours, theirs = both
    expected = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours.render_chat(messages) == expected
    expected_ids = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(expected_ids, dict) or hasattr(expected_ids, "input_ids"):
        expected_ids = expected_ids["input_ids"]
    assert ours.encode_chat(messages) == list(expected_ids)


@pytest.mark.parametrize("text", ["Hello world", " leading space", "😀 日本語 naïve", "<|im_end|> x"])
def test_encode_decode_match_transformers(both, text):
    ours, theirs = both
    assert ours.encode(text) == theirs.encode(text)
    ids = ours.encode(text)
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


def test_model_facts():
    tok = load_tokenizer("")
    assert tok.name == "SmolLM2-135M-Instruct"
    assert tok.vocab_size == 49152
    assert tok.eos_token_ids == [tok.tokenizer.token_to_id("<|im_end|>")]
    with pytest.raises(FileNotFoundError):
        load_tokenizer("/no/such/model.gguf")


# ---------------------------------------------------------------------------- offsets and bytes


@pytest.fixture(scope="module")
def smol():
    return load_tokenizer("")


def tiny_bos_tokenizer() -> TextTokenizer:
    """Word-level, with a post-processor that puts <s> in front, as Llama-style tokenizers do."""
    words = ["<s>", "[UNK]", "hello", "world", "!"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return TextTokenizer(tokenizer=tok, name="tiny-bos", bos_token="<s>")


def tiny_byte_fallback_tokenizer() -> TextTokenizer:
    """SentencePiece-style: ▁ for spaces, and <0xHH> tokens for bytes the vocabulary lacks."""
    pieces = ["<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += ["▁", "h", "e", "l", "o", "▁h", "▁he", "▁hel", "▁hell", "▁hello"]
    merges = [("▁", "h"), ("▁h", "e"), ("▁he", "l"), ("▁hel", "l"), ("▁hell", "o")]
    tok = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, merges, unk_token="<unk>",
                               byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return TextTokenizer(tokenizer=tok, name="tiny-sp")


def test_offsets_are_code_points(smol):
    text = "a 😀 日本語 naïve\n\tx  y"
    ids, offsets = smol.encode_with_offsets(text)
    assert ids == smol.encode(text) and len(offsets) == len(ids)
    for token_id, (start, end) in zip(ids, offsets):
        assert 0 <= start < end <= len(text)
        token = smol.token_text(token_id)
        # A token holding part of a character spans the whole character.
        assert text[start:end] == token if "\ufffd" not in token else len(text[start:end].strip()) == 1
    assert offsets[-1][1] == len(text)


def test_add_special_tokens_adds_the_bos_or_not():
    tok = tiny_bos_tokenizer()
    assert tok.encode_with_offsets("hello world !") == ([0, 2, 3, 4], [(0, 0), (0, 5), (6, 11), (12, 13)])
    assert tok.encode_with_offsets("hello world !", add_special_tokens=False) == \
        ([2, 3, 4], [(0, 5), (6, 11), (12, 13)])
    assert tok.token_bytes(0) == b"<s>" and tok.token_text(2) == "hello"


def test_half_an_emoji_is_not_utf8_alone(smol):
    ids = smol.encode("😀")
    assert len(ids) > 1  # byte-level BPE splits this emoji
    parts = [smol.token_bytes(i) for i in ids]
    assert b"".join(parts) == "😀".encode()
    with pytest.raises(UnicodeDecodeError):
        parts[0].decode("utf-8")
    assert "\ufffd" in smol.token_text(ids[0])


@pytest.mark.parametrize("text", ["Hello world", "😀 日本語 naïve", " \n\t  spaces\r\n", "Ω≈ç√∫ 🇫🇷"])
def test_token_bytes_concatenate_to_the_text(smol, text):
    assert b"".join(smol.token_bytes(i) for i in smol.encode(text)) == text.encode()


def test_token_text_is_the_lone_decode(smol):
    # Over the whole vocabulary, special tokens included.
    for token_id in range(smol.vocab_size):
        assert smol.token_text(token_id) == smol.decode([token_id], skip_special_tokens=False)
    im_end = smol.eos_token_ids[0]
    assert smol.token_bytes(im_end) == b"<|im_end|>" and smol.token_text(im_end) == "<|im_end|>"
    assert smol.token_bytes(smol.encode(" the")[0]) == b" the"
    assert smol.token_bytes(10**9) == b""  # no such id: nothing, not a crash
    assert smol.token_bytes(im_end) is smol.token_bytes(im_end)  # cached


def test_byte_fallback_tokens_are_their_byte():
    tok = tiny_byte_fallback_tokenizer()
    ids = tok.encode("hello é", add_special_tokens=False)
    assert [tok.id_to_token(i) for i in ids] == ["▁hello", "▁", "<0xC3>", "<0xA9>"]
    assert [tok.token_bytes(i) for i in ids] == [b" hello", b" ", b"\xc3", b"\xa9"]
    # Alone, decode() strips the first token's leading space; mid-text the token carries it.
    assert tok.decode(ids[:1]) == "hello" and tok.token_text(ids[0]) == " hello"
    assert tok.token_text(ids[2]) == "\ufffd"
    assert b"".join(tok.token_bytes(i) for i in ids).decode() == " " + tok.decode(ids)
