"""The agent contract, and the runners that turn one agent episode into token-exact Segments.

An agent is plain Python in a file passed by `--agent.path FILE` that defines `make_agent()`, of one of two kinds:
- `Env`: the framework owns the LLM loop: `reset(prompt, label)`, then `step(action_text, state) -> Result` per turn;
  the reward is the sum of the steps'. An image in an observation becomes its placeholder run in Segment.images.
- `ChatAgent`: the agent owns the loop: `run(ctx) -> Result` calls the loopback chat server, which captures tokens.
An exception inside an agent drops its episode (`rollout/dropped_agent_error`) and the run goes on.
Not here: scheduling, batching or staleness (launch.py), token capture (generator.py, chat_server.py).
Reading order: the contract, the two runners, AgentWorker; then the banner `machinery: the user's file, observations`.
"""
import asyncio
import dataclasses
import importlib.util
import math
import os
import time
import uuid
from dataclasses import dataclass, field

from chat_server import ChatArgs, ChatServer, ChatTemplate, template_content
from generator import Generator, Segment, sampled_record, segment_routing


@dataclass
class AgentArgs:
    path: str = field(default="recipes/copy_agent.py", metadata={"help": "file with make_agent() -> Env or ChatAgent"})
    max_turns: int = field(default=8, metadata={"help": "turns after which an Env episode ends as truncated"})
    max_context: int = field(default=2048, metadata={
        "help": "tokens after which an Env episode ends as truncated (--vllm.max_model_len if that is lower)"})
    episode_timeout_s: float = field(default=600.0, metadata={"help": "an episode still running after this is dropped"})
    failed_reward: float | None = field(default=None, metadata={
        "help": "reward of an episode whose agent raised or timed out: what it sampled trains with it; unset: dropped"})

    def __post_init__(self):
        if self.max_turns < 1:
            raise ValueError(f"--agent.max_turns {self.max_turns}: must be >= 1")
        if self.max_context < 16:
            raise ValueError(f"--agent.max_context {self.max_context}: must be >= 16 tokens")
        if self.failed_reward is not None and not math.isfinite(self.failed_reward):
            raise ValueError(f"--agent.failed_reward {self.failed_reward}: must be a finite number")


# --- the contract
@dataclass
class Result:
    reward: float
    observation: str | list = ""   # the next user turn: a str, or parts in order, str (text) or bytes (an image)
    terminated: bool = True
    truncated: bool = False
    info: dict = field(default_factory=dict)


class Env:
    """Subclass and implement reset and step; one instance serves one episode; reset returns the first observation."""
    system_prompt: str | None = None

    async def reset(self, prompt: str, label) -> str | list:
        raise NotImplementedError

    async def step(self, action_text: str, state: dict) -> Result:
        raise NotImplementedError


@dataclass
class ChatContext:
    base_url: str            # OpenAI SDK: OpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
    anthropic_base_url: str  # Anthropic SDK: Anthropic(base_url=ctx.anthropic_base_url, api_key=ctx.api_key)
    api_key: str
    model: str
    messages: list[dict]
    tools: list[dict]
    label: object = None
    group_id: str = ""       # the episodes of one prompt share it (a group-level reward scores them together)


class ChatAgent:
    """Subclass and implement run; it may make any number of SDK calls, sub-agents included."""
    async def run(self, ctx: ChatContext) -> Result:
        raise NotImplementedError


# --- runners: one episode -> Segments
async def run_env_episode(env: Env, generator: Generator, template: ChatTemplate, row: dict, *, args: AgentArgs,
                          episode_id: str, group_id: str, sampled_so_far: list | None = None) -> list[Segment]:
    """The framework-owned loop, one segment: render the first observation once, then append sampled ids verbatim
    and each observation as delta tokens (mask 0; a template that cannot make them fails the episode, naming why).
    sampled_so_far gets a function returning the row up to its last action, for an episode that fails midway."""
    state = {"label": row.get("label"), "prompt": row["prompt"], "turn": 0, "finish_reason": ""}
    ids, mask, logps, versions, spans, sampled, turns = [], [], [], [], [], [], []
    result, truncated, routed, reward = Result(reward=0.0), True, None, 0.0  # truncated unless the env ends it

    def rows(cut: bool = False) -> list[Segment]:  # reads the loop's lists when called: consistent at every await
        end = max((t + 1 for t, m in enumerate(mask) if m), default=0) if cut else len(ids)  # cut: to its last action
        return [Segment(token_ids=ids[:end], action_mask=mask[:end], logprobs=logps[:end], versions=versions[:end],
                        reward=reward, episode_id=episode_id, group_id=group_id, finish_reason=state["finish_reason"],
                        images=[x for x in spans if x[1] <= end], truncated=truncated and not cut,
                        info=dict(result.info, sampled=sampled_record(sampled), turns=list(turns)),
                        routed_experts=None if routed is None else segment_routing(routed, end))] if end else []
    if sampled_so_far is not None:
        sampled_so_far.append(lambda: rows(cut=True))
    first, images = user_turn(await env.reset(row["prompt"], row.get("label")))
    system = [{"role": "system", "content": env.system_prompt}] if env.system_prompt else []
    ids, spans = template.expand_images(template.render_full(system + [first]), images)
    mask, logps, versions = [False] * len(ids), [0.0] * len(ids), [-1] * len(ids)
    limit = min(args.max_context, generator.vllm.max_model_len)  # the engine refuses a prompt that fills its window
    while (room := limit - len(ids)) > 0 and state["turn"] < args.max_turns:
        out = await generator.generate(ids, max_new_tokens=min(room, generator.rollout.max_new_tokens),
                                       affinity=group_id, images=spans)  # a group on one engine: its prompt cached
        turns.append((len(ids), len(ids) + len(out.token_ids)))  # this turn's samples in the row, as the chat path's
        ids, mask = ids + out.token_ids, mask + [True] * len(out.token_ids)
        logps, versions = logps + out.logprobs, versions + out.versions
        sampled.append((out.token_ids, out.logprobs, out.versions))  # as returned, for the audit
        routed = out.routed_experts  # each call prefills the whole history: its routing covers every earlier row
        state.update(turn=state["turn"] + 1, finish_reason=out.finish_reason)
        text_ids = out.token_ids[:-1] if out.token_ids[-1:] == [template.eos_id] else out.token_ids
        result = await env.step(template.decode(text_ids), state)
        reward += result.reward
        if result.terminated or result.truncated or out.finish_reason == "abort":
            truncated = result.truncated or out.finish_reason == "length"  # cut at max tokens, as a chat turn is
            break
        message, images = user_turn(result.observation)
        observation = template.render_delta([message])  # first: its error names the roles and the template
        bridge = template.bridge(out.token_ids)
        observation, new = template.expand_images(observation, images, len(ids) + len(bridge))
        delta = bridge + observation
        if len(ids) + len(delta) >= limit or state["turn"] >= args.max_turns:
            break  # no sample would follow it: the row ends at the last action
        ids, mask, spans = ids + delta, mask + [False] * len(delta), spans + new
        logps, versions = logps + [0.0] * len(delta), versions + [-1] * len(delta)
    return rows()


async def run_chat_episode(agent: ChatAgent, server: ChatServer, row: dict, *, model: str, episode_id: str,
                           group_id: str, sampled_so_far: list | None = None) -> list[Segment]:
    """Agent-owned loop via the chat server; each segment of the episode (compaction, sub-agents) gets its reward.
    sampled_so_far gets a function returning the episode's segments, for an episode that fails midway."""
    ep = server.open_episode(affinity=group_id)  # a group on one engine: its prompt prefilled once, as an Env's
    messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
    ctx = ChatContext(base_url=ep.openai_base_url, anthropic_base_url=ep.anthropic_base_url, api_key=ep.api_key,
                      model=model, messages=messages, tools=row.get("tools", []), label=row.get("label"),
                      group_id=group_id)
    try:
        result = await agent.run(ctx)
    finally:
        segments = server.close_episode(ep.id)
        if sampled_so_far is not None:
            sampled_so_far.append(lambda: segments)
    for s in segments:
        s.reward, s.episode_id, s.group_id = result.reward, episode_id, group_id
        s.info = {**result.info, **s.info}  # the agent's info never replaces the audit's record
    return segments


class AgentWorker:
    """Runs the episodes of prompt groups concurrently (an async Ray actor: one event loop, many episodes)."""

    def __init__(self, args: AgentArgs, chat: ChatArgs, generator: Generator, model_path: str):
        self.args, self.chat, self.generator, self.model_path, self.server = args, chat, generator, model_path, None
        self.module = load_module(args.path, "make_agent", "--agent.path")
        self.template = ChatTemplate(model_path, append_roles=())  # no start-up check: an Env's delta fails when made

    async def start(self) -> str:
        agent = self.module.make_agent()
        if isinstance(agent, ChatAgent) and self.server is None:
            self.server = ChatServer(self.generator, self.model_path, self.chat)
            await self.server.start()
        return type(agent).__name__

    async def run_episode(self, row: dict, episode_id: str, group_id: str, sampled_so_far: list) -> list[Segment]:
        agent = self.module.make_agent()
        names = {"episode_id": episode_id, "group_id": group_id, "sampled_so_far": sampled_so_far}
        if isinstance(agent, Env):
            run = run_env_episode(agent, self.generator, self.template, row, args=self.args, **names)
        elif isinstance(agent, ChatAgent):
            run = run_chat_episode(agent, self.server, row, model=self.server.model_name, **names)  # --chat.model_name
        else:
            raise ValueError(f"--agent.path {self.args.path}: make_agent() returned {type(agent).__name__}, "
                             "not an Env or ChatAgent")
        return await asyncio.wait_for(run, self.args.episode_timeout_s)

    async def run_group(self, row: dict, group_id: str, samples: int) -> dict:
        """`samples` episodes of one prompt; an episode that raises or times out is dropped and counted, or with
        --agent.failed_reward scored: what it sampled trains at that reward, counted as scored. Tainted: dropped."""
        start = time.perf_counter()
        ids, partial = [f"{group_id}-{k}" for k in range(samples)], [[] for _ in range(samples)]
        outcomes = await asyncio.gather(*(self.run_episode(row, e, group_id, p) for e, p in zip(ids, partial)),
                                        return_exceptions=True)
        if self.generator.dead is not None:  # not an agent's failure: the loop stops with it
            raise self.generator.dead
        segments, dropped, scored, errors, scored_ids = [], {"agent_error": 0, "timeout": 0, "tainted": 0}, {}, [], []
        for out, episode_id, sampled_so_far in zip(outcomes, ids, partial):
            failed = ("timeout" if isinstance(out, asyncio.TimeoutError) else
                      "agent_error" if isinstance(out, BaseException) else None)
            if failed == "agent_error":
                errors.append(f"{type(out).__name__}: {out}")
            if failed:  # with --agent.failed_reward, its rows up to the failure at that reward; else none
                out = [dataclasses.replace(s, reward=self.args.failed_reward, episode_id=episode_id, group_id=group_id,
                                           info={**s.info, "failed": failed})
                       for s in (sampled_so_far[0]() if self.args.failed_reward is not None and sampled_so_far else [])]
            if failed and not out:
                dropped[failed] += 1
            elif any(s.info.get("tainted") for s in out):  # the chat server lost track: never trained
                dropped["tainted"] += 1
            else:
                segments += out
                if failed:
                    scored[failed], scored_ids = scored.get(failed, 0) + 1, scored_ids + [episode_id]
        return {"segments": segments, "dropped": dropped, "scored": scored, "scored_ids": scored_ids,
                "errors": errors[:3], "seconds": time.perf_counter() - start}

    async def metrics(self) -> dict:
        return self.server.metrics() if self.server is not None else {}

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop()


# === machinery: the user's file, observations; read it when you change how agents load or what they see
def load_module(path: str, needs: str, flag: str):
    """Import a user's Python file (an agent, a data file) and check it defines `needs`."""
    spec = importlib.util.spec_from_file_location(f"user_{uuid.uuid4().hex[:8]}", path)
    if spec is None or not os.path.exists(path):
        raise ValueError(f"{flag} {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, needs):
        raise ValueError(f"{flag} {path}: defines no {needs}()")
    return module


def user_turn(observation: str | list) -> tuple[dict, list[bytes]]:
    """An observation -> its chat-template user message (one {"type": "image"} part per image) and its images."""
    if not all(isinstance(p, (str, bytes)) for p in observation):  # a str's characters pass
        raise ValueError(f"observation parts {[type(p).__name__ for p in observation]}: each must be str or bytes")
    return {"role": "user", "content": template_content(observation)}, [p for p in observation if isinstance(p, bytes)]
