"""Benchmark: the loop's step time, strictly on-policy (K=0) vs one step off-policy (K=1), in one run.

On the default recipe's model (tiny character Qwen3 after the recipe's 30-step SFT warm start):
- K=0 samples, then trains: its step should be close to generation + training (+ refit).
- K=1 samples the next batch while training this one: its step should be at most 1.15 x
  max(generation, training), taking the K=0 run's median generation and training times as the two parts.
Also prints the wall-clock time until the K=1 run's batch reward first reaches 0.9.
    python tests/bench_loop.py
"""
import asyncio
import json
import os
import statistics
import sys
import tempfile

import ray

import launch
from recipes.tiny_model import build_tiny_model

HERE = os.path.dirname(os.path.abspath(__file__))
COPY = os.path.join(HERE, "..", "recipes", "copy_agent.py")


def rl_flags(model: str, out: str, steps: int, *extra: str) -> list[str]:
    return ["--launch.model", model, "--launch.out_dir", out, "--launch.steps", str(steps), "--agent.path", COPY,
            "--data.path", COPY, "--launch.batch_prompts", "32", "--launch.samples_per_prompt", "8",
            "--rollout.max_new_tokens", "8", "--vllm.max_model_len", "64", "--train.lr", "3e-3", *extra]


def main() -> int:
    root = tempfile.mkdtemp(prefix="bench_loop_")
    model = build_tiny_model(os.path.join(root, "model"), tokenizer="chars", alphabet="0123456789copy \n")
    ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    sft = launch.run_sft(launch.parse_args(["--launch.mode", "sft", "--launch.model", model, "--launch.out_dir",
                                            os.path.join(root, "sft"), "--launch.steps", "30", "--data.path", COPY,
                                            "--launch.batch_prompts", "16", "--train.lr", "3e-3"]))
    sync = asyncio.run(launch.run_rl(launch.parse_args(rl_flags(sft["hf"], os.path.join(root, "k0"), 12))))
    rows0 = read_rows(sync["out_dir"])[2:]  # the first steps include warm-up
    k1 = asyncio.run(launch.run_rl(launch.parse_args(rl_flags(sft["hf"], os.path.join(root, "k1"), 40,
                                                              "--launch.max_staleness", "1",
                                                              "--loss.is_level", "token"))))
    rows1 = read_rows(k1["out_dir"])
    ray.shutdown()
    gen = statistics.median(r["launch/rollout_wait_s"] for r in rows0)
    train = statistics.median(r["launch/train_s"] for r in rows0)
    step0 = statistics.median(r["launch/step_s"] for r in rows0)
    step1 = statistics.median(r["launch/step_s"] for r in rows1[2:])
    bound = 1.15 * max(gen, train)
    print(f"bench_loop: K=0 step {step0:.2f} s (generation {gen:.2f} s + training {train:.2f} s = {gen + train:.2f} s)")
    print(f"bench_loop: K=1 step {step1:.2f} s vs 1.15 x max(generation, training) = {bound:.2f} s "
          f"-> ratio {step1 / max(gen, train):.2f}x of max, {step1 / step0:.2f}x of K=0")
    hit = next((r for r in rows1 if r["rollout/reward_mean"] >= 0.9), None)
    print(f"bench_loop: K=1 reward {rows1[0]['rollout/reward_mean']:.3f} -> {rows1[-1]['rollout/reward_mean']:.3f}; "
          + (f"first >= 0.9 at step {hit['step']} after {hit['time']:.0f} s of RL" if hit else "never reached 0.9"))
    return 0 if step1 <= bound else 1


def read_rows(out_dir: str) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


if __name__ == "__main__":
    sys.exit(main())
