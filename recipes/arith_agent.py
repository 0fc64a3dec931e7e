"""Long, varied completions for peer job 2 (`tests/bench_gpu.py peer2`): add k one-digit numbers step by step.

Prompt "What is 3 + 5 + 2? Add the numbers one at a time and show each partial sum, then give the final answer as
`Answer: <number>`.", k drawn per prompt from 2..MAX_TERMS. Reward 1 if the reply's final answer equals the sum,
else 0: the last `Answer: <int>`, or without one the reply's last integer (its last partial sum). Only the final
answer counts, so a reply cut off before it earns nothing. SmolLM2-135M-Instruct at temperature 0.7 seldom writes a
right `Answer:` line (on CPU: 1 of 10 mixed sums, 0 of 16 sums of two digits), so the `Answer:` line alone left
nothing to learn from; its replies (partial sums, restarts, digressions) run from ~5 to several hundred tokens.
`rows(split)`: seeded and fixed; 200 test rows drawn with another seed, and a train row equal to a test row dropped
(the short sums repeat).
"""
import random
import re

from agent import Env, Result

MIN_TERMS, MAX_TERMS, TRAIN, TEST = 2, 16, 20000, 200
ANSWER = re.compile(r"Answer:\s*(-?\d+)")
INTEGER = re.compile(r"-?\d+")


def prompt(terms: list[int]) -> str:
    return (f"What is {' + '.join(map(str, terms))}? Add the numbers one at a time and show each partial sum, then "
            "give the final answer as `Answer: <number>`.")


def draw(rng: random.Random, n: int) -> list[list[int]]:
    return [[rng.randint(1, 9) for _ in range(rng.randint(MIN_TERMS, MAX_TERMS))] for _ in range(n)]


def rows(split: str) -> list[dict]:
    test = draw(random.Random(1), TEST)
    if split == "test":
        chosen = test
    elif split == "train":
        seen = {tuple(t) for t in test}
        chosen = [t for t in draw(random.Random(0), TRAIN) if tuple(t) not in seen]
    else:
        raise ValueError(f"split {split!r}: choose train or test")
    return [{"prompt": prompt(t), "label": str(sum(t))} for t in chosen]


class ArithEnv(Env):
    async def reset(self, prompt: str, label) -> str:
        return prompt

    async def step(self, action_text: str, state: dict) -> Result:
        answers = ANSWER.findall(action_text) or INTEGER.findall(action_text)[-1:]  # the final answer, if any
        right = bool(answers) and int(answers[-1]) == int(state["label"])
        return Result(reward=float(right), info={"answered": float(bool(ANSWER.search(action_text)))})


def make_agent() -> Env:
    return ArithEnv()
