"""verifiers 0.4 environments, written the way 0.4's docs show, train through recipes/verifiers04_agent.py as they ship.

Each environment is a taskset module and the eval TOML verifiers' `eval` would run it with (the tool-less `null`
harness, the local subprocess runtime). Episode tests: an AgentWorker (the class Ray runs, here on an event loop in
a thread) runs one prompt group against the session's real engine and a real chat server; verifiers 0.4 runs in its
own virtualenv (.agents/verifiers04, built on first use: ~90 s, then cached), its chat program talking to the
chat server over HTTP. The segments are checked against the engine's record (launch.audit) and the reward against a
hand computation from the decoded segments. Every test that needs the virtualenv is slow: a cold one installs it.
"""
import asyncio
import json
import os
import re

import pytest
from conftest import audited, call
from test_verifiers import content, read_metrics, replies, write_env

import launch
from agent import AgentArgs, AgentWorker, ChatContext, load_module
from chat_server import ChatArgs, ChatTemplate

ADAPTER = os.path.join(os.path.dirname(__file__), "..", "recipes", "verifiers04_agent.py")

# The eval TOML of each environment: its taskset module (beside the TOML), the null harness (verifiers' tool-less
# chat program, which speaks to MCP tool servers) in a local subprocess, and the sampling verifiers sends.
TOML = '''
[env.taskset]
id = "{name}"

[env.agent]
{agent}

[env.agent.harness]
id = "null"

[env.agent.runtime]
type = "subprocess"

[sampling]
{sampling}
'''

# SingleTurn: a taskset whose task stops after one turn (as 0.4's reverse-text does) and two weighted rewards, one
# reading the reply, one the task's data.
SINGLE_ENV = '''
import verifiers.v1 as vf


class SayData(vf.TaskData):
    bonus: float


class SayTask(vf.Task[SayData]):
    @vf.stop
    async def single_turn(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 1

    @vf.reward(weight=0.5)
    async def digits(self, trace: vf.Trace) -> float:
        return float(sum(c.isdigit() for c in trace.last_reply))

    @vf.reward(weight=2.0)
    async def bonus(self, trace: vf.Trace) -> float:
        return self.data.bonus


class SayTaskset(vf.Taskset[SayTask, vf.TasksetConfig]):
    def load(self) -> list[SayTask]:
        return [SayTask(SayData(prompt=f"say {i}", bonus=float(i)), self.config.task) for i in range(4)]


__all__ = ["SayTaskset"]
'''

# Tool: a taskset-wide Toolset (an MCP server verifiers starts as `python -m tool_env`) with one tool. The sampling
# sets tool_choice "required", so even the random model calls it every turn (the engine samples under the tool-call
# grammar; an enum and one call a turn keep it far below max_tokens), and max_turns=3 ends the run: the calls of
# turns 1 and 2 are answered in the conversation; turn 3's asks for a 4th turn, which the limit refuses.
# Reward: the tool results the trace holds that are their call's word shouted.
TOOL_ENV = '''
import json
from typing import Literal

import verifiers.v1 as vf


class ShoutToolset(vf.Toolset[vf.SharedToolsetConfig]):
    TOOL_PREFIX = "voice"

    @vf.tool
    async def shout(self, word: Literal["hi", "yo"]) -> str:
        """Shout a word.

        Args:
            word: the word to shout
        """
        return word.upper() + "!"


class ShoutConfig(vf.TasksetConfig):
    tools: vf.SharedToolsetConfig = vf.SharedToolsetConfig()


class ShoutTask(vf.Task[vf.TaskData]):
    @vf.reward
    async def right_results(self, trace: vf.Trace) -> float:
        calls = {c.id: json.loads(c.arguments) for m in trace.assistant_messages for c in m.tool_calls or []}
        return float(sum(m.content == calls[m.tool_call_id]["word"].upper() + "!" for m in trace.tool_messages))


class ShoutTaskset(vf.Taskset[ShoutTask, ShoutConfig]):
    @classmethod
    def toolsets(cls, config: ShoutConfig) -> list[vf.Toolset]:
        return [ShoutToolset(config.tools)]

    def load(self) -> list[ShoutTask]:
        return [ShoutTask(vf.TaskData(prompt="shout hi"), self.config.task)]


__all__ = ["ShoutTaskset"]

if __name__ == "__main__":
    ShoutToolset.run()
'''

# MultiTurn: an Env that is the user (as 0.4's alphabet-sort is): after the task's opening reply it answers "turn 1",
# then "turn 2", each through the agent's interaction, so every episode runs 3 turns. Reward: 0.5 x the turns.
MULTI_ENV = '''
import verifiers.v1 as vf


class TalkTask(vf.Task[vf.TaskData]):
    @vf.reward(weight=0.5)
    async def turns(self, trace: vf.Trace) -> float:
        return float(trace.num_turns)


class EchoEnv(vf.SingleAgentEnv):
    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        async with agents.agent.interaction(task) as chat:
            await chat.turn()
            for k in (1, 2):
                if (await chat.turn(f"turn {k}")).terminated:
                    break


class TalkTaskset(vf.Taskset[TalkTask, vf.TasksetConfig]):
    def load(self) -> list[TalkTask]:
        return [TalkTask(vf.TaskData(prompt="talk"), self.config.task)]


__all__ = ["EchoEnv", "TalkTaskset"]
'''

# A group judged together: 0.4 judges attempts against each other in Env.finalize (as its best-of-n env does); here
# it sees every episode of the group. Rewards: each reply's digits less the mean of all, and 0.1 x the attempts.
GROUP_ENV = '''
import verifiers.v1 as vf


class GoTask(vf.Task[vf.TaskData]):
    @vf.stop
    async def single_turn(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 1


class CentredEnv(vf.SingleAgentEnv):
    async def finalize(self, task: vf.Task, episode: vf.Episode) -> None:
        digits = [sum(c.isdigit() for c in t.last_reply) for t in episode.traces]
        for trace, n in zip(episode.traces, digits):
            trace.record_reward("centred", n - sum(digits) / len(digits))
            trace.record_reward("attempts", float(len(digits)), weight=0.1)


class GoTaskset(vf.Taskset[GoTask, vf.TasksetConfig]):
    def load(self) -> list[GoTask]:
        return [GoTask(vf.TaskData(prompt="go"), self.config.task)]


__all__ = ["CentredEnv", "GoTaskset"]
'''

RAISING_ENV = MULTI_ENV.replace('await chat.turn(f"turn {k}")', 'await chat.turn(f"turn {k}") and 1 / 0')
ENVS = {"single": (SINGLE_ENV, "", "max_tokens = 8"),
        "tool": (TOOL_ENV, "max_turns = 3", 'max_tokens = 96\ntool_choice = "required"\nparallel_tool_calls = false'),
        "multi": (MULTI_ENV, "", "max_tokens = 8"), "group": (GROUP_ENV, "", "max_tokens = 8"),
        "raising": (RAISING_ENV, "", "max_tokens = 8")}


def environment(tmp_path, kind: str) -> str:
    """The environment's module and its eval TOML in tmp_path; the TOML's path."""
    source, agent, sampling = ENVS[kind]
    write_env(tmp_path, source, f"{kind}_env.py")
    path = tmp_path / f"{kind}.toml"
    path.write_text(TOML.format(name=f"{kind}_env", agent=agent, sampling=sampling))
    return str(path)


def run_group(loop, generator, model: str, config: str, monkeypatch, samples: int, row: int = 0) -> dict:
    """One group of `samples` episodes of the environment's task `row`, through an AgentWorker."""
    monkeypatch.setenv("VERIFIERS04_CONFIG", config)
    adapter = load_module(ADAPTER, "rows", "--data.path")
    worker = AgentWorker(AgentArgs(path=ADAPTER), ChatArgs(), generator, model)
    assert call(loop, worker.start) == "Verifiers04Agent"
    try:
        return call(loop, worker.run_group, adapter.rows("train")[row], "g0", samples)
    finally:
        call(loop, worker.stop)
        call(loop, adapter.close_drivers)


def exact(group: dict, samples: int, turns: int) -> list:
    """conftest.audited, each segment holding its `turns` turns (verifiers counts the same)."""
    segments = audited(group, samples)
    for s in segments:
        spans = s.info["turns"]
        assert len(spans) == turns == s.info["env_turns"]
        assert sum(s.action_mask) == sum(e - b for b, e in spans) == s.info["completion_tokens"]
    return segments


def observed(template: ChatTemplate, seg) -> str:
    return template.decode([t for t, m in zip(seg.token_ids, seg.action_mask) if not m])


@pytest.fixture(scope="module")
def template(tiny_model) -> ChatTemplate:
    return ChatTemplate(tiny_model)


# --- refusals, before any install


def test_unset_config_and_foreign_rows_are_refused_naming_the_setting(monkeypatch):
    adapter = load_module(ADAPTER, "rows", "--data.path")
    monkeypatch.delenv("VERIFIERS04_CONFIG", raising=False)
    with pytest.raises(ValueError, match="VERIFIERS04_CONFIG is unset"):
        adapter.rows("train")
    ctx = ChatContext(base_url="", anthropic_base_url="", api_key="", model="m", messages=[], tools=[], label="42")
    with pytest.raises(ValueError, match="--data.path recipes/verifiers04_agent.py"):
        asyncio.run(adapter.make_agent().run(ctx))


def test_install_offline_raises_naming_the_folder_and_marks_nothing_done(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/")  # a closed loopback port: offline
    monkeypatch.setenv("PIP_RETRIES", "0")
    root = str(tmp_path / "venv")
    with pytest.raises(RuntimeError, match=rf"^could not build {re.escape(root)} \(offline\?\): .* -m pip install"):
        load_module(ADAPTER, "install", "--agent.path").install(root)
    assert not os.path.exists(os.path.join(root, "requirements.txt"))  # the next call tries again


# --- episodes against the real engine (slow: the first one may build the virtualenv)


@pytest.mark.slow
def test_rows_are_the_tasksets_tasks(tmp_path, monkeypatch):
    monkeypatch.setenv("VERIFIERS04_CONFIG", environment(tmp_path, "single"))
    rows = load_module(ADAPTER, "rows", "--data.path").rows("train")
    # SayTaskset.load: "say 0" .. "say 3", each with its bonus, numbered by verifiers in load order
    assert [r["messages"] for r in rows] == [[{"role": "user", "content": f"say {i}"}] for i in range(4)]
    assert [(r["label"]["verifiers04"]["idx"], r["label"]["verifiers04"]["bonus"]) for r in rows] == \
        [(i, float(i)) for i in range(4)]


@pytest.mark.slow
def test_single_turn_task_reward_is_its_weighted_rewards(loop, tiny_generator, tiny_model, template, tmp_path,
                                                         monkeypatch):
    group = run_group(loop, tiny_generator, tiny_model, environment(tmp_path, "single"), monkeypatch, 2, row=3)
    for s in exact(group, 2, 1):
        (text,) = replies(template, s)
        # 0.5 x the digits of the reply's content (verifiers strips it; digits are unchanged) + 2.0 x task 3's bonus
        assert s.reward == pytest.approx(0.5 * sum(c.isdigit() for c in content(text)) + 2.0 * 3.0)


@pytest.mark.slow
def test_toolset_tool_runs_over_turns_in_one_exact_segment(loop, tiny_generator, tiny_model, template, tmp_path,
                                                            monkeypatch):
    group = run_group(loop, tiny_generator, tiny_model, environment(tmp_path, "tool"), monkeypatch, 2)
    for s in exact(group, 2, 3):
        words = [json.loads(c.split("</tool_call>")[0])["arguments"]["word"]
                 for text in replies(template, s)[:2] for c in text.split("<tool_call>")[1:]]
        assert len(words) == 2, "tool_choice required, one call a turn: turns 1 and 2 each call the tool once"
        assert s.reward == 2.0  # both answered calls came back as their word shouted
        seen = observed(template, s)
        assert seen.count("<tool_response>") == 2 and all(f"{w.upper()}!" in seen for w in words)


@pytest.mark.slow
def test_env_that_is_the_user_answers_every_turn(loop, tiny_generator, tiny_model, template, tmp_path, monkeypatch):
    group = run_group(loop, tiny_generator, tiny_model, environment(tmp_path, "multi"), monkeypatch, 2)
    for s in exact(group, 2, 3):
        assert s.reward == 0.5 * 3  # 3 turns, weight 0.5
        seen = observed(template, s)
        assert "turn 1" in seen and "turn 2" in seen and "turn 3" not in seen  # its two answers, as observations


@pytest.mark.slow
def test_finalize_judges_the_whole_group(loop, tiny_generator, tiny_model, template, tmp_path, monkeypatch):
    segments = exact(run_group(loop, tiny_generator, tiny_model, environment(tmp_path, "group"), monkeypatch, 3), 3, 1)
    digits = {s.episode_id: sum(c.isdigit() for c in content(replies(template, s)[0])) for s in segments}
    mean = sum(digits.values()) / 3
    for s in segments:  # each reply's digits less the group's mean, plus 0.1 x the group's 3 attempts
        assert s.reward == pytest.approx(digits[s.episode_id] - mean + 0.1 * 3)


@pytest.mark.slow
def test_environment_whose_episode_fails_drops_it_naming_the_error(loop, tiny_generator, tiny_model, tmp_path,
                                                                  monkeypatch):
    group = run_group(loop, tiny_generator, tiny_model, environment(tmp_path, "raising"), monkeypatch, 2)
    assert group["segments"] == [] and group["dropped"]["agent_error"] == 2
    assert "the verifiers episode failed" in group["errors"][0] and "ZeroDivisionError" in group["errors"][0]


# --- the loop: 2 steps through launch.run_rl (Ray, the engine, FSDP2 on gloo)


@pytest.mark.slow
def test_environment_trains_through_the_loop_token_exact(ray_local, tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("VERIFIERS04_CONFIG", environment(tmp_path, "multi"))
    out = str(tmp_path / "run")
    # run_rl audits every batch (it raises on a token that is not the sampled one) before it trains
    result = asyncio.run(launch.run_rl(launch.parse_args([
        "--launch.model", tiny_model, "--launch.out_dir", out, "--launch.steps", "2", "--agent.path", ADAPTER,
        "--data.path", ADAPTER, "--launch.batch_prompts", "1", "--launch.samples_per_prompt", "2",
        "--vllm.max_model_len", "1024", "--train.lr", "1e-3"])))
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1] and result["errors"] == []
    for r in rows:  # every episode: 3 turns, 0.5 x 3
        assert r["rollout/episodes"] == 2.0 and r["rollout/segments_per_episode"] == 1.0
        assert r["rollout/dropped_agent_error"] == 0.0 and r["rollout/dropped_tainted"] == 0.0
        assert abs(r["loss/vllm_kl"]) < 1e-3 and r["rollout/reward_mean"] == pytest.approx(1.5)
    assert rows[-1]["train/version"] == 2.0
