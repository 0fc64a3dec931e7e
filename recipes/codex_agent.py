"""OpenAI's Codex CLI as a ChatAgent: the shipped binary (`codex exec`) trains as it is, through the chat server.

    agent = CodexAgent(binary)       # make_agent() installs the pinned CLI (recipes/clis.py); stock prompt
    result = await agent.run(ctx)    # Result(reward=1.0 if done.txt exists when Codex exits)

Per episode: a fresh working directory seeded with TASK_FILE, a fresh CODEX_HOME whose config.toml names one model
provider, the episode (ctx.base_url, the Responses API, the key from an environment variable), then `codex exec --json`
in that directory. Codex runs its shell tool (exec_command) itself; its sandbox may write only there. Past timeout_s
the process group is killed and the episode raises (launch.py drops it and counts it); so does a non-zero exit.
Analytics and plugins are off, so the episode's URL is the only host Codex contacts. Codex resends its whole history
each turn (our reasoning handles included), so an episode is one segment. minimal=True shrinks the ~40 KB request to
~4 KB (own instructions; no skills, permissions or environment blocks; only the two shell tools):
the tests use it (CODEX_MINIMAL=1 in the environment makes make_agent() use it), measurements use the stock request.
Not here: installing the CLI (recipes/clis.py), training (launch.py); recipes/codex.sh runs both.
"""
import asyncio
import json
import os
import signal
import subprocess
import tempfile

from agent import ChatAgent, ChatContext, Result
from recipes.clis import install

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TASK = "List the files here, then create done.txt."
TASK_FILE = "verbatim_task.txt"
KEY_ENV = "VERBATIM_API_KEY"
# Without these two, Codex contacts chatgpt.com, ab.chatgpt.com, github.com and api.github.com at start-up.
QUIET = "[analytics]\nenabled = false\n[features]\nplugins = false\n"
MINIMAL = """model_instructions_file = {instructions}
include_permissions_instructions = false
include_environment_context = false
include_apps_instructions = false
web_search = "disabled"
[agents]
enabled = false
[skills]
include_instructions = false
[skills.bundled]
enabled = false
[analytics]
enabled = false
[features]
plugins = false
goals = false
view_image = false
[tools.experimental_request_user_input]
enabled = false
"""
INSTRUCTIONS = "You are Codex, a coding agent in a terminal. Run shell commands with exec_command.\n"


def rows(split: str) -> list[dict]:
    return [{"prompt": TASK}] * {"train": 64, "test": 8}[split]


def codex_config(base_url: str, model: str, home: str, minimal: bool) -> str:
    """config.toml for one episode (TOML basic strings read JSON's escapes, hence json.dumps)."""
    if minimal:
        with open(os.path.join(home, "instructions.md"), "w") as f:
            f.write(INSTRUCTIONS)
    head = MINIMAL.format(instructions=json.dumps(os.path.join(home, "instructions.md"))) if minimal else QUIET
    return (f"model = {json.dumps(model)}\nmodel_provider = \"verbatim\"\n{head}[model_providers.verbatim]\n"
            f"name = \"verbatim\"\nbase_url = {json.dumps(base_url)}\nwire_api = \"responses\"\n"
            f"env_key = \"{KEY_ENV}\"\n")


class CodexAgent(ChatAgent):
    def __init__(self, binary: str, *, timeout_s: float = 300.0, minimal: bool = False,
                 sandbox: str = "workspace-write"):
        self.binary, self.timeout_s, self.minimal, self.sandbox = binary, timeout_s, minimal, sandbox

    async def run(self, ctx: ChatContext) -> Result:
        with tempfile.TemporaryDirectory(prefix="codex-") as root:
            home, work = os.path.join(root, "home"), os.path.join(root, "work")
            os.makedirs(home), os.makedirs(work)
            with open(os.path.join(work, TASK_FILE), "w") as f:
                f.write(ctx.messages[-1]["content"] + "\n")
            with open(os.path.join(home, "config.toml"), "w") as f:
                f.write(codex_config(ctx.base_url, ctx.model, home, self.minimal))
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home, "CODEX_HOME": home,
                   KEY_ENV: ctx.api_key}
            events = await self.codex(ctx.messages[-1]["content"], work, env)
            commands = sum(e.get("item", {}).get("type") == "command_execution" for e in events
                           if e.get("type") == "item.completed")
            done = os.path.exists(os.path.join(work, "done.txt"))
        return Result(reward=float(done), info={"codex_commands": float(commands)})

    async def codex(self, prompt: str, work: str, env: dict) -> list[dict]:
        """Run `codex exec --json` to its end; its JSONL events. Its own session: a kill takes its shells too."""
        proc = await asyncio.create_subprocess_exec(
            self.binary, "exec", "--json", "--skip-git-repo-check", "--ephemeral", "-s", self.sandbox, prompt,
            cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), self.timeout_s)
        finally:
            if proc.returncode is None:   # timed out or cancelled: Codex and its shells must not outlive us
                os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
        events = [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]
        if proc.returncode != 0:
            failed = [e for e in events if e.get("type") in ("error", "turn.failed")]
            raise RuntimeError(f"codex exec exited {proc.returncode}: {failed[-1:] or err.decode()[-500:]}")
        return events


def make_agent() -> ChatAgent:
    codex = install(os.path.join(ROOT, ".agents", "cli"), ("codex",))["codex"]
    return CodexAgent(codex, minimal=os.environ.get("CODEX_MINIMAL") == "1")
