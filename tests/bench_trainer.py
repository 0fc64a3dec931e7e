"""Benchmark: trainer.py training throughput and refit export time on CPU (gloo, real Ray actors).

Run: python tests/bench_trainer.py  (about 6-9 min on 2 cores). Not a pytest module: no test_ functions.
Models: the tiny test model (hidden 128, 2 layers) and a random ~50M-parameter Qwen3 (hidden 512,
12 layers, intermediate 2048, BPE vocabulary ~1k), each at world size 1 and 2. Each rank runs one
torch thread, so world size 1 uses one core and world size 2 both. A step is one RL train_step
(GRPO, PPO surrogate, on-policy: no old-log-prob pass) over a fixed random batch; the first step
is a warm-up and not timed. Tokens/s counts every token of the batch (prompt and completion).
Export: the time of one HF export (export_hf: every parameter gathered to rank 0, written as one safetensors file).
SmolLM2-135M-Instruct (recipes/smollm2.py, fp32): our sft_step at world size 1 vs plain transformers training
of the same model with the same numerics (fp32, token NLL on the same action tokens, grad clip 1.0, AdamW)
on the same 8x128-token batch, both on one torch thread, 5 alternating steps after one warm-up each; tokens/s,
CPU seconds per step, and the ratio of paired steps. Target >= 1.0x; the script exits non-zero below it.
"""
import json
import os
import pathlib
import random
import statistics
import sys
import tempfile
import time

import psutil
import ray
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from estimators import EstimatorArgs  # noqa: E402
from generator import Segment  # noqa: E402
from losses import LossArgs  # noqa: E402
from recipes.smollm2 import smollm2_dir  # noqa: E402
from recipes.tiny_model import build_tiny_model  # noqa: E402
from trainer import CkptArgs, FsdpArgs, TrainArgs, TrainerGroup  # noqa: E402

MODELS = {  # name: (build_tiny_model arguments, rows, tokens per row, timed steps)
    "tiny": (dict(tokenizer="chars"), 32, 64, 5),
    "50M": (dict(tokenizer="bpe", hidden=512, layers=12, heads=8, kv_heads=4, intermediate=2048), 8, 128, 2),
}


def make_batch(vocab: int, rows: int, tokens: int, *, version: int, seed: int,
               prompt_len: int | None = None) -> list[Segment]:
    """Groups of 4 rows sharing a prompt (a quarter of the row by default); the rest of each row is sampled
    (action) tokens."""
    rng = random.Random(seed)
    prompt_len, segments = tokens // 4 if prompt_len is None else prompt_len, []
    for r in range(rows):
        if r % 4 == 0:
            prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        completion = [rng.randrange(3, vocab) for _ in range(tokens - prompt_len)]
        mask = [False] * prompt_len + [True] * len(completion)
        segments.append(Segment(token_ids=prompt + completion, action_mask=mask,
                                logprobs=[-3.0 if m else 0.0 for m in mask],
                                versions=[version if m else -1 for m in mask], reward=rng.random(),
                                episode_id=f"e{r}", group_id=f"g{r // 4}"))
    return segments


def bench(name: str, path: str, world_size: int, rows: int, tokens: int, steps: int) -> None:
    vocab = json.load(open(f"{path}/config.json"))["vocab_size"]
    start = time.perf_counter()
    group = TrainerGroup(path, TrainArgs(lr=1e-4, world_size=world_size, max_tokens_per_microbatch=rows * tokens),
                         FsdpArgs(), CkptArgs(), LossArgs(), EstimatorArgs(), temperature=1.0, gpus_per_rank=0)
    started = time.perf_counter() - start
    try:
        group.train_step(make_batch(vocab, rows, tokens, version=0, seed=0))  # warm-up
        rates, step_s = [], []
        for s in range(steps):
            metrics = group.train_step(make_batch(vocab, rows, tokens, version=group.version, seed=s + 1))
            rates.append(metrics["train/tokens_per_s"])
            step_s.append(metrics["train/step_s"])
        with tempfile.TemporaryDirectory() as out:
            start = time.perf_counter()
            group.export_hf(out)
            export_s = time.perf_counter() - start
            tensors = list(load_file(os.path.join(out, "model.safetensors")).values())
    finally:
        group.shutdown()
    n_params = sum(t.numel() for t in tensors)
    mbytes = sum(t.numel() * t.element_size() for t in tensors) / 2**20
    print(f"trainer {name} ({n_params / 1e6:.1f}M params) world_size={world_size}: "
          f"{sum(rates) / len(rates):,.0f} train tokens/s (mean of {steps} steps of {rows}x{tokens} tokens, "
          f"{sum(step_s) / len(step_s):.2f} s/step; start-up {started:.1f} s)", flush=True)
    print(f"HF export {name} world_size={world_size}: {len(tensors)} tensors, "
          f"{mbytes:.1f} MiB in {export_s:.3f} s", flush=True)


def bench_against_plain(path: str, label: str, rows: int = 8, tokens: int = 128, steps: int = 5,
                        prompt_len: int | None = None) -> float:
    """Our sft_step vs a plain transformers step on one batch, alternating; prints both, returns the ratio:
    the median over steps of plain's step time over ours just after it (a slow spell of the host then counts
    against both). CPU seconds per step (the rank's process and this one) are printed too: on a shared
    machine they vary far less than the wall clock."""
    vocab = json.load(open(f"{path}/config.json"))["vocab_size"]
    batch = make_batch(vocab, rows, tokens, version=0, seed=0, prompt_len=prompt_len)
    ids = torch.tensor([s.token_ids for s in batch])  # (B, T)
    labels = ids.masked_fill(~torch.tensor([s.action_mask for s in batch]), -100)  # (B, T): NLL on action tokens
    torch.set_num_threads(1)  # as each trainer rank
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-5)

    def plain_step() -> None:
        plain(input_ids=ids, labels=labels, use_cache=False).loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    ours = TrainerGroup(path, TrainArgs(lr=1e-5, max_tokens_per_microbatch=rows * tokens), FsdpArgs(), CkptArgs(),
                        LossArgs(), EstimatorArgs(), temperature=1.0, gpus_per_rank=0)
    here, rank = psutil.Process(), psutil.Process(ray.get(ours.actors[0].__ray_call__.remote(lambda _: os.getpid())))
    cpu = lambda: sum(here.cpu_times()[:2]) + sum(rank.cpu_times()[:2])  # user + system of both processes
    wall, cpu_s = {"plain": [], "ours": []}, {"plain": [], "ours": []}
    try:
        for step in range(steps + 1):  # step 0 warms both up
            for name, fn in (("plain", plain_step), ("ours", lambda: ours.sft_step(batch))):
                start, start_cpu = time.perf_counter(), cpu()
                fn()
                if step:
                    wall[name].append(time.perf_counter() - start)
                    cpu_s[name].append(cpu() - start_cpu)
    finally:
        ours.shutdown()
    rate = {k: rows * tokens / statistics.median(v) for k, v in wall.items()}
    ratio = statistics.median(p / o for p, o in zip(wall["plain"], wall["ours"]))
    cpu_ratio = statistics.median(cpu_s["plain"]) / statistics.median(cpu_s["ours"])
    actions = sum(map(sum, (s.action_mask for s in batch)))
    print(f"trainer {label} fp32, {rows}x{tokens} tokens ({actions} of them sampled), {steps} alternating steps, "
          "one thread each:")
    for k, label in (("plain", "plain transformers"), ("ours", "ours (sft_step)   ")):
        print(f"  {label}  {rate[k]:6.1f} tokens/s (median)   steps {[round(x, 1) for x in wall[k]]} s, "
              f"CPU {[round(x, 1) for x in cpu_s[k]]} s")
    print(f"  ratio {ratio:.3f} (paired steps; target >= 1.0), CPU-time ratio {cpu_ratio:.3f}", flush=True)
    return ratio


if __name__ == "__main__":
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    with tempfile.TemporaryDirectory() as tmp:
        for name, (arguments, rows, tokens, steps) in MODELS.items():
            path = build_tiny_model(f"{tmp}/{name}", seed=0, **arguments)
            for world_size in (1, 2):
                bench(name, path, world_size, rows, tokens, steps)
        # an agent's rows: a long prompt (system text, tools, tool results) and a short reply, on the tool models'
        # shape (tests/tool_model.py: BPE vocabulary 4,096); plain transformers computes every position's logits
        tool = build_tiny_model(f"{tmp}/tool", seed=0, vocab_size=4096, rows=4096, max_positions=1 << 12)
        ratios = {"tool model, agent rows": bench_against_plain(tool, "tool-model shape", rows=8, tokens=896,
                                                                 prompt_len=864)}
    ratios["SmolLM2"] = bench_against_plain(smollm2_dir(), "SmolLM2-135M")
    ratios["SmolLM2, agent rows"] = bench_against_plain(smollm2_dir(), "SmolLM2-135M, agent rows", rows=2,
                                                        tokens=512, prompt_len=480)
    ray.shutdown()
    slower = [k for k, r in ratios.items() if r < 1.0]
    sys.exit(f"bench_trainer: ours is slower than plain transformers on {slower}" if slower else 0)
