"""Benchmark generator.py on CPU: routing overhead against bare vLLM, and refit time per bucket size.

1. Throughput: the same 64 prompts x 64 tokens (ignore_eos, seeded) through `Generator.generate` (a Ray
   actor hop per request) and through `AsyncLLM.generate` in this process, same engine flags, both engines
   alive, rounds alternating; median tokens/s, and the ratio: the median over rounds of ours over the raw
   round just before it (a slow spell of the host counts against both).
2. Refit: pause, update_weights, resume for the tiny model and a ~100M-parameter random Qwen3, per
   --vllm.refit_bucket_mb (16, 64, 256).
3. Throughput as in 1 on a real model, SmolLM2-135M-Instruct (recipes/smollm2.py, fp32): 64 chat prompts
   x 32 tokens, 3 rounds.
Target >= 0.95 for each throughput ratio; the script exits non-zero when SmolLM2's misses it (on the tiny
model the ratio weighs the actor hop per request against almost no compute, and is only printed).
Run: `.venv/bin/python tests/bench_generator.py` (about 4-8 minutes on 2 busy cores).
"""
import asyncio
import gc
import os
import statistics
import sys
import tempfile
import time

import ray
from safetensors.torch import load_file
from transformers import AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from generator import Generator, RolloutArgs, VllmArgs, build_engine_args, build_sampling_params  # noqa: E402
from recipes.smollm2 import smollm2_dir  # noqa: E402
from recipes.tiny_model import build_tiny_model  # noqa: E402

PROMPTS = [[5 + i, 17, 300, 42 + i, 9, 77] for i in range(64)]
NEW_TOKENS, ROUNDS, BUCKETS_MB, TARGET = 64, 5, (16, 64, 256), 0.95


async def direct_round(llm, rollout: RolloutArgs, prompts: list[list[int]], new_tokens: int) -> float:
    """tokens/s of bare AsyncLLM.generate over prompts."""
    async def one(i: int, prompt: list[int]) -> int:
        params = build_sampling_params(rollout, max_new_tokens=new_tokens, stop_token_ids=None, seed=i,
                                       ignore_eos=True)
        async for out in llm.generate({"prompt_token_ids": prompt}, params, f"direct-{time.time()}-{i}"):
            pass
        return len(out.outputs[0].token_ids)
    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)]))
    return tokens / (time.perf_counter() - start)


async def generator_round(gen: Generator, prompts: list[list[int]], new_tokens: int) -> float:
    """tokens/s of Generator.generate over prompts."""
    start = time.perf_counter()
    outs = await asyncio.gather(*[gen.generate(p, max_new_tokens=new_tokens, seed=i, ignore_eos=True)
                                  for i, p in enumerate(prompts)])
    return sum(len(c.token_ids) for c in outs) / (time.perf_counter() - start)


async def throughput(label: str, model_dir: str, vllm: VllmArgs, rollout: RolloutArgs, prompts: list[list[int]],
                     new_tokens: int, rounds: int) -> float:
    """Prints both engines' tokens/s per round; returns the paired ratio (ours over the raw round before it)."""
    args = build_engine_args(model_dir, vllm, cuda=False)  # the same flags and process layout as generator.Engine
    from vllm.v1.engine.async_llm import AsyncLLM
    llm = AsyncLLM.from_engine_args(args)
    gen = Generator(model_dir, vllm, rollout)
    await direct_round(llm, rollout, prompts, new_tokens)  # warm-up both
    await generator_round(gen, prompts, new_tokens)
    direct, routed = [], []
    for _ in range(rounds):
        direct.append(await direct_round(llm, rollout, prompts, new_tokens))
        routed.append(await generator_round(gen, prompts, new_tokens))
    d, r = statistics.median(direct), statistics.median(routed)
    ratio = statistics.median(y / x for x, y in zip(direct, routed))
    print(f"throughput {label}, {len(prompts)} prompts x {new_tokens} tokens, {rounds} alternating rounds:")
    print(f"  AsyncLLM.generate   {d:8.0f} tokens/s   rounds {[round(x) for x in direct]}")
    print(f"  Generator.generate  {r:8.0f} tokens/s   rounds {[round(x) for x in routed]}")
    print(f"  ratio {ratio:.3f} (paired rounds; target >= {TARGET})", flush=True)
    await gen.shutdown()
    llm.shutdown()
    del llm
    gc.collect()  # now, while the interpreter is whole: AsyncLLM.__del__ fails at exit
    return ratio


def chat_prompts(model_dir: str, n: int) -> list[list[int]]:
    """n distinct user turns through the model's own chat template, as token ids."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok.apply_chat_template([{"role": "user", "content": f"Count from {i} to {i + 10}, one number a line."}],
                                    add_generation_prompt=True, tokenize=True, return_dict=False) for i in range(n)]


async def refit_times(label: str, model_dir: str, vllm: VllmArgs) -> None:
    weights = sorted(load_file(os.path.join(model_dir, "model.safetensors")).items())
    mb = sum(t.nbytes for _, t in weights) / 2**20
    gen = Generator(model_dir, vllm, RolloutArgs())
    print(f"refit {label}: {sum(t.numel() for _, t in weights) / 1e6:.1f}M parameters, {mb:.0f} MiB fp32")
    for bucket_mb in BUCKETS_MB:
        gen._bucket_bytes = bucket_mb * 2**20  # only the router reads the bucket size: one engine serves all three
        for attempt in range(2):
            t0 = time.perf_counter()
            await gen.pause()
            t1 = time.perf_counter()
            report = await gen.update_weights(weights, gen.version + 1)
            t2 = time.perf_counter()
            await gen.resume()
            t3 = time.perf_counter()
            print(f"  bucket {bucket_mb:3d} MiB, try {attempt}: {len(report['applied']):3d} messages, pause "
                  f"{(t1 - t0) * 1e3:6.1f} ms, update {(t2 - t1):6.3f} s ({mb / (t2 - t1):6.0f} MiB/s), "
                  f"resume {(t3 - t2) * 1e3:5.1f} ms")
    await gen.shutdown()


def main() -> None:
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_tiny_model(os.path.join(tmp, "tiny"), seed=0, tokenizer="bpe")
        vllm = VllmArgs(max_model_len=512, kv_cache_gb=0.5)
        asyncio.run(throughput("tiny", tiny, vllm, RolloutArgs(), PROMPTS, NEW_TOKENS, ROUNDS))
        asyncio.run(refit_times("tiny", tiny, vllm))
        big = build_tiny_model(os.path.join(tmp, "big"), seed=0, tokenizer="bpe", hidden=768, layers=12, heads=12,
                               kv_heads=4, intermediate=3072)
        asyncio.run(refit_times("~100M", big, vllm))
    smol = smollm2_dir()
    ratio = asyncio.run(throughput("SmolLM2-135M", smol, VllmArgs(max_model_len=1024, kv_cache_gb=0.5), RolloutArgs(),
                                   chat_prompts(smol, 64), 32, 3))
    ray.shutdown()
    if ratio < TARGET:
        sys.exit(f"bench_generator: Generator below {TARGET} of raw vLLM on SmolLM2")


if __name__ == "__main__":
    main()
