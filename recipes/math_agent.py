"""Single-turn math with a boxed-answer grader: reward 1 if the last \\boxed{...} equals the label.

Data rows: {"prompt": question, "label": answer} (JSONL or parquet via --data.path). The comparison is
exact after stripping spaces, `$` and a trailing `.0`, so a format trick cannot earn partial credit.
"""

from agent import Env, Result

SYSTEM = "Think step by step, then put the final answer in \\boxed{}."


def last_boxed(text: str) -> str | None:
    """Contents of the last \\boxed{...}, braces balanced; None if there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth < 0:
            return text[i:j]
    return None


def normalize(answer: str) -> str:
    answer = answer.replace(" ", "").replace("$", "").replace(",", "")
    return answer[:-2] if answer.endswith(".0") else answer


class MathEnv(Env):
    system_prompt = SYSTEM

    async def reset(self, prompt: str, label) -> str:
        return prompt

    async def step(self, action_text: str, state: dict) -> Result:
        boxed = last_boxed(action_text)
        right = boxed is not None and normalize(boxed) == normalize(str(state["label"]))
        return Result(reward=float(right), info={"boxed": float(boxed is not None)})


def make_agent() -> Env:
    return MathEnv()
