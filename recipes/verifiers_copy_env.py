"""The copy task of recipes/copy_agent.py written as a `verifiers` environment, the way verifiers' docs show one.

A SingleTurnEnv over the same 900 train / 100 test strings, and a Rubric of two reward functions with weights
0.9 (right positions over the longer of answer and label) and 0.1 (the reply ended by itself, not at the token
limit): the native reward, so the two agents' curves compare. Load it with VERIFIERS_ENV=recipes/verifiers_copy_env.py
and --agent.path recipes/verifiers_agent.py (recipes/verifiers_copy.sh).
"""
import verifiers as vf
from datasets import Dataset

from recipes.copy_agent import rows


def positions(completion, answer, parser, **kwargs) -> float:
    text = parser.parse_answer(completion) or ""
    return sum(a == b for a, b in zip(text, answer)) / max(len(text), len(answer))


def ended(state, **kwargs) -> float:
    return float(not state["trajectory"][-1]["is_truncated"])


def load_environment() -> vf.Environment:
    data = {split: Dataset.from_list([{"question": r["prompt"], "answer": r["label"]} for r in rows(split)])
            for split in ("train", "test")}
    return vf.SingleTurnEnv(dataset=data["train"], eval_dataset=data["test"],
                            rubric=vf.Rubric(funcs=[positions, ended], weights=[0.9, 0.1]))
