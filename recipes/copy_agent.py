"""The default CPU task: copy a 3-digit string. An `Env` agent with a positional reward.

Prompt "copy 407", answer "407". Reward = 0.9 x share of positions answered right (over the longer string) + 0.1 if the
turn ended with the end-of-turn token (finish_reason "stop"); a random policy scores ~0.03. The
reward is exact per position, so it cannot be gamed by a constant answer. `rows(split)` is the data:
the 1,000 strings split 900 train / 100 test, and an `sft` slice of 50 train strings (5%) as chat
examples for the warm start.
"""
import random

from agent import Env, Result


def rows(split: str) -> list[dict]:
    strings = [f"{i:03d}" for i in range(1000)]
    random.Random(0).shuffle(strings)
    if split == "train":
        return [{"prompt": f"copy {s}", "label": s} for s in strings[:900]]
    if split == "test":
        return [{"prompt": f"copy {s}", "label": s} for s in strings[900:]]
    if split == "sft":
        return [{"messages": [{"role": "user", "content": f"copy {s}"}, {"role": "assistant", "content": s}]}
                for s in strings[:50]]
    raise ValueError(f"split {split!r}: choose train, test or sft")


class CopyEnv(Env):
    async def reset(self, prompt: str, label) -> str:
        return prompt

    async def step(self, action_text: str, state: dict) -> Result:
        label = state["label"]
        # right positions over the longer of answer and label: extra characters cost like wrong ones
        right = sum(a == b for a, b in zip(action_text, label)) / max(len(action_text), len(label))
        reward = 0.9 * right + 0.1 * (state["finish_reason"] == "stop")
        return Result(reward=reward, info={"exact": float(action_text == label)})


def make_agent() -> Env:
    return CopyEnv()
