"""The lines a CPU recipe ends with, from its RL run's metrics.jsonl: the batch reward at the first step (after the SFT
warm start) and the last, and the held-out eval before RL and at the last eval.

    python recipes/summary.py METRICS_JSONL [--label "held-out accuracy"] [--chance 0.25]
"""
import argparse
import json

if __name__ == "__main__":
    p = argparse.ArgumentParser(description="Print a recipe's reward after SFT and after RL, and its held-out eval.")
    p.add_argument("metrics", help="the RL run's metrics.jsonl")
    p.add_argument("--label", default="held-out eval", help="the held-out line's name for its metric")
    p.add_argument("--chance", type=float, default=None, help="a random answer's reward, printed after the held-out")
    a = p.parse_args()
    rows = [json.loads(line) for line in open(a.metrics)]
    first, last = rows[0], rows[-1]
    evals = [r["eval/reward_mean"] for r in rows if "eval/reward_mean" in r]
    print(f"reward after SFT (first RL batch): {first['rollout/reward_mean']:.3f}")
    print(f"reward after RL  (last RL batch):  {last['rollout/reward_mean']:.3f}")
    chance = "" if a.chance is None else f"   (chance {a.chance:g})"
    print(f"{a.label} before RL: {first.get('eval/before_reward_mean', float('nan')):.3f}   "
          f"after: {evals[-1] if evals else float('nan'):.3f}{chance}")
