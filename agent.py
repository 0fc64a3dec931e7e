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
import importlib.util
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

    def __post_init__(self):
        if self.max_turns < 1:
            raise ValueError(f"--agent.max_turns {self.max_turns}: must be >= 1")
        if self.max_context < 16:
            raise ValueError(f"--agent.max_context {self.max_context}: must be >= 16 tokens")


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
                          episode_id: str, group_id: str) -> list[Segment]:
    """The framework-owned loop, one segment: render the first observation once, then append sampled ids verbatim
    and each observation as delta tokens (mask 0; a template that cannot make them fails the episode, naming why)."""
    state = {"label": row.get("label"), "prompt": row["prompt"], "turn": 0, "finish_reason": ""}
    first, images = user_turn(await env.reset(row["prompt"], row.get("label")))
    system = [{"role": "system", "content": env.system_prompt}] if env.system_prompt else []
    ids, spans = template.expand_images(template.render_full(system + [first]), images)
    mask, logps, versions, sampled, turns = [False] * len(ids), [0.0] * len(ids), [-1] * len(ids), [], []
    result, truncated, routed, reward = Result(reward=0.0), True, None, 0.0  # truncated unless the env ends it
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
    return [Segment(token_ids=ids, action_mask=mask, logprobs=logps, versions=versions, reward=reward,
                    episode_id=episode_id, group_id=group_id, finish_reason=state["finish_reason"], images=spans,
                    truncated=truncated, info=dict(result.info, sampled=sampled_record(sampled), turns=turns),
                    routed_experts=None if routed is None else segment_routing(routed, len(ids)))]


async def run_chat_episode(agent: ChatAgent, server: ChatServer, row: dict, *, model: str, episode_id: str,
                           group_id: str) -> list[Segment]:
    """Agent-owned loop via the chat server; each segment of the episode (compaction, sub-agents) gets its reward."""
    ep = server.open_episode(affinity=group_id)  # a group on one engine: its prompt prefilled once, as an Env's
    messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
    ctx = ChatContext(base_url=ep.openai_base_url, anthropic_base_url=ep.anthropic_base_url, api_key=ep.api_key,
                      model=model, messages=messages, tools=row.get("tools", []), label=row.get("label"),
                      group_id=group_id)
    try:
        result = await agent.run(ctx)
    finally:
        segments = server.close_episode(ep.id)
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

    async def run_episode(self, row: dict, episode_id: str, group_id: str) -> list[Segment]:
        agent = self.module.make_agent()
        names = {"episode_id": episode_id, "group_id": group_id}
        if isinstance(agent, Env):
            run = run_env_episode(agent, self.generator, self.template, row, args=self.args, **names)
        elif isinstance(agent, ChatAgent):
            run = run_chat_episode(agent, self.server, row, model=self.server.model_name, **names)  # --chat.model_name
        else:
            raise ValueError(f"--agent.path {self.args.path}: make_agent() returned {type(agent).__name__}, "
                             "not an Env or ChatAgent")
        return await asyncio.wait_for(run, self.args.episode_timeout_s)

    async def run_group(self, row: dict, group_id: str, samples: int) -> dict:
        """`samples` episodes of one prompt; an episode that raises or times out is dropped and counted."""
        start = time.perf_counter()
        ids = [f"{group_id}-{k}" for k in range(samples)]
        outcomes = await asyncio.gather(*(self.run_episode(row, e, group_id) for e in ids), return_exceptions=True)
        if self.generator.dead is not None:  # not an agent's failure: the loop stops with it
            raise self.generator.dead
        segments, dropped, errors = [], {"agent_error": 0, "timeout": 0, "tainted": 0}, []
        for out in outcomes:
            if isinstance(out, asyncio.TimeoutError):
                dropped["timeout"] += 1
            elif isinstance(out, BaseException):
                dropped["agent_error"] += 1
                errors.append(f"{type(out).__name__}: {out}")
            elif any(s.info.get("tainted") for s in out):
                dropped["tainted"] += 1
            else:
                segments += out
        return {"segments": segments, "dropped": dropped, "errors": errors[:3], "seconds": time.perf_counter() - start}

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
