"""Tiny model factory: a random Qwen3 (dense) or Qwen3-MoE model directory built locally from a seed.

The directory loads in transformers, vLLM and the trainer with no hub access: config.json,
model.safetensors, generation_config.json and a fast tokenizer with ChatML special tokens
(`<|im_start|> <|im_end|> <|endoftext|>`), `<tool_call> </tool_call> <think> </think>` and a
Qwen/Hermes-style chat template that renders `tools`, assistant `tool_calls` and `tool` messages.
The template keeps reasoning in every turn (unlike stock Qwen3) so rendering is prefix-preserving.

Tokenizer kinds: `bpe` (byte-level BPE trained on a built-in or given corpus: any text encodes) or
`chars` (one token per character of an alphabet plus role words: small vocabularies for tasks that
must learn fast on a CPU). `head_dim` is 64 because vLLM's CPU attention needs it.

    python recipes/tiny_model.py OUT_DIR [--tokenizer chars --alphabet 0123456789] [--moe]
"""
import argparse
import json
import os

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3Config, Qwen3MoeConfig

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TAGS = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>"]
ROLES = ["system", "user", "assistant", "tool"]
# Qwen3-0.6B's shape (596M parameters with the tied embedding): the GPU benchmarks' model, random weights.
QWEN3_0_6B = dict(hidden=1024, layers=28, heads=16, kv_heads=8, intermediate=3072, head_dim=128, rows=151936,
                  max_positions=40960)
DEFAULT_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz+-*/=.,:;!?()[]{}\"'_ \n"

# Qwen/Hermes ChatML: tools listed in the system block, tool calls as <tool_call>{json}</tool_call>,
# consecutive tool results merged into one user block of <tool_response>s. Text is emitted only from
# {{ }} so that transformers' trim_blocks/lstrip_blocks cannot eat a newline.
CHAT_TEMPLATE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
    {{- '# Tools\n<tools>' }}
    {%- for t in tools %}{{- '\n' + (t | tojson) }}{%- endfor %}
    {{- '\n</tools>\nCall a tool with <tool_call>\n{"name": NAME, "arguments": ARGS}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for m in messages %}
    {%- if m.role == 'system' and loop.first %}
    {%- elif m.role == 'user' or m.role == 'system' %}
        {{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
    {%- elif m.role == 'assistant' %}
        {{- '<|im_start|>assistant\n' }}
        {%- if m.reasoning_content %}{{- '<think>\n' + m.reasoning_content + '\n</think>\n\n' }}{%- endif %}
        {%- if m.content %}{{- m.content }}{%- endif %}
        {%- for tc in m.tool_calls or [] %}
            {%- if not loop.first or m.content %}{{- '\n' }}{%- endif %}
            {{- '<tool_call>\n{"name": "' + tc.function.name + '", "arguments": ' }}
            {%- if tc.function.arguments is string %}{{- tc.function.arguments }}
            {%- else %}{{- tc.function.arguments | tojson }}{%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif m.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + m.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""


def default_corpus() -> list[str]:
    """Text the BPE learns merges from: arithmetic, digit strings, tool-call JSON and plain words."""
    words = ("the a of to and is in it you that call tool result answer question number sum add "
             "multiply calculator expression value name arguments error done ok yes no think").split()
    lines = []
    for i in range(400):
        a, b = (i * 37) % 1000, (i * 91) % 1000
        lines.append(f"{a} + {b} = {a + b}. {a} * {b} = {a * b}.")
        lines.append(" ".join(words[(i + k * 7) % len(words)] for k in range(12)))
        lines.append(json.dumps({"name": "calculator", "arguments": {"expression": f"{a}*{b}"}}))
    return lines


def build_tokenizer(kind: str, *, alphabet: str, vocab_size: int, corpus: list[str],
                    extra_special: tuple = ()) -> PreTrainedTokenizerFast:
    if kind == "bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(corpus, trainer=trainer)
    elif kind == "chars":
        chars = list(dict.fromkeys(alphabet))  # keep order, drop repeats
        vocab = {t: i for i, t in enumerate(SPECIAL + ["<unk>"] + chars)}
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")  # every character alone
        tok.decoder = decoders.Fuse()
    else:
        raise ValueError(f"--tokenizer {kind!r}: choose bpe or chars")
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>",
                                 pad_token="<|endoftext|>", unk_token="<unk>" if kind == "chars" else None,
                                 additional_special_tokens=SPECIAL[1:], clean_up_tokenization_spaces=False)
    hf.add_tokens(TAGS + (ROLES if kind == "chars" else []))  # single ids, kept by decode
    if extra_special:  # after every default id, so the default vocabulary is unchanged
        hf.add_tokens(list(extra_special), special_tokens=True)
    hf.chat_template = CHAT_TEMPLATE
    hf.model_max_length = 1 << 20
    return hf


def build_tiny_model(out_dir: str, *, seed: int = 0, tokenizer: str = "bpe", alphabet: str = DEFAULT_ALPHABET,
                     vocab_size: int = 1024, corpus_path: str | None = None, hidden: int = 128, layers: int = 2,
                     heads: int = 4, kv_heads: int = 2, intermediate: int = 256, max_positions: int = 4096,
                     moe: bool = False, experts: int = 4, experts_per_token: int = 2, head_dim: int = 64,
                     rows: int | None = None, dtype: str = "float32", extra_special: tuple = ()) -> str:
    """Write a random model directory to out_dir, identical for identical arguments; returns out_dir.
    Dense models tie lm_head to the embedding; MoE models do not (as Qwen3-30B-A3B; NeMo's MoE class refuses ties).
    rows: embedding rows when more than the tokenizer's ids (a real model's vocabulary size).
    extra_special: more special tokens (single ids with embedding rows), e.g. other chat templates' markers."""
    corpus = open(corpus_path).read().splitlines() if corpus_path else default_corpus()
    tok = build_tokenizer(tokenizer, alphabet=alphabet, vocab_size=vocab_size, corpus=corpus,
                          extra_special=extra_special)
    ids = dict(vocab_size=max(len(tok), rows or 0), eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
               pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"), bos_token_id=None)
    shape = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                 num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=max_positions,
                 tie_word_embeddings=not moe, rope_theta=10000.0, torch_dtype=dtype)
    if moe:
        config = Qwen3MoeConfig(**ids, **shape, num_experts=experts, num_experts_per_tok=experts_per_token,
                                moe_intermediate_size=intermediate // 2, intermediate_size=intermediate,
                                decoder_sparse_step=1, norm_topk_prob=True)
    else:
        config = Qwen3Config(**ids, **shape, intermediate_size=intermediate)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(getattr(torch, dtype))
    os.makedirs(out_dir, exist_ok=True)
    model.generation_config.eos_token_id = [ids["eos_token_id"], ids["pad_token_id"]]
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="Build a random tiny Qwen3 model directory (no hub access).")
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", choices=("bpe", "chars"), default="bpe")
    p.add_argument("--alphabet", default=DEFAULT_ALPHABET, help="characters of the chars tokenizer")
    p.add_argument("--vocab_size", type=int, default=1024, help="BPE vocabulary size")
    p.add_argument("--corpus", default=None, help="text file the BPE trains on (default: built in)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv_heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--moe", action="store_true", help="Qwen3-MoE instead of dense Qwen3")
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--head_dim", type=int, default=64)
    p.add_argument("--rows", type=int, default=None, help="embedding rows beyond the tokenizer's (e.g. 151936)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--qwen3_0_6b", action="store_true", help="Qwen3-0.6B's dimensions (596M parameters)")
    a = p.parse_args()
    transformers.utils.logging.disable_progress_bar()  # one small shard: a bar only clutters the recipe's screen
    shape = dict(hidden=a.hidden, layers=a.layers, heads=a.heads, kv_heads=a.kv_heads, intermediate=a.intermediate,
                 head_dim=a.head_dim, rows=a.rows)
    shape.update(QWEN3_0_6B if a.qwen3_0_6b else {})
    path = build_tiny_model(a.out_dir, seed=a.seed, tokenizer=a.tokenizer, alphabet=a.alphabet,
                            vocab_size=a.vocab_size, corpus_path=a.corpus, moe=a.moe, experts=a.experts,
                            dtype=a.dtype, **shape)
    print(f"tiny model written to {path}")
