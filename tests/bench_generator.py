"""Benchmark generator.py on CPU: routing overhead against bare vLLM, and refit time per bucket size.

1. Throughput: the same 64 prompts x 64 tokens (ignore_eos, seeded) through `Generator.generate` (a Ray
   actor hop per request) and through `AsyncLLM.generate` in this process, same engine flags, both engines
   alive, rounds interleaved so load from other processes hits both alike; median tokens/s and the ratio.
2. Refit: pause, update_weights, resume for the tiny model and a ~100M-parameter random Qwen3, per
   --vllm.refit_bucket_mb (16, 64, 256).
Run: `.venv/bin/python tests/bench_generator.py` (about 4-5 minutes on 2 busy cores).
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from generator import Generator, RolloutArgs, VllmArgs, build_engine_args, build_sampling_params  # noqa: E402
from recipes.tiny_model import build_tiny_model  # noqa: E402

PROMPTS = [[5 + i, 17, 300, 42 + i, 9, 77] for i in range(64)]
NEW_TOKENS, ROUNDS, BUCKETS_MB = 64, 5, (16, 64, 256)


async def direct_round(llm, rollout: RolloutArgs) -> float:
    """tokens/s of bare AsyncLLM.generate over PROMPTS."""
    async def one(i: int, prompt: list[int]) -> int:
        params = build_sampling_params(rollout, max_new_tokens=NEW_TOKENS, stop_token_ids=None, seed=i,
                                       ignore_eos=True)
        async for out in llm.generate({"prompt_token_ids": prompt}, params, f"direct-{time.time()}-{i}"):
            pass
        return len(out.outputs[0].token_ids)
    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*[one(i, p) for i, p in enumerate(PROMPTS)]))
    return tokens / (time.perf_counter() - start)


async def generator_round(gen: Generator) -> float:
    """tokens/s of Generator.generate over PROMPTS."""
    start = time.perf_counter()
    outs = await asyncio.gather(*[gen.generate(p, max_new_tokens=NEW_TOKENS, seed=i, ignore_eos=True)
                                  for i, p in enumerate(PROMPTS)])
    return sum(len(c.token_ids) for c in outs) / (time.perf_counter() - start)


async def throughput(model_dir: str, vllm: VllmArgs, rollout: RolloutArgs) -> None:
    args = build_engine_args(model_dir, vllm, cuda=False)  # the same flags and process layout as generator.Engine
    from vllm.v1.engine.async_llm import AsyncLLM
    llm = AsyncLLM.from_engine_args(args)
    gen = Generator(model_dir, vllm, rollout)
    await direct_round(llm, rollout)  # warm-up both
    await generator_round(gen)
    direct, routed = [], []
    for _ in range(ROUNDS):
        direct.append(await direct_round(llm, rollout))
        routed.append(await generator_round(gen))
    d, r = statistics.median(direct), statistics.median(routed)
    print(f"throughput, {len(PROMPTS)} prompts x {NEW_TOKENS} tokens, median of {ROUNDS} interleaved rounds:")
    print(f"  AsyncLLM.generate   {d:8.0f} tokens/s   rounds {[round(x) for x in direct]}")
    print(f"  Generator.generate  {r:8.0f} tokens/s   rounds {[round(x) for x in routed]}")
    print(f"  ratio {r / d:.3f} (target >= 0.95)")
    await gen.shutdown()
    llm.shutdown()
    del llm
    gc.collect()  # now, while the interpreter is whole: AsyncLLM.__del__ fails at exit


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
        asyncio.run(throughput(tiny, vllm, RolloutArgs()))
        asyncio.run(refit_times("tiny", tiny, vllm))
        big = build_tiny_model(os.path.join(tmp, "big"), seed=0, tokenizer="bpe", hidden=768, layers=12, heads=12,
                               kv_heads=4, intermediate=3072)
        asyncio.run(refit_times("~100M", big, vllm))
    ray.shutdown()


if __name__ == "__main__":
    main()
