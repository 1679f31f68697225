"""Incremental detokenization and stop strings, with the real SmolLM2 tokenizer."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from gateway.generation.detokenize import Detokenizer, StopMatcher
from gateway.tokenizer import load_tokenizer

TOK = load_tokenizer("")

# Pieces whose UTF-8 bytes span several byte-level BPE tokens.
HARD = ["😀", "🎉", "👨‍👩‍👧", "🇯🇵", "日本語のテキスト", "中文", "한국어", "é", "ñ", "Ö", "e\u0301",
        "ﬁ", "𝔘𝔫𝔦", "\u200d", " ", "\n", "  ", "\t", "ß", "Ω≈ç√", "🤖🚀", "ǅ", "\u00a0"]
_chars = st.characters(codec="utf-8", exclude_characters="\ufffd")
TEXT = st.lists(st.one_of(st.sampled_from(HARD), st.text(_chars, max_size=6)), max_size=12).map("".join)
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def encode(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


def stream(det: Detokenizer, ids: list[int], sizes: list[int]) -> list[str]:
    """Feeds ids in deltas of the given sizes (cycled); returns every chunk, finish last."""
    chunks, i, k = [], 0, 0
    while i < len(ids):
        size = max(1, sizes[k % len(sizes)]) if sizes else 1
        text, _ = det.add_many(ids[i:i + size])
        chunks.append(text)
        i, k = i + size, k + 1
    chunks.append(det.finish())
    return chunks


def assert_streams_like_decode(ids: list[int], sizes: list[int], prompt: list[int] = ()) -> None:
    chunks = stream(Detokenizer(TOK, prompt_token_ids=prompt), ids, sizes)
    full = TOK.decode(ids)
    assert "".join(chunks) == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in c for c in chunks)


@pytest.mark.parametrize("text", HARD + ["Hello, world! 😀 naïve café 日本 🇯🇵 done"])
def test_hard_text_one_token_at_a_time(text):
    ids = encode(text)
    chunks = stream(Detokenizer(TOK), ids, [1])
    assert "".join(chunks) == TOK.decode(ids)
    assert not any("\ufffd" in c for c in chunks)


def test_emoji_is_held_until_complete():
    ids = encode("😀")
    assert len(ids) > 1, "the test needs an emoji that spans tokens"
    det = Detokenizer(TOK)
    assert [det.add(t) for t in ids] == [""] * (len(ids) - 1) + ["😀"]


def test_unfinished_character_is_flushed_as_replacement_at_the_end():
    ids = encode("😀")[:-1]
    det = Detokenizer(TOK)
    assert [det.add(t) for t in ids] == [""] * len(ids)
    assert det.finish() == TOK.decode(ids) == "\ufffd"


def test_special_tokens_are_skipped():
    eos = TOK.eos_token_ids[0]
    assert "".join(stream(Detokenizer(TOK), encode("Hi there") + [eos], [1])) == "Hi there"


@SETTINGS
@given(TEXT, st.lists(st.integers(1, 5), max_size=4), st.sampled_from(["", "Hello", "<|im_start|>assistant\n", "日"]))
def test_random_text_streams_like_decode(text, sizes, prompt):
    assert_streams_like_decode(encode(text), sizes, prompt=encode(prompt))


@SETTINGS
@given(st.lists(TEXT, max_size=5), st.lists(st.integers(1, 3), max_size=3))
def test_concatenated_encodings_stream_like_decode(texts, sizes):
    # Token sequences a model can emit: pieces encoded separately, then joined.
    assert_streams_like_decode([t for text in texts for t in encode(text)], sizes)


@SETTINGS
@given(st.lists(st.integers(0, TOK.vocab_size - 1), max_size=30), st.lists(st.integers(1, 4), max_size=3))
def test_arbitrary_ids_still_add_up_to_decode(ids, sizes):
    # Any ids at all (invalid byte runs, special tokens): U+FFFD may appear mid-stream then,
    # but only where the full decode has it too, and nothing is lost or doubled.
    assert_streams_like_decode(ids, sizes)


@SETTINGS
@given(TEXT.filter(lambda t: len(t) >= 2), st.data())
def test_stop_string_across_token_boundaries(text, data):
    ids = encode(text)
    full = TOK.decode(ids)
    assume(full)  # some control characters decode to nothing: no stop string to find
    lo = data.draw(st.integers(0, len(full) - 1))
    hi = data.draw(st.integers(lo + 1, min(len(full), lo + 8)))
    stop = full[lo:hi]
    expected = full[:full.find(stop)]
    det = Detokenizer(TOK, stop=[stop, "\x00never"])
    emitted, accepted = "", []
    for t in ids:
        text_i, ids_i = det.add_many([t])
        emitted += text_i
        accepted += ids_i
        # Never shows text past the start of the stop string, even before it is complete.
        assert expected.startswith(emitted)
    emitted += det.finish()
    assert det.stopped and emitted == expected
    # Output ids end with the token that completed the stop string; later ones are dropped.
    assert accepted == ids[:len(accepted)] and accepted
    assert stop in TOK.decode(accepted)
    before = TOK.decode(accepted[:-1])
    if "\ufffd" not in before:  # (else the stop's text was still inside an unfinished character)
        assert stop not in before


@SETTINGS
@given(TEXT, st.lists(st.text(_chars, min_size=1, max_size=4), min_size=1, max_size=3))
def test_absent_stop_strings_change_nothing(text, stops):
    ids = encode(text)
    full = TOK.decode(ids)
    if any(s in full for s in stops):
        return
    det = Detokenizer(TOK, stop=stops)
    assert "".join(stream(det, ids, [1])) == full and not det.stopped


def test_stop_holds_back_a_possible_start():
    m = StopMatcher(["abc", "xyz"])
    assert m.feed("hello ab") == "hello "  # "ab" may begin "abc"
    assert m.feed("d x") == "abd "        # it did not; " x" is held for "xyz"
    assert m.feed("y") == ""
    assert m.feed("!") == "xy!"
    assert m.feed("..abc..") == ".." and m.matched == "abc"
    assert m.feed("more") == "" and m.flush() == ""


def test_earliest_stop_wins_and_drops_the_rest_of_the_delta():
    det = Detokenizer(TOK, stop=["world", "Hello"])
    ids = encode("Say Hello world and more")
    text, accepted = det.add_many(ids)
    assert text == "Say " and det.stopped
    assert TOK.decode(accepted) == "Say Hello"
    assert det.add_many(encode(" more")) == ("", [])
    assert det.finish() == ""


def test_held_text_is_released_at_the_end():
    det = Detokenizer(TOK, stop=["the end."])
    assert "".join(stream(det, encode("this is the end"), [1])) == "this is the end"
