"""A task a small pretrained instruct model solves sometimes: which of two 2-digit numbers is larger.

Prompt "Which number is larger, 23 or 76?", label "76". Reward 1 if the first integer of the reply is the
larger number, else 0: exact, so a constant answer or a guess between the two earns at most one half.
SmolLM2-135M-Instruct (dequantized Q4_1) gets ~0.3 at temperature 0.7: it often answers with prose or
other numbers first. `rows(split)`: the 8,010 ordered pairs of distinct numbers 10..99, shuffled once,
split 7,810 train / 200 test; the test pairs never appear in training.
"""
import random
import re

from agent import Env, Result

FIRST_INT = re.compile(r"\d+")


def rows(split: str) -> list[dict]:
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100) if a != b]
    random.Random(0).shuffle(pairs)
    chosen = {"train": pairs[200:], "test": pairs[:200]}.get(split)
    if chosen is None:
        raise ValueError(f"split {split!r}: choose train or test")
    return [{"prompt": f"Which number is larger, {a} or {b}?", "label": str(max(a, b))} for a, b in chosen]


class CompareEnv(Env):
    async def reset(self, prompt: str, label) -> str:
        return prompt

    async def step(self, action_text: str, state: dict) -> Result:
        first = FIRST_INT.search(action_text)
        right = first is not None and first.group(0) == state["label"]
        return Result(reward=float(right), info={"answered_a_number": float(first is not None)})


def make_agent() -> Env:
    return CompareEnv()
