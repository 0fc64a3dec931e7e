"""verifiers environments, written the way verifiers' docs show, train through recipes/verifiers_agent.py as they ship.

Episode tests: an AgentWorker (the class Ray runs, here on an event loop in a thread, off the main thread as in an
actor) runs one prompt group of each environment against the session's real engine and a real chat server; the
test checks the segments against the engine's record (launch.audit) and the reward against a hand computation
from the decoded segments. Loop tests (slow): each environment trains a few steps through launch.run_rl.
"""
import asyncio
import json
import os
import subprocess
import textwrap

import pytest
from conftest import audited, call

import launch
from agent import AgentArgs, AgentWorker, load_module
from chat_server import ChatArgs, ChatTemplate, parse_reply

ADAPTER = os.path.join(os.path.dirname(__file__), "..", "recipes", "verifiers_agent.py")
COPY_ENV = os.path.join(os.path.dirname(__file__), "..", "recipes", "verifiers_copy_env.py")

# A SingleTurnEnv and a Rubric of two weighted functions, one reading the completion, one the dataset row. Each
# environment sets max_tokens in its sampling_args, as verifiers' docs do (the chat server's default is the context).
SINGLE_ENV = '''
import verifiers as vf
from datasets import Dataset

def digits(completion, parser) -> float:
    return float(sum(c.isdigit() for c in parser.parse_answer(completion) or ""))

def bonus(info) -> float:
    return info["bonus"]

def load_environment():
    data = Dataset.from_list([{"question": f"say {i}", "answer": str(i), "info": {"bonus": float(i)}}
                              for i in range(4)])
    return vf.SingleTurnEnv(dataset=data, rubric=vf.Rubric(funcs=[digits, bonus], weights=[0.5, 2.0]),
                            sampling_args={"max_tokens": 8})
'''

# A ToolEnv with one Python tool. tool_choice "required" makes even the random model call it every turn (the
# engine samples under the tool-call grammar; an enum and one call a turn keep it far below max_tokens, where a list
# of parallel calls could outgrow it and end the episode early), so each episode runs max_turns=3 turns:
# the calls of turns 1 and 2 are run and answered, turn 3's ends the episode. Reward: the tool results that are
# their call's word shouted.
TOOL_ENV = '''
import json
from typing import Literal
import verifiers as vf
from datasets import Dataset

def shout(word: Literal["hi", "yo"]) -> str:
    """Shout a word.

    Args:
        word: the word to shout
    """
    return word.upper() + "!"

def right_results(completion) -> float:
    calls = {c.id: json.loads(c.arguments) for m in completion if m.role == "assistant" for c in m.tool_calls or []}
    return float(sum(m.content == calls[m.tool_call_id]["word"].upper() + "!" for m in completion if m.role == "tool"))

def load_environment():
    data = Dataset.from_list([{"question": "shout hi", "answer": "HI!"}])
    return vf.ToolEnv(dataset=data, tools=[shout], max_turns=3, rubric=vf.Rubric(funcs=[right_results]),
                      sampling_args={"tool_choice": "required", "parallel_tool_calls": False,
                                     "max_tokens": 96})
'''

# A MultiTurnEnv with its own env_response: it answers every turn with "turn N" and never ends the episode itself.
MULTI_ENV = '''
import verifiers as vf
from datasets import Dataset

class Echo(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": f"turn {len(state['trajectory'])}"}]

def turns(state) -> float:
    return float(len(state["trajectory"]))

def load_environment():
    data = Dataset.from_list([{"question": "talk", "answer": ""}])
    return Echo(dataset=data, max_turns=3, rubric=vf.Rubric(funcs=[turns], weights=[0.5]),
                sampling_args={"max_tokens": 8})
'''

# Group-level reward functions (plural arguments): each sees the whole group of the prompt.
GROUP_ENV = '''
import verifiers as vf
from datasets import Dataset

def centred(completions, parser) -> list[float]:
    lengths = [sum(ch.isdigit() for ch in parser.parse_answer(c) or "") for c in completions]
    return [n - sum(lengths) / len(lengths) for n in lengths]

def group_size(states) -> list[float]:
    return [float(len(states))] * len(states)

def load_environment():
    data = Dataset.from_list([{"question": "go", "answer": ""}])
    return vf.SingleTurnEnv(dataset=data, rubric=vf.Rubric(funcs=[centred, group_size], weights=[1.0, 0.1]),
                            sampling_args={"max_tokens": 8})
'''

RAISING_ENV = MULTI_ENV.replace('return [{"role": "user", "content": f"turn {len(state[\'trajectory\'])}"}]',
                                'raise RuntimeError("this environment breaks after its first turn")')
NAN_ENV = SINGLE_ENV.replace('return info["bonus"]', 'return float("nan")')
NO_LOAD_ENV = "import verifiers as vf\n\ndef load_env():\n    return None\n"


def write_env(tmp_path, source: str, name: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return str(path)


def run_group(loop, generator, model: str, env_path: str, monkeypatch, samples: int, row: int = 0) -> dict:
    """One group of `samples` episodes of the environment's dataset row `row`, through an AgentWorker."""
    monkeypatch.setenv("VERIFIERS_ENV", env_path)
    data = load_module(ADAPTER, "rows", "--data.path").rows("train")
    worker = AgentWorker(AgentArgs(path=ADAPTER), ChatArgs(), generator, model)
    assert call(loop, worker.start) == "VerifiersAgent"
    try:
        return call(loop, worker.run_group, data[row], "g0", samples)
    finally:
        call(loop, worker.stop)


def replies(template: ChatTemplate, seg) -> list[str]:
    """The sampled text of each turn, end-of-turn token left out, as the chat server's reply content."""
    out = []
    for start, end in seg.info["turns"]:
        ids = seg.token_ids[start:end]
        out.append(template.decode(ids[:-1] if ids[-1:] == [template.eos_id] else ids))
    return out


def content(text: str) -> str:
    """A reply's content as the chat server parses it (vLLM's hermes and <think> parsers): the text after the first
    </think>, its leading newlines dropped (a random model samples such tags now and then)."""
    return text.partition("</think>")[2].lstrip("\n") if "</think>" in text else text


def answered(template: ChatTemplate, seg, turns: int) -> int:
    """The turns verifiers keeps: an episode ends at a reply with no content, reasoning or tool call (verifiers'
    EmptyModelResponseError, which the random model's eos-first reply now and then raises), and that turn is left
    out of the trajectory. The segment keeps it: its sampled tokens train like any other."""
    said = [any(parse_reply(text)) for text in replies(template, seg)]
    return min(turns, said.index(False) if False in said else len(said))


def exact(group: dict, samples: int, turns: int, template: ChatTemplate) -> list:
    """conftest.audited, each segment holding every turn."""
    segments = audited(group, samples)
    for s in segments:
        kept, spans = answered(template, s, turns), s.info["turns"]
        assert len(spans) == min(turns, kept + 1) and s.info["env_turns"] == kept
        assert sum(s.action_mask) == sum(e - b for b, e in spans)
        # verifiers adds a reply's usage after its client returned it; an empty reply raises before that, so its
        # tokens (trained: the policy sampled them) are not in verifiers' count, the kept turns' tokens are
        assert s.info["completion_tokens"] == sum(e - b for b, e in spans[:kept])
    return segments


# --- episodes against the real engine


@pytest.fixture(scope="module")
def template(tiny_model) -> ChatTemplate:
    return ChatTemplate(tiny_model)


def test_single_turn_env_reward_is_its_weighted_rubric(loop, tiny_generator, tiny_model, template, tmp_path,
                                                       monkeypatch):
    env = write_env(tmp_path, SINGLE_ENV, "single.py")
    for s in exact(run_group(loop, tiny_generator, tiny_model, env, monkeypatch, 2, row=3), 2, 1, template):
        (text,) = replies(template, s)
        # 0.5 x the digits of the reply's content + 2.0 x row 3's info bonus, 3.0
        assert s.reward == pytest.approx(0.5 * sum(c.isdigit() for c in content(text)) + 2.0 * 3.0)


def test_tool_env_runs_its_python_tool_over_turns_in_one_exact_segment(loop, tiny_generator, tiny_model, template,
                                                                       tmp_path, monkeypatch):
    env = write_env(tmp_path, TOOL_ENV, "tool.py")
    for s in exact(run_group(loop, tiny_generator, tiny_model, env, monkeypatch, 2), 2, 3, template):
        words = [json.loads(c.split("</tool_call>")[0])["arguments"]["word"]
                 for text in replies(template, s)[:2] for c in text.split("<tool_call>")[1:]]
        assert len(words) == 2, "tool_choice required, one call a turn: turns 1 and 2 each call the tool once"
        assert s.reward == len(words)  # every call of turns 1 and 2 ran and its result came back right
        observed = template.decode([t for t, m in zip(s.token_ids, s.action_mask) if not m])
        assert observed.count("<tool_response>") == len(words)  # the results: observations (mask 0), each once
        assert all(f"{w.upper()}!" in observed for w in words)


def test_multi_turn_env_answers_with_its_env_response(loop, tiny_generator, tiny_model, template, tmp_path,
                                                      monkeypatch):
    env = write_env(tmp_path, MULTI_ENV, "multi.py")
    for s in exact(run_group(loop, tiny_generator, tiny_model, env, monkeypatch, 2), 2, 3, template):
        kept = answered(template, s, 3)   # 3 unless a reply was empty
        assert s.reward == 0.5 * kept  # the trajectory's turns, weight 0.5
        observed = template.decode([t for t, m in zip(s.token_ids, s.action_mask) if not m])
        # its answer after each kept turn but the last: "turn 1" and "turn 2" when all 3 are kept
        assert all((f"turn {k}" in observed) == (k < min(kept + 1, 3)) for k in (1, 2, 3))


def test_group_reward_function_sees_the_whole_group(loop, tiny_generator, tiny_model, template, tmp_path,
                                                    monkeypatch):
    env = write_env(tmp_path, GROUP_ENV, "group.py")
    segments = exact(run_group(loop, tiny_generator, tiny_model, env, monkeypatch, 3), 3, 1, template)
    lengths = {s.episode_id: sum(c.isdigit() for c in content(replies(template, s)[0])) for s in segments}
    mean = sum(lengths.values()) / 3
    for s in segments:  # each reply's digits less the group's mean, plus 0.1 x the group's 3 episodes
        assert s.reward == pytest.approx(lengths[s.episode_id] - mean + 0.1 * 3)


def test_group_of_a_prompt_row_from_another_data_path_is_scored_as_one_group(loop, tiny_generator, tiny_model,
                                                                             template, tmp_path, monkeypatch):
    # a {prompt, label} row (another --data.path): each episode builds its own messages list, yet the 3 episodes
    # of the row are one group for a group-level rubric: group_size sees 3 states, centred the group's mean
    monkeypatch.setenv("VERIFIERS_ENV", write_env(tmp_path, GROUP_ENV, "group.py"))
    worker = AgentWorker(AgentArgs(path=ADAPTER), ChatArgs(), tiny_generator, tiny_model)
    assert call(loop, worker.start) == "VerifiersAgent"
    try:
        group = call(loop, worker.run_group, {"prompt": "go", "label": ""}, "g1", 3)
    finally:
        call(loop, worker.stop)
    segments = exact(group, 3, 1, template)
    lengths = {s.episode_id: sum(c.isdigit() for c in content(replies(template, s)[0])) for s in segments}
    for s in segments:  # as the dataset's own row: digits less the group's mean, plus 0.1 x 3 episodes
        assert s.reward == pytest.approx(lengths[s.episode_id] - sum(lengths.values()) / 3 + 0.1 * 3)


def test_environment_whose_rollout_raises_drops_its_episodes(loop, tiny_generator, tiny_model, tmp_path,
                                                             monkeypatch):
    env = write_env(tmp_path, RAISING_ENV, "raising.py")
    group = run_group(loop, tiny_generator, tiny_model, env, monkeypatch, 2)
    assert group["segments"] == [] and group["dropped"]["agent_error"] == 2
    assert "breaks after its first turn" in group["errors"][0]


def test_rubric_returning_nan_drops_the_episode_naming_the_reward(loop, tiny_generator, tiny_model, tmp_path,
                                                                  monkeypatch):
    env = write_env(tmp_path, NAN_ENV, "nan.py")
    group = run_group(loop, tiny_generator, tiny_model, env, monkeypatch, 2)
    assert group["segments"] == [] and group["dropped"]["agent_error"] == 2
    assert "rubric gave reward nan" in group["errors"][0] and "finite" in group["errors"][0]


def test_module_without_load_environment_is_refused_naming_the_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("VERIFIERS_ENV", write_env(tmp_path, NO_LOAD_ENV, "no_load.py"))
    with pytest.raises(ValueError, match=r"VERIFIERS_ENV .*no_load.py: defines no load_environment\(\)"):
        load_module(ADAPTER, "rows", "--data.path").rows("train")
    monkeypatch.delenv("VERIFIERS_ENV")
    with pytest.raises(ValueError, match="VERIFIERS_ENV is unset"):
        load_module(ADAPTER, "rows", "--data.path").rows("train")


def test_copy_env_rows_are_the_native_agents_rows():
    from recipes.copy_agent import rows
    os.environ["VERIFIERS_ENV"] = COPY_ENV
    try:
        adapter = load_module(ADAPTER, "rows", "--data.path")
        for split in ("train", "test"):
            mine = adapter.rows(split)
            assert [r["messages"] for r in mine] == [[{"role": "user", "content": r["prompt"]}] for r in rows(split)]
            assert [r["label"]["input"]["answer"] for r in mine] == [r["label"] for r in rows(split)]
    finally:
        del os.environ["VERIFIERS_ENV"]


# --- the loop: each environment trains 2 steps through launch.run_rl (Ray, the engine, FSDP2 on gloo)


def read_metrics(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


# (environment, reward_mean of every step by hand or None, extra flags). The MultiTurnEnv's episodes all score
# 0.5 x 3 turns; a group's centred digits sum to 0, leaving 0.1 x its 2 episodes; a ToolEnv episode scores one per
# call of turns 1 and 2, at least one each. Its calls are constrained tokens: --loss.is_level token corrects them.
LOOPS = {"single": (SINGLE_ENV, None, ()), "tool": (TOOL_ENV, None, ("--loss.is_level", "token")),
         "multi": (MULTI_ENV, 1.5, ()), "group": (GROUP_ENV, 0.2, ())}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(LOOPS))
def test_environment_trains_through_the_loop_token_exact(kind, ray_local, tiny_model, tmp_path, monkeypatch):
    source, reward, extra = LOOPS[kind]
    monkeypatch.setenv("VERIFIERS_ENV", write_env(tmp_path, source, f"{kind}.py"))
    out = str(tmp_path / "run")
    # run_rl audits every batch (it raises on a token that is not the sampled one) before it trains
    result = asyncio.run(launch.run_rl(launch.parse_args([
        "--launch.model", tiny_model, "--launch.out_dir", out, "--launch.steps", "2", "--agent.path", ADAPTER,
        "--data.path", ADAPTER, "--launch.batch_prompts", "1", "--launch.samples_per_prompt", "2",
        "--vllm.max_model_len", "1024", "--train.lr", "1e-3", *extra])))
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1] and result["errors"] == []
    for r in rows:
        assert r["rollout/episodes"] == 2.0 and r["rollout/segments_per_episode"] == 1.0
        assert r["rollout/dropped_agent_error"] == 0.0 and r["rollout/dropped_tainted"] == 0.0
        if kind != "tool":  # the trainer recomputes the engine's log-probs (a grammar-masked token's differ)
            assert abs(r["loss/vllm_kl"]) < 1e-3
        if reward is not None:
            assert r["rollout/reward_mean"] == pytest.approx(reward)
    if kind == "tool":
        assert all(r["rollout/constrained_tokens"] > 0 and r["rollout/reward_mean"] == 2.0 for r in rows)
    assert rows[-1]["train/version"] == 2.0


# --- the learning curve


@pytest.mark.slow
def test_verifiers_copy_recipe_trains_both_agents_from_one_warm_start(tmp_path):
    """recipes/verifiers_copy.sh, shortened to 2 SFT and 2 RL steps: both agents log the same keys.

    The full recipe (30 SFT steps, then 60 GRPO steps of 32 prompts x 8, K=1, from one SFT model) on 2 CPU cores shared
    with other jobs; held-out reward on the 100 test strings, before RL / after 10, 20, ..., 60 steps, and RL wall time:
        native Env agent (recipes/copy_agent.py):    0.725 / 0.811 0.884 0.979 0.986 0.985 0.991, 290 s
        verifiers SingleTurnEnv (verifiers_copy_env): 0.721 / 0.785 0.899 0.967 0.986 0.988 0.988, 1,204 s
    Median step 2.2 s native, 13.9 s verifiers (each episode goes through HTTP, verifiers' message models and the
    chat server, and that run shared the cores with this file's other tests): the same reward in the same steps.
    """
    root = os.path.join(os.path.dirname(__file__), "..")
    out = str(tmp_path / "curve")
    done = subprocess.run(["bash", "recipes/verifiers_copy.sh"], cwd=root, capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "OUT": out, "SFT_STEPS": "2", "RL_STEPS": "2"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    native, mine = read_metrics(os.path.join(out, "native")), read_metrics(os.path.join(out, "verifiers"))
    assert [r["step"] for r in native] == [r["step"] for r in mine] == [0, 1]
    for a, b in zip(native, mine):
        assert a["rollout/episodes"] == b["rollout/episodes"] == 256.0  # 32 prompts x 8 samples, none dropped
        assert b["rollout/segments_per_episode"] == 1.0
    # the same held-out strings and the same SFT model: the baselines differ only by sampling noise
    assert abs(native[0]["eval/before_reward_mean"] - mine[0]["eval/before_reward_mean"]) < 0.1
    assert done.stdout.count("held-out eval before RL") == 2
