"""verifiers 0.4 environments (Prime Intellect's taskset/harness API) train as they ship, in a virtualenv of their own.

    export VERIFIERS04_CONFIG=my_eval.toml   # the TOML verifiers' `eval @ my_eval.toml` runs
    python launch.py --agent.path recipes/verifiers04_agent.py --data.path recipes/verifiers04_agent.py ...

0.4 pins openai<3 and mcp==2.0.0, which .venv cannot hold (openai 3), so it runs where its pins hold: install() builds
.agents/verifiers04 from recipes/verifiers04_requirements.txt on first use, and recipes/verifiers04_driver.py runs
there: once per process and TOML, answering each episode over a pipe. An episode is one 0.4 episode of its task, as
verifiers' env server runs one for a trainer: the environment's own harness (its chat program, tools as MCP servers)
talks to the episode's chat-server URL over HTTP, like the coding CLIs; the chat server records the segments.
Rewards: the task's @vf.reward functions, then, once every episode of the group has ended, the Env's finalize() over
one episode holding all their traces (0.4's cross-agent judgement, so a group sees every member, as 0.3.1's group
rubric did); the finalize() of each single episode runs first, as 0.4 runs it. rows(split): the TOML's [select]ed
tasks ("train"), or those of VERIFIERS04_TEST_CONFIG ("test"). An episode whose 0.4 episode fails, or that trains other
than one agent, or whose reward is not a finite number, raises: dropped (rollout/dropped_agent_error).
Not here: verifiers 0.3.1 environments (recipes/verifiers_agent.py, in .venv).
"""
import asyncio
import collections
import fcntl
import json
import math
import os
import subprocess
import sys

from agent import ChatAgent, ChatContext, Result

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(os.path.dirname(HERE), ".agents", "verifiers04")
REQUIREMENTS, DRIVER = os.path.join(HERE, "verifiers04_requirements.txt"), os.path.join(HERE, "verifiers04_driver.py")


def install(root: str = ROOT) -> str:
    """The virtualenv's python, built once per requirements file (a copy in root marks it done)."""
    python, done = os.path.join(root, "bin", "python"), os.path.join(root, "requirements.txt")
    with open(REQUIREMENTS) as f:
        pins = f.read()
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # Ray workers and tests may start at once
        if os.path.exists(done) and open(done).read() == pins:
            return python
        pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", "-r", REQUIREMENTS]
        for argv in ([sys.executable, "-m", "venv", "--clear", root], pip):
            run = subprocess.run(argv, capture_output=True, text=True)
            if run.returncode != 0:
                raise RuntimeError(f"could not build {root} (offline?): {' '.join(argv[:4])}: {run.stderr[-600:]}")
        with open(done, "w") as f:
            f.write(pins)
    return python


def driver_env(python: str) -> dict:
    """The driver's environment: the virtualenv's bin first on PATH, for the uv that verifiers' harnesses run."""
    return {**os.environ, "PATH": os.path.dirname(python) + os.pathsep + os.environ.get("PATH", "")}


def config_of(split: str) -> str:
    name = {"train": "VERIFIERS04_CONFIG", "test": "VERIFIERS04_TEST_CONFIG"}.get(split)
    if name is None:
        raise ValueError(f"split {split!r}: choose train or test")
    if not os.environ.get(name):
        raise ValueError(f"{name} is unset: set it to the eval TOML of the verifiers 0.4 environment for {split}")
    return os.path.abspath(os.environ[name])


def rows(split: str) -> list[dict]:
    """The environment's tasks; each label names its TOML, so a Ray worker on any node runs the same environment."""
    config, python = config_of(split), install()
    run = subprocess.run([python, DRIVER, "rows", config], capture_output=True, text=True, env=driver_env(python))
    if run.returncode != 0:
        raise ValueError(f"verifiers 0.4 could not load {config}: {run.stderr[-1500:]}")
    out = json.loads(run.stdout)
    for row in out:
        row["label"]["config"] = config
    return out


# --- the driver: one serve process per event loop and TOML, requests answered as they finish

class Driver:
    def __init__(self, proc):
        self.proc, self.pending, self.next, self.tail = proc, {}, 0, collections.deque(maxlen=40)
        self.reader = asyncio.ensure_future(self.read())
        self.logger = asyncio.ensure_future(self.log())

    async def read(self) -> None:
        while line := await self.proc.stdout.readline():
            reply = json.loads(line)
            if not (future := self.pending.pop(reply["id"])).done():  # done: its episode timed out and was cancelled
                future.set_result(reply)
        await self.proc.wait()  # it exited: every request still waiting fails with its last words
        error = RuntimeError(f"the verifiers 0.4 driver exited {self.proc.returncode}: {''.join(self.tail)[-1500:]}")
        for future in self.pending.values():
            if not future.done():
                future.set_exception(error)

    async def log(self) -> None:
        while line := await self.proc.stderr.readline():
            self.tail.append(line.decode(errors="replace"))

    async def request(self, **req) -> dict:
        if self.proc.returncode is not None:
            raise RuntimeError(f"the verifiers 0.4 driver exited {self.proc.returncode}: {''.join(self.tail)[-1500:]}")
        self.next += 1
        self.pending[self.next] = future = asyncio.get_running_loop().create_future()
        self.proc.stdin.write((json.dumps({"id": self.next, **req}) + "\n").encode())
        await self.proc.stdin.drain()
        reply = await future
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply


DRIVERS: dict = {}  # (event loop, TOML) -> Driver; the process ends when ours does (its stdin closes)


async def driver(config: str) -> Driver:
    key = (asyncio.get_running_loop(), config)
    if (future := DRIVERS.get(key)) is None:
        DRIVERS[key] = future = key[0].create_future()
        try:
            python = await asyncio.to_thread(install)
            proc = await asyncio.create_subprocess_exec(python, DRIVER, "serve", config, stdin=subprocess.PIPE,
                                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                        env=driver_env(python), limit=2**24)
            future.set_result(Driver(proc))
        except BaseException as e:  # the episodes waiting on it fail with it; the next one tries again
            del DRIVERS[key]
            future.set_exception(e if isinstance(e, Exception) else RuntimeError("starting the driver was cancelled"))
            raise
    return await asyncio.shield(future)


async def close_drivers() -> None:
    """End this event loop's drivers (their stdin closes: each tears its environment down and exits)."""
    loop = asyncio.get_running_loop()
    for key in [k for k in DRIVERS if k[0] is loop]:
        drv = await DRIVERS.pop(key)
        drv.proc.stdin.close()
        await drv.reader


# --- a group: the episodes of one prompt, judged together once the last one has ended

# AgentWorker.run_group starts a group's episodes in one event-loop pass, before any can finish (a rollout waits on
# the driver): every member joins ctx.group_id's entry before its first await, so all have joined before the first
# one ends. The entry goes when the last one ends.
GROUPS: dict[str, dict] = {}


async def judge(group: dict) -> None:
    try:
        if group["runs"]:  # then a member has reached the driver
            reply = await group["driver"].request(op="group", runs=group["runs"])
            group["rewards"] = dict(zip(group["runs"], zip(reply["rewards"], reply["metrics"])))
    except Exception as e:  # every member of the group raises it
        group["error"] = e
    group["judged"].set()


class Verifiers04Agent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        label = ctx.label if isinstance(ctx.label, dict) else {}
        if label.keys() != {"verifiers04", "config"}:
            raise ValueError("this row is no verifiers 0.4 task: use --data.path recipes/verifiers04_agent.py")
        group = GROUPS.setdefault(ctx.group_id, {"running": 0, "runs": [], "judged": asyncio.Event(), "error": None})
        group["running"] += 1
        try:
            group["driver"] = drv = await driver(label["config"])
            run = await drv.request(op="run", task=label["verifiers04"], base_url=ctx.base_url, model=ctx.model)
            group["runs"].append(run["id"])
        finally:  # a failed or timed-out member leaves the group; the last one to end starts the judging
            group["running"] -= 1
            if group["running"] == 0:
                del GROUPS[ctx.group_id]
                group["task"] = asyncio.ensure_future(judge(group))
        await group["judged"].wait()
        if group["error"] is not None:
            raise group["error"]
        reward, metrics = group["rewards"][run["id"]]
        if not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise ValueError(f"the environment gave reward {reward!r} (metrics {metrics}): it must be a finite number")
        return Result(reward=float(reward), info={"metrics": metrics, "env_turns": run["turns"],
                                                  "completion_tokens": run["output_tokens"]})


def make_agent() -> ChatAgent:
    return Verifiers04Agent()
