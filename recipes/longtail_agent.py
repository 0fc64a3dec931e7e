"""A long-tail workload for the partial-rollout benchmark (`tests/bench_gpu.py longtail`), through the stock
`openai` SDK: each episode asks for one completion of L tokens, L drawn from a lognormal distribution.

L = min(CAP, round(MEDIAN * exp(SIGMA * z))), z ~ N(0, 1): median 256, mean ~420, p90 ~920, p99 ~2,610,
at most 8,192 tokens. Agentic rollouts look like this: most end soon, a few run on and on. A random-weight
model (the benchmark's) almost never samples its end-of-turn token, so each completion is L tokens long;
a trained model may stop earlier. The reward (L / CAP) is a stand-in that varies within a group, so
every step has advantages to train on; nothing is learnt from it.
"""
import math
import random

from openai import AsyncOpenAI

from agent import ChatAgent, ChatContext, Result

MEDIAN, SIGMA, CAP = 256, 1.0, 8192


def rows(split: str) -> list[dict]:
    return [{"prompt": f"count {i}"} for i in range({"train": 1000, "test": 50}[split])]


def draw_length(rng: random.Random) -> int:
    return max(1, min(CAP, round(MEDIAN * math.exp(SIGMA * rng.gauss(0.0, 1.0)))))


class LongTailAgent(ChatAgent):
    drawn: dict[str, int] = {}  # prompt -> its episodes so far, in this process: runs launched alike draw alike

    async def run(self, ctx: ChatContext) -> Result:
        prompt = ctx.messages[-1]["content"]
        self.drawn[prompt] = k = self.drawn.get(prompt, -1) + 1
        length = draw_length(random.Random(f"{prompt}/{k}"))
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
        await client.chat.completions.create(model=ctx.model, messages=ctx.messages, max_tokens=length)
        return Result(reward=length / CAP, info={"asked_tokens": float(length)})


def make_agent() -> ChatAgent:
    return LongTailAgent()
