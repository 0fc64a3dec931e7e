"""Claude Code, the shipped CLI, as a ChatAgent: it trains as it is, through the chat server's Anthropic front end.

An episode runs `claude -p TASK --output-format json` in a fresh working directory seeded with TASK_FILE, HOME a
fresh directory too (no login, no state shared between episodes), pointed at the episode (ANTHROPIC_BASE_URL, its
key, the model name) with every other connection off. Bash runs without permission prompts (IS_SANDBOX=1 lets root
skip them) and without the episode's URL and key (SHELL_PREFIX). A CLI still running after timeout_s is killed and
the episode raises TimeoutError, so launch.py drops and counts it; a CLI that exits with an error raises with its
message. Reward: 1.0 if done.txt exists afterwards.
`CLAUDE_ARGS` (environment) adds CLI arguments to every episode, e.g. the tests' short prompt:
`--system-prompt "You run shell commands." --tools Bash`; unset, the stock prompt and tools are sent.
Not here: installing the CLI (recipes/clis.py), a model that calls tools (tests/tool_model.py).
"""
import asyncio
import json
import os
import shlex
import shutil
import signal
import tempfile

from agent import ChatAgent, ChatContext, Result
from recipes.clis import install

TASK = "List the files here, then create done.txt."
TASK_FILE = "verbatim_task.txt"
# Claude Code runs each Bash command as `$CLAUDE_CODE_SHELL_PREFIX '<script>'`. Without this wrapper the commands
# inherit the episode's URL and key, and whatever they start that speaks Anthropic (an SDK, curl, another claude)
# is sampled on the episode and trained as one of its segments, though the agent never wrote that turn.
SHELL_PREFIX = '#!/bin/sh\nunset ANTHROPIC_BASE_URL ANTHROPIC_API_KEY\nexec bash -c "$1"\n'


def rows(split: str) -> list[dict]:
    return [{"prompt": TASK}] * {"train": 64, "test": 8}[split]


class ClaudeCodeAgent(ChatAgent):
    def __init__(self, claude: str, extra_args: tuple = (), timeout_s: float = 300.0):
        self.claude, self.extra_args, self.timeout_s = claude, tuple(extra_args), timeout_s

    async def run(self, ctx: ChatContext) -> Result:
        work, home = tempfile.mkdtemp(prefix="claude-work-"), tempfile.mkdtemp(prefix="claude-home-")
        try:
            with open(os.path.join(work, TASK_FILE), "w") as f:
                f.write(ctx.messages[-1]["content"] + "\n")
            with open(os.path.join(home, "shell_prefix.sh"), "w") as f:
                f.write(SHELL_PREFIX)
            os.chmod(f.name, 0o700)
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home, "IS_SANDBOX": "1",
                   "ANTHROPIC_BASE_URL": ctx.anthropic_base_url, "ANTHROPIC_API_KEY": ctx.api_key,
                   "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "CLAUDE_CODE_SHELL_PREFIX": f.name}
            argv = [self.claude, "-p", ctx.messages[-1]["content"], "--output-format", "json", "--model", ctx.model,
                    "--dangerously-skip-permissions", "--no-session-persistence", *self.extra_args]
            proc = await asyncio.create_subprocess_exec(*argv, cwd=work, env=env, stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.PIPE, start_new_session=True)
            try:
                out, err = await asyncio.wait_for(proc.communicate(), self.timeout_s)
            finally:
                if proc.returncode is None:   # timed out or cancelled: the CLI and its shells must not outlive us
                    os.killpg(proc.pid, signal.SIGKILL)
                    await proc.wait()
            report = json.loads(out) if out.strip().startswith(b"{") else {}
            if proc.returncode != 0 or report.get("is_error", True):
                raise RuntimeError(f"claude exited {proc.returncode}: {report.get('result') or err.decode()[-500:]}")
            return Result(reward=float(os.path.exists(os.path.join(work, "done.txt"))),
                          info={"claude_turns": float(report.get("num_turns", 0))})
        finally:
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(home, ignore_errors=True)


def make_agent() -> ChatAgent:
    claude = install(names=("claude",))["claude"]
    return ClaudeCodeAgent(claude, shlex.split(os.environ.get("CLAUDE_ARGS", "")))
