"""worker.model.eos: every token that ends an answer, from each place a model's files can name one."""
from __future__ import annotations

import json

from worker.model.eos import end_of_turn_ids, eos_token_ids

TEMPLATE = ("{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}<|turn_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|start|>assistant\n{% endif %}")


def write_hf_dir(folder, config_eos, generation_eos=None, eos_token=None, template=None):
    (folder / "config.json").write_text(json.dumps({"eos_token_id": config_eos}))
    if generation_eos is not None:
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    added = [{"id": 0, "content": "<|endoftext|>", "special": True},
             {"id": 1, "content": "<|start|>", "special": True},
             {"id": 7, "content": "<|turn_end|>", "special": True},
             {"id": 9, "content": "<|endnote|>", "special": False}]
    (folder / "tokenizer.json").write_text(json.dumps({"added_tokens": added}))
    cfg = {}
    if eos_token:
        cfg["eos_token"] = eos_token
    if template:
        cfg["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))


def test_config_generation_config_tokenizer_and_template_all_count(tmp_path):
    write_hf_dir(tmp_path, config_eos=0, generation_eos=[0, 5], eos_token="<|endoftext|>",
                 template=TEMPLATE)
    assert eos_token_ids(tmp_path, [0]) == [0, 5, 7]


def test_a_special_token_outside_the_template_is_no_end_of_turn(tmp_path):
    write_hf_dir(tmp_path, config_eos=0)
    assert eos_token_ids(tmp_path, [0]) == [0]
    assert end_of_turn_ids(TEMPLATE, {"<|start|>": 1, "<|endoftext|>": 0}) == []


def test_a_model_without_any_end_token_has_none(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert eos_token_ids(tmp_path, []) == []
