"""The tiny model factory: deterministic, loads in transformers, ChatML tokens, prefix-preserving template."""
import hashlib
import json
import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from recipes.tiny_model import build_tiny_model

CALL = {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": {"expression": "2+3"}}}
TOOLS = [{"type": "function", "function": {"name": "calc", "description": "adds", "parameters": {"type": "object"}}}]


def digest(path: str) -> str:
    return hashlib.sha256(open(os.path.join(path, "model.safetensors"), "rb").read()).hexdigest()


def test_same_seed_builds_identical_weights_and_other_seed_differs(tmp_path, tiny_chars_model):
    again = build_tiny_model(str(tmp_path / "a"), seed=0, tokenizer="chars")
    other = build_tiny_model(str(tmp_path / "b"), seed=1, tokenizer="chars")
    assert digest(again) == digest(tiny_chars_model)
    assert digest(other) != digest(tiny_chars_model)


def test_special_tokens_are_single_ids_in_both_tokenizers(tiny_model, tiny_chars_model):
    for path in (tiny_model, tiny_chars_model):
        tok = AutoTokenizer.from_pretrained(path)
        for t in ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>", "<think>", "</think>"]:
            assert len(tok.encode(t, add_special_tokens=False)) == 1, (path, t)
        assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"


def test_template_renders_tools_tool_calls_and_merged_tool_results(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    msgs = [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "c1", "content": "5"},
            {"role": "tool", "tool_call_id": "c2", "content": "6"}]
    text = tok.apply_chat_template(msgs, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    # Written out by hand from the Hermes format: tools block, one call, both results in one user turn.
    expected = ('<|im_start|>system\n# Tools\n<tools>\n' + json.dumps(TOOLS[0]) + '\n</tools>\n'
                'Call a tool with <tool_call>\n{"name": NAME, "arguments": ARGS}\n</tool_call><|im_end|>\n'
                '<|im_start|>user\n2+3?<|im_end|>\n'
                '<|im_start|>assistant\n<tool_call>\n{"name": "calc", "arguments": {"expression": "2+3"}}\n'
                '</tool_call><|im_end|>\n'
                '<|im_start|>user\n<tool_response>\n5\n</tool_response>\n'
                '<tool_response>\n6\n</tool_response><|im_end|>\n'
                '<|im_start|>assistant\n')
    assert text == expected


def test_template_is_prefix_preserving_for_tool_and_user_appends(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    history = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
               {"role": "assistant", "content": "a", "reasoning_content": "r", "tool_calls": [CALL]}]
    before = tok.apply_chat_template(history, tools=TOOLS, tokenize=False)
    for extra in ({"role": "tool", "tool_call_id": "c1", "content": "5"}, {"role": "user", "content": "more"}):
        after = tok.apply_chat_template(history + [extra], tools=TOOLS, tokenize=False, add_generation_prompt=True)
        assert after.startswith(before), extra["role"]


def test_model_loads_in_transformers_with_head_dim_64_and_tied_embeddings(tiny_chars_model, tiny_moe_model):
    dense = AutoModelForCausalLM.from_pretrained(tiny_chars_model)
    assert dense.config.head_dim == 64 and dense.config.model_type == "qwen3"
    assert dense.lm_head.weight.data_ptr() == dense.model.embed_tokens.weight.data_ptr()
    tok = AutoTokenizer.from_pretrained(tiny_chars_model)
    assert dense.config.vocab_size == len(tok)
    logits = dense(torch.tensor([[1, 5, 6]])).logits
    assert logits.shape == (1, 3, len(tok)) and torch.isfinite(logits).all()
    moe = AutoConfig.from_pretrained(tiny_moe_model)
    assert moe.model_type == "qwen3_moe" and moe.num_experts == 4 and moe.num_experts_per_tok == 2
