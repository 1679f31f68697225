"""The gateway's tokenizer (tokenizers + jinja2) agrees with transformers on the same files."""
from __future__ import annotations

import pytest

from gateway.tokenizer import _tokenizer_folder, load_tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "naïve 😀 日本語"}, {"role": "assistant", "content": "ok"},
     {"role": "tool", "content": '{"x": 1}'}, {"role": "user", "content": ""}],
]


@pytest.fixture(scope="module")
def both():
    transformers = pytest.importorskip("transformers")
    _, folder = _tokenizer_folder("")
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
