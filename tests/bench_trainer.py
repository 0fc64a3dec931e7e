"""Benchmark: trainer.py training throughput and refit export time on CPU (gloo, real Ray actors).

Run: python tests/bench_trainer.py  (about 3-5 min on 2 cores). Not a pytest module: no test_ functions.
Models: the tiny test model (hidden 128, 2 layers) and a random ~50M-parameter Qwen3 (hidden 512,
12 layers, intermediate 2048, BPE vocabulary ~1k), each at world size 1 and 2. Each rank runs one
torch thread, so world size 1 uses one core and world size 2 both. A step is one RL train_step
(GRPO, PPO surrogate, on-policy: no old-log-prob pass) over a fixed random batch; the first step
is a warm-up and not timed. Tokens/s counts every token of the batch (prompt and completion).
Refit export: the time of one full export_weights(256 MiB) pass (every parameter gathered to rank 0).
"""
import json
import pathlib
import random
import sys
import tempfile
import time

import ray

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from estimators import EstimatorArgs  # noqa: E402
from generator import Segment  # noqa: E402
from losses import LossArgs  # noqa: E402
from recipes.tiny_model import build_tiny_model  # noqa: E402
from trainer import CkptArgs, FsdpArgs, TrainArgs, TrainerGroup  # noqa: E402

MODELS = {  # name: (build_tiny_model arguments, rows, tokens per row, timed steps)
    "tiny": (dict(tokenizer="chars"), 32, 64, 5),
    "50M": (dict(tokenizer="bpe", hidden=512, layers=12, heads=8, kv_heads=4, intermediate=2048), 8, 128, 2),
}


def make_batch(vocab: int, rows: int, tokens: int, *, version: int, seed: int) -> list[Segment]:
    """Groups of 4 rows sharing a quarter-length prompt; the rest of each row is sampled (action) tokens."""
    rng = random.Random(seed)
    prompt_len, segments = tokens // 4, []
    for r in range(rows):
        if r % 4 == 0:
            prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        completion = [rng.randrange(3, vocab) for _ in range(tokens - prompt_len)]
        mask = [False] * prompt_len + [True] * len(completion)
        segments.append(Segment(token_ids=prompt + completion, action_mask=mask, logprobs=[-3.0 if m else 0.0 for m in mask],
                                versions=[version if m else -1 for m in mask], reward=rng.random(), episode_id=f"e{r}", group_id=f"g{r // 4}"))
    return segments


def bench(name: str, path: str, world_size: int, rows: int, tokens: int, steps: int) -> None:
    vocab = json.load(open(f"{path}/config.json"))["vocab_size"]
    start = time.perf_counter()
    group = TrainerGroup(path, TrainArgs(lr=1e-4, world_size=world_size, max_tokens_per_microbatch=rows * tokens), FsdpArgs(),
                         CkptArgs(), LossArgs(), EstimatorArgs(), temperature=1.0, gpus_per_rank=0)
    started = time.perf_counter() - start
    try:
        group.train_step(make_batch(vocab, rows, tokens, version=0, seed=0))  # warm-up
        rates, step_s = [], []
        for s in range(steps):
            metrics = group.train_step(make_batch(vocab, rows, tokens, version=group.version, seed=s + 1))
            rates.append(metrics["train/tokens_per_s"])
            step_s.append(metrics["train/step_s"])
        start = time.perf_counter()
        tensors = [t for bucket in group.export_weights(256) for _, t in bucket]
        export_s = time.perf_counter() - start
    finally:
        group.shutdown()
    n_params = sum(t.numel() for t in tensors)
    mbytes = sum(t.numel() * t.element_size() for t in tensors) / 2**20
    print(f"trainer {name} ({n_params / 1e6:.1f}M params) world_size={world_size}: "
          f"{sum(rates) / len(rates):,.0f} train tokens/s (mean of {steps} steps of {rows}x{tokens} tokens, "
          f"{sum(step_s) / len(step_s):.2f} s/step; start-up {started:.1f} s)", flush=True)
    print(f"refit export {name} world_size={world_size}: {len(tensors)} tensors, {mbytes:.1f} MiB in {export_s:.3f} s", flush=True)


if __name__ == "__main__":
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    with tempfile.TemporaryDirectory() as tmp:
        for name, (arguments, rows, tokens, steps) in MODELS.items():
            path = build_tiny_model(f"{tmp}/{name}", seed=0, **arguments)
            for world_size in (1, 2):
                bench(name, path, world_size, rows, tokens, steps)
    ray.shutdown()
