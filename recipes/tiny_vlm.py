"""Tiny VLM factory: a random Idefics3 (SigLIP-style vision tower, pixel-shuffle connector, Llama text model).

The directory loads in transformers (Idefics3ForConditionalGeneration, AutoProcessor) and vLLM 0.32's CPU
build with no hub access and no torchvision: Idefics3's image processor has a PIL/numpy backend, and vLLM's
idefics3 module imports no torchvision (its llava module does, through pixtral). It holds config.json,
model.safetensors, tiny_model.py's byte-level BPE tokenizer plus Idefics3's image tokens, the processor
config and a ChatML template whose message content may be a string or a list of {"type": "text"} /
{"type": "image"} parts (an image part renders as one `<image>`).

Every image is resized to image_size x image_size (no tiling) and becomes a run of n + 3 tokens:
`<fake_token_around_image><global-img>` + n x `<image>` + `<fake_token_around_image>`, n = (image_size /
patch / 2)^2 (pixel shuffle merges 2x2 patches): 19 tokens for the default 64 px.
The HF processor expands each `<image>` of a text prompt into that run; vLLM expands each
`<image>` id of a token prompt itself, so an engine prompt carries one `<image>` id per image.

    python recipes/tiny_vlm.py OUT_DIR [--seed 0]
"""
import argparse
import json
import os
import sys

import torch
import transformers
from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessorPil,
                          Idefics3Processor, Idefics3VisionConfig, LlamaConfig)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_model import CHAT_TEMPLATE, DEFAULT_ALPHABET, build_tokenizer, default_corpus  # noqa: E402

IMAGE_TOKENS = ("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>")
# tiny_model's template, with every message content rendered by a macro that also takes a list of parts
VLM_TEMPLATE = ("{%- macro render(c) -%}{%- if c is string -%}{{- c -}}{%- else -%}{%- for p in c -%}"
                "{%- if p.type == 'image' -%}{{- '<image>' -}}{%- else -%}{{- p.text -}}{%- endif -%}"
                "{%- endfor -%}{%- endif -%}{%- endmacro -%}"
                + CHAT_TEMPLATE.replace("m.content", "render(m.content)")
                .replace("messages[0].content", "render(messages[0].content)"))


def build_tiny_vlm(out_dir: str, *, seed: int = 0, image_size: int = 64, patch: int = 8, vision_hidden: int = 64,
                   vision_layers: int = 2, hidden: int = 128, layers: int = 2, vocab_size: int = 1024,
                   dtype: str = "float32", split: bool = False) -> str:
    """Write a random Idefics3 directory to out_dir, identical for identical arguments; returns out_dir.
    Vision and text attention heads are 64 wide (vLLM's CPU attention wants head_dim 64). dtype: of the saved
    weights, which the engine serves in (bfloat16 on a GPU). split: SmolVLM's tiling, as its checkpoints ship:
    an image is resized to 2 x image_size and cut into 2 x 2 tiles plus the whole image downscaled, each tile's
    run led by its `<row_i_col_j>` token: 94 ids for any image (4 tiles of 2 markers + 16 `<image>`, 3 newlines,
    the whole image's 19). The GPU machine's vLLM 0.26 needs it: its
    Idefics3 module counts 0 patches for an image that is not split (vLLM 0.32 takes max(n, 1))."""
    tok = build_tokenizer("bpe", alphabet=DEFAULT_ALPHABET, vocab_size=vocab_size, corpus=default_corpus(),
                          extra_special=IMAGE_TOKENS + tuple(f"<row_{i}_col_{j}>" for i in range(1, 7)
                                                             for j in range(1, 7)) * split)
    eos, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    text = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=64, intermediate_size=2 * hidden, max_position_embeddings=4096,
                       tie_word_embeddings=True, rope_theta=10000.0, eos_token_id=eos, pad_token_id=pad,
                       bos_token_id=None)
    vision = Idefics3VisionConfig(hidden_size=vision_hidden, intermediate_size=2 * vision_hidden,
                                  num_hidden_layers=vision_layers, num_attention_heads=vision_hidden // 64,
                                  image_size=image_size, patch_size=patch)
    config = Idefics3Config(vision_config=vision, text_config=text, image_token_id=tok.convert_tokens_to_ids("<image>"),
                            scale_factor=2, tie_word_embeddings=True, pad_token_id=pad, torch_dtype=dtype)
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).to(getattr(torch, dtype))
    model.generation_config.eos_token_id = [eos, pad]
    images = Idefics3ImageProcessorPil(do_image_splitting=split, size={"longest_edge": image_size * (1 + split)},
                                       max_image_size={"longest_edge": image_size})
    processor = Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=(image_size // patch // 2) ** 2,
                                  chat_template=VLM_TEMPLATE)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    # save_pretrained names the torchvision class; name the PIL one, so every environment computes the same pixels
    path = os.path.join(out_dir, "processor_config.json")
    saved = json.load(open(path))
    saved["image_processor"]["image_processor_type"] = "Idefics3ImageProcessorPil"
    json.dump(saved, open(path, "w"), indent=2)
    return out_dir


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="Build a random tiny Idefics3 directory (no hub access).")
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--image_size", type=int, default=64, help="pixels per image side (a multiple of 16)")
    a = p.parse_args()
    transformers.utils.logging.disable_progress_bar()  # one small shard: a bar only clutters the screen
    print(f"tiny VLM written to {build_tiny_vlm(a.out_dir, seed=a.seed, image_size=a.image_size)}")
