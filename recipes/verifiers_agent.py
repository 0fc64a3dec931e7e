"""Any `verifiers` environment (Prime Intellect's library) trains as it ships: one ChatAgent runs its own rollout.

    export VERIFIERS_ENV=my_env.py   # or an installed environment's module name
    python launch.py --agent.path recipes/verifiers_agent.py --data.path recipes/verifiers_agent.py ...

VERIFIERS_ENV names the environment: a .py file, or an importable module (a hub package), with load_environment().
Each episode runs the environment's rollout (SingleTurnEnv, MultiTurnEnv, ToolEnv, ...) through verifiers' own
OpenAI chat client, wrapping a stock AsyncOpenAI at the episode's base URL; the chat server records the segments.
The reward is the environment's rubric scored on the episode's whole group with Rubric.score_group, as verifiers'
run_group scores one: group-level reward functions see every episode of the prompt that did not fail.
rows(split): the environment's dataset ("train") or eval dataset ("test"); a label names the environment and row.
An episode is dropped (rollout/dropped_agent_error) when its rollout raises or ends with an error other than an empty
or malformed reply, or when the rubric gives a reward that is not a finite number.
Not here: verifiers 0.4, which replaced this environment API and pins openai<3 and mcp==2.0.0: its environments
train through recipes/verifiers04_agent.py, in a virtualenv of their own. 0.3.1 and the packages .venv lacks are
installed beside .venv with --no-deps (install()), so it runs on .venv's openai and mcp.
"""
import asyncio
import importlib
import math
import os
import threading
from unittest import mock

from agent import ChatAgent, ChatContext, Result, load_module
from recipes.frameworks import install

# verifiers 0.3.1 and what its environment classes import that .venv lacks (found by importing them), nothing
# .venv has; openai-agents, griffelib and tenacity are the pins recipes/frameworks.py installs too.
PINS = ["verifiers==0.3.1", "renderers==0.1.12", "prime-pydantic-config==0.4.3", "tenacity==9.2.1",
        "aiolimiter==1.3.0", "prime-sandboxes==0.5.1", "connectrpc==0.11.1", "pyqwest==0.12.0", "protobuf-py==0.1.1",
        "protobuf-py-ext==0.1.1", "aiofiles==25.1.0", "openai-agents==0.24.0", "griffelib==2.4.1"]


install(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".agents", "py"), PINS)
import httpx  # noqa: E402
from openai import AsyncOpenAI  # noqa: E402
from verifiers.legacy.clients import OpenAIChatCompletionsClient  # noqa: E402
from verifiers.legacy.errors import InvalidModelResponseError  # noqa: E402

ENVS: dict = {}  # name -> environment, built once per process (load_environment may load a dataset)


def environment(name: str):
    if not name:
        raise ValueError("VERIFIERS_ENV is unset: set it to a .py file or a module that defines load_environment()")
    if name not in ENVS:
        module = (load_module(name, "load_environment", "VERIFIERS_ENV") if name.endswith(".py")
                  else importlib.import_module(name))
        if not hasattr(module, "load_environment"):
            raise ValueError(f"VERIFIERS_ENV {name}: defines no load_environment()")
        if threading.current_thread() is threading.main_thread():
            ENVS[name] = module.load_environment()
        else:  # an Environment sets SIGINT/SIGTERM handlers, which only the main thread may; a Ray actor is off it
            with mock.patch("signal.signal"):
                ENVS[name] = module.load_environment()
    return ENVS[name]


def rows(split: str) -> list[dict]:
    """The environment's rows; each label names the environment, so a Ray worker on any node loads the same one."""
    if split not in ("train", "test"):
        raise ValueError(f"split {split!r}: choose train or test (the environment's dataset or eval dataset)")
    name = os.environ.get("VERIFIERS_ENV", "")
    name = os.path.abspath(name) if name.endswith(".py") else name
    env = environment(name)
    data = env.get_dataset() if split == "train" else env.get_eval_dataset()
    # Arrow gives every message every key any message has: drop the None ones
    return [{"messages": [{k: v for k, v in m.items() if v is not None} for m in row["prompt"]],
             "label": {"env": name, "input": dict(row)}} for row in data]


def episode(ctx: ChatContext) -> tuple:
    """(environment, verifiers input) of an episode: a row of rows() names both; a row of another --data.path is
    the input of the environment VERIFIERS_ENV names."""
    if isinstance(ctx.label, dict) and ctx.label.keys() == {"env", "input"}:
        return environment(ctx.label["env"]), ctx.label["input"]
    answer = "" if ctx.label is None else str(ctx.label)
    return environment(os.environ.get("VERIFIERS_ENV", "")), {"prompt": ctx.messages, "answer": answer,
                                                             "example_id": 0}


# --- a group: the episodes of one prompt, scored together once the last one has rolled out

# AgentWorker.run_group starts a group's episodes in one event-loop pass, before any can finish (a rollout waits on
# HTTP): ctx.group_id names the group, whatever --data.path made the row, and every member has joined before the
# first one ends. The entry goes when its last member ends.
GROUPS: dict[str, dict] = {}
HTTP = None  # one connection pool for the process's episodes: a fresh AsyncOpenAI builds its own, ~40 ms of CPU


async def score(env, group: dict) -> None:
    try:
        if group["states"]:
            await env.rubric.score_group(group["states"])
            for state in group["states"]:
                await env.rubric.cleanup(state)
    except Exception as e:  # every member of the group raises it
        group["error"] = e
    group["scored"].set()


class VerifiersAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        global HTTP
        key, (env, task) = ctx.group_id, episode(ctx)
        group = GROUPS.setdefault(key, {"running": 0, "states": [], "scored": asyncio.Event(), "error": None})
        group["running"] += 1
        try:
            HTTP = HTTP or httpx.AsyncClient(limits=httpx.Limits(max_connections=None))  # every episode at once
            client = OpenAIChatCompletionsClient(AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key,
                                                             http_client=HTTP))
            state = await env.rollout(task, client, ctx.model, env.sampling_args)
            # An empty or malformed reply is the policy's own sample: the rubric scores it, as verifiers' run_group
            # does. Any other error (the server, a sandbox, the environment) drops the episode.
            if state.get("error") is not None and not isinstance(state["error"], InvalidModelResponseError):
                raise RuntimeError(f"the verifiers rollout ended with an error: {state['error']!r}")
            group["states"].append(state)
        finally:  # a failed or timed-out member leaves the group; the last one to end starts the scoring
            group["running"] -= 1
            if group["running"] == 0:
                del GROUPS[key]
                group["task"] = asyncio.ensure_future(score(env, group))
        await group["scored"].wait()
        if group["error"] is not None:
            raise group["error"]
        reward = state["reward"]
        if not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise ValueError(f"the environment's rubric gave reward {reward!r} (metrics {state['metrics']}): "
                             "a reward must be a finite number")
        usage = env.get_state_usage(state) or {}
        return Result(reward=float(reward), info={"metrics": dict(state["metrics"] or {}), "env_turns":
                      len(state["trajectory"]), "completion_tokens": usage.get("output_tokens")})


def make_agent() -> ChatAgent:
    return VerifiersAgent()
