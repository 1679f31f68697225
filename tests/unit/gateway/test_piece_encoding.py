"""Text encoded in pieces (gateway/piece_encoding.py) is token-exact with the whole text's
Encoding, ids and offsets, on the inputs where a cut could go wrong; and encoding stops at the
bound."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

from gateway.piece_encoding import PieceEncoder, TooManyTokens
from gateway.tokenizer import load_tokenizer

SMOL = load_tokenizer("")
SPECIALS = [t.content for t in SMOL.tokenizer.get_added_tokens_decoder().values()]

TRICKY = {
    "U+10FFFF run": "\U0010ffff" * 3000,  # one pre-token: cut inside, with an overlap
    "'=' run": "=" * 4001 + "x",
    "whitespace runs": "a" + " " * 3000 + "b" + "\t \n" * 700 + "  \r\n" * 500 + "z",
    "CRLF": "line\r\n" * 1500,
    "digits": "1234567890" * 600 + " 3.14159 " * 200,
    "emoji": "👩‍👩‍👧‍👦🏳️‍🌈😀" * 800,
    "CJK": "漢字かなカナ한국어" * 800,
    # Added tokens cut by a piece's border, wherever it falls.
    "added tokens": "".join(f"w{i} {SPECIALS[i % len(SPECIALS)]}" + " " * (i % 5) for i in range(2000)),
    "mixed": ("hello world " + "\U0010ffff" * 3 + "  \r\n 42 <|im_end|> don't") * 300,
}


def pairs(flat) -> list[tuple[int, int]]:
    return list(zip(flat[::2], flat[1::2]))


@pytest.mark.parametrize("name", list(TRICKY))
@pytest.mark.parametrize("piece_chars", [300, 1000])
def test_pieces_encode_as_the_whole_text(name, piece_chars):
    text, tok = TRICKY[name], SMOL.tokenizer
    encoder = PieceEncoder(tok, piece_chars=piece_chars)
    assert encoder.exact
    for add in (True, False):
        whole = tok.encode(text, add_special_tokens=add)
        ids, offsets = encoder.encode(text, add, 1 << 30, whole_up_to=0)
        assert list(ids) == whole.ids
        assert pairs(offsets) == whole.offsets


def test_encoding_stops_past_the_bound():
    encoder = PieceEncoder(SMOL.tokenizer, piece_chars=500)
    text = "\U0010ffff" * 20_000  # 80,000 tokens
    with pytest.raises(TooManyTokens) as e:
        encoder.encode(text, True, 1000, whole_up_to=0)
    assert 1000 < e.value.count <= 1000 + 4 * 800  # stopped after the piece that passed it
    ids, _ = encoder.encode(text[:250], True, 1000, whole_up_to=0)
    assert len(ids) == 1000  # the bound itself is allowed


def test_the_post_processors_tokens_go_around_the_pieces():
    words = ["<s>", "</s>", "[UNK]", "a", "b"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 1)])
    text = "a b " * 3000
    ids, offsets = PieceEncoder(tok, piece_chars=400).encode(text, True, 1 << 30, whole_up_to=0)
    whole = tok.encode(text)
    assert (list(ids), pairs(offsets)) == (whole.ids, whole.offsets)


def test_a_tokenizer_whose_pieces_differ_is_encoded_whole():
    # A normalizer that prepends "▁" to each text it sees (Llama's legacy one) would mark the
    # start of every piece.
    vocab = {"[UNK]": 0, "▁Hello": 1, "Hello": 2, "world": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Prepend("▁")
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    encoder = PieceEncoder(tok, piece_chars=100)
    assert not encoder.exact
    text = "Hello world " * 2000
    ids, offsets = encoder.encode(text, True, 1 << 30, whole_up_to=0)
    whole = tok.encode(text)
    assert (list(ids), pairs(offsets)) == (whole.ids, whole.offsets)


def test_chat_literal_spans_are_bounded_too():
    text = "<|im_start|>user\n<|im_end|>" + "\U0010ffff" * 5000 + "<|im_end|>"
    literal = [(17, len(text) - len("<|im_end|>"))]
    ids, offsets = SMOL.encode_bounded(text, False, 1 << 30, literal)
    assert (list(ids), pairs(offsets)) == SMOL.encode_with_offsets(text, False, literal)
    with pytest.raises(TooManyTokens):
        SMOL.encode_bounded(text, False, 1000, literal)
