"""The verifiers 0.4 side of recipes/verifiers04_agent.py: it runs in the environment's own virtualenv, never .venv.

    python recipes/verifiers04_driver.py rows CONFIG    # stdout: one JSON list, the selected tasks as rows
    python recipes/verifiers04_driver.py serve CONFIG   # JSON lines: requests on stdin, answers on stdout

CONFIG is an eval TOML as verifiers' own `eval @ CONFIG` reads one: `[env]` (the taskset, each role's harness,
runtime and limits), `[sampling]` and `[select]`; a taskset id is an installed package or a module in CONFIG's folder.
`serve` builds the environment once and holds its serving resources (shared tool servers, the interception) as
`eval` does, then answers, each request as it comes:
  {"id", "op": "run", "task", "base_url", "model"}: one episode of the task, as verifiers' env server runs one
      (env.slots, env.run_slot), its model calls sent to base_url, the chat server's episode. The answer: the
      episode's one trainable trace (its reward, metrics, turns, output tokens), or the episode's error.
  {"id", "op": "group", "runs": [ids]}: the group's finished episodes judged together: Env.finalize, 0.4's
      cross-agent judgement, over one episode holding every trace of the group. The answer: each run's reward.
Not here: the chat server's side of an episode (recipes/verifiers04_agent.py hands its URL over).
"""
import asyncio
import json
import os
import sys
import tomllib

import verifiers.v1 as vf


def load(path: str) -> tuple[vf.Env, dict]:
    with open(path, "rb") as f:
        config = tomllib.load(f)
    folder = os.path.dirname(os.path.abspath(path))  # a taskset module beside its TOML: importable here, and by the
    sys.path.insert(0, folder)                       # tool servers verifiers starts as `python -m MODULE`
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [folder, os.environ.get("PYTHONPATH")]))
    return vf.load_environment(vf.resolve_env_config(config.get("env", {}))), config


def rows(env: vf.Env, config: dict) -> list[dict]:
    taskset = env.taskset.select(vf.SelectConfig.model_validate(config.get("select", {})))
    if not taskset.bounded:
        raise ValueError(f"{type(taskset).__name__} is infinite: bound it with [select] limit in the TOML")
    out = []
    for task in taskset:
        data, prompt = task.data, task.data.prompt
        first = ([{"role": "user", "content": prompt}] if isinstance(prompt, str) else
                 [m.model_dump(mode="json", exclude_none=True) for m in prompt or []])
        messages = ([{"role": "system", "content": data.system_prompt}] if data.system_prompt else []) + first
        out.append({"messages": messages, "prompt": data.prompt_text,
                    "label": {"verifiers04": data.model_dump(mode="json", exclude_none=True)}})
    return out


class Driver:
    def __init__(self, env: vf.Env, config: dict):
        self.env, self.runs = env, {}  # run id -> (task, its trace)
        self.sampling = vf.SamplingConfig.model_validate(config.get("sampling", {}))
        task_cls = type(env.taskset).task_type()
        self.task = lambda data: task_cls(task_cls.data_type().model_validate(data), env.config.taskset.task)

    async def run(self, req: dict) -> dict:
        """One episode, as verifiers' env server runs a RunRequest; the key is unused: the URL names the episode."""
        task = self.task(req["task"])
        ctx = vf.ModelContext(model=req["model"], sampling=self.sampling, client=vf.EvalClientConfig(
            base_url=req["base_url"], api_key_var="VERBATIM_EPISODE_URL_NAMES_IT"))
        (slot,) = self.env.slots(task)
        episode = await self.env.run_slot(slot, ctx)
        if not episode.ok:
            errors = [e for t in episode.traces for e in t.errors] + episode.errors
            raise RuntimeError(f"the verifiers episode failed: {errors[-1].type}: {errors[-1].message}"
                               if errors else "the verifiers episode failed")
        trained = [t for t in episode.traces if t.agent.trainable]
        if len(trained) != 1:
            raise ValueError(f"the episode ran {len(trained)} trainable agents: each episode must train one (the "
                             "chat server's episode); mark the others untrainable in the Env's setup()")
        self.runs[req["id"]] = (task, trained[0])
        return {"turns": trained[0].num_turns, "output_tokens": trained[0].num_output_tokens}

    async def group(self, req: dict) -> dict:
        (task, _), traces = self.runs[req["runs"][0]], [self.runs.pop(i)[1] for i in req["runs"]]
        episode = vf.Episode(task=vf.TraceTask(type=type(task).__name__, data=task.data), traces=traces)
        await self.env.finalize(task, episode)
        return {"rewards": [t.reward for t in traces], "metrics": [dict(t.metrics) for t in traces]}

    async def answer(self, req: dict, out) -> None:
        try:
            reply = await (self.run(req) if req["op"] == "run" else self.group(req))
        except Exception as e:  # the episode's failure is the answer; the driver serves on
            reply = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps({"id": req["id"], **reply}) + "\n")
        out.flush()

    async def serve(self, out) -> None:
        loop, pending = asyncio.get_running_loop(), set()
        async with self.env.serving():
            while line := await loop.run_in_executor(None, sys.stdin.readline):  # EOF: the agent's process ended
                pending.add(task := asyncio.ensure_future(self.answer(json.loads(line), out)))
                task.add_done_callback(pending.discard)


def main(command: str, path: str) -> None:
    out = os.fdopen(os.dup(1), "w")  # the answers; anything else printed (verifiers, its programs) goes to stderr
    os.dup2(2, 1)
    env, config = load(path)
    if command == "rows":
        out.write(json.dumps(rows(env, config)) + "\n")
    elif command == "serve":
        asyncio.run(Driver(env, config).serve(out))
    else:
        raise ValueError(f"command {command!r}: choose rows or serve")


if __name__ == "__main__":
    main(*sys.argv[1:])
